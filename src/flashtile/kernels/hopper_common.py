"""What the Gluon Hopper kernels (hopper_fwd.py, hopper_dq.py, hopper_bwd.py) share: their producer/consumer ring
(Ring: every slot index and phase, Note [ring positions]) and a persistent program's two sets of held buffers
(BufferSets), how they find and address a tile through TMA in a dense or a varlen batch, how a persistent loader
describes a work item to its consumers, and the two places a varlen batch's packed layout needs more than a TMA
box (Note [varlen descriptors] in hopper_fwd.py). Gluon only (sm_90).

A change here changes every Hopper kernel's code: tools/sass_diff.py compares the sm_90 SASS of every compile
against another tree, instruction for instruction, where no GPU can time the change.

Note [head dim parts]: the kernels take q/k 128 with v 128, and MLA prefill's q/k 192 with v 128 (DeepSeek-V3,
Kimi). A register tile's dims must be powers of two, and a 256-wide Q and K would spend a quarter of Q Kᵀ, dS K
and dSᵀ Q on zeros, so 192 is read as config.head_dim_parts gives it, 128 + 64: HEAD_DIM (V's, O's and dO's
width, and the first part of Q's, K's, dQ's and dK's) and HEAD_DIM_TAIL (0, or the tail's). The launchers
(ops/hopper.py) build a second descriptor over each tensor's tail columns (Q2, K2, DQ2, DK2: a view whose base is
HEAD_DIM elements in, 16-byte aligned), the loaders fill a tail buffer beside each first-part buffer on the same
barrier, S and Sᵀ are two wgmmas into one accumulator, and dQ's and dK's tails accumulate on their own (a second
wgmma on the same dS) and are staged for their stores in the tail buffers of Q and K, as the first parts are in
theirs. The tails' shared memory leaves no room for the held sets and three-stage rings at the d128 tiles: the
forward takes 2 stages (one K slot, two V), and the backward halves the tile it streams (dQ's key blocks,
dK/dV's query tiles: config.HOPPER).
"""

import hashlib
import inspect

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate
from triton.language.core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .masking import kv_block_range
from .seqlen import seq_lengths


@gluon.jit
def barrier_array(N: gl.constexpr, COUNT: gl.constexpr):
    """N mbarriers, each of which completes a phase on COUNT arrivals (and the bytes a TMA arrival expects). Not
    fenced: ring_barriers' fence covers every barrier initialised before it."""
    bars = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N):
        mbarrier.init(bars.index(i), count=COUNT)
    return bars


@gluon.jit
def ring_barriers(STAGES: gl.constexpr, HELD: gl.constexpr):
    """(held, ready, empty): `held[i]` completes once for a consumer's tiles that stay while they are used (its Q
    tile in the forward, one per Q buffer; its K and V in dK/dV); `ready[s]` when the loader's TMA has filled ring
    slot s; `empty[s]` when both consumers have read it (count 2), which the loader waits for before refilling it."""
    held = barrier_array(HELD, 1)
    ready = barrier_array(STAGES, 1)
    empty = barrier_array(STAGES, 2)  # one arrival from each consumer
    fence_async_shared()  # the initialised barriers, before the TMA unit and the other partitions use them
    return held, ready, empty


def _apply(a, op: str, b, _semantic):
    """`a <op> b` as the code generator emits it for a Gluon function's expression: the tensor's operator method,
    (reflected if only b is a tensor), or Python's own on two constexprs (a dense program's positions start at a
    constant 0)."""
    if isinstance(a, gl.tensor):
        return getattr(a, op)(b, _semantic=_semantic)
    if isinstance(b, gl.tensor):
        return getattr(b, op.replace("__", "__r", 1))(a, _semantic=_semantic)
    return gl.constexpr(getattr(gl.constexpr(a).value, op)(gl.constexpr(b).value))


