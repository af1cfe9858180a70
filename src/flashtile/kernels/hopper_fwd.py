"""The Hopper forward: a warp-specialised Gluon kernel for sm_90 (H100/H200), FlashAttention-3's structure.

A program is persistent: it computes work items of 2 x BLOCK_M query rows of one (sequence, head), one after
another, dense and varlen batches alike (Note [persistent forward]):

  loader partition (1 warp)            TMA: each item's two Q tiles, then K_j and V_j into rings of STAGES - 1 and
                                       STAGES slots; it waits on a slot's `empty` barrier before refilling it
  two consumer partitions (4 warps)    one BLOCK_M-row Q tile each, the same K/V slots. Per key block:
                                         issue S_j = Q K_jᵀ and O += P_{j-1} V_{j-1}; wait for S_j only
                                         online softmax of S_j                 (under P_{j-1} V_{j-1})
                                         wait for the P V update; arrive on slot j-1's `empty` (count 2)

Two kinds of overlap, neither of which stock Triton 3.6 produces on sm_90 (its loops wait for every wgmma before
the next instruction; docs/design/hopper-pipeline.md): across the two consumer warpgroups, whose softmax and
matmuls interleave on the SM's tensor cores under the warp schedulers, and inside each, where the softmax of block
j runs while the tensor cores still work on block j-1's P V. The loader gives up its registers (setmaxnreg) so the
consumers hold S, P and O (240 registers a thread, no spill at d128).

BLOCK_N = 2 * BLOCK_M so that both consumers need the same key blocks under a causal or sliding-window mask: the
program's key range is kv_block_range's for its 2 x BLOCK_M rows, and a consumer treats a block its rows only
partly see as masked (apply_mask, as the Triton kernel does). Keys past seqlen_k are masked, and rows past
seqlen_q are neither stored nor written to the LSE: a dense batch's 4-d descriptors end where each sequence does
(rows past it are TMA's zero fill, stores past it are dropped); a varlen batch's run over the packed tensors, and
Note [varlen descriptors] says what keeps one sequence out of another. A consumer none of whose rows is in the
sequence (the upper half of a last tile) passes over the key blocks: it waits for each and releases it; one
whose rows see only the first half of the last key block computes that block at half width (Note [half last
block]).

Scope (ops/hopper.py decides which calls come here; the rest run kernels/fwd.py): dense (B, S, H, D) and varlen
(total, H, D) batches, fp16/bf16, D 128, and MLA prefill's q/k 192 with v 128 (HEAD_DIM_TAIL: Note [head dim
parts] in hopper_common.py; _scores), MHA/GQA/MQA, any lengths, causal and sliding windows, chunked attention
(MASK_CHUNK: kv_block_range and apply_mask take the chunk, as everywhere else), learnable sinks
(HAS_SINK: SINK, fp32 (H,), joins each row's denominator after its last key block, as softmax.fold_sink; the
backward needs nothing more, its P comes from this LSE), dropout (HAS_DROPOUT: _softmax drops P after the row sum
has counted it, entry by entry where P sits: Note [dropout entries] in dropout.py; O is scaled by 1 / (1 - p) at
the end, as kernels/fwd.py does). Not softcap, ALiBi, seqused or paged K/V.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate

from .dropout import cleared, dropout_state, keep_words, packed_threshold
from .hopper_common import (BufferSets, Ring, barrier_array, dense_work_item, info_slots, item_fields,
                            publish_item, read_item, ring_barriers, store_rows, take_item, tile_buffers, tma_load,
                            tma_store, work_item, zero_rows_from)
from .masking import LN2, LOG2E, apply_mask, kv_block_range
from .softmax import sink_state


@gluon.jit
def _load_item(q_desc, q2_desc, k_desc, k2_desc, v_desc, q_s, q2_s, k_s, k2_s, v_s, held, k_ring, v_ring, b, h, hk,
               m_start, lo, n_blocks, q_row0, k_row0, it0, q0, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM_TAIL: gl.constexpr, IS_VARLEN: gl.constexpr):
    """The loads of one work item: its two Q tiles into Q buffers q0 and q0 + 1, then its key blocks into the K and
    V rings from ring position it0 on (with HEAD_DIM_TAIL, each Q and K tile's tail columns into q2_s and k2_s on
    the same barrier). q_row0 and k_row0: where the sequence's rows start in the packed tensors (varlen; 0 for a
    dense batch, whose descriptors take the sequence b)."""
    q_bytes: gl.constexpr = q_desc.block_type.nbytes + (q2_desc.block_type.nbytes if HEAD_DIM_TAIL > 0 else 0)
    k_bytes: gl.constexpr = k_desc.block_type.nbytes + (k2_desc.block_type.nbytes if HEAD_DIM_TAIL > 0 else 0)
    for c in gl.static_range(2):
        row = q_row0 + m_start + c * BLOCK_M
        mbarrier.expect(held.index(q0 + c), q_bytes)
        tma_load(q_desc, b, row, h, held.index(q0 + c), q_s.index(q0 + c), IS_VARLEN)
        if HEAD_DIM_TAIL > 0:
            tma_load(q2_desc, b, row, h, held.index(q0 + c), q2_s.index(q0 + c), IS_VARLEN)
    for j in range(n_blocks):
        it = it0 + j
        k_ring.wait_empty(it)
        slot = k_ring.slot(it)
        row = k_row0 + lo + j * BLOCK_N
        # K and V in rings of their own (Note [persistent forward])
        mbarrier.expect(k_ring.ready_bar(it), k_bytes)
        tma_load(k_desc, b, row, hk, k_ring.ready_bar(it), k_s.index(slot), IS_VARLEN)
        if HEAD_DIM_TAIL > 0:
            tma_load(k2_desc, b, row, hk, k_ring.ready_bar(it), k2_s.index(slot), IS_VARLEN)
        v_ring.wait_empty(it)
        vslot = v_ring.slot(it)
        mbarrier.expect(v_ring.ready_bar(it), v_desc.block_type.nbytes)
        tma_load(v_desc, b, row, hk, v_ring.ready_bar(it), v_s.index(vslot), IS_VARLEN)


@gluon.jit
def _varlen_item(w, heads, TILES, CU_SEQLENS_Q, CU_SEQLENS_K, total_q, total_k, wl, wr, chunk, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, MASK_CHUNK: gl.constexpr):
    """Work item w of a varlen batch (hopper_common.work_item; the tile list holds a sequence's query tiles last
    first). Returns (valid, b, h, m_start, q_row0, seqlen_q, k_row0, seqlen_k, lo, full_lo, full_hi, n_blocks)."""
    valid, b, h, tile, q_row0, seqlen_q, k_row0, seqlen_k = work_item(w, heads, TILES, CU_SEQLENS_Q, CU_SEQLENS_K,
                                                                      total_q, total_k, 2 * BLOCK_M, True, False)
    m_start = tile * 2 * BLOCK_M
    lo, full_lo, full_hi, hi = kv_block_range(m_start, seqlen_q, seqlen_k, wl, wr, 2 * BLOCK_M, BLOCK_N,
                                              MASK_LEFT, MASK_RIGHT, chunk, MASK_CHUNK)
    n_blocks = (hi - lo + BLOCK_N - 1) // BLOCK_N
    return valid, b, h, m_start, q_row0, seqlen_q, k_row0, seqlen_k, lo, full_lo, full_hi, n_blocks


@gluon.jit
def _dense_item(w, heads, seqlen_q, seqlen_k, wl, wr, chunk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, MASK_CHUNK: gl.constexpr):
    """Work item w of a dense batch (hopper_common.dense_work_item: the tiles fastest, each (sequence, head)'s last
    tile first, as a varlen batch's list). Returns (b, h, m_start, lo, full_lo, full_hi, n_blocks)."""
    b, h, tile = dense_work_item(w, heads, seqlen_q, 2 * BLOCK_M, True)
    m_start = tile * 2 * BLOCK_M
    lo, full_lo, full_hi, hi = kv_block_range(m_start, seqlen_q, seqlen_k, wl, wr, 2 * BLOCK_M, BLOCK_N,
                                              MASK_LEFT, MASK_RIGHT, chunk, MASK_CHUNK)
    n_blocks = (hi - lo + BLOCK_N - 1) // BLOCK_N
    return b, h, m_start, lo, full_lo, full_hi, n_blocks


@aggregate
class _Item:
    """One work item as the persistent loader describes it to the consumers, in publish_item's field order
    (hopper_common): `valid` (false for the first item past the list, which ends the program), the query head, the
    item's first query row in its sequence, where the sequence's queries start in the packed tensor, both lengths,
    the item's key blocks (lo, the mask-free [full_lo, full_hi), how many), and its sequence b (a dense batch's
    descriptors take it, a varlen item's q_row0 places it; the dropout mask takes it in both)."""
    valid: gl.tensor
    h: gl.tensor
    m_start: gl.tensor
    q_row0: gl.tensor
    seqlen_q: gl.tensor
    seqlen_k: gl.tensor
    lo: gl.tensor
    full_lo: gl.tensor
    full_hi: gl.tensor
    n_blocks: gl.tensor
    b: gl.tensor

    @gluon.constexpr_function
    def __init__(self, valid, h, m_start, q_row0, seqlen_q, seqlen_k, lo, full_lo, full_hi, n_blocks, b):
        item_fields(self, locals())


@gluon.jit
def _read_item(slot):
    """The item _loader published in slot."""
    valid, h, m_start, q_row0, seqlen_q, seqlen_k, lo, full_lo, full_hi, n_blocks, b, _ = read_item(slot)
    return _Item(valid, h, m_start, q_row0, seqlen_q, seqlen_k, lo, full_lo, full_hi, n_blocks, b)


@gluon.jit
def _loader(q_desc, q2_desc, k_desc, k2_desc, v_desc, q_s, q2_s, k_s, k2_s, v_s, sets, k_ring, v_ring, COUNTER, TILES,
            CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k, wl, wr, chunk, n_items, heads, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, HEAD_DIM_TAIL: gl.constexpr, GROUP: gl.constexpr, MASK_LEFT: gl.constexpr,
            MASK_RIGHT: gl.constexpr, MASK_CHUNK: gl.constexpr, IS_VARLEN: gl.constexpr):
    """A persistent program's loader (Note [persistent forward]): it takes the next item from the work counter,
    describes it to the consumers and loads its Q into its set of Q buffers (hopper_common.BufferSets), once both
    consumers have handed that set back; the K/V rings run on from item to item. The first item past the list (a
    varlen batch's) or past n_items is published invalid, which ends the program. seqlen_q and seqlen_k: a dense
    batch's lengths, a varlen batch's packed totals."""
    it0 = 0
    r = 0
    done = False
    while not done:
        w = take_item(COUNTER, n_items, not IS_VARLEN)  # a varlen plan's counters are zeroed per call
        if IS_VARLEN:
            valid, b, h, m_start, q_row0, sq, k_row0, sk, lo, full_lo, full_hi, n_blocks = _varlen_item(
                gl.minimum(w, n_items - 1), heads, TILES, CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k, wl, wr,
                chunk, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, MASK_CHUNK)
            valid = valid & (w < n_items)
        else:
            b, h, m_start, lo, full_lo, full_hi, n_blocks = _dense_item(
                gl.minimum(w, n_items - 1), heads, seqlen_q, seqlen_k, wl, wr, chunk, BLOCK_M, BLOCK_N, MASK_LEFT,
                MASK_RIGHT, MASK_CHUNK)
            valid = w < n_items
            q_row0, sq, k_row0, sk = 0, seqlen_q, 0, seqlen_k
        sets.wait_free(r)
        publish_item(sets.info_slot(r), valid, h, m_start, q_row0, sq, sk, lo, full_lo, full_hi, n_blocks, b,
                     0)  # _Item
        if valid:
            _load_item(q_desc, q2_desc, k_desc, k2_desc, v_desc, q_s, q2_s, k_s, k2_s, v_s, sets.held, k_ring, v_ring,
                       b, h, h // GROUP, m_start, lo, n_blocks, q_row0, k_row0, it0, sets.buffer(r, 0), BLOCK_M,
                       BLOCK_N, HEAD_DIM_TAIL, IS_VARLEN)
            it0 += n_blocks
        else:
            sets.end(r)
            done = True
        r += 1


@gluon.constexpr_function
def _acc_layout(n):
    """The wgmma accumulator layout of a consumer warpgroup's (BLOCK_M, n) tile: S (n = keys) and O (n = D)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def _p_layout(head_dim):
    """P as the register operand A of P V."""
    return gl.DotOperandLayout(operand_index=0, parent=_acc_layout(head_dim), k_width=2)


@gluon.jit
def _softmax(s, m_i, l_i, rows, n0, masked, seqlen_k, diag, wl, wr, chunk, qk_scale, drop,
             BLOCK_N: gl.constexpr, s_layout: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
             MASK_CHUNK: gl.constexpr, HAS_DROPOUT: gl.constexpr, DTYPE: gl.constexpr):
    """Fold the raw scores of key block n0 into the running (max, sum): returns (p, m_new, l_new, alpha). With
    HAS_DROPOUT (drop: (seed, stream, b * H + h, c, t), _consumer's), p comes in DTYPE with the dropout mask
    applied; else in fp32, for the caller to convert."""
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if masked:
        s = apply_mask(s, gl.expand_dims(rows, 1), gl.expand_dims(n0 + cols, 0), seqlen_k, diag, wl, wr,
                       MASK_LEFT, MASK_RIGHT, True, chunk, MASK_CHUNK)
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    if masked:
        # Note [fully masked rows] in softmax.py: a row that has seen no visible key keeps a finite reference max.
        m_new = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    l_new = l_i * alpha + gl.sum(p, 1)
    if HAS_DROPOUT:  # after the sum: the LSE is the undropped softmax's (Note [dropout mask] in dropout.py)
        seed, stream, bh, c, t = drop
        word, byte = keep_words(seed, stream, bh, gl.expand_dims(rows, 1), n0, gl.expand_dims(cols, 0), c, t,
                                BLOCK_N)
        p = cleared(p.to(DTYPE), word, byte)  # on P's packed pairs (Note [dropout entries])
    return p, m_new, l_new, alpha


@gluon.jit
def _scores(q_tile, q2_tile, k_s, k2_s, slot, WIDTH: gl.constexpr, HEAD_DIM: gl.constexpr,
            HEAD_DIM_TAIL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Issue S = Q Kᵀ on the first WIDTH keys of the K tile in ring slot `slot`, asynchronously: one wgmma, or with
    HEAD_DIM_TAIL a second over the tail columns into the same accumulator (Note [head dim parts] in
    hopper_common.py). A wait for the last leaves neither in flight: wgmma groups complete in order."""
    s_layout: gl.constexpr = _acc_layout(WIDTH)
    k_tile = k_s.index(slot).reshape([BLOCK_N, HEAD_DIM])
    if WIDTH < BLOCK_N:
        k_tile = k_tile.slice(0, WIDTH)
    s = warpgroup_mma(q_tile, k_tile.permute((1, 0)), gl.zeros([BLOCK_M, WIDTH], gl.float32, layout=s_layout),
                      use_acc=False, is_async=True)
    if HEAD_DIM_TAIL > 0:
        k2_tile = k2_s.index(slot).reshape([BLOCK_N, HEAD_DIM_TAIL])
        if WIDTH < BLOCK_N:
            k2_tile = k2_tile.slice(0, WIDTH)
        s = warpgroup_mma(q2_tile, k2_tile.permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _step(q_tile, q2_tile, k_s, k2_s, v_s, k_ring, v_ring, it, n0, p, acc, m_i, l_i, rows, full_lo, full_hi, seqlen_k,
          diag, wl, wr, chunk, qk_scale, drop, WIDTH: gl.constexpr, HEAD_DIM: gl.constexpr,
          HEAD_DIM_TAIL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr,
          MASK_RIGHT: gl.constexpr, MASK_CHUNK: gl.constexpr, HAS_DROPOUT: gl.constexpr):
    """Key block n0 at ring position it, after the item's first: S on the block's first WIDTH keys (all of them, or
    half under Note [half last block]) is issued with the previous block's P V under it, and its softmax runs
    while that P V is on the tensor cores. m_i, l_i and rows are in the layout of a WIDTH-wide S. Returns (p, m_i,
    l_i, acc), acc rescaled to the new max."""
    dtype: gl.constexpr = v_s.dtype
    s_layout: gl.constexpr = _acc_layout(WIDTH)
    o_layout: gl.constexpr = _acc_layout(HEAD_DIM)
    p_layout: gl.constexpr = _p_layout(HEAD_DIM)
    slot = k_ring.slot(it)
    k_ring.wait_ready(it)
    v_ring.wait_ready(it - 1)  # V_{j-1}'s slot in its own ring, which the loader filled after K_{j-1}
    prev = v_ring.slot(it - 1)
    s = _scores(q_tile, q2_tile, k_s, k2_s, slot, WIDTH, HEAD_DIM, HEAD_DIM_TAIL, BLOCK_M, BLOCK_N)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_s.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc,
                        is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
    k_ring.release(it)  # K_j is read
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, rows, n0, (n0 < full_lo) | (n0 >= full_hi), seqlen_k, diag, wl, wr,
                                  chunk, qk_scale, drop, WIDTH, s_layout, MASK_LEFT, MASK_RIGHT, MASK_CHUNK,
                                  HAS_DROPOUT, dtype)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    v_ring.release(it - 1)  # V_{j-1} is read
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    return p, m_i, l_i, acc


@gluon.jit
def _last_pv(p, acc, v_s, v_ring, it, keys_left, WIDTH: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
             IS_VARLEN: gl.constexpr):
    """The item's last P V, on the first WIDTH rows of V at ring position it (keys_left of its rows in the
    sequence), with nothing left to hide it under."""
    dtype: gl.constexpr = v_s.dtype
    p_layout: gl.constexpr = _p_layout(HEAD_DIM)
    v_ring.wait_ready(it)
    last = v_ring.slot(it)
    v_last = v_s.index(last).reshape([BLOCK_N, HEAD_DIM])
    if IS_VARLEN:  # Note [varlen descriptors]; a dense batch's descriptor fills rows past the sequence with zeros
        if keys_left < BLOCK_N:  # the sequence ends inside the last key block
            zero_rows_from(v_last, keys_left, BLOCK_N, HEAD_DIM, 4)
    if WIDTH < BLOCK_N:
        v_last = v_last.slice(0, WIDTH)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_last, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    v_ring.release(it)
    return acc


@gluon.jit
def _consume_item(c: gl.constexpr, o_desc, O_PTR, LSE, SINK, q_s, q2_s, k_s, k2_s, v_s, sets, k_ring, v_ring, b, h,
                  m_start, lo, full_lo, full_hi, n_blocks, lse_off, q_row0, seqlen_q, seqlen_k, wl, wr, chunk,
                  qk_scale, drop, drop_scale, stride_om, stride_oh, it0, qi, free_prev, HEAD_DIM: gl.constexpr,
                  HEAD_DIM_TAIL: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, MASK_CHUNK: gl.constexpr,
                  IS_VARLEN: gl.constexpr, HAS_SINK: gl.constexpr, HAS_DROPOUT: gl.constexpr):
    """Consumer c's BLOCK_M rows of one work item, its Q in buffer qi, whose key blocks start at ring position it0.
    It leaves its O store in flight, and hands the previous item's Q buffer back (free_prev) once its first S of
    this item is issued.

    Note [half last block]: where this consumer's rows see none of the upper half of the item's last key block
    (under a causal mask the lower consumer's diagonal block; where the keys end in a block's first half), it
    computes that block at half width: S on the first BLOCK_N / 2 keys, P V on the first BLOCK_N / 2 rows of V
    (wgmma N and K of 64 at BLOCK_N = 128). Under a causal mask that takes a quarter block off every item's lower
    consumer, which weighs most on short items (a varlen batch's short sequences). Only after a whole block, so
    that the half step, like every other block but the first, runs under a previous P V."""
    dtype: gl.constexpr = o_desc.dtype
    HALF: gl.constexpr = BLOCK_N // 2
    s_layout: gl.constexpr = _acc_layout(BLOCK_N)
    h_layout: gl.constexpr = _acc_layout(HALF)
    o_layout: gl.constexpr = _acc_layout(HEAD_DIM)
    diag = seqlen_k - seqlen_q
    m0 = m_start + c * BLOCK_M
    q_tile = q_s.index(qi).reshape([BLOCK_M, HEAD_DIM])
    q2_tile = q_tile  # read only with HEAD_DIM_TAIL
    if HEAD_DIM_TAIL > 0:
        q2_tile = q2_s.index(qi).reshape([BLOCK_M, HEAD_DIM_TAIL])
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    if (n_blocks > 0) & (m0 < seqlen_q):
        first = k_ring.slot(it0)
        k_ring.wait_ready(it0)
        s = _scores(q_tile, q2_tile, k_s, k2_s, first, BLOCK_N, HEAD_DIM, HEAD_DIM_TAIL, BLOCK_M, BLOCK_N)
        _free_previous(free_prev, sets, sets.other(qi))
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        k_ring.release(it0)  # K_0 is read
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, rows, lo, (lo < full_lo) | (lo >= full_hi), seqlen_k, diag,
                                      wl, wr, chunk, qk_scale, drop, BLOCK_N, s_layout, MASK_LEFT, MASK_RIGHT,
                                      MASK_CHUNK, HAS_DROPOUT, dtype)
        n_last = lo + (n_blocks - 1) * BLOCK_N
        keys_end = seqlen_k  # past this consumer's last visible key
        if MASK_RIGHT:
            keys_end = gl.minimum(keys_end, gl.minimum(m0 + BLOCK_M, seqlen_q) + diag + wr)
        half = (n_blocks > 1) & (keys_end - n_last <= HALF)
        for j in range(1, n_blocks - half.to(gl.int32)):
            p, m_i, l_i, acc = _step(q_tile, q2_tile, k_s, k2_s, v_s, k_ring, v_ring, it0 + j, lo + j * BLOCK_N, p,
                                     acc, m_i, l_i, rows, full_lo, full_hi, seqlen_k, diag, wl, wr, chunk, qk_scale,
                                     drop, BLOCK_N, HEAD_DIM, HEAD_DIM_TAIL, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT,
                                     MASK_CHUNK, HAS_DROPOUT)
        it_last = it0 + n_blocks - 1
        if half:
            p_h, m_h, l_h, acc = _step(q_tile, q2_tile, k_s, k2_s, v_s, k_ring, v_ring, it_last, n_last, p, acc,
                                       gl.convert_layout(m_i, gl.SliceLayout(1, h_layout)),
                                       gl.convert_layout(l_i, gl.SliceLayout(1, h_layout)),
                                       gl.convert_layout(rows, gl.SliceLayout(1, h_layout)), full_lo, full_hi,
                                       seqlen_k, diag, wl, wr, chunk, qk_scale, drop, HALF, HEAD_DIM, HEAD_DIM_TAIL,
                                       BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, MASK_CHUNK, HAS_DROPOUT)
            acc = _last_pv(p_h, acc, v_s, v_ring, it_last, seqlen_k - n_last, HALF, HEAD_DIM, BLOCK_N, IS_VARLEN)
            m_i = gl.convert_layout(m_h, gl.SliceLayout(1, s_layout))
            l_i = gl.convert_layout(l_h, gl.SliceLayout(1, s_layout))
        else:
            acc = _last_pv(p, acc, v_s, v_ring, it_last, seqlen_k - n_last, BLOCK_N, HEAD_DIM, BLOCK_N, IS_VARLEN)
    else:
        # No key block, or no row of this tile in the sequence (the last tile's upper half): nothing to compute,
        # but the other consumer's loads still wait on this one's releases.
        _free_previous(free_prev, sets, sets.other(qi))
        _pass_over(it0, it0 + n_blocks, k_ring, v_ring)
    if HAS_SINK:  # softmax.fold_sink, the accumulator rescaled in its own layout
        alpha, l_i, m_i = sink_state(l_i, m_i, gl.load(SINK + h) * LOG2E)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    # softmax.finalize's convention: a row that saw no key (and no sink) gives out 0 and lse +inf.
    empty_row = l_i == 0.0
    l_safe = gl.where(empty_row, 1.0, l_i)
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
    if HAS_DROPOUT:
        out = out * drop_scale
    if m0 < seqlen_q:  # else no row of this tile is in the sequence (or the program is past the list)
        lse = gl.where(empty_row, float("inf"), (m_i + gl.log2(l_safe)) * LN2)
        gl.store(LSE + lse_off + rows, lse, mask=rows < seqlen_q)
        q_tile.store(out.to(dtype))  # this consumer's Q is no longer read: its buffer stages O for the store
        fence_async_shared()
        if IS_VARLEN and m0 + BLOCK_M > seqlen_q:  # a box would also write the next sequence's rows
            store_rows(O_PTR, q_tile, q_row0 + m0, seqlen_q - m0, h, stride_om, stride_oh, BLOCK_M, HEAD_DIM)
        else:
            tma_store(o_desc, b, q_row0 + m0, h, q_s.index(qi), IS_VARLEN)


@gluon.jit
def _pass_over(it_from, it_to, k_ring, v_ring):
    """hopper_common.pass_over over the K ring and V's, block by block: the loader fills K_j then V_j, so passing
    over every K first would wait for a K fill queued behind a V slot that only the V releases free."""
    for it in range(it_from, it_to):
        k_ring.wait_ready(it)
        k_ring.release(it)
        v_ring.wait_ready(it)
        v_ring.release(it)


@gluon.jit
def _free_previous(free_prev, sets, prev):
    """Once the previous item's O store has read its Q buffer (prev, the other set's), hand that buffer back."""
    if free_prev:
        tma.store_wait(pendings=0)
        sets.release(prev)


@gluon.jit
def _consumer(c: gl.constexpr, o_desc, O_PTR, LSE, SINK, RNG, q_s, q2_s, k_s, k2_s, v_s, sets, k_ring, v_ring, wl,
              wr, chunk, qk_scale, dropout_p, stride_lb, stride_lh, stride_om, stride_oh, heads,
              HEAD_DIM: gl.constexpr, HEAD_DIM_TAIL: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, MASK_CHUNK: gl.constexpr,
              IS_VARLEN: gl.constexpr, HAS_SINK: gl.constexpr, HAS_DROPOUT: gl.constexpr):
    """A persistent program's consumer c: the loader's items, in its order, as it describes them (its r-th in its
    set of Q buffers: hopper_common.BufferSets), until one is invalid."""
    seed, stream, drop_c, drop_t, drop_scale = 0, 0, 0, 0, 1.0
    if HAS_DROPOUT:
        seed, stream, threshold, drop_scale = dropout_state(RNG, dropout_p)
        drop_c, drop_t = packed_threshold(threshold)
    it0 = 0
    r = 0
    done = False
    while not done:
        sets.wait_held(r, c)
        item = _read_item(sets.info_slot(r))
        if item.valid:
            if IS_VARLEN:
                b = 0
                lse_off = item.h.to(gl.int64) * stride_lh + item.q_row0
            else:
                b = item.b
                lse_off = b.to(gl.int64) * stride_lb + item.h.to(gl.int64) * stride_lh
            drop = (seed, stream, item.b * heads + item.h, drop_c, drop_t)
            _consume_item(c, o_desc, O_PTR, LSE, SINK, q_s, q2_s, k_s, k2_s, v_s, sets, k_ring, v_ring, b, item.h,
                          item.m_start, item.lo, item.full_lo, item.full_hi, item.n_blocks, lse_off, item.q_row0,
                          item.seqlen_q, item.seqlen_k, wl, wr, chunk, qk_scale, drop, drop_scale, stride_om,
                          stride_oh, it0, sets.buffer(r, c), r > 0, HEAD_DIM, HEAD_DIM_TAIL, BLOCK_M, BLOCK_N,
                          MASK_LEFT, MASK_RIGHT, MASK_CHUNK, IS_VARLEN, HAS_SINK, HAS_DROPOUT)
            it0 += item.n_blocks
        else:
            done = True
        r += 1
    tma.store_wait(pendings=0)  # the last O store has read its buffer before the program's shared memory goes


# Parameters: the per-call ones (descriptors, pointers, float scalars) first, then the integers, then constexprs.
@gluon.jit
def _hopper_fwd_kernel(Q, Q2, K, K2, V, O, O_PTR, LSE, SINK, RNG, TILES, CU_SEQLENS_Q, CU_SEQLENS_K, COUNTER,
                       qk_scale, dropout_p, stride_lb: gl.int32, stride_lh: gl.int32, seqlen_q: gl.int32,
                       seqlen_k: gl.int32, wl: gl.int32, wr: gl.int32, stride_om, stride_oh, n_items: gl.int32,
                       heads: gl.int32, chunk: gl.int32, HEAD_DIM: gl.constexpr, HEAD_DIM_TAIL: gl.constexpr,
                       BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, MASK_LEFT: gl.constexpr,
                       MASK_RIGHT: gl.constexpr, MASK_CHUNK: gl.constexpr, IS_VARLEN: gl.constexpr,
                       HAS_SINK: gl.constexpr, HAS_DROPOUT: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       LOADER_REGS: gl.constexpr):
    """The grid is one program per SM (at most n_items), persistent over n_items work items of 2 x BLOCK_M query
    rows of one (sequence, head) (Note [persistent forward]), and COUNTER counts the items handed out so far (0 at
    launch: its writer zeroes it). Q, K, V, O are host descriptors: over (B, S, H, D) for a dense batch, whose
    items are B x H x the query tiles (_dense_item) and which leaves O_PTR, stride_om/oh, TILES and CU_SEQLENS
    unused; over the packed (total, H, D) tensors for a varlen one, whose seqlen_q/k are the totals and whose
    n_items are heads x tile-list entries: TILES holds the (sequence, tile) list (ops/schedule.varlen_plan: longest
    sequences first, and within one the last tile first), and O_PTR is O's tensor, for the last tile of a varlen
    sequence (stride_lb is then 0). SINK: the learnable sinks (HAS_SINK; else unused). RNG and dropout_p: the
    call's seed and stream (ops/dropout.py) and p (HAS_DROPOUT; else unused). HEAD_DIM is V's and O's head
    dim and the first HEAD_DIM columns of Q's and K's, whose descriptors' boxes are that wide; HEAD_DIM_TAIL > 0
    (MLA prefill's q/k 192 with v 128: 128 + 64) reads Q's and K's next HEAD_DIM_TAIL columns through Q2 and K2,
    descriptors over those columns (else Q2 and K2 are unused).

    Note [persistent forward]: a program of this kernel pays a fixed cost besides its key blocks. Timed
    inside the kernel (globaltimer and clock64 at each phase, H200): its start 0.4 µs (0.9 with the
    varlen lookups), the Q load 1.2 µs, the first S and its softmax with no P V to hide them 1.3 µs, the last P V,
    the O store 1.1 µs, and 0.6-0.7 µs between one program's end and the next one's start on the SM: some 7,000
    cycles, 2.5 key blocks. Dense 4k programs see 32 key blocks (16 causal), the 16-sequence mix's 14 (8 causal).
    So a program works through items, and each item's fixed costs land under another's key blocks:
    - the loader takes the next item from COUNTER (an atomic add), in the list's order, when it has issued the
      current item's last K/V load: the greedy order the hardware gives a grid's programs, which balances causal
      items of unequal cost (a static round-robin over programs made the causal mix 10% slower);
    - an item is (sequence, head, tile), the tiles fastest within a sequence, so that the items in flight share a
      few heads' K/V in L2 (heads fastest, Note [varlen grid order], was 6% slower on 4k sequences here);
    - Q has two sets of buffers, item r in set r % 2, so the next item's Q loads under the current one's key
      blocks. The second set takes one K slot: K and V have rings of their own, STAGES - 1 and STAGES slots, and a
      consumer hands K_j back as soon as S_j is done, V_j after P_j V_j (one joint ring of two slots starved the
      in-warpgroup overlap: 17% slower);
    - the loader describes each item to the consumers in shared memory (hopper_common.publish_item: `info`, a
      slot per Q set), so they never wait on a global load between items;
    - a consumer stages O in its item's Q buffer and leaves the TMA store in flight; once the next item's first S
      is issued, it waits for the store to have read the buffer and hands the buffer back (`q_free`), for the
      item after next.
    The first item past the list (or past n_items) is published invalid and ends the program. Measured against
    the one-program-per-tile grid on varlen batches (same results bit for bit): the mix's forward 525-545 ->
    487-498 µs, causal 320-324 -> 295-298 (-8%); 16 sequences of 1k -10% (causal -9%); 4 of 4k -6% (causal -2%).
    Dense batches take the same path, their items numbered in the same order (_dense_item), with no list.

    Note [varlen grid order]: in the varlen grids of the Triton kernels the heads are the fastest axis
    (seqlen.tile_coords), so the programs in flight are every head of a few tiles. A row of a packed (total, H, D)
    tensor holds all its heads (H x 256 bytes at d128), so they read whole rows together; with the tile list
    fastest (a dense grid's order) they were the tiles of one head of many sequences, each reading 256 bytes of
    every row. On the 16-sequence mix (H200, bf16, d128, H=16) heads first made the then one-program-per-tile
    Gluon dK/dV 4% faster (7% causal) and forward 4%. The dense grids keep theirs (heads first is not
    measured there), and the persistent Gluon kernels their own (tiles fastest within a sequence: above).

    Note [varlen descriptors]: a box over a packed tensor does not end where the sequence does, so the last tile of
    a sequence reads (and would write) the next sequence's rows. Reading them is harmless for Q and K: a query row
    past the sequence gives a row that is neither stored nor written to the LSE, and keys past it sit in a masked
    block, whose scores apply_mask replaces (a `where`, so an inf or NaN there does not survive). Not for V: a row
    past the sequence meets P = 0 in P V, and 0 x inf is NaN, so the consumers zero those rows of the last V tile
    (hopper_common.zero_rows_from) before its wgmma. A tile of O that ends past the sequence is staged in shared
    memory as for the TMA store, then stored by pointer under a row mask (store_rows). Descriptors built on the
    device over each sequence's rows, which end where it does, did this job before; each costs a global
    write and a fence before its first use, and replacing the forward's last two and all six of dK/dV's made the
    16-sequence mix 4% faster forward (9% causal) and 3% forward+backward (7% causal), with bitwise the same results
    (docs/design/descriptors.md)."""
    gl.static_assert(BLOCK_N == 2 * BLOCK_M, "both consumers must need the same key blocks")
    KS: gl.constexpr = STAGES - 1  # the second Q set takes one K slot's shared memory
    VS: gl.constexpr = STAGES
    k_s = tile_buffers(K, KS, BLOCK_N, HEAD_DIM, IS_VARLEN)
    v_s = tile_buffers(V, VS, BLOCK_N, HEAD_DIM, IS_VARLEN)
    k2_s = k_s  # the tails' buffers, used only with HEAD_DIM_TAIL
    q2_s = k_s
    if HEAD_DIM_TAIL > 0:
        k2_s = tile_buffers(K2, KS, BLOCK_N, HEAD_DIM_TAIL, IS_VARLEN)
        q2_s = tile_buffers(Q2, 4, BLOCK_M, HEAD_DIM_TAIL, IS_VARLEN)
    v_ready = barrier_array(VS, 1)  # V's ring: ring_barriers' ready and empty are K's
    v_empty = barrier_array(VS, 2)
    # Two sets of Q buffers (2 * set + consumer); q_free[i]: buffer i holds nothing its item still needs.
    q_s = tile_buffers(Q, 4, BLOCK_M, HEAD_DIM, IS_VARLEN)
    q_free = barrier_array(4, 1)
    info = info_slots()
    held, ready, empty = ring_barriers(KS, 4)  # its fence covers the barriers above too
    sets = BufferSets(held, q_free, info)
    k_ring = Ring(ready, empty, KS)
    v_ring = Ring(v_ready, v_empty, VS)
    gl.warp_specialize([
        (_consumer, (0, O, O_PTR, LSE, SINK, RNG, q_s, q2_s, k_s, k2_s, v_s, sets, k_ring, v_ring, wl, wr, chunk,
                     qk_scale, dropout_p, stride_lb, stride_lh, stride_om, stride_oh, heads, HEAD_DIM, HEAD_DIM_TAIL,
                     BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, MASK_CHUNK, IS_VARLEN, HAS_SINK, HAS_DROPOUT)),
        (_consumer, (1, O, O_PTR, LSE, SINK, RNG, q_s, q2_s, k_s, k2_s, v_s, sets, k_ring, v_ring, wl, wr, chunk,
                     qk_scale, dropout_p, stride_lb, stride_lh, stride_om, stride_oh, heads, HEAD_DIM, HEAD_DIM_TAIL,
                     BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, MASK_CHUNK, IS_VARLEN, HAS_SINK, HAS_DROPOUT)),
        (_loader, (Q, Q2, K, K2, V, q_s, q2_s, k_s, k2_s, v_s, sets, k_ring, v_ring, COUNTER, TILES, CU_SEQLENS_Q,
                   CU_SEQLENS_K, seqlen_q, seqlen_k, wl, wr, chunk, n_items, heads, BLOCK_M, BLOCK_N, HEAD_DIM_TAIL,
                   GROUP, MASK_LEFT, MASK_RIGHT, MASK_CHUNK, IS_VARLEN)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
