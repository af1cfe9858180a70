"""Split-KV decode (flash-decoding): attention of a few query tokens against a long, possibly paged, KV cache.

One program per (M tile x KV split, KV head, sequence). Decode is bandwidth-bound, so the design is about reading
every K/V row once and keeping enough programs in flight:
  - GQA packing: the GROUP query heads that share KV head hk and the Sq query tokens are packed into the M
    dimension of one tile (row m <-> token t = m // GROUP, query head h = hk * GROUP + m % GROUP), so each K/V tile
    is loaded once per KV head rather than once per query head, and a single decode token still fills a
    tensor-core tile (BLOCK_M >= 16).
  - Split-KV: the visible key range of a sequence is cut into num_splits contiguous chunks, one program each, so
    that batch x KV heads x splits keeps every SM streaming even for one long sequence. The chunks are derived on
    the device from cache_seqlens; the host chooses num_splits from shapes only (no synchronisation). A program
    writes a normalised partial (o, lse) state; combine.py merges them. With one split it writes the final output.
  - Loads: K/V rows are gathered with pointer loads rather than TMA descriptors, since a paged tile may span
    pages; each row is HEAD_DIM contiguous elements, so the loads stay 16-byte vectors, and Triton's pipeliner
    keeps several tiles in flight with cp.async (num_stages; see ops/decode.py for the paged stage count).

Notation (see masking.py for i, j, diag, wl, wr and log2-unit logits, kvcache.py for r, capacity, (page, off)):
  L          keys of sequence b: cache_seqlens[b] + S_new - leftpad[b]; logical key j is physical row
             r = j + leftpad. Masks are aligned bottom-right to L (diag = L - Sq).
  BLOCK_N    key rows per inner-loop step. Tiles are aligned on physical rows, so with page_size a multiple of
             BLOCK_N a tile never straddles a page; the first tile of a left-padded sequence is masked.
  PAGE_TILED PAGED with page_size a multiple of BLOCK_N: a tile's rows are contiguous in one page, so the kernel
             reads one block-table entry per tile instead of translating each row (kvcache.cache_coords).
  BLOCK_T    an upper bound on the query tokens one M tile spans (for the key block range).
  BLOCK_D, BLOCK_D2   the q/k head dim as two powers of two (config.head_dim_parts): columns [0, BLOCK_D) and,
             where BLOCK_D2 > 0, [BLOCK_D, BLOCK_D + BLOCK_D2), each product Q Kᵀ the sum of the parts' (DeepSeek's
             576 is 512 + 64: padded to one 1024-wide part, 44% of that product's work would be on zeros).
             BLOCK_D2 = 0: one part, BLOCK_D >= HEAD_DIM. Columns past HEAD_DIM are masked on load (the cache
             cannot be zero-padded, it is the caller's tensor).
  HEAD_DIM_V, BLOCK_DV   V's and O's head dim, which may differ from Q's and K's (MLA), and its power of two.
  V_IS_K     v_cache is a view of k_cache's first HEAD_DIM_V channels (an absorbed MLA cache) and BLOCK_DV =
             BLOCK_D: V's tile is K's first part, already on chip, so each cache row is read once. Its columns
             past HEAD_DIM_V hold K's other channels, so O's are garbage there; they are never stored.
  KEYS_M     the score tile is keys x rows (BLOCK_N x BLOCK_M) and acc is O's transpose (BLOCK_DV x BLOCK_M):
             S^T = K Q^T, O^T += V^T P^T, so the key rows are the MMA's M dimension and a few query rows (absorbed
             MLA decode's 16 heads) fill one warpgroup's wgmma (M = 64 keys, N = 16) with no padding, where rows x
             keys takes mma.sync tiles of 16 rows. Q is transposed once, O once at the end (Note [keys-major
             decode] in ops/decode.py).
  acc, m_i, l_i   the online softmax state, as in fwd.py.
  UPCAST     compute on fp32 copies of bf16 tiles: only under the CPU interpreter, which cannot compute on bf16.
  DOT_PRECISION   "ieee" for fp32 inputs (true fp32 products), "tf32" otherwise; from problem.kernel_flags.

Flags that change the code: PAGED (row translation through the block table), PAGE_TILED, HAS_BATCH_IDX,
HAS_LEFTPAD, V_IS_K, HAS_ROTARY (+ ROTARY_INTERLEAVED: the query tile is rotated as it is loaded, at position
cache_seqlens + t when the mask is causal/local, else at cache_seqlens), MASK_LEFT, MASK_RIGHT, HAS_SOFTCAP,
HAS_ALIBI, HAS_SINK (a learnable sink logit per query head, folded into split 0's state only: the merge of the
splits then counts it once; softmax.fold_sink), KEYS_M, UPCAST, DOT_PRECISION.
Never reads a row outside [leftpad, cache_seqlens + S_new) of its sequence, nor a block-table entry for one.
Does not write the cache (kvcache.py appends) and has no backward.
"""

