"""Which (query, key) pairs are visible, and how a raw score becomes a logit: the one place masks live.

Notation used by every kernel in this package:
  i, j        query row and key column inside one sequence (0-based).
  diag        seqlen_k - seqlen_q. Causal and sliding-window masks are aligned bottom-right, so query i sits on
              key column i + diag.
  wl, wr      window_left / window_right as runtime scalars; key j is visible to query i iff
              i + diag - wl <= j <= i + diag + wr. Causal is the window (wl = inf, wr = 0), so the kernels know
              only two constexpr flags: MASK_LEFT (wl is bounded) and MASK_RIGHT (wr is bounded).
  chunk       chunked attention (Llama 4; FlashAttention-3's attention_chunk), flag MASK_CHUNK: the key axis is cut
              into chunks of `chunk` keys, and query i sees only keys of the chunk its position i + diag falls in:
              c(i) <= j < c(i) + chunk with c(i) = floor((i + diag) / chunk) * chunk, besides the window's bounds.
  s2          a logit in log2 units: softmax(s) == exp2(s2 - max) / sum, with s2 = logit * log2(e). Working in
              log2 units lets every exponential be an exp2 and folds the scale into one multiply.

Block ranges. A kernel that walks key blocks for a tile of query rows [m, m + BLOCK_M) (forward, dQ) asks
`kv_block_range` for four boundaries lo <= full_lo <= full_hi <= hi. Blocks in [full_lo, full_hi) need no mask at
all; blocks in [lo, full_lo) and [full_hi, hi) need `apply_mask`. A kernel that walks query blocks for one key
block (dK/dV) asks `q_block_range` for the transposed picture. Keeping the unmasked blocks mask-free is what
makes the causal and sliding-window kernels as fast as the dense one on their interior.

This file does not load or store anything; kernels own their memory traffic.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def chunk_start(x, chunk):
    """floor(x / chunk) * chunk for either sign of x (integer division truncates toward zero)."""
    return tl.where(x >= 0, x // chunk, -((chunk - 1 - x) // chunk)) * chunk


@triton.jit
def kv_block_range(m_start, seqlen_q, seqlen_k, wl, wr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, chunk=0, MASK_CHUNK: tl.constexpr = False,
                   origin=0):
    """Key blocks for query rows [m_start, m_start + BLOCK_M): returns (lo, full_lo, full_hi, hi).

    Blocks in [full_lo, full_hi) are fully visible to every row of the tile and lie inside seqlen_k; the rest of
    [lo, hi) needs `apply_mask`. All four are multiples of BLOCK_N except hi, which may be seqlen_k. `origin`: where
    key 0 sits in the coordinates of the range (decode's physical cache rows put it at the left padding), which
    chunk boundaries count from.
    """
    diag = seqlen_k - seqlen_q
    m_last = m_start + BLOCK_M - 1
    hi = seqlen_k
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    if MASK_RIGHT:
        # The last row of the tile sees furthest right; the first row bounds the mask-free region.
        hi = tl.minimum(hi, tl.maximum(m_last + diag + wr + 1, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(m_start + diag + wr + 1, 0) // BLOCK_N) * BLOCK_N)
    lo = 0
    full_lo = 0
    if MASK_LEFT:
        lo = (tl.maximum(m_start + diag - wl, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(m_last + diag - wl, 0), BLOCK_N) * BLOCK_N
    if MASK_CHUNK:
        # The first row's chunk starts first and ends first: keys from its start to the last row's end are
        # needed, and only keys in both the first row's chunk and the last row's are seen by every row.
        c_first = origin + chunk_start(m_start + diag - origin, chunk)
        c_last = origin + chunk_start(m_last + diag - origin, chunk)
        hi = tl.minimum(hi, tl.maximum(c_last + chunk, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(c_first + chunk, 0) // BLOCK_N) * BLOCK_N)
        lo = tl.maximum(lo, (tl.maximum(c_first, 0) // BLOCK_N) * BLOCK_N)
        full_lo = tl.maximum(full_lo, tl.cdiv(tl.maximum(c_last, 0), BLOCK_N) * BLOCK_N)
    lo = tl.minimum(lo, hi)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def q_block_range(n_start, seqlen_q, seqlen_k, wl, wr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, chunk=0, MASK_CHUNK: tl.constexpr = False):
    """Query blocks that see key columns [n_start, n_start + BLOCK_N): returns (lo, full_lo, full_hi, hi).

    Query blocks in [full_lo, full_hi) see every key of the block; the others need `apply_mask`. Query rows past
    seqlen_q need no mask: the dK/dV kernel gives them lse = +inf, so their probabilities are exactly 0.
    """
    diag = seqlen_k - seqlen_q
    n_last = n_start + BLOCK_N - 1
    lo = 0
    full_lo = 0
    if MASK_RIGHT:
        # Query i sees key j only if i >= j - diag - wr.
        lo = (tl.maximum(n_start - diag - wr, 0) // BLOCK_M) * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(n_last - diag - wr, 0), BLOCK_M) * BLOCK_M
    hi = seqlen_q
    full_hi = tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    if MASK_LEFT:
        # Query i sees key j only if i <= j - diag + wl.
        hi = tl.minimum(hi, tl.maximum(n_last - diag + wl + 1, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(n_start - diag + wl + 1, 0) // BLOCK_M) * BLOCK_M)
    if MASK_CHUNK:
        # Query i sees key j only if i + diag lies in j's chunk: [c(j), c(j) + chunk).
        c_first = chunk_start(n_start, chunk)
        c_last = chunk_start(n_last, chunk)
        lo = tl.maximum(lo, (tl.maximum(c_first - diag, 0) // BLOCK_M) * BLOCK_M)
        full_lo = tl.maximum(full_lo, tl.cdiv(tl.maximum(c_last - diag, 0), BLOCK_M) * BLOCK_M)
        hi = tl.minimum(hi, tl.maximum(c_last + chunk - diag, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(c_first + chunk - diag, 0) // BLOCK_M) * BLOCK_M)
    lo = tl.minimum(lo, hi)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def apply_mask(s2, i, j, seqlen_k, diag, wl, wr,
               MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, MASK_SEQLEN_K: tl.constexpr, chunk=0,
               MASK_CHUNK: tl.constexpr = False):
    """Set invisible entries of the logit tile s2 to -inf. i and j broadcast against s2 (either orientation)."""
    visible = j >= 0
    if MASK_SEQLEN_K:
        visible = visible & (j < seqlen_k)
    if MASK_RIGHT:
        visible = visible & (j <= i + diag + wr)
    if MASK_LEFT:
        visible = visible & (j >= i + diag - wl)
    if MASK_CHUNK:
        c = chunk_start(i + diag, chunk)
        visible = visible & (j >= c) & (j < c + chunk)
    return tl.where(visible, s2, float("-inf"))


@triton.jit
def tanh(x):
    # Triton has no portable tanh (libdevice is unavailable in the interpreter). 1 - 2/(e^2x + 1) saturates
    # cleanly to +-1 for large |x| and is exact to fp32 rounding in absolute terms, which is what softcap needs.
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def logits(s, i, j, diag, qk_scale, softcap2, slope2,
           HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Raw scores q.k -> (logits in log2 units, t). With softcap t = tanh(.) for the backward; else t is the
    logits again (unused, and removed by the compiler: a jit function cannot return None in a tuple).

    Without softcap qk_scale = softmax_scale * log2(e). With softcap qk_scale = softmax_scale / softcap and
    softcap2 = softcap * log2(e), so logit = softcap * tanh(score * softmax_scale / softcap).
    ALiBi adds -slope * |i + diag - j| (slope2 = slope * log2(e)).
    """
    if HAS_SOFTCAP:
        t = tanh(s * qk_scale)
        s2 = t * softcap2
    else:
        s2 = s * qk_scale
        t = s2
    if HAS_ALIBI:
        s2 = s2 - slope2 * tl.abs(i + diag - j).to(tl.float32)
    return s2, t
