"""The attention backends `flashtile bench` compares, and how each is set up for a case.

A backend is a name and `setup(case, inputs) -> Prepared`. Setup does everything that must stay out of the
timed region: imports, layout changes ((B, S, H, D) → contiguous (B, H, S, D) for SDPA and Flex), paging the
KV cache, block masks, torch.compile. It returns the timed callable. A backend that cannot run a case raises
`Unsupported` with the reason, which the report prints instead of a time; a backend that is not installed is
unsupported, not an error.

    backend         fwd/fwdbwd            decode                         varlen/varlenbwd
    flashtile       flash_attn_func       flash_attn_with_kvcache        flash_attn_varlen_func
    fa4             flash_attn.cute       dense or paged (page_table)    varlen func (cu_seqlens)
    fa2             flash_attn            with_kvcache, pages of 256·n   varlen func
    sdpa-*          forced SDPBackend     contiguous cache, enable_gqa   nested jagged tensors (math: a loop)
    flex            compiled flex         contiguous cache               document block mask

The backward modes (fwdbwd, varlenbwd) go through each backend's autograd from the same random dout; a backend
whose backward raises NotImplementedError for the case is reported unsupported, like a missing feature. A case
with dropout_p > 0 runs on the backends that take dropout (flashtile, fa2, SDPA's flash, efficient and math).
Learnable sinks run on flashtile and FlashAttention-4 (its `learnable_sink`); the others refuse them. A
v head dim other than q's is given to every backend but fa2, which has none; those that cannot take it (SDPA's
flash kernel, say) refuse it themselves, and the row says what they said. An absorbed MLA decode cache is passed
as it is, v_cache a view of k_cache; a backend that needs its own layout copies it in setup, untimed.

What this module does not do: time, check numerics, or rank backends (run.py, refcheck.py, report.py).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashtile.bench.cases import Case
from flashtile.bench.inputs import Inputs, paginate

# SDPA's math backend materialises (B, H, Sq, Sk) scores and probabilities, and their gradients in fwdbwd:
# 2^28 elements is 512 MiB each in bf16, where the sweep's smallest cases sit.
MATH_MAX_SCORES = 2**28


class Unsupported(Exception):
    """The backend cannot run this case; the message says why."""


@dataclass
class Prepared:
    run: Callable[[], object]  # the timed region: the forward, or forward + backward (fwdbwd, varlenbwd)
    output: Callable[[], torch.Tensor]  # forward output in flashtile's layout, for --refcheck (not timed)
    leaves: tuple[torch.Tensor, ...] = ()  # tensors whose .grad the timer clears between repetitions


@dataclass(frozen=True)
class Backend:
    name: str
    setup: Callable[[Case, Inputs], Prepared]
    description: str
    cpu: bool = False  # runs without CUDA too: flashtile via the Triton interpreter, SDPA's math backend


def _prepare(case, fwd, q, buffers, dout=None, to_flash=lambda o: o) -> Prepared:
    """The timed call for `fwd(q, *buffer) -> output in the backend's layout`.

    fwdbwd and varlenbwd run forward then backward from leaves made here; backward frees the graph and the
    timer clears the gradients, so no repetition inherits anything from the last. Other modes time the forward
    alone, rotating through the buffers (there are several only in decode; see inputs.py).
    """
    if case.backward:
        ((k, v),) = buffers
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        return Prepared(lambda: fwd(q, k, v).backward(dout), lambda: to_flash(fwd(q, k, v)), (q, k, v))
    rotation = itertools.cycle(buffers)
    return Prepared(lambda: fwd(q, *next(rotation)), lambda: to_flash(fwd(q, *buffers[0])))


def _api(module: str, *names: str):
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # a broken install (missing CUDA libraries, ABI) is as unusable as an absent one
        raise Unsupported(f"{module} not importable ({type(e).__name__})") from e
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        raise Unsupported(f"{module} has no {', '.join(missing)}")
    return [getattr(mod, n) for n in names]


def _paged(case: Case, inputs: Inputs):
    return [paginate(k, v, case.page_size) for k, v in inputs.kv]


def _refuse_sink(case: Case, name: str) -> None:
    if case.sink:
        raise Unsupported(f"learnable sinks not wired up for {name}")


def _fa2_refuse(case: Case) -> None:
    """What flash-attn 2 has no kernel for."""
    if case.sink:
        raise Unsupported("FlashAttention-2 has no learnable sinks")
    if case.dv != case.headdim:
        raise Unsupported("FlashAttention-2 needs v's head dim equal to q's")
    if case.headdim > 256:
        raise Unsupported("FlashAttention-2 supports head dims up to 256")


def _flash_api(module: str, page_multiple: int = 1, refuse: Callable[[Case], None] | None = None):
    """flashtile and FlashAttention-2, which share flash-attn 2.8's API; `refuse(case)` raises Unsupported for
    what the library cannot run (flashtile runs every case)."""

    def setup(case: Case, inputs: Inputs) -> Prepared:
        if refuse is not None:
            refuse(case)
        kw = {"causal": case.causal, "window_size": case.window_size, "softcap": case.softcap}
        if case.dropout_p:
            kw["dropout_p"] = case.dropout_p
        if case.sink:
            kw["learnable_sink"] = inputs.sink
        if case.mode == "decode":
            (fn,) = _api(module, "flash_attn_with_kvcache")
            if case.page_size % page_multiple:
                raise Unsupported(f"paged KV needs a page size that is a multiple of {page_multiple}")
            kw.update(cache_seqlens=inputs.cache_seqlens, num_splits=0)  # 0: the library's split-KV heuristic
            if case.page_size:
                paged = lambda q, k, v, block_table: fn(q, k, v, block_table=block_table, **kw)
                return _prepare(case, paged, inputs.q, _paged(case, inputs))
            return _prepare(case, lambda q, k, v: fn(q, k, v, **kw), inputs.q, inputs.kv)
        if case.varlen:
            (fn,) = _api(module, "flash_attn_varlen_func")
            cu, n = inputs.cu_seqlens, case.seqlen_q
            varlen = lambda q, k, v: fn(q, k, v, cu, cu, n, n, **kw)
            return _prepare(case, varlen, inputs.q, inputs.kv, inputs.dout)
        (fn,) = _api(module, "flash_attn_func")
        return _prepare(case, lambda q, k, v: fn(q, k, v, **kw), inputs.q, inputs.kv, inputs.dout)

    return setup


def _setup_fa4(case: Case, inputs: Inputs) -> Prepared:
    """FlashAttention-4 (CuTe DSL): an unbounded window side is None rather than -1; it returns (out, lse)."""
    if case.dropout_p:
        raise Unsupported("FlashAttention-4 has no dropout")
    func, varlen_func = _api("flash_attn.cute", "flash_attn_func", "flash_attn_varlen_func")
    kw = {"causal": case.causal, "window_size": tuple(None if w < 0 else w for w in case.window_size)}
    if case.softcap:
        kw["softcap"] = case.softcap
    if case.sink:  # FA4's own keyword (gpt-oss); a build whose kernels lack it fails the case, as a row says
        kw["learnable_sink"] = inputs.sink
    cu, n = inputs.cu_seqlens, case.seqlen_q

    def dense(q, k, v):
        return func(q, k, v, **kw)[0]

    def paged(q, k, v, page_table):
        return varlen_func(q, k, v, page_table=page_table, seqused_k=inputs.cache_seqlens, **kw)[0]

    def varlen(q, k, v):
        return varlen_func(q, k, v, cu, cu, max_seqlen_q=n, max_seqlen_k=n, **kw)[0]

    if case.mode == "decode":
        kw["num_splits"] = 0  # < 1: FA4's split-KV heuristic; its default, 1, leaves most SMs idle in decode
        if case.page_size:
            return _prepare(case, paged, inputs.q, _paged(case, inputs))
        if case.cache_lengths:
            raise Unsupported("per-sequence cache lengths wired up only for paged caches (seqused_k)")
        return _prepare(case, dense, inputs.q, inputs.kv)
    if case.varlen:
        return _prepare(case, varlen, inputs.q, inputs.kv, inputs.dout)
    return _prepare(case, dense, inputs.q, inputs.kv, inputs.dout)


def _to_bhsd(t):
    return None if t is None else t.transpose(1, 2).contiguous()


def _sdpa_causal(case: Case) -> dict:
    """SDPA's is_causal aligns the mask top-left; flash-attn's (and so the bench's) aligns it bottom-right."""
    if not case.causal or case.seqlen_q == 1:  # a lone query row sees every key under bottom-right alignment
        return {}
    if case.seqlen_q == case.seqlen_k:
        return {"is_causal": True}
    from torch.nn.attention.bias import causal_lower_right

    return {"attn_mask": causal_lower_right(case.seqlen_q, case.seqlen_k)}


def _sdpa(kernel_name: str):
    """torch's scaled_dot_product_attention with one backend forced: fails rather than falls back."""

    def setup(case: Case, inputs: Inputs) -> Prepared:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kernel = getattr(SDPBackend, kernel_name)
        if case.window_size != (-1, -1) or case.softcap:
            raise Unsupported("SDPA has no sliding window or softcap")
        if case.page_size:
            raise Unsupported("SDPA has no paged KV cache")
        if case.cache_lengths:
            raise Unsupported("SDPA has no per-sequence cache lengths")
        if case.sink:
            raise Unsupported("SDPA has no learnable sinks")
        per_head = sum(n * n for n in case.seqlens) or case.batch * case.seqlen_q * case.seqlen_k
        scores = case.nheads * per_head
        if kernel == SDPBackend.MATH and scores > MATH_MAX_SCORES:
            raise Unsupported(f"math backend only up to {MATH_MAX_SCORES:.2g} scores")
        kw = {"enable_gqa": True} if case.nheads_kv != case.nheads else {}
        if case.dropout_p:
            if kernel == SDPBackend.CUDNN_ATTENTION:
                raise Unsupported("dropout not wired up for the cuDNN backend")
            kw["dropout_p"] = case.dropout_p

        def fwd(q, k, v, **extra):
            with sdpa_kernel(kernel):
                return F.scaled_dot_product_attention(q, k, v, **(kw | extra))

        if case.varlen and kernel == SDPBackend.MATH:
            return _prepare(case, _per_sequence(fwd, case.seqlens, kw.get("enable_gqa", False), case.causal),
                            inputs.q, inputs.kv, inputs.dout)
        if case.varlen:
            if case.nheads_kv != case.nheads:
                raise Unsupported("SDPA on nested tensors has no GQA")
            # torch logs a paragraph per refused nested-tensor kernel on every call; the row already says why.
            logging.getLogger("torch.nested._internal.sdpa").setLevel(logging.ERROR)
            kw["is_causal"] = case.causal
            offsets = inputs.cu_seqlens.long()

            def nested(t):  # (total, H, D) → jagged (n, H, j, D)
                return torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2)

            kv = [(nested(inputs.k), nested(inputs.v))]
            dout = None if inputs.dout is None else nested(inputs.dout)
            return _prepare(case, fwd, nested(inputs.q), kv, dout, lambda o: o.transpose(1, 2).values())
        kw.update(_sdpa_causal(case))
        kv = [(_to_bhsd(k), _to_bhsd(v)) for k, v in inputs.kv]
        return _prepare(case, fwd, _to_bhsd(inputs.q), kv, _to_bhsd(inputs.dout), lambda o: o.transpose(1, 2))

    return setup


