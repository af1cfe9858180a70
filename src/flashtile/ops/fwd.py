"""Forward launcher and the `flashtile::fwd` custom op (dense, varlen and paged-varlen share it).

Grid: dense (query tiles, query heads, sequences), the tile axis fastest, so that programs running together read
the same K/V head and share it through L2; varlen (query heads, query-tile list), whose list holds the tiles of
every sequence, built on the device and bounded by the packed total, not by max_seqlen_q (Note [varlen tile list]
in kernels/seqlen.py), with the heads fastest because a packed row holds every head (Note [varlen grid order] in
kernels/hopper_fwd.py). Tiles start longest first: the last query tiles of a sequence first (under a causal mask
they do the most work), and in a varlen batch the sequences with the most keys first (Note [longest sequences
first]). That is list scheduling with the longest tiles first, which keeps every SM busy to the end of a mixed
batch without a host synchronisation and without a persistent kernel's queue. The Hopper fast path's varlen
forward is persistent: its programs take the same list's items, in order, from a work counter (Note [persistent
varlen forward] in kernels/hopper_fwd.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import block_d, tile_config
from ..kernels.fwd import _attn_fwd_kernel
from ..kernels.seqlen import DESC_DENSE, DESC_PACKED, DESC_ROW
from ..problem import kernel_flags
from .common import alibi_batch_stride, custom_op, fast_divisor, unpack
from .descriptors import bmh_strides, descriptor_blocks, host_desc
from .schedule import Plan, list_blocks, plan_lists, schedule_step, tile_grid, varlen_plan
from . import hopper
from .call import op_problem
from .hopper import HOPPER_PATH, TRITON, record
from .launch import Static, head_dims, launch, prepare_launch

# Whether dense batches get host-built descriptors (Note [host descriptors]; docs/design/descriptors.md has the
# measurements of both ways), and varlen batches always take the other path. Only up to the head dims where it
# was measured: at d256 the Q tile the host path holds in registers takes the forward from 223 to 254 registers
# (no spill, per tests/sm90_compile.py --ptxas), which is untimed.
HOST_DESCRIPTORS = True
HOST_DESCRIPTOR_MAX_D = 128
_FWD_BLOCKS = descriptor_blocks({"Q": ("BLOCK_M", "BLOCK_D"), "O": ("BLOCK_M", "BLOCK_DV"),
                                 "K": ("BLOCK_N", "BLOCK_D"), "V": ("BLOCK_N", "BLOCK_DV")})


def logit_scales(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, softcap2) as the kernels take them; see masking.logits."""
    log2e = 1.4426950408889634
    if softcap > 0.0:
        return softmax_scale / softcap, softcap * log2e
    return softmax_scale * log2e, 0.0


def out_shape(q: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """q's shape with v's head dim (the two differ in MLA prefill)."""
    return (*q.shape[:-1], v.shape[-1])


def lse_shape(q: torch.Tensor, varlen: bool) -> tuple[int, ...]:
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int]:
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