@aggregate
class Ring:
    """A ring of STAGES slots that the loader fills and both consumers read (Note [ring positions]): `ready[s]`
    completes a phase when a fill of slot s has landed, `empty[s]` when both consumers have released it. Every
    index and phase of a ring is computed here, from the position alone. The methods are builtins, not Gluon
    functions (Note [ring methods are builtins]).

    Note [ring positions]: the loader and each consumer count a ring's fills from the program's first, on from one
    item to the next (a persistent program's item starts where the last one ended: `it0`), and so agree on every
    position without talking. Position it is slot it % STAGES's (it // STAGES)-th fill: the phase of `ready` it
    completes, and of `empty` its release completes, is (it // STAGES) & 1. The loader waits for the release of
    the slot's previous fill, the phase before, ((it // STAGES) & 1) ^ 1, which a fresh barrier counts as
    complete, so the first STAGES fills wait for nothing. A consumer releases every position, the ones it does not
    compute included (pass_over): the `empty` barriers count two arrivals a phase, one from each consumer.

    Note [ring methods are builtins]: a Gluon function call is inlined, but it leaves an inlined scope in the
    debug line info, whose bounds become labels in the PTX, and ptxas schedules differently around them: with the
    ring's methods as Gluon functions the sm_90 SASS of 2 of the 7 dQ kernels changed (22 and 30 instructions
    moved; the PTX without its labels was the same). As builtins they emit their operations at the caller's line
    and leave the SASS instruction for instruction as the hand-written arithmetic (tools/sass_diff.py). Triton
    leaves builtins out of its cache key, so their source enters it through __init__ (_RING_SOURCE)."""
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    STAGES: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ready, empty, STAGES):
        assert _RING_SOURCE  # Note [ring methods are builtins]: the builtins' source, in the cache key
        self.ready = ready
        self.empty = empty
        self.STAGES = gl.constexpr(STAGES)

    @builtin
    def slot(self, it, _semantic=None):
        """Position it's slot: the index of its buffers (and barriers)."""
        return _apply(it, "__mod__", self.STAGES, _semantic)

    @builtin
    def ready_bar(self, it, _semantic=None):
        """The barrier a fill of position it lands on (its TMA loads' `expect`)."""
        return self.ready.index(self.slot(it, _semantic=_semantic), _semantic=_semantic)

    @builtin
    def wait_ready(self, it, _semantic=None):
        """A consumer: wait for position it's fill to land."""
        bar = self.ready_bar(it, _semantic=_semantic)
        phase = _apply(_apply(it, "__floordiv__", self.STAGES, _semantic), "__and__", 1, _semantic)
        mbarrier.wait(bar, phase, _semantic=_semantic)

    @builtin
    def release(self, it, _semantic=None):
        """A consumer: it has read position it's slot."""
        mbarrier.arrive(self.empty.index(self.slot(it, _semantic=_semantic), _semantic=_semantic), count=1,
                        _semantic=_semantic)

    @builtin
    def wait_empty(self, it, _semantic=None):
        """The loader: wait until both consumers have released the slot's previous fill, before refilling it."""
        bar = self.empty.index(self.slot(it, _semantic=_semantic), _semantic=_semantic)
        phase = _apply(_apply(it, "__floordiv__", self.STAGES, _semantic), "__and__", 1, _semantic)
        mbarrier.wait(bar, _apply(phase, "__xor__", 1, _semantic), _semantic=_semantic)


