"""Prefill forward: one program per (query tile, query head, sequence); K/V tiles stream through on-chip memory.

Notation (see masking.py for i, j, diag, wl, wr and log2-unit logits):
  BLOCK_M    query rows per program; the Q tile is loaded once and stays on chip.
  BLOCK_N    key rows per inner-loop step.
  BLOCK_D    head dim rounded up to a power of two (>= 16); tensor descriptors zero-fill columns past HEAD_DIM,
             so padded columns add nothing to either product.
  HEAD_DIM_V, BLOCK_DV   the same for V and O, whose head dim may differ from Q's and K's (MLA prefill: q/k 192,
             v 128); HEAD_DIM_V = HEAD_DIM otherwise.
  acc, m_i, l_i   un-normalised output, running row max (log2 units), running row sum: the online softmax state.
  GROUP      query heads per KV head (GQA/MQA); query head h reads KV head h // GROUP.
  UPCAST     cast loaded tiles to fp32: only for bf16 under the CPU interpreter, which cannot compute on bf16.
  PAGED      K/V live in a paged cache (num_blocks, page_size, Hk, D): key row r of sequence b is row
             r % page_size of page block_table[b, r // page_size] (kvcache.cache_coords). Any page size works
             because every row is translated on its own; such tiles are gathered with pointer loads, since a tile
             may span pages (a TMA descriptor needs one strided box). Otherwise K/V are read through descriptors.
  DESC       where Q, K, V (and O) come from (seqlen.load_rows; ops/fwd.py, Note [host descriptors]):
             DESC_DENSE, host-built rank-4 descriptors over the whole (B, S, H, D) tensors, passed as kernel
             parameters; DESC_PACKED, host-built rank-3 ones over varlen (total, H, D) tensors, whose boxes can
             cross into the next sequence: that is harmless for Q (those rows are never stored) and for K (their
             scores are masked), V's rows past seqlen_k are zeroed in the masked blocks, and O is stored through a
             per-sequence row_desc; DESC_ROW, descriptors built on the device per (sequence, head), for what
             the host paths do not cover.

Writes O once and the log-sum-exp in natural-log units (B, H, Sq) or (H, total_q); never materialises the
Sq x Sk score matrix. Sequence-length boundaries are handled by descriptor shapes (reads past them are zeros and
writes are dropped) plus a key mask on the last key block; paged loads mask rows past seqlen_k instead, and never
read a block-table entry for them. HAS_DROPOUT drops probabilities after the softmax state has counted them (the
LSE is the undropped softmax's) and scales O by 1 / (1 - p): Note [dropout mask] in dropout.py. HAS_SINK folds
the head's learnable sink logit (SINK, fp32 (H,)) into the softmax's denominator before normalising
(softmax.fold_sink); the backward needs no change for it, as its P is recomputed from this LSE.

Grid: dense (query tiles, query heads, B); varlen (query heads, query-tile list), the tiles of every sequence in one
list ordered longest first (Notes [varlen tile list] and [longest sequences first] in seqlen.py; heads fastest as in
Note [varlen grid order] in hopper_fwd.py). Either way a program computes exactly one tile: a loop over tiles
around the body would make Triton hoist the O staging buffer out of it, 16 KB more shared memory per program (d256
would no longer fit on sm_90).

Note [V parts]: at V_PARTS > 1 (ops/call.OpProblem.v_parts: a V 512 wide, 16-bit inputs) the grid's heads are
(head, part) pairs, and the V_PARTS programs of a query tile each compute the whole Q Kᵀ and softmax but only their
HEAD_DIM_V columns of V and O, from part * HEAD_DIM_V on; the first stores the LSE, which every part computes
alike. That is 1.5x the FLOPs of one 512-wide program at two parts, for an accumulator of d256's size: a 64 x 512
fp32 accumulator takes 128 registers a thread even over 8 warps, and config.TABLE's d512 tile, one stage of K/V,
builds at 255 registers with 700-2400 bytes of spill stores (tests/sm90_compile.py); a part's tile (config.NARROW_V's
(512, 256): 4 warps, 3 stages) builds at 239-241 registers without a spill in the dense builds. On the H200 the
parts ran the d512 forward 7-18% faster than one 512-wide program (docs/perf.md, "Model shapes"). On sm_90, q, k
and v 512 in 16-bit inputs run the Gluon forward instead, which computes Q Kᵀ once (Note [split columns] in
hopper_fwd_wide.py: 1.35-1.40x the parts); the parts serve the other GPUs and a V 512 wide beside another q/k.
"""

