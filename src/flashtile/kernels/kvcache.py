"""The KV cache as the decode kernels see it: where a cache row lives, rotary embedding, appending new tokens.

Notation:
  r          a physical cache row of one sequence: 0 <= r < capacity. A sequence's keys are rows
             [leftpad, cache_seqlens + S_new); new tokens land at rows [cache_seqlens, cache_seqlens + S_new).
  capacity   rows a sequence can hold: S_cache for a contiguous cache (B_cache, S_cache, Hk, D), or
             max_blocks * page_size for a paged one (num_blocks, page_size, Hk, D) with block_table (B, max_blocks).
  (page, off) where row r lives: the cache is addressed as page * stride_kb + off * stride_kn + hk * stride_kh.
             Contiguous: page = the sequence's cache batch index (cache_batch_idx[b] or b), off = r. Paged:
             page = block_table[b, r // page_size], off = r % page_size. Translating every row separately is what
             lets any page size work (1, 16, 64, 256, ...): a K/V tile of BLOCK_N rows may span several pages, and
             with pages >= BLOCK_N all rows of a tile read the same block-table entry (one cached load).
  rotary     x (rows, D) rotated by the angles of position pos: pairs (x[2c], x[2c+1]) when INTERLEAVED (GPT-J),
             (x[c], x[c + rotary_dim/2]) otherwise (GPT-NeoX), for c < rotary_dim/2; columns past rotary_dim pass
             through. cos/sin are (seqlen_ro, rotary_dim/2) tables. Computed in fp32 from the stored values, then
             rounded once to the storage dtype, as flash-attn does.

`_append_kv_kernel` writes k (rotated if asked) and v into the cache in place; it is separate from the decode
kernel so that the decode kernel finds the new rows in the cache like any other (stream order makes them
visible) and split-KV needs no special case for them. It costs one small launch that reads and writes only the
new rows. The query is rotated by the decode kernel as it loads its tile (decode.py). Nothing here attends.
"""

import triton
import triton.language as tl


@triton.jit
def cache_coords(r, b, cache_b, BLOCK_TABLE, stride_btb, page_size, page_mul, page_shift, num_pages, row_ok,
                 PAGED: tl.constexpr):
    """(page, off) of physical rows r of sequence b, both int64; see the notation block. row_ok masks rows that
    are not the sequence's own (their block-table entry is never read, and their r may be anything, negative
    included); pass None when every row is. The rows it keeps must lie in [0, 2^31).

    r // page_size is (r * page_mul) >> page_shift, the host's magic numbers for dividing by page_size
    (ops/common.py: fast_divisor): a multiply and a shift per row where an integer division by a runtime value is
    a ~25-instruction sequence, twice (quotient and remainder). With pages smaller than a K/V tile every row is
    translated, and the division was about a quarter of the decode loop's instructions (SASS, sm_90a).

    Block-table entries and cache_batch_idx come from device memory and are checked only under FLASHTILE_CHECK=1
    (a host sync); the page is clamped into the cache's num_pages (num_blocks, or B_cache for a contiguous cache),
    so a bad entry reads or writes a wrong page of this cache, never memory outside it."""
    if PAGED:
        index = ((r * page_mul) >> page_shift).to(tl.int32)  # page_mul is int64, so is the product
        if row_ok is None:
            page = tl.load(BLOCK_TABLE + b * stride_btb + index)
        else:
            page = tl.load(BLOCK_TABLE + b * stride_btb + index, mask=row_ok, other=0)
        off = r - index * page_size
    else:
        page = cache_b
        off = r
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
    return page.to(tl.int64), off.to(tl.int64)


