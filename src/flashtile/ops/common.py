"""Plumbing shared by the attention ops: the custom-op wrapper and its eager shortcut, packed-input views, TMA
alignment and host descriptors, strides, varlen grids and launch order. Launching itself is ops/launch.py.

Note [eager calls skip the dispatcher]: every kernel entry point is a `torch.library.custom_op` with a fake, which
is what torch.compile, FakeTensor and the other tracing modes see. A plain eager call does not need the
dispatcher, and at short lengths it cost more than the kernels: on the H200 machine (torch 2.11) the host took
1.1-1.6 ms to enqueue one B=16, S=1k, d128 forward+backward through the custom ops and their registered
autograd, while the GPU needed ~1.1 ms (causal), so the call ran at the host's pace. So `call` runs the
implementation directly when nothing traces the call (not compiling, every tensor a plain torch.Tensor or
Parameter), and the op otherwise; autograd.py does the same with a torch.autograd.Function around the two
implementations, which enqueues the same forward+backward in 0.85-0.95 ms (docs/design/launch-path.md).
Both routes run the same functions.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import NamedTuple, Optional

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import env
from ..config import HOPPER, block_d, tile_config
from ..kernels.seqlen import MAX_SORT, MAX_STEP, _plan_kernel
from .launch import capture_target, launch_fixed, signature
from .triton_internals import descriptor

_TMA_ALIGN = 16  # bytes: TMA descriptors need 16-byte aligned bases and strides


def custom_op(name: str, mutates_args=()):
    """`torch.library.custom_op`, keeping the undecorated implementation as the op's `.impl` and the positions of
    the arguments it writes as `.mutated`, for `call`."""
    def wrap(fn):
        op = torch.library.custom_op(name, fn, mutates_args=mutates_args)
        op.impl = fn
        op.mutated = tuple(i for i, arg in enumerate(inspect.signature(fn).parameters) if arg in mutates_args)
        return op
    return wrap


# torch.func's wrappers (vmap's batched tensors, grad's tracking tensors) look like plain torch.Tensors from
# Python; this private predicate is the only way to tell them apart, and without it vmap would reach a kernel.
_functorch_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda t: False)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def untraced(args) -> bool:
    """True when a call with these arguments can run an op's implementation directly: eager mode and plain
    tensors (a tensor subclass such as FakeTensor, or a torch.func wrapper, needs the dispatcher). Note [eager
    calls skip the dispatcher]."""
    if torch.compiler.is_compiling():  # first: dynamo need not trace the checks below
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN or _functorch_wrapped(a)):
            return False
    return True


def call(op, *args):
    """op(*args), through the dispatcher only when something may be tracing it."""
    if not untraced(args):
        return op(*args)
    result = op.impl(*args)
    # The dispatcher bumps the version counter of every tensor an op writes in place, which is how autograd
    # notices a tensor it saved being changed; kernels bypass that, so do it here.
    if op.mutated:
        torch.autograd.graph.increment_version([args[i] for i in op.mutated])
    return result


def cdiv(a: int, b: int) -> int:
    """triton.cdiv for host code. Triton 3.6's is a constexpr function, and each call from Python costs a few µs
    (its wrapper imports and unwraps its arguments): 20 µs of a varlen forward's host time on the CI machine."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for host code (see cdiv)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# Packing of the custom ops' (q, k, v) arguments, so that packed entry points get one gradient buffer.
PACK_NONE, PACK_QKV, PACK_KV = 0, 1, 2


def unpack(q, k, v, packing: int):
    """Views of q, k, v from (q, k, v), (qkv, None, None) or (q, kv, None); packed dim is -3."""
    if packing == PACK_QKV:
        return q.select(-3, 0), q.select(-3, 1), q.select(-3, 2)
    if packing == PACK_KV:
        return q, k.select(-3, 0), k.select(-3, 1)
    return q, k, v


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA device, read once per device (under launch.capture_launches, the
    capability of the device it pretends to be)."""
    target = capture_target()
    if target is not None:
        return target[0]
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device, read once per device: a persistent grid's size (under
    launch.capture_launches, the pretended device's)."""
    target = capture_target()
    if target is not None:
        return target[1]
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def on_gpu(device: torch.device) -> bool:
    """Whether kernels for `device` are compiled for a GPU: a CUDA device, or any under launch.capture_launches."""
    return device.type == "cuda" or capture_target() is not None


