"""flash_attn_with_kvcache: fp64 references on the de-paged cache, paging, appending, rotary, splits, errors.

Every cache is built from a logical one (batch, capacity, nheads_k, headdim) whose rows outside
[cache_leftpad, cache_seqlens) are NaN, laid out contiguously (optionally at permuted cache_batch_idx rows of a
larger NaN buffer) or in shuffled pages, with NaN-filled spare pages that the block-table entries past a
sequence's own pages point at. A stray read turns into NaN in the output; a stray write changes a NaN row, which
the whole-buffer comparison after appending catches.

The interpreter tier keeps shapes tiny (the decode tiles are 16 x 16 there, so caches of ~100 rows still cross
several key blocks, splits and, with enough packed query rows, M tiles). `pytest -m gpu` runs real sizes in bf16.
"""

import math

import pytest
import torch

import flashtile.kvcache as kvcache
from flashtile import problem
from conftest import DEVICE
from flashtile.ops import decode as decode_ops
from flashtile.config import decode_config
from flashtile.ops.common import fast_divisor
from flashtile.ops.device import sm_count
from flashtile.testing import attention_ref, check_close, op_args

NAN = float("nan")
FACTOR = 2  # flash-attn's rule: at most twice PyTorch's own error in the input dtype, plus rounding


# ---------------------------------------------------------------------------------------------------------------
# Building caches and references


def rotary_tables(seqlen_ro, rotary_dim, dtype, device=DEVICE):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(seqlen_ro, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)


def rotary_ref(x, cos, sin, positions, interleaved):
    """x (S, H, D) rotated at positions (S,): computed in fp64, rounded to x's dtype."""
    rotary_dim = 2 * cos.shape[1]
    c = cos[positions].double()[:, None, :]
    s = sin[positions].double()[:, None, :]
    xr = x[..., :rotary_dim].double()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return torch.cat([rotated.to(x.dtype), x[..., rotary_dim:]], dim=-1)


