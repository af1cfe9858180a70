"""The Hopper forward: a warp-specialised Gluon kernel for sm_90 (H100/H200), FlashAttention-3's structure.

One program computes 2 x BLOCK_M query rows of one (sequence, head):

  loader partition (1 warp)            TMA: both Q tiles once, then K_j and V_j into a ring of STAGES slots; it
                                       waits on a slot's `empty` barrier before refilling it
  two consumer partitions (4 warps)    one BLOCK_M-row Q tile each, the same K/V slots. Per key block:
                                         issue S_j = Q K_jᵀ and O += P_{j-1} V_{j-1}; wait for S_j only
                                         online softmax of S_j                 (under P_{j-1} V_{j-1})
                                         wait for the P V update; arrive on slot j-1's `empty` (count 2)

Two kinds of overlap, neither of which stock Triton 3.6 produces on sm_90 (its loops wait for every wgmma before
the next instruction; PERF.md, "What the compiled loops do"): across the two consumer warpgroups, whose softmax and
matmuls interleave on the SM's tensor cores under the warp schedulers, and inside each, where the softmax of block
j runs while the tensor cores still work on block j-1's P V. The loader gives up its registers (setmaxnreg) so the
consumers hold S, P and O (240 registers a thread, no spill at d128).

BLOCK_N = 2 * BLOCK_M so that both consumers need the same key blocks under a causal or sliding-window mask: the
program's key range is kv_block_range's for its 2 x BLOCK_M rows, and a consumer treats a block its rows only
partly see as masked (apply_mask, as the Triton kernel does). Keys past seqlen_k are masked, and rows past
seqlen_q are neither stored nor written to the LSE: a dense batch's 4-d descriptors end where each sequence does
(rows past it are TMA's zero fill, stores past it are dropped); a varlen batch's run over the packed tensors, and
Note [varlen descriptors] says what keeps one sequence out of another.

Scope (ops/hopper.py decides which calls come here; the rest run kernels/fwd.py): dense (B, S, H, D) and varlen
(total, H, D) batches, fp16/bf16, D 128, MHA/GQA/MQA, any lengths, causal and sliding windows. Not softcap, ALiBi,
seqused or paged K/V.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

from .hopper_common import (ring_barriers, store_rows, tile_buffers, tma_load, tma_store, varlen_program,
                            zero_rows_from)
from .masking import LN2, apply_mask, kv_block_range


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bars, ready, empty, b, h, hk, m_start, lo, n_blocks,
            q_row0, k_row0, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            IS_VARLEN: gl.constexpr):
    """q_row0 and k_row0: where the sequence's rows start in the packed tensors (varlen; 0 for a dense batch)."""
    for c in gl.static_range(2):
        mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes)
        tma_load(q_desc, b, q_row0 + m_start + c * BLOCK_M, h, q_bars.index(c), q_s.index(c), IS_VARLEN)
    for j in range(n_blocks):
        slot = j % STAGES
        # A fresh barrier counts as having completed the phase before its first: the first pass waits for nothing.
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, b, k_row0 + lo + j * BLOCK_N, hk, bar, k_s.index(slot), IS_VARLEN)
        tma_load(v_desc, b, k_row0 + lo + j * BLOCK_N, hk, bar, v_s.index(slot), IS_VARLEN)


