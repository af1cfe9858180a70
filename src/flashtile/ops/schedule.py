"""The schedule of a varlen call: grid shapes, the sequences' launch order (longest first), the tile lists the
persistent and listed kernels read and their work counters, all written by one small kernel (kernels/schedule.py:
_plan_kernel) with no host synchronisation; and which lists each kernel of a call wants. docs/design/scheduling.md
is the long form.

What this module does not do: launch the attention kernels (ops/fwd.py, ops/bwd.py, ops/hopper.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .. import env
from ..config import HOPPER, tile_config
from ..kernels.schedule import MAX_SORT, _plan_kernel
from ..kernels.seqlen import MAX_STEP
from .common import cdiv, next_power_of_2
from .device import graph_capturing, stream_handle
from .launch import StaticByName, launch_named


def schedule_step(batch: int, varlen: bool) -> int:
    """How many sequences tile_coords and the tile list read per step of their prefix sum (kernels/seqlen.py): a
    few sizes, so that the kernels that take it compile a few times, not once per batch size. A dense grid walks
    no schedule: one value for every batch."""
    if not varlen:
        return MAX_STEP
    return 16 if batch <= 16 else 128 if batch <= 128 else MAX_STEP


MAX_GRID_Y = 65535  # CUDA's limit on a grid's y (and z) dimension


def tile_grid(block: int, seqlen: int, total: int, batch: int, heads: int, varlen: bool,
              limit: int = MAX_GRID_Y) -> tuple[int, int, int]:
    """(tiles, heads, sequences) for a dense batch. For a varlen one (heads, tile list) with the heads fastest (Note
    [varlen grid order] in kernels/hopper_fwd.py), the list of sum_b cdiv(len_b, block) <= cdiv(total, block) + B
    tiles bounded whatever the lengths are; one longer than y's limit (more than 8M tokens of 128-row tiles) folds
    into z, and a program reads position z * Y + y (seqlen.tile_coords). The persistent Gluon kernels take only
    the list's bound from it (their items: hopper_common.work_item)."""
    if varlen:
        n = cdiv(total, block) + batch
        return heads, min(n, limit), cdiv(n, limit)
    return cdiv(seqlen, block), heads, batch


class Plan(NamedTuple):
    """What varlen_plan wrote for a varlen call's kernels, views of one int32 buffer on the device."""
    schedule: torch.Tensor  # (2, B): the sequences in launch order, and their tiled lengths (seqlen.tile_coords)
    block: int  # rows per tile of the lists (0: no list written)
    last_first: Optional[torch.Tensor]  # (entries, 2): the tile list, each sequence's last tile first
    first_first: Optional[torch.Tensor]  # (entries, 2): the same tiles, each sequence's first tile first
    # (4, 4): zeroed work counters, [0] for the forward's persistent kernel (it reads last_first), [1] dK/dV's
    # (first_first), [2] dQ's (last_first); [3] unused (the plan kernel zeroes a power of two of them)
    counters: Optional[torch.Tensor]

    def has(self, last_first: int, first_first: int) -> bool:
        """Whether this plan holds the lists of these blocks (0: that list is not needed)."""
        return all(not want or (self.block == want and lst is not None)
                   for want, lst in ((last_first, self.last_first), (first_first, self.first_first)))