def make_layout(seqlens, seqlen_new, capacity, batch_cache, page_size, batch_idx, seed):
    """Where each sequence lives: (block_table, cache_batch_idx, num_pages). Pages are shuffled; entries past a
    sequence's own pages point at a spare page (the last one), which must never be read or written."""
    gen = torch.Generator().manual_seed(seed + 1000)
    batch = len(seqlens)
    if page_size is None:
        idx = torch.randperm(batch_cache, generator=gen)[:batch].int() if batch_idx else None
        return None, idx, None
    assert capacity % page_size == 0
    max_blocks = capacity // page_size
    owned = [math.ceil((s + seqlen_new) / page_size) for s in seqlens]
    num_pages = sum(owned) + 2
    perm = torch.randperm(num_pages - 1, generator=gen)
    block_table = torch.full((batch, max_blocks), num_pages - 1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(owned):
        block_table[b, :n] = perm[start:start + n].int()
        start += n
    return block_table, None, num_pages


def place(logical, batch_cache, block_table, batch_idx, num_pages):
    """The physical cache buffer holding logical (B, capacity, Hk, D); NaN wherever no sequence row lives."""
    batch, capacity, nheads_kv, head_dim = logical.shape
    if block_table is None:
        if batch_idx is None:
            return logical.clone()
        buf = torch.full((batch_cache, capacity, nheads_kv, head_dim), NAN, dtype=logical.dtype)
        buf[batch_idx.long()] = logical
        return buf
    page_size = capacity // block_table.shape[1]
    buf = torch.full((num_pages, page_size, nheads_kv, head_dim), NAN, dtype=logical.dtype)
    for b in range(batch):
        for n, page in enumerate(block_table[b].tolist()):
            if page != num_pages - 1:
                buf[page] = logical[b, n * page_size:(n + 1) * page_size]
    return buf


def assert_same_buffer(name, actual, expected, rotated_rows=None):
    """Bitwise equal, NaN for NaN; rows rotated by the kernel may differ from the fp64 reference by rounding."""
    actual, expected = actual.cpu(), expected.cpu()
    assert torch.equal(actual.isnan(), expected.isnan()), f"{name}: NaN pattern changed (a stray read or write)"
    if rotated_rows is None:
        assert torch.equal(actual.nan_to_num(0.0), expected.nan_to_num(0.0)), f"{name}: contents differ"
    else:
        torch.testing.assert_close(actual.nan_to_num(0.0), expected.nan_to_num(0.0), msg=f"{name}: contents differ")


def run_case(*, dtype=torch.float16, batch=2, seqlen_q=1, nheads=4, nheads_kv=2, head_dim=32, capacity=96,
             seqlens=(70, 33), seqlen_new=0, leftpad=None, page_size=None, batch_idx=False, causal=False,
             window=(-1, -1), softcap=0.0, alibi=None, rotary=None, rotary_dim=None, num_splits=0,
             seqlens_as_int=False, seed=0, check=True):
    """Run one call on freshly built inputs, check caches and outputs against the references, return
    (out, lse, k_cache, v_cache)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    assert len(seqlens) == batch
    seqlens_t = torch.tensor(seqlens, dtype=torch.int32)
    leftpad_t = torch.tensor(leftpad if leftpad is not None else [0] * batch, dtype=torch.int32)
    q = randn(batch, seqlen_q, nheads, head_dim)
    logical_k = randn(batch, capacity, nheads_kv, head_dim)
    logical_v = randn(batch, capacity, nheads_kv, head_dim)
    rows = torch.arange(capacity)
    own = (rows[None, :] >= leftpad_t[:, None].long()) & (rows[None, :] < seqlens_t[:, None].long())
    logical_k[~own] = NAN
    logical_v[~own] = NAN
    k_new = randn(batch, seqlen_new, nheads_kv, head_dim) if seqlen_new else None
    v_new = randn(batch, seqlen_new, nheads_kv, head_dim) if seqlen_new else None
    cos = sin = None
    interleaved = rotary != "neox"
    if rotary is not None:
        cos, sin = rotary_tables(capacity + seqlen_q, rotary_dim or head_dim, dtype, device="cpu")
    slopes = None
    if alibi is not None:
        slopes = torch.rand((nheads,) if alibi == "h" else (batch, nheads), generator=gen) * 0.5

    # What the caches must hold afterwards, and the keys each sequence attends to.
    expected_k, expected_v = logical_k.clone(), logical_v.clone()
    local = causal or tuple(window) != (-1, -1)
    q_ro = q.clone()
    for b, s in enumerate(seqlens):
        positions = torch.arange(s, s + seqlen_new)
        if seqlen_new:
            expected_k[b, s:s + seqlen_new] = (k_new[b] if cos is None
                                               else rotary_ref(k_new[b], cos, sin, positions, interleaved))
            expected_v[b, s:s + seqlen_new] = v_new[b]
        if cos is not None:
            q_pos = torch.arange(s, s + seqlen_q) if local else torch.full((seqlen_q,), s)
            q_ro[b] = rotary_ref(q[b], cos, sin, q_pos, interleaved)

    batch_cache = batch + 2
    block_table, batch_idx_t, num_pages = make_layout(seqlens, seqlen_new, capacity, batch_cache, page_size,
                                                      batch_idx, seed)
    k_cache = place(logical_k, batch_cache, block_table, batch_idx_t, num_pages).to(DEVICE)
    v_cache = place(logical_v, batch_cache, block_table, batch_idx_t, num_pages).to(DEVICE)

    def dev(t):
        return None if t is None else t.to(DEVICE)

    out, lse = kvcache.flash_attn_with_kvcache(
        dev(q), k_cache, v_cache, k=dev(k_new), v=dev(v_new), rotary_cos=dev(cos), rotary_sin=dev(sin),
        cache_seqlens=seqlens[0] if seqlens_as_int else dev(seqlens_t), cache_batch_idx=dev(batch_idx_t),
        cache_leftpad=dev(leftpad_t) if leftpad is not None else None,
        block_table=dev(block_table), causal=causal, window_size=window, softcap=softcap,
        rotary_interleaved=interleaved, alibi_slopes=dev(slopes), num_splits=num_splits, return_softmax_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (batch, nheads, seqlen_q)
    if not check:
        return out, lse, k_cache, v_cache

    rotated = cos is not None and seqlen_new > 0
    assert_same_buffer("k_cache", k_cache, place(expected_k, batch_cache, block_table, batch_idx_t, num_pages),
                       rotated_rows=rotated or None)
    assert_same_buffer("v_cache", v_cache, place(expected_v, batch_cache, block_table, batch_idx_t, num_pages))
    for b, s in enumerate(seqlens):
        keys = slice(int(leftpad_t[b]), s + seqlen_new)
        args = (q_ro[b:b + 1], expected_k[b:b + 1, keys], expected_v[b:b + 1, keys])
        slopes_b = None if slopes is None else slopes if slopes.dim() == 1 else slopes[b]
        kwargs = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes_b)
        ref_out, ref_lse = attention_ref(*args, **kwargs)
        base_out, base_lse = attention_ref(*args, upcast=False, **kwargs)
        check_close(f"out[{b}]", out[b:b + 1].cpu(), ref_out, base_out, FACTOR)
        # lse is O(log seqlen_k) and passes through log2 units: floor the tolerance at a few ulps of its size.
        check_close(f"lse[{b}]", lse[b:b + 1].cpu(), ref_lse, base_lse.to(dtype), FACTOR, scale=_lse_scale(ref_lse))
    return out, lse, k_cache, v_cache


def _lse_scale(ref_lse):
    finite = ref_lse[torch.isfinite(ref_lse)]
    return finite.abs().max().item() if finite.numel() else 1.0


# ---------------------------------------------------------------------------------------------------------------
# Interpreter tier

CASES = {
    "decode": dict(),
    "decode_int_seqlens": dict(seqlens=(50, 50), seqlens_as_int=True),
    "empty_and_full": dict(seqlens=(0, 96)),
    "causal_sq3_fully_masked_rows": dict(seqlens=(1, 40), seqlen_q=3, causal=True),
    "noncausal_sq4": dict(seqlen_q=4, nheads=2, nheads_kv=1),
    "window": dict(seqlen_q=2, window=(9, 0)),
    "window_both_sides": dict(seqlen_q=3, window=(5, 1), seqlens=(60, 20)),
    "window_right_only": dict(seqlen_q=3, window=(-1, 1)),
    "softcap": dict(softcap=2.0, seqlen_q=2, causal=True),
    "alibi_heads": dict(alibi="h", causal=True, seqlen_q=2),
    "alibi_batch_heads": dict(alibi="bh", window=(20, 0)),
    "append": dict(seqlen_q=3, seqlen_new=3, causal=True),
    "append_noncausal_snew2": dict(seqlen_new=2, seqlens=(94, 0)),
    "append_paged_page1": dict(seqlen_q=2, seqlen_new=2, causal=True, page_size=1),
    "append_paged_page16": dict(seqlen_new=3, seqlen_q=3, causal=True, page_size=16, seqlens=(77, 13)),
    "leftpad": dict(leftpad=(5, 17), seqlen_q=2, causal=True),
    "leftpad_window_append": dict(leftpad=(30, 2), seqlen_new=2, seqlen_q=2, window=(7, 0)),
    "leftpad_paged": dict(leftpad=(19, 3), page_size=3, seqlen_new=1, alibi="h"),
    "batch_idx": dict(batch_idx=True, seqlen_new=2, seqlen_q=2, causal=True),
    "mha": dict(nheads=2, nheads_kv=2),
    "mqa": dict(nheads=4, nheads_kv=1, seqlen_q=2, causal=True),
    "group3": dict(nheads=6, nheads_kv=2, seqlen_q=3, causal=True),
    "two_m_tiles": dict(nheads=8, nheads_kv=1, seqlen_q=3, causal=True, seqlen_new=3),
    "two_m_tiles_ragged_group": dict(nheads=6, nheads_kv=1, seqlen_q=3, window=(4, 0), batch=1, seqlens=(60,)),
    "head_dim_40": dict(head_dim=40, page_size=16, seqlen_new=1),
    "head_dim_64": dict(head_dim=64, nheads=2, nheads_kv=1, batch=1, seqlens=(90,)),
    # Head dims read in two parts (32 + 16: config.head_dim_parts), rotary pairs crossing from one into the other.
    "head_dim_48_rotary_neox": dict(head_dim=48, rotary="neox", seqlen_new=2, seqlen_q=2, causal=True),
    "head_dim_40_rotary_interleaved_paged": dict(head_dim=40, rotary="interleaved", rotary_dim=40, page_size=16,
                                                 seqlen_new=1),
    "rotary_interleaved_causal": dict(rotary="interleaved", seqlen_new=3, seqlen_q=3, causal=True),
    "rotary_neox_causal_paged": dict(rotary="neox", seqlen_new=2, seqlen_q=2, causal=True, page_size=16),
    "rotary_interleaved_noncausal": dict(rotary="interleaved", seqlen_new=2, seqlen_q=2),
    "rotary_neox_partial_dim": dict(rotary="neox", rotary_dim=16, seqlen_new=1, leftpad=(4, 0)),
    "rotary_interleaved_partial_local": dict(rotary="interleaved", rotary_dim=8, seqlen_new=2, seqlen_q=2,
                                             window=(10, 0), batch_idx=True),
    "bf16": dict(dtype=torch.bfloat16, seqlen_new=1, causal=True),
    "bf16_paged_rotary": dict(dtype=torch.bfloat16, page_size=16, rotary="neox", seqlen_new=2, seqlen_q=2,
                              causal=True, alibi="h"),
    "fp32": dict(dtype=torch.float32, seqlen_q=2, seqlen_new=2, causal=True),
    "fp32_paged_softcap": dict(dtype=torch.float32, page_size=32, softcap=3.0, leftpad=(1, 9)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    run_case(**CASES[name])


@pytest.mark.parametrize("page_size", [1, 3, 16, 32, 96])
def test_paged_identical_to_contiguous(page_size):
    """The same logical cache, paged or not, gives bitwise the same output: only addresses differ."""
    case = dict(seqlen_q=2, seqlen_new=2, causal=True, num_splits=3, leftpad=(3, 0), seed=7, check=False)
    out, lse, _, _ = run_case(**case)
    paged_out, paged_lse, _, _ = run_case(page_size=page_size, **case)
    assert torch.equal(out, paged_out) and torch.equal(lse, paged_lse)


@pytest.mark.parametrize("d", [1, 2, 3, 7, 16, 96, 256, 1000, 4097, 2**20 + 7, 2**31 - 1])
def test_fast_divisor_is_exact(d):
    """Page translation divides rows by a multiply and a shift (kvcache.cache_coords); the identity must hold for
    every row a kernel can pass (0 <= n < 2^31), in int64 without overflow. Checked on the edges of each
    quotient step, the top of the range and a random sample, with the kernel's own int64 arithmetic."""
    mul, shift = fast_divisor(d)
    edges = [q * d + r for q in (0, 1, 2, (2**31 - 1) // d - 1, (2**31 - 1) // d) for r in (-1, 0, 1, d - 1)]
    n = torch.tensor([x for x in edges if 0 <= x < 2**31] + [2**31 - 1], dtype=torch.int64)
    n = torch.cat([n, torch.randint(0, 2**31, (4096,), generator=torch.Generator().manual_seed(d))])
    assert torch.equal((n * mul) >> shift, n // d)
    assert mul * (2**31 - 1) < 2**63


def test_num_splits_agree():
    """1, 3, many (more splits than key blocks: some are empty) and auto splits agree up to rounding."""
    case = dict(dtype=torch.float32, batch=1, nheads_kv=1, nheads=2, seqlens=(121,), capacity=128, seqlen_q=2,
                seqlen_new=2, causal=True, seed=3)
    if DEVICE == "cpu":  # auto must really split here, or the comparison below proves nothing about it
        assert decode_ops.auto_num_splits(1, 128 // decode_config(32).block_n,
                                          sm_count(torch.device(DEVICE))) > 1
    results = [run_case(num_splits=n, **case)[:2] for n in (1, 3, 13, 0)]
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lse, results[0][1], atol=1e-6, rtol=1e-5)


def _half(gen, *shape):
    return torch.randn(*shape, generator=gen).half().to(DEVICE)


def test_page_table_alias():
    """FlashAttention-3's name for the block table."""
    q = _half(torch.Generator().manual_seed(5), 2, 1, 4, 32)
    k_cache = _half(torch.Generator().manual_seed(6), 6, 16, 2, 32)
    block_table = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32, device=DEVICE)
    seqlens = torch.tensor([30, 17], dtype=torch.int32, device=DEVICE)
    a = kvcache.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=seqlens, block_table=block_table)
    b = kvcache.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=seqlens, page_table=block_table)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="not both"):
        kvcache.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=seqlens, block_table=block_table,
                                        page_table=block_table)