@aggregate
class BufferSets:
    """The buffers a persistent program's consumers hold for a whole item (the forward's Q, dQ's Q and dO, dK/dV's
    K and V), in two sets so that the next item's loads run under the current one's work: item r (the r-th the
    loader takes) in set r % 2, consumer c's in buffer 2 * (r % 2) + c, described in info slot r % 2 (publish_item).
    `held[i]` completes when buffer i's loads have landed (or on the loader's plain arrival: end), `free[i]` when
    its consumer no longer needs it (its store has read it); set r % 2 is refilled every other item, so both wait
    for phase (r // 2) & 1 (the loader, on `free`, for the one before: a fresh barrier counts it as complete, and
    items 0 and 1 wait for nothing). Builtins, as Ring's (Note [ring methods are builtins])."""
    held: gl.shared_memory_descriptor
    free: gl.shared_memory_descriptor
    info: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, held, free, info):
        assert _RING_SOURCE  # Note [ring methods are builtins]: the builtins' source, in the cache key
        self.held = held
        self.free = free
        self.info = info

    @builtin
    def info_slot(self, r, _semantic=None):
        """Where item r is described."""
        return self.info.index(_apply(r, "__mod__", 2, _semantic), _semantic=_semantic)

    @builtin
    def buffer(self, r, c, _semantic=None):
        """Consumer c's buffer of item r."""
        first = _apply(2, "__mul__", _apply(r, "__mod__", 2, _semantic), _semantic)
        return _apply(first, "__add__", c, _semantic)

    @builtin
    def other(self, i, _semantic=None):
        """The same consumer's buffer in the other set: the previous item's."""
        return _apply(i, "__xor__", 2, _semantic)

    @builtin
    def previous(self, r, c, _semantic=None):
        """Consumer c's buffer of item r - 1: other(buffer(r, c)) written as dK/dV wrote it, 2 * (1 - r % 2) + c,
        with which ptxas schedules its varlen kernels as before (through other, 8 instructions more and some 90 to
        400 moved)."""
        first = _apply(2, "__mul__", _apply(1, "__sub__", _apply(r, "__mod__", 2, _semantic), _semantic), _semantic)
        return _apply(first, "__add__", c, _semantic)

    @builtin
    def wait_free(self, r, _semantic=None):
        """The loader: wait until both consumers have handed back item r's set (item r - 2's buffers)."""
        first = _apply(2, "__mul__", _apply(r, "__mod__", 2, _semantic), _semantic)
        for c in range(2):
            i = first if c == 0 else _apply(first, "__add__", c, _semantic)
            bar = self.free.index(i, _semantic=_semantic)
            phase = _apply(_apply(_apply(r, "__floordiv__", 2, _semantic), "__and__", 1, _semantic), "__xor__", 1,
                           _semantic)
            mbarrier.wait(bar, phase, _semantic=_semantic)

    @builtin
    def end(self, r, _semantic=None):
        """The loader, at the first item past its list (published invalid): no loads, a plain arrival on both
        consumers' `held` completes their wait, and they read the item and stop."""
        first = _apply(2, "__mul__", _apply(r, "__mod__", 2, _semantic), _semantic)
        for c in range(2):
            i = first if c == 0 else _apply(first, "__add__", c, _semantic)
            mbarrier.arrive(self.held.index(i, _semantic=_semantic), count=1, _semantic=_semantic)

    @builtin
    def wait_held(self, r, c, _semantic=None):
        """Consumer c: wait for its buffer of item r to land."""
        bar = self.held.index(self.buffer(r, c, _semantic=_semantic), _semantic=_semantic)
        phase = _apply(_apply(r, "__floordiv__", 2, _semantic), "__and__", 1, _semantic)
        mbarrier.wait(bar, phase, _semantic=_semantic)

    @builtin
    def release(self, i, _semantic=None):
        """A consumer: buffer i holds nothing its item still needs."""
        mbarrier.arrive(self.free.index(i, _semantic=_semantic), count=1, _semantic=_semantic)


_RING_SOURCE = gl.constexpr(hashlib.sha256("".join(inspect.getsource(x) for x in (_apply, Ring, BufferSets))
                                           .encode()).hexdigest())


@gluon.jit
def pass_over(it_from, it_to, ring):
    """Ring positions [it_from, it_to) that a consumer does not compute: it waits for each slot's fill (an arrival
    before it would complete the slot's phase while the other consumer may still read it) and releases it."""
    for it in range(it_from, it_to):
        ring.wait_ready(it)
        ring.release(it)


