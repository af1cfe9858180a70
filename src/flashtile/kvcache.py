"""Inference API: `flash_attn_with_kvcache` (flash-attn 2.8's signature) and `combine` (FlashAttention-3's
`flash_attn_combine`).

This module checks every argument once, with errors that name it, normalises the rest (an int cache_seqlens
becomes a tensor, causal becomes a window) and calls the custom ops of ops/decode.py (in eager mode their
implementations directly: ops/common.py): `append_kv` when new k/v are given, then `decode`. Checks that need
the values of device tensors (block-table entries in range, cache_seqlens within capacity, ...) synchronise the
device: they run as flash-attn runs them, for paged caches in eager mode, and for every cache with
`FLASHTILE_CHECK=1` (Note [cache index checks]); a contiguous cache's call never synchronises, and no call
synchronises under torch.compile or CUDA-graph capture, where the kernels' clamps keep a bad value inside the
cache. No backward.
"""

from __future__ import annotations

import torch

from .ops.common import call
from .ops.device import graph_capturing
from .ops.decode import append_kv, capacity, decode
from .ops.decode import combine as _combine_op
from .problem import (MAX_HEAD_DIM, check_alibi, check_grid_limits, check_index, check_scalar_args, check_tensor,
                      normalize_window, value_checks)

__all__ = ["flash_attn_with_kvcache", "combine"]