import triton
import triton.language as tl

from .kvcache import cache_coords, rotary_load
from .masking import LOG2E, apply_mask, kv_block_range, logits
from .softmax import finalize, fold_sink, keys_major_step, online_softmax_step


@triton.jit
def _load_kv(ptrs, row_ok, d, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, END: tl.constexpr):
    """A (BLOCK_N, columns d) tile; END bounds d, and columns past HEAD_DIM load as 0. In MASKED blocks rows with
    row_ok false are not read and load as 0: a 0 in V times a probability of 0 stays 0, where a stray NaN would
    not."""
    if MASKED:
        if HEAD_DIM < END:
            return tl.load(ptrs, mask=row_ok[:, None] & (d < HEAD_DIM), other=0.0)
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    if HEAD_DIM < END:
        return tl.load(ptrs, mask=d < HEAD_DIM, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _load_q(q_ptrs, d, row_ok, seqlen_cache, i, COS, SIN, stride_cos, rotary_dim, seqlen_ro, HEAD_DIM: tl.constexpr,
            HAS_ROTARY: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr, PER_TOKEN: tl.constexpr,
            UPCAST: tl.constexpr):
    """Columns d of the packed query rows, rotated (HAS_ROTARY) at seqlen_cache, or at seqlen_cache + i for each
    token when the mask is causal or local (PER_TOKEN)."""
    mask = row_ok[:, None] & (d < HEAD_DIM)
    if HAS_ROTARY:
        pos = seqlen_cache
        if PER_TOKEN:
            pos = seqlen_cache + i
        q = rotary_load(q_ptrs, d, mask, pos, COS, SIN, stride_cos, rotary_dim, seqlen_ro, ROTARY_INTERLEAVED)
        q = q.to(q_ptrs.dtype.element_ty)
    else:
        q = tl.load(q_ptrs + d, mask=mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _decode_inner(acc, l_i, m_i, q, q2, K, V, BLOCK_TABLE, b, cache_b, hk, i, d, lo, hi,
                  r_lo, r_hi, seqlen_k, diag, wl, wr, chunk, qk_scale, softcap2, slope2,
                  stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                  stride_btb, page_size, page_mul, page_shift, num_pages,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
                  HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, V_IS_K: tl.constexpr, MASKED: tl.constexpr,
                  PAGED: tl.constexpr,
                  PAGE_TILED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, MASK_CHUNK: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, KEYS_M: tl.constexpr, UPCAST: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    dv = tl.arange(0, BLOCK_DV)[None, :]
    for start in tl.range(lo, hi, BLOCK_N):
        r = start + offs_n
        row_ok = (r >= r_lo) & (r < r_hi)  # the sequence's own rows; only MASKED blocks use (and compute) it
        if PAGE_TILED:
            # The tile lies in one page, which holds rows of this sequence: one block-table entry for all rows.
            page, off = cache_coords(start, b, cache_b, BLOCK_TABLE, stride_btb, page_size, page_mul, page_shift,
                                     num_pages, None, PAGED)
            off = off + offs_n
        elif MASKED:
            page, off = cache_coords(r, b, cache_b, BLOCK_TABLE, stride_btb, page_size, page_mul, page_shift,
                                     num_pages, row_ok, PAGED)
        else:
            page, off = cache_coords(r, b, cache_b, BLOCK_TABLE, stride_btb, page_size, page_mul, page_shift,
                                     num_pages, None, PAGED)
        k_rows = K + (page * stride_kb + off * stride_kn)[:, None] + hk * stride_kh
        k = _load_kv(k_rows + d, row_ok, d, MASKED, HEAD_DIM, BLOCK_D)
        if UPCAST:
            k = k.to(tl.float32)
        if KEYS_M:  # q and q2 hold the query rows transposed: s is keys x rows
            j = (r - r_lo)[:, None]  # logical key index
            s = tl.dot(k, q, input_precision=DOT_PRECISION)
        else:
            j = (r - r_lo)[None, :]
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if BLOCK_D2 > 0:
            d2 = BLOCK_D + tl.arange(0, BLOCK_D2)[None, :]
            k2 = _load_kv(k_rows + d2, row_ok, d2, MASKED, HEAD_DIM, BLOCK_D + BLOCK_D2)
            if UPCAST:
                k2 = k2.to(tl.float32)
            if KEYS_M:
                s = tl.dot(k2, q2, s, input_precision=DOT_PRECISION)
            else:
                s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PRECISION)
        s2, _ = logits(s, i, j, diag, qk_scale, softcap2, slope2, HAS_SOFTCAP, HAS_ALIBI)
        if MASKED:
            s2 = apply_mask(s2, i, j, seqlen_k, diag, wl, wr, MASK_LEFT, MASK_RIGHT, True, chunk, MASK_CHUNK)
        if KEYS_M:  # l_i: the keys x rows sums of keys_major_step
            p, alpha, l_i, m_i = keys_major_step(s2, m_i, l_i, MASKED)
        else:
            p, alpha, l_i, m_i = online_softmax_step(s2, 1.0, m_i, l_i, MASKED)
        if V_IS_K:
            v = k
        else:
            v = _load_kv(V + (page * stride_vb + off * stride_vn)[:, None] + hk * stride_vh + dv, row_ok, dv,
                         MASKED, HEAD_DIM_V, BLOCK_DV)
            if UPCAST:
                v = v.to(tl.float32)
        if KEYS_M:
            acc = tl.dot(tl.trans(v), p.to(v.dtype), acc * alpha[None, :], input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _decode_kernel(
    Q, K, V, O, LSE, CACHE_SEQLENS, CACHE_BATCH_IDX, LEFTPAD, BLOCK_TABLE, ALIBI, COS, SIN, SINK,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_os, stride_ob, stride_om, stride_oh,
    stride_ls, stride_lb, stride_lh, stride_lm,
    stride_btb, stride_ab, stride_cos,
    seqlen_q, seqlen_new, page_size, page_mul, page_shift, num_pages, capacity, rotary_dim, seqlen_ro,
    num_splits, num_m_tiles,
    qk_scale, softcap2, wl, wr, chunk,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, V_IS_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, GROUP: tl.constexpr,
    PAGED: tl.constexpr, PAGE_TILED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    HAS_ROTARY: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, MASK_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SINK: tl.constexpr, KEYS_M: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_D >= 16, "tl.dot needs every dimension >= 16")
    tl.static_assert(BLOCK_D2 == 0 or BLOCK_D2 >= 16, "tl.dot needs every dimension >= 16")
    tl.static_assert(not V_IS_K or BLOCK_DV == BLOCK_D, "V's tile is K's first part")
    # M tiles of one split are neighbours in launch order, so they share the split's K/V through L2.
    m_tile = tl.program_id(0) % num_m_tiles
    split = tl.program_id(0) // num_m_tiles
    hk = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)

    cache_b = b
    if HAS_BATCH_IDX:
        cache_b = tl.load(CACHE_BATCH_IDX + b)
    # Lengths come from device memory and are checked only under FLASHTILE_CHECK=1 (a host sync). Clamping them to
    # the rows a sequence can own keeps a bad value from ever addressing memory outside its cache.
    seqlen_cache = tl.minimum(tl.maximum(tl.load(CACHE_SEQLENS + b), 0), capacity - seqlen_new)
    r_hi = seqlen_cache + seqlen_new  # one past the last physical row
    r_lo = 0
    if HAS_LEFTPAD:
        r_lo = tl.minimum(tl.maximum(tl.load(LEFTPAD + b), 0), r_hi)
    seqlen_k = r_hi - r_lo
    diag = seqlen_k - seqlen_q

    # Packed rows of this tile: token t, query head h.
    m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    t = m // GROUP
    h = hk * GROUP + m % GROUP
    row_ok = t < seqlen_q
    i = t[None, :] if KEYS_M else t[:, None]  # as the score tile holds its rows
    d = tl.arange(0, BLOCK_D)[None, :]
    q_ptrs = Q + b64 * stride_qb + (t * stride_qm + h * stride_qh)[:, None]
    q = _load_q(q_ptrs, d, row_ok, seqlen_cache, t[:, None], COS, SIN, stride_cos, rotary_dim, seqlen_ro, HEAD_DIM,
                HAS_ROTARY, ROTARY_INTERLEAVED, MASK_LEFT or MASK_RIGHT, UPCAST)
    q2 = q  # unused with one part
    if BLOCK_D2 > 0:
        q2 = _load_q(q_ptrs, BLOCK_D + tl.arange(0, BLOCK_D2)[None, :], row_ok, seqlen_cache, t[:, None], COS, SIN,
                     stride_cos, rotary_dim, seqlen_ro, HEAD_DIM, HAS_ROTARY, ROTARY_INTERLEAVED,
                     MASK_LEFT or MASK_RIGHT, UPCAST)
        if KEYS_M:
            q2 = tl.trans(q2)
    if KEYS_M:
        q = tl.trans(q)
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + b * stride_ab + h, mask=row_ok, other=0.0) * LOG2E
        slope2 = slope2[None, :] if KEYS_M else slope2[:, None]

    # Key blocks in physical rows: the window bounds (bottom-right aligned, so shifting keys and diag by leftpad
    # changes nothing), then the left padding, whose first block is partial and so masked.
    t_first = m_tile * BLOCK_M // GROUP
    lo, full_lo, full_hi, hi = kv_block_range(t_first, seqlen_q, r_hi, wl, wr, BLOCK_T, BLOCK_N,
                                              MASK_LEFT, MASK_RIGHT, chunk, MASK_CHUNK, r_lo)
    if HAS_LEFTPAD:
        lo = tl.minimum(tl.maximum(lo, (r_lo // BLOCK_N) * BLOCK_N), hi)
        full_lo = tl.minimum(tl.maximum(full_lo, tl.cdiv(r_lo, BLOCK_N) * BLOCK_N), hi)
        full_hi = tl.maximum(full_hi, full_lo)
    blocks_per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits)
    split_lo = lo + split * blocks_per_split * BLOCK_N
    split_hi = tl.minimum(split_lo + blocks_per_split * BLOCK_N, hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if KEYS_M:
        acc = tl.zeros([BLOCK_DV, BLOCK_M], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # This split's share of: the masked left edge, the mask-free interior, the masked right edge. A keys-major tile
    # masks all its blocks in one loop instead: its masks are a few entries a thread, and one pipelined loop of its
    # wide K tiles, not three, keeps its registers (Note [keys-major decode] in ops/decode.py).
    acc, l_i, m_i = _decode_inner(acc, l_i, m_i, q, q2, K, V, BLOCK_TABLE, b, cache_b, hk, i, d,
                                  split_lo, split_hi if KEYS_M else tl.minimum(split_hi, full_lo), r_lo, r_hi,
                                  seqlen_k, diag, wl, wr, chunk, qk_scale, softcap2, slope2,
                                  stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                                  stride_btb, page_size, page_mul, page_shift, num_pages,
                                  BLOCK_N, HEAD_DIM, BLOCK_D, BLOCK_D2, HEAD_DIM_V, BLOCK_DV, V_IS_K, True, PAGED,
                                  PAGE_TILED, MASK_LEFT, MASK_RIGHT, MASK_CHUNK, HAS_SOFTCAP, HAS_ALIBI, KEYS_M,
                                  UPCAST, DOT_PRECISION)
    if not KEYS_M:
        acc, l_i, m_i = _decode_inner(acc, l_i, m_i, q, q2, K, V, BLOCK_TABLE, b, cache_b, hk, i, d,
                                      tl.maximum(split_lo, full_lo), tl.minimum(split_hi, full_hi), r_lo, r_hi,
                                      seqlen_k, diag, wl, wr, chunk, qk_scale, softcap2, slope2,
                                      stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                                      stride_btb, page_size, page_mul, page_shift, num_pages,
                                      BLOCK_N, HEAD_DIM, BLOCK_D, BLOCK_D2, HEAD_DIM_V, BLOCK_DV, V_IS_K, False, PAGED,
                                      PAGE_TILED, MASK_LEFT, MASK_RIGHT, MASK_CHUNK, HAS_SOFTCAP, HAS_ALIBI, KEYS_M,
                                      UPCAST, DOT_PRECISION)
        acc, l_i, m_i = _decode_inner(acc, l_i, m_i, q, q2, K, V, BLOCK_TABLE, b, cache_b, hk, i, d,
                                      tl.maximum(split_lo, full_hi), split_hi, r_lo, r_hi, seqlen_k, diag, wl, wr,
                                      chunk, qk_scale, softcap2, slope2, stride_kb, stride_kn, stride_kh,
                                      stride_vb, stride_vn, stride_vh,
                                      stride_btb, page_size, page_mul, page_shift, num_pages,
                                      BLOCK_N, HEAD_DIM, BLOCK_D, BLOCK_D2, HEAD_DIM_V, BLOCK_DV, V_IS_K, True, PAGED,
                                      PAGE_TILED, MASK_LEFT, MASK_RIGHT, MASK_CHUNK, HAS_SOFTCAP, HAS_ALIBI, KEYS_M,
                                      UPCAST, DOT_PRECISION)
    if KEYS_M:
        acc = tl.trans(acc)
        l_i = tl.sum(l_i, 0)

    if HAS_SINK:
        sink2 = tl.load(SINK + h, mask=row_ok, other=0.0) * LOG2E
        acc, l_i, m_i = fold_sink(acc, l_i, m_i, tl.where(split == 0, sink2, float("-inf")))
    # The (o, lse) state of this split, normalised; a split that saw no key writes the empty state.
    out, lse = finalize(acc, l_i, m_i)
    dv = tl.arange(0, BLOCK_DV)[None, :]
    o_ptrs = O + split * stride_os + b64 * stride_ob + (t * stride_om + h * stride_oh)[:, None] + dv
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (dv < HEAD_DIM_V))
    tl.store(LSE + split * stride_ls + b64 * stride_lb + h * stride_lh + t * stride_lm, lse, mask=row_ok)
