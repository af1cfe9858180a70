"""flashtile.combine: merging partial (out, lse) states against an fp64 log-sum-exp reference.

Empty parts (lse -inf, or +inf as flash-attn reports rows without keys) must carry weight 0, rows with only
empty parts give out 0 and lse +inf, and merging must be associative (merging merged states is merging all).
"""

import pytest
import torch

import flashtile.kvcache as kvcache
from conftest import DEVICE

INF = float("inf")


def combine_ref(out_partials, lse_partials):
    """fp64 reference: weights softmax(lse) over the splits, with +inf read as an empty part."""
    lse = lse_partials.double().masked_fill(lse_partials == INF, -INF)  # (S, B, H, Sq)
    total = torch.logsumexp(lse, 0)
    weights = torch.exp(lse - total).nan_to_num(0.0)  # all-empty rows: exp(-inf - -inf) = nan -> 0
    out = torch.einsum("sbhq,sbqhd->bqhd", weights, out_partials.double())
    return out, total.masked_fill(total == -INF, INF).float()


def partials(num_splits, batch, seqlen, nheads, head_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(num_splits, batch, seqlen, nheads, head_dim, generator=gen)
    lse = 3 * torch.randn(num_splits, batch, nheads, seqlen, generator=gen)
    # Empty parts in both spellings, and one row with no part at all.
    lse[0, 0, 0, 0] = -INF
    lse[1 % num_splits, -1, -1, -1] = INF
    lse[:, 0, -1, 0] = -INF
    out[:, 0, 0, -1] = 0.0
    return out.to(DEVICE), lse.to(DEVICE)


def assert_matches_ref(out, lse, out_partials, lse_partials, atol=1e-5):
    ref_out, ref_lse = combine_ref(out_partials, lse_partials)
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


# 19 splits take two of a program's groups of splits, the second partly empty (Note [combine groups]).
@pytest.mark.parametrize("num_splits", [1, 2, 5, 19])
@pytest.mark.parametrize("head_dim", [16, 40, 200])
def test_matches_reference(num_splits, head_dim):
    out_partials, lse_partials = partials(num_splits, 2, 3, 3, head_dim)
    out, lse = kvcache.combine(out_partials, lse_partials)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 3, head_dim) and lse.shape == (2, 3, 3)
    assert_matches_ref(out, lse, out_partials, lse_partials)


@pytest.mark.parametrize("num_splits", [3, 11])
def test_many_rows(num_splits):
    """Enough rows for the combine's wider row blocks, whose groups hold fewer splits (ops/decode.py)."""
    out_partials, lse_partials = partials(num_splits, 2, 5, 8, 24, seed=2)
    lse_partials[num_splits // 2:, 1, 3] = -INF  # a head whose later splits saw no key
    out, lse = kvcache.combine(out_partials, lse_partials)
    assert_matches_ref(out, lse, out_partials, lse_partials)


def test_rows_without_keys():
    out_partials, lse_partials = partials(3, 1, 2, 2, 16)
    lse_partials[:, 0, 1, :] = torch.tensor([-INF, INF, -INF], device=DEVICE)[:, None]
    out, lse = kvcache.combine(out_partials, lse_partials)
    assert torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1]))
    assert torch.equal(lse[0, 1], torch.full_like(lse[0, 1], INF))
    assert_matches_ref(out, lse, out_partials, lse_partials)


def test_merge_is_associative():
    out_partials, lse_partials = partials(4, 2, 2, 2, 32, seed=1)
    out_ab, lse_ab = kvcache.combine(out_partials[:2], lse_partials[:2])
    out_cd, lse_cd = kvcache.combine(out_partials[2:], lse_partials[2:])
    out, lse = kvcache.combine(torch.stack([out_ab, out_cd]), torch.stack([lse_ab, lse_cd]))
    ref_out, ref_lse = kvcache.combine(out_partials, lse_partials)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_out_dtype(out_dtype):
    out_partials, lse_partials = partials(3, 1, 2, 2, 32)
    out, lse = kvcache.combine(out_partials, lse_partials, out_dtype=out_dtype)
    assert out.dtype == out_dtype and lse.dtype == torch.float32
    assert_matches_ref(out, lse, out_partials, lse_partials, atol=1e-2)


def test_varlen_layout():
    """(num_splits, total_q, nheads, headdim) with (num_splits, nheads, total_q), flash-attn's varlen layouts."""
    out_partials, lse_partials = partials(3, 1, 5, 2, 16)
    out, lse = kvcache.combine(out_partials[:, 0], lse_partials[:, 0])
    assert out.shape == (5, 2, 16) and lse.shape == (2, 5)
    assert_matches_ref(out[None], lse[None], out_partials, lse_partials)


def test_strided_inputs():
    """Views with non-contiguous strides (the split dimension innermost but one) are read in place."""
    out_t, lse_t = partials(3, 2, 2, 2, 16)
    out_partials = out_t.permute(1, 0, 2, 3, 4).contiguous().permute(1, 0, 2, 3, 4)
    lse_partials = lse_t.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)
    assert not out_partials.is_contiguous() and not lse_partials.is_contiguous()
    out, lse = kvcache.combine(out_partials, lse_partials)
    assert_matches_ref(out, lse, out_t, lse_t)


def test_bad_inputs():
    out_partials, lse_partials = partials(2, 1, 2, 2, 16)
    with pytest.raises(ValueError, match="lse_partials must have shape"):
        kvcache.combine(out_partials, lse_partials.transpose(2, 3)[:, :, :1])
    with pytest.raises(TypeError, match="lse_partials float32"):
        kvcache.combine(out_partials, lse_partials.double())
    with pytest.raises(ValueError, match="out_partials must be"):
        kvcache.combine(out_partials[0], lse_partials)
    with pytest.raises(TypeError, match="out_partials must be a torch.Tensor"):
        kvcache.combine(None, lse_partials)


def test_torch_compile():
    out_partials, lse_partials = partials(3, 1, 2, 2, 16)
    compiled = torch.compile(kvcache.combine, fullgraph=True, backend="aot_eager")
    out, lse = compiled(out_partials, lse_partials)
    ref_out, ref_lse = kvcache.combine(out_partials, lse_partials)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
