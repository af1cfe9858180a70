"""Attention dropout: which probabilities of a tile survive, drawn from a counter-based RNG, so that the backward
regenerates the forward's mask from the call's seed and each entry's position, with no mask stored.

Note [dropout mask]: entry (i, j) of (sequence b, query head h) survives iff an 8-bit random number u(b, h, i, j) is
at least threshold = round(p * 256) (halves up): it is dropped with probability exactly threshold / 256, within 2^-9
of p (p = 0.1 drops 26 / 256 = 10.16%; p < 2^-9 drops nothing, p >= 1 - 2^-9 everything). flash-attn 2 quantises to
8 bits too, but floors: it keeps iff u <= floor((1 - p) * 255), so it drops ceil(255 * p) / 256, between p / 256
below p and 2^-8 above it; rounding halves that bound. Survivors are scaled by 1 / (1 - p) of the unquantised p
(flash-attn 2's semantics; the LSE is that of the softmax before dropout), so the output's expectation is
(1 - threshold / 256) / (1 - p) times the undropped one: biased by the quantisation, as flash-attn 2's is. u comes
from Philox4x32 with 7 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011: the fewest
rounds that pass BigCrush, with the round keys of Random123) keyed by the call's 64-bit seed, whose counter is
(c, i, b * H + h, stream): call c gives 4 x 32 bits, sixteen 8-bit numbers, for the sixteen keys
j = 64 * (c // 4) + 8 * g + 2 * (c % 4) + e of query i (g in [0, 8), e in [0, 2)), key (g, e) taking byte 2 * g + e
of the call's words read little-endian in order: word g // 2, bits 8 * (2 * (g % 2) + e) up. The four calls
4 * t + [0, 4) thus cover the 64-key unit t. So the mask depends on (seed, stream, b, h, i, j) alone, never on a
kernel's tile shape or its orientation (keys x queries, or queries x keys): the forward,
both backward kernels and the testing kernel below regenerate the same bits. i and j count from the start of their
sequence (varlen too). Tiles start at multiples of 64 keys, or of their width when narrower (config.py's d512 and
fp32 rows have 32- and 16-key tiles, the interpreter 16 and 32): a narrow tile draws its whole unit and keeps its
part, so a 32-key tile makes as many calls per key as the 16-bit numbers of the previous design did.

Why those sixteen keys: they are the columns 8 * g + 2 * q + [0, 2) of one row, over eight consecutive 8-column
groups, that a thread holds in the accumulator of an MMA (mma.sync and wgmma alike, q = lane % 4), so the forward
and dQ kernels build their mask in the registers where P sits: their sm_90 PTX has exactly as many shared-memory
accesses and barriers as without dropout. Eight consecutive keys per call (the first design) spread a call over
four threads and cost a round trip through shared memory per tile, which made the mask slower than the Q Kᵀ
product it masks (docs/perf.md). Why 8 bits: with 16-bit numbers, eight a call, Philox's integer work alone was
about as large as the Q Kᵀ product's (tools/mask_bench.py), and dropout about doubled the time of a forward and
backward on an H200; sixteen a call halve it. The dK/dV kernel, whose tile is otherwise keys x queries (two keys
of a query per thread), computes it queries x keys with dropout, so that it too draws the mask where P sits and
transposes P ∘ Z and dS into its products instead: transposing the mask cost more (kernels/bwd.py).

Note [dropout entries]: `keep_words` gives the same bits entry by entry, for tiles in a layout that keep_mask's
joins and reshapes would change (the wgmma accumulators of the Gluon forward and dQ kernels), and packed: each entry
gets its call's word, tested four bytes at once (Note [packed keep bits]), and which byte is its own. Each entry
derives its call c, word and byte from its key alone and runs the whole Philox call; the compiler finds the sixteen
entries of one call in a thread (their counters are the same values: the key's offset within its 8-key group comes
from the lane, the group from the register) and keeps one call, as the sm_90 builds show (one call per 16 entries,
as keep_mask), and one test per word. The key is split as n0 + jl, the tile's first key, a multiple of 64, and the
key within the tile, so that what selects the word and the byte depends on jl alone, which the compiler can see
per register; a tile narrower than 64 keys (the d512 forward's 32) may start inside a unit, and then selects them at
run time. The kernels, Gluon and Triton, then clear dropped entries with one PRMT and one LOP3 per pair of 16-bit
values or per fp32 value (`cleared`, `drop`), where testing each byte and selecting or multiplying took about three
ALU instructions an entry (docs/perf.md, lead 4), and where keep_mask's joins and reshapes, in a Triton kernel's
MMA layout, cost about as much again as Philox (the d64 forward's loop: 297 instructions a warp a block at p = 0,
479 with keep_mask).

Note [packed keep bits]: a byte x survives a threshold t in [0, 256] iff x >= t, and a 32-bit word's four bytes are
tested at once without a carry between them. With t <= 128: x >= t iff x's top bit is set or its low seven bits
reach t, and the top bit of each byte of d = (x | 0x80808080) - 0x01010101 t is whether they do (each byte of
x | 0x80808080 is at least 128 >= t: no borrow). With t > 128: x >= t iff the top bit is set and the low seven bits
reach t - 128, d's test with t - 128. So with c = 0x80808080 below 129 and 0 above, the top bit of each byte of
maj(x, c, d) = (x & c) | (x & d) | (c & d), one LOP3, is the byte's keep bit: x | d where c's bits are set, x & d
where they are clear. Two instructions and a LOP3 a word, four entries; the other bits are not meaningful.

`dropout_probs_kernel` writes S_dmask for `return_attn_probs=True` (testing only, one slow pass): the
probabilities exp(s - lse) of every visible entry, negated where dropped; see ops/dropout.py for the layout.
"""

