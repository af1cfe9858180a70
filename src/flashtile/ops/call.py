"""One call of the attention ops as their launchers see it: `OpProblem`, rebuilt in one function (`op_problem`) from
a custom op's arguments, below the op boundary, where the public API's AttnProblem (problem.py) cannot travel (a
custom op takes tensors and scalars only).

It holds the inputs with their packing undone and made TMA-legal, the layout (dense, varlen, paged), the sizes the
kernels are launched with, the mask and score modifiers, and the dispatch decisions, taken once here: whether the
forward and the backward run the Gluon Hopper kernels (and why not: ops/hopper.py), and for a backward whether
its dK/dV kernel overlaps dQ through programmatic dependent launch and whether the Triton dQ kernel reads a tile
list. The launchers read the problem and nothing else, so `key()`, the launch-cache key derived from every field
(the signature of each tensor, every other value but the per-call floats), is complete by construction (Note
[launch cache] in ops/launch.py). A problem carries its key as `launch_key`, taken with its decisions from a memo
when a call like it was seen before (Note [problem memo]).

What this module does not do: validate arguments (problem.py, at the public API) or launch anything.
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Optional

import torch

from .. import env
from ..config import v_parts
from .common import unpack
from .descriptors import tma_ready
from . import device as devices
from .device import graph_capturing, pdl_supported
from .hopper import hopper_unsupported
from .launch import MAX_CACHED, signature, tensor_signature
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
    dq_unsupported: Optional[str]
    dkdv_unsupported: Optional[str]
    pdl: bool  # backward: the Triton dK/dV kernel overlaps the Triton dQ (Note [delta handoff] in kernels/bwd.py)
    dq_list_block: int  # backward: rows per tile of the list the dQ kernel reads (0: it walks the schedule)
    launch_key: tuple  # key(), as op_problem derived or remembered it (Note [problem memo])

    @property
    def tile_dim(self) -> int:
        """The head dim the tile table is read at: the wider of the two (config.py sizes tiles for it)."""
        return max(self.head_dim, self.head_dim_v)

    @property
    def v_parts(self) -> int:
        """How many programs of the Triton forward share a query tile (config.v_parts)."""
        return v_parts(self.head_dim_v, self.q.dtype == torch.float32)

    @property
    def fwd_gluon(self) -> bool:
        return self.fwd_unsupported is None

    @property
    def dq_gluon(self) -> bool:
        return self.dq_unsupported is None

    @property
    def dkdv_gluon(self) -> bool:
        return self.dkdv_unsupported is None

    def key(self) -> tuple:
        """The launch-cache key: every field, tensors by their signature, the per-call floats (softmax_scale,
        softcap, dropout_p: passed as kernel arguments, never specialised) by whether softcap and dropout are on.
        Derived here from the fields (launch_key aside); the launchers read launch_key."""
        return signature(*self[:_N_TENSORS]), self.softcap > 0.0, self.dropout_p > 0.0, _keyed(self)


_N_TENSORS = OpProblem._fields.index("varlen")
_PER_CALL = ("softmax_scale", "softcap", "dropout_p")
_keyed = operator.itemgetter(*(i for i, name in enumerate(OpProblem._fields)
                               if i >= _N_TENSORS and name not in _PER_CALL + ("launch_key",)))
# The remembered part of a problem, OpProblem[_N_TENSORS:], is cut around its per-call floats.
_SCALE, _SOFTCAP, _DROPOUT = (OpProblem._fields.index(name) - _N_TENSORS for name in _PER_CALL)
assert _DROPOUT == _SOFTCAP + 1

# Note [problem memo]: what op_problem decides (layout, sizes, dispatch) and the launch key it derives are a function
# of its arguments' signatures (launch.signature: shape, strides, dtype, 16-byte alignment of the pointer, which is
# all that tma_ready and lse.contiguous() look at), their device, which optional tensors are the same object
# (schedule.self_attention), the integers, whether softcap and dropout are on, and what the dispatch reads beside
# the call: the environment flags (FLASHTILE_HOPPER, FLASHTILE_PDL: env reads them at every call), whether the
# interpreter runs, launch.capture_launches' pretended device, and for a backward whether a CUDA graph is being
# captured. Under that key the decisions of the first such call are remembered, without its tensors (MAX_CACHED
# keys, the oldest dropped first), and a later call takes them, with its own tensors (unpacked: views of them) and
# per-call floats: a short dense forward's op_problem and key, ~9 µs of its ~40 on a CPU host, become a ~5 µs
# lookup (docs/perf.md, "Host time per call"). A call for which tma_ready or contiguous() copied a tensor is not
# remembered. Under the interpreter and with FLASHTILE_CHECK=1 every hit is
# derived again and compared, as the launch cache's hits are (Note [launch cache] in ops/launch.py).
_MEMO: dict[tuple, tuple[tuple, tuple, tuple]] = {}  # the decisions, cut around the per-call floats


def op_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, block_table,
               learnable_sink, rng, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
               attention_chunk, softcap, dropout_p, packing,
               dout=None, out=None, lse=None) -> OpProblem:
    """The OpProblem of flashtile::fwd's arguments, or with dout, out and lse flashtile::bwd's (Note [problem
    memo])."""
    tensors = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, block_table, learnable_sink, rng)
    device, backward = q.device, dout is not None
    memo_key = (tuple([None if t is None else tensor_signature(t) for t in (q, k, v, *tensors, dout, out, lse)]),
                device, window_left, window_right, attention_chunk, packing, softcap > 0.0, dropout_p > 0.0,
                cu_seqlens_k is cu_seqlens_q, seqused_k is seqused_q, env.INTERPRET, env.hopper(),
                devices.capture_target(), backward and env.pdl(), backward and graph_capturing(device))
    known = _MEMO.get(memo_key)
    if known is None:
        p, copied = _derive(q, k, v, *tensors, softmax_scale, window_left, window_right, attention_chunk, softcap,
                            dropout_p, packing, dout, out, lse)
        if not copied:
            if len(_MEMO) >= MAX_CACHED:
                _MEMO.pop(next(iter(_MEMO), None), None)  # another thread may have dropped it first
            decided = p[_N_TENSORS:]
            _MEMO[memo_key] = (decided[:_SCALE], decided[_SCALE + 1:_SOFTCAP], decided[_DROPOUT + 1:])
        return p
    before_scale, before_softcap, rest = known
    p = OpProblem._make((*unpack(q, k, v, packing), *tensors, dout, out, lse, *before_scale, float(softmax_scale),
                         *before_softcap, float(softcap), float(dropout_p), *rest))
    if env.INTERPRET or env.debug_checks():
        _check(p, _derive(q, k, v, *tensors, softmax_scale, window_left, window_right, attention_chunk, softcap,
                          dropout_p, packing, dout, out, lse)[0])
    return p


def _check(hit: OpProblem, derived: OpProblem) -> None:
    """That a remembered problem is the one op_problem derives (Note [problem memo])."""
    def layout(t):
        return None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype)
    if ([layout(t) for t in hit[:_N_TENSORS]] != [layout(t) for t in derived[:_N_TENSORS]]
            or hit[_N_TENSORS:] != derived[_N_TENSORS:]):  # launch_key among them
        raise AssertionError(f"the problem memo's key does not determine the problem: remembered {hit[_N_TENSORS:]}, "
                             f"derived {derived[_N_TENSORS:]}")


def _derive(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, block_table, learnable_sink,
            rng, softmax_scale, window_left, window_right, attention_chunk, softcap, dropout_p, packing, dout, out,
            lse) -> tuple[OpProblem, bool]:
    """op_problem's problem, derived, and whether a tensor was copied on the way (to be made TMA-legal or
    dense)."""
    given = (q, k, v, dout, out, lse)
    paged = block_table is not None
    if not paged:
        k, v = (None if t is None else tma_ready(t) for t in (k, v))
    q = tma_ready(q)
    copied = q is not given[0] or k is not given[1] or v is not given[2]
    q, k, v = unpack(q, k, v, packing)
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
    # Each kernel has its own path: with dropout (Note [dropout on the Gluon path]), and at a head dim that only
    # the Gluon forward takes (512: Note [split columns] in kernels/hopper_fwd_wide.py).
    fwd_unsupported, dq_unsupported, dkdv_unsupported = (
        hopper_unsupported(q.device, q.dtype, head_dim, head_dim_v=head_dim_v, paged=paged, seqused=seqused,
                           softcap=softcap, alibi=alibi_slopes is not None, dropout=dropout_p > 0.0,
                           right_mask=window_right >= 0, kernel=kernel) if k.numel() > 0 else "no keys"
        for kernel in ("fwd", "bwd_dq", "bwd_dkdv"))
    pdl, dq_list_block = False, 0
    if dout is not None:
        dout, out = tma_ready(dout), tma_ready(out)
        # The kernels write delta with lse's strides into a buffer shaped like it: a view of a wider lse (a ring's
        # half sequence, an aten op's) must be made dense first.
        lse = lse.contiguous()
        copied = copied or dout is not given[3] or out is not given[4] or lse is not given[5]
        # Not under CUDA-graph capture: PDL launches inside a captured graph have not been run on our GPU.
        pdl = dq_unsupported is not None and pdl_supported(q.device) and not graph_capturing(q.device)
        if varlen:
            dq_list_block = list_blocks(max(head_dim, head_dim_v), q.dtype == torch.float32,
                                        fwd_unsupported is None, dq_unsupported is None, dkdv_unsupported is None,
                                        dropout_p > 0.0, head_dim_v)[1]
    p = OpProblem(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, block_table,
                  learnable_sink, rng, dout, out, lse, varlen, paged, batch, seqlen_q, seqlen_k, nheads, nheads_kv,
                  head_dim, head_dim_v, float(softmax_scale), window_left, window_right, attention_chunk,
                  float(softcap), float(dropout_p), packing, self_attn, fwd_unsupported, dq_unsupported,
                  dkdv_unsupported, pdl,
                  dq_list_block, ())
    return p._replace(launch_key=p.key()), copied
