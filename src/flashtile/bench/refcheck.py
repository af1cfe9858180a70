"""--refcheck: each backend's forward output against flashtile.testing's fp64 reference, before it is timed.

The reference is computed on a slice of the problem: batches {0, B−1} and the query heads of KV heads {0,
Hk−1} (varlen: its first and last sequences), narrowed to one batch and one KV head's group when that slice
would hold more than REF_MAX_SCORES scores. So a 16k-token case checks in milliseconds and a few GB, and both
ends of the batch and head ranges are looked at. A backend passes by the rule the tests use
(flashtile.testing.check_close): max |out − ref| ≤ FACTOR · max |PyTorch's same math in the input dtype − ref|
+ a rounding-sized atol. A failure is reported as MISMATCH beside the backend's time; it does not stop the run
or hide the row. Sinks (the checked heads' own logits) and a v head dim of its own go to the reference as they
go to the backends; an absorbed MLA cache's v is already the view of its k.

What this module does not do: run backends (run.py) or check gradients (the test suite does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashtile.bench.cases import Case
from flashtile.bench.inputs import Inputs

# The reference materialises a few fp64 (slice, Sq, Sk) arrays: 2^28 scores is 2 GiB each, which admits one
# head of the standard sweep's longest case (16k × 16k).
REF_MAX_SCORES = 2**28
FACTOR = 2  # flash-attn's factor for the forward output


@dataclass
class Reference:
    parts: list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]]  # (output slicer, fp64 ref)
    bound: float  # largest max-abs error that passes


@dataclass(frozen=True)
class Verdict:
    ok: bool
    err: float
    bound: float

    def __str__(self) -> str:
        return "ok" if self.ok else f"MISMATCH {self.err:.1e}>{self.bound:.1e}"


def _slices(case: Case):
    """Batch (or sequence) indices and query / KV heads to check; None when even the smallest is too big."""
    group = case.nheads // case.nheads_kv
    n = len(case.seqlens) or case.batch
    for batches, kv_heads in (({0, n - 1}, {0, case.nheads_kv - 1}), ({0}, {0})):
        batches, kv_heads = sorted(batches), sorted(kv_heads)
        q_heads = [h for j in kv_heads for h in range(j * group, (j + 1) * group)]
        per_head = (sum(case.seqlens[b] ** 2 for b in batches) if case.seqlens
                    else case.seqlen_q * sum(case.cache_lengths[b] for b in batches) if case.cache_lengths
                    else len(batches) * case.seqlen_q * case.seqlen_k)
        if per_head * len(q_heads) <= REF_MAX_SCORES:
            return batches, q_heads, kv_heads
    return None


def _sequence(s: slice):
    return lambda t: t[s].unsqueeze(0)  # one packed sequence (n, H, D) as a batch of one (1, n, H, D)


def _batches(idx: torch.Tensor):
    return lambda t: t[idx]


def build_reference(case: Case, inputs: Inputs) -> Reference | None:
    """The fp64 reference on a slice of the case; None when the smallest slice is too large to compute."""
    from flashtile.testing import attention_ref, rounding_atol

    slices = _slices(case)
    if slices is None or case.dropout_p:  # each backend draws its own mask: outputs differ by design
        return None
    batches, q_heads, kv_heads = slices
    kw = {"causal": case.causal, "window_size": case.window_size, "softcap": case.softcap}
    q_idx = torch.tensor(q_heads, device=inputs.q.device)
    if case.sink:
        kw["learnable_sink"] = inputs.sink[q_idx]
    kv_idx = torch.tensor(kv_heads, device=inputs.q.device)
    keys = [None] * len(batches)  # how many cached keys each selection sees; None: all
    if case.seqlens:
        cu = inputs.cu_seqlens.tolist()
        selects = [_sequence(slice(cu[b], cu[b + 1])) for b in batches]
    elif case.cache_lengths:  # mixed decode: each sequence against its own cache length
        selects = [_batches(torch.tensor([b], device=inputs.q.device)) for b in batches]
        keys = [case.cache_lengths[b] for b in batches]
    else:
        selects = [_batches(torch.tensor(batches, device=inputs.q.device))]
        keys = keys[:1]
    parts, base_err, atol = [], 0.0, 0.0
    for select, n in zip(selects, keys):
        q = select(inputs.q)[:, :, q_idx]
        k, v = select(inputs.k)[:, :n, kv_idx], select(inputs.v)[:, :n, kv_idx]
        ref, _ = attention_ref(q.double(), k.double(), v.double(), **kw)
        low, _ = attention_ref(q, k, v, upcast=False, **kw)
        base_err = max(base_err, (low.double() - ref).abs().max().item())
        atol = max(atol, rounding_atol(ref, q.dtype))
        parts.append((lambda out, select=select: select(out)[:, :, q_idx], ref))
    return Reference(parts, FACTOR * base_err + atol)


def check(ref: Reference, out: torch.Tensor) -> Verdict:
    """Compare a backend's full forward output (flashtile layout) with the reference slices; NaN fails."""
    err = max((select(out).double() - expected).abs().max().item() for select, expected in ref.parts)
    return Verdict(err <= ref.bound, err, ref.bound)