def test_append_bumps_cache_versions():
    """Appending writes the caches in place; autograd's version counters must say so (as the custom op's
    dispatch does), or a saved cache changed later would go unnoticed. Decoding without appending writes nothing."""
    g = torch.Generator().manual_seed(7)
    q, k_new, v_new = _half(g, 2, 1, 4, 32), _half(g, 2, 1, 2, 32), _half(g, 2, 1, 2, 32)
    k_cache, v_cache = _half(g, 2, 16, 2, 32), _half(g, 2, 16, 2, 32)
    seqlens = torch.tensor([3, 9], dtype=torch.int32, device=DEVICE)
    versions = k_cache._version, v_cache._version
    kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    assert (k_cache._version, v_cache._version) == versions
    kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens)
    assert k_cache._version > versions[0] and v_cache._version > versions[1]


def test_strided_q_and_cache_views():
    """q and the caches as non-contiguous views (heads sliced out of larger tensors) are read in place."""
    gen = torch.Generator().manual_seed(11)
    q_full = _half(gen, 2, 1, 8, 32)
    k_full = _half(gen, 2, 64, 4, 32)
    v_full = _half(gen, 2, 64, 4, 32)
    q, k_cache, v_cache = q_full[:, :, ::2], k_full[:, :, 1:3], v_full[:, :, 2:]
    seqlens = torch.tensor([64, 40], dtype=torch.int32, device=DEVICE)
    out = kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    expected = kvcache.flash_attn_with_kvcache(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(),
                                               cache_seqlens=seqlens)
    assert torch.equal(out, expected)


