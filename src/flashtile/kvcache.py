"""Inference API: `flash_attn_with_kvcache` (flash-attn 2.8's signature) and `combine` (FlashAttention-3's
`flash_attn_combine`).

problem.kvcache_problem checks every argument once, with errors that name it, and normalises the rest (an int
cache_seqlens becomes a tensor, causal becomes a window); this module calls the custom ops of ops/decode.py (in
eager mode their implementations directly: ops/common.py): `append_kv` when new k/v are given, then `decode`.
Checks that need the values of device tensors (block-table entries in range, cache_seqlens within capacity, ...)
synchronise the device: they run as flash-attn runs them, for paged caches in eager mode, and for every cache
with `FLASHTILE_CHECK=1` (Note [cache index checks] in problem.py); a contiguous cache's call never synchronises,
and no call synchronises under torch.compile or CUDA-graph capture, where the kernels' clamps keep a bad value
inside the cache. No backward.
"""

from __future__ import annotations

import torch

from .ops.common import call
from .ops.decode import append_kv, decode
from .ops.decode import combine as _combine_op
from .ops.device import require_runnable
from .problem import kvcache_problem

__all__ = ["flash_attn_with_kvcache", "combine"]

def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            *, page_table=None, learnable_sink=None, attention_chunk=0):
    """Attention of a few new query tokens against a KV cache, optionally appending new keys/values in place.

    If k and v are given they are written into the caches *in place* at rows [cache_seqlens[b],
    cache_seqlens[b] + seqlen_new) of sequence b (after rotary, if given), and attention runs over the updated
    cache: keys [cache_leftpad[b], cache_seqlens[b] + seqlen_new). Preallocate the caches with the maximum length
    and keep the current lengths in cache_seqlens. Rows and pages a sequence does not own are never read or
    written.

    With rotary_cos/rotary_sin, k is rotated at positions cache_seqlens[b], cache_seqlens[b] + 1, ..., and so is q
    when causal or local (window_size != (-1, -1)); otherwise every query token is rotated at position
    cache_seqlens[b] (they are all taken to sit at the end of the cache). The rotated k is what lands in the cache.

    MQA/GQA: nheads must be a multiple of nheads_k; the query heads sharing a KV head are computed together, so
    the cache is read once per KV head.

    causal and window_size are aligned to the bottom-right corner, that is to the end of the updated cache: with
    seqlen_k = cache_seqlens[b] + seqlen_new - cache_leftpad[b] keys, query i attends to keys j with
    i + seqlen_k - seqlen_q - window_size[0] <= j <= i + seqlen_k - seqlen_q + window_size[1] (j counted from
    cache_leftpad[b]). For seqlen_q = 2 and seqlen_k = 5 the causal mask is (1 = visible)
        1 1 1 1 0
        1 1 1 1 1
    A query row with no visible key outputs 0 (and lse +inf). As in flash-attn, a window entry >= the cache
    capacity is treated as unbounded.

    Index values (Note [cache index checks]): with a paged cache (block_table) an eager call checks, with one
    device-to-host copy as flash-attn does, that cache_seqlens + seqlen_new lies in [0, capacity], cache_leftpad
    in [0, cache_seqlens] and the pages a sequence's rows live in in [0, num_blocks), and raises ValueError naming
    the argument otherwise; FLASHTILE_CHECK=1 (or CPU tensors) checks every cache so, cache_batch_idx included.
    Otherwise (a contiguous cache on the GPU, or any call under torch.compile or CUDA-graph capture, which
    never synchronises) the kernels clamp them: cache_seqlens into [0, capacity - seqlen_new], cache_leftpad into
    [0, cache_seqlens + seqlen_new], pages and cache rows into the cache, and appended rows past a sequence's
    capacity are dropped, so a bad value can give a wrong answer for its own sequence but never reads or writes
    outside the caches. No backward pass.

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim). fp16, bf16 or fp32; unit stride in the last dimension.
        k_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim) without block_table, or
            (num_blocks, page_block_size, nheads_k, headdim) with block_table (a paged cache). Any
            page_block_size >= 1. Same dtype as q; unit stride in the last dimension. headdim <= 576 (DeepSeek's
            absorbed MLA cache: 512 latent + 64 rope channels).
        v_cache: k_cache's shape but for the last dimension, headdim_v <= 512, which may differ from headdim (MLA).
            v_cache may be a view of k_cache (an absorbed MLA cache: v_cache = k_cache[..., :headdim_v], one
            storage); appended v then fills those first channels and k only the channels past them.
        k [optional]: (batch_size, seqlen_new, nheads_k, headdim), new keys to append. Needs v and cache_seqlens.
        v [optional]: (batch_size, seqlen_new, nheads_k, headdim_v), new values to append.
        rotary_cos [optional]: (seqlen_ro, rotary_dim / 2); rotary_dim <= headdim. Needs k and v, and
            seqlen_ro >= the cache capacity (seqlen_cache, or max_num_blocks_per_seq * page_block_size). A query
            whose position is past the table (causal or local, more queries than appended keys) is not rotated,
            and no row past the table is read.
        rotary_sin [optional]: (seqlen_ro, rotary_dim / 2), as rotary_cos.
        cache_seqlens: int, or (batch_size,) int32: current length of each cache (before appending). Default: the
            whole capacity (then k/v cannot be appended).
        cache_batch_idx [optional]: (batch_size,) int32, the cache row of each sequence (default: b); not with a
            block_table. With duplicate indices and appended k/v, which write lands is unspecified.
        cache_leftpad [optional]: (batch_size,) int32, where each sequence starts in its cache (default 0); rows
            before it are ignored.
        block_table [optional]: (batch_size, max_num_blocks_per_seq) int32: page b's logical block n lives in
            page block_table[b, n] of the paged caches. Also accepted as the keyword `page_table` (FA3's name).
        softmax_scale: scaling of q kᵀ before the softmax; default 1 / sqrt(headdim).
        causal: causal mask aligned bottom-right (see above).
        window_size: (left, right); -1 or None means unbounded. Sliding-window attention (see above).
        softcap: if > 0, scores (already scaled) become softcap * tanh(score / softcap).
        rotary_interleaved: rotate pairs (0, 1), (2, 3), ... (GPT-J) if True, else (0, rotary_dim / 2),
            (1, rotary_dim / 2 + 1), ... (GPT-NeoX).
        alibi_slopes [optional]: (nheads,) or (batch_size, nheads), fp32. Adds
            -alibi_slope * |i + seqlen_k - seqlen_q - j| to the score of query i and key j.
        num_splits: how many chunks each sequence's keys are split into, computed in parallel and then merged.
            0 (default) picks from the GPU's SM count and the cache capacity (not the current lengths); 1 never
            splits.
        return_softmax_lse: also return the log-sum-exp of the scores.
        learnable_sink [keyword, optional]: (nheads,), float32, bfloat16 or float16: a logit per query head that
            joins each row's softmax denominator with no value (as `flash_attn_func`); softmax_lse includes it.
        attention_chunk [keyword, optional]: chunked attention (as `flash_attn_func`): query i sees only the keys
            of the chunk of `attention_chunk` keys its position falls in, positions counted from cache_leftpad.
    Return:
        out: (batch_size, seqlen_q, nheads, headdim_v), q's dtype.
        softmax_lse [if return_softmax_lse]: (batch_size, nheads, seqlen_q) fp32, natural log of the row sums of
            exp(scaled scores); +inf for rows with no visible key.
    """
    p = kvcache_problem(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                        cache_leftpad, block_table, page_table, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, num_splits, learnable_sink, attention_chunk)
    require_runnable(q)
    if k is not None:
        call(append_kv, k_cache, v_cache, k, v, p.cache_seqlens, cache_batch_idx, p.block_table, rotary_cos,
             rotary_sin, bool(rotary_interleaved))
    out, lse = call(decode, q, k_cache, v_cache, p.cache_seqlens, cache_batch_idx, cache_leftpad, p.block_table,
                    alibi_slopes, rotary_cos, rotary_sin, bool(rotary_interleaved),
                    None if learnable_sink is None else learnable_sink.float(), p.seqlen_new, p.softmax_scale,
                    p.window_left, p.window_right, p.attention_chunk, p.softcap, num_splits)
    return (out, lse) if return_softmax_lse else out


