"""Per-program sequence information: which sequence a program works on, where it starts and how long it is.

Dense batches (B, S, H, D) address sequence b through a batch stride and have one length for all; varlen batches
(total, H, D) have stride_b = 0 and find sequence b at row cu_seqlens[b]. `seqused` (FlashAttention-3) shortens a
sequence to its first seqused[b] tokens without moving it.

Note [longest sequences first]: a varlen grid's sequence axis is the slowest-varying one, so the GPU starts the
programs of its sequences in grid order, and a long sequence whose tiles come last leaves a tail in which most
SMs idle. With few heads per GPU (tensor parallelism) that tail is large: list scheduling simulated on 132 SMs
with 4 heads and the benchmark's 16-sequence mix, longest sequence last, reaches 66-96% of the ideal in batch
order and 95-99% longest first (causal or not, one or two programs per SM); with 16 heads the gain is ~1%.
`_seq_order_kernel` writes, on the device and without a host synchronisation, the order in which grid index z
visits sequences: by decreasing length, so that the most expensive tiles start first and the cheapest fill the
tail (longest-processing-time-first list scheduling). It sorts chunks of up to MAX_SORT sequences separately:
with more sequences than that, each chunk is a full wave of work and the order inside a chunk is what shapes the
tail. The tiles of one sequence stay neighbours in launch order, which keeps its K/V shared through L2.
This file only computes indices, offsets and lengths.
"""

import triton
import triton.language as tl

MAX_SORT = 1024  # sequences sorted together by _seq_order_kernel (one bitonic sort per program)


@triton.jit
def seq_info(b, seqlen, cu_seqlens, seqused, IS_VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr):
    """Returns (first row of sequence b in the packed tensor, its length)."""
    if IS_VARLEN:
        start = tl.load(cu_seqlens + b).to(tl.int64)
        length = (tl.load(cu_seqlens + b + 1) - tl.load(cu_seqlens + b)).to(tl.int32)
    else:
        start = tl.zeros((), dtype=tl.int64)
        length = seqlen
    if HAS_SEQUSED:
        length = tl.load(seqused + b).to(tl.int32)
    return start, length


@triton.jit
def seq_index(z, seq_order, IS_VARLEN: tl.constexpr):
    """The sequence that grid index z works on: varlen grids visit them in seq_order (Note [longest sequences
    first]); dense ones, whose sequences are all alike, in batch order."""
    if IS_VARLEN:
        return tl.load(seq_order + z)
    return z


@triton.jit
def _seq_order_kernel(CU_SEQLENS, SEQUSED, ORDER, batch,
                      BLOCK_B: tl.constexpr, HAS_SEQUSED: tl.constexpr):
    """ORDER[chunk] = the sequences of this program's chunk of BLOCK_B, longest first; ties keep batch order."""
    i = tl.arange(0, BLOCK_B)
    first = tl.program_id(0) * BLOCK_B
    b = first + i
    ok = b < batch
    if HAS_SEQUSED:
        length = tl.load(SEQUSED + b, mask=ok, other=0)
    else:
        length = tl.load(CU_SEQLENS + b + 1, mask=ok, other=0) - tl.load(CU_SEQLENS + b, mask=ok, other=0)
    # One sortable key per sequence: the length, then the reversed position so that equal lengths keep their order
    # in a descending sort. Clamping keeps a malformed (decreasing) cu_seqlens from sorting below the padding.
    key = tl.where(ok, tl.maximum(length, 0).to(tl.int64) * BLOCK_B + (BLOCK_B - 1 - i), -1)
    key = tl.sort(key, descending=True)
    tl.store(ORDER + b, first + (BLOCK_B - 1 - key % BLOCK_B).to(tl.int32), mask=ok)
