"""Per-program sequence information: where a sequence starts in memory and how long it is.

Dense batches (B, S, H, D) address sequence b through a batch stride and have one length for all; varlen batches
(total, H, D) have stride_b = 0 and find sequence b at row cu_seqlens[b]. `seqused` (FlashAttention-3) shortens a
sequence to its first seqused[b] tokens without moving it. This file only computes offsets and lengths.
"""

import triton
import triton.language as tl


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
