"""Dropout's host side: drawing a call's seed and stream from PyTorch's generator, and the `flashtile::dropout_probs`
op that writes S_dmask for `return_attn_probs=True` (testing only).

Note [dropout seed]: a call with dropout_p > 0 draws two int64 from the generator of q's device (`draw_rng`, with
torch.randint): the Philox key and a counter word of every entry's random number (kernels/dropout.py). Drawing
advances the generator, so consecutive calls get different masks and `torch.manual_seed` reproduces a run; a
`torch.Generator` passed by the caller is used instead of the default one. The draw is an ordinary tensor op on the
device: no host synchronisation, traced by torch.compile (whose RNG then stands in for the eager one), and
recorded by CUDA-graph capture, so that each replay draws anew as PyTorch's own dropout does. The (2,) tensor is an
input of the forward op and is saved for the backward, which regenerates the same mask from it.

S_dmask, as flash-attn 2.8 shapes it: (batch, nheads, seqlen_q rounded up to 128, seqlen_k rounded up to 128), for
a varlen batch with its max_seqlen_q/k. Entry (i, j) is the softmax probability P[i, j] = exp(s_ij - lse_i) of the
undropped softmax where it survives dropout, and -max(P[i, j], 1.2e-38) where it is dropped, so that `S_dmask >= 0`
recovers the mask even where P is 0 (a masked key); entries past a sequence's lengths are 0. float32.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import block_d
from ..kernels.dropout import dropout_probs_kernel
from ..problem import kernel_flags
from .common import alibi_batch_stride, custom_op
from .fwd import logit_scales
from .launch import launch_direct


def _block(width: int) -> int:
    """S_dmask's square tile: a testing pass, not tuned. Its fp32 Q and K tiles stay within 128 KiB of shared memory
    (sm_90 has 227 KiB): 64 rows up to head dim 256, 32 at 512, 16 at 1024 (a d512 tile of 64 needed 256 KiB)."""
    return max(16, min(64, 16384 // width))


def draw_rng(device: torch.device, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The (seed, stream) of one call with dropout, drawn from `generator` or the default one of `device` (Note
    [dropout seed])."""
    return torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64, device=device, generator=generator)


def _rounded(n: int) -> int:
    return -(-n // 128) * 128


@custom_op("flashtile::dropout_probs", mutates_args=())
def dropout_probs(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, rng: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
    seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
    attention_chunk: int,
    softcap: float, dropout_p: float,
) -> torch.Tensor:
    """S_dmask (module docstring) of the forward whose lse and rng these are. q (B, Sq, H, D) or (total_q, H, D),
    k likewise with Hk heads (unpacked, head dim as the forward ran it)."""
    varlen = cu_seqlens_q is not None
    nheads, head_dim = q.shape[-2:]
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    s = torch.empty(batch, nheads, _rounded(max_seqlen_q), _rounded(max_seqlen_k), dtype=torch.float32,
                    device=q.device)
    if s.numel() == 0:
        return s
    qk_scale, softcap2 = logit_scales(softmax_scale, softcap)
    flags = kernel_flags(window_left, window_right, softcap, alibi_slopes is not None, varlen,
                         seqused_q is not None, seqused_k is not None, q.dtype, dropout_p, chunk=attention_chunk)
    q_strides = (0, *q.stride()[:2]) if varlen else q.stride()[:3]
    k_strides = (0, *k.stride()[:2]) if varlen else k.stride()[:3]
    lse_strides = (0, lse.stride(0)) if varlen else lse.stride()[:2]
    seqlen_q, seqlen_k = (q.shape[0], k.shape[0]) if varlen else (q.shape[1], k.shape[1])
    block = _block(block_d(head_dim))
    grid = (s.shape[2] // block, s.shape[3] // block, batch * nheads)
    launch_direct(dropout_probs_kernel, grid, q, k, lse, s, alibi_slopes, rng, cu_seqlens_q, cu_seqlens_k, seqused_q,
                  seqused_k, qk_scale, softcap2, dropout_p, *q_strides, *k_strides, *lse_strides, *s.stride()[:3],
                  alibi_batch_stride(alibi_slopes), seqlen_q, seqlen_k, nheads, nheads // k.shape[-2], window_left,
                  window_right, attention_chunk, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=block,
                  BLOCK_N=block,
                  **{name: flags[name] for name in ("IS_VARLEN", "HAS_SEQUSED_Q", "HAS_SEQUSED_K", "MASK_LEFT",
                                                    "MASK_RIGHT", "MASK_CHUNK", "HAS_SOFTCAP", "HAS_ALIBI")})
    return s


@dropout_probs.register_fake
def _(q, k, lse, rng, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, max_seqlen_q, max_seqlen_k,
      softmax_scale, window_left, window_right, attention_chunk, softcap, dropout_p):
    batch = cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None else q.shape[0]
    return q.new_empty((batch, q.shape[-2], _rounded(max_seqlen_q), _rounded(max_seqlen_k)), dtype=torch.float32)
