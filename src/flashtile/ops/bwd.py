"""Backward launcher and the `flashtile::bwd` custom op: dQ (which also writes delta = rowsum(dO * O)), then
dK/dV.

Grids: dQ is (query tiles, query heads, sequences), like the forward; dK/dV is (key tiles, KV heads, sequences)
and each program loops over its GQA group, so nothing is reduced across programs and the result is bitwise
reproducible. Varlen batches get the forward's tile lists and heads-first grids (kernels/seqlen.py): dQ tiles
cost in proportion to their sequence's keys and dK/dV tiles to its queries, so each list puts that side's longest
sequences first. The Triton dQ kernel reads its tile from its list written out (ops/schedule.varlen_plan), the
Triton dK/dV kernel walks its schedule (seqlen.tile_coords); the Gluon ones (sm_90) are persistent over lists.
Two launches, in that order on one stream: the Triton dK/dV kernel reads the delta the dQ kernel wrote, through
per-(sequence, head) counters that let it start on the SMs the dQ grid's last wave leaves idle, launched with
programmatic dependent launch on sm_90 (Note [delta handoff] in kernels/bwd.py; FLASHTILE_PDL=0 switches that
off). Packed inputs get their gradients written into one buffer of the packed
shape.

Note [one plan per step]: a varlen call's kernels read a plan (ops/schedule.varlen_plan: the launch order, tile lists
and work counters), one small launch that costs ~20 µs of host time on the H200 machine, as much as a kernel
launch of the attention itself. A varlen forward+backward once made six of them around its three kernels
(the forward's schedule and list, the backward's dQ list and dK/dV list, besides the kernels that read them), and
it was host-bound: the autograd engine hands the backward to its device thread after the forward returns, and
the host reached the dQ launch after the GPU had finished the ~280 µs causal forward of the benchmark's
16-sequence mix. Now one launch writes the order and every list a call needs (one kernel, each program placing its
sequence by rank, no sort), and an eager forward that autograd will differentiate writes the backward's lists too
where one plan can hold them (self-attention, the same lengths on both sides, and lists of one block: the Hopper
path's 128-row tiles), handing the plan to the backward on the autograd context; the persistent forward, dQ and
dK/dV kernels count their work items in counters of their own. A varlen forward+backward then launches one plan
and its three kernels; a torch.compile'd one (whose backward is the `flashtile::bwd` op, which takes no plan) one
more. A plan serves a single backward: a second one (retain_graph) plans anew, its dQ and dK/dV counters spent.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import block_d, tile_config
from ..kernels.bwd import _bwd_dkdv_kernel, _bwd_dq_kernel
from ..kernels.seqlen import DESC_DENSE, DESC_PACKED, DESC_ROW
from ..problem import kernel_flags
from .call import op_problem
from .common import PACK_KV, PACK_QKV, alibi_batch_stride, custom_op, unpack
from .descriptors import bmh_strides, descriptor_blocks, host_desc
from .schedule import Plan, list_blocks, plan_lists, schedule_step, tile_grid, varlen_plan
from .fwd import HOST_DESCRIPTOR_MAX_D, HOST_DESCRIPTORS, logit_scales, lse_strides
from . import hopper
from .hopper import HOPPER_PATH, TRITON, record
from .launch import Static, head_dims, keep_scratch, launch, prepare_launch


_DQ_BLOCKS = descriptor_blocks({"K": ("BLOCK_N", "BLOCK_D"), "V": ("BLOCK_N", "BLOCK_DV")})


def _grad_buffers(q, k, v, packing):
    """Gradient outputs: the list the op returns, and the (dq, dk, dv) views the kernels write."""
    if packing == PACK_QKV:
        dqkv = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return [dqkv], unpack(dqkv, None, None, packing)
    if packing == PACK_KV:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dkv = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        return [dq, dkv], unpack(dq, dkv, None, packing)
    grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
    return grads, tuple(grads)


@custom_op("flashtile::bwd", mutates_args=())
def attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
    out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
    seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
    learnable_sink: Optional[torch.Tensor], rng: Optional[torch.Tensor],
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
    attention_chunk: int,
    softcap: float, dropout_p: float, packing: int,
) -> list[torch.Tensor]:
    """Gradients for the packing of the inputs: [dq, dk, dv], [dqkv] or [dq, dkv], then the learnable sink's if
    there is one. With dropout_p > 0, rng is the forward's: the kernels regenerate its mask."""
    return backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes,
                    learnable_sink, rng, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
                    attention_chunk, softcap,
                    dropout_p, packing)


