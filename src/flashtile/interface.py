"""Public API, argument-for-argument compatible with flash-attn 2.8's `flash_attn_interface`.

Each function validates its arguments once (problem.py), normalises them (causal -> window, head dim padded to a
multiple of 8), calls the `flashtile::fwd` custom op and trims the result. Gradients flow through the op's
registered autograd (autograd.py). Layout is (batch, seqlen, nheads, headdim) throughout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import autograd  # noqa: F401  (registers the backward of flashtile::fwd)
from .ops.common import PACK_KV, PACK_NONE, PACK_QKV
from .ops.fwd import attention_fwd
from .problem import AttnProblem, dense_problem, pad_head_dim


def _pad(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    padded = pad_head_dim(head_dim)
    return t if padded == head_dim else F.pad(t, (0, padded - head_dim))


def _run(p: AttnProblem, q, k, v, packing: int, alibi_slopes, return_attn_probs: bool, deterministic: bool,
         cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None):
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    # The backward has no atomics (see ops/bwd.py), so it is bitwise reproducible whatever `deterministic` says.
    q, k, v = (None if t is None else _pad(t, p.head_dim) for t in (q, k, v))
    out, lse = attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes,
                             p.seqlen_q, p.seqlen_k, p.softmax_scale, p.window_left, p.window_right, p.softcap,
                             packing)
    out = out[..., :p.head_dim] if out.shape[-1] != p.head_dim else out
    if return_attn_probs:
        # S_dmask is the dropout mask in flash-attn; without dropout it is an empty tensor there too.
        return out, lse, torch.empty(0, dtype=out.dtype, device=out.device)
    return out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Exact attention softmax(q kᵀ · softmax_scale) v, fused and tiled; forward and backward.

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim)
        k: (batch_size, seqlen_k, nheads_k, headdim)
        v: (batch_size, seqlen_k, nheads_k, headdim)
            nheads must be a multiple of nheads_k (MQA/GQA): query head h uses key/value head h // (nheads /
            nheads_k). fp16, bf16 or fp32; unit stride in the last dimension, any other strides. headdim <= 256
            (multiples of 8 run natively, others are zero-padded).
        dropout_p: must be 0.0 (dropout is not supported yet; a non-zero value raises NotImplementedError).
        softmax_scale: scaling of qkᵀ before the softmax; default 1 / sqrt(headdim).
        causal: causal mask, aligned to the bottom-right corner of the attention matrix when seqlen_q != seqlen_k.
            For seqlen_q = 2, seqlen_k = 5 (1 = visible):
                1 1 1 1 0
                1 1 1 1 1
            and for seqlen_q = 5, seqlen_k = 2:
                0 0
                0 0
                0 0
                1 0
                1 1
            A row with no visible key outputs 0.
        window_size: (left, right); -1 or None means unbounded. Query i attends to keys j with
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right. causal=True sets right to 0.
        softcap: if > 0, scores (already scaled) become softcap * tanh(score / softcap).
        alibi_slopes: (nheads,) or (batch_size, nheads), float32. Adds -slope * |i + seqlen_k - seqlen_q - j| to
            the score of query i and key j.
        deterministic: accepted for compatibility. flashtile's backward is always bitwise reproducible: it has no
            atomics (an atomic-dQ schedule measured 1.5-2x slower on H200; see PERF.md).
        return_attn_probs: if True, also return softmax_lse and an empty S_dmask (testing only).
    Return:
        out: (batch_size, seqlen_q, nheads, headdim).
        softmax_lse [if return_attn_probs]: (batch_size, nheads, seqlen_q), float32, natural log of the row sums
            of exp(scores); +inf for rows with no visible key.
        S_dmask [if return_attn_probs]: an empty tensor (there is no dropout mask).
    """
    p = dense_problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p)
    return _run(p, q, k, v, PACK_NONE, alibi_slopes, return_attn_probs, deterministic)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """`flash_attn_func` with q, k, v packed: qkv is (batch_size, seqlen, 3, nheads, headdim).

    Reads q, k and v as strided views of qkv and writes their gradients into one (batch_size, seqlen, 3, nheads,
    headdim) buffer, with no concatenation. Other arguments and the return value as `flash_attn_func`.
    """
    _check_packed("qkv", qkv, 5, 3)
    p = dense_problem(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], softmax_scale, causal, window_size, softcap,
                      alibi_slopes, dropout_p)
    return _run(p, qkv, None, None, PACK_QKV, alibi_slopes, return_attn_probs, deterministic)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """`flash_attn_func` with k and v packed: q is (batch_size, seqlen_q, nheads, headdim) and kv is
    (batch_size, seqlen_k, 2, nheads_k, headdim). dk and dv are written into one buffer of kv's shape.
    Other arguments and the return value as `flash_attn_func`.
    """
    _check_packed("kv", kv, 5, 2)
    p = dense_problem(q, kv[:, :, 0], kv[:, :, 1], softmax_scale, causal, window_size, softcap, alibi_slopes,
                      dropout_p)
    return _run(p, q, kv, None, PACK_KV, alibi_slopes, return_attn_probs, deterministic)


def _check_packed(name: str, t, ndim: int, n: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim or t.shape[-3] != n:
        raise ValueError(f"{name} must have {ndim} dimensions with size {n} at dimension -3, "
                         f"got shape {tuple(t.shape)}")
