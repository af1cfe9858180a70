"""Backward by recomputation: P is rebuilt from the saved log-sum-exp, never stored.

Two kernels, each its own parallelisation, launched in this order:
  _bwd_dq_kernel          one program per (query tile, query head, seq), walking key tiles like the forward. It
                          first computes delta = rowsum(dO * O) (fp32) for its rows and stores it for the dK/dV
                          kernel: no separate pass over O and dO, no extra launch. dQ is recomputed here rather
                          than accumulated with atomics from the dK/dV kernel: two extra matmuls per tile pair,
                          but deterministic and free of an fp32 dQ buffer.
  _bwd_dkdv_kernel        one program per (key tile, KV head, seq). It holds K, V and the dK, dV accumulators on
                          chip and walks the query tiles of every query head in its GQA group, so dK/dV are summed
                          over the group in registers: no atomics on gradients, bitwise deterministic. It reads
                          delta as the dQ kernel stored it (Note [delta handoff]).

Note [delta handoff]: both grids end in a part-filled wave (at B*S = 16k tokens and 16 heads, 2048 dQ programs one
per SM and 4096 dK/dV programs two per SM are 15.5 waves on 132 SMs), and the dK/dV grid would wait for the dQ
grid's last programs with SMs idle. So on sm_90 the dK/dV kernel is launched with programmatic dependent launch:
its programs may start once every dQ program has started (each dQ program allows it first thing), and take the SMs
the dQ grid's last wave leaves free. What dK/dV needs from dQ is delta. Each dQ program publishes its rows when it
ends: a CTA barrier (every thread's delta stores are done), then one thread's release add of the row count to a
per-(sequence, head) counter (PUBLISH; not when the Gluon dK/dV kernel runs, which reads no counters: the release
waits for the program's stores, ~1 µs per program). A dK/dV program spins on an acquire load until its head's
counter reaches the sequence's query length, then reads delta. The dK/dV programs that start early are the first
in launch order, whose (sequence, head)'s dQ programs ran in the first waves. No deadlock: the programs waited on
have all started, so they run to completion.
Before exiting, each dK/dV program (one with no keys too) waits for the whole dQ grid (griddepcontrol.wait), so
the kernel ends after dQ is written and work queued behind it sees both. Without PDL (the interpreter,
FLASHTILE_PDL=0, GPUs before sm_90) the kernels run one after the other and the counters are complete before dK/dV
reads them; the CPU tests run the same spin, so a count that falls short hangs a test there (pytest-timeout fails
it), not first a GPU. The counters count rows, not programs, so they hold whatever tile the dQ kernel was
autotuned to. Calls captured into a CUDA graph launch without PDL (ops/bwd.py): that combination has not been run
on our GPU.
Publishing before the dQ main loop instead (as early as delta is known) made the causal d64 dQ kernel fault on the
H200 at its (64, 64, 4, 2) tile ("unspecified launch failure" inside the pipelined key loop; the same code without
the barrier and add ran).

Math per (query tile, key tile), logits in log2 units (masking.py), lse2 = lse * log2(e):
  P = exp2(s2 - lse2);  dV += P^T dO;  dP = dO V^T;  dS = P * (dP - delta) [* (1 - tanh^2) with softcap]
  dK += dS^T Q;  dQ += dS K;  finally dK and dQ are scaled by softmax_scale.
Rows past seqlen_q are neutralised by loading lse = +inf for them (P = 0); keys past seqlen_k are zero rows
(descriptor zero-fill) and are masked where they could reach a stored value. Varlen dK/dV and dQ grids are tile
lists like the forward's (Notes [varlen tile list] and [longest sequences first] in seqlen.py); delta is written
only for the rows each sequence uses, which are the only rows dK/dV reads. Offsets that can pass 2^31 elements
are int64, as in the forward. HAS_DROPOUT regenerates the forward's mask (Note [dropout mask] in dropout.py).
Does not do paged K/V. V, O, dO and dV have head dim HEAD_DIM_V (tiles BLOCK_DV wide), which may differ from Q's
and K's (MLA prefill); delta sums over it.

Memory: each kernel holds two tiles for its whole loop (K and V in dK/dV, Q and dO in dQ; dQ reads O once more
for delta) and streams two others.
Held tiles are read once with pointer loads (seqlen.load_once) and the results written with pointer stores. The dQ
kernel streams K and V through host descriptors where the forward does (DESC: ops/fwd.py, Note [host
descriptors]; a packed box that crosses the sequence's end reads the next sequence's rows, which the masked blocks
zero). A device descriptor costs a global write and two proxy fences before the first load, and at the dQ tile's
~1.2 µs per key block that fixed cost weighed: on the H200 the host descriptors made dQ 6-7% faster on the
16-sequence mix and 9-12% at S=1k, even at 4k (docs/design/descriptors.md). The
dK/dV kernel builds its Q and dO descriptors per (sequence, head) on the device (with host descriptors they were no
faster and crashed ptxas at d128).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .dropout import drop, dropout_state
from .masking import LOG2E, apply_mask, kv_block_range, logits, q_block_range
from .seqlen import DESC_PACKED, DESC_ROW, load_once, load_rows, row_desc, seq_info, store_once, tile_coords


@triton.jit
def _wait_delta(ready, rows):
    """Spin until the dQ programs have published `rows` delta rows through the counter `ready` (Note [delta
    handoff]); the acquire makes their stores visible to this program's later loads."""
    done = tl.atomic_add(ready, 0, sem="acquire", scope="gpu")
    while done < rows:
        done = tl.atomic_add(ready, 0, sem="acquire", scope="gpu")


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_desc, do_desc, LSE_H, DELTA_H, j, lo, hi,
                    seqlen_q, seqlen_k, diag, wl, wr, chunk, qk_scale, softcap2, slope2,
                    seed, stream, bh, threshold, drop_scale, n_start,
                    BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, MASK_CHUNK: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # The tile is computed transposed, (keys x queries), so dK and dV accumulate without transposing them; with
    # dropout it is not (below).
    offs_m = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        q = q_desc.load([start_m, 0])
        do = do_desc.load([start_m, 0])
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        rows = start_m + offs_m
        lse2 = tl.load(LSE_H + rows, mask=rows < seqlen_q, other=float("inf")) * LOG2E
        delta = tl.load(DELTA_H + rows, mask=rows < seqlen_q, other=0.0)
        if HAS_DROPOUT:
            # O = (P ∘ Z) V with Z = mask / (1 - p): dV takes P ∘ Z, and dS = P ∘ (Z ∘ dP - delta) with
            # delta = rowsum(dO ∘ O) unchanged. With P' = P / (1 - p) (the scale moved into the row's LSE, as the
            # Gluon dQ kernel does), P ∘ Z is P' with its dropped entries cleared and dS = (P ∘ Z) ∘ dP -
            # P' ∘ delta (1 - p): the mask costs one clear (dropout.drop). The tile is computed as the forward
            # holds it, queries x keys, so that the mask is drawn in the registers where P sits (Note [dropout
            # mask] in dropout.py); P ∘ Z and dS are transposed on their way into the dV and dK products instead,
            # where the transposed tile below would transpose the mask (docs/perf.md).
            i = rows[:, None]
            jk = tl.trans(j)
            s2, t = logits(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), i, jk, diag, qk_scale, softcap2,
                           slope2, HAS_SOFTCAP, HAS_ALIBI)
            if MASKED:
                s2 = apply_mask(s2, i, jk, seqlen_k, diag, wl, wr, MASK_LEFT, MASK_RIGHT, False, chunk, MASK_CHUNK)
            p = tl.math.exp2(s2 - (lse2 - tl.math.log2(drop_scale))[:, None])
            pz = drop(p, seed, stream, bh, i, n_start, tl.arange(0, jk.shape[1])[None, :], threshold, jk.shape[1])
            dv = tl.dot(tl.trans(pz.to(do.dtype)), do, dv, input_precision=DOT_PRECISION)
            ds = pz * tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION) - p * (delta / drop_scale)[:, None]
            if HAS_SOFTCAP:
                ds = ds * (1.0 - t * t)
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=DOT_PRECISION)
        else:
            i = rows[None, :]
            qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
            s2T, tT = logits(qkT, i, j, diag, qk_scale, softcap2, slope2, HAS_SOFTCAP, HAS_ALIBI)
            if MASKED:
                s2T = apply_mask(s2T, i, j, seqlen_k, diag, wl, wr, MASK_LEFT, MASK_RIGHT, False, chunk, MASK_CHUNK)
            pT = tl.math.exp2(s2T - lse2[None, :])
            dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            dsT = pT * (dpT - delta[None, :])
            if HAS_SOFTCAP:
                dsT = dsT * (1.0 - tT * tT)
            dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


