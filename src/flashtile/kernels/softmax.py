"""The online softmax: one key block's update of the running (max, sum) state, and the final normalisation.

State per query row, in log2 units (masking.py): m_i the running max of the logits seen so far, l_i the sum of
exp2(logit - m_i), acc the matching un-normalised output. Shared by the prefill forward and split-KV decode; the
backward recomputes probabilities from the saved log-sum-exp instead and needs neither.
"""

import triton
import triton.language as tl

from .masking import LN2


@triton.jit
def online_softmax_step(s, scale, m_i, l_i, MASKED: tl.constexpr):
    """Fold one block of scores s (rows x keys) into (m_i, l_i). The logits are s * scale (scale is 1 when s
    already holds logits; otherwise the multiply fuses into the exponent's FMA).

    Returns (p, alpha, l_i, m_new): the block's unnormalised probabilities, the factor by which the old acc must be
    rescaled, and the new state. The caller does acc = acc * alpha + p @ v.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
    if MASKED:
        # Note [fully masked rows]: a row that has seen only masked keys has max -inf, and exp2(-inf - -inf) would
        # be NaN. Any finite reference max is exact (it cancels in the final division), so use 0.
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s * scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def keys_major_step(s, m_i, l_keys, MASKED: tl.constexpr):
    """online_softmax_step for a keys x rows block of logits s (kernels/decode.py: KEYS_M), whose denominator is
    kept per key slot: l_keys (keys x rows) sums the probabilities each slot has seen, rescaled with its row, and
    the caller sums its keys once, at the end. So a block reduces across its keys, which span the warps (a
    round trip through shared memory and a barrier), for the max alone."""
    m_new = tl.maximum(m_i, tl.max(s, 0))
    if MASKED:  # Note [fully masked rows]
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_new[None, :])
    alpha = tl.math.exp2(m_i - m_new)
    return p, alpha, l_keys * alpha[None, :] + p, m_new


@triton.jit
def fold_sink(acc, l_i, m_i, sink2):
    """The state (acc, l_i, m_i) with one more logit per row, sink2 (log2 units; -inf for none), that has no value:
    it joins the denominator only. That is a learnable attention sink (gpt-oss; FlashAttention-4's learnable_sink):
    o_i = sum_j exp(s_ij) v_j / (sum_j exp(s_ij) + exp(sink)), and the LSE includes it. A row that saw no key
    then has out 0 and lse = sink; with no sink either it stays empty (finalize's +inf)."""
    alpha, l_i, m_i = sink_state(l_i, m_i, sink2)
    return acc * alpha[:, None], l_i, m_i


@triton.jit
def sink_state(l_i, m_i, sink2):
    """fold_sink's (alpha, l_i, m_i): the row state with the sink joined, and the factor that rescales the rows'
    accumulator to the new max (the Gluon forward applies it in its accumulator's own layout)."""
    m_new = tl.maximum(m_i, sink2)
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # as Note [fully masked rows]
    alpha = tl.math.exp2(m_i - m_new)
    return alpha, l_i * alpha + tl.math.exp2(sink2 - m_new), m_new


@triton.jit
def finalize(acc, l_i, m_i):
    """(out, lse): acc normalised, and the natural-log log-sum-exp. Rows that saw no key (l_i == 0) give out 0
    and lse +inf, flash-attn's convention, which makes the backward's recomputed exp(s - lse) exactly 0 and
    which the combine kernel reads as an empty state."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    return acc / l_safe[:, None], tl.where(empty, float("inf"), (m_i + tl.math.log2(l_safe)) * LN2)