def _inputs(**overrides):
    t = dict(q=torch.zeros(2, 1, 4, 32, dtype=torch.float16), k_cache=torch.zeros(2, 64, 2, 32, dtype=torch.float16),
             v_cache=torch.zeros(2, 64, 2, 32, dtype=torch.float16),
             cache_seqlens=torch.tensor([10, 20], dtype=torch.int32))
    t.update(overrides)
    return t


def _new_kv(s=1, d=32):
    return dict(k=torch.zeros(2, s, 2, d, dtype=torch.float16), v=torch.zeros(2, s, 2, d, dtype=torch.float16))


BAD_INPUTS = {
    "q_3d": (dict(q=torch.zeros(2, 4, 32, dtype=torch.float16)), ValueError, "q must have 4 dimensions"),
    "cache_dtype": (dict(k_cache=torch.zeros(2, 64, 2, 32)), TypeError, "k_cache has dtype"),
    "int_q": (dict(q=torch.zeros(2, 1, 4, 32, dtype=torch.int32)), TypeError, "q has dtype"),
    "v_cache_shape": (dict(v_cache=torch.zeros(2, 32, 2, 32, dtype=torch.float16)), ValueError,
                      "k_cache and v_cache must have the same shape"),
    "head_dim": (dict(q=torch.zeros(2, 1, 4, 16, dtype=torch.float16)), ValueError,
                 "q and k_cache must have the same head"),
    "heads": (dict(q=torch.zeros(2, 1, 3, 32, dtype=torch.float16)), ValueError, "multiple of the number"),
    "k_without_v": (dict(k=torch.zeros(2, 1, 2, 32, dtype=torch.float16)), ValueError, "k and v must be given"),
    "k_shape": (dict(k=torch.zeros(2, 1, 4, 32, dtype=torch.float16), v=torch.zeros(2, 1, 4, 32,
                                                                                   dtype=torch.float16)),
                ValueError, "k must have shape"),
    "append_too_long": (_new_kv(65), ValueError, "cannot append"),
    "append_without_seqlens": (dict(cache_seqlens=None, **_new_kv()), ValueError, "needs cache_seqlens"),
    "int_seqlens_past_end": (dict(cache_seqlens=64, **_new_kv()), ValueError, "cache_seqlens = 64"),
    "seqlens_dtype": (dict(cache_seqlens=torch.tensor([1, 2])), TypeError, "cache_seqlens must be int32"),
    "seqlens_shape": (dict(cache_seqlens=torch.tensor([1], dtype=torch.int32)), ValueError,
                      "cache_seqlens must have shape"),
    "rotary_without_k": (dict(rotary_cos=torch.zeros(64, 8, dtype=torch.float16),
                              rotary_sin=torch.zeros(64, 8, dtype=torch.float16)), ValueError,
                         "need new keys"),
    "rotary_cos_only": (dict(rotary_cos=torch.zeros(64, 8, dtype=torch.float16), **_new_kv()), ValueError,
                        "given together"),
    "rotary_dim_too_large": (dict(rotary_cos=torch.zeros(64, 17, dtype=torch.float16),
                                  rotary_sin=torch.zeros(64, 17, dtype=torch.float16), **_new_kv()), ValueError,
                             "rotary_dim <= headdim"),
    "rotary_dim_zero": (dict(rotary_cos=torch.zeros(64, 0, dtype=torch.float16),
                             rotary_sin=torch.zeros(64, 0, dtype=torch.float16), **_new_kv()), ValueError,
                        "0 < rotary_dim"),
    "rotary_too_short": (dict(rotary_cos=torch.zeros(32, 8, dtype=torch.float16),
                              rotary_sin=torch.zeros(32, 8, dtype=torch.float16), **_new_kv()), ValueError,
                         "seqlen_ro"),
    "block_table_dtype": (dict(block_table=torch.zeros(2, 4, dtype=torch.int64)), TypeError,
                          "block_table must be int32"),
    "block_table_batch": (dict(block_table=torch.zeros(3, 4, dtype=torch.int32)), ValueError,
                          "block_table must have shape"),
    "batch_idx_with_pages": (dict(block_table=torch.zeros(2, 4, dtype=torch.int32),
                                  cache_batch_idx=torch.zeros(2, dtype=torch.int32)), ValueError,
                             "cache_batch_idx cannot be used"),
    "small_cache_batch": (dict(k_cache=torch.zeros(1, 64, 2, 32, dtype=torch.float16),
                               v_cache=torch.zeros(1, 64, 2, 32, dtype=torch.float16)), ValueError,
                          "holds 1 sequences"),
    "leftpad_dtype": (dict(cache_leftpad=torch.zeros(2, dtype=torch.int64)), TypeError, "cache_leftpad must be"),
    "alibi_shape": (dict(alibi_slopes=torch.zeros(3)), ValueError, "alibi_slopes must have shape"),
    "window": (dict(window_size=(-2, 0)), ValueError, "window_size"),
    "softcap": (dict(softcap=-1.0), ValueError, "softcap"),
    "num_splits": (dict(num_splits=-1), ValueError, "num_splits"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_inputs_raise(name):
    overrides, error, match = BAD_INPUTS[name]
    args = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in _inputs(**overrides).items()}
    with pytest.raises(error, match=match):
        kvcache.flash_attn_with_kvcache(**args)


DEBUG_CHECKED = {
    "seqlens_past_capacity": (dict(cache_seqlens=torch.tensor([10, 64], dtype=torch.int32), **_new_kv()),
                              "cache_seqlens \\+ seqlen_new"),
    "negative_seqlens": (dict(cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)), "cache_seqlens"),
    "leftpad_past_seqlens": (dict(cache_leftpad=torch.tensor([0, 21], dtype=torch.int32)), "cache_leftpad"),
    "batch_idx_out_of_range": (dict(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)), "cache_batch_idx"),
    "page_out_of_range": (dict(k_cache=torch.zeros(4, 16, 2, 32, dtype=torch.float16),
                               v_cache=torch.zeros(4, 16, 2, 32, dtype=torch.float16),
                               block_table=torch.tensor([[0, -1, -1, -1], [1, 4, -1, -1]], dtype=torch.int32)),
                          "block_table\\[1, 1\\] = 4"),
    "negative_page": (dict(k_cache=torch.zeros(4, 16, 2, 32, dtype=torch.float16),
                           v_cache=torch.zeros(4, 16, 2, 32, dtype=torch.float16),
                           block_table=torch.tensor([[-1, 0, 0, 0], [1, 2, 0, 0]], dtype=torch.int32)),
                      "block_table\\[0, 0\\] = -1"),
}


