"""Rotary position embedding with flash-attn's `flash_attn.layers.rotary.apply_rotary_emb` signature and semantics,
in plain PyTorch.

flash-attn applies rotary embeddings with a Triton kernel of its own; flashtile applies them inside its KV-cache
kernel (`flash_attn_with_kvcache(rotary_cos=..., rotary_sin=...)`) and has no standalone kernel, so this module
computes the same thing with PyTorch operations: in fp32 (fp64 for fp64 inputs), rounded once to x's dtype,
differentiable in x (and in cos and sin) through autograd. It is for code written against flash-attn
(flashtile.compat); a model that cares about the last microsecond fuses rotary into its projections or lets the
KV-cache kernel do it.

What this module does not do: launch a Triton kernel, or take `conjugate` (flash-attn's internal backward switch).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = ["apply_rotary_emb"]


def _positions(x: torch.Tensor, seqlen_offsets, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    """The rotary position of every token: (batch, seqlen) for a padded batch, (total,) for a packed one."""
    device = x.device
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        positions = torch.arange(seqlen, device=device).expand(batch, seqlen)
        if isinstance(seqlen_offsets, torch.Tensor):
            return positions + seqlen_offsets.to(device, torch.long)[:, None]
        return positions + seqlen_offsets
    tokens = torch.arange(x.shape[0], device=device)
    cu = cu_seqlens.to(device, torch.long)
    sequence = torch.searchsorted(cu[1:], tokens, right=True)  # the sequence each token belongs to
    positions = tokens - cu[sequence]
    if isinstance(seqlen_offsets, torch.Tensor):
        return positions + seqlen_offsets.to(device, torch.long)[sequence]
    return positions + seqlen_offsets


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets: Union[int, torch.Tensor] = 0,
                     cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None) -> torch.Tensor:
    """Rotate the first rotary_dim = 2 * cos.shape[1] features of every head of x by its token's position.

    Arguments:
        x: (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with cu_seqlens.
        cos, sin: (seqlen_ro, rotary_dim / 2), x's dtype; rotary_dim <= headdim. Row p holds position p.
        interleaved: rotate the pairs (0, 1), (2, 3), ... (GPT-J) if True, else (0, rotary_dim / 2),
            (1, rotary_dim / 2 + 1), ... (GPT-NeoX).
        inplace: write the result into x (and return x).
        seqlen_offsets: int, or (batch,) int32/int64 tensor: token t of sequence b sits at position
            t + seqlen_offsets[b] (decoding with a KV cache). A position past seqlen_ro is left unrotated, as
            flash-attn's kernel leaves it.
        cu_seqlens: (batch + 1,) int32, the packed layout of x (positions restart at each sequence).
        max_seqlen: int, the longest sequence; required with cu_seqlens, as in flash-attn.
    Return:
        x rotated, same shape and dtype; features past rotary_dim are copied unchanged.
    Refuses (ValueError/TypeError naming the argument): cos/sin of different shapes or of a dtype other than x's,
    rotary_dim > headdim, a seqlen (or max_seqlen) beyond seqlen_ro with an int offset, cu_seqlens without
    max_seqlen, seqlen_offsets of the wrong shape or dtype.
    """
    if cu_seqlens is not None and max_seqlen is None:
        raise ValueError("max_seqlen is required with cu_seqlens (as in flash-attn)")
    if x.dim() != (3 if cu_seqlens is not None else 4):
        raise ValueError(f"x must be (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with cu_seqlens; "
                         f"got shape {tuple(x.shape)}")
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(f"cos and sin must both be (seqlen_ro, rotary_dim / 2), got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if not (cos.dtype == sin.dtype == x.dtype):
        raise TypeError(f"cos and sin must have x's dtype {x.dtype}, got {cos.dtype} and {sin.dtype}")
    seqlen_ro, half = cos.shape
    rotary_dim = 2 * half
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim = 2 * cos.shape[1] = {rotary_dim} must be <= headdim = {x.shape[-1]}")
    seqlen = max_seqlen if cu_seqlens is not None else x.shape[1]
    if isinstance(seqlen_offsets, torch.Tensor):
        batch = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else x.shape[0]
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"seqlen_offsets must be an int or a (batch,) = ({batch},) int32/int64 tensor, got "
                             f"{seqlen_offsets.dtype} {tuple(seqlen_offsets.shape)}")
    elif seqlen_offsets + seqlen > seqlen_ro:
        raise ValueError(f"cos/sin hold {seqlen_ro} positions (seqlen_ro) but positions up to "
                         f"seqlen_offsets + seqlen = {seqlen_offsets + seqlen} are needed")

    positions = _positions(x, seqlen_offsets, cu_seqlens)
    inside = positions < seqlen_ro
    rows = positions.clamp(max=seqlen_ro - 1)
    compute = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    c = torch.where(inside[..., None], cos[rows].to(compute), 1.0)[..., None, :]  # (..., 1, rotary_dim / 2)
    s = torch.where(inside[..., None], sin[rows].to(compute), 0.0)[..., None, :]
    head = x[..., :rotary_dim].to(compute)
    if interleaved:
        x1, x2 = head[..., 0::2], head[..., 1::2]
    else:
        x1, x2 = head[..., :half], head[..., half:]
    y1, y2 = x1 * c - x2 * s, x1 * s + x2 * c
    rotated = (torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)).to(x.dtype)
    if inplace:
        x[..., :rotary_dim] = rotated
        return x
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
