"""Merging partial attention results: the (o, lse) state algebra and the split-KV combine kernel.

Notation:
  state      (o, lse) for one query row over some subset of the keys: o is the softmax-weighted average of the
             subset's values (already normalised) and lse = log2 sum_j exp2(s2_j), the log-sum-exp of its logits in
             log2 units (masking.py's s2). Attention over a union of disjoint key sets is a merge of their states,
             so the merge is associative and commutative and the order of splits does not matter.
  empty      a state over no visible key: o = 0 and lse = -inf. flash-attn reports such rows with lse = +inf (see
             fwd.py), so `merge_states` treats +inf as empty too: partial results written by any flashtile kernel
             can be merged as they are.
  R, BLOCK_R rows (batch x query token x head) and rows per combine program.
  D, BLOCK_D head dim and the columns per combine program (a power of two); columns past D are masked.

`merge_states` is the reusable piece (split-KV decode here, context-parallel attention elsewhere).
`_combine_kernel` folds num_splits states per row into one and writes out in the output dtype and lse in natural
log units with flash-attn's +inf for rows that saw no key. Its grid is (row blocks, column blocks): each program
merges its rows' lse in full and their o in its BLOCK_D columns (ops/decode.combine_into says why). It does not
compute attention.
"""

import triton
import triton.language as tl

from .masking import LN2, LOG2E


@triton.jit
def merge_states(o_a, lse_a, o_b, lse_b):
    """Merge two states over disjoint key sets. o_*: [R, D] fp32, lse_*: [R] fp32 in log2 units.

    Returns (o, lse) of the union; an empty input (lse = +-inf) carries weight 0 and two empties give an empty.
    """
    lse_a = tl.where(lse_a == float("inf"), float("-inf"), lse_a)
    lse_b = tl.where(lse_b == float("inf"), float("-inf"), lse_b)
    m = tl.maximum(lse_a, lse_b)
    # Any finite reference point is exact; 0 keeps exp2 away from (-inf) - (-inf) when both are empty.
    m = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.math.exp2(lse_a - m)
    w_b = tl.math.exp2(lse_b - m)
    w = w_a + w_b
    empty = w == 0.0
    w_safe = tl.where(empty, 1.0, w)
    o = o_a * (w_a / w_safe)[:, None] + o_b * (w_b / w_safe)[:, None]
    return o, tl.where(empty, float("-inf"), m + tl.math.log2(w_safe))


@triton.jit
def _combine_kernel(
    O_PARTIAL, LSE_PARTIAL, O, LSE,
    stride_ps, stride_pb, stride_pm, stride_ph,
    stride_qs, stride_qb, stride_qh, stride_qm,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh, stride_lm,
    num_splits, seqlen_q, nheads, n_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # Rows are (b, t, h) flattened with h fastest, so neighbouring rows of a contiguous partial buffer are
    # neighbours in memory too.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = r % nheads
    t = (r // nheads) % seqlen_q
    b = (r // nheads // seqlen_q).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = r < n_rows
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    o_rows = b * stride_pb + t * stride_pm + h * stride_ph
    lse_rows = b * stride_qb + h * stride_qh + t * stride_qm

    o = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    lse = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    # The merges form a chain but the loads do not: the launcher's num_stages pipelines them. Otherwise every split
    # costs a memory latency, and a decode step with few rows (one long sequence, 32 splits) would spend longer
    # here than reading its KV cache.
    for s in range(num_splits):
        o_s = tl.load(O_PARTIAL + s * stride_ps + o_rows[:, None] + d[None, :], mask=mask, other=0.0)
        lse_s = tl.load(LSE_PARTIAL + s * stride_qs + lse_rows, mask=row_ok, other=float("-inf"))
        o, lse = merge_states(o, lse, o_s.to(tl.float32), lse_s.to(tl.float32) * LOG2E)

    out_rows = b * stride_ob + t * stride_om + h * stride_oh
    tl.store(O + out_rows[:, None] + d[None, :], o.to(O.dtype.element_ty), mask=mask)
    lse = tl.where(lse == float("-inf"), float("inf"), lse * LN2)
    tl.store(LSE + b * stride_lb + h * stride_lh + t * stride_lm, lse, mask=row_ok & (tl.program_id(1) == 0))
