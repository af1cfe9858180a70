"""Per-program sequence information: which sequence and tile a program works on, where the sequence starts and
how long it is.

Dense batches (B, S, H, D) address sequence b through a batch stride and have one length for all; varlen batches
(total, H, D) have stride_b = 0 and find sequence b at row cu_seqlens[b]. `seqused` (FlashAttention-3) shortens a
sequence to its first seqused[b] tokens without moving it.

Note [varlen tile list]: a dense grid is (tiles, heads, B). A varlen grid of that shape would need the longest
sequence's tile count for every sequence, and the programs past a shorter sequence's end would only read
cu_seqlens and exit: on a mix of 256..4096 tokens that is three programs in four, each holding an SM slot. So a
varlen grid is (heads, tile bound): the tiles of all sequences in one list, whose length is bounded from the
packed total alone (sum of cdiv(len_b, BLOCK) <= cdiv(total, BLOCK) + B), with no host synchronisation and
without reading max_seqlen. `_plan_kernel` (kernels/schedule.py) writes the sequences in launch order with their
tiled lengths; program t walks it once (`tile_coords`: a prefix sum of tile counts, up to MAX_STEP sequences per
step) to find its (sequence, tile): one read of the schedule (8 KB from L2 for up to 1024 sequences) and a prefix
sum per program, in place of the idle programs. At most B programs per head are left over past the list, and they
exit at once.

Note [longest sequences first]: the list is in order of decreasing cost per tile (the length of the axis each
tile sweeps: keys for the forward and dQ, queries for dK/dV), and within a sequence the most expensive tile comes
first. That is longest-processing-time-first list scheduling: the tiles that start last are the cheapest, so the
wave ends evenly. In batch order a long sequence that comes last leaves most SMs idle while it finishes; list
scheduling simulated on 132 SMs with 4 heads (tensor parallelism) and the benchmark's 16-sequence mix, longest
sequence last, reaches 66-96% of the ideal in batch order and 95-99% longest first (causal or not, one or two
programs per SM); with 16 heads the gain is ~1%. The tiles of one sequence and head stay neighbours in launch
order, which keeps its K/V shared through L2. `_plan_kernel` orders chunks of up to MAX_SORT sequences
separately: with more sequences than that, each chunk is a full wave of work.

This file only computes indices, offsets and lengths; the plan itself is written by kernels/schedule.py.
"""

import triton
import triton.language as tl

MAX_STEP = 1024  # sequences tile_coords and the tile list read per step: one step up to 1024 sequences


