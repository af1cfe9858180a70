"""The split-KV combine kernel: partial attention results over disjoint key sets merged into one.

Notation:
  state      (o, lse) for one query row over some subset of the keys: o is the softmax-weighted average of the
             subset's values (already normalised) and lse = log sum_j exp(s_j), the log-sum-exp of its logits.
             Attention over a union of disjoint key sets is a merge of their states: weights exp(lse_s - lse) with
             lse = log sum_s exp(lse_s), so the merge is associative and commutative and the order of splits does
             not matter.
  empty      a state over no visible key: o = 0 and lse = -inf. flash-attn reports such rows with lse = +inf (see
             fwd.py), so +inf is read as empty too: partial results written by any flashtile kernel can be merged as
             they are.
  R, BLOCK_R rows (batch x query token x head) and rows per combine program.
  D, BLOCK_D head dim and the columns per combine program (a power of two); columns past D are masked.
  SPLITS     splits a program loads at once (Note [combine groups]).

`_combine_kernel` folds num_splits states per row into one and writes out in the output dtype and lse in natural
log units with flash-attn's +inf for rows that saw no key. Its grid is (row blocks, column blocks): each program
merges its rows' lse in full and their o in its BLOCK_D columns (ops/decode.combine_into says why). It does not
compute attention; context-parallel attention merges its steps' states in PyTorch (distributed.py).
"""

import triton
import triton.language as tl

from .masking import LOG2E
from .softmax import finalize


@triton.jit
def _group_lse(LSE_PARTIAL, s, num_splits, stride_qs, lse_rows, row_ok):
    """(rows, splits) lse of splits s in log2 units: -inf where a split is empty (either spelling: flash-attn's
    +inf, fwd.py) or past num_splits."""
    lse = tl.load(LSE_PARTIAL + s[None, :] * stride_qs + lse_rows[:, None],
                  mask=(s < num_splits)[None, :] & row_ok[:, None], other=float("-inf")).to(tl.float32) * LOG2E
    return tl.where(lse == float("inf"), float("-inf"), lse)


@triton.jit
def _combine_kernel(
    O_PARTIAL, LSE_PARTIAL, O, LSE,
    stride_ps, stride_pb, stride_pm, stride_ph,
    stride_qs, stride_qb, stride_qh, stride_qm,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh, stride_lm,
    num_splits, seqlen_q, nheads, n_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, SPLITS: tl.constexpr,
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

    # Note [combine groups]: a program takes its splits SPLITS at a time, one (rows, splits, columns) load of o, and
    # folds them into an unnormalised running sum acc = sum_s 2^(lse_s - m) o_s, l = sum_s 2^(lse_s - m) over a
    # running maximum m, rescaled once a group: one memory latency a group. The group's lse comes with the previous
    # group's loads, because ptxas places the o loads after the exp2 of the weights, which would otherwise wait
    # for an lse load first (two latencies a group, in the sm_90 SASS). Merging split after split through the
    # pipeliner kept num_stages - 1 splits in flight; this took the 16-head MLA combine at b16 x 4k from 8.1 to 4.3
    # µs, at b16 x 32k (33 splits) from 18.1 to 6.0 (docs/perf.md, lead 6). Laid out as (rows, splits, columns),
    # Triton puts the warps along the rows and a thread's splits in its own registers, so the sums over the splits
    # need no shared memory; a (splits, rows, columns) tile gets its warps along the splits.
    s_local = tl.arange(0, SPLITS)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_R], dtype=tl.float32)
    lse_next = _group_lse(LSE_PARTIAL, s_local, num_splits, stride_qs, lse_rows, row_ok)
    for s0 in range(0, num_splits, SPLITS):
        s = s0 + s_local
        o_s = tl.load(O_PARTIAL + s[None, :, None] * stride_ps + o_rows[:, None, None] + d[None, None, :],
                      mask=(s < num_splits)[None, :, None] & mask[:, None, :], other=0.0)
        lse_s = lse_next
        lse_next = _group_lse(LSE_PARTIAL, s + SPLITS, num_splits, stride_qs, lse_rows, row_ok)
        m_new = tl.maximum(m, tl.max(lse_s, axis=1))
        # Any finite reference point is exact; 0 keeps exp2 away from (-inf) - (-inf) while all are empty.
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - ref)
        w = tl.math.exp2(lse_s - ref[:, None])
        l = l * alpha + tl.sum(w, axis=1)
        acc = acc * alpha[:, None] + tl.sum(o_s.to(tl.float32) * w[:, :, None], axis=1)
        m = m_new

    o, lse = finalize(acc, l, m)
    out_rows = b * stride_ob + t * stride_om + h * stride_oh
    tl.store(O + out_rows[:, None] + d[None, :], o.to(O.dtype.element_ty), mask=mask)
    tl.store(LSE + b * stride_lb + h * stride_lh + t * stride_lm, lse, mask=row_ok & (tl.program_id(1) == 0))
