"""The Hopper dQ kernel: a warp-specialised Gluon kernel for sm_90 (H100/H200), the backward's query-side pass on
the structure of kernels/hopper_fwd.py. It also writes delta = rowsum(dO * O), which the dK/dV kernel
(hopper_bwd.py), launched after it on the same stream, reads.

One program computes dQ for 2 x BLOCK_M query rows of one (sequence, head):

  loader partition (1 warp)            TMA: both Q and dO tiles once, then K_j and V_j into a ring of STAGES slots;
                                       it waits on a slot's `empty` barrier before refilling it
  two consumer partitions (4 warps)    one BLOCK_M-row tile each; first delta from dO (shared memory) and O (pointer
                                       loads), then per key block of its own range:
                                         issue S_j = Q K_jᵀ and dP_j = dO V_jᵀ behind dQ += dS_{j-1} K_{j-1}
                                         wait for dQ's update: arrive on slot j-1's `empty` (count 2)
                                         wait for S_j; P_j = exp2(S_j·scale − lse2)     (under dP_j)
                                         wait for dP_j; dS_j = P_j ∘ (dP_j − delta); issue dQ += dS_j K_j

The program's key range is kv_block_range's for its 2 x BLOCK_M rows; each consumer computes only the blocks of its
own rows' range and passes over the others (it still releases their slots), so under a causal mask the upper
consumer does not spend a block on keys its rows cannot see. Blocks its rows only partly see run with apply_mask
(keys past seqlen_k included). Rows past seqlen_q read lse = +inf: their probabilities are 0 and nothing is stored
for them (descriptors end where the sequence does).

Scope (ops/hopper.py): as the other Gluon kernels, dense and varlen batches, fp16/bf16, D 128, MHA/GQA/MQA, any
lengths, causal and sliding windows. Not softcap, ALiBi, seqused.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_init, warpgroup_mma_wait)

from .hopper_common import pass_over, ring_barriers, seq_desc, tile_entry, tma_load, tma_store
from .masking import LOG2E, apply_mask, kv_block_range
from .seqlen import seq_lengths


@gluon.jit
def _loader(q_desc, do_desc, k_desc, v_desc, q_s, do_s, k_s, v_s, held, ready, empty, b, h, hk, m_start, lo,
            n_blocks, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_VARLEN: gl.constexpr):
    for c in gl.static_range(2):
        bar = held.index(c)
        mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma_load(q_desc, b, m_start + c * BLOCK_M, h, bar, q_s.index(c), IS_VARLEN)
        tma_load(do_desc, b, m_start + c * BLOCK_M, h, bar, do_s.index(c), IS_VARLEN)
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)  # passes at once on a fresh barrier
        bar = ready.index(slot)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, b, lo + j * BLOCK_N, hk, bar, k_s.index(slot), IS_VARLEN)
        tma_load(v_desc, b, lo + j * BLOCK_N, hk, bar, v_s.index(slot), IS_VARLEN)


@gluon.jit
def _delta(do_t, O, o_off, stride_om, m0, seqlen_q, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
           row_layout: gl.constexpr):
    """rowsum(dO * O) of this consumer's rows m0 .. m0 + BLOCK_M - 1, in row_layout; 0 for rows past seqlen_q. dO
    comes from shared memory, O (read nowhere else) by pointer loads."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blk))
    ptrs = O + o_off + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
    o = gl.load(ptrs, mask=gl.expand_dims(rows < seqlen_q, 1), other=0.0).to(gl.float32)
    do = do_t.load(blk).to(gl.float32)
    return gl.convert_layout(gl.sum(o * do, 1), row_layout)


