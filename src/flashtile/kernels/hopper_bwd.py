"""The Hopper dK/dV kernel: a warp-specialised Gluon kernel for sm_90 (H100/H200), the structure of
kernels/hopper_fwd.py applied to the backward's key-side pass. dQ and delta = rowsum(dO * O) come from the dQ
kernel launched before this one on the same stream (the Gluon one, hopper_dq.py).

One program computes dK and dV for 2 x BLOCK_N keys of one (sequence, KV head), over every query head of its GQA
group (so nothing is reduced across programs, and the result is bitwise reproducible); a program is persistent
and computes one such item after another, dense and varlen batches alike (Note [persistent dK/dV]):

  loader partition (1 warp)            TMA: each item's K and V tiles, then Q_i and dO_i, head by head, into a ring
                                       of STAGES slots; it waits on a slot's `empty` barrier before refilling it
                                       (and, varlen, zeroes the rows past the sequence in its last tile: below)
  two consumer partitions (4 warps)    BLOCK_N keys each, the same Q/dO slots. Per query tile i, transposed
                                       (keys x queries) so that dK and dV accumulate without transposes:
                                         issue Sᵀ = K Q_iᵀ and dPᵀ = V dO_iᵀ; wait for Sᵀ only
                                         Pᵀ = exp2(Sᵀ·scale − lse2)              (under dPᵀ)
                                         issue dV += Pᵀ dO_i; wait for dPᵀ only
                                         dSᵀ = Pᵀ ∘ (dPᵀ − delta)                (under dV)
                                         issue dK += dSᵀ Q_i; wait for both; arrive on the slot's `empty`
                                       The tile's LSE and delta rows: pointer loads under Sᵀ and dPᵀ.

The program's query range is q_block_range's for its 2 x BLOCK_N keys; the tiles that some (query, key) pair of
the program does not see (its masked ends) apply the mask, with masking.apply_mask's test rearranged so that only
per-key bounds move with the tile (_tile says why); a consumer passes over the tiles that reach none of its keys
(it waits for each and releases it), as the dQ kernel's consumers do the key blocks their rows do not see.

Query rows past seqlen_q (in the last tile, which runs masked) read lse = +inf, so their probabilities are exactly 0
(as in kernels/bwd.py). In a dense batch, rows past a sequence are TMA's zero fill and the 4-d descriptors' stores
drop their gradient rows. A varlen batch's descriptors run over the packed tensors (Note [varlen descriptors] in
hopper_fwd.py): key rows past the sequence only reach their own rows of dK and dV, which are not stored (the last
key tile goes through hopper_common.store_rows); query and dO rows past it would reach every key's gradient (0 x inf
in dSᵀ Q and Pᵀ dO). So the loader lands that tile (the last of each head's pass) on a barrier of its own, zeroes
those rows (zero_rows_from) and only then releases the slot to the consumers. Zeroing in the consumers instead costs
them registers, and ptxas spills values that their loops reload every tile; here, on the 16-sequence mix with the
heads-first grid, dK/dV is 3% faster than with the consumers zeroing (causal: even).

Note [one loop per consumer]: a consumer runs its tiles in one loop, the mask under a branch in the edge tiles. Its
masked front tiles once ran in a loop of their own before the loop of the others, and the varlen kernel's gradients
were wrong for every key tile with no masked tile (causal, fewer queries than keys, one query head per KV head: q 1,
64 or 200 against 484 keys; errors 0.1-0.5, the same on every run, and a later launch could fault). From the results
on the H200 (torch 2.11, Triton 3.6 with its ptxas 12.8.93): the Sᵀ and dPᵀ matmuls of those tiles were right in
head dims 0-15 and wrong in the rest, that is in every k-step of the wgmma after the first; and the sm_90 SASS shows
why. ptxas computed the shared-memory descriptors of those k-steps (the tile's base plus each step's offset) once,
in uniform registers, in the first loop's preheader, and the second loop's preheader read them; when the first loop
had no iteration they held whatever was there before. The PTX defines them on both paths (a ptxas fault, not the
kernel's). With GQA the loops sit inside the group's loop and compile otherwise; the dense kernel was right. One
loop per consumer leaves nothing for another loop to define, and costs the edge test per tile. Covered by
tests/test_gpu_trust.py::test_varlen_backward_with_fewer_queries_than_keys.

Scope (ops/hopper.py): dense and varlen batches, fp16/bf16, D 128 and q/k 192 with v 128 (HEAD_DIM_TAIL, Note
[head dim parts] in hopper_common.py), MHA/GQA/MQA, any lengths, causal and sliding windows, chunked attention
(MASK_CHUNK, `chunk` keys: masking.py's notation); a learnable sink needs nothing here (its LSE holds it). Not
softcap, ALiBi, seqused.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate

from .hopper_common import (BufferSets, Ring, barrier_array, dense_work_item, info_slots, item_fields, pass_over,
                            publish_item, read_item, ring_barriers, store_rows, take_item, tile_buffers, tma_load,
                            tma_store, work_item, zero_rows_from)
from .masking import LOG2E, chunk_start, q_block_range


@gluon.jit
def _load_item(q_desc, q2_desc, k_desc, k2_desc, v_desc, do_desc, k_s, k2_s, v_s, q_s, q2_s, do_s, held, ring, landed,
               b, hk, n_start, lo, n_tiles, q_row0, k_row0, seqlen_q, it0, kv0, n_landed, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_TAIL: gl.constexpr, GROUP: gl.constexpr,
               IS_VARLEN: gl.constexpr):
    """The loads of one work item: both consumers' K and V tiles into buffers kv0 and kv0 + 1, then Q_i and dO_i,
    head by head, into the ring from position it0 (with HEAD_DIM_TAIL, K's and Q's tail columns into k2_s and q2_s
    on the same barriers). q_row0 and k_row0: where the sequence's rows start in the packed tensors (varlen; 0 for a
    dense batch). n_landed counts the tiles landed on `landed` before this item (its phase); returns the count after
    it."""
    kv_bytes: gl.constexpr = (k_desc.block_type.nbytes + v_desc.block_type.nbytes
                              + (k2_desc.block_type.nbytes if HEAD_DIM_TAIL > 0 else 0))
    q_bytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes
                             + (q2_desc.block_type.nbytes if HEAD_DIM_TAIL > 0 else 0))
    for c in gl.static_range(2):
        bar = held.index(kv0 + c)
        row = k_row0 + n_start + c * BLOCK_N
        mbarrier.expect(bar, kv_bytes)
        tma_load(k_desc, b, row, hk, bar, k_s.index(kv0 + c), IS_VARLEN)
        if HEAD_DIM_TAIL > 0:
            tma_load(k2_desc, b, row, hk, bar, k2_s.index(kv0 + c), IS_VARLEN)
        tma_load(v_desc, b, row, hk, bar, v_s.index(kv0 + c), IS_VARLEN)
    for g in range(GROUP):
        h = hk * GROUP + g
        for t in range(n_tiles):
            it = it0 + g * n_tiles + t
            ring.wait_empty(it)
            slot = ring.slot(it)
            m_start = lo + t * BLOCK_M
            if IS_VARLEN and m_start + BLOCK_M > seqlen_q:
                # The tile the sequence ends in (at most one per head, the last): it lands on `landed`, this warp
                # zeroes the next sequence's rows (Note [varlen descriptors] in hopper_fwd.py), then releases it.
                mbarrier.expect(landed, q_bytes)
                tma_load(q_desc, b, q_row0 + m_start, h, landed, q_s.index(slot), IS_VARLEN)
                if HEAD_DIM_TAIL > 0:
                    tma_load(q2_desc, b, q_row0 + m_start, h, landed, q2_s.index(slot), IS_VARLEN)
                tma_load(do_desc, b, q_row0 + m_start, h, landed, do_s.index(slot), IS_VARLEN)
                mbarrier.wait(landed, n_landed & 1)
                n_landed += 1
                zero_rows_from(q_s.index(slot).reshape([BLOCK_M, HEAD_DIM]), seqlen_q - m_start, BLOCK_M, HEAD_DIM, 1)
                if HEAD_DIM_TAIL > 0:
                    zero_rows_from(q2_s.index(slot).reshape([BLOCK_M, HEAD_DIM_TAIL]), seqlen_q - m_start, BLOCK_M,
                                   HEAD_DIM_TAIL, 1)
                zero_rows_from(do_s.index(slot).reshape([BLOCK_M, HEAD_DIM]), seqlen_q - m_start, BLOCK_M, HEAD_DIM,
                               1)
                mbarrier.arrive(ring.ready_bar(it), count=1)
            else:
                bar = ring.ready_bar(it)
                mbarrier.expect(bar, q_bytes)
                tma_load(q_desc, b, q_row0 + m_start, h, bar, q_s.index(slot), IS_VARLEN)
                if HEAD_DIM_TAIL > 0:
                    tma_load(q2_desc, b, q_row0 + m_start, h, bar, q2_s.index(slot), IS_VARLEN)
                tma_load(do_desc, b, q_row0 + m_start, h, bar, do_s.index(slot), IS_VARLEN)
    return n_landed


@gluon.jit
def _query_tiles(n_start, seqlen_q, seqlen_k, wl, wr, chunk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, MASK_CHUNK: gl.constexpr):
    """The query tiles of the program's 2 x BLOCK_N keys from n_start: (lo, n_front, n_mid, n_tiles). Tiles start
    at lo (a multiple of BLOCK_M); the first n_front and those from n_mid on run masked. Those starting in
    [full_lo, full_hi) see every key of the program; of them, the ones that end by seqlen_q need no mask at all, not
    even on their LSE and delta rows."""
    lo, full_lo, full_hi, hi = q_block_range(n_start, seqlen_q, seqlen_k, wl, wr, BLOCK_M, 2 * BLOCK_N,
                                             MASK_LEFT, MASK_RIGHT, chunk, MASK_CHUNK)
    n_tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    n_front = gl.minimum((full_lo - lo + BLOCK_M - 1) // BLOCK_M, n_tiles)
    n_mid = gl.minimum(gl.maximum(gl.minimum((full_hi - lo + BLOCK_M - 1) // BLOCK_M, (seqlen_q - lo) // BLOCK_M),
                                  n_front), n_tiles)
    return lo, n_front, n_mid, n_tiles


@aggregate
class _Item:
    """One work item as the persistent loader describes it to the consumers, in publish_item's field order
    (hopper_common): `valid` (false for the first item past the list, which ends the program), the KV head, the
    item's first key row in its sequence, where the sequence's queries and keys start in the packed tensors, both
    lengths, its query tiles (_query_tiles: the first one's row, the front and middle counts, how many), and a
    dense batch's sequence (a varlen item's rows place it)."""
    valid: gl.tensor
    hk: gl.tensor
    n_start: gl.tensor
    q_row0: gl.tensor
    seqlen_q: gl.tensor
    k_row0: gl.tensor
    seqlen_k: gl.tensor
    lo: gl.tensor
    n_front: gl.tensor
    n_mid: gl.tensor
    n_tiles: gl.tensor
    b: gl.tensor

    @gluon.constexpr_function
    def __init__(self, valid, hk, n_start, q_row0, seqlen_q, k_row0, seqlen_k, lo, n_front, n_mid, n_tiles, b):
        item_fields(self, locals())


@gluon.jit
def _read_item(slot):
    """The item _loader published in slot."""
    valid, hk, n_start, q_row0, seqlen_q, k_row0, seqlen_k, lo, n_front, n_mid, n_tiles, b = read_item(slot)
    return _Item(valid, hk, n_start, q_row0, seqlen_q, k_row0, seqlen_k, lo, n_front, n_mid, n_tiles, b)


@gluon.jit
def _loader(q_desc, q2_desc, k_desc, k2_desc, v_desc, do_desc, k_s, k2_s, v_s, q_s, q2_s, do_s, sets, ring, landed,
            COUNTER, TILES, CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k, wl, wr, chunk, n_items, heads,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_TAIL: gl.constexpr,
            GROUP: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, MASK_CHUNK: gl.constexpr,
            IS_VARLEN: gl.constexpr):
    """A persistent program's loader (Note [persistent dK/dV]): it takes the next item from the work counter,
    describes it to the consumers and loads its K and V into its set of buffers (hopper_common.BufferSets), once
    both consumers have handed that set back; the Q/dO ring runs on from item to item. The first item past the list
    (a varlen batch's) or past n_items is published invalid, which ends the program. seqlen_q and seqlen_k: a dense
    batch's lengths, a varlen batch's packed totals."""
    it0 = 0
    r = 0
    n_landed = 0
    done = False
    while not done:
        w = take_item(COUNTER, n_items, not IS_VARLEN)  # a varlen plan's counters are zeroed per call
        if IS_VARLEN:
            valid, b, hk, pid_n, q_row0, sq, k_row0, sk = work_item(gl.minimum(w, n_items - 1), heads, TILES,
                                                                    CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k,
                                                                    2 * BLOCK_N, False, True)
            valid = valid & (w < n_items)
            b_field = 0
        else:
            # Under a causal mask the first key tiles see the most queries: first first.
            b, hk, pid_n = dense_work_item(gl.minimum(w, n_items - 1), heads, seqlen_k, 2 * BLOCK_N, False)
            valid = w < n_items
            q_row0, sq, k_row0, sk, b_field = 0, seqlen_q, 0, seqlen_k, b
        n_start = pid_n * 2 * BLOCK_N
        lo, n_front, n_mid, n_tiles = _query_tiles(n_start, sq, sk, wl, wr, chunk, BLOCK_M, BLOCK_N, MASK_LEFT,
                                                   MASK_RIGHT, MASK_CHUNK)
        sets.wait_free(r)
        publish_item(sets.info_slot(r), valid, hk, n_start, q_row0, sq, k_row0, sk, lo, n_front, n_mid,
                     n_tiles, b_field)  # _Item
        if valid:
            n_landed = _load_item(q_desc, q2_desc, k_desc, k2_desc, v_desc, do_desc, k_s, k2_s, v_s, q_s, q2_s, do_s,
                                  sets.held, ring, landed, b, hk, n_start, lo, n_tiles, q_row0, k_row0, sq, it0,
                                  sets.buffer(r, 0), n_landed, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_TAIL, GROUP,
                                  IS_VARLEN)
            it0 += GROUP * n_tiles
        else:
            sets.end(r)
            done = True
        r += 1


@gluon.jit
def _tile(dk, dk2, dv, it, m_start, k_c, k2_c, v_c, q_s, q2_s, do_s, ring, lse_h, delta_h, kr, kl, offs_m, st_zero,
          seqlen_q, qk_scale, edge, a_layout: gl.constexpr, a2_layout: gl.constexpr, HEAD_DIM: gl.constexpr,
          HEAD_DIM_TAIL: gl.constexpr, BLOCK_M: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
          MASK_CHUNK: gl.constexpr):
    """One query tile of a consumer's loop (the schedule in the module docstring); returns (dk, dk2, dv), dk2 the
    tail columns' (HEAD_DIM_TAIL; else passed through). `edge`: the tile is at a masked end of the consumer's
    range, where some (query, key) pair is not visible."""
    dtype: gl.constexpr = q_s.dtype
    slot = ring.slot(it)
    ring.wait_ready(it)
    q_t = q_s.index(slot).reshape([BLOCK_M, HEAD_DIM])
    do_t = do_s.index(slot).reshape([BLOCK_M, HEAD_DIM])
    st = warpgroup_mma(k_c, q_t.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    q2_t = q_t
    if HEAD_DIM_TAIL > 0:  # Sᵀ over the tail columns too, into the same accumulator
        q2_t = q2_s.index(slot).reshape([BLOCK_M, HEAD_DIM_TAIL])
        st = warpgroup_mma(k2_c, q2_t.permute((1, 0)), st, is_async=True)
    dpt = warpgroup_mma(v_c, do_t.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    # This tile's LSE and delta rows, read under the two matmuls just issued; rows past seqlen_q read lse = +inf.
    # Scalar pointer first, then the arange: LLVM otherwise hoists 16 per-element 64-bit pointers per tensor out of
    # the loop (lse_h + offs_m), and they spill.
    lse_t = lse_h + m_start
    delta_t = delta_h + m_start
    lse2 = gl.load(lse_t + offs_m, mask=offs_m < seqlen_q - m_start, other=float("inf")) * LOG2E
    delta = gl.load(delta_t + offs_m, mask=offs_m < seqlen_q - m_start, other=0.0)
    st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
    s2 = st * qk_scale
    if MASK_LEFT or MASK_RIGHT or MASK_CHUNK:
        if edge:
            # apply_mask's test (key j visible to query i iff i + diag - wl <= j <= i + diag + wr, and j in the
            # chunk of i + diag) with i = m_start + offs_m, rearranged as per-key bounds on i, kr <= i <= kl, so
            # that only those bounds move with m_start: comparing a tile-independent i-expression instead makes
            # LLVM hoist 16 (or 32) per-element values out of the loop, which spill.
            qi = gl.expand_dims(offs_m, 0)
            visible = qi >= 0  # all true
            if MASK_RIGHT or MASK_CHUNK:
                visible = visible & (qi >= gl.expand_dims(kr - m_start, 1))
            if MASK_LEFT or MASK_CHUNK:
                visible = visible & (qi <= gl.expand_dims(kl - m_start, 1))
            s2 = gl.where(visible, s2, float("-inf"))
    pt = gl.exp2(s2 - gl.expand_dims(lse2, 0))
    dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_t, dv, is_async=True)
    dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt,))
    dst = pt * (dpt - gl.expand_dims(delta, 0))
    dk = warpgroup_mma(gl.convert_layout(dst.to(dtype), a_layout), q_t, dk, is_async=True)
    if HEAD_DIM_TAIL > 0:
        dk2 = warpgroup_mma(gl.convert_layout(dst.to(dtype), a2_layout), q2_t, dk2, is_async=True)
        dk, dk2, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dk2, dv))
    else:
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    ring.release(it)  # this consumer has read Q_i and dO_i
    return dk, dk2, dv


@gluon.jit
def _consume_item(c: gl.constexpr, kv, dk_desc, dk2_desc, dv_desc, DK_PTR, DV_PTR, LSE, DELTA, k_s, k2_s, v_s, q_s,
                  q2_s, do_s, ring, b, hk, n_start, lo, n_front, n_mid, n_tiles, lse_off, stride_lh, k_row0, seqlen_q,
                  seqlen_k, wl, wr, chunk, qk_scale, softmax_scale, stride_dkm, stride_dkh, stride_dvm, stride_dvh,
                  it0, HEAD_DIM: gl.constexpr, HEAD_DIM_TAIL: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, GROUP: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                  MASK_CHUNK: gl.constexpr, IS_VARLEN: gl.constexpr):
    """Consumer c's BLOCK_N keys of one work item, its K and V in buffers kv (landed), whose query tiles start at
    ring position it0. It leaves its dK/dV stores in flight."""
    dtype: gl.constexpr = dk_desc.dtype
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    TAIL: gl.constexpr = HEAD_DIM_TAIL if HEAD_DIM_TAIL > 0 else HEAD_DIM  # the tail's tiles' width (read if any)
    acc2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, TAIL, 16])
    a2_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc2_layout, k_width=2)
    k_c = k_s.index(kv).reshape([BLOCK_N, HEAD_DIM])
    k2_c = k_c
    if HEAD_DIM_TAIL > 0:
        k2_c = k2_s.index(kv).reshape([BLOCK_N, TAIL])
    v_c = v_s.index(kv).reshape([BLOCK_N, HEAD_DIM])
    key0 = n_start + c * BLOCK_N
    keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))  # one value per query (Sᵀ's columns)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    dk2 = gl.zeros([BLOCK_N, TAIL], gl.float32, layout=acc2_layout)  # with HEAD_DIM_TAIL only
    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)
    kr = keys - (seqlen_k - seqlen_q) - wr  # the first query row that sees each key (MASK_RIGHT)
    kl = keys - (seqlen_k - seqlen_q) + wl  # the last (MASK_LEFT)
    if MASK_CHUNK:
        # Query i sees key j only if i + diag lies in j's chunk: kr <= i <= kl within [c(j) - diag, c(j) + chunk).
        chunk_q0 = chunk_start(keys, chunk) - (seqlen_k - seqlen_q)
        if MASK_RIGHT:
            kr = gl.maximum(kr, chunk_q0)
        else:
            kr = chunk_q0
        if MASK_LEFT:
            kl = gl.minimum(kl, chunk_q0 + chunk - 1)
        else:
            kl = chunk_q0 + chunk - 1
    lse_h = LSE + lse_off
    delta_h = DELTA + lse_off
    # This consumer's own query tiles: a contiguous part [own0, own1) of the item's (q_block_range for its BLOCK_N
    # keys; none if its keys are all past the sequence). It passes over the others: under a causal mask the upper
    # consumer's first tile, which its keys do not reach.
    own_lo, _, _, own_hi = q_block_range(key0, seqlen_q, seqlen_k, wl, wr, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT,
                                         chunk, MASK_CHUNK)
    own0 = gl.minimum(gl.maximum((own_lo - lo) // BLOCK_M, 0), n_tiles)
    own1 = gl.minimum(gl.maximum((own_hi - lo + BLOCK_M - 1) // BLOCK_M, own0), n_tiles)
    own1 = gl.where(key0 < seqlen_k, own1, own0)
    front = gl.minimum(gl.maximum(n_front, own0), own1)  # the item's masked front and tail, within [own0, own1)
    mid = gl.minimum(gl.maximum(n_mid, front), own1)
    for g in range(GROUP):
        base = it0 + g * n_tiles
        pass_over(base, base + own0, ring)
        # One loop over the consumer's tiles; a tile at either masked end, [own0, front) or [mid, own1), applies
        # the mask under a branch (Note [one loop per consumer]).
        for t in range(own0, own1):
            edge = (t < front) | (t >= mid)
            dk, dk2, dv = _tile(dk, dk2, dv, base + t, lo + t * BLOCK_M, k_c, k2_c, v_c, q_s, q2_s, do_s, ring,
                                lse_h, delta_h, kr, kl, offs_m, st_zero, seqlen_q, qk_scale, edge, a_layout,
                                a2_layout, HEAD_DIM, HEAD_DIM_TAIL, BLOCK_M, MASK_LEFT, MASK_RIGHT, MASK_CHUNK)
        pass_over(base + own1, base + n_tiles, ring)
        lse_h += stride_lh
        delta_h += stride_lh
    if key0 < seqlen_k:  # else no key of this consumer is in the sequence
        # K and V are no longer read: this consumer's buffers stage its dK and dV for the stores.
        k_c.store((dk * softmax_scale).to(dtype))
        if HEAD_DIM_TAIL > 0:
            k2_c.store((dk2 * softmax_scale).to(dtype))
        v_c.store(dv.to(dtype))
        fence_async_shared()
        if IS_VARLEN and key0 + BLOCK_N > seqlen_k:  # a box would also write the next sequence's rows
            store_rows(DK_PTR, k_c, k_row0 + key0, seqlen_k - key0, hk, stride_dkm, stride_dkh, BLOCK_N, HEAD_DIM)
            if HEAD_DIM_TAIL > 0:
                store_rows(DK_PTR + HEAD_DIM, k2_c, k_row0 + key0, seqlen_k - key0, hk, stride_dkm, stride_dkh,
                           BLOCK_N, TAIL)
            store_rows(DV_PTR, v_c, k_row0 + key0, seqlen_k - key0, hk, stride_dvm, stride_dvh, BLOCK_N, HEAD_DIM)
        else:
            tma_store(dk_desc, b, k_row0 + key0, hk, k_s.index(kv), IS_VARLEN)
            if HEAD_DIM_TAIL > 0:
                tma_store(dk2_desc, b, k_row0 + key0, hk, k2_s.index(kv), IS_VARLEN)
            tma_store(dv_desc, b, k_row0 + key0, hk, v_s.index(kv), IS_VARLEN)


@gluon.jit
def _consumer(c: gl.constexpr, dk_desc, dk2_desc, dv_desc, DK_PTR, DV_PTR, LSE, DELTA, k_s, k2_s, v_s, q_s, q2_s, do_s,
              sets, ring, wl, wr, chunk, qk_scale, softmax_scale, stride_lb, stride_lh, stride_dkm, stride_dkh,
              stride_dvm, stride_dvh, HEAD_DIM: gl.constexpr, HEAD_DIM_TAIL: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, GROUP: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
              MASK_CHUNK: gl.constexpr, IS_VARLEN: gl.constexpr):
    """A persistent program's consumer c: the loader's items, in its order, as it describes them (its r-th
    in its set of K and V buffers: hopper_common.BufferSets), until one is invalid. Once an item's K and V have
    landed, it waits for the previous item's dK/dV stores to have read their staging buffers (the other set) and
    hands that set back."""
    it0 = 0
    r = 0
    done = False
    while not done:
        sets.wait_held(r, c)
        item = _read_item(sets.info_slot(r))
        if r > 0:
            tma.store_wait(pendings=0)
            sets.release(sets.previous(r, c))
        if item.valid:
            if IS_VARLEN:
                b = 0
                lse_off = (item.hk * GROUP).to(gl.int64) * stride_lh + item.q_row0
            else:
                b = item.b
                lse_off = b.to(gl.int64) * stride_lb + (item.hk * GROUP).to(gl.int64) * stride_lh
            _consume_item(c, sets.buffer(r, c), dk_desc, dk2_desc, dv_desc, DK_PTR, DV_PTR, LSE, DELTA, k_s, k2_s, v_s,
                          q_s, q2_s, do_s, ring, b, item.hk, item.n_start, item.lo, item.n_front, item.n_mid,
                          item.n_tiles, lse_off, stride_lh, item.k_row0, item.seqlen_q, item.seqlen_k, wl, wr, chunk,
                          qk_scale, softmax_scale, stride_dkm, stride_dkh, stride_dvm, stride_dvh, it0, HEAD_DIM,
                          HEAD_DIM_TAIL, BLOCK_M, BLOCK_N, GROUP, MASK_LEFT, MASK_RIGHT, MASK_CHUNK, IS_VARLEN)
            it0 += GROUP * item.n_tiles
        else:
            done = True
        r += 1
    tma.store_wait(pendings=0)  # the last stores have read their buffers before the program's shared memory goes


# Parameters: the per-call ones (descriptors, pointers, float scalars) first, then the integers, then constexprs.
@gluon.jit
def _hopper_dkdv_kernel(Q, Q2, K, K2, V, DO, DK, DK2, DV, DK_PTR, DV_PTR, LSE, DELTA, TILES, CU_SEQLENS_Q,
                        CU_SEQLENS_K, COUNTER, qk_scale, softmax_scale, stride_lb: gl.int32, stride_lh: gl.int32,
                        seqlen_q: gl.int32, seqlen_k: gl.int32, wl: gl.int32, wr: gl.int32,
                        stride_dkm, stride_dkh, stride_dvm, stride_dvh, n_items: gl.int32, heads: gl.int32,
                        chunk: gl.int32, HEAD_DIM: gl.constexpr, HEAD_DIM_TAIL: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, GROUP: gl.constexpr, MASK_LEFT: gl.constexpr,
                        MASK_RIGHT: gl.constexpr, MASK_CHUNK: gl.constexpr, IS_VARLEN: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    """The grid is one program per SM (at most n_items), persistent over n_items work items (Note [persistent
    dK/dV]; COUNTER the items handed out so far, 0 at launch). The six tensors are host descriptors. Dense: over
    (B, S, H, D), the items are B x Hk x the key tiles (hopper_common.dense_work_item, the first key tile first),
    and DK_PTR, DV_PTR, TILES, CU_SEQLENS and the dK/dV strides are unused. Varlen: over the packed (total, H, D)
    tensors, whose seqlen_q/k are the totals; the items are heads x tile-list entries: TILES holds the (sequence,
    key tile) list (ops/schedule.varlen_plan: ordered by each sequence's queries, ops/bwd.py, and within one the
    first key tile first). DK_PTR and DV_PTR are dK's and dV's tensors, for a sequence's last key tile. HEAD_DIM
    is V's and dO's head dim and the first HEAD_DIM columns of Q, K and dK; HEAD_DIM_TAIL > 0 reads and writes
    their next columns through Q2, K2 and DK2 (Note [head dim parts] in hopper_common.py; else unused).

    Note [persistent dK/dV]: the forward's persistence (Note [persistent forward] in hopper_fwd.py)
    applied to this kernel. One program per SM; the loader takes (sequence, KV head, key tile) items from COUNTER
    in the list's order (hopper_common.work_item: tiles fastest within a sequence), and the Q/dO ring runs on from
    one item to the next. K and V have two sets of buffers, item r in set r % 2, so the next item's K and V load
    under the current one's query tiles; the loader describes each item in shared memory (`info`); a consumer
    stages its dK and dV in its item's K and V buffers and leaves the TMA stores in flight until the next item's K
    and V have landed, then hands the set back (`kv_free`), for the item after next. The second set is what the
    ring's three slots leave of shared memory (224 KiB in all). Measured on the H200 (docs/design/scheduling.md):
    a program of the one-program-per-tile grid paid ~5.5 µs besides its query tiles (~1.8 µs each), and the
    16-sequence mix runs 16 programs per SM of 16 tiles (causal) where dense 4k runs 33. Persistent, the mix's
    causal dK/dV went from 553 to 497 µs (-10%), with the same results bit for bit; without a mask (31 tiles a
    program) 927 -> 937. Dense batches: not yet timed against the one-program-per-tile grid."""
    gl.static_assert(BLOCK_N % BLOCK_M == 0, "the two consumers' ranges differ by whole query tiles")
    q_s = tile_buffers(Q, STAGES, BLOCK_M, HEAD_DIM, IS_VARLEN)
    do_s = tile_buffers(DO, STAGES, BLOCK_M, HEAD_DIM, IS_VARLEN)
    landed = barrier_array(1, 1).index(0)
    # Two sets of K and V buffers (2 * set + consumer); kv_free[i]: buffer i holds nothing its item still needs.
    k_s = tile_buffers(K, 4, BLOCK_N, HEAD_DIM, IS_VARLEN)
    v_s = tile_buffers(V, 4, BLOCK_N, HEAD_DIM, IS_VARLEN)
    k2_s = k_s  # the tails' buffers, used only with HEAD_DIM_TAIL
    q2_s = q_s
    if HEAD_DIM_TAIL > 0:
        k2_s = tile_buffers(K2, 4, BLOCK_N, HEAD_DIM_TAIL, IS_VARLEN)
        q2_s = tile_buffers(Q2, STAGES, BLOCK_M, HEAD_DIM_TAIL, IS_VARLEN)
    kv_free = barrier_array(4, 1)
    info = info_slots()
    held, ready, empty = ring_barriers(STAGES, 4)  # its fence covers the barriers above too
    sets = BufferSets(held, kv_free, info)
    ring = Ring(ready, empty, STAGES)
    gl.warp_specialize([
        (_consumer, (0, DK, DK2, DV, DK_PTR, DV_PTR, LSE, DELTA, k_s, k2_s, v_s, q_s, q2_s, do_s, sets, ring, wl, wr,
                     chunk, qk_scale, softmax_scale, stride_lb, stride_lh, stride_dkm, stride_dkh, stride_dvm,
                     stride_dvh, HEAD_DIM, HEAD_DIM_TAIL, BLOCK_M, BLOCK_N, GROUP, MASK_LEFT, MASK_RIGHT, MASK_CHUNK,
                     IS_VARLEN)),
        (_consumer, (1, DK, DK2, DV, DK_PTR, DV_PTR, LSE, DELTA, k_s, k2_s, v_s, q_s, q2_s, do_s, sets, ring, wl, wr,
                     chunk, qk_scale, softmax_scale, stride_lb, stride_lh, stride_dkm, stride_dkh, stride_dvm,
                     stride_dvh, HEAD_DIM, HEAD_DIM_TAIL, BLOCK_M, BLOCK_N, GROUP, MASK_LEFT, MASK_RIGHT, MASK_CHUNK,
                     IS_VARLEN)),
        (_loader, (Q, Q2, K, K2, V, DO, k_s, k2_s, v_s, q_s, q2_s, do_s, sets, ring, landed, COUNTER, TILES,
                   CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k, wl, wr, chunk, n_items, heads, BLOCK_M, BLOCK_N,
                   HEAD_DIM, HEAD_DIM_TAIL, GROUP, MASK_LEFT, MASK_RIGHT, MASK_CHUNK, IS_VARLEN)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
