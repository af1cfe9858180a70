"""The Hopper forward for a head dim too wide for one warpgroup's accumulator (q, k, v 512: Gemma 4's global
layers): a warp-specialised Gluon kernel for sm_90 whose two consumer warpgroups split the head dim between them.

Note [split columns]: at d512 a 64-row O tile in fp32 is 128 KiB, half the SM's register file: one warpgroup
cannot hold it beside S, and two warpgroups each holding 64 rows (hopper_fwd.py's structure) would need all of it.
So both consumers work on the same 64 query rows, consumer c on columns [256 c, 256 c + 256) of Q, K, V and O:

  loader partition (1 warp)            TMA: the tile's Q (both halves), then K_j and V_j (both halves) into rings
                                       of STAGES slots
  consumer c (4 warps)                 per key block: issue S_j^c = Q^c (K_j^c)ᵀ, a partial sum over its 256 columns,
                                       and O^c += P_{j-1} V_{j-1}^c under it; hand S_j^c to the other consumer
                                       through shared memory and add the other's; the online softmax of the sum
                                       (under P_{j-1} V_{j-1}^c); wait for the P V update

Each consumer does half of Q Kᵀ's FLOPs and half of P V's, and computes P itself: both add the same two fp32
partials (in the other order, and fp32 addition commutes), so their S, their row statistics and their P agree bit
for bit, and P never leaves registers. What that costs: the two consumers meet once a key block, so neither's
softmax hides under the other's matmuls (the 128 kernel's ping-pong), only under its own P V; the exchange is
2 x BLOCK_M x BLOCK_N x 4 bytes of shared traffic a block each way, and the softmax runs twice, which at 1024
matmul FLOPs an entry is small. The V-parts Triton forward this replaces computed all of Q Kᵀ in each of two
programs (Note [V parts] in fwd.py: 1.5x the FLOPs).

Shared memory at BLOCK_M = 64, BLOCK_N = 32, 2 stages: Q 64 KiB, K and V 2 x 32 KiB each, the exchange 2
consumers x 2 parities x 8 KiB: 224 KiB of the 227 an sm_90 block may have. The exchange buffers alternate by key
block (parity), so that a consumer never overwrites the partial the other may still be reading: it writes block
j's into the buffer of block j - 2, which the other has read before it arrived for block j - 1.

One program per (tile, sequence, head), not persistent: a d512 item runs long (a 4k sequence: 128 key blocks
against a fixed cost of some 3 blocks, Note [persistent forward] in hopper_fwd.py), and the persistent kernel's
second Q set would not fit. Scope as hopper_fwd.py's (dense and varlen, causal, windows, chunks, sinks, GQA,
dropout), but no half last block. Not softcap, ALiBi, seqused or paged K/V (ops/hopper.py).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

from .dropout import dropout_state, packed_threshold
from .hopper_common import (Ring, barrier_array, dense_work_item, ring_barriers, store_rows, tile_buffers, tma_load,
                            tma_store, work_item)
from .hopper_fwd import _acc_layout, _last_pv, _p_layout, _scores, _softmax
from .masking import LN2, LOG2E, kv_block_range
from .softmax import sink_state


@gluon.jit
def _item(TILES, CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k, wl, wr, chunk, heads, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, MASK_CHUNK: gl.constexpr,
          IS_VARLEN: gl.constexpr):
    """This program's tile, which every partition derives for itself: (valid, b, h, m_start, q_row0, seqlen_q,
    k_row0, seqlen_k, lo, full_lo, full_hi, n_blocks), in the order of the 128 kernel's items (the last tile of a
    sequence first). seqlen_q and seqlen_k: a dense batch's lengths, a varlen batch's packed totals. A varlen
    grid covers its list's bound on the tiles (ops/schedule.varlen_plan, sized on the host): a program past the
    list's end is invalid, with no key blocks, and writes nothing."""
    w = gl.program_id(0)
    if IS_VARLEN:
        valid, b, h, tile, q_row0, sq, k_row0, sk = work_item(w, heads, TILES, CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q,
                                                              seqlen_k, BLOCK_M, True, False)
    else:
        b, h, tile = dense_work_item(w, heads, seqlen_q, BLOCK_M, True)
        valid, q_row0, sq, k_row0, sk = True, 0, seqlen_q, 0, seqlen_k
    m_start = tile * BLOCK_M
    lo, full_lo, full_hi, hi = kv_block_range(m_start, sq, sk, wl, wr, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT,
                                              chunk, MASK_CHUNK)
    n_blocks = gl.where(valid, gl.maximum(hi - lo + BLOCK_N - 1, 0) // BLOCK_N, 0)
    return valid, b, h, m_start, q_row0, sq, k_row0, sk, lo, full_lo, full_hi, n_blocks


@gluon.jit
def _loader(q_desc, q2_desc, k_desc, k2_desc, v_desc, v2_desc, q_s, k_s, k2_s, v_s, v2_s, q_bar, k_ring, v_ring,
            TILES, CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k, wl, wr, chunk, heads, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, GROUP: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
            MASK_CHUNK: gl.constexpr, IS_VARLEN: gl.constexpr):
    """Q's two halves on q_bar, then each key block's K halves and V halves on their rings' slots."""
    valid, b, h, m_start, q_row0, sq, k_row0, sk, lo, full_lo, full_hi, n_blocks = _item(
        TILES, CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k, wl, wr, chunk, heads, BLOCK_M, BLOCK_N, MASK_LEFT,
        MASK_RIGHT, MASK_CHUNK, IS_VARLEN)
    if not valid:
        return
    hk = h // GROUP
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma_load(q_desc, b, q_row0 + m_start, h, q_bar, q_s.index(0), IS_VARLEN)
    tma_load(q2_desc, b, q_row0 + m_start, h, q_bar, q_s.index(1), IS_VARLEN)
    for j in range(n_blocks):
        row = k_row0 + lo + j * BLOCK_N
        k_ring.wait_empty(j)
        mbarrier.expect(k_ring.ready_bar(j), 2 * k_desc.block_type.nbytes)
        tma_load(k_desc, b, row, hk, k_ring.ready_bar(j), k_s.index(k_ring.slot(j)), IS_VARLEN)
        tma_load(k2_desc, b, row, hk, k_ring.ready_bar(j), k2_s.index(k_ring.slot(j)), IS_VARLEN)
        v_ring.wait_empty(j)
        mbarrier.expect(v_ring.ready_bar(j), 2 * v_desc.block_type.nbytes)
        tma_load(v_desc, b, row, hk, v_ring.ready_bar(j), v_s.index(v_ring.slot(j)), IS_VARLEN)
        tma_load(v2_desc, b, row, hk, v_ring.ready_bar(j), v2_s.index(v_ring.slot(j)), IS_VARLEN)


@gluon.jit
def _exchange(c: gl.constexpr, s, x_s, x_bar, j):
    """Consumer c's partial S of key block j, summed with the other consumer's: its own into exchange buffer
    (c, j % 2), the other's read from (1 - c, j % 2) once that consumer has arrived on its barrier (Note [split
    columns]). The partition's thread barrier orders all its threads' stores before the one thread's arrival."""
    par = j % 2
    mine = x_s.index(2 * c + par)
    mine.store(s)
    gl.thread_barrier()
    mbarrier.arrive(x_bar.index(2 * c + par), count=1)
    mbarrier.wait(x_bar.index(2 * (1 - c) + par), (j // 2) & 1)
    return s + x_s.index(2 * (1 - c) + par).load(s.type.layout)


@gluon.jit
def _consumer(c: gl.constexpr, o_desc, O_PTR, LSE, SINK, RNG, q_s, k_s, v_s, x_s, x_bar, q_bar, k_ring, v_ring,
              TILES, CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k, wl, wr, chunk, heads, qk_scale, dropout_p,
              stride_lb, stride_lh, stride_om, stride_oh, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, MASK_CHUNK: gl.constexpr,
              IS_VARLEN: gl.constexpr, HAS_SINK: gl.constexpr, HAS_DROPOUT: gl.constexpr):
    """Consumer c: columns [c HEAD_DIM, (c + 1) HEAD_DIM) of the tile's O, from its halves q_s.index(c), k_s and
    v_s of Q, K and V (Note [split columns]). Consumer 0 writes the LSE."""
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = _acc_layout(BLOCK_N)
    o_layout: gl.constexpr = _acc_layout(HEAD_DIM)
    p_layout: gl.constexpr = _p_layout(HEAD_DIM)
    valid, b, h, m_start, q_row0, sq, k_row0, sk, lo, full_lo, full_hi, n_blocks = _item(
        TILES, CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k, wl, wr, chunk, heads, BLOCK_M, BLOCK_N, MASK_LEFT,
        MASK_RIGHT, MASK_CHUNK, IS_VARLEN)
    if not valid:
        return
    drop_scale = 1.0
    drop = (0, 0, 0, 0, 0)
    if HAS_DROPOUT:
        seed, stream, threshold, drop_scale = dropout_state(RNG, dropout_p)
        drop_c, drop_t = packed_threshold(threshold)
        drop = (seed, stream, b * heads + h, drop_c, drop_t)
    diag = sk - sq
    q_tile = q_s.index(c).reshape([BLOCK_M, HEAD_DIM])
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    rows = m_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    mbarrier.wait(q_bar, 0)
    if n_blocks > 0:
        k_ring.wait_ready(0)
        s = _scores(q_tile, q_tile, k_s, k_s, k_ring.slot(0), BLOCK_N, HEAD_DIM, 0, BLOCK_M, BLOCK_N)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        k_ring.release(0)
        s = _exchange(c, s, x_s, x_bar, 0)
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, rows, lo, (lo < full_lo) | (lo >= full_hi), sk, diag, wl, wr,
                                      chunk, qk_scale, drop, BLOCK_N, s_layout, MASK_LEFT, MASK_RIGHT, MASK_CHUNK,
                                      HAS_DROPOUT, dtype)
        for j in range(1, n_blocks):
            n0 = lo + j * BLOCK_N
            k_ring.wait_ready(j)
            v_ring.wait_ready(j - 1)
            s = _scores(q_tile, q_tile, k_s, k_s, k_ring.slot(j), BLOCK_N, HEAD_DIM, 0, BLOCK_M, BLOCK_N)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout),
                                v_s.index(v_ring.slot(j - 1)).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            k_ring.release(j)
            s = _exchange(c, s, x_s, x_bar, j)
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, rows, n0, (n0 < full_lo) | (n0 >= full_hi), sk, diag, wl,
                                          wr, chunk, qk_scale, drop, BLOCK_N, s_layout, MASK_LEFT, MASK_RIGHT,
                                          MASK_CHUNK, HAS_DROPOUT, dtype)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            v_ring.release(j - 1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        n_last = lo + (n_blocks - 1) * BLOCK_N
        acc = _last_pv(p, acc, v_s, v_ring, n_blocks - 1, sk - n_last, BLOCK_N, HEAD_DIM, BLOCK_N, IS_VARLEN)
    # The rows' end as hopper_fwd.py's consumers finish theirs, written out there too: a Gluon function shared by
    # both moved ~1000 of the 128 kernel's sm_90 instructions (tools/sass_diff.py), untimed.
    if HAS_SINK:
        alpha, l_i, m_i = sink_state(l_i, m_i, gl.load(SINK + h) * LOG2E)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    empty_row = l_i == 0.0
    l_safe = gl.where(empty_row, 1.0, l_i)
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
    if HAS_DROPOUT:
        out = out * drop_scale
    if c == 0:
        if IS_VARLEN:
            lse_off = h.to(gl.int64) * stride_lh + q_row0
        else:
            lse_off = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
        lse = gl.where(empty_row, float("inf"), (m_i + gl.log2(l_safe)) * LN2)
        gl.store(LSE + lse_off + rows, lse, mask=rows < sq)
    q_tile.store(out.to(dtype))  # Q's half is no longer read: it stages O's for the store
    fence_async_shared()
    if IS_VARLEN and m_start + BLOCK_M > sq:  # Note [varlen descriptors] in hopper_fwd.py
        store_rows(O_PTR + c * HEAD_DIM, q_tile, q_row0 + m_start, sq - m_start, h, stride_om, stride_oh, BLOCK_M,
                   HEAD_DIM)
    else:
        tma_store(o_desc, b, q_row0 + m_start, h, q_s.index(c), IS_VARLEN)
        tma.store_wait(pendings=0)


# Parameters: the per-call ones (descriptors, pointers, float scalars) first, then the integers, then constexprs.
@gluon.jit
def _hopper_fwd_wide_kernel(Q, Q2, K, K2, V, V2, O, O2, O_PTR, LSE, SINK, RNG, TILES, CU_SEQLENS_Q, CU_SEQLENS_K,
                            qk_scale, dropout_p, stride_lb: gl.int32, stride_lh: gl.int32, seqlen_q: gl.int32,
                            seqlen_k: gl.int32, wl: gl.int32, wr: gl.int32, stride_om, stride_oh, heads: gl.int32,
                            chunk: gl.int32, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr, GROUP: gl.constexpr, MASK_LEFT: gl.constexpr,
                            MASK_RIGHT: gl.constexpr, MASK_CHUNK: gl.constexpr, IS_VARLEN: gl.constexpr,
                            HAS_SINK: gl.constexpr, HAS_DROPOUT: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                            LOADER_REGS: gl.constexpr):
    """One program per work item (a BLOCK_M-row query tile of one sequence and head; hopper_common's item order).
    Q, K, V, O over columns [0, HEAD_DIM) and Q2, K2, V2, O2 over [HEAD_DIM, 2 HEAD_DIM) of the tensors, host
    descriptors as hopper_fwd.py's (dense (B, S, H, D) or packed (total, H, D)); the other arguments as that
    kernel's (TILES: a varlen batch's list of BLOCK_M-row tiles)."""
    q_s = tile_buffers(Q, 2, BLOCK_M, HEAD_DIM, IS_VARLEN)
    k_s = tile_buffers(K, STAGES, BLOCK_N, HEAD_DIM, IS_VARLEN)
    k2_s = tile_buffers(K2, STAGES, BLOCK_N, HEAD_DIM, IS_VARLEN)
    v_s = tile_buffers(V, STAGES, BLOCK_N, HEAD_DIM, IS_VARLEN)
    v2_s = tile_buffers(V2, STAGES, BLOCK_N, HEAD_DIM, IS_VARLEN)
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float32)
    x_s = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M, BLOCK_N], x_layout)  # (consumer, parity)
    x_bar = barrier_array(4, 1)
    v_ready = barrier_array(STAGES, 1)
    v_empty = barrier_array(STAGES, 2)
    q_bar, ready, empty = ring_barriers(STAGES, 1)  # its fence covers the barriers above too
    k_ring = Ring(ready, empty, STAGES)
    v_ring = Ring(v_ready, v_empty, STAGES)
    gl.warp_specialize([
        (_consumer, (0, O, O_PTR, LSE, SINK, RNG, q_s, k_s, v_s, x_s, x_bar, q_bar.index(0), k_ring, v_ring, TILES,
                     CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k, wl, wr, chunk, heads, qk_scale, dropout_p,
                     stride_lb, stride_lh, stride_om, stride_oh, HEAD_DIM, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT,
                     MASK_CHUNK, IS_VARLEN, HAS_SINK, HAS_DROPOUT)),
        (_consumer, (1, O2, O_PTR, LSE, SINK, RNG, q_s, k2_s, v2_s, x_s, x_bar, q_bar.index(0), k_ring, v_ring,
                     TILES, CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k, wl, wr, chunk, heads, qk_scale,
                     dropout_p, stride_lb, stride_lh, stride_om, stride_oh, HEAD_DIM, BLOCK_M, BLOCK_N, MASK_LEFT,
                     MASK_RIGHT, MASK_CHUNK, IS_VARLEN, HAS_SINK, HAS_DROPOUT)),
        (_loader, (Q, Q2, K, K2, V, V2, q_s, k_s, k2_s, v_s, v2_s, q_bar.index(0), k_ring, v_ring, TILES,
                   CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k, wl, wr, chunk, heads, BLOCK_M, BLOCK_N, GROUP,
                   MASK_LEFT, MASK_RIGHT, MASK_CHUNK, IS_VARLEN)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