@gluon.jit
def _softmax(s, m_i, l_i, rows, n0, masked, seqlen_k, diag, wl, wr, qk_scale,
             BLOCK_N: gl.constexpr, s_layout: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
    """Fold the raw scores of key block n0 into the running (max, sum): returns (p, m_new, l_new, alpha)."""
    if masked:
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = apply_mask(s, gl.expand_dims(rows, 1), gl.expand_dims(cols, 0), seqlen_k, diag, wl, wr,
                       MASK_LEFT, MASK_RIGHT, True)
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    if masked:
        # Note [fully masked rows] in softmax.py: a row that has seen no visible key keeps a finite reference max.
        m_new = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _consumer(c: gl.constexpr, o_desc, O_PTR, LSE, q_s, k_s, v_s, q_bars, ready, empty, b, h, m_start, lo,
              full_lo, full_hi, n_blocks, lse_off, q_row0, seqlen_q, seqlen_k, wl, wr, qk_scale, stride_om,
              stride_oh, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr):
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    diag = seqlen_k - seqlen_q
    m0 = m_start + c * BLOCK_M
    q_tile = q_s.index(c).reshape([BLOCK_M, HEAD_DIM])
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    mbarrier.wait(q_bars.index(c), 0)
    if n_blocks > 0:
        mbarrier.wait(ready.index(0), 0)
        s = warpgroup_mma(q_tile, k_s.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, rows, lo, (lo < full_lo) | (lo >= full_hi), seqlen_k, diag,
                                      wl, wr, qk_scale, BLOCK_N, s_layout, MASK_LEFT, MASK_RIGHT)
        for j in range(1, n_blocks):
            slot = j % STAGES
            prev = (j - 1) % STAGES
            n0 = lo + j * BLOCK_N
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            s = warpgroup_mma(q_tile, k_s.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout),
                                v_s.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, rows, n0, (n0 < full_lo) | (n0 >= full_hi), seqlen_k,
                                          diag, wl, wr, qk_scale, BLOCK_N, s_layout, MASK_LEFT, MASK_RIGHT)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(prev), count=1)  # K_{j-1} and V_{j-1} are read
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        last = (n_blocks - 1) % STAGES
        v_last = v_s.index(last).reshape([BLOCK_N, HEAD_DIM])
        if IS_VARLEN:
            keys_left = seqlen_k - (lo + (n_blocks - 1) * BLOCK_N)
            if keys_left < BLOCK_N:  # the sequence ends inside the last key block
                zero_rows_from(v_last, keys_left, BLOCK_N, HEAD_DIM, 4)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout),
                            v_last, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(last), count=1)
    # softmax.finalize's convention: a row that saw no key gives out 0 and lse +inf.
    empty_row = l_i == 0.0
    l_safe = gl.where(empty_row, 1.0, l_i)
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
    if m0 < seqlen_q:  # else no row of this tile is in the sequence (or the program is past the varlen list)
        lse = gl.where(empty_row, float("inf"), (m_i + gl.log2(l_safe)) * LN2)
        gl.store(LSE + lse_off + rows, lse, mask=rows < seqlen_q)
        q_tile.store(out.to(dtype))  # this consumer's Q is no longer read: its buffer stages O for the store
        fence_async_shared()
        if IS_VARLEN and m0 + BLOCK_M > seqlen_q:  # a box would also write the next sequence's rows
            store_rows(O_PTR, q_tile, q_row0 + m0, seqlen_q - m0, h, stride_om, stride_oh, BLOCK_M, HEAD_DIM)
        else:
            tma_store(o_desc, b, q_row0 + m0, h, q_s.index(c), IS_VARLEN)
            tma.store_wait(pendings=0)