def graph_capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched with programmatic dependent launch (sm_90 and later, not under
    the interpreter, not switched off with FLASHTILE_PDL=0)."""
    if env.INTERPRET or not on_gpu(device) or not env.pdl():
        return False
    return capability(device) >= (9, 0)


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """Return t, or a contiguous copy if its base or strides are not 16-byte aligned or are 0 (TMA requirements).

    The copy keeps autograd intact; it only happens for unusual views (odd offsets or strides).
    """
    es = t.element_size()
    if t.is_contiguous() and (t.data_ptr() | t.shape[-1] * es) % _TMA_ALIGN == 0:
        return t  # every stride is a multiple of the last dim's size (the common case, checked first for speed)
    aligned = t.data_ptr() % _TMA_ALIGN == 0 and all(
        s > 0 and (s * es) % _TMA_ALIGN == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)
    return t if aligned else t.contiguous() if not t.is_contiguous() else t.clone()


def kernel_strides(t: torch.Tensor) -> list[int]:
    """t's strides as every kernel takes them (TMA descriptors and pointer arithmetic alike). A dimension of size
    1 is never stepped along, so its stride may be anything; give it the stride it would have in a contiguous
    tensor: TMA wants every stride 16-byte aligned, and a stride of 1 would be an integer Triton specialises into
    a constant, compiling another kernel (Note [runtime integers] in kernels/__init__.py)."""
    shape, strides = t.shape, list(t.stride())
    if 1 in shape:
        for i in range(len(shape) - 2, -1, -1):
            if shape[i] == 1:
                strides[i] = strides[i + 1] * shape[i + 1]
    return strides


def host_desc(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A TMA descriptor over a dense (B, S, H, D) or packed (total, H, D) tensor (tma_ready), for
    seqlen.load_rows/store_rows, whose box is one head's (rows, BLOCK_D) tile. An autotuned launch resets the box
    for each config it tries (`descriptor_blocks`)."""
    shape, strides = list(t.shape), kernel_strides(t)
    box = [rows, 1, block_d(shape[-1])]
    # Without the dataclass's checks where Triton allows (triton_internals.descriptor): they repeat what tma_ready
    # and the tile table guarantee.
    return descriptor(TensorDescriptor, base=t, shape=shape, strides=strides,
                      block_shape=[1, *box] if len(shape) == 4 else box, padding="zero")


def descriptor_blocks(rows: dict):
    """A launch pre-hook: set the block shape of each host descriptor argument named in `rows` (argument name ->
    the tile-config constexpr giving its rows), so that the boxes follow the config an autotuner or the table
    picks: (1, rows, 1, BLOCK_D) over (B, S, H, D), (rows, 1, BLOCK_D) over (total, H, D)."""
    def hook(nargs):
        for name, block in rows.items():
            desc = nargs[name]
            if isinstance(desc, TensorDescriptor):
                box = [nargs[block], 1, nargs["BLOCK_D"]]
                desc.block_shape = [1] + box if len(desc.shape) == 4 else box
    return hook


def bmh_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, row, head) strides of a (B, S, H, D) tensor, or of a (total, H, D) one with batch stride 0
    (kernel_strides)."""
    strides = kernel_strides(t)
    if varlen:
        return 0, strides[0], strides[1]
    return strides[0], strides[1], strides[2]


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
    counters for the persistent Gluon kernels (Notes [persistent varlen forward], [persistent varlen dQ] and
    [persistent varlen dK/dV]).
    Kernels that walk the schedule take `schedule`, kernels that read their tile take a list (the Gluon kernels and
    the varlen dQ kernel). One launch (kernels/seqlen.py: _plan_kernel), through the launch cache, no host
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
        key = (signature(cu_tiled, seqused_tiled, cu_cost, seqused_cost), bound_tiled, bound_cost, cost_packed,
               plan.block, plan.last_first is not None, plan.first_first is not None, entries)
        launch_fixed(_plan_kernel, key, (batch + lists, 1, 1),
                     (cu_tiled, seqused_tiled, cu_cost, seqused_cost, plan.schedule, plan.last_first,
                      plan.first_first, plan.counters), (batch, bound_tiled, bound_cost, entries),
                     dict(BLOCK_B=min(MAX_SORT, next_power_of_2(max(batch, 1))), BLOCK=plan.block,
                          HAS_SEQUSED_TILED=seqused_tiled is not None, HAS_SEQUSED_COST=seqused_cost is not None,
                          COST_PACKED=cost_packed), num_warps=4)
    return plan


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


def list_blocks(head_dim: int, fp32: bool, gluon: bool) -> tuple[int, int, int]:
    """Rows per tile of the lists that the varlen forward, dQ and dK/dV kernels read, 0 for one that walks the
    schedule: the Gluon kernels (`gluon`, Note [hopper path] in ops/hopper.py) take 2 x their consumer's rows; the
    Triton dQ kernel reads a list of its BLOCK_M unless an autotuner may launch it with another (ops/bwd.py)."""
    fwd = 2 * HOPPER["fwd"][head_dim].block_m if gluon else 0
    dkdv = 2 * HOPPER["bwd_dkdv"][head_dim].block_n if gluon else 0
    if gluon:
        dq = 2 * HOPPER["bwd_dq"][head_dim].block_m
    else:
        dq = 0 if env.autotune() else tile_config("bwd_dq", head_dim, fp32).block_m
    return fwd, dq, dkdv


@functools.lru_cache(maxsize=64)  # a handful of page sizes per process; every paged or dense forward asks
def fast_divisor(d: int) -> tuple[int, int]:
    """(mul, shift) with n // d == (n * mul) >> shift for every 0 <= n < 2^31, for kernels that divide by a
    runtime value (kvcache.cache_coords: rows by the page size). Division by an invariant integer (Granlund and
    Montgomery, 1994): with l = ceil(log2 d), shift = 31 + l and mul = ceil(2^shift / d) <= 2^32, so n * mul < 2^63
    fits int64, and the rounding error e = mul * d - 2^shift < d <= 2^l keeps n * e < 2^shift: the product never
    reaches the next multiple of d."""
    if d < 1:
        raise ValueError(f"divisor must be >= 1, got {d}")
    shift = 31 + (d - 1).bit_length()
    return -(-(1 << shift) // d), shift


def alibi_batch_stride(alibi_slopes) -> int:
    """Slopes are (H,) or (B, H); a batch stride of 0 makes the first shape read like the second."""
    return alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0