@gluon.jit
def tile_buffers(desc, N: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, IS_VARLEN: gl.constexpr):
    """N shared-memory buffers of one box of desc each, in the shape tma_load fills: (ROWS, 1, D) through a
    descriptor over a packed (total, H, D) tensor, (1, ROWS, 1, D) through one over (B, S, H, D)."""
    if IS_VARLEN:
        return gl.allocate_shared_memory(desc.dtype, [N, ROWS, 1, HEAD_DIM], desc.layout)
    else:
        return gl.allocate_shared_memory(desc.dtype, [N, 1, ROWS, 1, HEAD_DIM], desc.layout)


@gluon.jit
def tma_load(desc, b, row, h, bar, dst, IS_VARLEN: gl.constexpr):
    """TMA-load the box at (sequence b, row, head h) into dst: a host descriptor over (B, S, H, D) for a dense
    batch, over the packed (total, H, D) tensor for a varlen one (row counted from the packed tensor's start)."""
    if IS_VARLEN:
        tma.async_copy_global_to_shared(desc, [row, h, 0], bar, dst)
    else:
        tma.async_copy_global_to_shared(desc, [b, row, h, 0], bar, dst)


@gluon.jit
def tma_store(desc, b, row, h, src, IS_VARLEN: gl.constexpr):
    """The store that tma_load's box reads back. A dense batch's descriptor drops rows past the sequence; a varlen
    batch's would write them into the next sequence, so its last partial tile goes through store_rows instead."""
    if IS_VARLEN:
        tma.async_copy_shared_to_global(desc, [row, h, 0], src)
    else:
        tma.async_copy_shared_to_global(desc, [b, row, h, 0], src)


@gluon.jit
def varlen_program(TILES, index, CU_SEQLENS_Q, CU_SEQLENS_K, total_q, total_k):
    """The (sequence, tile) at position `index` of the written-out tile list (ops/schedule.varlen_plan), whether the
    list has one there, and its sequence's query and key rows: (b, tile, valid, q_row0, seqlen_q, k_row0,
    seqlen_k), the rows where the sequence starts in the packed tensors, 32-bit as TMA coordinates are (a packed
    tensor's row count is far below 2^31; element offsets are widened where they are formed). Entries past the list
    are (-1, -1); such an entry becomes tile 0 of sequence 0 with no rows (seq_lengths gives an invalid entry none),
    and the persistent loaders publish it as the end of their work. A negative tile would put negative rows in its
    TMA stores' coordinates, which the H200 faults on as an illegal instruction although the whole box lies outside
    the descriptor (compute-sanitizer; docs/design/descriptors.md).

    `index`: the persistent kernels' work item divided by the heads (work_item)."""
    entry = TILES + 2 * index
    seq = gl.load(entry)
    b = gl.maximum(seq, 0)
    tile = gl.maximum(gl.load(entry + 1), 0)
    valid = seq >= 0
    q_row0, seqlen_q = seq_lengths(b, valid, CU_SEQLENS_Q, None, total_q, False)
    k_row0, seqlen_k = seq_lengths(b, valid, CU_SEQLENS_K, None, total_k, False)
    return b, tile, valid, q_row0, seqlen_q, k_row0, seqlen_k


