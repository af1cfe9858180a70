"""The Hopper dQ kernel: a warp-specialised Gluon kernel for sm_90 (H100/H200), the backward's query-side pass on the
structure of kernels/hopper_fwd.py. It also writes delta = rowsum(dO * O), which the dK/dV kernel (hopper_bwd.py),
launched after it on the same stream, reads.

A program is persistent: it computes dQ for work items of 2 x BLOCK_M query rows of one (sequence, head), one after
another, dense and varlen batches alike (Note [persistent dQ]):

  loader partition (1 warp)            TMA: each item's Q and dO tiles for both consumers, then K_j and V_j into
                                       a ring of STAGES slots; it waits on a slot's `empty` barrier before
                                       refilling it
                                       (and, varlen, zeroes the rows past the sequence in its last block: below)
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
included). Rows past seqlen_q read lse = +inf: their probabilities are 0, and their dQ rows are not stored (a dense
batch's descriptors end where the sequence does; a varlen sequence's partial last tile goes through
hopper_common.store_rows). A varlen batch's descriptors run over the packed tensors (Note [varlen descriptors] in
hopper_fwd.py): query and dO rows past the sequence only reach their own rows of dQ, but key and value rows past
it would reach every row (0 x inf in dS K and in dO Vᵀ's dS), so the loader lands the block the sequence ends in
on a barrier of its own, zeroes those rows of K and V (zero_rows_from) and only then releases the slot, as the
dK/dV loader does for Q and dO.

Note [persistent dQ]: the forward's and dK/dV's persistence (Notes [persistent forward] in
hopper_fwd.py and [persistent dK/dV] in hopper_bwd.py) for the dQ pass. One program per SM takes (sequence,
head, query tile) items from a work counter: a varlen batch's over the plan's last-first list of 2 x BLOCK_M-row
tiles (the forward's list; counters[2] of ops/schedule.Plan), a dense batch's numbered in the same order
(hopper_common.dense_work_item) with a counter zeroed per call; two sets of Q/dO buffers, item r in set r % 2, so that the next
item's Q and dO load under the current one's key blocks; the loader describes each item in shared memory
(hopper_common.publish_item); the K/V ring runs on from item to item. A consumer stages dQ in its Q buffer and
leaves the store in flight; at its next item it waits for that store and hands the set back (`q_free`). What it
hides: a Triton dQ program's fixed cost besides its key blocks, the held tiles' loads, delta and the store, ~5 µs
(docs/design/scheduling.md), which the 16-sequence mix pays on twice as many programs per FLOP as dense 4k. On
the H200 against the Triton varlen dQ it replaced, the mix's forward+backward is 4.5% faster, causal 0-8%
(noisy), with the same gradient checksums. Dense batches: not yet timed against the one-program-per-tile grid.

Note [dQ update in its block]: with the update kept in flight into the next block (issued behind that block's S
and dP, as the forward keeps P V in flight under the softmax), the accumulators in flight outgrew what ptxas had
registers for, and it serialised every wgmma of the kernel (C7512): the kernel was then 3-6% slower over forward
+ backward than the Triton dQ. Waited for in its block, ptxas keeps the wgmma asynchronous, and the two consumer
warpgroups still overlap one another's updates: on the H200, gradients whose checksums equal the Triton dQ
kernel's, forward+backward 1.2-2.8% faster on dense batches at S = 1k-16k (docs/design/hopper-pipeline.md).

Scope (ops/hopper.py): as the other Gluon kernels, dense and varlen batches, fp16/bf16, D 128 and q/k 192 with v
128 (HEAD_DIM_TAIL, Note [head dim parts] in hopper_common.py), MHA/GQA/MQA, any lengths, causal and sliding
windows, chunked attention (MASK_CHUNK), dropout (HAS_DROPOUT: dP_j's entries are dropped and scaled by 1 / (1 - p)
as in kernels/bwd.py, the mask drawn entry by entry where dP_j sits, under the dP matmul: Note [dropout entries]
in dropout.py). Not softcap, ALiBi, seqused.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate

from .dropout import cleared, dropout_state, keep_words, packed_threshold
from .hopper_common import (BufferSets, Ring, barrier_array, dense_work_item, info_slots, item_fields,
                            pass_over, publish_item, read_item, ring_barriers, store_rows, take_item, tile_buffers,
                            tma_load, tma_store, work_item, zero_rows_from)
from .masking import LOG2E, apply_mask, kv_block_range


@gluon.jit
def _load_item(q_desc, q2_desc, do_desc, k_desc, k2_desc, v_desc, q_s, q2_s, do_s, k_s, k2_s, v_s, held, ring,
               landed, b, h, hk, m_start, lo, n_blocks, q_row0, k_row0, seqlen_k, it0, q0, n_landed,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_TAIL: gl.constexpr,
               IS_VARLEN: gl.constexpr):
    """The loads of one work item: both consumers' Q and dO tiles into buffers q0 and q0 + 1, then its key blocks
    into the K/V ring from position it0 (with HEAD_DIM_TAIL, Q's and K's tail columns into q2_s and k2_s on the same
    barriers). q_row0 and k_row0: where the sequence's rows start in the packed tensors (varlen; 0 for a dense
    batch). n_landed counts the blocks landed on `landed` before this item (its phase); returns the count after
    it."""
    q_bytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes
                             + (q2_desc.block_type.nbytes if HEAD_DIM_TAIL > 0 else 0))
    kv_bytes: gl.constexpr = (k_desc.block_type.nbytes + v_desc.block_type.nbytes
                              + (k2_desc.block_type.nbytes if HEAD_DIM_TAIL > 0 else 0))
    for c in gl.static_range(2):
        bar = held.index(q0 + c)
        row = q_row0 + m_start + c * BLOCK_M
        mbarrier.expect(bar, q_bytes)
        tma_load(q_desc, b, row, h, bar, q_s.index(q0 + c), IS_VARLEN)
        if HEAD_DIM_TAIL > 0:
            tma_load(q2_desc, b, row, h, bar, q2_s.index(q0 + c), IS_VARLEN)
        tma_load(do_desc, b, row, h, bar, do_s.index(q0 + c), IS_VARLEN)
    for j in range(n_blocks):
        it = it0 + j
        ring.wait_empty(it)
        slot = ring.slot(it)
        n0 = lo + j * BLOCK_N
        if IS_VARLEN and n0 + BLOCK_N > seqlen_k:
            # The block the sequence ends in (the item's last): it lands on `landed`, this warp zeroes the next
            # sequence's rows of K and V, then releases it.
            mbarrier.expect(landed, kv_bytes)
            tma_load(k_desc, b, k_row0 + n0, hk, landed, k_s.index(slot), IS_VARLEN)
            if HEAD_DIM_TAIL > 0:
                tma_load(k2_desc, b, k_row0 + n0, hk, landed, k2_s.index(slot), IS_VARLEN)
            tma_load(v_desc, b, k_row0 + n0, hk, landed, v_s.index(slot), IS_VARLEN)
            mbarrier.wait(landed, n_landed & 1)
            n_landed += 1
            zero_rows_from(k_s.index(slot).reshape([BLOCK_N, HEAD_DIM]), seqlen_k - n0, BLOCK_N, HEAD_DIM, 1)
            if HEAD_DIM_TAIL > 0:
                zero_rows_from(k2_s.index(slot).reshape([BLOCK_N, HEAD_DIM_TAIL]), seqlen_k - n0, BLOCK_N,
                               HEAD_DIM_TAIL, 1)
            zero_rows_from(v_s.index(slot).reshape([BLOCK_N, HEAD_DIM]), seqlen_k - n0, BLOCK_N, HEAD_DIM, 1)
            mbarrier.arrive(ring.ready_bar(it), count=1)
        else:
            bar = ring.ready_bar(it)
            mbarrier.expect(bar, kv_bytes)
            tma_load(k_desc, b, k_row0 + n0, hk, bar, k_s.index(slot), IS_VARLEN)
            if HEAD_DIM_TAIL > 0:
                tma_load(k2_desc, b, k_row0 + n0, hk, bar, k2_s.index(slot), IS_VARLEN)
            tma_load(v_desc, b, k_row0 + n0, hk, bar, v_s.index(slot), IS_VARLEN)
    return n_landed


@aggregate
class _Item:
    """One work item as the persistent loader describes it to the consumers, in publish_item's field order
    (hopper_common): `valid` (false for the first item past the list, which ends the program), the query head, the
    item's first query row in its sequence, where the sequence's queries start in the packed tensor, both lengths,
    the item's first key block and how many it has, a dense batch's sequence for its descriptors (0 for a varlen
    item, whose q_row0 places it), and the item's sequence, which the dropout mask takes."""
    valid: gl.tensor
    h: gl.tensor
    m_start: gl.tensor
    q_row0: gl.tensor
    seqlen_q: gl.tensor
    seqlen_k: gl.tensor
    lo: gl.tensor
    n_blocks: gl.tensor
    b: gl.tensor
    seq: gl.tensor

    @gluon.constexpr_function
    def __init__(self, valid, h, m_start, q_row0, seqlen_q, seqlen_k, lo, n_blocks, b, seq):
        item_fields(self, locals())


