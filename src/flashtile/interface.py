"""Public API, argument-for-argument compatible with flash-attn 2.8's `flash_attn_interface`.

Each function validates its arguments once (problem.py), normalises them (causal -> window, head dim padded to a
multiple of 8), calls the `flashtile::fwd` custom op (directly in eager mode: autograd.py) and trims the result.
Gradients flow through the op's backward (autograd.py). Layout is (batch, seqlen, nheads, headdim), or (total,
nheads, headdim) for the varlen functions, whose batch is packed along one token axis and described by cu_seqlens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .autograd import attention
from .ops.common import PACK_KV, PACK_NONE, PACK_QKV, call, unpack
from .ops.device import require_runnable
from .ops.dropout import draw_rng, dropout_probs
from .ops.hopper import HOPPER_PATH, TRITON, fallback_logging, hopper_unsupported, log_fallback
from .problem import AttnProblem, dense_problem, pad_head_dim, varlen_problem


def _pad(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    padded = pad_head_dim(head_dim)
    return t if padded == head_dim else F.pad(t, (0, padded - head_dim))


def _run(p: AttnProblem, q, k, v, packing: int, alibi_slopes, return_attn_probs: bool, deterministic: bool,
         cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, block_table=None,
         learnable_sink=None):
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    require_runnable(q)
    if fallback_logging():
        log_fallback(q.device, p.dtype, p.head_dim_padded, head_dim_v=p.head_dim_v_padded, paged=p.paged,
                     softcap=p.softcap, alibi=p.alibi, seqused=seqused_q is not None or seqused_k is not None,
                     dropout=p.dropout_p > 0.0, right_mask=p.window_right >= 0)
    # The backward reduces nothing with atomics (see ops/bwd.py), so it is bitwise reproducible whatever
    # `deterministic` says.
    # Packed inputs share one head dim; separate ones pad v to its own (head_dim_v).
    q, k = (None if t is None else _pad(t, p.head_dim) for t in (q, k))
    v = None if v is None else _pad(v, p.head_dim_v)
    rng = draw_rng(q.device) if p.dropout_p > 0.0 else None  # Note [dropout seed] in ops/dropout.py
    # The kernels read the sink as fp32; the cast is differentiated by autograd, so its gradient comes back in the
    # sink's own dtype.
    sink = None if learnable_sink is None else learnable_sink.float()
    out, lse = attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, block_table, sink,
                         rng, p.seqlen_q, p.seqlen_k, p.softmax_scale, p.window_left, p.window_right,
                         p.attention_chunk, p.softcap, p.dropout_p, packing)
    out = out[..., :p.head_dim_v] if out.shape[-1] != p.head_dim_v else out
    if not return_attn_probs:
        return out
    if rng is None:  # without dropout flash-attn returns an empty S_dmask too
        return out, lse, torch.empty(0, dtype=out.dtype, device=out.device)
    if block_table is not None:
        raise NotImplementedError("return_attn_probs with dropout_p > 0 and a paged KV cache (block_table): S_dmask "
                                  "is computed for contiguous k only")
    qu, ku, _ = unpack(q, k, v, packing)
    s_dmask = call(dropout_probs, qu.detach(), ku.detach(), lse, rng, cu_seqlens_q, cu_seqlens_k, seqused_q,
                   seqused_k, alibi_slopes, p.seqlen_q, p.seqlen_k, p.softmax_scale, p.window_left, p.window_right,
                   p.attention_chunk, p.softcap, p.dropout_p)
    return out, lse, s_dmask


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, learnable_sink=None,
                    attention_chunk=0):
    """Exact attention softmax(q kᵀ · softmax_scale) v, fused and tiled; forward and backward.

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim)
        k: (batch_size, seqlen_k, nheads_k, headdim)
        v: (batch_size, seqlen_k, nheads_k, headdim_v); headdim_v may differ from headdim (MLA prefill: 192 and
            128), as in FlashAttention-3.
            nheads must be a multiple of nheads_k (MQA/GQA): query head h uses key/value head h // (nheads /
            nheads_k). fp16, bf16 or fp32; unit stride in the last dimension, any other strides. headdim and
            headdim_v <= 512 (multiples of 8 run natively, others are zero-padded).
        dropout_p: dropout probability in [0, 1) (training): out = (dropout(P) / (1 - dropout_p)) v with P the
            softmax, as flash-attn 2. The mask is drawn in the kernels from the generator of q's device (each call
            advances it; `torch.manual_seed` reproduces a run), and the backward regenerates it. Pass 0.0 in
            evaluation.
        softmax_scale: scaling of qkᵀ before the softmax; default 1 / sqrt(headdim).
        causal: causal mask, aligned to the bottom-right corner of the attention matrix when seqlen_q != seqlen_k.
            For seqlen_q = 2, seqlen_k = 5 (1 = visible):
                1 1 1 1 0
                1 1 1 1 1
            and for seqlen_q = 5, seqlen_k = 2:
                0 0
                0 0
                0 0
                1 0
                1 1
            A row with no visible key outputs 0.
        window_size: (left, right); -1 or None means unbounded. Query i attends to keys j with
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right. causal=True sets right to 0.
        softcap: if > 0, scores (already scaled) become softcap * tanh(score / softcap).
        alibi_slopes: (nheads,) or (batch_size, nheads), float32. Adds -slope * |i + seqlen_k - seqlen_q - j| to
            the score of query i and key j.
        deterministic: accepted for compatibility. flashtile's backward is always bitwise reproducible: it sums
            no gradient with atomics (atomic-dQ schedules measured 1.5-3x slower on H200; docs/design/backward.md).
        return_attn_probs: if True, also return softmax_lse and S_dmask (testing only).
        learnable_sink [keyword, optional]: (nheads,), float32, bfloat16 or float16: a logit per query head that
            joins every row's softmax denominator and contributes no value (gpt-oss; FlashAttention-4's
            `learnable_sink`): out_i = sum_j exp(s_ij) v_j / (sum_j exp(s_ij) + exp(sink_h)). softmax_lse includes
            it, and a row that sees no key outputs 0 with lse = sink. Differentiable: its gradient sums over the
            head's rows.
        attention_chunk [keyword, optional]: chunked attention (Llama 4; FlashAttention-3's `attention_chunk`), 0
            for none: keys are cut into chunks of attention_chunk, and query i sees only keys of the chunk its
            position i + seqlen_k - seqlen_q falls in (combined with causal and window_size).
    Return:
        out: (batch_size, seqlen_q, nheads, headdim_v).
        softmax_lse [if return_attn_probs]: (batch_size, nheads, seqlen_q), float32, natural log of the row sums
            of exp(scores); +inf for rows with no visible key.
        S_dmask [if return_attn_probs]: without dropout an empty tensor; with dropout (batch_size, nheads,
            seqlen_q rounded up to 128, seqlen_k rounded up to 128), float32: P where the entry is kept,
            -max(P, 1.2e-38) where it is dropped (so `S_dmask >= 0` is the keep mask), 0 past the lengths; an extra
            pass, for tests.
    """
    p = dense_problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, learnable_sink,
                      attention_chunk)
    return _run(p, q, k, v, PACK_NONE, alibi_slopes, return_attn_probs, deterministic, learnable_sink=learnable_sink)


def kernel_paths(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, *,
                 learnable_sink=None, attention_chunk=0) -> dict:
    """Which kernels `flash_attn_func(q, k, v, ...)` with these arguments runs, forward and backward.

    Returns {'fwd': path, 'bwd_dq': path, 'bwd_dkdv': path, 'reason': str or None}, each path 'gluon-sm90' (the
    warp-specialised Hopper kernels) or 'triton', and the reason why the Hopper kernels do not run where they do
    not (with dropout the dQ kernel runs them, the forward unless causal or with a right window, the dK/dV kernel
    not: Note [dropout on the Gluon path] in ops/hopper.py). The packed and varlen entry points follow the same rule for
    their q, k, v (varlen with seqused_q/k or a block_table runs the Triton kernels). Arguments are validated as
    flash_attn_func validates them; nothing is computed.
    `last_kernel_paths()` says what the last call ran.
    """
    p = dense_problem(q, k, v, None, causal, window_size, softcap, alibi_slopes, dropout_p, learnable_sink,
                      attention_chunk)
    require_runnable(q)
    if p.seqlen_k == 0:
        return {"fwd": TRITON, "bwd_dq": TRITON, "bwd_dkdv": TRITON, "reason": "no keys (seqlen_k == 0)"}
    reasons = {kernel: hopper_unsupported(q.device, q.dtype, p.head_dim_padded, head_dim_v=p.head_dim_v_padded,
                                          softcap=p.softcap, alibi=p.alibi, dropout=p.dropout_p > 0.0, kernel=kernel,
                                          right_mask=p.window_right >= 0)
               for kernel in ("fwd", "bwd_dq", "bwd_dkdv")}
    paths = {kernel: TRITON if why else HOPPER_PATH for kernel, why in reasons.items()}
    return {**paths, "reason": next((why for why in reasons.values() if why), None)}


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              learnable_sink=None, attention_chunk=0):
    """`flash_attn_func` with q, k, v packed: qkv is (batch_size, seqlen, 3, nheads, headdim).

    Reads q, k and v as strided views of qkv and writes their gradients into one (batch_size, seqlen, 3, nheads,
    headdim) buffer, with no concatenation. Other arguments and the return value as `flash_attn_func`.
    """
    _check_packed("qkv", qkv, 5, 3)
    p = dense_problem(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], softmax_scale, causal, window_size, softcap,
                      alibi_slopes, dropout_p, learnable_sink, attention_chunk)
    return _run(p, qkv, None, None, PACK_QKV, alibi_slopes, return_attn_probs, deterministic,
                learnable_sink=learnable_sink)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             learnable_sink=None, attention_chunk=0):
    """`flash_attn_func` with k and v packed: q is (batch_size, seqlen_q, nheads, headdim) and kv is
    (batch_size, seqlen_k, 2, nheads_k, headdim). dk and dv are written into one buffer of kv's shape.
    Other arguments and the return value as `flash_attn_func`.
    """
    _check_packed("kv", kv, 5, 2)
    p = dense_problem(q, kv[:, :, 0], kv[:, :, 1], softmax_scale, causal, window_size, softcap, alibi_slopes,
                      dropout_p, learnable_sink, attention_chunk)
    return _run(p, q, kv, None, PACK_KV, alibi_slopes, return_attn_probs, deterministic,
                learnable_sink=learnable_sink)


def _check_packed(name: str, t, ndim: int, n: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim or t.shape[-3] != n:
        raise ValueError(f"{name} must have {ndim} dimensions with size {n} at dimension -3, "
                         f"got shape {tuple(t.shape)}")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, seqused_q=None,
                           seqused_k=None, learnable_sink=None, attention_chunk=0):
    """`flash_attn_func` over a ragged batch: B sequences of different lengths packed along one token axis.

    Sequence b is rows cu_seqlens_q[b] : cu_seqlens_q[b + 1] of q and rows cu_seqlens_k[b] : cu_seqlens_k[b + 1] of
    k and v; it attends only to itself, with no padding computed. Masks and ALiBi are per sequence: causal and
    window_size are aligned to the bottom-right corner of each sequence's own seqlen_q x seqlen_k matrix (see
    `flash_attn_func`). Forward and backward, except with block_table (forward only).

    Arguments:
        q: (total_q, nheads, headdim), total_q = total number of query tokens in the batch.
        k: (total_k, nheads_k, headdim), or with block_table a paged cache (num_blocks, page_block_size, nheads_k,
            headdim) with any page_block_size >= 1.
        v: k's shape but for the last dimension, headdim_v (as `flash_attn_func`).
            nheads must be a multiple of nheads_k (MQA/GQA). fp16, bf16 or fp32, unit stride in the last dimension;
            headdim and headdim_v <= 512.
        cu_seqlens_q: (batch_size + 1,), int32, the cumulative sequence lengths of q: starts at 0, non-decreasing,
            ends at total_q. Zero-length sequences are allowed.
        cu_seqlens_k: (batch_size + 1,), int32, the same for k and v (ends at total_k). With block_table it gives
            each sequence's key count only; its keys are rows 0, 1, ... of its pages.
        max_seqlen_q: int, the longest query sequence (with seqused_q: the largest seqused_q).
        max_seqlen_k: int, the longest key sequence (with seqused_k: the largest seqused_k).
            flash-attn sizes its grid with them; flashtile does not need them (its grid is a list of the
            sequences' tiles, built on the device), so a wrong value changes nothing. They are still checked
            with the other values, for code that must also run on flash-attn.
        dropout_p: dropout probability in [0, 1), as `flash_attn_func`.
        softmax_scale: scaling of qkᵀ before the softmax; default 1 / sqrt(headdim).
        causal: causal mask, aligned bottom-right within each sequence. A row with no visible key outputs 0.
        window_size: (left, right); -1 or None means unbounded. Query i of a sequence attends to its keys j with
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (lengths of that sequence).
        softcap: if > 0, scores (already scaled) become softcap * tanh(score / softcap).
        alibi_slopes: (nheads,) or (batch_size, nheads), float32. Adds -slope * |i + seqlen_k - seqlen_q - j|.
        deterministic: accepted for compatibility; the backward is always bitwise reproducible.
        return_attn_probs: if True, also return softmax_lse and S_dmask (testing only; as `flash_attn_func`,
            with the rounded max_seqlen_q and max_seqlen_k).
        block_table [optional]: (batch_size, max_num_blocks_per_seq), int32. Key row r of sequence b lives in
            row r % page_block_size of page block_table[b, r // page_block_size] of k and v. Entries past a
            sequence's keys are never read. Paged K/V has no backward (NotImplementedError): it is for inference.
            A headdim that is not a multiple of 8 pads a copy of the whole cache; use multiples of 8 with pages.
        seqused_q [keyword, optional]: (batch_size,), int32. Only the first seqused_q[b] queries of sequence b are
            computed; the other rows of out are 0 (their lse +inf) and get no gradient (FlashAttention-3's
            convention).
        seqused_k [keyword, optional]: (batch_size,), int32. Only the first seqused_k[b] keys of sequence b are
            attended to; masks are aligned to that length.
        learnable_sink [keyword, optional]: (nheads,), as `flash_attn_func`.
        attention_chunk [keyword, optional]: as `flash_attn_func`, per sequence.
    Checks: shapes, dtypes and devices always. The values of cu_seqlens, seqused and block_table (start at 0,
    non-decreasing, end at the total, max_seqlen large enough, pages in range) only when FLASHTILE_CHECK=1 or the
    tensors are on the CPU, and not under torch.compile tracing: on a GPU reading them is a synchronising copy
    that would also break CUDA-graph capture. Without the checks the kernels clamp cu_seqlens and seqused into
    the packed totals and block_table entries into the cache, so a bad value gives a wrong result for its own
    sequence but never reads or writes outside q, k, v or the cache.
    Return:
        out: (total_q, nheads, headdim_v).
        softmax_lse [if return_attn_probs]: (nheads, total_q), float32, natural log of the row sums of
            exp(scores); +inf for rows with no visible key.
        S_dmask [if return_attn_probs]: as `flash_attn_func`, (batch_size, nheads, max_seqlen_q rounded up to 128,
            max_seqlen_k rounded up to 128); empty without dropout.
    """
    p = varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                       window_size, softcap, alibi_slopes, dropout_p, seqused_q, seqused_k, block_table,
                       learnable_sink, attention_chunk)
    return _run(p, q, k, v, PACK_NONE, alibi_slopes, return_attn_probs, deterministic, cu_seqlens_q, cu_seqlens_k,
                seqused_q, seqused_k, block_table, learnable_sink)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, learnable_sink=None, attention_chunk=0):
    """`flash_attn_varlen_func` with q, k, v packed: qkv is (total, 3, nheads, headdim), and one cu_seqlens
    ((batch_size + 1,), int32) and max_seqlen serve queries and keys.

    Gradients are written into one (total, 3, nheads, headdim) buffer. Other arguments and the return value as
    `flash_attn_varlen_func`.
    """
    _check_packed("qkv", qkv, 4, 3)
    p = varlen_problem(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                       softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                       learnable_sink=learnable_sink, attention_chunk=attention_chunk)
    return _run(p, qkv, None, None, PACK_QKV, alibi_slopes, return_attn_probs, deterministic, cu_seqlens,
                cu_seqlens, learnable_sink=learnable_sink)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    learnable_sink=None, attention_chunk=0):
    """`flash_attn_varlen_func` with k and v packed: q is (total_q, nheads, headdim) and kv is (total_k, 2,
    nheads_k, headdim). dk and dv are written into one buffer of kv's shape. Other arguments and the return value
    as `flash_attn_varlen_func`.
    """
    _check_packed("kv", kv, 4, 2)
    p = varlen_problem(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                       learnable_sink=learnable_sink, attention_chunk=attention_chunk)
    return _run(p, q, kv, None, PACK_KV, alibi_slopes, return_attn_probs, deterministic, cu_seqlens_q,
                cu_seqlens_k, learnable_sink=learnable_sink)