@pytest.mark.parametrize("name", list(DEBUG_CHECKED))
def test_debug_checks(name, monkeypatch):
    """Value checks run only with FLASHTILE_CHECK=1 (each synchronises the device)."""
    overrides, match = DEBUG_CHECKED[name]
    args = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in _inputs(**overrides).items()}
    monkeypatch.setenv("FLASHTILE_CHECK", "1")
    with pytest.raises(ValueError, match=match):
        kvcache.flash_attn_with_kvcache(**args)


PAGED_CHECKED = {  # flash-attn raises for these in eager mode; so does flashtile, naming the argument
    "seqlens_past_block_table": (dict(cache_seqlens=torch.tensor([10, 60], dtype=torch.int32), **_new_kv(5)),
                                 "cache_seqlens\\[1\\] = 60.*block_table"),
    "negative_seqlens": (dict(cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)), "cache_seqlens\\[0\\]"),
    "append_past_the_end": (dict(cache_seqlens=torch.tensor([64, 0], dtype=torch.int32), **_new_kv()),
                            "cache_seqlens\\[0\\] = 64"),
    "page_out_of_range": (dict(block_table=torch.tensor([[0, 1, 2, 3], [4, 9, 6, 7]], dtype=torch.int32)),
                          "block_table\\[1, 1\\] = 9"),
    "negative_page": (dict(block_table=torch.tensor([[0, 1, 2, 3], [-2, 5, 6, 7]], dtype=torch.int32)),
                      "block_table\\[1, 0\\] = -2"),
    "leftpad_past_seqlens": (dict(cache_leftpad=torch.tensor([0, 21], dtype=torch.int32)), "cache_leftpad\\[1\\]"),
}