@triton.jit
def rotary_load(ptrs, d, mask, pos, COS, SIN, stride_cos, rotary_dim, seqlen_ro, INTERLEAVED: tl.constexpr):
    """Load a (rows, D) tile at ptrs + d rotated to positions pos (rows, 1); returns fp32. mask: (rows, D).

    A position outside the tables' seqlen_ro rows is not rotated (cos 1, sin 0) and its table row is never read,
    as in flash-attn's rotary kernel: a query of a causal decode step can sit past the cache's last row, and the
    tables need only cover the cache (kvcache.py)."""
    half = rotary_dim // 2
    if INTERLEAVED:
        partner = d ^ 1
        c = d // 2
        first = d % 2 == 0
    else:
        first = d < half
        partner = tl.where(first, d + half, d - half)
        c = tl.where(first, d, d - half)
    rot = mask & (d < rotary_dim) & (pos >= 0) & (pos < seqlen_ro)
    x = tl.load(ptrs + d, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(ptrs + partner, mask=rot, other=0.0).to(tl.float32)
    cos = tl.load(COS + pos * stride_cos + c, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(SIN + pos * stride_cos + c, mask=rot, other=0.0).to(tl.float32)
    # (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin): the first of a pair subtracts its partner.
    return x * cos + tl.where(first, -x_partner, x_partner) * sin


@triton.jit
def _append_kv_kernel(
    K_NEW, V_NEW, K_CACHE, V_CACHE, CACHE_SEQLENS, CACHE_BATCH_IDX, BLOCK_TABLE, COS, SIN,
    stride_knb, stride_knm, stride_knh,
    stride_vnb, stride_vnm, stride_vnh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_btb, stride_cos,
    seqlen_new, page_size, page_mul, page_shift, num_pages, capacity, rotary_dim, seqlen_ro,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_T: tl.constexpr, PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_ROTARY: tl.constexpr,
    ROTARY_INTERLEAVED: tl.constexpr, V_IN_K: tl.constexpr,
):
    """One program per (BLOCK_T new tokens, KV head, sequence): k[b, t] -> cache row cache_seqlens[b] + t. v's
    rows are HEAD_DIM_V wide (MLA). V_IN_K: v_cache is a view of k_cache's first channels (an absorbed MLA cache),
    which hold v; k writes only the channels past them. Two stores to one address from different threads of a
    program land in no set order (k's and v's tiles differ in width, so in layout), and storing k whole then v
    would leave each such channel k's or v's."""
    hk = tl.program_id(1)
    b = tl.program_id(2)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)[None, :]
    r = tl.load(CACHE_SEQLENS + b) + t
    # cache_seqlens is checked against the capacity only under FLASHTILE_CHECK=1 (a host sync); rows it would put
    # outside the sequence's cache are dropped here, so a bad value never writes memory the sequence does not own.
    t_ok = (t < seqlen_new) & (r >= 0) & (r < capacity)
    mask = t_ok[:, None] & (d < HEAD_DIM)
    if V_IN_K:
        store_k = mask & (d >= HEAD_DIM_V)
    else:
        store_k = mask
    cache_b = b
    if HAS_BATCH_IDX:
        cache_b = tl.load(CACHE_BATCH_IDX + b)
    page, off = cache_coords(r, b, cache_b, BLOCK_TABLE, stride_btb, page_size, page_mul, page_shift, num_pages,
                             t_ok, PAGED)
    b64 = b.to(tl.int64)

    k_ptrs = K_NEW + b64 * stride_knb + t[:, None].to(tl.int64) * stride_knm + hk * stride_knh
    if HAS_ROTARY:
        k = rotary_load(k_ptrs, d, mask, r[:, None], COS, SIN, stride_cos, rotary_dim, seqlen_ro,
                        ROTARY_INTERLEAVED)
    else:
        k = tl.load(k_ptrs + d, mask=mask)
    k_dst = K_CACHE + (page * stride_kb + off * stride_kn)[:, None] + hk * stride_kh + d
    tl.store(k_dst, k.to(K_CACHE.dtype.element_ty), mask=store_k)

    dv = tl.arange(0, BLOCK_DV)[None, :]
    mask_v = t_ok[:, None] & (dv < HEAD_DIM_V)
    v = tl.load(V_NEW + b64 * stride_vnb + t[:, None].to(tl.int64) * stride_vnm + hk * stride_vnh + dv, mask=mask_v)
    v_dst = V_CACHE + (page * stride_vb + off * stride_vn)[:, None] + hk * stride_vh + dv
    tl.store(v_dst, v.to(V_CACHE.dtype.element_ty), mask=mask_v)
