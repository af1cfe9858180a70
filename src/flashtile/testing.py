"""Test support: an fp64 reference, NaN-guarded input generators and flash-attn's tolerance rule.

Shipped with the package so that the tests, `flashtile demo` and `flashtile bench --refcheck` judge results the
same way. Nothing here runs a Triton kernel.
"""

from __future__ import annotations

import inspect
import math

import torch


def visible_mask(seqlen_q: int, seqlen_k: int, window_left: int, window_right: int, device=None,
                 attention_chunk: int = 0) -> torch.Tensor:
    """(Sq, Sk) bool: query i sees key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right (-1: unbounded), and
    with attention_chunk > 0 iff j lies in the chunk of attention_chunk keys that i + Sk - Sq falls in."""
    i = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_right >= 0:
        visible &= j <= i + window_right
    if window_left >= 0:
        visible &= j >= i - window_left
    if attention_chunk > 0:
        visible &= torch.div(j, attention_chunk, rounding_mode="floor") == torch.div(i, attention_chunk,
                                                                                     rounding_mode="floor")
    return visible


def attention_ref(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                  softmax_scale=None, upcast=True, return_probs=False, dropout_mask=None, dropout_p=0.0,
                  learnable_sink=None, attention_chunk=0):
    """Attention computed the plain way. q/k (B, Sq or Sk, H or Hk, D), v (B, Sk, Hk, Dv); returns (out, lse), and the
    probabilities P (B, H, Sq, Sk) too with return_probs (for accumulation_floor).

    dropout_mask (B, H, Sq, Sk), bool (e.g. `S_dmask >= 0` of the call under test, cropped): P becomes
    P * mask / (1 - dropout_p) before it multiplies v (flash-attn 2's dropout); lse is the undropped softmax's, and
    the returned probabilities are the dropped ones.

    learnable_sink (H,): one more logit per row, of no value, in every row's softmax (its lse includes it); a row
    that sees no key then gives out 0 and lse = sink. Differentiable like q, k and v.

    upcast=True computes in float64 (the oracle); upcast=False computes in the input dtype, which is the
    "PyTorch doing the same math" baseline of the tolerance rule. out has q's dtype; lse (B, H, Sq) is float64 for
    the oracle and float32 otherwise, +inf for rows that see no key (flash-attn's convention).
    """
    dtype = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if nheads != nheads_kv:
        k = k.repeat_interleave(nheads // nheads_kv, dim=2)
        v = v.repeat_interleave(nheads // nheads_kv, dim=2)
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = (-1 if w is None else w for w in window_size)
    if causal:
        right = 0
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(scores.dtype).reshape(-1, nheads)[:, :, None, None]  # (1 or B, H, 1, 1)
        i = torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)
        j = torch.arange(seqlen_k, device=q.device)[None, :]
        scores = scores - slopes * (i - j).abs().to(scores.dtype)
    visible = visible_mask(seqlen_q, seqlen_k, left, right, q.device, attention_chunk)
    scores = scores.masked_fill(~visible, float("-inf"))
    if learnable_sink is not None:
        sink = learnable_sink.to(scores.dtype).view(1, nheads, 1, 1).expand(batch, nheads, seqlen_q, 1)
        scores = torch.cat([scores, sink], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    attn = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key -> 0
    if learnable_sink is not None:
        attn = attn[..., :seqlen_k]
    if dropout_mask is not None:
        attn = attn.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
    out = torch.einsum("bhts,bshd->bthd", attn, v)
    # The oracle's LSE stays in float64: rounded to float32 it would differ from PyTorch's own float32 LSE by
    # nothing and from the kernels' by an ulp, a verdict decided by rounding.
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    lse = lse if upcast else lse.float()
    if return_probs:
        return out.to(dtype), lse, attn
    return out.to(dtype), lse


# Scalar arguments of the custom ops whose value switches a feature off (op_args fills them in).
_OFF = dict(window_left=-1, window_right=-1, attention_chunk=0, softcap=0.0, dropout_p=0.0, packing=0)


def op_args(op, **named) -> tuple:
    """The positional arguments of a flashtile custom op (or of any function, e.g. ops.call.op_problem) from their
    names: optional tensors not named are None, and the feature scalars not named are off (_OFF). So a call site
    in a test or tool names what it uses and survives a new input or feature of the op."""
    params = inspect.signature(getattr(op, "impl", op)).parameters
    args = []
    for name, param in params.items():
        if name in named:
            args.append(named.pop(name))
        elif name in _OFF:
            args.append(_OFF[name])
        elif "Optional" in str(param.annotation) or param.default is None:
            args.append(None)
        elif param.default is not inspect.Parameter.empty:
            break
        else:
            raise TypeError(f"{getattr(op, '__name__', op)} needs {name!r}")
    if named:
        raise TypeError(f"{getattr(op, '__name__', op)} takes no {sorted(named)}")
    return tuple(args)


def accumulation_floor(q, k, v, dout, out, probs, softmax_scale=None) -> dict:
    """Entry-wise floors for the tolerance rule: 2 fp32 epsilons times the magnitude of the terms that each entry of
    out, dq, dk and dv sums (q, k, v, dout as attention_ref takes them, out and probs the fp64 reference's).

    The kernels accumulate in fp32 whatever the input dtype, and their backward computes dS = P (dP - delta) with
    delta = rowsum(dO * O), where PyTorch's softmax backward cancels exactly when a row sees one key: there
    PyTorch's error is 0, the rule's 2x / 3x term vanishes, and what is left is the rounding of the kernel's own
    sums, which depends on their order (under the interpreter, on the CPU's BLAS). Every order obeys
    |error| <= n eps sum |terms| (Higham, Accuracy and Stability of Numerical Algorithms, 3.1), so a floor in
    units of sum |terms| gives the same verdict on any machine; 2 eps of it is far below that bound and far below
    the rounding atol of fp16/bf16 results, so it matters only for fp32 inputs. The magnitudes, per (b, h):
    out: P |V|;  dS: P * (|dO| |V|^T + rowsum(|dO| |O|));  dq: scale |dS| |K|;  dk: scale |dS|^T |Q|;
    dv: P^T |dO| (dk and dv summed over each KV head's query heads); lse (B, H, Sq): twice the largest visible
    scale |q_i| |k_j| plus log Sk, which bounds the largest score and |lse| (a log-sum-exp is as accurate as
    its largest term).
    """
    eps = torch.finfo(torch.float32).eps
    q, k, v, dout, out = (t.detach().double().abs() for t in (q, k, v, dout, out))
    nheads, nheads_kv, head_dim = q.shape[2], k.shape[2], q.shape[3]
    group = nheads // nheads_kv
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    p = probs.double()
    ds = p * (torch.einsum("bthd,bshd->bhts", dout, v) + (dout * out).sum(-1).transpose(1, 2)[..., None])
    mags = {"out": torch.einsum("bhts,bshd->bthd", p, v),
            "dq": scale * torch.einsum("bhts,bshd->bthd", ds, k),
            "dk": scale * torch.einsum("bhts,bthd->bshd", ds, q),
            "dv": torch.einsum("bhts,bthd->bshd", p, dout)}
    for name in ("dk", "dv"):
        b, s, _, d = mags[name].shape
        mags[name] = mags[name].reshape(b, s, nheads_kv, group, d).sum(3)
    # |lse_i| <= max_j |s_ij| + log(Sk): the rounding of the largest score, and of the log, bound its error.
    terms = torch.where(p > 0, scale * torch.einsum("bthd,bshd->bhts", q, k), 0.0)
    largest = terms.amax(-1) if terms.shape[-1] else terms.sum(-1)
    mags["lse"] = 2 * largest + math.log(max(k.shape[1], 1))
    return {name: 2 * eps * m for name, m in mags.items()}


def rounding_atol(ref: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> float:
    """flash-attn's rounding-size atol: twice the error of adding and subtracting 0.3 in `dtype`; floored at
    2 epsilons of `scale`, the magnitude of the problem's values, for references that are exactly zero by
    cancellation (dq and dk when every query sees a single key) but are computed from O(scale) terms."""
    r = ref.to(dtype)
    fa = 2 * ((r + 0.3 - 0.3) - r).abs().max().item() if r.numel() else 0.0
    return max(fa, 2 * torch.finfo(dtype).eps * scale)


def check_close(name: str, ours: torch.Tensor, ref: torch.Tensor, baseline: torch.Tensor, factor: float,
                scale: float = 1.0, floor=None) -> None:
    """Assert |ours - ref| <= factor * max|baseline - ref| + rounding atol (+ floor, entry-wise: see
    accumulation_floor) at every entry (ref is the fp64 oracle)."""
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    ours, ref, baseline_d = ours.double(), ref.double(), baseline.double()
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(ours), finite), f"{name}: non-finite entries differ from the reference"
    assert torch.equal(ours[~finite], ref[~finite]), f"{name}: infinite entries differ from the reference"
    if not finite.any():
        return
    diff = (ours - ref)[finite].abs()
    base = (baseline_d - ref)[finite].abs().max().item()
    tol = factor * base + rounding_atol(ref[finite], baseline.dtype, scale)
    extra = floor.double().expand_as(ref)[finite] if floor is not None else torch.zeros_like(diff)
    excess = diff - (tol + extra)
    worst = int(excess.argmax())
    assert excess[worst] <= 0, (f"{name}: error {diff[worst]:.3e} > {factor} x PyTorch error {base:.3e} + atol "
                                f"(= {tol:.3e}) + accumulation floor {extra[worst]:.3e}; max error {diff.max():.3e}")


def nan_guarded(shape, dtype, device="cpu", generator=None, pad_last: int = 8) -> torch.Tensor:
    """Random normal tensor carved out of a larger NaN-filled buffer (the guard bands sit around every row and
    past the end), so any out-of-bounds read in a kernel turns into NaN in its output. Strides are not the
    contiguous ones; the last dim keeps unit stride."""
    padded = list(shape)
    padded[-1] += pad_last
    if len(shape) >= 2:
        padded[-2] += 1
    buf = torch.full([2] + padded, float("nan"), dtype=dtype, device=device)
    view = buf[(1,) + tuple(slice(0, n) for n in shape)]
    view.copy_(torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype))
    return view


def cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    """The int32 cumulative offsets [0, l0, l0 + l1, ...] of a packed batch of these lengths."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def varlen_inputs(device, lens_q, lens_k, nheads=4, nheads_kv=2, head_dim=32, dtype=torch.float16, seed=0):
    """A packed batch of sequences lens_q x lens_k: NaN-guarded q (sum lens_q, nheads, head_dim), k and v (sum
    lens_k, nheads_kv, head_dim), a random dout like q, and cu_seqlens_q/k; drawn in that order from one
    generator seeded with `seed`."""
    g = torch.Generator().manual_seed(seed)
    q = nan_guarded((sum(lens_q), nheads, head_dim), dtype, device, g)
    k, v = (nan_guarded((sum(lens_k), nheads_kv, head_dim), dtype, device, g) for _ in range(2))
    dout = torch.randn(sum(lens_q), nheads, head_dim, generator=g).to(device, dtype)
    return q, k, v, dout, cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)


def check_attention(q, k, v, dout, **kw) -> None:
    """flash_attn_func's output, lse and gradients for (q, k, v, dout) against the fp64 oracle: within 2x (output,
    lse) or 3x (gradients) of PyTorch's own error doing the same math in the input dtype, plus the accumulation
    floors. `kw` are the keyword arguments flash_attn_func and attention_ref share (masks, softcap, alibi, chunks)."""
    from flashtile import flash_attn_func
    dtype = q.dtype
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = flash_attn_func(*inputs, return_attn_probs=True, **kw)
    grads = torch.autograd.grad(out, inputs, dout)
    # The oracle runs on fp64 copies, so its outputs and gradients are not rounded back to the input dtype.
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse, probs = attention_ref(*ref_in, **kw, return_probs=True)
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout)
    floors = accumulation_floor(q, k, v, dout, ref_out, probs)
    pt_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    pt_out, pt_lse = attention_ref(*pt_in, upcast=False, **kw)
    pt_grads = torch.autograd.grad(pt_out, pt_in, dout)
    check_close("out", out, ref_out, pt_out, 2, floor=floors["out"])
    check_close("lse", lse, ref_lse, pt_lse.to(dtype), 2, floor=floors["lse"])
    scale = max(gr.abs().max().item() for gr in ref_grads)
    for name, ours, ref, pt in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
        check_close(name, ours, ref, pt, 3, scale, floor=floors[name])


def kvcache_inputs(device, batch, capacity, nheads, nheads_kv, head_dim, seqlen_new, page_size=None, seed=0):
    """Random fp16 inputs for flash_attn_with_kvcache: q, the caches (contiguous, or paged through an identity
    block_table), the new keys and values, and the logical (batch, capacity, ...) caches the oracle reads.
    Returns a dict; its "kwargs" holds block_table when paged."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, capacity, nheads_kv, head_dim)
    logical_k, logical_v = (torch.randn(shape, generator=g).to(device, torch.float16) for _ in range(2))
    q = torch.randn(batch, seqlen_new, nheads, head_dim, generator=g).to(device, torch.float16)
    new_k, new_v = (torch.randn(batch, seqlen_new, nheads_kv, head_dim, generator=g).to(device, torch.float16)
                    for _ in range(2))
    kwargs = {}
    if page_size:
        pages = batch * capacity // page_size
        k_cache, v_cache = (t.reshape(pages, page_size, nheads_kv, head_dim).clone() for t in (logical_k, logical_v))
        kwargs["block_table"] = torch.arange(pages, dtype=torch.int32, device=device).reshape(batch, -1)
    else:
        k_cache, v_cache = logical_k.clone(), logical_v.clone()
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, k=new_k, v=new_v, logical_k=logical_k, logical_v=logical_v,
                kwargs=kwargs)
