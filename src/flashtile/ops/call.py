"""One call of the attention ops as their launchers see it: `OpProblem`, rebuilt in one function (`op_problem`) from
a custom op's arguments, below the op boundary, where the public API's AttnProblem (problem.py) cannot travel (a
custom op takes tensors and scalars only).

It holds the inputs with their packing undone and made TMA-legal, the layout (dense, varlen, paged), the sizes the
kernels are launched with, the mask and score modifiers, and the dispatch decisions, taken once here: whether the
forward and the backward run the Gluon Hopper kernels (and why not: ops/hopper.py), and for a backward whether
its dK/dV kernel overlaps dQ through programmatic dependent launch and whether the Triton dQ kernel reads a tile
list. The launchers read the problem and nothing else, so `key()`, the launch-cache key derived from every field
(the signature of each tensor, every other value but the per-call floats), is complete by construction (Note
[launch cache] in ops/launch.py).

What this module does not do: validate arguments (problem.py, at the public API) or launch anything.
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Optional

import torch

from .common import unpack
from .descriptors import tma_ready
from .device import graph_capturing, pdl_supported
from .hopper import hopper_unsupported
from .launch import signature
from .schedule import list_blocks, self_attention


class OpProblem(NamedTuple):
    """A call of flashtile::fwd (dout, out and lse None) or flashtile::bwd."""
    q: torch.Tensor  # (B, Sq, H, D) or (total_q, H, D); packing undone, TMA-legal
    k: torch.Tensor  # (B, Sk, Hk, D), (total_k, Hk, D), or a paged cache (num_blocks, page_size, Hk, D)
    v: torch.Tensor
    cu_seqlens_q: Optional[torch.Tensor]
    cu_seqlens_k: Optional[torch.Tensor]
    seqused_q: Optional[torch.Tensor]
    seqused_k: Optional[torch.Tensor]
    alibi_slopes: Optional[torch.Tensor]
    block_table: Optional[torch.Tensor]
    learnable_sink: Optional[torch.Tensor]  # fp32 (H,)
    rng: Optional[torch.Tensor]  # dropout: the call's seed and stream, (2,) int64 (ops/dropout.py)
    dout: Optional[torch.Tensor]  # the backward's: dout and the forward's out (TMA-legal) and lse
    out: Optional[torch.Tensor]
    lse: Optional[torch.Tensor]
    varlen: bool
    paged: bool
    batch: int
    # Dense: the lengths. Varlen: the bounds each sequence's lengths are clamped to, the packed totals (a paged
    # cache's keys: its block table's capacity); max_seqlen_q/k size nothing (Note [varlen tile list]).
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    head_dim: int  # q's and k's, padded, as the kernels see it
    head_dim_v: int  # v's and the output's (MLA prefill: 128 beside q/k's 192), padded
    softmax_scale: float
    window_left: int
    window_right: int
    attention_chunk: int  # 0: off
    softcap: float
    dropout_p: float
    packing: int
    self_attention: bool  # varlen: the same tensors describe both sides (ops/schedule.self_attention)
    # Dispatch: None when the Gluon kernels run, else why the Triton ones do (ops/hopper.py).
    fwd_unsupported: Optional[str]
    bwd_unsupported: Optional[str]
    pdl: bool  # backward: the Triton dK/dV kernel overlaps dQ (Note [delta handoff] in kernels/bwd.py)
    dq_list_block: int  # backward: rows per tile of the list the dQ kernel reads (0: it walks the schedule)

    @property
    def tile_dim(self) -> int:
        """The head dim the tile table is read at: the wider of the two (config.py sizes tiles for it)."""
        return max(self.head_dim, self.head_dim_v)

    @property
    def fwd_gluon(self) -> bool:
        return self.fwd_unsupported is None

    @property
    def bwd_gluon(self) -> bool:
        return self.bwd_unsupported is None

    def key(self) -> tuple:
        """The launch-cache key: every field, tensors by their signature, the per-call floats (softmax_scale,
        softcap, dropout_p: passed as kernel arguments, never specialised) by whether softcap and dropout are on."""
        return signature(*self[:_N_TENSORS]), self.softcap > 0.0, self.dropout_p > 0.0, _keyed(self)


_N_TENSORS = OpProblem._fields.index("varlen")
_PER_CALL = ("softmax_scale", "softcap", "dropout_p")
_keyed = operator.itemgetter(*(i for i, name in enumerate(OpProblem._fields)
                               if i >= _N_TENSORS and name not in _PER_CALL))


def op_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, block_table,
               learnable_sink, rng, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
               attention_chunk, softcap, dropout_p, packing,
               dout=None, out=None, lse=None) -> OpProblem:
    """The OpProblem of flashtile::fwd's arguments, or with dout, out and lse flashtile::bwd's."""
    paged = block_table is not None
    if not paged:
        k, v = (None if t is None else tma_ready(t) for t in (k, v))
    q, k, v = unpack(tma_ready(q), k, v, packing)
    varlen = cu_seqlens_q is not None
    nheads, nheads_kv, head_dim, head_dim_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    if varlen:
        batch, seqlen_q = cu_seqlens_q.shape[0] - 1, q.shape[0]
        seqlen_k = block_table.shape[1] * k.shape[1] if paged else k.shape[0]
        self_attn = self_attention(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k)
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        self_attn = False
    seqused = seqused_q is not None or seqused_k is not None
    fwd_unsupported = hopper_unsupported(q.device, q.dtype, head_dim, head_dim_v=head_dim_v, paged=paged,
                                         seqused=seqused, softcap=softcap, alibi=alibi_slopes is not None,
                                         dropout=dropout_p > 0.0) \
        if k.numel() > 0 else "no keys"
    bwd_unsupported = fwd_unsupported  # the backward runs the kernels of its forward's path
    pdl, dq_list_block = False, 0
    if dout is not None:
        dout, out = tma_ready(dout), tma_ready(out)
        # The kernels write delta with lse's strides into a buffer shaped like it: a view of a wider lse (a ring's
        # half sequence, an aten op's) must be made dense first.
        lse = lse.contiguous()
        # Not under CUDA-graph capture: PDL launches inside a captured graph have not been run on our GPU.
        pdl = bwd_unsupported is not None and pdl_supported(q.device) and not graph_capturing(q.device)
        if varlen:
            dq_list_block = list_blocks(max(head_dim, head_dim_v), q.dtype == torch.float32,
                                        bwd_unsupported is None, dropout_p > 0.0)[1]
    return OpProblem(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, block_table,
                     learnable_sink, rng, dout,
                     out, lse, varlen, paged, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, head_dim_v,
                     float(softmax_scale), window_left, window_right, attention_chunk, float(softcap),
                     float(dropout_p), packing,
                     self_attn, fwd_unsupported, bwd_unsupported, pdl, dq_list_block)
