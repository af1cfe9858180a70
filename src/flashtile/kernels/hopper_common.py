"""What the Gluon Hopper kernels (hopper_fwd.py, hopper_bwd.py) share: the barriers of their
producer/consumer ring, and how they find and address a tile through TMA in a dense or a varlen batch. Gluon only
(sm_90).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .seqlen import seq_lengths


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """(held, ready, empty): `held` completes once for each consumer's tiles that stay for the whole program (its Q
    tile in the forward, its K and V in dK/dV); `ready[s]` when the loader's TMA has filled ring slot s;
    `empty[s]` when both consumers have read it (count 2), which the loader waits for before refilling it."""
    held = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(held.index(c), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival from each consumer
    fence_async_shared()  # the initialised barriers, before the TMA unit and the other partitions use them
    return held, ready, empty


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
    batch, a per-sequence one over (rows, H, D) for a varlen batch (built by the kernel; see hopper_fwd.py)."""
    if IS_VARLEN:
        tma.async_copy_global_to_shared(desc, [row, h, 0], bar, dst)
    else:
        tma.async_copy_global_to_shared(desc, [b, row, h, 0], bar, dst)


@gluon.jit
def tma_store(desc, b, row, h, src, IS_VARLEN: gl.constexpr):
    """The store that tma_load's box reads back; rows past the sequence are dropped either way."""
    if IS_VARLEN:
        tma.async_copy_shared_to_global(desc, [row, h, 0], src)
    else:
        tma.async_copy_shared_to_global(desc, [b, row, h, 0], src)


@gluon.jit
def varlen_program(TILES, CU_SEQLENS_Q, CU_SEQLENS_K, total_q, total_k):
    """A varlen program's (sequence, tile) from the written-out tile list (ops/common.tile_list), whether it has
    one, and its sequence's query and key rows: (b, tile, valid, q_start, seqlen_q, k_start, seqlen_k), the starts
    64-bit (a packed total may hold more than 2^31 elements). Entries past the list are (-1, -1); such a program
    becomes tile 0 of sequence 0 with no rows (seq_lengths gives an invalid entry none), so it reads one row and
    writes nothing. A negative tile would put negative rows in its TMA stores' coordinates, which the H200 faults
    on as an illegal instruction although the whole box lies outside the descriptor (compute-sanitizer, session 8)."""
    entry = TILES + 2 * gl.program_id(0)
    seq = gl.load(entry)
    b = gl.maximum(seq, 0)
    tile = gl.maximum(gl.load(entry + 1), 0)
    valid = seq >= 0
    q_start, seqlen_q = seq_lengths(b, valid, CU_SEQLENS_Q, None, total_q, False)
    q_start = q_start.to(gl.int64)
    k_start, seqlen_k = seq_lengths(b, valid, CU_SEQLENS_K, None, total_k, False)
    return b, tile, valid, q_start, seqlen_q, k_start.to(gl.int64), seqlen_k


@gluon.jit
def seq_desc(base, start, length, stride_m, stride_h, nheads, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
             LAYOUT: gl.constexpr):
    """A descriptor over one varlen sequence's rows [start, start + length) of a packed (total, H, D) tensor, boxes
    of (BLOCK, 1, HEAD_DIM). Its rows end where the sequence does, so reads past it are zeros and writes are dropped
    (the next sequence's rows are never read: a row of inf or NaN there would survive P = 0 in P V). A sequence
    with no rows gets a one-row descriptor, which the kernels never write to (a program past the tile list reads
    it; see varlen_program)."""
    return tma.make_tensor_descriptor(base + start * stride_m, [gl.maximum(length, 1), nheads, HEAD_DIM],
                                      [stride_m, stride_h, 1], [BLOCK, 1, HEAD_DIM], LAYOUT)