@custom_op("flashtile::fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
    seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor], learnable_sink: Optional[torch.Tensor], rng: Optional[torch.Tensor],
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
    attention_chunk: int,
    softcap: float, dropout_p: float, packing: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, lse). Dense: q (B, Sq, H, D), lse (B, H, Sq). Varlen: q (total_q, H, D), lse (H, total_q).
    out has q's shape with v's head dim, which may differ from q's and k's.

    With block_table (varlen only), k and v are paged caches (num_blocks, page_size, Hk, D) read without TMA, so
    they are neither copied nor aligned here. With dropout_p > 0, rng is the call's seed and stream
    (ops/dropout.draw_rng), which the backward takes again. learnable_sink: fp32 (H,), a logit per query head that
    joins the softmax's denominator (and the lse).
    """
    out, lse, _ = forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, block_table,
                          learnable_sink, rng,
                          max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, attention_chunk,
                          softcap, dropout_p,
                          packing)
    return out, lse


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, block_table, learnable_sink,
            rng, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, attention_chunk, softcap,
            dropout_p, packing, for_backward: bool = False) -> tuple[torch.Tensor, torch.Tensor, Optional[Plan]]:
    """attention_fwd's implementation; also returns a varlen call's plan (ops/schedule.varlen_plan, else None). With
    `for_backward` that plan also holds the lists the backward's kernels read where one plan can (self-attention,
    lists of one block: Note [one plan per step] in ops/bwd.py), so that the backward launches none."""
    p = op_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, block_table,
                   learnable_sink, rng, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
                   attention_chunk, softcap, dropout_p, packing)
    q, k, v, varlen, paged, gluon = p.q, p.k, p.v, p.varlen, p.paged, p.fwd_gluon
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim = (p.batch, p.seqlen_q, p.seqlen_k, p.nheads, p.nheads_kv,
                                                              p.head_dim)
    out = torch.empty(out_shape(q, v), dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_shape(q, varlen), dtype=torch.float32, device=q.device)
    if seqused_q is not None:
        # Rows past seqused_q[b] are not computed; give them the values of a row that sees no key.
        out.zero_()
        lse.fill_(float("inf"))
    if out.numel() == 0:
        return out, lse, None
    plan = None
    if varlen:
        # The kernel reads each sequence's lengths, clamped to the bounds its seqlen arguments carry
        # (kernels/seqlen.py: seq_info; ops/call.OpProblem).
        fwd_block, dq_block, dkdv_block = list_blocks(p.tile_dim, q.dtype == torch.float32, gluon, p.dq_gluon,
                                                     p.dkdv_gluon, p.dropout_p > 0.0, p.head_dim_v)
        backward = for_backward and p.self_attention
        lists = plan_lists((fwd_block, False), *(((dq_block, False), (dkdv_block, True)) if backward else ()))
        plan = varlen_plan(cu_seqlens_q, seqused_q, seqlen_q, cu_seqlens_k, seqused_k, seqlen_k, *lists,
                           cost_packed=not paged)
    qk_scale, softcap2 = logit_scales(softmax_scale, softcap)
    if gluon:
        # Note [hopper path] in ops/hopper.py
        hopper.fwd(q, k, v, out, lse, qk_scale, window_left, window_right, cu_seqlens_q, cu_seqlens_k, plan,
                   p.learnable_sink, p.attention_chunk, p.rng, p.dropout_p, key=p.launch_key)
        record("fwd", HOPPER_PATH)
        return out, lse, plan
    record("fwd", TRITON)
    # Note [host descriptors]: a dense batch's sequences all end at row S, so one descriptor per tensor, built
    # here and passed as a kernel parameter, bounds every sequence, in place of descriptors built per program on
    # the device (a global-memory write and a proxy fence each, a fixed cost that weighs most on short sequences,
    # where each program runs few key blocks). A packed varlen batch gets host descriptors over (total, H, D) for
    # Q, K and V, whose boxes may cross into the next sequence (kernels/fwd.py: DESC says why that is safe), and
    # keeps a per-sequence one for O. Measured on the H200 (docs/design/descriptors.md): the dense forward 4-23%
    # faster at S = 1k-4k, the varlen forward 9-11% on 16 sequences of 256-4096 tokens. The backward's dQ kernel
    # streams K and V through the same host descriptors and reads the tiles it holds with pointer loads
    # (kernels/bwd.py: Memory); host descriptors for every tile ran 6-9% slower (the held tiles spilled).
    host = HOST_DESCRIPTORS and not paged and k.numel() > 0 and block_d(p.tile_dim) <= HOST_DESCRIPTOR_MAX_D
    parts = p.v_parts  # Note [V parts] in kernels/fwd.py: the programs see v's head dim as one part's
    part_dv = p.head_dim_v // parts
    # Plain ints: comparing the kernels' tl.constexpr constants costs a microsecond each.
    desc = (DESC_PACKED.value if varlen else DESC_DENSE.value) if host else DESC_ROW.value
    if desc == DESC_ROW.value:
        qd, kd, vd, od = q, k, v, out
    else:
        cfg = tile_config("fwd", p.tile_dim, q.dtype == torch.float32, p.dropout_p > 0.0, part_dv)
        qd, kd, vd = host_desc(q, cfg.block_m), host_desc(k, cfg.block_n), host_desc(v, cfg.block_n)
        # A packed batch's O is stored through per-sequence descriptors (kernels/fwd.py: DESC).
        od = host_desc(out, cfg.block_m) if desc == DESC_DENSE.value else out

    def static():
        flags = kernel_flags(p.window_left, p.window_right, p.softcap, p.alibi_slopes is not None, varlen,
                             p.seqused_q is not None, p.seqused_k is not None, q.dtype, p.dropout_p,
                             p.learnable_sink is not None, p.attention_chunk)
        # A paged cache is (num_blocks, page_size, Hk, D): its "batch" and row strides are the page and in-page
        # ones.
        kv_strides = (*bmh_strides(k, varlen and not paged), *bmh_strides(v, varlen and not paged))
        stride_btb, page_size, num_pages = ((p.block_table.stride(0), k.shape[1], k.shape[0]) if paged
                                            else (0, 1, batch))
        args = (*bmh_strides(q, varlen), *kv_strides, *bmh_strides(out, varlen), *lse_strides(lse, varlen),
                alibi_batch_stride(p.alibi_slopes), stride_btb, seqlen_q, seqlen_k, batch, page_size,
                *fast_divisor(page_size), num_pages, p.window_left, p.window_right, p.attention_chunk)
        constexprs = dict(GROUP=nheads // nheads_kv, PAGED=paged, DESC=desc, STEP=schedule_step(batch, varlen),
                          **head_dims(head_dim, part_dv), V_PARTS=parts, **flags)
        return Static(args, constexprs, lambda block_m, _: tile_grid(block_m, seqlen_q, q.shape[0], batch,
                                                                      nheads * parts, varlen))

    # `static` reads the problem only (out and lse are fresh allocations whose layout q's and v's shapes fix), so the
    # problem's key is complete (Note [launch cache]).
    prepare_launch(q)
    launch(_attn_fwd_kernel, "fwd", p.tile_dim, q.dtype == torch.float32, p.launch_key,
           (qd, kd, vd, od, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
            None if plan is None else plan.schedule, block_table, p.rng, p.learnable_sink, qk_scale, softcap2,
            p.dropout_p),
           static, pre_hook=_FWD_BLOCKS, dropout=p.dropout_p > 0.0, head_dim_v=part_dv)
    return out, lse, plan


@attention_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, block_table, learnable_sink, rng,
      max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, attention_chunk, softcap, dropout_p,
      packing):
    q, _, v = unpack(q, k, v, packing)
    varlen = cu_seqlens_q is not None
    return (q.new_empty(out_shape(q, v)), q.new_empty(lse_shape(q, varlen), dtype=torch.float32))