def combine(out_partials, lse_partials, out_dtype=None):
    """Merge attention results computed over disjoint parts of the keys (split-KV, context parallelism).

    Row by row: lse = log(sum_s exp(lse_s)) and out = sum_s exp(lse_s - lse) * out_s. A part with lse = -inf or
    +inf (flash-attn's value for a row that saw no key) has weight 0; a row whose parts are all empty gives out 0
    and lse +inf.

    Arguments:
        out_partials: (num_splits, batch_size, seqlen, nheads, headdim), or (num_splits, total_q, nheads,
            headdim) for a varlen batch; each part's normalised output. fp32 (any dtype is accepted and read
            as fp32). Unit stride in the last dimension.
        lse_partials: (num_splits, batch_size, nheads, seqlen), or (num_splits, nheads, total_q) for a varlen
            batch (flash-attn's softmax_lse layouts), fp32, natural log.
        out_dtype: dtype of out; default out_partials' dtype.
    Return:
        out: (batch_size, seqlen, nheads, headdim), or (total_q, nheads, headdim).
        softmax_lse: (batch_size, nheads, seqlen), or (nheads, total_q); fp32.
    """
    for name, t in (("out_partials", out_partials), ("lse_partials", lse_partials)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    varlen = out_partials.dim() == 4
    if out_partials.dim() not in (4, 5) or lse_partials.dim() != out_partials.dim() - 1:
        raise ValueError(f"out_partials must be (num_splits, batch_size, seqlen, nheads, headdim) with lse_partials "
                         f"(num_splits, batch_size, nheads, seqlen), or (num_splits, total_q, nheads, headdim) "
                         f"with (num_splits, nheads, total_q); got {tuple(out_partials.shape)} and "
                         f"{tuple(lse_partials.shape)}")
    if varlen:
        out_partials, lse_partials = out_partials.unsqueeze(1), lse_partials.unsqueeze(1)
    num_splits, batch, seqlen, nheads, head_dim = out_partials.shape
    if tuple(lse_partials.shape) != (num_splits, batch, nheads, seqlen):
        raise ValueError(f"lse_partials must have shape {(num_splits, batch, nheads, seqlen)} to match "
                         f"out_partials {tuple(out_partials.shape)}, got {tuple(lse_partials.shape)}")
    if not out_partials.dtype.is_floating_point or lse_partials.dtype != torch.float32:
        raise TypeError(f"out_partials must be floating point and lse_partials float32, got {out_partials.dtype} "
                        f"and {lse_partials.dtype}")
    if lse_partials.device != out_partials.device:
        raise ValueError(f"lse_partials is on {lse_partials.device} but out_partials on {out_partials.device}")
    if out_partials.stride(-1) != 1 and out_partials.numel() > 0:
        raise ValueError(f"out_partials must have unit stride in its last dimension, got {out_partials.stride()}")
    if num_splits < 1:
        raise ValueError("out_partials must hold at least one split (num_splits >= 1)")
    require_runnable(out_partials)
    out, lse = call(_combine_op, out_partials, lse_partials, out_dtype)
    return (out[0], lse[0]) if varlen else (out, lse)