def varlen_plan(cu_tiled: torch.Tensor, seqused_tiled, bound_tiled: int, cu_cost: torch.Tensor, seqused_cost,
                bound_cost: int, block: int = 0, last_first: bool = False, first_first: bool = False,
                cost_packed: bool = True, limit: int = MAX_GRID_Y) -> Plan:
    """The schedule of a varlen call: its sequences in launch order, longest `cost` side first, with the lengths of
    their `tiled` side (the axis the grid tiles), both clamped to their bounds as the kernels clamp them
    (seqlen.py: seq_lengths); with `block`, that order written out as a tile list of `block`-row tiles, one
    (sequence, tile) entry per tile in tile_coords' order (each sequence's last tile first, `last_first`, or first
    tile first, `first_first`, or both), then (-1, -1) up to the entries of tile_grid's grid, and zeroed work
    counters for the persistent Gluon kernels (Notes [persistent forward], [persistent dQ] and
    [persistent dK/dV]).
    Kernels that walk the schedule take `schedule`, kernels that read their tile take a list (the Gluon kernels and
    the varlen dQ kernel). One launch (kernels/schedule.py: _plan_kernel), through the launch cache, no host
    synchronisation. Notes [varlen tile list] and [longest sequences first] in kernels/seqlen.py."""
    batch = cu_tiled.shape[0] - 1
    lists = block > 0 and (last_first or first_first)
    entries = math.prod(tile_grid(block, 0, bound_tiled, batch, 1, True, limit)[1:]) if lists else 0

    def aligned(n: int) -> int:  # int32s, rounded up so that every part starts 16 bytes aligned
        return -(-n // 4) * 4

    spans = [16, aligned(2 * batch)] + ([aligned(2 * entries)] * (last_first + first_first) if lists else [])
    buf = torch.empty(sum(spans), dtype=torch.int32, device=cu_tiled.device)
    counters, sched, *written = buf.split_with_sizes(spans)
    written = iter(w[:2 * entries].view(entries, 2) for w in written)
    plan = Plan(sched[:2 * batch].view(2, batch), block if lists else 0,
                next(written) if lists and last_first else None, next(written) if lists and first_first else None,
                counters.view(4, 4) if lists else None)
    if batch + lists > 0:
        launch_named(_plan_kernel,
                     dict(CU_TILED=cu_tiled, SEQUSED_TILED=seqused_tiled, CU_COST=cu_cost, SEQUSED_COST=seqused_cost,
                          SCHEDULE=plan.schedule, LAST_FIRST_LIST=plan.last_first,
                          FIRST_FIRST_LIST=plan.first_first, COUNTERS=plan.counters),
                     lambda: StaticByName(
                         (batch + lists, 1, 1),
                         dict(batch=batch, bound_tiled=bound_tiled, bound_cost=bound_cost, entries=entries),
                         dict(BLOCK_B=min(MAX_SORT, next_power_of_2(max(batch, 1))), BLOCK=plan.block,
                              HAS_SEQUSED_TILED=seqused_tiled is not None, HAS_SEQUSED_COST=seqused_cost is not None,
                              COST_PACKED=cost_packed)),
                     num_warps=4)
    return plan


# Dense work counters by (device index, CUDA stream): [0] the forward's, [1] dK/dV's, [2] dQ's, as Plan.counters.
_DENSE_COUNTERS: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}


def dense_counter(device: torch.device, kernel: int) -> torch.Tensor:
    """The work counter of a persistent Gluon kernel (`kernel`: 0 forward, 1 dK/dV, 2 dQ) over a dense batch, 0 at
    launch: one per kernel, device and stream, which each launch leaves at 0 for the next (Note
    [self-resetting counter] in kernels/hopper_common.py); kernels on one stream run in order, and the three
    kernels of a call never share one. A launch being captured into a CUDA graph gets a zeroed counter of its own,
    so that replays (on whatever stream) share nothing with eager calls; so does a launch that is not on a GPU."""
    if device.type != "cuda" or graph_capturing(device):
        return torch.zeros(1, dtype=torch.int32, device=device)
    key = (device.index, stream_handle(device))
    counters = _DENSE_COUNTERS.get(key)
    if counters is None:
        # 16 bytes apart, each as aligned as the fresh counter a capture gets (Triton specialises pointers on it)
        counters = _DENSE_COUNTERS[key] = tuple(torch.zeros(3, 4, dtype=torch.int32, device=device)[:, 0:1])
    return counters[kernel]


def self_attention(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q: int, seqlen_k: int) -> bool:
    """Whether a varlen call's two sides have the same lengths by construction (the same tensors describe them),
    so that one plan orders both."""
    return cu_seqlens_k is cu_seqlens_q and seqused_k is seqused_q and seqlen_k == seqlen_q


def plan_lists(*wanted: tuple[int, bool]) -> tuple[int, bool, bool]:
    """(block, last_first, first_first), varlen_plan's arguments for one plan holding the first of the `wanted`
    lists that is one, and each later one of the same block. A wanted list is (rows per tile, 0 for a kernel that
    walks the schedule; whether it is first tile first, dK/dV's order, or last tile first, the forward's and dQ's)."""
    block, last_first, first_first = 0, False, False
    for rows, first in wanted:
        if rows and block in (0, rows):
            block, last_first, first_first = rows, last_first or not first, first_first or first
    return block, last_first, first_first


def list_blocks(head_dim: int, fp32: bool, fwd_gluon: bool, dq_gluon: bool, dkdv_gluon: bool,
                dropout: bool = False, head_dim_v: Optional[int] = None) -> tuple[int, int, int]:
    """Rows per tile of the lists that the varlen forward, dQ and dK/dV kernels read, 0 for one that walks the
    schedule: the Gluon kernels (each kernel's flag: Note [hopper path] in ops/hopper.py) take their items' rows
    (config.HopperConfig.item_rows); the Triton dQ kernel reads a list of its BLOCK_M (its tile with dropout if
    `dropout`, v's head dim `head_dim_v`: config.tile_config) unless an autotuner may launch it with another
    (ops/bwd.py)."""
    fwd = HOPPER["fwd"][head_dim].item_rows if fwd_gluon else 0
    dkdv = 2 * HOPPER["bwd_dkdv"][head_dim].block_n if dkdv_gluon else 0
    if dq_gluon:
        dq = 2 * HOPPER["bwd_dq"][head_dim].block_m
    else:
        dq = 0 if env.autotune() else tile_config("bwd_dq", head_dim, fp32, dropout, head_dim_v).block_m
    return fwd, dq, dkdv