# Parameters: the per-call ones (pointers, float scalars) first, then those a launch key fixes (Note [launch
# cache] in ops/launch.py), then constexprs.
@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, READY, ALIBI, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_Q, SEQUSED_K, SCHEDULE, RNG,
    qk_scale, softcap2, softmax_scale, dropout_p,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lb: tl.int32, stride_lh: tl.int32, stride_ab: tl.int32,
    seqlen_q: tl.int32, seqlen_k: tl.int32, batch: tl.int32, wl: tl.int32, wr: tl.int32, chunk: tl.int32,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_SEQUSED_Q: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, MASK_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    STEP: tl.constexpr,
):
    # Under a causal mask the first key tiles are seen by the most queries: take them first.
    b, pid_n, hk, heads_kv = tile_coords(SCHEDULE, batch, BLOCK_N, False, IS_VARLEN, STEP)
    q_start, seqlen_q = seq_info(b, seqlen_q, CU_SEQLENS_Q, SEQUSED_Q, IS_VARLEN, HAS_SEQUSED_Q)
    k_start, seqlen_k = seq_info(b, seqlen_k, CU_SEQLENS_K, SEQUSED_K, IS_VARLEN, HAS_SEQUSED_K)
    n_start = pid_n * BLOCK_N
    if n_start >= seqlen_k:
        if PDL:
            gdc_wait()  # even a program with no keys ends after the dQ grid (Note [delta handoff])
        return
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    k = load_once(K + b64 * stride_kb + k_start * stride_kn + hk64 * stride_kh, n_start, seqlen_k, stride_kn,
                  BLOCK_N, HEAD_DIM, BLOCK_D)
    v = load_once(V + b64 * stride_vb + k_start * stride_vn + hk64 * stride_vh, n_start, seqlen_k, stride_vn,
                  BLOCK_N, HEAD_DIM_V, BLOCK_DV)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    diag = seqlen_k - seqlen_q
    j = (n_start + tl.arange(0, BLOCK_N))[:, None]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    lo, full_lo, full_hi, hi = q_block_range(n_start, seqlen_q, seqlen_k, wl, wr,
                                             BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, chunk, MASK_CHUNK)
    seed, stream, threshold, drop_scale = 0, 0, 0, 1.0
    if HAS_DROPOUT:
        seed, stream, threshold, drop_scale = dropout_state(RNG, dropout_p)
    for g in range(GROUP):
        h = hk * GROUP + g
        h64 = h.to(tl.int64)
        q_desc = row_desc(Q + b64 * stride_qb + q_start * stride_qm + h64 * stride_qh,
                          seqlen_q, stride_qm, BLOCK_M, HEAD_DIM, BLOCK_D)
        do_desc = row_desc(DO + b64 * stride_dob + q_start * stride_dom + h64 * stride_doh,
                           seqlen_q, stride_dom, BLOCK_M, HEAD_DIM_V, BLOCK_DV)
        LSE_H = LSE + b64 * stride_lb + h64 * stride_lh + q_start
        DELTA_H = DELTA + b64 * stride_lb + h64 * stride_lh + q_start
        _wait_delta(READY + b * heads_kv * GROUP + h, seqlen_q)
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(ALIBI + b * stride_ab + h) * LOG2E
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_desc, do_desc, LSE_H, DELTA_H, j, lo, full_lo,
                                 seqlen_q, seqlen_k, diag, wl, wr, chunk, qk_scale, softcap2, slope2, seed, stream,
                                 b * heads_kv * GROUP + h, threshold, drop_scale, n_start, BLOCK_M, True,
                                 MASK_LEFT, MASK_RIGHT, MASK_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, UPCAST,
                                 DOT_PRECISION)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_desc, do_desc, LSE_H, DELTA_H, j, full_lo, full_hi,
                                 seqlen_q, seqlen_k, diag, wl, wr, chunk, qk_scale, softcap2, slope2, seed, stream,
                                 b * heads_kv * GROUP + h, threshold, drop_scale, n_start, BLOCK_M, False,
                                 MASK_LEFT, MASK_RIGHT, MASK_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, UPCAST,
                                 DOT_PRECISION)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_desc, do_desc, LSE_H, DELTA_H, j, full_hi, hi,
                                 seqlen_q, seqlen_k, diag, wl, wr, chunk, qk_scale, softcap2, slope2, seed, stream,
                                 b * heads_kv * GROUP + h, threshold, drop_scale, n_start, BLOCK_M, True,
                                 MASK_LEFT, MASK_RIGHT, MASK_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, UPCAST,
                                 DOT_PRECISION)
    store_once(DK + b64 * stride_dkb + k_start * stride_dkn + hk64 * stride_dkh, n_start, seqlen_k, stride_dkn,
               dk * softmax_scale, HEAD_DIM)
    store_once(DV + b64 * stride_dvb + k_start * stride_dvn + hk64 * stride_dvh, n_start, seqlen_k, stride_dvn,
               dv, HEAD_DIM_V)
    if PDL:
        # Returns once the dQ grid has finished and its writes are visible, so that work queued after this kernel
        # also finds dQ complete (Note [delta handoff]).
        gdc_wait()


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, k_start, b, hk, i, lo, hi,
                  seqlen_k, diag, wl, wr, chunk, qk_scale, softcap2, slope2, seed, stream, bh, threshold, drop_scale,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DESC: tl.constexpr,
                  MASKED: tl.constexpr,
                  MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, MASK_CHUNK: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                  UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        k = load_rows(k_src, k_start, start_n, b, hk, DESC, BLOCK_N, BLOCK_D)
        v = load_rows(v_src, k_start, start_n, b, hk, DESC, BLOCK_N, BLOCK_DV)
        if MASKED and DESC == DESC_PACKED:
            # The next sequence's rows (or rows past seqused_k, which may hold anything): dS is 0 there, but
            # 0 * inf is not, in dS K and in dP = dO Vᵀ.
            row_ok = (start_n + offs_n < seqlen_k)[:, None]
            k = tl.where(row_ok, k, 0.0)
            v = tl.where(row_ok, v, 0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        j = (start_n + offs_n)[None, :]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s2, t = logits(qk, i, j, diag, qk_scale, softcap2, slope2, HAS_SOFTCAP, HAS_ALIBI)
        if MASKED:
            s2 = apply_mask(s2, i, j, seqlen_k, diag, wl, wr, MASK_LEFT, MASK_RIGHT, True, chunk, MASK_CHUNK)
        p = tl.math.exp2(s2 - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:  # dP = Z ∘ (dO Vᵀ), Z's scale in lse2 and delta (_bwd_dq_kernel)
            dp = drop(dp, seed, stream, bh, i, start_n, offs_n[None, :], threshold, BLOCK_N)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


# Parameters: the per-call ones (pointers, float scalars) first, then those a launch key fixes (Note [launch
# cache] in ops/launch.py), then constexprs.
@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, O, DQ, LSE, DELTA, READY, ALIBI, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_Q, SEQUSED_K, SCHEDULE, RNG,
    qk_scale, softcap2, softmax_scale, dropout_p,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_ob, stride_om, stride_oh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lb: tl.int32, stride_lh: tl.int32, stride_ab: tl.int32,
    seqlen_q: tl.int32, seqlen_k: tl.int32, batch: tl.int32, wl: tl.int32, wr: tl.int32, chunk: tl.int32,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_SEQUSED_Q: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, MASK_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    STEP: tl.constexpr, LISTED: tl.constexpr, DESC: tl.constexpr, PUBLISH: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
    b, pid_m, h, heads = tile_coords(SCHEDULE, batch, BLOCK_M, True, IS_VARLEN, STEP, LISTED)
    hk = h // GROUP
    q_start, seqlen_q = seq_info(b, seqlen_q, CU_SEQLENS_Q, SEQUSED_Q, IS_VARLEN, HAS_SEQUSED_Q)
    k_start, seqlen_k = seq_info(b, seqlen_k, CU_SEQLENS_K, SEQUSED_K, IS_VARLEN, HAS_SEQUSED_K)
    m_start = pid_m * BLOCK_M
    if m_start >= seqlen_q:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = hk.to(tl.int64)
    # The held tiles' loads first: a device descriptor below costs a global write and two proxy fences, which
    # these loads' latency now covers.
    q = load_once(Q + b64 * stride_qb + q_start * stride_qm + h64 * stride_qh, m_start, seqlen_q, stride_qm,
                  BLOCK_M, HEAD_DIM, BLOCK_D)
    do = load_once(DO + b64 * stride_dob + q_start * stride_dom + h64 * stride_doh, m_start, seqlen_q, stride_dom,
                   BLOCK_M, HEAD_DIM_V, BLOCK_DV)
    o = load_once(O + b64 * stride_ob + q_start * stride_om + h64 * stride_oh, m_start, seqlen_q, stride_om,
                  BLOCK_M, HEAD_DIM_V, BLOCK_DV)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    row_ok = offs_m < seqlen_q
    lse2 = tl.load(LSE + b64 * stride_lb + h64 * stride_lh + q_start + offs_m, mask=row_ok,
                   other=float("inf")) * LOG2E
    if DESC == DESC_ROW:
        k_src = row_desc(K + b64 * stride_kb + k_start * stride_kn + hk64 * stride_kh,
                         seqlen_k, stride_kn, BLOCK_N, HEAD_DIM, BLOCK_D)
        v_src = row_desc(V + b64 * stride_vb + k_start * stride_vn + hk64 * stride_vh,
                         seqlen_k, stride_vn, BLOCK_N, HEAD_DIM_V, BLOCK_DV)
    else:
        k_src = K
        v_src = V
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    # delta = rowsum(dO * O) of this tile's rows, used here and stored for the dK/dV kernel that runs next.
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + b64 * stride_lb + h64 * stride_lh + q_start + offs_m, delta, mask=row_ok)
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + b * stride_ab + h) * LOG2E
    diag = seqlen_k - seqlen_q
    i = offs_m[:, None]
    seed, stream, threshold, drop_scale = 0, 0, 0, 1.0
    if HAS_DROPOUT:
        seed, stream, threshold, drop_scale = dropout_state(RNG, dropout_p)
        # dS = P ∘ (Z ∘ dP - delta) with Z = scale or 0 is (scale P) ∘ (dP kept or 0 - delta / scale): the scale
        # moves into the row's LSE and delta (after delta's store), and the mask only clears dP's dropped entries.
        lse2 = lse2 - tl.math.log2(drop_scale)
        delta = delta / drop_scale
    bh = b * heads + h
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = kv_block_range(m_start, seqlen_q, seqlen_k, wl, wr,
                                              BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT, chunk, MASK_CHUNK)
    # Each loop only where it can have blocks: an empty pipelined loop still costs ~0.4 µs (its prologue's waits;
    # H200 trace). Only a window's left edge or a chunk's start makes a masked front, and its loop is not under a
    # runtime `if`: ptxas serialised every wgmma of the kernel when it was (the `if` yields dq from the loop's wgmma,
    # whose registers get moved; docs/design/hopper-pipeline.md). Unmasked tiles often have no masked tail.
    if MASK_LEFT or MASK_CHUNK:
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, k_start, b, hk, i, lo, full_lo, seqlen_k, diag,
                           wl, wr, chunk, qk_scale, softcap2, slope2, seed, stream, bh, threshold, drop_scale,
                           BLOCK_N, BLOCK_D, BLOCK_DV, DESC, True,
                           MASK_LEFT, MASK_RIGHT, MASK_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, UPCAST,
                           DOT_PRECISION)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, k_start, b, hk, i, full_lo, full_hi, seqlen_k, diag,
                       wl, wr, chunk, qk_scale, softcap2, slope2, seed, stream, bh, threshold, drop_scale,
                       BLOCK_N, BLOCK_D, BLOCK_DV, DESC, False,
                       MASK_LEFT, MASK_RIGHT, MASK_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, UPCAST,
                       DOT_PRECISION)
    if full_hi < hi:
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, k_start, b, hk, i, full_hi, hi, seqlen_k, diag,
                           wl, wr, chunk, qk_scale, softcap2, slope2, seed, stream, bh, threshold, drop_scale,
                           BLOCK_N, BLOCK_D, BLOCK_DV, DESC, True,
                           MASK_LEFT, MASK_RIGHT, MASK_CHUNK, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, UPCAST,
                           DOT_PRECISION)
    store_once(DQ + b64 * stride_dqb + q_start * stride_dqm + h64 * stride_dqh, m_start, seqlen_q, stride_dqm,
               dq * softmax_scale, HEAD_DIM)
    if PUBLISH:
        # Every thread's delta stores happen before one thread's release add: dK/dV programs of this head waiting
        # for these rows may read them.
        tl.debug_barrier()
        tl.atomic_add(READY + b * heads + h, tl.minimum(seqlen_q - m_start, BLOCK_M), sem="release",
                      scope="gpu")