import triton
import triton.language as tl

from .masking import LOG2E, apply_mask, logits
from .seqlen import seq_info

PHILOX_ROUNDS = tl.constexpr(7)
# Under TRITON_INTERPRET (set before this module is imported) kernels run through numpy, which has no PTX.
INTERPRETING = tl.constexpr(triton.knobs.runtime.interpret)
TINY = tl.constexpr(1.1754943508222875e-38)  # the least normal fp32: a dropped zero probability is -TINY


@triton.jit
def _wide_product(x, ROUND_A: tl.constexpr):
    """(low, high) words of the 64-bit product of uint32 x and Philox4x32's round multiplier A (ROUND_A) or B."""
    if INTERPRETING:
        m = 0xD2511F53 if ROUND_A else 0xCD9E8D57
        return tl.mul(x, m, sanitize_overflow=False), tl.math.umulhi(x, m)
    elif ROUND_A:
        return tl.inline_asm_elementwise("{ .reg .b64 w; mul.wide.u32 w, $2, 0xD2511F53; mov.b64 {$0, $1}, w; }",
                                         "=r,=r,r", [x], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("{ .reg .b64 w; mul.wide.u32 w, $2, 0xCD9E8D57; mov.b64 {$0, $1}, w; }",
                                         "=r,=r,r", [x], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)


@triton.jit
def philox(seed, c0, c1, c2, c3):
    """tl.philox(seed, c0, c1, c2, c3, PHILOX_ROUNDS), bit for bit (uint32 words; 32-bit counters), with each of a
    round's two products one PTX mul.wide, one IMAD.WIDE.U32 on sm_90: tl.philox computes the high and the low word
    by umulhi and a multiplication, which ptxas leaves two IMADs (the Gluon d128 forward's key loop: 925 -> 884
    instructions a warp a block, IMAD 118 -> 78; docs/perf.md, lead 4). The round keys derive from the seed alone:
    uniform registers, off the vector pipes."""
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = c0.to(tl.uint32, bitcast=True)
    c1 = c1.to(tl.uint32, bitcast=True)
    c2 = c2.to(tl.uint32, bitcast=True)
    c3 = c3.to(tl.uint32, bitcast=True)
    for _ in tl.static_range(PHILOX_ROUNDS):
        low_a, high_a = _wide_product(c0, True)
        low_b, high_b = _wide_product(c2, False)
        c0 = high_b ^ c1 ^ k0
        c2 = high_a ^ c3 ^ k1
        c1 = low_b
        c3 = low_a
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def dropout_state(RNG, dropout_p):
    """(seed, stream, threshold, scale) of a call: the two int64 its op drew from PyTorch's generator
    (ops/dropout.py), the 8-bit threshold a surviving entry's number reaches, and 1 / (1 - p)."""
    seed = tl.load(RNG)
    stream = tl.load(RNG + 1).to(tl.int32)
    threshold = tl.cast(dropout_p * 256.0 + 0.5, tl.int32)
    return seed, stream, threshold, 1.0 / (1.0 - dropout_p)


@triton.jit
def _unit_numbers(seed, stream, bh, i, unit, BLOCK_M: tl.constexpr, UNITS: tl.constexpr):
    """(BLOCK_M, UNITS * 64) 8-bit numbers of the key units unit + [0, UNITS) (Note [dropout mask])."""
    zero = tl.zeros([BLOCK_M, UNITS, 4], dtype=tl.int32)
    calls = 4 * (unit + tl.arange(0, UNITS))[:, None] + tl.arange(0, 4)[None, :]
    r0, r1, r2, r3 = philox(seed, calls[None, :, :] + zero, i[:, :, None] + zero, bh + zero, stream + zero)
    words = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # (M, U, 4 q, 2 b, 2 a): word 2a + b, g = 4a + 2b + s
    # Byte 2s + e of a word (s: which of its two groups, e: which key of the pair); the mask keeps 8 bits whether
    # Philox's words come out signed or not.
    halves = tl.join(words, words >> 16)  # (M, U, q, b, a, s)
    numbers = tl.join(halves & 0xFF, (halves >> 8) & 0xFF)  # (M, U, q, b, a, s, e)
    # Key 64u + 8g + 2q + e = 64u + 32a + 16b + 8s + 2q + e.
    return tl.reshape(tl.permute(numbers, [0, 1, 4, 3, 5, 2, 6]), [BLOCK_M, UNITS * 64])


@triton.jit
def keep_mask(seed, stream, bh, i, n_start, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(BLOCK_M, BLOCK_N) booleans: entry (i[r], n_start + c) survives (Note [dropout mask]). i: (BLOCK_M, 1) query
    rows within the sequence; n_start: a multiple of min(BLOCK_N, 64), the tile's first key within the sequence;
    bh: b * H + h."""
    if BLOCK_N >= 64:
        tl.static_assert(BLOCK_N % 64 == 0, "dropout draws keys in units of 64")
        u = _unit_numbers(seed, stream, bh, i, n_start // 64, BLOCK_M, BLOCK_N // 64)
    else:
        # A narrow tile's keys are one part of a unit: draw the unit, keep that part.
        unit = tl.reshape(_unit_numbers(seed, stream, bh, i, n_start // 64, BLOCK_M, 1),
                          [BLOCK_M, 64 // BLOCK_N, BLOCK_N])
        part = (tl.arange(0, 64 // BLOCK_N) == (n_start % 64) // BLOCK_N)[None, :, None]
        u = tl.sum(tl.where(part, unit, 0), axis=1)
    return u.to(tl.int32) >= threshold


@triton.jit
def packed_threshold(threshold):
    """(c, t) of Note [packed keep bits] for an 8-bit threshold in [0, 256]: uint32 constants of the test."""
    high = threshold > 128
    c = tl.where(high, 0, 0x80808080).to(tl.uint32)
    t = tl.where(high, threshold - 128, threshold).to(tl.uint32) * 0x01010101
    return c, t


@triton.jit
def keep_words(seed, stream, bh, i, n0, jl, c, t, BLOCK_N: tl.constexpr):
    """keep_mask's bits, entry by entry (Note [dropout entries]): for i (query rows within the sequence) and jl
    (keys within the tile, from 0) of broadcastable shapes in any layout, (word, byte): entry (i, n0 + jl) survives
    iff bit 8 * byte + 7 of the uint32 word is set. n0: the tile's first key within the sequence, a multiple of
    min(BLOCK_N, 64), the tile's width; bh: b * H + h; (c, t): packed_threshold's."""
    if BLOCK_N < 64:  # a narrow tile starts inside a 64-key unit: which word and byte is then known at run time
        jl = jl + n0 % 64
        n0 = n0 - n0 % 64
    zero = (i + jl) * 0
    calls = 4 * (n0 // 64 + jl // 64) + (jl % 8) // 2
    r0, r1, r2, r3 = philox(seed, calls + zero, i + zero, bh + zero, stream + zero)
    group = (jl % 64) // 8  # key 64u + 8g + 2q + e: word g // 2, byte 2 * (g % 2) + e
    x = tl.where(group < 4, tl.where(group < 2, r0, r1), tl.where(group < 6, r2, r3))
    return packed_keep(x.to(tl.uint32), c, t), 2 * (group % 2) + jl % 2 + zero


@triton.jit
def packed_keep(x, c, t):
    """The keep bits of uint32 x's four bytes (Note [packed keep bits]): bit 8 * k + 7 is set iff byte k reaches
    the threshold of packed_threshold's (c, t)."""
    d = (x | 0x80808080) - t
    return (x & c) | (x & d) | (c & d)


@triton.jit
def cleared(x, word, byte):
    """x with its dropped entries set to 0: entry e survives iff bit 8 * byte[e] + 7 of word[e] is set (keep_words).
    A 16-bit tile two entries at a time, as its values are packed: one PRMT replicates each entry's keep bit over
    its half of a 32-bit mask (PTX prmt's sign-replicating selector nibbles, 8 + byte: the first entry's from the
    first word, the second's, 12 + byte, from the second), one AND clears the pair; a 32-bit tile one PRMT and one
    AND an entry. The selectors are known per register at compile time, and ptxas folds their arithmetic into the
    PRMT's immediate (Note [dropout entries]). A select on a keep predicate cost about three ALU instructions an
    entry: LLVM moves a select ahead of a conversion to 16 bits past it, splitting each packed pair
    (docs/design/backward.md)."""
    if INTERPRETING:
        keep = ((word >> (8 * byte + 7).to(tl.uint32)) & 1) != 0
        return tl.where(keep, x, tl.zeros_like(x))
    elif x.dtype.primitive_bitwidth == 16:
        sel = (8 + byte) * 0x11 + (12 + byte) * 0x1100
        return tl.inline_asm_elementwise(
            "{ .reg .b32 s, m; and.b32 s, $4, 0xFF; and.b32 m, $5, 0xFF00; or.b32 s, s, m; "
            "prmt.b32 m, $2, $3, s; and.b32 $0, $1, m; }",
            "=r,r,r,r,r,r", [x, word, sel], dtype=x.dtype, is_pure=True, pack=2)
    else:
        tl.static_assert(x.dtype.primitive_bitwidth == 32, "dropout clears 16- and 32-bit tiles")
        return tl.inline_asm_elementwise(
            "{ .reg .b32 m; prmt.b32 m, $2, 0, $3; and.b32 $0, $1, m; }",
            "=r,r,r,r", [x, word, (8 + byte) * 0x1111], dtype=x.dtype, is_pure=True, pack=1)


@triton.jit
def drop(x, seed, stream, bh, i, n0, jl, threshold, BLOCK_N: tl.constexpr):
    """x, a tile of P or dP at query rows i and keys n0 + jl (keep_words' arguments), with the entries that dropout
    drops set to 0 (and no 1 / (1 - p): the kernels fold it into the row's LSE and delta, or into the output)."""
    c, t = packed_threshold(threshold)
    word, byte = keep_words(seed, stream, bh, i, n0, jl, c, t, BLOCK_N)
    return cleared(x, word, byte)


@triton.jit
def dropout_probs_kernel(
    Q, K, LSE, S, ALIBI, RNG, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_Q, SEQUSED_K,
    qk_scale, softcap2, dropout_p,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_lb, stride_lh, stride_sb, stride_sh, stride_sm, stride_ab,
    seqlen_q: tl.int32, seqlen_k: tl.int32, nheads: tl.int32, group: tl.int32, wl: tl.int32, wr: tl.int32,
    chunk: tl.int32,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_Q: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, MASK_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
):
    """S[b, h, i, j] = P[i, j] if entry (i, j) survives dropout, else -max(P[i, j], TINY); 0 outside the
    sequence's seqlen_q x seqlen_k. Grid (query tiles, key tiles, B * H) over S's rounded shape."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // nheads
    h = bh % nheads
    hk = h // group
    q_start, seqlen_q = seq_info(b, seqlen_q, CU_SEQLENS_Q, SEQUSED_Q, IS_VARLEN, HAS_SEQUSED_Q)
    k_start, seqlen_k = seq_info(b, seqlen_k, CU_SEQLENS_K, SEQUSED_K, IS_VARLEN, HAS_SEQUSED_K)
    b64 = b.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b64 * stride_qb + (q_start + rows.to(tl.int64))[:, None] * stride_qm
                + h.to(tl.int64) * stride_qh + d[None, :], mask=(rows < seqlen_q)[:, None] & (d < HEAD_DIM)[None, :],
                other=0.0)
    k = tl.load(K + b64 * stride_kb + (k_start + cols.to(tl.int64))[:, None] * stride_kn
                + hk.to(tl.int64) * stride_kh + d[None, :], mask=(cols < seqlen_k)[:, None] & (d < HEAD_DIM)[None, :],
                other=0.0)
    qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    i = rows[:, None]
    j = cols[None, :]
    diag = seqlen_k - seqlen_q
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + b * stride_ab + h) * LOG2E
    s2, _ = logits(qk, i, j, diag, qk_scale, softcap2, slope2, HAS_SOFTCAP, HAS_ALIBI)
    s2 = apply_mask(s2, i, j, seqlen_k, diag, wl, wr, MASK_LEFT, MASK_RIGHT, True, chunk, MASK_CHUNK)
    lse2 = tl.load(LSE + b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start + rows, mask=rows < seqlen_q,
                   other=float("inf")) * LOG2E
    p = tl.math.exp2(s2 - lse2[:, None])
    seed, stream, threshold, _ = dropout_state(RNG, dropout_p)
    keep = keep_mask(seed, stream, b * nheads + h, i, pid_n * BLOCK_N, threshold, BLOCK_M, BLOCK_N)
    value = tl.where(keep, p, -tl.maximum(p, TINY))
    value = tl.where((i < seqlen_q) & (j < seqlen_k), value, 0.0)
    tl.store(S + b64 * stride_sb + h.to(tl.int64) * stride_sh + rows.to(tl.int64)[:, None] * stride_sm + j, value)
