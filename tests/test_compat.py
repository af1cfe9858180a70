"""flashtile.compat (flash_attn resolving to flashtile) and flashtile.rotary (flash-attn's apply_rotary_emb)."""

import importlib
import math

import pytest
import torch

import flashtile
from flashtile import compat
from flashtile.rotary import apply_rotary_emb


@pytest.fixture
def shim():
    compat.install()
    yield
    compat.uninstall()


def test_imports_resolve_to_flashtile(shim):
    import flash_attn
    from flash_attn.bert_padding import pad_input, unpad_input
    from flash_attn.cute import flash_attn_func as fa4_func
    from flash_attn.flash_attn_interface import flash_attn_varlen_func
    from flash_attn.layers.rotary import apply_rotary_emb as fa_rotary

    assert flash_attn.flash_attn_func is flashtile.flash_attn_func and flash_attn.__version__.startswith("2.8")
    assert flash_attn_varlen_func is flashtile.flash_attn_varlen_func
    assert flash_attn.flash_attn_with_kvcache is flashtile.flash_attn_with_kvcache
    assert (unpad_input, pad_input) == (flashtile.bert_padding.unpad_input, flashtile.bert_padding.pad_input)
    assert fa_rotary is apply_rotary_emb and fa4_func is compat.cute_flash_attn_func
    assert importlib.import_module("flash_attn.layers.rotary").apply_rotary_emb is apply_rotary_emb


def test_uninstall_and_refusing_a_real_flash_attn(monkeypatch):
    compat.install()
    assert compat.installed()
    compat.uninstall()
    assert not compat.installed()
    with pytest.raises(ImportError):
        import flash_attn  # noqa: F401  (no flash-attn in the test environment)
    monkeypatch.setitem(__import__("sys").modules, "flash_attn", object())
    with pytest.raises(RuntimeError, match="already imported"):
        compat.install()


def qkv(device, *shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device, torch.float16) for s in shapes]


def test_fa4_signature(shim, device):
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    q, k, v = qkv(device, (2, 9, 4, 32), (2, 13, 2, 32), (2, 13, 2, 32))
    out, lse = flash_attn_func(q, k, v, causal=True, window_size=(5, None))
    want, want_lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, window_size=(5, -1), return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    out, _ = flash_attn_func(q, k, v, window_size=(-3, 1))  # a negative-sum pair: no window, as FA4
    assert torch.equal(out, flashtile.flash_attn_func(q, k, v))
    cu = torch.tensor([0, 4, 13], dtype=torch.int32, device=device)
    out, lse = flash_attn_varlen_func(k[0], k[1], v[1], cu, cu, softcap=3.0)
    assert torch.equal(out, flashtile.flash_attn_varlen_func(k[0], k[1], v[1], cu, cu, 9, 9, softcap=3.0))
    sink = torch.tensor([0.5, -1.0, 0.0, 2.0], device=device)
    out, lse = flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    want, want_lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    with pytest.raises(NotImplementedError, match="mask_mod"):
        flash_attn_func(q, k, v, mask_mod=lambda *a: True)


def test_fa4_paged_varlen_is_the_kvcache_call(shim, device):
    from flash_attn.cute import flash_attn_varlen_func
    q, cache_k, cache_v = qkv(device, (2, 1, 4, 32), (6, 8, 2, 32), (6, 8, 2, 32), seed=1)
    table = torch.tensor([[3, 0], [5, 1]], dtype=torch.int32, device=device)
    used = torch.tensor([11, 4], dtype=torch.int32, device=device)
    out, lse = flash_attn_varlen_func(q, cache_k, cache_v, page_table=table, seqused_k=used, causal=True)
    want = flashtile.flash_attn_with_kvcache(q, cache_k, cache_v, cache_seqlens=used, block_table=table, causal=True)
    assert torch.equal(out, want) and lse.shape == (2, 4, 1)


# ---------------------------------------------------------------------------------------------------------------
# apply_rotary_emb
# ---------------------------------------------------------------------------------------------------------------