@gluon.jit
def _consumer(c: gl.constexpr, dq_desc, O, LSE, DELTA, q_s, do_s, k_s, v_s, held, ready, empty, b, h, m_start, lo,
              n_blocks, o_off, stride_om, lse_off, seqlen_q, seqlen_k, wl, wr, qk_scale, softmax_scale,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr):
    dtype: gl.constexpr = dq_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    diag = seqlen_k - seqlen_q
    m0 = m_start + c * BLOCK_M
    rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
    q_t = q_s.index(c).reshape([BLOCK_M, HEAD_DIM])
    do_t = do_s.index(c).reshape([BLOCK_M, HEAD_DIM])
    # This consumer's own key blocks: a contiguous part [j0, j1) of the program's, whose mask-free part is
    # [f0, f1) (kv_block_range for its BLOCK_M rows, in blocks from the program's lo).
    own_lo, own_full_lo, own_full_hi, own_hi = kv_block_range(m0, seqlen_q, seqlen_k, wl, wr, BLOCK_M, BLOCK_N,
                                                              MASK_LEFT, MASK_RIGHT)
    j0 = gl.minimum(gl.maximum((own_lo - lo) // BLOCK_N, 0), n_blocks)
    j1 = gl.minimum(gl.maximum((own_hi - lo + BLOCK_N - 1) // BLOCK_N, j0), n_blocks)
    j1 = gl.where(m0 < seqlen_q, j1, j0)  # rows all past the sequence (the last tile's upper half): no work
    mbarrier.wait(held.index(c), 0)
    delta = _delta(do_t, O, o_off, stride_om, m0, seqlen_q, HEAD_DIM, BLOCK_M, row_layout)
    gl.store(DELTA + lse_off + rows, delta, mask=rows < seqlen_q)
    lse2 = gl.load(LSE + lse_off + rows, mask=rows < seqlen_q, other=float("inf")) * LOG2E
    # An async accumulator from the start: dQ's update stays in flight across loop iterations.
    dq = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=acc_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    pass_over(0, j0, ready, empty, STAGES)
    for j in range(j0, j1):
        slot = j % STAGES
        n0 = lo + j * BLOCK_N
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        k_t = k_s.index(slot).reshape([BLOCK_N, HEAD_DIM])
        v_t = v_s.index(slot).reshape([BLOCK_N, HEAD_DIM])
        s = warpgroup_mma(q_t, k_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_t, v_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # Groups complete in order: with S_j and dP_j behind it, two outstanding means dQ's update from block j - 1
        # is done, and with it the last read of that block's K (on the first block there is none to wait for).
        dq = warpgroup_mma_wait(num_outstanding=2, deps=(dq,))
        if j > j0:
            mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        if (n0 < own_full_lo) | (n0 >= own_full_hi):
            cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s2 = apply_mask(s * qk_scale, gl.expand_dims(rows, 1), gl.expand_dims(cols, 0), seqlen_k, diag, wl, wr,
                            MASK_LEFT, MASK_RIGHT, True)
            p = gl.exp2(s2 - gl.expand_dims(lse2, 1))
        else:
            p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        ds = p * (dp - gl.expand_dims(delta, 1))
        dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), k_t, dq, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
    if j1 > j0:
        mbarrier.arrive(empty.index((j1 - 1) % STAGES), count=1)
    pass_over(j1, n_blocks, ready, empty, STAGES)
    if m0 < seqlen_q:  # else no row of this tile is in the sequence (or the program is past the varlen list)
        q_t.store((dq * softmax_scale).to(dtype))  # Q is no longer read: its buffer stages dQ for the TMA store
        fence_async_shared()
        tma_store(dq_desc, b, m0, h, q_s.index(c), IS_VARLEN)
        tma.store_wait(pendings=0)


# Parameters: the per-call ones (descriptors, pointers, float scalars) first, then the integers, then constexprs.
@gluon.jit
def _hopper_dq_kernel(Q, K, V, DO, DQ, O, LSE, DELTA, TILES, CU_SEQLENS_Q, CU_SEQLENS_K, qk_scale, softmax_scale,
                      stride_lb, stride_lh, seqlen_q, seqlen_k, wl, wr,
                      stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh, stride_dom, stride_doh,
                      stride_dqm, stride_dqh, stride_ob, stride_om, stride_oh, nheads, nheads_kv,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, GROUP: gl.constexpr, MASK_LEFT: gl.constexpr,
                      MASK_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr, M_LAYOUT: gl.constexpr,
                      N_LAYOUT: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    """Dense: Q, K, V, DO, DQ are host descriptors over (B, S, H, D) and the grid is (query tiles of 2 x BLOCK_M
    rows, H, B); varlen: the packed tensors and (the tile list's bound, H), as in hopper_fwd.py's kernel. O is a
    pointer either way (read once per row, for delta), with its (batch, row, head) strides."""
    gl.static_assert(BLOCK_N == BLOCK_M, "the two consumers' ranges differ by whole key blocks")
    h = gl.program_id(1)
    hk = h // GROUP
    if IS_VARLEN:
        b, pid_m, valid = tile_entry(TILES)
        q_start, seqlen_q = seq_lengths(b, valid, CU_SEQLENS_Q, None, seqlen_q, False)
        q_start = q_start.to(gl.int64)  # 64-bit row offsets: a packed total may hold more than 2^31 elements
        k_start, seqlen_k = seq_lengths(b, valid, CU_SEQLENS_K, None, seqlen_k, False)
        k_start = k_start.to(gl.int64)
        q_desc = seq_desc(Q, q_start, seqlen_q, stride_qm, stride_qh, nheads, BLOCK_M, HEAD_DIM, M_LAYOUT)
        do_desc = seq_desc(DO, q_start, seqlen_q, stride_dom, stride_doh, nheads, BLOCK_M, HEAD_DIM, M_LAYOUT)
        dq_desc = seq_desc(DQ, q_start, seqlen_q, stride_dqm, stride_dqh, nheads, BLOCK_M, HEAD_DIM, M_LAYOUT)
        k_desc = seq_desc(K, k_start, seqlen_k, stride_km, stride_kh, nheads_kv, BLOCK_N, HEAD_DIM, N_LAYOUT)
        v_desc = seq_desc(V, k_start, seqlen_k, stride_vm, stride_vh, nheads_kv, BLOCK_N, HEAD_DIM, N_LAYOUT)
    else:
        # The last query tiles first: under a causal mask they see the most keys.
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
        b = gl.program_id(2)
        q_start = 0
        q_desc, k_desc, v_desc, do_desc, dq_desc = Q, K, V, DO, DQ
    m_start = pid_m * 2 * BLOCK_M
    lo, full_lo, full_hi, hi = kv_block_range(m_start, seqlen_q, seqlen_k, wl, wr, 2 * BLOCK_M, BLOCK_N,
                                              MASK_LEFT, MASK_RIGHT)
    n_blocks = (hi - lo + BLOCK_N - 1) // BLOCK_N
    if IS_VARLEN:
        n_blocks = gl.where(valid, n_blocks, 0)
    lse_off = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + q_start
    o_off = b.to(gl.int64) * stride_ob + q_start * stride_om + h.to(gl.int64) * stride_oh
    dtype: gl.constexpr = q_desc.dtype
    if IS_VARLEN:
        q_s = gl.allocate_shared_memory(dtype, [2, BLOCK_M, 1, HEAD_DIM], q_desc.layout)
        do_s = gl.allocate_shared_memory(dtype, [2, BLOCK_M, 1, HEAD_DIM], do_desc.layout)
        k_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
        v_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    else:
        q_s = gl.allocate_shared_memory(dtype, [2, 1, BLOCK_M, 1, HEAD_DIM], q_desc.layout)
        do_s = gl.allocate_shared_memory(dtype, [2, 1, BLOCK_M, 1, HEAD_DIM], do_desc.layout)
        k_s = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
        v_s = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    held, ready, empty = ring_barriers(STAGES)
    gl.warp_specialize([
        (_consumer, (0, dq_desc, O, LSE, DELTA, q_s, do_s, k_s, v_s, held, ready, empty, b, h, m_start, lo,
                     n_blocks, o_off, stride_om, lse_off, seqlen_q, seqlen_k, wl, wr, qk_scale, softmax_scale,
                     HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, MASK_LEFT, MASK_RIGHT, IS_VARLEN)),
        (_consumer, (1, dq_desc, O, LSE, DELTA, q_s, do_s, k_s, v_s, held, ready, empty, b, h, m_start, lo,
                     n_blocks, o_off, stride_om, lse_off, seqlen_q, seqlen_k, wl, wr, qk_scale, softmax_scale,
                     HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, MASK_LEFT, MASK_RIGHT, IS_VARLEN)),
        (_loader, (q_desc, do_desc, k_desc, v_desc, q_s, do_s, k_s, v_s, held, ready, empty, b, h, hk, m_start, lo,
                   n_blocks, BLOCK_M, BLOCK_N, STAGES, IS_VARLEN)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
