"""Merging partial attention results: the split-KV combine kernel and the (o, lse) state algebra it applies.

Notation:
  state      (o, lse) for one query row over some subset of the keys: o is the softmax-weighted average of the
             subset's values (already normalised) and lse = log2 sum_j exp2(s2_j), the log-sum-exp of its logits in
             log2 units (masking.py's s2). Attention over a union of disjoint key sets is a merge of their states,
             so the merge is associative and commutative and the order of splits does not matter.
  empty      a state over no visible key: o = 0 and lse = -inf. flash-attn reports such rows with lse = +inf (see
             fwd.py), so the combine treats +inf as empty too: partial results written by any flashtile kernel
             can be merged as they are.
  R, BLOCK_R rows (batch x query token x head) and rows per combine program.
  D, BLOCK_C head dim and the columns of it a combine program writes; columns past D are masked.

`_combine_kernel` folds num_splits states per row into one and writes out in the output dtype and lse in natural
log units with flash-attn's +inf for rows that saw no key. It does not compute attention.
"""

import triton
import triton.language as tl

from .masking import LN2, LOG2E


@triton.jit
def _split_lse(LSE_PARTIAL, lse_rows, row_ok, s0, num_splits, stride_qs, SPLITS: tl.constexpr):
    """(BLOCK_R, SPLITS) lse of splits s0 + [0, SPLITS) in log2 units, an empty part (+inf or -inf, or a split
    past num_splits) as -inf."""
    s = s0 + tl.arange(0, SPLITS)
    lse = tl.load(LSE_PARTIAL + s[None, :] * stride_qs + lse_rows[:, None],
                  mask=row_ok[:, None] & (s < num_splits)[None, :], other=float("-inf")) * LOG2E
    return tl.where(lse == float("inf"), float("-inf"), lse)


@triton.jit
def _combine_kernel(
    O_PARTIAL, LSE_PARTIAL, O, LSE,
    stride_ps, stride_pb, stride_pm, stride_ph,
    stride_qs, stride_qb, stride_qh, stride_qm,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh, stride_lm,
    num_splits, seqlen_q, nheads, n_rows,
    HEAD_DIM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, SPLITS: tl.constexpr,
):
    """Grid (row blocks, column blocks): BLOCK_R rows x BLOCK_C columns of out a program; the first column block
    also writes the rows' lse.

    Two passes over the splits, SPLITS of them a load: the rows' total lse = log2 sum_s exp2(lse_s) (an online
    max and sum over the lse alone), then out = sum_s exp2(lse_s - lse) o_s. Every load of the second pass is
    independent of the others, so a program keeps SPLITS x BLOCK_R x BLOCK_C of o in flight a load and the
    pipeliner several loads: merging state into state, split after split, made each split wait for the last,
    and the combine of an MLA decode step (32 splits of 16 rows x 512 channels) took 41% of the step."""
    # Rows are (b, t, h) flattened with h fastest, so neighbouring rows of a contiguous partial buffer are
    # neighbours in memory too.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = r % nheads
    t = (r // nheads) % seqlen_q
    b = (r // nheads // seqlen_q).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = r < n_rows
    o_rows = b * stride_pb + t * stride_pm + h * stride_ph
    lse_rows = b * stride_qb + h * stride_qh + t * stride_qm

    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    for s0 in range(0, num_splits, SPLITS):
        lse_s = _split_lse(LSE_PARTIAL, lse_rows, row_ok, s0, num_splits, stride_qs, SPLITS)
        m_new = tl.maximum(m, tl.max(lse_s, 1))
        # Any finite reference point is exact; 0 keeps exp2 away from (-inf) - (-inf) while every part is empty.
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.math.exp2(m - ref) + tl.sum(tl.math.exp2(lse_s - ref[:, None]), 1)
        m = m_new
    empty = total == 0.0  # no part saw a key: out 0, lse +inf (flash-attn's convention)
    lse = tl.where(empty, 0.0, tl.where(m == float("-inf"), 0.0, m) + tl.math.log2(tl.where(empty, 1.0, total)))

    mask = row_ok[None, :, None] & (c < HEAD_DIM)[None, None, :]
    o = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for s0 in range(0, num_splits, SPLITS):
        w = tl.math.exp2(_split_lse(LSE_PARTIAL, lse_rows, row_ok, s0, num_splits, stride_qs, SPLITS)
                         - lse[:, None])  # (R, S): 0 for an empty part
        s = s0 + tl.arange(0, SPLITS)
        o_s = tl.load(O_PARTIAL + s[:, None, None] * stride_ps + o_rows[None, :, None] + c[None, None, :],
                      mask=mask & (s < num_splits)[:, None, None], other=0.0)
        o += tl.sum(o_s.to(tl.float32) * tl.trans(w)[:, :, None], 0)

    out_rows = b * stride_ob + t * stride_om + h * stride_oh
    tl.store(O + out_rows[:, None] + c[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (c < HEAD_DIM)[None, :])
    if tl.program_id(1) == 0:
        tl.store(LSE + b * stride_lb + h * stride_lh + t * stride_lm, tl.where(empty, float("inf"), lse * LN2),
                 mask=row_ok)