def _per_sequence(fwd, seqlens, enable_gqa: bool, causal: bool):
    """A packed (total, H, D) batch through dense SDPA one sequence at a time, for the math backend: its nested-tensor
    path takes no causal mask ("No viable backend"), and as a reference it need not be fast. Each sequence is
    square, so SDPA's top-left is_causal is the bench's bottom-right mask."""
    kw = {"enable_gqa": enable_gqa, "is_causal": causal}

    def run(q, k, v):
        outs, start = [], 0
        for n in seqlens:
            q_s, k_s, v_s = (t[start:start + n].transpose(0, 1)[None] for t in (q, k, v))  # (1, H, n, D)
            outs.append(fwd(q_s, k_s, v_s, **kw)[0].transpose(0, 1))
            start += n
        return torch.cat(outs)

    return run


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Each case is a new shape and so a recompile. Past dynamo's limit (8 by default) it silently runs
    # flex_attention eagerly, which materialises the scores: the rows would time that instead.
    limits = ("recompile_limit", "cache_size_limit",  # the names vary across torch versions
              "accumulated_recompile_limit", "accumulated_cache_size_limit")
    for name in limits:
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 4096)
    return torch.compile(flex_attention, dynamic=False)


def _setup_flex(case: Case, inputs: Inputs) -> Prepared:
    from torch.nn.attention.flex_attention import create_block_mask

    if case.dropout_p:
        raise Unsupported("FlexAttention has no dropout")
    if case.page_size:
        raise Unsupported("paged KV not wired up for Flex")
    if case.cache_lengths:
        raise Unsupported("per-sequence cache lengths not wired up for Flex")
    _refuse_sink(case, "Flex")
    left, right = case.window_size
    right = 0 if case.causal else right
    offset = case.seqlen_k - case.seqlen_q  # bottom-right alignment
    keep = []
    if case.varlen:  # the packed batch as one sequence, with attention kept inside each document
        offset = 0
        lengths = torch.tensor(case.seqlens, device=inputs.q.device)
        doc = torch.repeat_interleave(torch.arange(len(case.seqlens), device=inputs.q.device), lengths)
        keep.append(lambda q, kv: doc[q] == doc[kv])
    if right >= 0:
        keep.append(lambda q, kv: kv <= q + offset + right)
    if left >= 0:
        keep.append(lambda q, kv: kv >= q + offset - left)

    def mask_mod(b, h, q_idx, kv_idx):
        return functools.reduce(torch.logical_and, (cond(q_idx, kv_idx) for cond in keep))

    def score_mod(score, b, h, q_idx, kv_idx):
        return case.softcap * torch.tanh(score / case.softcap)

    packed = case.varlen

    def layout(t):  # (B, S, H, D) → (B, H, S, D); varlen's (total, H, D) → (1, H, total, D)
        return (t.unsqueeze(0) if packed else t).transpose(1, 2).contiguous()

    def to_flash(o):
        return o[0].transpose(0, 1) if packed else o.transpose(1, 2)

    q = layout(inputs.q)
    kw = {"enable_gqa": case.nheads_kv != case.nheads, "score_mod": score_mod if case.softcap else None}
    if keep:
        seqlen_q, seqlen_k = q.shape[-2], inputs.k.shape[-3]
        kw["block_mask"] = create_block_mask(mask_mod, None, None, seqlen_q, seqlen_k, device=q.device)
    flex = _compiled_flex()
    kv = [(layout(k), layout(v)) for k, v in inputs.kv]
    dout = None if inputs.dout is None else layout(inputs.dout)
    return _prepare(case, lambda q, k, v: flex(q, k, v, **kw), q, kv, dout, to_flash)


BACKENDS = {
    b.name: b
    for b in (
        Backend("flashtile", _flash_api("flashtile"), "flashtile (this package)", cpu=True),
        Backend("fa4", _setup_fa4, "FlashAttention-4, flash_attn.cute"),
        Backend("fa2", _flash_api("flash_attn", page_multiple=256, refuse=_fa2_refuse),
                "FlashAttention-2, flash_attn"),
        Backend("sdpa-cudnn", _sdpa("CUDNN_ATTENTION"), "torch SDPA, cuDNN backend"),
        Backend("sdpa-flash", _sdpa("FLASH_ATTENTION"), "torch SDPA, its FlashAttention-2 backend"),
        Backend("sdpa-efficient", _sdpa("EFFICIENT_ATTENTION"), "torch SDPA, memory-efficient backend"),
        Backend("sdpa-math", _sdpa("MATH"), "torch SDPA, unfused math backend (small cases only)", cpu=True),
        Backend("flex", _setup_flex, "FlexAttention, torch.compile(flex_attention)"),
    )
}