@gluon.jit
def work_item(w, heads, TILES, CU_SEQLENS_Q, CU_SEQLENS_K, total_q, total_k, ROWS: gl.constexpr,
              LAST_FIRST: gl.constexpr, KEY_TILES: gl.constexpr):
    """Work item w of a persistent varlen kernel (the forward's Note [persistent forward]): the items of one
    sequence are its heads x tiles, tiles fastest, and occupy items [first * heads, (first + n) * heads) when the
    tile list (ops/schedule.varlen_plan) holds the sequence's n tiles of ROWS rows at entries [first, first + n),
    the last tile first if LAST_FIRST. Entry w // heads lies in that run, so it names the sequence; where in the run
    it lies gives `first`. The tiles are query tiles, or key tiles if KEY_TILES. Returns (valid, b, h, tile,
    q_row0, seqlen_q, k_row0, seqlen_k), varlen_program's values for the entry; valid is false past the list."""
    b, entry_tile, valid, q_row0, seqlen_q, k_row0, seqlen_k = varlen_program(TILES, w // heads, CU_SEQLENS_Q,
                                                                               CU_SEQLENS_K, total_q, total_k)
    if KEY_TILES:
        length = seqlen_k
    else:
        length = seqlen_q
    n_tiles = gl.maximum((length + ROWS - 1) // ROWS, 1)  # an entry past the list has no rows
    if LAST_FIRST:
        position = n_tiles - 1 - entry_tile
    else:
        position = entry_tile
    local = w - (w // heads - position) * heads
    h = local // n_tiles
    tile = local % n_tiles
    if LAST_FIRST:
        tile = n_tiles - 1 - tile
    return valid, b, h, tile, q_row0, seqlen_q, k_row0, seqlen_k


# Note [self-resetting counter]: a dense batch's work counter is not zeroed per call (that is a memset launch and
# an allocation on the host's path) but left at 0 by the launch that used it. Every program takes items until it
# draws one past the last, so a launch of G programs over n items draws exactly n + G numbers, and the program
# that draws n + G - 1 makes the counter's last atomic: it stores 0 there, for the next launch on the stream
# (ops/schedule.dense_counter keeps one counter per kernel, device and stream; a launch under CUDA-graph capture
# takes a zeroed counter of its own).
@gluon.jit
def take_item(COUNTER, n_items, RESET: gl.constexpr):
    """The next work item's number from COUNTER (an atomic add: one thread's, its result broadcast to the warp);
    with RESET the draw of n_items + the grid - 1 leaves the counter at 0 (Note [self-resetting counter])."""
    w = gl.atomic_add(COUNTER, 1)
    if RESET:
        if w == n_items + gl.num_programs(0) - 1:
            gl.atomic_xchg(COUNTER, 0)
    return w


@gluon.jit
def dense_work_item(w, heads, length, ROWS: gl.constexpr, LAST_FIRST: gl.constexpr):
    """Work item w of a dense batch in a persistent kernel: (b, h, tile) for tiles of ROWS rows over `length`, the
    tiles fastest within a (sequence, head), the last first if LAST_FIRST: the order work_item gives a varlen
    batch's items, numbered instead of listed. h is a query head, or a KV head when `heads` counts those."""
    n_tiles = (length + ROWS - 1) // ROWS
    bh = w // n_tiles
    tile = w - bh * n_tiles
    if LAST_FIRST:
        tile = n_tiles - 1 - tile
    return bh // heads, bh % heads, tile


@gluon.jit
def publish_item(slot, valid, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11):
    """A persistent loader's description of a work item, for its consumers (read_item): valid and 11 int32 fields,
    into a 16-wide int32 row of shared memory; each kernel names the fields in an `_Item` aggregate. The thread
    barrier orders the warp's shared writes before its next arrival on a barrier the consumers wait on (the item's
    first TMA load's `expect`) before reading."""
    layout: gl.constexpr = gl.BlockedLayout([16], [32], [1], [0])
    i = gl.arange(0, 16, layout=layout)
    v = gl.where(i == 0, valid.to(gl.int32), 0)
    v = gl.where(i == 1, f1, v)
    v = gl.where(i == 2, f2, v)
    v = gl.where(i == 3, f3, v)
    v = gl.where(i == 4, f4, v)
    v = gl.where(i == 5, f5, v)
    v = gl.where(i == 6, f6, v)
    v = gl.where(i == 7, f7, v)
    v = gl.where(i == 8, f8, v)
    v = gl.where(i == 9, f9, v)
    v = gl.where(i == 10, f10, v)
    v = gl.where(i == 11, f11, v)
    slot.store(v)
    gl.thread_barrier()


@gluon.constexpr_function
def item_fields(item, fields: dict) -> None:
    """An `_Item` aggregate's constructor body: its fields from the constructor's arguments (`locals()`)."""
    for name, value in fields.items():
        if name != "self":
            setattr(item, name, value)


@gluon.jit
def _field(v, i, k: gl.constexpr):
    return gl.sum(gl.where(i == k, v, 0), 0)  # every thread holds the whole row: no shuffle


@gluon.jit
def read_item(slot):
    """publish_item's fields, read by a 4-warp consumer: (valid, f1, ..., f11)."""
    layout: gl.constexpr = gl.BlockedLayout([16], [32], [4], [0])
    v = slot.load(layout)
    i = gl.arange(0, 16, layout=layout)
    return (_field(v, i, 0) != 0, _field(v, i, 1), _field(v, i, 2), _field(v, i, 3), _field(v, i, 4),
            _field(v, i, 5), _field(v, i, 6), _field(v, i, 7), _field(v, i, 8), _field(v, i, 9), _field(v, i, 10),
            _field(v, i, 11))


@gluon.jit
def info_slots():
    """Two rows for publish_item, one per buffer set of a persistent kernel (item r in slot r % 2)."""
    return gl.allocate_shared_memory(gl.int32, [2, 16], gl.SwizzledSharedLayout(1, 1, 1, [0]))


@gluon.jit
def zero_rows_from(tile, first, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, WARPS: gl.constexpr):
    """Zero rows [first, ROWS) of a (ROWS, HEAD_DIM) shared tile that a TMA load through a packed descriptor has
    filled, before a wgmma reads it: those rows belong to the next sequence (Note [varlen descriptors] in
    hopper_fwd.py), and a zero probability times an inf or NaN there is NaN. Called by a partition of WARPS warps,
    which rewrites only the chunks of rows that reach row `first` (16 rows for 4 warps, 8 for one: a slice of the
    128-byte swizzle holds whole 8-row groups), and ends with the fence that orders these generic-proxy writes
    before a wgmma's (async proxy) reads. The caller then issues that wgmma itself (the forward's consumers), or
    hands the tile to other partitions through an mbarrier (the dK/dV loader: Triton puts a warp barrier before
    the one thread's arrive)."""
    CHUNK: gl.constexpr = 16 if WARPS > 1 else 8
    COLS: gl.constexpr = HEAD_DIM // 8  # threads along a row, 8 elements (16 bytes) each
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // COLS, COLS], [WARPS, 1], [1, 0])
    zeros = gl.zeros([CHUNK, HEAD_DIM], tile.dtype, layout)
    for r in gl.static_range(0, ROWS, CHUNK):
        chunk = tile.slice(r, CHUNK)
        if r >= first:
            chunk.store(zeros)
        elif r + CHUNK > first:  # the chunk the sequence ends in
            rows = r + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
            chunk.store(gl.where(gl.expand_dims(rows < first, 1), chunk.load(layout), zeros))
    fence_async_shared()


@gluon.jit
def store_rows(base, tile, row0, n_rows, h, stride_m, stride_h, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Store the first n_rows rows of a (ROWS, HEAD_DIM) shared tile, staged as for a TMA store, at rows row0 + i,
    head h of a packed (total, H, D) tensor: a varlen sequence's last, partial tile, where a TMA box would also
    write the next sequence's rows. Read back in a row-major layout, each thread stores 16-byte pieces through a
    few row pointers (from the wgmma layout it would need one 64-bit pointer per register pair, which spill).
    Row offsets are 64-bit: a packed tensor may exceed 2^31 elements."""
    COLS: gl.constexpr = HEAD_DIM // 8
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // COLS, COLS], [4, 1], [1, 0])
    x = tile.load(layout)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    ptr = base + row0.to(gl.int64) * stride_m + h.to(gl.int64) * stride_h
    offs = gl.expand_dims(rows.to(gl.int64) * stride_m, 1) + gl.expand_dims(cols, 0)
    gl.store(ptr + offs, x, mask=gl.expand_dims(rows < n_rows, 1))