# Parameters: the per-call ones (descriptors, pointers, float scalars) first, then the integers, then constexprs.
@gluon.jit
def _hopper_fwd_kernel(Q, K, V, O, O_PTR, LSE, TILES, CU_SEQLENS_Q, CU_SEQLENS_K, qk_scale,
                       stride_lb, stride_lh, seqlen_q, seqlen_k, wl, wr, stride_om, stride_oh,
                       HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, GROUP: gl.constexpr, MASK_LEFT: gl.constexpr,
                       MASK_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       LOADER_REGS: gl.constexpr):
    """Q, K, V, O are host descriptors: over (B, S, H, D) for a dense batch, whose grid is (query tiles of
    2 x BLOCK_M rows, H, B) and which leaves O_PTR, the strides and the TILES and CU_SEQLENS unused; over the
    packed (total, H, D) tensors for a varlen one, whose seqlen_q/k are the totals and whose grid is (H, the tile
    list's bound), folded into z past 65535 entries (ops/common.tile_grid): each program reads its (sequence,
    tile) from TILES (ops/common.varlen_grid: longest sequences first, and within one the last tile first). O_PTR is
    O's tensor, for the last tile of a varlen sequence.

    Note [varlen grid order]: in a varlen grid the heads are the fastest axis, so the programs in flight are every
    head of a few tiles. A row of a packed (total, H, D) tensor holds all its heads (H x 256 bytes at d128), so they
    read whole rows together; with the tile list fastest (a dense grid's order) they were the tiles of one head of
    many sequences, each reading 256 bytes of every row. On the 16-sequence mix (H200, bf16, d128, H=16) heads first
    made dK/dV 4% faster (7% causal) and the causal forward 4% (PERF.md, v11); the Triton kernels' varlen grids
    take the same order (seqlen.tile_coords). The dense grids keep theirs (heads first is not measured there).

    Note [varlen descriptors]: a box over a packed tensor does not end where the sequence does, so the last tile of
    a sequence reads (and would write) the next sequence's rows. Reading them is harmless for Q and K: a query row
    past the sequence gives a row that is neither stored nor written to the LSE, and keys past it sit in a masked
    block, whose scores apply_mask replaces (a `where`, so an inf or NaN there does not survive). Not for V: a row
    past the sequence meets P = 0 in P V, and 0 x inf is NaN, so the consumers zero those rows of the last V tile
    (hopper_common.zero_rows_from) before its wgmma. A tile of O that ends past the sequence is staged in shared
    memory as for the TMA store, then stored by pointer under a row mask (store_rows). Descriptors built on the
    device over each sequence's rows, which end where it does, did this job until session 10; each costs a global
    write and a fence before its first use, and replacing the forward's last two and all six of dK/dV's made the
    16-sequence mix 4% faster forward (9% causal) and 3% forward+backward (7% causal), with bitwise the same results
    (PERF.md, v10)."""
    gl.static_assert(BLOCK_N == 2 * BLOCK_M, "both consumers must need the same key blocks")
    if IS_VARLEN:
        h = gl.program_id(0)  # Note [varlen grid order]
        b, pid_m, valid, q_row0, seqlen_q, k_row0, seqlen_k = varlen_program(TILES, CU_SEQLENS_Q, CU_SEQLENS_K,
                                                                              seqlen_q, seqlen_k)
    else:
        # The last query tiles first: under a causal mask they see the most keys (ops/fwd.py's launch order).
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
        h = gl.program_id(1)
        b = gl.program_id(2)
        q_row0 = 0
        k_row0 = 0
    hk = h // GROUP
    m_start = pid_m * 2 * BLOCK_M
    lo, full_lo, full_hi, hi = kv_block_range(m_start, seqlen_q, seqlen_k, wl, wr, 2 * BLOCK_M, BLOCK_N,
                                              MASK_LEFT, MASK_RIGHT)
    n_blocks = (hi - lo + BLOCK_N - 1) // BLOCK_N
    if IS_VARLEN:
        n_blocks = gl.where(valid, n_blocks, 0)
    lse_off = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + q_row0
    q_s = tile_buffers(Q, 2, BLOCK_M, HEAD_DIM, IS_VARLEN)
    k_s = tile_buffers(K, STAGES, BLOCK_N, HEAD_DIM, IS_VARLEN)
    v_s = tile_buffers(V, STAGES, BLOCK_N, HEAD_DIM, IS_VARLEN)
    q_bars, ready, empty = ring_barriers(STAGES)
    gl.warp_specialize([
        (_consumer, (0, O, O_PTR, LSE, q_s, k_s, v_s, q_bars, ready, empty, b, h, m_start, lo, full_lo,
                     full_hi, n_blocks, lse_off, q_row0, seqlen_q, seqlen_k, wl, wr, qk_scale, stride_om, stride_oh,
                     HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, MASK_LEFT, MASK_RIGHT, IS_VARLEN)),
        (_consumer, (1, O, O_PTR, LSE, q_s, k_s, v_s, q_bars, ready, empty, b, h, m_start, lo, full_lo,
                     full_hi, n_blocks, lse_off, q_row0, seqlen_q, seqlen_k, wl, wr, qk_scale, stride_om, stride_oh,
                     HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, MASK_LEFT, MASK_RIGHT, IS_VARLEN)),
        (_loader, (Q, K, V, q_s, k_s, v_s, q_bars, ready, empty, b, h, hk, m_start, lo, n_blocks,
                   q_row0, k_row0, BLOCK_M, BLOCK_N, STAGES, IS_VARLEN)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