@gluon.jit
def _read_item(slot):
    """The item _loader published in slot."""
    valid, h, m_start, q_row0, seqlen_q, seqlen_k, lo, n_blocks, b, seq, _, _ = read_item(slot)
    return _Item(valid, h, m_start, q_row0, seqlen_q, seqlen_k, lo, n_blocks, b, seq)


@gluon.jit
def _loader(q_desc, q2_desc, do_desc, k_desc, k2_desc, v_desc, q_s, q2_s, do_s, k_s, k2_s, v_s, sets, ring, landed,
            COUNTER, TILES, CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k, wl, wr, chunk, n_items, heads,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_TAIL: gl.constexpr,
            GROUP: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, MASK_CHUNK: gl.constexpr,
            IS_VARLEN: gl.constexpr):
    """A persistent program's loader (Note [persistent dQ]): it takes the next item from the work counter,
    describes it to the consumers and loads its Q and dO into its set of buffers (hopper_common.BufferSets), once
    both consumers have handed that set back; the K/V ring runs on from item to item. The first item past the list
    (a varlen batch's) or past n_items is published invalid, which ends the program. seqlen_q and seqlen_k: a dense
    batch's lengths, a varlen batch's packed totals."""
    it0 = 0
    r = 0
    n_landed = 0
    done = False
    while not done:
        w = take_item(COUNTER, n_items, not IS_VARLEN)  # a varlen plan's counters are zeroed per call
        if IS_VARLEN:
            valid, b, h, tile, q_row0, sq, k_row0, sk = work_item(gl.minimum(w, n_items - 1), heads, TILES,
                                                                  CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k,
                                                                  2 * BLOCK_M, True, False)
            valid = valid & (w < n_items)
            seq = b
            b = 0  # the descriptors are over the packed tensors
        else:
            b, h, tile = dense_work_item(gl.minimum(w, n_items - 1), heads, seqlen_q, 2 * BLOCK_M, True)
            valid = w < n_items
            q_row0, sq, k_row0, sk, seq = 0, seqlen_q, 0, seqlen_k, b
        m_start = tile * 2 * BLOCK_M
        lo, _, _, hi = kv_block_range(m_start, sq, sk, wl, wr, 2 * BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT,
                                      chunk, MASK_CHUNK)
        n_blocks = (hi - lo + BLOCK_N - 1) // BLOCK_N
        sets.wait_free(r)
        publish_item(sets.info_slot(r), valid, h, m_start, q_row0, sq, sk, lo, n_blocks, b, seq, 0, 0)  # _Item
        if valid:
            n_landed = _load_item(q_desc, q2_desc, do_desc, k_desc, k2_desc, v_desc, q_s, q2_s, do_s, k_s, k2_s, v_s,
                                  sets.held, ring, landed, b, h, h // GROUP, m_start, lo, n_blocks, q_row0, k_row0,
                                  sk, it0, sets.buffer(r, 0), n_landed, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_TAIL,
                                  IS_VARLEN)
            it0 += n_blocks
        else:
            sets.end(r)
            done = True
        r += 1