def sink_gradient(learnable_sink: torch.Tensor, lse: torch.Tensor, delta: Optional[torch.Tensor]) -> torch.Tensor:
    """Note [sink gradient]: a sink's logit sigma scales every probability of its rows by the same factor, so
    dO_i / d sigma = -P_sink,i O_i with P_sink,i = exp(sigma - lse_i), and the loss's gradient is
    -sum_i P_sink,i delta_i over the head's rows (delta = rowsum(dO * O), which the dQ kernel wrote; dropout
    changes neither form). One pass over (B, H, Sq) floats after the kernels. Rows the forward did not compute
    (seqused_q) have lse +inf and a delta nobody wrote: they add nothing."""
    if delta is None:
        return torch.zeros_like(learnable_sink)
    dense = lse.dim() == 3  # (B, H, Sq); a varlen batch's is (H, total_q)
    weight = torch.exp(learnable_sink.view((1, -1, 1) if dense else (-1, 1)) - lse)
    terms = torch.where(torch.isinf(lse), 0.0, weight * delta)
    return -terms.sum((0, 2) if dense else (1,))


def backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, learnable_sink,
             rng, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, attention_chunk, softcap,
             dropout_p, packing, plan: Optional[Plan] = None) -> list[torch.Tensor]:
    """attention_bwd's implementation. `plan`: the forward's (ops/fwd.forward), used for whatever lists of this
    backward's it holds (Note [one plan per step]); a plan may serve one backward only (its dK/dV work counter)."""
    grads, delta = _backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                             alibi_slopes, learnable_sink, rng, max_seqlen_q, max_seqlen_k, softmax_scale,
                             window_left, window_right, attention_chunk, softcap, dropout_p, packing, plan)
    if learnable_sink is None:
        return grads
    return [*grads, sink_gradient(learnable_sink, lse, delta)]