@pytest.mark.parametrize("name", list(PAGED_CHECKED))
def test_paged_values_checked_in_eager_mode(name):
    """A paged cache's index values are checked without FLASHTILE_CHECK, as flash-attn checks them (one
    device-to-host copy), and the error names the argument; no cache is written before the check."""
    overrides, match = PAGED_CHECKED[name]
    pages = dict(k_cache=torch.zeros(8, 16, 2, 32, dtype=torch.float16),
                 v_cache=torch.zeros(8, 16, 2, 32, dtype=torch.float16),
                 block_table=torch.arange(8, dtype=torch.int32).reshape(2, 4))
    args = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v)
            for k, v in _inputs(**{**pages, **overrides}).items()}
    before = args["k_cache"].clone()
    with pytest.raises(ValueError, match=match):
        kvcache.flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("page_size", [None, 16])
def test_rotary_tables_as_long_as_the_cache(causal, page_size):
    """flash-attn's rule, seqlen_ro >= capacity, with more queries than appended keys: under a causal mask the
    last queries sit past the cache's last row. Their positions get no rotation, and no table row past seqlen_ro
    is read (the tables are carved out of NaN-filled buffers, so such a read would turn the output into NaN)."""
    gen = torch.Generator().manual_seed(3)
    batch, capacity, seqlen_q, seqlen_new, d = 2, 64, 6, 2, 32
    seqlens = [60, 61]  # queries at positions 60..65 and 61..66 with causal: the last 2 and 3 are past the table
    q = torch.randn(batch, seqlen_q, 4, d, generator=gen).half()
    k_new, v_new = (torch.randn(batch, seqlen_new, 2, d, generator=gen).half() for _ in range(2))
    logical_k, logical_v = (torch.randn(batch, capacity, 2, d, generator=gen).half() for _ in range(2))
    cos, sin = rotary_tables(capacity, d, torch.float16, device="cpu")
    guarded = []
    for t in (cos, sin):
        buf = torch.full((capacity + 16, t.shape[1]), float("nan"), dtype=t.dtype)
        buf[:capacity] = t
        guarded.append(buf[:capacity].to(DEVICE))
    if page_size is None:
        k_cache, v_cache, block_table = logical_k.clone(), logical_v.clone(), None
    else:
        k_cache = logical_k.reshape(batch * capacity // page_size, page_size, 2, d).clone()
        v_cache = logical_v.reshape(batch * capacity // page_size, page_size, 2, d).clone()
        block_table = torch.arange(batch * capacity // page_size, dtype=torch.int32).reshape(batch, -1)
    dev = (lambda t: None if t is None else t.to(DEVICE))
    out = kvcache.flash_attn_with_kvcache(dev(q), dev(k_cache), dev(v_cache), k=dev(k_new), v=dev(v_new),
                                          rotary_cos=guarded[0], rotary_sin=guarded[1], causal=causal,
                                          cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=DEVICE),
                                          block_table=dev(block_table), rotary_interleaved=False).cpu()
    assert torch.isfinite(out).all(), "a rotary table row past seqlen_ro was read"
    for b, s in enumerate(seqlens):
        keys_k = torch.cat([logical_k[b, :s], rotary_ref(k_new[b], cos, sin, torch.arange(s, s + seqlen_new),
                                                          False)])[None]
        keys_v = torch.cat([logical_v[b, :s], v_new[b]])[None]
        positions = torch.arange(s, s + seqlen_q) if causal else torch.full((seqlen_q,), s)
        inside = positions < capacity
        q_ro = q[b].clone()
        q_ro[inside] = rotary_ref(q[b][inside], cos, sin, positions[inside], False)
        ref, _ = attention_ref(q_ro[None], keys_k, keys_v, causal=causal)
        base, _ = attention_ref(q_ro[None], keys_k, keys_v, causal=causal, upcast=False)
        check_close(f"out[{b}]", out[b:b + 1], ref, base, FACTOR)


def test_debug_checks_accept_padding_past_owned_pages(monkeypatch):
    """-1 entries past the pages a sequence owns are fine: they are never read."""
    monkeypatch.setenv("FLASHTILE_CHECK", "1")
    args = _inputs(k_cache=torch.zeros(4, 16, 2, 32, dtype=torch.float16),
                   v_cache=torch.zeros(4, 16, 2, 32, dtype=torch.float16),
                   block_table=torch.tensor([[0, -1, -1, -1], [1, 2, -1, -1]], dtype=torch.int32), **_new_kv())
    out = kvcache.flash_attn_with_kvcache(**{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v)
                                             for k, v in args.items()})
    assert torch.equal(out, torch.zeros_like(out))


def test_torch_compile_fullgraph():
    """Append (a mutation of the caches) + rotary + paged decode traced without a graph break."""
    gen = torch.Generator().manual_seed(2)
    q = _half(gen, 2, 2, 4, 32)
    k_new = _half(gen, 2, 2, 2, 32)
    v_new = _half(gen, 2, 2, 2, 32)
    k_cache = _half(gen, 8, 16, 2, 32)
    v_cache = _half(gen, 8, 16, 2, 32)
    block_table = torch.tensor([[3, 0, 5], [1, 7, 2]], dtype=torch.int32, device=DEVICE)
    seqlens = torch.tensor([20, 9], dtype=torch.int32, device=DEVICE)
    cos, sin = rotary_tables(48, 32, torch.float16)

    def step(q, k_cache, v_cache, k_new, v_new, seqlens):
        return kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, cache_seqlens=seqlens,
                                               block_table=block_table, causal=True, rotary_interleaved=False,
                                               return_softmax_lse=True)

    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    out, lse = step(q, eager_k, eager_v, k_new, v_new, seqlens)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    c_out, c_lse = compiled(q, k_cache, v_cache, k_new, v_new, seqlens)
    assert torch.equal(c_out, out) and torch.equal(c_lse, lse)
    assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)