@triton.jit
def row_desc(base, length, stride_m, BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """TMA descriptor over one (sequence, head): rows [0, length) of HEAD_DIM elements from `base`, read and
    written in (BLOCK_ROWS, BLOCK_D) tiles. Reads past either bound are zeros and writes past them are dropped:
    that is how every kernel handles a ragged last tile and a head dim below BLOCK_D, without masks."""
    return tl.make_tensor_descriptor(base, shape=[length, HEAD_DIM], strides=[stride_m, 1],
                                     block_shape=[BLOCK_ROWS, BLOCK_D])


# Where load_rows/store_rows find a tile (the DESC constexpr of the kernels that use them):
DESC_ROW = tl.constexpr(0)  # a row_desc built on the device per (sequence, head); rows relative to its start
DESC_DENSE = tl.constexpr(1)  # a host-built rank-4 descriptor over a dense (B, S, H, D) tensor
DESC_PACKED = tl.constexpr(2)  # a host-built rank-3 descriptor over a packed (total, H, D) tensor


@triton.jit
def load_rows(src, start, row, b, h, DESC: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The (BLOCK_ROWS, BLOCK_D) tile at rows [row, row + BLOCK_ROWS) of sequence b (first row `start` in a packed
    tensor), head h, through a descriptor of kind DESC, read in boxes of BLOCK_ROWS rows of one head. Columns
    past HEAD_DIM read as zeros, and so do rows past the sequence for DESC_ROW and DESC_DENSE; a DESC_PACKED box
    that crosses the sequence's end reads the next sequence's rows (zeros only past the packed total)."""
    if DESC == DESC_DENSE:
        tile = src.load([b, row, h, 0]).reshape(BLOCK_ROWS, BLOCK_D)
    elif DESC == DESC_PACKED:
        tile = src.load([(start + row).to(tl.int32), h, 0]).reshape(BLOCK_ROWS, BLOCK_D)
    else:
        tile = src.load([row, 0])
    return tile


@triton.jit
def store_rows(dst, row, b, h, tile, DESC: tl.constexpr):
    """Write `tile`, in the descriptor's dtype, where `load_rows` reads it (DESC_ROW or DESC_DENSE, whose boxes
    drop the rows past the sequence and the columns past HEAD_DIM)."""
    tl.static_assert(DESC != DESC_PACKED, "a packed box can cross into the next sequence: store through a row_desc")
    tile = tile.to(dst.dtype)
    if DESC == DESC_DENSE:
        dst.store([b, row, h, 0], tile.reshape(1, tile.shape[0], 1, tile.shape[1]))
    else:
        dst.store([row, 0], tile)


@triton.jit
def load_once(base, row, length, stride_m, BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """The (BLOCK_ROWS, BLOCK_D) tile at rows [row, row + BLOCK_ROWS) of one (sequence, head) starting at `base`,
    with pointer loads: rows past `length` and columns past HEAD_DIM read as zeros, as a descriptor gives them.
    For tiles a program reads once and holds in registers (the backward's K/V or Q/dO), where building a
    descriptor on the device would cost more than the load."""
    rows = row + tl.arange(0, BLOCK_ROWS)
    d = tl.arange(0, BLOCK_D)[None, :]
    ptrs = base + rows.to(tl.int64)[:, None] * stride_m + d
    if HEAD_DIM < BLOCK_D:
        return tl.load(ptrs, mask=(rows < length)[:, None] & (d < HEAD_DIM), other=0.0)
    return tl.load(ptrs, mask=(rows < length)[:, None], other=0.0)


@triton.jit
def store_once(base, row, length, stride_m, tile, HEAD_DIM: tl.constexpr):
    """Write `tile` where `load_once` reads it, dropping rows past `length` and columns past HEAD_DIM."""
    rows = row + tl.arange(0, tile.shape[0])
    d = tl.arange(0, tile.shape[1])[None, :]
    ptrs = base + rows.to(tl.int64)[:, None] * stride_m + d
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=(rows < length)[:, None] & (d < HEAD_DIM))


@triton.jit
def seq_info(b, bound, cu_seqlens, seqused, IS_VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr,
             PACKED: tl.constexpr = True):
    """Returns (first row of sequence b in the packed tensor, its length): (0, bound) for a dense batch, where
    bound is the sequence length; `seq_lengths` for a varlen one."""
    if IS_VARLEN:
        start, length = seq_lengths(b, b >= 0, cu_seqlens, seqused, bound, HAS_SEQUSED, PACKED)
        return start.to(tl.int64), length
    return tl.zeros((), dtype=tl.int64), bound


@triton.jit
def seq_lengths(b, ok, cu_seqlens, seqused, bound, HAS_SEQUSED: tl.constexpr, PACKED: tl.constexpr = True):
    """(start, length) of varlen sequences b (scalar or vector; entries with ok false read nothing, give (0, 0)).

    Sequence b is rows cu_seqlens[b] : cu_seqlens[b + 1], shortened to seqused[b] if given. `bound` is the packed
    total (PACKED) or, for keys in a paged cache (not PACKED: rows are found through the block table and the start
    is unused), a sequence's capacity. These values come from device memory and are validated only under
    FLASHTILE_CHECK=1 (a host sync), so they are clamped into [0, bound] here: a bad cu_seqlens or seqused can
    give a wrong answer for its own sequence, never an access outside the tensors. The tile list and the kernels
    both read lengths through this function, so they always agree.
    """
    lo = tl.load(cu_seqlens + b, mask=ok, other=0)
    hi = tl.load(cu_seqlens + b + 1, mask=ok, other=0)
    if PACKED:
        lo = tl.minimum(tl.maximum(lo, 0), bound)
        length = tl.minimum(tl.maximum(hi, lo), bound) - lo
    else:
        length = tl.minimum(tl.maximum(hi - lo, 0), bound)
    if HAS_SEQUSED:
        length = tl.minimum(tl.maximum(tl.load(seqused + b, mask=ok, other=0), 0), length)
    return lo, length


@triton.jit
def tile_coords(SCHEDULE, batch, BLOCK: tl.constexpr, LAST_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr,
                STEP: tl.constexpr, LISTED: tl.constexpr = False):
    """(sequence b, tile index, head h, heads in the grid) of this program; tiles are BLOCK rows of the axis the
    grid tiles.

    Dense grid (tiles, heads, B): (program_id(2), program_id(0), program_id(1)), the tile counted from the last if
    LAST_FIRST. Varlen grid (heads, tile list) with the heads fastest (Note [varlen grid order] in hopper_fwd.py),
    the list folded into z past y's limit (ops/schedule.tile_grid): program (h, y, z) is position z * Y + y in the
    tile list (Note [varlen tile list]), found by walking SCHEDULE, (2, batch) int32, the sequences in launch order
    and their tiled lengths, STEP sequences at a time (ops/schedule.schedule_step sizes it by the batch: a prefix sum
    1024 wide for 16 sequences made the causal dQ kernel 2-4% slower). Within a sequence the tiles
    come last first if LAST_FIRST. A program past the list gets sequence 0 and a tile index past any sequence's
    end, so its end-of-sequence check exits it.

    LISTED: SCHEDULE is instead that list written out for this BLOCK and LAST_FIRST (ops/schedule.varlen_plan), and
    the program reads its entry: one load in place of the walk's prefix sums, which cost the varlen dQ kernel
    registers (ptxas: 213 against 197 listed, dense 176) and 4-6% of its time.
    """
    if IS_VARLEN:
        h = tl.program_id(0)
        heads = tl.num_programs(0)
        t = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)
    if IS_VARLEN and LISTED:
        seq = tl.load(SCHEDULE + 2 * t)
        b = tl.maximum(seq, 0)
        tile = tl.where(seq >= 0, tl.load(SCHEDULE + 2 * t + 1), (2**31 - 1) // BLOCK)
    elif IS_VARLEN:
        b = 0
        tile = (2**31 - 1) // BLOCK
        before = 0  # tiles of the sequences in earlier steps
        for first in range(0, batch, STEP):
            z = first + tl.arange(0, STEP)
            ok = z < batch
            seq = tl.load(SCHEDULE + z, mask=ok, other=0)
            tiles = tl.cdiv(tl.load(SCHEDULE + batch + z, mask=ok, other=0), BLOCK)
            end = before + tl.cumsum(tiles, 0)
            mine = (end - tiles <= t) & (t < end)  # true for at most one sequence (never for an empty one)
            if LAST_FIRST:
                index = end - 1 - t
            else:
                index = t - (end - tiles)
            b = tl.maximum(b, tl.max(tl.where(mine, seq, -1), 0))
            tile = tl.minimum(tile, tl.min(tl.where(mine, index, 2**31 - 1), 0))
            before += tl.sum(tiles, 0)
    else:
        b = tl.program_id(2)
        h = tl.program_id(1)
        heads = tl.num_programs(1)
        if LAST_FIRST:
            tile = tl.num_programs(0) - 1 - tl.program_id(0)
        else:
            tile = tl.program_id(0)
    return b, tile, h, heads