def _backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, learnable_sink,
              rng, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, attention_chunk, softcap,
              dropout_p, packing, plan: Optional[Plan]) -> tuple[list[torch.Tensor], Optional[torch.Tensor]]:
    """The gradients of q, k and v, and the delta the dQ kernel wrote (None when nothing ran)."""
    grads, (dq, dk, dv) = _grad_buffers(q, k, v, packing)
    p = op_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, None, learnable_sink,
                   rng, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, attention_chunk,
                   softcap, dropout_p, packing, dout, out, lse)
    q, k, v, dout, out, lse, varlen = p.q, p.k, p.v, p.dout, p.out, p.lse, p.varlen
    if seqused_q is not None:
        dq.zero_()  # rows past seqused_q[b] are ignored by the forward; their gradient is 0
    if seqused_k is not None:
        dk.zero_()
        dv.zero_()
    if q.numel() == 0 or k.numel() == 0:
        for g in grads:
            g.zero_()
        return grads, None
    nheads, nheads_kv, head_dim, dq_gluon, dkdv_gluon = p.nheads, p.nheads_kv, p.head_dim, p.dq_gluon, p.dkdv_gluon
    fp32, dropout = q.dtype == torch.float32, p.dropout_p > 0.0  # the tile table's row (config.tile_config)
    batch, seqlen_q, seqlen_k = p.batch, p.seqlen_q, p.seqlen_k
    plan_k = None
    if varlen:
        # As in the forward, the kernels read each sequence's lengths, clamped to the packed totals passed as their
        # seqlen arguments. The Triton dQ kernel reads its tile from a last-first list of its BLOCK_M
        # (seqlen.tile_coords, LISTED), unless an autotuner may launch it with another BLOCK_M: then it walks the
        # schedule (dq_list_block 0); the Gluon dQ kernel takes items from a last-first list of 2 x its consumer's
        # rows, and the Gluon dK/dV kernel from a first-first list of the key side (ops/call.py decides which).
        _, dq_block, dkdv_block = list_blocks(p.tile_dim, fp32, p.fwd_gluon, dq_gluon, dkdv_gluon, dropout,
                                              p.head_dim_v)
        if plan is None or not plan.has(dq_block, 0):
            plan = varlen_plan(cu_seqlens_q, seqused_q, seqlen_q, cu_seqlens_k, seqused_k, seqlen_k,
                               *plan_lists((dq_block, False), *(((dkdv_block, True),) if p.self_attention else ())))
        # Self-attention: the same lengths on both sides, so the same order (Triton's dK/dV walks the schedule).
        plan_k = plan if p.self_attention and plan.has(0, dkdv_block) else varlen_plan(
            cu_seqlens_k, seqused_k, seqlen_k, cu_seqlens_q, seqused_q, seqlen_q, dkdv_block, False, bool(dkdv_block))
    listed = p.dq_list_block > 0
    qk_scale, softcap2 = logit_scales(softmax_scale, softcap)
    # Written by the dQ kernel for the rows each sequence uses, the only ones dK/dV reads; for the Triton dK/dV
    # kernel `ready` counts them per (sequence, head) (Note [delta handoff] in kernels/bwd.py), which the Triton dQ
    # kernel publishes. After the Gluon dQ kernel (with dropout: Note [dropout on the Gluon path]) delta is
    # complete once dK/dV starts, later on the same stream: its counts start past every length.
    delta = torch.empty_like(lse)
    if dkdv_gluon:
        ready = None
    elif dq_gluon:
        ready = torch.full((batch * nheads,), 2 ** 31 - 1, dtype=torch.int32, device=q.device)
    else:
        ready = torch.zeros(batch * nheads, dtype=torch.int32, device=q.device)
    # The Triton dQ kernel streams K and V through host descriptors (ops/fwd.py, Note [host descriptors]), built
    # only when it runs; the Triton dK/dV kernel through descriptors it builds per (sequence, head).
    host = HOST_DESCRIPTORS and block_d(p.tile_dim) <= HOST_DESCRIPTOR_MAX_D
    desc = (DESC_PACKED.value if varlen else DESC_DENSE.value) if host else DESC_ROW.value
    if host and not dq_gluon:
        block_n = tile_config("bwd_dq", p.tile_dim, fp32, dropout, p.head_dim_v).block_n
        kd, vd = host_desc(k, block_n), host_desc(v, block_n)
    else:
        kd, vd = k, v
    pdl = p.pdl
    seq_args = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    scalars = (qk_scale, softcap2, softmax_scale, p.dropout_p)

    def static(kernel):
        flags = kernel_flags(p.window_left, p.window_right, p.softcap, p.alibi_slopes is not None, varlen,
                             p.seqused_q is not None, p.seqused_k is not None, q.dtype, p.dropout_p,
                             chunk=p.attention_chunk)
        del flags["HAS_SINK"]  # a sink changes only the lse, from which the backward's P comes (sink_gradient)
        constexprs = dict(GROUP=nheads // nheads_kv, PDL=pdl, **head_dims(head_dim, p.head_dim_v), **flags)
        if kernel == "bwd_dq":
            constexprs.update(STEP=schedule_step(batch, varlen and not listed), LISTED=listed, DESC=desc,
                              PUBLISH=not dkdv_gluon)
        else:
            constexprs.update(STEP=schedule_step(batch, varlen))
        strides = (*bmh_strides(q, varlen), *bmh_strides(k, varlen), *bmh_strides(v, varlen),
                   *bmh_strides(dout, varlen))
        tail = (*lse_strides(lse, varlen), alibi_batch_stride(p.alibi_slopes), seqlen_q, seqlen_k, batch,
                p.window_left, p.window_right, p.attention_chunk)
        if kernel == "bwd_dq":
            return Static((*strides, *bmh_strides(out, varlen), *bmh_strides(dq, varlen), *tail), constexprs,
                          lambda block_m, _: tile_grid(block_m, seqlen_q, q.shape[0], batch, nheads, varlen))
        return Static((*strides, *bmh_strides(dk, varlen), *bmh_strides(dv, varlen), *tail), constexprs,
                      lambda _, block_n: tile_grid(block_n, seqlen_k, k.shape[0], batch, nheads_kv, varlen))

    # `static` reads the problem only (the gradients and delta are fresh allocations whose layout the inputs'
    # shapes and the packing fix), so the problem's key is complete (Note [launch cache]).
    key = p.launch_key
    prepare_launch(q)

    def triton_dkdv():
        launch(_bwd_dkdv_kernel, "bwd_dkdv", p.tile_dim, fp32, key,
               (q, k, v, dout, dk, dv, lse, delta, ready, alibi_slopes, *seq_args,
                None if plan_k is None else plan_k.schedule, p.rng, *scalars),
               lambda: static("bwd_dkdv"), pdl=pdl, dropout=dropout, head_dim_v=p.head_dim_v)
        record("bwd_dkdv", TRITON)

    if dq_gluon:
        hopper.bwd_dq(q, k, v, dout, dq, out, lse, delta, qk_scale, softmax_scale, window_left, window_right,
                      cu_seqlens_q, cu_seqlens_k, plan, p.attention_chunk, p.rng, p.dropout_p, key=key)
        record("bwd_dq", HOPPER_PATH)
        if dkdv_gluon:
            hopper.bwd_dkdv(q, k, v, dout, dk, dv, lse, delta, qk_scale, softmax_scale, window_left, window_right,
                            cu_seqlens_q, cu_seqlens_k, plan_k, p.attention_chunk, key=key)
            record("bwd_dkdv", HOPPER_PATH)
        else:
            triton_dkdv()
        return grads, delta
    # The dK/dV kernel may run beside the dQ kernel (PDL): the dQ kernel's descriptor scratch must outlive both
    # launches (Note [scratch under PDL] in ops/launch.py).
    with keep_scratch():
        launch(_bwd_dq_kernel, "bwd_dq", p.tile_dim, fp32, key,
               (q, kd, vd, dout, out, dq, lse, delta, ready, alibi_slopes, *seq_args,
                None if plan is None else plan.last_first if listed else plan.schedule, p.rng, *scalars),
               lambda: static("bwd_dq"), pre_hook=_DQ_BLOCKS, dropout=dropout, head_dim_v=p.head_dim_v)
        record("bwd_dq", TRITON)
        triton_dkdv()
    return grads, delta


@attention_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, learnable_sink, rng,
      max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, attention_chunk, softcap, dropout_p,
      packing):
    if packing == PACK_QKV:
        grads = [q.new_empty(q.shape)]
    elif packing == PACK_KV:
        grads = [q.new_empty(q.shape), k.new_empty(k.shape)]
    else:
        grads = [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)]
    return grads if learnable_sink is None else [*grads, learnable_sink.new_empty(learnable_sink.shape)]
