"""Test support: an fp64 reference, NaN-guarded input generators and flash-attn's tolerance rule.

Shipped with the package so that the tests, `flashtile demo` and `flashtile bench --refcheck` judge results the
same way. Nothing here runs a Triton kernel.
"""

from __future__ import annotations

import math

import torch


def visible_mask(seqlen_q: int, seqlen_k: int, window_left: int, window_right: int, device=None) -> torch.Tensor:
    """(Sq, Sk) bool: query i sees key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right (-1: unbounded)."""
    i = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_right >= 0:
        visible &= j <= i + window_right
    if window_left >= 0:
        visible &= j >= i - window_left
    return visible


def attention_ref(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                  softmax_scale=None, upcast=True):
    """Attention computed the plain way. q (B, Sq, H, D), k/v (B, Sk, Hk, D); returns (out, lse).

    upcast=True computes in float64 (the oracle); upcast=False computes in the input dtype, which is the
    "PyTorch doing the same math" baseline of the tolerance rule. out has q's dtype; lse is float32
    (B, H, Sq) with +inf for rows that see no key (flash-attn's convention).
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
    visible = visible_mask(seqlen_q, seqlen_k, left, right, q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    attn = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key -> 0
    out = torch.einsum("bhts,bshd->bthd", attn, v)
    lse = lse.float().masked_fill(lse == float("-inf"), float("inf"))
    return out.to(dtype), lse


def rounding_atol(ref: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> float:
    """flash-attn's rounding-size atol: twice the error of adding and subtracting 0.3 in `dtype`; floored at
    2 epsilons of `scale`, the magnitude of the problem's values, for references that are exactly zero by
    cancellation (dq and dk when every query sees a single key) but are computed from O(scale) terms."""
    r = ref.to(dtype)
    fa = 2 * ((r + 0.3 - 0.3) - r).abs().max().item() if r.numel() else 0.0
    return max(fa, 2 * torch.finfo(dtype).eps * scale)


def check_close(name: str, ours: torch.Tensor, ref: torch.Tensor, baseline: torch.Tensor, factor: float,
                scale: float = 1.0) -> None:
    """Assert max|ours - ref| <= factor * max|baseline - ref| + rounding atol (ref is the fp64 oracle)."""
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    ours, ref, baseline_d = ours.double(), ref.double(), baseline.double()
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(ours), finite), f"{name}: non-finite entries differ from the reference"
    assert torch.equal(ours[~finite], ref[~finite]), f"{name}: infinite entries differ from the reference"
    err = (ours - ref)[finite].abs().max().item() if finite.any() else 0.0
    base = (baseline_d - ref)[finite].abs().max().item() if finite.any() else 0.0
    tol = factor * base + rounding_atol(ref[finite], baseline.dtype, scale)
    assert err <= tol, f"{name}: max error {err:.3e} > {factor} x PyTorch error {base:.3e} + atol (= {tol:.3e})"


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
