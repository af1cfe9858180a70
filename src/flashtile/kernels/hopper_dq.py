"""The Hopper dQ kernel: a warp-specialised Gluon kernel for sm_90 (H100/H200), the backward's query-side pass on the
structure of kernels/hopper_fwd.py. It also writes delta = rowsum(dO * O), which the dK/dV kernel (hopper_bwd.py),
launched after it on the same stream, reads.

One program computes dQ for 2 x BLOCK_M query rows of one (sequence, head) of a dense batch:

  loader partition (1 warp)            TMA: both consumers' Q and dO tiles once, then K_j and V_j into a ring of
                                       STAGES slots; it waits on a slot's `empty` barrier before refilling it
  two consumer partitions (4 warps)    one BLOCK_M-row tile each: first delta from dO (shared memory) and O (pointer
                                       loads), then per key block of its own rows' range:
                                         issue S_j = Q K_jᵀ and dP_j = dO V_jᵀ; wait for S_j only
                                         P_j = exp2(S_j·scale − lse2)                 (under dP_j)
                                         wait for dP_j; dS_j = P_j ∘ (dP_j − delta)
                                         issue dQ += dS_j K_j and wait for it; arrive on slot j's `empty`

The dQ update is waited for in its own block (Note [dQ update in its block]). The program's key range is
kv_block_range's for its 2 x BLOCK_M rows; each consumer computes only the blocks of its own rows' range and passes
over the others (it still waits for and releases their slots), so under a causal mask the upper consumer does not
spend a block on keys its rows cannot see. Blocks its rows only partly see run with apply_mask (keys past seqlen_k
included). Rows past seqlen_q read lse = +inf: their probabilities are 0, and the descriptors, which end where the
sequence does, drop their dQ rows.

Note [dQ update in its block]: with the update kept in flight into the next block (issued behind that block's S
and dP, as the forward keeps P V in flight under the softmax), the accumulators in flight outgrew what ptxas had
registers for, and it serialised every wgmma of the kernel (C7512): the kernel was then 3-6% slower over forward
+ backward than the Triton dQ (PERF.md, S8-9). Waited for in its block, ptxas keeps the wgmma asynchronous, and
the two consumer warpgroups still overlap one another's updates: on the H200, gradients whose checksums equal the
Triton dQ kernel's, forward+backward 1.2-2.8% faster on dense batches at S = 1k-16k (PERF.md, v18).

Scope (ops/hopper.py, ops/bwd.py): dense batches, fp16/bf16, D 128, MHA/GQA/MQA, any lengths, causal and sliding
windows. Varlen batches run the Triton dQ kernel (kernels/bwd.py); not softcap, ALiBi, seqused.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

from .hopper_common import dense_query_tile, ring_barriers, tile_buffers, tma_load, tma_store
from .masking import LOG2E, apply_mask, kv_block_range


@gluon.jit
def _loader(q_desc, do_desc, k_desc, v_desc, q_s, do_s, k_s, v_s, held, ready, empty, b, h, hk, m_start, lo,
            n_blocks, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    for c in gl.static_range(2):
        bar = held.index(c)
        mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma_load(q_desc, b, m_start + c * BLOCK_M, h, bar, q_s.index(c), False)
        tma_load(do_desc, b, m_start + c * BLOCK_M, h, bar, do_s.index(c), False)
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)  # passes at once on a fresh barrier
        bar = ready.index(slot)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, b, lo + j * BLOCK_N, hk, bar, k_s.index(slot), False)
        tma_load(v_desc, b, lo + j * BLOCK_N, hk, bar, v_s.index(slot), False)


@gluon.jit
def _pass_over(j0, j1, ready, empty, STAGES: gl.constexpr):
    """Blocks [j0, j1) of the ring that this consumer does not compute: it waits for each slot's fill (an arrival
    before it would complete the slot's phase while the other consumer may still read it) and releases it."""
    for j in range(j0, j1):
        mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)
        mbarrier.arrive(empty.index(j % STAGES), count=1)


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
              MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
    dtype: gl.constexpr = q_s.dtype
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
    # [own_full_lo, own_full_hi) (kv_block_range for its BLOCK_M rows).
    own_lo, own_full_lo, own_full_hi, own_hi = kv_block_range(m0, seqlen_q, seqlen_k, wl, wr, BLOCK_M, BLOCK_N,
                                                              MASK_LEFT, MASK_RIGHT)
    j0 = gl.minimum(gl.maximum((own_lo - lo) // BLOCK_N, 0), n_blocks)
    j1 = gl.minimum(gl.maximum((own_hi - lo + BLOCK_N - 1) // BLOCK_N, j0), n_blocks)
    j1 = gl.where(m0 < seqlen_q, j1, j0)  # rows all past the sequence (the last tile's upper half): no work
    mbarrier.wait(held.index(c), 0)
    delta = _delta(do_t, O, o_off, stride_om, m0, seqlen_q, HEAD_DIM, BLOCK_M, row_layout)
    gl.store(DELTA + lse_off + rows, delta, mask=rows < seqlen_q)
    lse2 = gl.load(LSE + lse_off + rows, mask=rows < seqlen_q, other=float("inf")) * LOG2E
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    _pass_over(0, j0, ready, empty, STAGES)
    for j in range(j0, j1):
        slot = j % STAGES
        n0 = lo + j * BLOCK_N
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        k_t = k_s.index(slot).reshape([BLOCK_N, HEAD_DIM])
        v_t = v_s.index(slot).reshape([BLOCK_N, HEAD_DIM])
        s = warpgroup_mma(q_t, k_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_t, v_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
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
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))  # Note [dQ update in its block]
        mbarrier.arrive(empty.index(slot), count=1)  # this consumer has read K_j and V_j
    _pass_over(j1, n_blocks, ready, empty, STAGES)
    if m0 < seqlen_q:  # else no row of this tile is in the sequence
        q_t.store((dq * softmax_scale).to(dtype))  # Q is no longer read: its buffer stages dQ for the TMA store
        fence_async_shared()
        tma_store(dq_desc, b, m0, h, q_s.index(c), False)
        tma.store_wait(pendings=0)


# Parameters: the per-call ones (descriptors, pointers, float scalars) first, then the integers, then constexprs.
@gluon.jit
def _hopper_dq_kernel(Q, K, V, DO, DQ, OUT, LSE, DELTA, qk_scale, softmax_scale,
                      stride_lb, stride_lh, stride_ob, stride_om, stride_oh, seqlen_q, seqlen_k, wl, wr,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, GROUP: gl.constexpr, MASK_LEFT: gl.constexpr,
                      MASK_RIGHT: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    """Q, K, V, DO, DQ are host descriptors over (B, S, H, D) and the grid is (query tiles of 2 x BLOCK_M rows, H,
    B). OUT is the forward's output, a pointer (read once per row, for delta) with its (batch, row, head)
    strides; LSE and DELTA share theirs."""
    gl.static_assert(BLOCK_N == BLOCK_M, "the two consumers' ranges differ by whole key blocks")
    b, h, m_start, lo, _, _, n_blocks, lse_off = dense_query_tile(seqlen_q, seqlen_k, wl, wr, stride_lb, stride_lh,
                                                                  BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    o_off = b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
    q_s = tile_buffers(Q, 2, BLOCK_M, HEAD_DIM, False)
    do_s = tile_buffers(DO, 2, BLOCK_M, HEAD_DIM, False)
    k_s = tile_buffers(K, STAGES, BLOCK_N, HEAD_DIM, False)
    v_s = tile_buffers(V, STAGES, BLOCK_N, HEAD_DIM, False)
    held, ready, empty = ring_barriers(STAGES, 2)
    gl.warp_specialize([
        (_consumer, (0, DQ, OUT, LSE, DELTA, q_s, do_s, k_s, v_s, held, ready, empty, b, h, m_start, lo, n_blocks,
                     o_off, stride_om, lse_off, seqlen_q, seqlen_k, wl, wr, qk_scale, softmax_scale, HEAD_DIM,
                     BLOCK_M, BLOCK_N, STAGES, MASK_LEFT, MASK_RIGHT)),
        (_consumer, (1, DQ, OUT, LSE, DELTA, q_s, do_s, k_s, v_s, held, ready, empty, b, h, m_start, lo, n_blocks,
                     o_off, stride_om, lse_off, seqlen_q, seqlen_k, wl, wr, qk_scale, softmax_scale, HEAD_DIM,
                     BLOCK_M, BLOCK_N, STAGES, MASK_LEFT, MASK_RIGHT)),
        (_loader, (Q, DO, K, V, q_s, do_s, k_s, v_s, held, ready, empty, b, h, h // GROUP, m_start, lo, n_blocks,
                   BLOCK_M, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
