"""The plan of a varlen call, in one launch (ops/schedule.varlen_plan launches it): the sequences in launch order,
longest first, with their tiled lengths; the tile lists that the listed and persistent kernels read; their work
counters, zeroed. Notes [varlen tile list] and [longest sequences first] in kernels/seqlen.py say why, and
docs/design/scheduling.md has the long form.

This file only orders sequences and writes lists; reading them is seqlen.tile_coords's and
hopper_common.work_item's.
"""

import triton
import triton.language as tl

from .seqlen import seq_lengths

MAX_SORT = 1024  # sequences ordered together by _plan_kernel (each ranked within its chunk of this many)


@triton.jit
def _plan_kernel(CU_TILED, SEQUSED_TILED, CU_COST, SEQUSED_COST, SCHEDULE, LAST_FIRST_LIST, FIRST_FIRST_LIST,
                 COUNTERS, batch: tl.int32, bound_tiled: tl.int32, bound_cost: tl.int32, entries: tl.int32,
                 BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
                 HAS_SEQUSED_TILED: tl.constexpr, HAS_SEQUSED_COST: tl.constexpr, COST_PACKED: tl.constexpr):
    """A varlen call's plan (ops/schedule.varlen_plan), in one launch: SCHEDULE, (2, batch), the sequences in launch
    order and their tiled lengths (Notes [varlen tile list] and [longest sequences first]); with BLOCK > 0 the
    tile list of BLOCK-row tiles in that order, written out, each sequence's last tile first (LAST_FIRST_LIST) or
    first tile first (FIRST_FIRST_LIST), whichever are not None, then (-1, -1) up to `entries`; and COUNTERS, four
    slots of persistent kernels' work counters (4 int32 each, 16 bytes apart; three used), zeroed.

    Program b < batch places sequence b: its rank among the sequences of its chunk of BLOCK_B (cost descending,
    ties in batch order) is how many of them sort before it, so no program sorts and none waits for another; its
    tiles start after those of the earlier chunks and of the sequences ranked before it. Program `batch` (with
    lists) finds the total that way, pads the lists and zeroes the counters."""
    b = tl.program_id(0)
    first = b - b % BLOCK_B  # b's chunk
    i = tl.arange(0, BLOCK_B)
    z = first + i
    ok = z < batch
    _, cost = seq_lengths(z, ok, CU_COST, SEQUSED_COST, bound_cost, HAS_SEQUSED_COST, COST_PACKED)
    # One key per sequence, unique: the cost, then the reversed position so that equal costs keep batch order;
    # past the batch -1, below every key (so program `batch` ranks after its whole chunk).
    key = tl.where(ok, cost.to(tl.int64) * BLOCK_B + (BLOCK_B - 1 - i), -1)
    ahead = ok & (key > tl.sum(tl.where(i == b - first, key, 0), 0))
    _, length = seq_lengths(b, b < batch, CU_TILED, SEQUSED_TILED, bound_tiled, HAS_SEQUSED_TILED)
    if b < batch:
        rank = tl.sum(ahead.to(tl.int32), 0)
        tl.store(SCHEDULE + first + rank, b)
        tl.store(SCHEDULE + batch + first + rank, length)
    if BLOCK > 0:
        _, tiled = seq_lengths(z, ok, CU_TILED, SEQUSED_TILED, bound_tiled, HAS_SEQUSED_TILED)
        before = tl.sum(tl.where(ahead, tl.cdiv(tiled, BLOCK), 0), 0)
        for start in range(0, first, BLOCK_B):  # the earlier chunks, all of whose tiles come first
            _, n = seq_lengths(start + i, True, CU_TILED, SEQUSED_TILED, bound_tiled, HAS_SEQUSED_TILED)
            before += tl.sum(tl.cdiv(n, BLOCK), 0)
        if b < batch:
            n = tl.cdiv(length, BLOCK)
            if LAST_FIRST_LIST is not None:
                _write_entries(LAST_FIRST_LIST, before, n, b, True)
            if FIRST_FIRST_LIST is not None:
                _write_entries(FIRST_FIRST_LIST, before, n, b, False)
        else:
            if LAST_FIRST_LIST is not None:
                _write_entries(LAST_FIRST_LIST, before, entries - before, -1, True)
            if FIRST_FIRST_LIST is not None:
                _write_entries(FIRST_FIRST_LIST, before, entries - before, -1, False)
            tl.store(COUNTERS + tl.arange(0, 16), tl.zeros([16], tl.int32))


@triton.jit
def _write_entries(LIST, first, n, seq, LAST_FIRST: tl.constexpr):
    """Entries [first, first + n) of a tile list: (seq, tile) for the n tiles of sequence seq, the last first if
    LAST_FIRST; (-1, -1), past the list, for seq -1."""
    WIDTH: tl.constexpr = 256
    lane = tl.arange(0, 2 * WIDTH)  # each entry's two int32s, side by side
    for t0 in range(0, n, WIDTH):
        t = t0 + lane // 2
        tile = n - 1 - t if LAST_FIRST else t
        value = tl.where(lane % 2 == 0, seq, tl.where(seq < 0, -1, tile))
        tl.store(LIST + 2 * (first + t0) + lane, value, mask=t < n)