def test_opcheck_custom_ops():
    """Schemas, fake implementations and declared mutations agree with what the ops do."""
    gen = torch.Generator().manual_seed(4)
    q = _half(gen, 2, 2, 4, 32)
    k_cache = _half(gen, 2, 32, 2, 32)
    v_cache = _half(gen, 2, 32, 2, 32)
    k_new = _half(gen, 2, 1, 2, 32)
    seqlens = torch.tensor([20, 9], dtype=torch.int32, device=DEVICE)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(decode_ops.append_kv, (k_cache, v_cache, k_new, k_new, seqlens, None, None, None, None,
                                                 True), test_utils=tests)
    torch.library.opcheck(decode_ops.decode, op_args(decode_ops.decode, q=q, k_cache=k_cache, v_cache=v_cache,
                                                     cache_seqlens=seqlens, rotary_interleaved=True, seqlen_new=1,
                                                     softmax_scale=0.2, window_right=0, num_splits=2),
                          test_utils=tests)


# ---------------------------------------------------------------------------------------------------------------
# GPU tier (pytest -m gpu on the H200): bf16, real sizes


def _gpu_inputs(batch, seqlens, capacity, page_size, seqlen_q=1, nheads=32, nheads_kv=8, head_dim=128, seed=0):
    """A random bf16 cache; paged with shuffled pages when page_size is given (same logical content)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, capacity, nheads_kv, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, capacity, nheads_kv, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    seqlens_t = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    if page_size is None:
        return q, k, v, k, v, seqlens_t, None
    blocks = capacity // page_size
    perm = torch.randperm(batch * blocks, device="cuda", generator=gen)
    block_table = perm.view(batch, blocks).int()
    k_pages = torch.empty(batch * blocks, page_size, nheads_kv, head_dim, device="cuda", dtype=torch.bfloat16)
    v_pages = torch.empty_like(k_pages)
    k_pages[perm] = k.view(batch * blocks, page_size, nheads_kv, head_dim)
    v_pages[perm] = v.view(batch * blocks, page_size, nheads_kv, head_dim)
    return q, k, v, k_pages, v_pages, seqlens_t, block_table


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 1, 16, 64, 256])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_gpu_decode_matches_reference(page_size, seqlen_q):
    seqlens = [8192 - seqlen_q, 1, 3001, 5000]
    q, k, v, k_cache, v_cache, seqlens_t, block_table = _gpu_inputs(4, seqlens, 8192, page_size, seqlen_q)
    out, lse = kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens_t, block_table=block_table,
                                               causal=True, return_softmax_lse=True)
    for b, s in enumerate(seqlens):
        args = (q[b:b + 1], k[b:b + 1, :s], v[b:b + 1, :s])
        ref_out, ref_lse = attention_ref(*args, causal=True)
        base_out, base_lse = attention_ref(*args, causal=True, upcast=False)
        check_close(f"out[{b}]", out[b:b + 1], ref_out, base_out, FACTOR)
        check_close(f"lse[{b}]", lse[b:b + 1], ref_lse, base_lse.to(torch.bfloat16), FACTOR,
                    scale=_lse_scale(ref_lse))
    if page_size is not None:
        contiguous = kvcache.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens_t, causal=True)
        assert torch.equal(out, contiguous)


@pytest.mark.gpu
def test_gpu_splits_agree():
    seqlens = [32768, 20000]
    q, k, v, _, _, seqlens_t, _ = _gpu_inputs(2, seqlens, 32768, None)
    outs = [kvcache.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens_t, num_splits=n) for n in (1, 3, 0, 64)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_append_rotary_paged():
    """Chunked append of 4 rotated tokens into 16-token pages, against the contiguous path."""
    q, k, v, k_pages, v_pages, seqlens_t, block_table = _gpu_inputs(4, [100, 4000, 0, 8188], 8192, 16, seqlen_q=4)
    gen = torch.Generator(device="cuda").manual_seed(1)
    k_new = torch.randn(4, 4, 8, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    cos, sin = rotary_tables(8192, 64, torch.bfloat16, device="cuda")
    kwargs = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens_t, causal=True, rotary_interleaved=False)
    out_paged = kvcache.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, block_table=block_table, **kwargs)
    out = kvcache.flash_attn_with_kvcache(q, k, v, k_new, v_new, **kwargs)
    assert torch.equal(out_paged, out)
    for b, s in enumerate(seqlens_t.tolist()):
        positions = torch.arange(s, s + 4, device="cuda")
        torch.testing.assert_close(k[b, s:s + 4], rotary_ref(k_new[b], cos, sin, positions, False))
        assert torch.equal(v[b, s:s + 4], v_new[b])


@pytest.mark.gpu
def test_gpu_cuda_graph_capture(monkeypatch):
    """The decode path never synchronises: it can be captured and replayed with new lengths in place."""
    monkeypatch.delenv("FLASHTILE_CHECK", raising=False)  # its value checks do synchronise
    q, k, v, k_pages, v_pages, seqlens_t, block_table = _gpu_inputs(8, [4096] * 8, 8192, 64)
    k_new = torch.randn(8, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)

    def step():
        return kvcache.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, cache_seqlens=seqlens_t,
                                               block_table=block_table, causal=True)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    seqlens_t.copy_(torch.tensor([1, 100, 2000, 3000, 4000, 5000, 6000, 8000], dtype=torch.int32))
    graph.replay()
    torch.testing.assert_close(out, step(), atol=0, rtol=0)


def _unchecked(monkeypatch):
    """The path of a call whose index values are not checked: a contiguous cache on the GPU, any call under
    torch.compile or CUDA-graph capture (Note [cache index checks] in flashtile/problem.py)."""
    monkeypatch.setattr(problem, "_cache_value_checks", lambda *args: False)


def test_out_of_range_cache_seqlens_never_touch_foreign_memory(device, monkeypatch):
    """Where a bad cache_seqlens is not caught on the host (that would sync the device), the kernels clamp reads
    to the capacity and drop appended rows past it, so memory outside the caches stays intact (NaN guard bands
    around them would otherwise change, and a GPU would fault)."""
    _unchecked(monkeypatch)
    g = torch.Generator().manual_seed(5)
    buf_k = torch.full((3, 2, 40, 2, 32), float("nan"), dtype=torch.float16, device=device)
    buf_v = buf_k.clone()
    k_cache, v_cache = buf_k[1], buf_v[1]
    k_cache.copy_(torch.randn(2, 40, 2, 32, generator=g).half())
    v_cache.copy_(torch.randn(2, 40, 2, 32, generator=g).half())
    q = torch.randn(2, 1, 4, 32, generator=g).half().to(device)
    k_new, v_new = (torch.randn(2, 1, 2, 32, generator=g).half().to(device) for _ in range(2))
    before = buf_k.clone(), buf_v.clone()
    # Row 45 of sequence 0 would be row 5 of sequence 1; row -3 of sequence 1 would be row 37 of sequence 0.
    seqlens = torch.tensor([45, -3], dtype=torch.int32, device=device)
    out = kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens)
    assert torch.isfinite(out).all()
    for buf, old in zip((buf_k, buf_v), before):
        assert torch.equal(buf.nan_to_num(7.0), old.nan_to_num(7.0)), "a row outside a sequence's cache was written"


def test_out_of_range_block_table_stays_inside_the_cache(device, monkeypatch):
    """Where block-table entries are not validated on the host (under torch.compile or CUDA-graph capture), the
    kernels clamp page indices into the cache, so a bad entry can only read a wrong page of this cache (NaN guard
    pages around the cache stay unread and unwritten)."""
    _unchecked(monkeypatch)
    g = torch.Generator().manual_seed(6)
    buf_k = torch.full((3, 4, 16, 2, 32), float("nan"), dtype=torch.float16, device=device)
    buf_v = buf_k.clone()
    k_cache, v_cache = buf_k[1], buf_v[1]  # 4 pages of 16 rows
    k_cache.copy_(torch.randn(4, 16, 2, 32, generator=g).half())
    v_cache.copy_(torch.randn(4, 16, 2, 32, generator=g).half())
    before = buf_k.clone(), buf_v.clone()
    q = torch.randn(2, 1, 4, 32, generator=g).half().to(device)
    k_new, v_new = (torch.randn(2, 1, 2, 32, generator=g).half().to(device) for _ in range(2))
    block_table = torch.tensor([[0, 1], [-5, 99]], dtype=torch.int32, device=device)
    seqlens = torch.tensor([20, 20], dtype=torch.int32, device=device)
    out = kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens,
                                          block_table=block_table)
    assert torch.isfinite(out).all()
    for buf, old in zip((buf_k, buf_v), before):
        assert torch.equal(buf[0].nan_to_num(7.0), old[0].nan_to_num(7.0))
        assert torch.equal(buf[2].nan_to_num(7.0), old[2].nan_to_num(7.0))


def test_index_value_checks_agree_with_the_elementwise_rule():
    """problem._check_values decides from a few extremes (min/max reductions, one device-to-host copy): on random
    index tensors it raises exactly when some entry breaks the elementwise rule, and names a broken argument."""
    g = torch.Generator().manual_seed(0)

    def randint(lo, hi, shape):
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int32)

    for trial in range(400):
        batch, pages, page_size, cols = (int(x) for x in randint(1, 5, (4,)))
        cap, new = cols * page_size, int(randint(0, 3, ()))
        seqlens = randint(-1, cap + 2, (batch,))
        leftpad = randint(-1, cap + 1, (batch,)) if trial % 3 == 0 else None
        batch_idx = randint(-1, pages + 1, (batch,)) if trial % 3 == 1 else None
        table = randint(-2, pages + 2, (batch, cols)) if trial % 3 != 1 else None
        k_cache = torch.zeros(pages, page_size, 1, 8)
        bad = {"cache_seqlens": bool(((seqlens < 0) | (seqlens + new > cap)).any())}
        if leftpad is not None:
            bad["cache_leftpad"] = bool(((leftpad < 0) | (leftpad > seqlens)).any())
        if batch_idx is not None:
            bad["cache_batch_idx"] = bool(((batch_idx < 0) | (batch_idx >= pages)).any())
        if table is not None:
            rows = seqlens.clamp(0, cap) + new
            owned = torch.arange(cols)[None, :] * page_size < rows[:, None]
            bad["block_table"] = bool((owned & ((table < 0) | (table >= pages))).any())
        args = (k_cache, seqlens, batch_idx, leftpad, table, cap, new)
        if any(bad.values()):
            with pytest.raises(ValueError, match=next(name for name, b in bad.items() if b)):
                problem._check_values(*args)
        else:
            problem._check_values(*args)