import triton
import triton.language as tl

from .dropout import drop, dropout_state
from .kvcache import cache_coords
from .masking import LOG2E, apply_mask, kv_block_range, logits
from .seqlen import DESC_DENSE, DESC_PACKED, DESC_ROW, load_rows, row_desc, seq_info, store_rows, tile_coords
from .softmax import finalize, fold_sink, online_softmax_step


@triton.jit
def _load_kv(src, start, start_n, b, hk, page, off, stride_page, stride_row, row_ok, d,
             PAGED: tl.constexpr, DESC: tl.constexpr, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The (BLOCK_N, BLOCK_D) tile of K or V at key rows start_n + [0, BLOCK_N) of sequence b, KV head hk.

    Contiguous: `src` is a tensor descriptor (seqlen.load_rows). PAGED: `src` points at the KV head in the paged
    cache and row n sits at page[n] * stride_page + off[n] * stride_row. Rows past seqlen_k (row_ok false, only
    in MASKED blocks) and columns past HEAD_DIM are not read and load as 0, as the descriptors give them: a 0 in V
    times a probability of 0 stays 0, where a stray NaN would not.
    """
    if PAGED:
        ptrs = src + (page * stride_page + off * stride_row)[:, None] + d
        if MASKED or HEAD_DIM < BLOCK_D:
            tile = tl.load(ptrs, mask=row_ok[:, None] & (d < HEAD_DIM), other=0.0)
        else:
            tile = tl.load(ptrs)
    else:
        tile = load_rows(src, start, start_n, b, hk, DESC, BLOCK_N, BLOCK_D)
    return tile


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_src, v_src, i, lo, hi,
               seqlen_k, diag, wl, wr, chunk, qk_scale, softcap2, slope2,
               k_start, b, hk, BLOCK_TABLE, stride_btb, page_size, page_mul, page_shift, num_pages,
               stride_kb, stride_kn, stride_vb, stride_vn, seed, stream, bh, threshold,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, PAGED: tl.constexpr, DESC: tl.constexpr,
               MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, MASK_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)[None, :]
    dv = tl.arange(0, BLOCK_DV)[None, :]
    for start_n in range(lo, hi, BLOCK_N):
        r = start_n + offs_n
        row_ok = r < seqlen_k
        # Where the rows live in a paged cache (dead code for descriptors). Mask-free blocks lie inside seqlen_k.
        if MASKED:
            page, off = cache_coords(r, b, b, BLOCK_TABLE, stride_btb, page_size, page_mul, page_shift,
                                     num_pages, row_ok, PAGED)
        else:
            page, off = cache_coords(r, b, b, BLOCK_TABLE, stride_btb, page_size, page_mul, page_shift,
                                     num_pages, None, PAGED)
        k = _load_kv(k_src, k_start, start_n, b, hk, page, off, stride_kb, stride_kn, row_ok, d,
                     PAGED, DESC, MASKED, HEAD_DIM, BLOCK_N, BLOCK_D)
        if UPCAST:
            k = k.to(tl.float32)
        j = r[None, :]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if HAS_SOFTCAP or HAS_ALIBI:
            s, _ = logits(qk, i, j, diag, qk_scale, softcap2, slope2, HAS_SOFTCAP, HAS_ALIBI)
            scale = 1.0
        else:
            # Plain scores: keep them unscaled and fold qk_scale into the row max and into one FMA in the
            # exponent below, saving a multiply per score (softmax_scale > 0 is checked at the API).
            s = qk
            scale = qk_scale
        if MASKED:
            s = apply_mask(s, i, j, seqlen_k, diag, wl, wr, MASK_LEFT, MASK_RIGHT, True, chunk, MASK_CHUNK)
        p, alpha, l_i, m_i = online_softmax_step(s, scale, m_i, l_i, MASKED)
        v = _load_kv(v_src, k_start, start_n, b, hk, page, off, stride_vb, stride_vn, row_ok, dv,
                     PAGED, DESC, MASKED, HEAD_DIM_V, BLOCK_N, BLOCK_DV)
        if MASKED and DESC == DESC_PACKED:
            v = tl.where(row_ok[:, None], v, 0.0)  # the next sequence's rows: p is 0 there, but 0 * inf is not
        if UPCAST:
            v = v.to(tl.float32)
        p = p.to(v.dtype)
        if HAS_DROPOUT:  # after the row sum, on P's packed pairs; 1 / (1 - p) scales the output (Note [dropout mask])
            p = drop(p, seed, stream, bh, i, start_n, offs_n[None, :], threshold, BLOCK_N)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_i


# Parameters: the per-call ones (pointers, float scalars) first, then those a launch key fixes (Note [launch
# cache] in ops/launch.py), then constexprs.
@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, ALIBI, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_Q, SEQUSED_K, SCHEDULE, BLOCK_TABLE, RNG, SINK,
    qk_scale, softcap2, dropout_p,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb: tl.int32, stride_lh: tl.int32, stride_ab: tl.int32, stride_btb: tl.int32,
    seqlen_q: tl.int32, seqlen_k: tl.int32, batch: tl.int32, page_size: tl.int32, page_mul: tl.int64,
    page_shift: tl.int32, num_pages: tl.int32, wl: tl.int32, wr: tl.int32, chunk: tl.int32,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_SEQUSED_Q: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    PAGED: tl.constexpr, DESC: tl.constexpr, STEP: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, MASK_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SINK: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, V_PARTS: tl.constexpr,
):
    # Longest tiles first: under a causal mask the last query tiles do the most work, so launch them first and
    # let the short ones fill the tail of the wave (across sequences: Note [longest sequences first]).
    b, pid_m, h, heads = tile_coords(SCHEDULE, batch, BLOCK_M, True, IS_VARLEN, STEP)
    part = 0
    if V_PARTS > 1:  # Note [V parts]: the grid's heads are (head, part) pairs, the parts fastest
        tl.static_assert(DESC == DESC_ROW, "V parts offset the device-built descriptors of V and O")
        part = h % V_PARTS
        h = h // V_PARTS
        heads = heads // V_PARTS
    hk = h // GROUP
    q_start, seqlen_q = seq_info(b, seqlen_q, CU_SEQLENS_Q, SEQUSED_Q, IS_VARLEN, HAS_SEQUSED_Q)
    k_start, seqlen_k = seq_info(b, seqlen_k, CU_SEQLENS_K, SEQUSED_K, IS_VARLEN, HAS_SEQUSED_K, not PAGED)
    m_start = pid_m * BLOCK_M
    if m_start >= seqlen_q:
        return
    # Every offset that can pass 2^31 elements is int64: b64 and q_start/k_start (int64) times a row stride, and
    # h64 times a head stride (heads can be the outer dimension of a strided view, and LSE is (H, total_q)).
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = hk.to(tl.int64)
    if DESC == DESC_ROW:
        q_src = row_desc(Q + b64 * stride_qb + q_start * stride_qm + h64 * stride_qh,
                         seqlen_q, stride_qm, BLOCK_M, HEAD_DIM, BLOCK_D)
        o_src = row_desc(O + b64 * stride_ob + q_start * stride_om + h64 * stride_oh + part * HEAD_DIM_V,
                         seqlen_q, stride_om, BLOCK_M, HEAD_DIM_V, BLOCK_DV)
        if PAGED:
            k_src = K + hk64 * stride_kh
            v_src = V + hk64 * stride_vh + part * HEAD_DIM_V
        else:
            k_src = row_desc(K + b64 * stride_kb + k_start * stride_kn + hk64 * stride_kh,
                             seqlen_k, stride_kn, BLOCK_N, HEAD_DIM, BLOCK_D)
            v_src = row_desc(V + b64 * stride_vb + k_start * stride_vn + hk64 * stride_vh + part * HEAD_DIM_V,
                             seqlen_k, stride_vn, BLOCK_N, HEAD_DIM_V, BLOCK_DV)
    else:
        q_src, k_src, v_src = Q, K, V
        if DESC == DESC_DENSE:
            o_src = O
        else:
            o_src = row_desc(O + q_start * stride_om + h64 * stride_oh, seqlen_q, stride_om, BLOCK_M, HEAD_DIM_V,
                             BLOCK_DV)
    diag = seqlen_k - seqlen_q
    offs_m = m_start + tl.arange(0, BLOCK_M)
    i = offs_m[:, None]
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + b * stride_ab + h) * LOG2E
    seed, stream, threshold, drop_scale = 0, 0, 0, 1.0
    if HAS_DROPOUT:
        seed, stream, threshold, drop_scale = dropout_state(RNG, dropout_p)

    q = load_rows(q_src, q_start, m_start, b, h, DESC, BLOCK_M, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    lo, full_lo, full_hi, hi = kv_block_range(m_start, seqlen_q, seqlen_k, wl, wr,
                                              BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, chunk, MASK_CHUNK)
    # Left edge of a sliding window, mask-free interior, then the diagonal / right edge / ragged last block.
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, i, lo, full_lo,
                               seqlen_k, diag, wl, wr, chunk, qk_scale, softcap2, slope2,
                               k_start, b, hk, BLOCK_TABLE, stride_btb,
                               page_size, page_mul, page_shift, num_pages,
                               stride_kb, stride_kn, stride_vb, stride_vn, seed, stream, b * heads + h, threshold,
                               BLOCK_N, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, True, PAGED, DESC,
                               MASK_LEFT, MASK_RIGHT, MASK_CHUNK,
                               HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, UPCAST, DOT_PRECISION)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, i, full_lo, full_hi,
                               seqlen_k, diag, wl, wr, chunk, qk_scale, softcap2, slope2,
                               k_start, b, hk, BLOCK_TABLE, stride_btb,
                               page_size, page_mul, page_shift, num_pages,
                               stride_kb, stride_kn, stride_vb, stride_vn, seed, stream, b * heads + h, threshold,
                               BLOCK_N, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, False, PAGED, DESC,
                               MASK_LEFT, MASK_RIGHT, MASK_CHUNK,
                               HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, UPCAST, DOT_PRECISION)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, i, full_hi, hi,
                               seqlen_k, diag, wl, wr, chunk, qk_scale, softcap2, slope2,
                               k_start, b, hk, BLOCK_TABLE, stride_btb,
                               page_size, page_mul, page_shift, num_pages,
                               stride_kb, stride_kn, stride_vb, stride_vn, seed, stream, b * heads + h, threshold,
                               BLOCK_N, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, True, PAGED, DESC,
                               MASK_LEFT, MASK_RIGHT, MASK_CHUNK,
                               HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, UPCAST, DOT_PRECISION)

    if HAS_SINK:
        acc, l_i, m_i = fold_sink(acc, l_i, m_i, tl.load(SINK + h) * LOG2E)
    out, lse = finalize(acc, l_i, m_i)
    if HAS_DROPOUT:
        out = out * drop_scale
    store_rows(o_src, m_start, b, h, out, DESC_ROW if DESC == DESC_PACKED else DESC)
    # Every part computes the same LSE; the first stores it.
    tl.store(LSE + b64 * stride_lb + h64 * stride_lh + q_start + offs_m, lse, mask=(offs_m < seqlen_q) & (part == 0))