def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            *, page_table=None):
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
            page_block_size >= 1. Same dtype as q; unit stride in the last dimension. headdim <= 256.
        v_cache: same shape as k_cache.
        k [optional]: (batch_size, seqlen_new, nheads_k, headdim), new keys to append. Needs v and cache_seqlens.
        v [optional]: (batch_size, seqlen_new, nheads_k, headdim), new values to append.
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
    Return:
        out: (batch_size, seqlen_q, nheads, headdim), q's dtype.
        softmax_lse [if return_softmax_lse]: (batch_size, nheads, seqlen_q) fp32, natural log of the row sums of
            exp(scaled scores); +inf for rows with no visible key.
    """
    if page_table is not None:
        if block_table is not None:
            raise ValueError("pass the page table as block_table or as page_table, not both")
        block_table = page_table
    check_tensor("q", q, 4)
    check_tensor("k_cache", k_cache, 4, q.device, q.dtype)
    check_tensor("v_cache", v_cache, 4, q.device, q.dtype)
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_kv = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q and k_cache must have the same headdim, got {head_dim} and {k_cache.shape[3]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"headdim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if seqlen_q < 1:
        raise ValueError(f"q must have at least one token (seqlen_q >= 1), got shape {tuple(q.shape)}")
    check_grid_limits(batch, nheads)
    if nheads_kv < 1 or nheads % nheads_kv != 0:
        raise ValueError(f"number of query heads ({nheads}) must be a multiple of the number of key/value heads "
                         f"in k_cache ({nheads_kv})")
    check_index("block_table", block_table, 2, batch, q.device)
    check_index("cache_batch_idx", cache_batch_idx, 1, batch, q.device)
    check_index("cache_leftpad", cache_leftpad, 1, batch, q.device)
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be used with a paged cache (block_table): the block table "
                             "already maps each sequence to its pages")
        if k_cache.shape[1] < 1 or block_table.shape[1] < 1:
            raise ValueError(f"a paged cache needs page_block_size >= 1 and block_table with >= 1 column, got "
                             f"k_cache {tuple(k_cache.shape)} and block_table {tuple(block_table.shape)}")
    elif cache_batch_idx is None and k_cache.shape[0] < batch:
        raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences but q has batch_size {batch}; pass "
                         "cache_batch_idx to pick cache rows")
    cap = capacity(k_cache, block_table)

    seqlen_new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append), or both be None")
    if k is not None:
        check_tensor("k", k, 4, q.device, q.dtype)
        check_tensor("v", v, 4, q.device, q.dtype)
        expected = (batch, k.shape[1], nheads_kv, head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} must have shape (batch_size, seqlen_new, nheads_k, headdim) = "
                                 f"{expected}, got {tuple(t.shape)}")
        seqlen_new = k.shape[1]
        if seqlen_new > cap:
            raise ValueError(f"cannot append {seqlen_new} tokens (k.shape[1]) to a cache of capacity {cap}")
        if cache_seqlens is None:
            raise ValueError("appending k/v needs cache_seqlens: the new tokens are written at rows "
                             "[cache_seqlens[b], cache_seqlens[b] + seqlen_new)")

    softmax_scale = check_scalar_args(0.0, softmax_scale, softcap, head_dim)
    check_alibi(alibi_slopes, batch, nheads, q.device)
    window_left, window_right = normalize_window(causal, window_size)
    # flash-attn's rule: a window reaching past the capacity restricts nothing, so it is not local (this also
    # decides at which positions q is rotated).
    window_left = -1 if window_left >= cap else window_left
    window_right = -1 if window_right >= cap else window_right
    if seqlen_q == 1:
        # A single query row sits on the last key, so a right bound (causal included) hides nothing: dropping it
        # keeps the common decode step on the kernel variant without masks. Rotary positions are unaffected.
        window_right = -1
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = choose automatically), got {num_splits!r}")
    _check_rotary(rotary_cos, rotary_sin, k, q, head_dim, cap)

    if cache_seqlens is None:
        cache_seqlens = torch.full((batch,), cap, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= cap - seqlen_new:
            raise ValueError(f"cache_seqlens = {cache_seqlens} must be in [0, capacity - seqlen_new] = "
                             f"[0, {cap - seqlen_new}]")
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    else:
        check_index("cache_seqlens", cache_seqlens, 1, batch, q.device)
    if _value_checks(q.device, block_table is not None, cache_seqlens, cache_batch_idx, cache_leftpad,
                     block_table):
        _check_values(k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, cap, seqlen_new)

    if k is not None:
        call(append_kv, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, rotary_cos,
             rotary_sin, bool(rotary_interleaved))
    out, lse = call(decode, q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                    alibi_slopes, rotary_cos, rotary_sin, bool(rotary_interleaved), seqlen_new, softmax_scale,
                    window_left, window_right, float(softcap), num_splits)
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
    out, lse = call(_combine_op, out_partials, lse_partials, out_dtype)
    return (out[0], lse[0]) if varlen else (out, lse)


def _value_checks(device, paged: bool, *tensors) -> bool:
    """Note [cache index checks]: whether this call checks the values of its index tensors (cache_seqlens,
    cache_leftpad, cache_batch_idx, block_table), which on a GPU costs a device-to-host copy that waits for the
    queued work. flash-attn pays it for paged caches only and raises there; so does flashtile, and on CPU tensors
    (free) and with FLASHTILE_CHECK=1 for every cache. Never while torch.compile traces (the values are unknown)
    or a CUDA graph is captured (a copy would break the capture). Unchecked values are clamped by the kernels:
    cache_seqlens into [0, capacity - seqlen_new], cache_leftpad into [0, cache_seqlens + seqlen_new], pages and
    cache rows into the cache, and appended rows past a sequence's capacity are dropped; a bad value can give a
    wrong answer for its own sequence but never reads or writes memory outside the caches."""
    if torch.compiler.is_compiling() or graph_capturing(device):
        return False
    return paged or value_checks(*tensors)


def _check_rotary(cos, sin, k, q, head_dim: int, cap: int) -> None:
    if cos is None and sin is None:
        return
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if k is None:
        raise ValueError("rotary_cos/rotary_sin need new keys k and v: rotary embedding is applied to q and to the "
                         "appended k (the cache holds already-rotated keys)")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        check_tensor(name, t, 2, q.device)
    if tuple(sin.shape) != tuple(cos.shape):
        raise ValueError(f"rotary_cos and rotary_sin must have the same shape, got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if sin.stride() != cos.stride():
        raise ValueError(f"rotary_cos and rotary_sin must have the same strides, got {cos.stride()} and "
                         f"{sin.stride()}")
    rotary_dim = 2 * cos.shape[1]
    if not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_cos must be (seqlen_ro, rotary_dim / 2) with 0 < rotary_dim <= headdim = "
                         f"{head_dim}; got shape {tuple(cos.shape)} (rotary_dim = {rotary_dim})")
    # flash-attn's rule: the tables cover the cache. A query of a causal or local step can sit past the cache's
    # last row (more queries than appended keys); such a position is not rotated and reads no table row
    # (kernels/kvcache.rotary_load).
    if cos.shape[0] < cap:
        raise ValueError(f"rotary_cos/rotary_sin have {cos.shape[0]} positions (seqlen_ro) but the cache holds {cap} "
                         f"rows (its capacity): seqlen_ro must be >= the capacity")


def _check_values(k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, cap: int,
                  seqlen_new: int) -> None:
    """Checks on the values of the index tensors (Note [cache index checks]): one device-to-host copy of a few
    flags, and a second only to name the first bad entry when one fails."""
    seqlens = cache_seqlens.long()
    conditions = [("cache_seqlens", (seqlens < 0) | (seqlens + seqlen_new > cap))]
    if cache_leftpad is not None:
        conditions.append(("cache_leftpad", (cache_leftpad < 0) | (cache_leftpad.long() > seqlens)))
    if cache_batch_idx is not None:
        conditions.append(("cache_batch_idx", (cache_batch_idx < 0) | (cache_batch_idx >= k_cache.shape[0])))
    if block_table is not None:
        # Only the pages a sequence owns (those holding rows < cache_seqlens + seqlen_new) must be pages of the
        # cache; the rest of its row may hold anything (e.g. -1 padding), since it is never read.
        page_size = k_cache.shape[1]
        owned = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * page_size < (
            seqlens.clamp(0, cap) + seqlen_new)[:, None]
        conditions.append(("block_table", owned & ((block_table < 0) | (block_table >= k_cache.shape[0]))))
    failed = torch.stack([bad.any() for _, bad in conditions]).tolist()
    if not any(failed):
        return
    name, bad = conditions[failed.index(True)]
    index = tuple(int(i) for i in bad.nonzero()[0])
    if name == "cache_seqlens":
        b = index[0]
        raise ValueError(f"cache_seqlens[{b}] = {int(seqlens[b])}: cache_seqlens + seqlen_new ({seqlen_new}) must "
                         f"lie in [0, {cap}], the rows a sequence's cache holds (block_table.shape[1] x "
                         f"page_block_size for a paged cache, k_cache.shape[1] otherwise)")
    if name == "cache_leftpad":
        b = index[0]
        raise ValueError(f"cache_leftpad[{b}] = {int(cache_leftpad[b])} must lie in [0, cache_seqlens[{b}] = "
                         f"{int(seqlens[b])}]")
    if name == "cache_batch_idx":
        b = index[0]
        raise ValueError(f"cache_batch_idx[{b}] = {int(cache_batch_idx[b])} must lie in [0, {k_cache.shape[0]}) "
                         f"(k_cache.shape[0])")
    b, n = index
    raise ValueError(f"block_table[{b}, {n}] = {int(block_table[b, n])} is not a page of the cache: the pages a "
                     f"sequence's rows live in must lie in [0, {k_cache.shape[0]}) (k_cache.shape[0])")