@gluon.jit
def _delta(do_t, OUT, o_off, stride_om, m0, seqlen_q, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
           row_layout: gl.constexpr):
    """rowsum(dO * O) of this consumer's rows m0 .. m0 + BLOCK_M - 1, in row_layout; 0 for rows past seqlen_q. dO
    comes from shared memory, O (read nowhere else) by pointer loads."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blk))
    ptrs = OUT + o_off + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
    o = gl.load(ptrs, mask=gl.expand_dims(rows < seqlen_q, 1), other=0.0).to(gl.float32)
    do = do_t.load(blk).to(gl.float32)
    return gl.convert_layout(gl.sum(o * do, 1), row_layout)


@gluon.jit
def _consume_item(c: gl.constexpr, dq_desc, dq2_desc, DQ_PTR, OUT, LSE, DELTA, q_s, q2_s, do_s, k_s, k2_s, v_s, ring,
                  b, h, m_start, lo, n_blocks, o_off, stride_om, lse_off, q_row0, seqlen_q, seqlen_k, wl, wr, chunk,
                  qk_scale, softmax_scale, drop, drop_scale, stride_dqm, stride_dqh, it0, qi, HEAD_DIM: gl.constexpr,
                  HEAD_DIM_TAIL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr,
                  MASK_RIGHT: gl.constexpr, MASK_CHUNK: gl.constexpr, IS_VARLEN: gl.constexpr,
                  HAS_DROPOUT: gl.constexpr):
    """Consumer c's BLOCK_M rows of one work item, its Q and dO in buffers qi (landed), whose key blocks start at
    ring position it0. It leaves its dQ store in flight. With HEAD_DIM_TAIL, S = Q Kᵀ runs as two wgmmas into one
    accumulator and dQ's tail columns accumulate on their own (Note [head dim parts] in hopper_common.py). drop:
    (seed, stream, b * H + h, c, t) of the dropout mask (HAS_DROPOUT; dropout.packed_threshold's c and t),
    drop_scale 1 / (1 - p)."""
    dtype: gl.constexpr = q_s.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    TAIL: gl.constexpr = HEAD_DIM_TAIL if HEAD_DIM_TAIL > 0 else HEAD_DIM  # the tail's tiles' width (read if any)
    acc2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, TAIL, 16])
    a2_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc2_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    diag = seqlen_k - seqlen_q
    m0 = m_start + c * BLOCK_M
    rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
    q_t = q_s.index(qi).reshape([BLOCK_M, HEAD_DIM])
    q2_t = q_t
    if HEAD_DIM_TAIL > 0:
        q2_t = q2_s.index(qi).reshape([BLOCK_M, TAIL])
    do_t = do_s.index(qi).reshape([BLOCK_M, HEAD_DIM])
    # This consumer's own key blocks: a contiguous part [j0, j1) of the item's, whose mask-free part is
    # [own_full_lo, own_full_hi) (kv_block_range for its BLOCK_M rows).
    own_lo, own_full_lo, own_full_hi, own_hi = kv_block_range(m0, seqlen_q, seqlen_k, wl, wr, BLOCK_M, BLOCK_N,
                                                              MASK_LEFT, MASK_RIGHT, chunk, MASK_CHUNK)
    j0 = gl.minimum(gl.maximum((own_lo - lo) // BLOCK_N, 0), n_blocks)
    j1 = gl.minimum(gl.maximum((own_hi - lo + BLOCK_N - 1) // BLOCK_N, j0), n_blocks)
    j1 = gl.where(m0 < seqlen_q, j1, j0)  # rows all past the sequence (the last tile's upper half): no work
    delta = _delta(do_t, OUT, o_off, stride_om, m0, seqlen_q, HEAD_DIM, BLOCK_M, row_layout)
    gl.store(DELTA + lse_off + rows, delta, mask=rows < seqlen_q)
    lse2 = gl.load(LSE + lse_off + rows, mask=rows < seqlen_q, other=float("inf")) * LOG2E
    if HAS_DROPOUT:
        # dS = P ∘ (Z ∘ dP - delta) with Z = scale or 0 is (scale P) ∘ (dP kept or 0 - delta / scale): the scale
        # moves into the row's LSE and delta, and the mask only clears dP's dropped entries (dropout.cleared).
        lse2 = lse2 - gl.log2(drop_scale)
        delta = delta / drop_scale
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=acc_layout)
    dq2 = gl.zeros([BLOCK_M, TAIL], gl.float32, layout=acc2_layout)  # with HEAD_DIM_TAIL only
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    pass_over(it0, it0 + j0, ring)
    for j in range(j0, j1):
        it = it0 + j
        slot = ring.slot(it)
        n0 = lo + j * BLOCK_N
        ring.wait_ready(it)
        k_t = k_s.index(slot).reshape([BLOCK_N, HEAD_DIM])
        v_t = v_s.index(slot).reshape([BLOCK_N, HEAD_DIM])
        s = warpgroup_mma(q_t, k_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        k2_t = k_t
        if HEAD_DIM_TAIL > 0:
            k2_t = k2_s.index(slot).reshape([BLOCK_N, TAIL])
            s = warpgroup_mma(q2_t, k2_t.permute((1, 0)), s, is_async=True)
        dp = warpgroup_mma(do_t, v_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        if (n0 < own_full_lo) | (n0 >= own_full_hi):
            cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s2 = apply_mask(s * qk_scale, gl.expand_dims(rows, 1), gl.expand_dims(cols, 0), seqlen_k, diag, wl, wr,
                            MASK_LEFT, MASK_RIGHT, True, chunk, MASK_CHUNK)
            p = gl.exp2(s2 - gl.expand_dims(lse2, 1))
        else:
            p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
        if HAS_DROPOUT:  # dP = Z ∘ (dO Vᵀ), as kernels/bwd.py; the mask drawn under the dP matmul
            seed, stream, bh, drop_c, drop_t = drop
            keys = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
            word, byte = keep_words(seed, stream, bh, gl.expand_dims(rows, 1), n0, keys, drop_c, drop_t, BLOCK_N)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        if HAS_DROPOUT:
            dp = cleared(dp, word, byte)
        ds = p * (dp - gl.expand_dims(delta, 1))
        dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), k_t, dq, is_async=True)
        if HEAD_DIM_TAIL > 0:
            dq2 = warpgroup_mma(gl.convert_layout(ds.to(dtype), a2_layout), k2_t, dq2, is_async=True)
            dq, dq2 = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dq2))
        else:
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))  # Note [dQ update in its block]
        ring.release(it)  # this consumer has read K_j and V_j
    pass_over(it0 + j1, it0 + n_blocks, ring)
    if m0 < seqlen_q:  # else no row of this tile is in the sequence (or the program is past the list)
        q_t.store((dq * softmax_scale).to(dtype))  # Q is no longer read: its buffer stages dQ for the store
        if HEAD_DIM_TAIL > 0:
            q2_t.store((dq2 * softmax_scale).to(dtype))
        fence_async_shared()
        if IS_VARLEN and m0 + BLOCK_M > seqlen_q:  # a box would also write the next sequence's rows
            store_rows(DQ_PTR, q_t, q_row0 + m0, seqlen_q - m0, h, stride_dqm, stride_dqh, BLOCK_M, HEAD_DIM)
            if HEAD_DIM_TAIL > 0:
                store_rows(DQ_PTR + HEAD_DIM, q2_t, q_row0 + m0, seqlen_q - m0, h, stride_dqm, stride_dqh, BLOCK_M,
                           TAIL)
        else:
            tma_store(dq_desc, b, q_row0 + m0, h, q_s.index(qi), IS_VARLEN)
            if HEAD_DIM_TAIL > 0:
                tma_store(dq2_desc, b, q_row0 + m0, h, q2_s.index(qi), IS_VARLEN)


@gluon.jit
def _consumer(c: gl.constexpr, dq_desc, dq2_desc, DQ_PTR, OUT, LSE, DELTA, RNG, q_s, q2_s, do_s, k_s, k2_s, v_s, sets,
              ring, wl, wr, chunk, qk_scale, softmax_scale, dropout_p, stride_lb, stride_lh, stride_ob, stride_om,
              stride_oh, stride_dqm, stride_dqh, heads, HEAD_DIM: gl.constexpr, HEAD_DIM_TAIL: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
              MASK_CHUNK: gl.constexpr, IS_VARLEN: gl.constexpr, HAS_DROPOUT: gl.constexpr):
    """A persistent program's consumer c: the loader's items, in its order, as it describes them (its r-th
    in its set of Q and dO buffers: hopper_common.BufferSets), until one is invalid. Once an item's Q and dO have
    landed, it waits for the previous item's dQ store to have read its staging buffer (the other set's) and hands
    that buffer back."""
    seed, stream, drop_c, drop_t, drop_scale = 0, 0, 0, 0, 1.0
    if HAS_DROPOUT:
        seed, stream, threshold, drop_scale = dropout_state(RNG, dropout_p)
        drop_c, drop_t = packed_threshold(threshold)
    it0 = 0
    r = 0
    done = False
    while not done:
        qi = sets.buffer(r, c)
        sets.wait_held(r, c)
        item = _read_item(sets.info_slot(r))
        if r > 0:
            tma.store_wait(pendings=0)
            sets.release(sets.other(qi))
        if item.valid:
            h64 = item.h.to(gl.int64)
            if IS_VARLEN:
                b = 0
                o_off = item.q_row0.to(gl.int64) * stride_om + h64 * stride_oh
                lse_off = h64 * stride_lh + item.q_row0
            else:
                b = item.b
                o_off = b.to(gl.int64) * stride_ob + h64 * stride_oh
                lse_off = b.to(gl.int64) * stride_lb + h64 * stride_lh
            drop = (seed, stream, item.seq * heads + item.h, drop_c, drop_t)
            _consume_item(c, dq_desc, dq2_desc, DQ_PTR, OUT, LSE, DELTA, q_s, q2_s, do_s, k_s, k2_s, v_s, ring, b,
                          item.h, item.m_start, item.lo, item.n_blocks, o_off, stride_om, lse_off, item.q_row0,
                          item.seqlen_q, item.seqlen_k, wl, wr, chunk, qk_scale, softmax_scale, drop, drop_scale,
                          stride_dqm, stride_dqh, it0, qi, HEAD_DIM, HEAD_DIM_TAIL, BLOCK_M, BLOCK_N, MASK_LEFT,
                          MASK_RIGHT, MASK_CHUNK, IS_VARLEN, HAS_DROPOUT)
            it0 += item.n_blocks
        else:
            done = True
        r += 1
    tma.store_wait(pendings=0)  # the last store has read its buffer before the program's shared memory goes


# Parameters: the per-call ones (descriptors, pointers, float scalars) first, then the integers, then constexprs.
@gluon.jit
def _hopper_dq_kernel(Q, Q2, K, K2, V, DO, DQ, DQ2, DQ_PTR, OUT, LSE, DELTA, RNG, TILES, CU_SEQLENS_Q, CU_SEQLENS_K,
                      COUNTER, qk_scale, softmax_scale, dropout_p, stride_lb: gl.int32, stride_lh: gl.int32,
                      stride_ob, stride_om, stride_oh, seqlen_q: gl.int32,
                      seqlen_k: gl.int32, wl: gl.int32, wr: gl.int32, stride_dqm, stride_dqh,
                      n_items: gl.int32, heads: gl.int32, chunk: gl.int32,
                      HEAD_DIM: gl.constexpr, HEAD_DIM_TAIL: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, MASK_LEFT: gl.constexpr,
                      MASK_RIGHT: gl.constexpr, MASK_CHUNK: gl.constexpr, IS_VARLEN: gl.constexpr,
                      HAS_DROPOUT: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    """The grid is one program per SM (at most n_items), persistent over n_items work items (Note [persistent dQ];
    COUNTER the zeroed work counter). Q, K, V, DO, DQ are host descriptors: over (B, S, H, D) for a dense batch,
    whose items are B x H x the query tiles and which leaves DQ_PTR, TILES, CU_SEQLENS and the dQ strides unused;
    over the packed (total, H, D) tensors for a varlen one, whose seqlen_q/k are the totals and whose n_items are
    heads x tile-list entries (TILES the plan's last-first list of 2 x BLOCK_M-row tiles). OUT is the forward's output, a pointer (read once per row, for delta) with its (batch, row,
    head) strides; LSE and DELTA share theirs. DQ_PTR is dQ's tensor, for the last tile of a varlen sequence.
    HEAD_DIM is V's and dO's head dim and the first HEAD_DIM columns of Q, K and dQ; HEAD_DIM_TAIL > 0 (MLA
    prefill's q/k 192 with v 128) reads and writes their next HEAD_DIM_TAIL columns through Q2, K2 and DQ2 (as the
    forward's Q2 and K2; else unused). RNG and dropout_p: the forward's seed and stream (ops/dropout.py) and p
    (HAS_DROPOUT; else unused)."""
    gl.static_assert(BLOCK_M % BLOCK_N == 0, "the two consumers' ranges differ by whole key blocks")
    landed = barrier_array(1, 1).index(0)
    k_s = tile_buffers(K, STAGES, BLOCK_N, HEAD_DIM, IS_VARLEN)
    v_s = tile_buffers(V, STAGES, BLOCK_N, HEAD_DIM, IS_VARLEN)
    k2_s = k_s  # the tails' buffers, used only with HEAD_DIM_TAIL
    q2_s = k_s
    if HEAD_DIM_TAIL > 0:
        k2_s = tile_buffers(K2, STAGES, BLOCK_N, HEAD_DIM_TAIL, IS_VARLEN)
        q2_s = tile_buffers(Q2, 4, BLOCK_M, HEAD_DIM_TAIL, IS_VARLEN)
    # Two sets of Q and dO buffers (2 * set + consumer); q_free[i]: buffer i holds nothing its item still needs.
    q_s = tile_buffers(Q, 4, BLOCK_M, HEAD_DIM, IS_VARLEN)
    do_s = tile_buffers(DO, 4, BLOCK_M, HEAD_DIM, IS_VARLEN)
    q_free = barrier_array(4, 1)
    info = info_slots()
    held, ready, empty = ring_barriers(STAGES, 4)  # its fence covers the barriers above too
    sets = BufferSets(held, q_free, info)
    ring = Ring(ready, empty, STAGES)
    gl.warp_specialize([
        (_consumer, (0, DQ, DQ2, DQ_PTR, OUT, LSE, DELTA, RNG, q_s, q2_s, do_s, k_s, k2_s, v_s, sets, ring, wl, wr,
                     chunk, qk_scale, softmax_scale, dropout_p, stride_lb, stride_lh, stride_ob, stride_om, stride_oh,
                     stride_dqm, stride_dqh, heads, HEAD_DIM, HEAD_DIM_TAIL, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT,
                     MASK_CHUNK, IS_VARLEN, HAS_DROPOUT)),
        (_consumer, (1, DQ, DQ2, DQ_PTR, OUT, LSE, DELTA, RNG, q_s, q2_s, do_s, k_s, k2_s, v_s, sets, ring, wl, wr,
                     chunk, qk_scale, softmax_scale, dropout_p, stride_lb, stride_lh, stride_ob, stride_om, stride_oh,
                     stride_dqm, stride_dqh, heads, HEAD_DIM, HEAD_DIM_TAIL, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT,
                     MASK_CHUNK, IS_VARLEN, HAS_DROPOUT)),
        (_loader, (Q, Q2, DO, K, K2, V, q_s, q2_s, do_s, k_s, k2_s, v_s, sets, ring, landed, COUNTER, TILES,
                   CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k, wl, wr, chunk, n_items, heads, BLOCK_M, BLOCK_N,
                   HEAD_DIM, HEAD_DIM_TAIL, GROUP, MASK_LEFT, MASK_RIGHT, MASK_CHUNK, IS_VARLEN)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
