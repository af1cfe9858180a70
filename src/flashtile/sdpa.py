"""`scaled_dot_product_attention`: PyTorch's `torch.nn.functional.scaled_dot_product_attention`, computed by flashtile.

Same signature, same (..., nheads, seqlen, headdim) layout and the same meaning of every argument, so that code
written for SDPA can call flashtile by changing the import. SDPA's `is_causal` is aligned to the top-left corner
of the score matrix (query i sees keys j <= i), flash-attn's and flashtile's `causal` to the bottom-right one; this
module turns one into the other (Note [top-left causal]). The inputs are transposed to flashtile's (batch, seqlen,
nheads, headdim) as views, and the output comes back the same way: a (batch, nheads, seqlen, headdim) view of a
(batch, seqlen, nheads, headdim) buffer, as PyTorch's own flash backend returns it.

What this module does not do: take a tensor `attn_mask` (arbitrary masks and biases need a mask operand in the
kernels, which is planned; until then such a call raises NotImplementedError rather than ignore the mask). The
causal masks of `torch.nn.attention.bias` (`causal_upper_left`, `causal_lower_right`) are not arbitrary: their
variant is an attribute, read without touching the device, and they are accepted.
"""

from __future__ import annotations

import math

import torch

from .interface import flash_attn_func

__all__ = ["scaled_dot_product_attention"]

# Note [top-left causal]: flashtile's masks are windows aligned bottom-right, query i seeing keys
# i + Sk - Sq - left <= j <= i + Sk - Sq + right. SDPA's is_causal is j <= i. With Sq >= Sk that is the window
# (-1, Sq - Sk) (right = Sq - Sk makes the upper bound i). With Sq < Sk the right bound would be negative, which
# the window convention does not have (-1 means unbounded); but then no query sees a key past Sq - 1, so the keys
# are cut to the first Sq and the mask is the square causal one. Cutting is a view: the gradient of the keys cut
# off is zero, as SDPA's is.
UPPER_LEFT, LOWER_RIGHT = "upper_left", "lower_right"


def _causal_variant(attn_mask, seqlen_q: int, seqlen_k: int):
    """The alignment of a `torch.nn.attention.bias.CausalBias` mask, None for no mask; any other mask raises."""
    if attn_mask is None:
        return None
    try:
        from torch.nn.attention.bias import CausalBias, CausalVariant
    except ImportError:  # a torch without attention biases: every mask is a tensor mask
        CausalBias = None
    if CausalBias is not None and isinstance(attn_mask, CausalBias):
        if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (seqlen_q, seqlen_k):
            raise ValueError(f"attn_mask is a causal bias for {attn_mask.seq_len_q} queries and "
                             f"{attn_mask.seq_len_kv} keys, but query has {seqlen_q} and key {seqlen_k}")
        return UPPER_LEFT if attn_mask.variant == CausalVariant.UPPER_LEFT else LOWER_RIGHT
    raise NotImplementedError(
        "flashtile.scaled_dot_product_attention does not take a tensor attn_mask yet (a mask operand in the "
        "kernels is planned). Use is_causal=True, a causal bias from torch.nn.attention.bias, or "
        "flashtile.flash_attn_func's window_size / flash_attn_varlen_func for padding.")


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """softmax(query keyᵀ · scale) value, with PyTorch SDPA's signature and semantics, by flashtile's kernels.

    Arguments:
        query: (..., nheads, seqlen_q, headdim); any number of leading batch dimensions (at least 3 dimensions
            in all: a 3-dimensional query is (nheads, seqlen_q, headdim)). fp16, bf16 or fp32, unit stride in
            the last dimension; headdim <= 512.
        key: (..., nheads_k, seqlen_k, headdim), the same leading dimensions (no broadcasting).
        value: (..., nheads_k, seqlen_k, headdim_v). headdim_v may differ from headdim (flash_attn_func's
            head_dim_v).
        attn_mask: None, or a causal bias of `torch.nn.attention.bias` (`causal_upper_left`,
            `causal_lower_right`, for these lengths). A tensor mask raises NotImplementedError.
        dropout_p: dropout probability (flashtile's, flash-attn 2's semantics: Note [dropout mask] in
            kernels/dropout.py).
        is_causal: top-left causal mask, as SDPA's: query i sees keys j <= i, whatever seqlen_q and seqlen_k
            (flash_attn_func's causal is aligned bottom-right instead). Not together with attn_mask.
        scale: scaling of query keyᵀ before the softmax; default 1 / sqrt(headdim). Must be > 0.
        enable_gqa: allow nheads_k < nheads (nheads a multiple of nheads_k; query head h uses key/value head
            h // (nheads / nheads_k)). Without it the head counts must be equal, as in SDPA.
    Return:
        (..., nheads, seqlen_q, headdim_v) in query's dtype: a view of a (..., seqlen_q, nheads, headdim_v)
        buffer (PyTorch's flash backend returns the same layout). Differentiable in query, key and value.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 3:
            raise ValueError(f"{name} must have at least 3 dimensions (..., nheads, seqlen, headdim), got shape "
                             f"{tuple(t.shape)}")
    if not (query.dim() == key.dim() == value.dim()) or query.shape[:-3] != key.shape[:-3] or (
            key.shape[:-1] != value.shape[:-1]):
        raise ValueError(f"query, key and value must share their leading (batch) dimensions and key and value "
                         f"their heads and length; got {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)} (flashtile does not broadcast batch dimensions)")
    nheads, seqlen_q, head_dim = query.shape[-3:]
    nheads_kv, seqlen_k, head_dim_v = value.shape[-3:]
    if nheads != nheads_kv and not enable_gqa:
        raise ValueError(f"query has {nheads} heads and key/value {nheads_kv}: pass enable_gqa=True for grouped-query "
                         f"attention, as torch's scaled_dot_product_attention requires")
    variant = _causal_variant(attn_mask, seqlen_q, seqlen_k)
    if variant is not None and is_causal:
        raise ValueError("attn_mask is already a causal mask: do not also pass is_causal=True")
    if is_causal:
        variant = UPPER_LEFT
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)  # of the query's head dim, before any padding
    lead = query.shape[:-3]
    q, k, v = (t.reshape(-1, *t.shape[-3:]) for t in (query, key, value))
    causal, window = False, (-1, -1)
    if variant == LOWER_RIGHT:
        causal = True
    elif variant == UPPER_LEFT:  # Note [top-left causal]
        if seqlen_q < seqlen_k:
            k, v = k[..., :seqlen_q, :], v[..., :seqlen_q, :]
            causal = True
        else:
            window = (-1, seqlen_q - seqlen_k)
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p,
                          softmax_scale=scale, causal=causal, window_size=window)
    return out.transpose(1, 2).reshape(*lead, nheads, seqlen_q, head_dim_v)