def rotary_ref(x, cos, sin, positions, interleaved):
    """Each pair rotated as a complex number by exp(i * angle), in float64; positions (..., seqlen) or (total,)."""
    half = cos.shape[1]
    x = x.double()
    head, tail = x[..., :2 * half], x[..., 2 * half:]
    pairs = head.unflatten(-1, (half, 2)) if interleaved else torch.stack((head[..., :half], head[..., half:]), -1)
    angle = torch.complex(cos.double(), sin.double())[positions][..., None, :]
    turned = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * angle)
    head = turned.flatten(-2) if interleaved else torch.cat((turned[..., 0], turned[..., 1]), -1)
    return torch.cat((head, tail), -1)


def tables(seqlen_ro, rotary_dim, dtype=torch.float32, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim)
    angles = torch.arange(seqlen_ro).double()[:, None] * inv
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_dense_offsets_and_partial_dim(interleaved):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 3, 32, generator=g)
    cos, sin = tables(16, 24)
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=5)
    torch.testing.assert_close(out.double(), rotary_ref(x, cos, sin, torch.arange(7) + 5, interleaved))
    offsets = torch.tensor([0, 9], dtype=torch.int32)
    positions = torch.arange(7)[None] + offsets[:, None].long()
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    torch.testing.assert_close(out.double(), rotary_ref(x, cos, sin, positions, interleaved))
    y = x.clone()
    assert apply_rotary_emb(y, cos, sin, interleaved=interleaved, inplace=True) is y
    torch.testing.assert_close(y, apply_rotary_emb(x, cos, sin, interleaved=interleaved))


def test_rotary_varlen_and_positions_past_the_table():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 2, 16, generator=g)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    cos, sin = tables(12, 16)
    offsets = torch.tensor([2, 8], dtype=torch.int64)
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu, max_seqlen=7)
    positions = torch.tensor([2, 3, 4] + list(range(8, 15)))
    inside = positions < 12
    want = rotary_ref(x, cos, sin, positions.clamp(max=11), False)
    want[~inside] = x[~inside].double()  # flash-attn's kernel leaves positions past seqlen_ro unrotated
    torch.testing.assert_close(out.double(), want)


def test_rotary_gradient():
    x = torch.randn(1, 5, 2, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = tables(8, 8, torch.float64)
    assert torch.autograd.gradcheck(lambda t: apply_rotary_emb(t, cos, sin, seqlen_offsets=2), (x,))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_matches_the_kvcache_kernel(device, interleaved):
    """The keys flash_attn_with_kvcache rotates in-kernel and appends are apply_rotary_emb's, at the cache lengths
    as offsets."""
    k_new = qkv(device, (2, 3, 2, 32), seed=2)[0]
    cache_k, cache_v = (torch.zeros(2, 16, 2, 32, device=device, dtype=torch.float16) for _ in range(2))
    cos, sin = (t.to(device) for t in tables(16, 16, torch.float16))
    lengths = torch.tensor([4, 9], dtype=torch.int32, device=device)
    q = qkv(device, (2, 1, 4, 32), seed=3)[0]
    flashtile.flash_attn_with_kvcache(q, cache_k, cache_v, k_new, k_new, rotary_cos=cos, rotary_sin=sin,
                                      cache_seqlens=lengths, rotary_interleaved=interleaved)
    want = apply_rotary_emb(k_new, cos, sin, interleaved=interleaved, seqlen_offsets=lengths)
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(cache_k[b, n:n + 3], want[b], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(cu_seqlens=torch.tensor([0, 4], dtype=torch.int32)), ValueError, "max_seqlen"),
    (dict(seqlen_offsets=20), ValueError, "seqlen_ro"),
    (dict(seqlen_offsets=torch.zeros(3, dtype=torch.int32)), ValueError, "seqlen_offsets"),
])
def test_rotary_refusals(kwargs, exc, match):
    x = torch.randn(1, 4, 2, 16)
    cos, sin = tables(16, 16)
    with pytest.raises(exc, match=match):
        apply_rotary_emb(x, cos, sin, **kwargs)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_emb(x, *tables(16, 32))
    with pytest.raises(TypeError, match="dtype"):
        apply_rotary_emb(x, cos.double(), sin.double())
    assert math.isfinite(float(apply_rotary_emb(x, cos, sin).sum()))
