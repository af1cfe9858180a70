"""Chunked attention (Llama 4; FlashAttention-3's `attention_chunk`): query i sees only the keys of the chunk of
`attention_chunk` keys its position i + seqlen_k - seqlen_q falls in, combined with causal and windows. Forward,
lse and gradients against the fp64 reference (2x / 3x rule) with chunk boundaries inside and across tiles, the
varlen and decode paths, and the argument's rules. Inputs are carved out of NaN-filled buffers."""

import pytest
import torch

import flashtile
from flashtile.testing import attention_ref, check_attention, check_close, kvcache_inputs, nan_guarded, varlen_inputs


def chunk_case(device, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype, chunk, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    q = nan_guarded((batch, seqlen_q, nheads, head_dim), dtype, device, g)
    k, v = (nan_guarded((batch, seqlen_k, nheads_kv, head_dim), dtype, device, g) for _ in range(2))
    dout = torch.randn(batch, seqlen_q, nheads, head_dim, generator=g).to(device, dtype)
    check_attention(q, k, v, dout, attention_chunk=chunk, **kw)


# The interpreter's tiles are 16 and 32 rows: chunks of 1, 7, 16, 33 and 100 keys end inside tiles, on their edges
# and past several of them.
@pytest.mark.parametrize("chunk", [1, 7, 16, 33, 100])
@pytest.mark.parametrize("seqlens", [(70, 70), (33, 90), (90, 33)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mask", ["causal", "none", "causal_local"])
def test_chunks_against_the_reference(device, mask, seqlens, chunk):
    kw = {"causal": dict(causal=True), "none": {}, "causal_local": dict(causal=True, window_size=(12, -1))}[mask]
    chunk_case(device, 2, *seqlens, 2, 2, 32, torch.float16, chunk, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_chunks_in_other_dtypes(device, dtype):
    chunk_case(device, 1, 65, 65, 2, 1, 64, dtype, 24, causal=True)


def test_chunks_with_other_features(device):
    """GQA, softcap and ALiBi, then a learnable sink: all compose with the chunk mask."""
    slopes = torch.rand(4, generator=torch.Generator().manual_seed(3)).to(device) * 0.3
    chunk_case(device, 2, 48, 48, 4, 2, 32, torch.float16, 20, causal=True, softcap=5.0, alibi_slopes=slopes)
    q, k, v = (torch.randn(1, 40, 2, 32, device=device, dtype=torch.float16) for _ in range(3))
    sink = torch.tensor([0.5, -0.5], device=device)
    out = flashtile.flash_attn_func(q, k, v, causal=True, attention_chunk=8, learnable_sink=sink)
    ref, _ = attention_ref(q.double(), k.double(), v.double(), causal=True, attention_chunk=8,
                           learnable_sink=sink.double())
    base, _ = attention_ref(q, k, v, causal=True, attention_chunk=8, learnable_sink=sink.half(), upcast=False)
    check_close("out", out, ref, base, 2)


def chunk_varlen_case(device, lens_q, lens_k, nheads, nheads_kv, head_dim, dtype, chunk, seed=5):
    """flash_attn_varlen_func, causal and chunked: out and dq, dk, dv per sequence against the reference."""
    q, k, v, dout, cu_q, cu_k = varlen_inputs(device, lens_q, lens_k, nheads, nheads_kv, head_dim, dtype, seed)
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flashtile.flash_attn_varlen_func(*inputs, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                           attention_chunk=chunk)
    grads = torch.autograd.grad(out, inputs, dout)
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        if sq == 0:
            continue
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref_in = [t[None].detach().double().requires_grad_() for t in (q[rq], k[rk], v[rk])]
        ref, _ = attention_ref(*ref_in, causal=True, attention_chunk=chunk)
        ref_g = torch.autograd.grad(ref, ref_in, dout[None, rq].double())
        pt_in = [t[None].detach().clone().requires_grad_() for t in (q[rq], k[rk], v[rk])]
        pt, _ = attention_ref(*pt_in, causal=True, attention_chunk=chunk, upcast=False)
        pt_g = torch.autograd.grad(pt, pt_in, dout[None, rq])
        check_close(f"out[{b}]", out[None, rq], ref, pt, 2)
        scale = max(r.abs().max().item() for r in ref_g)
        for name, ours, r, p in zip(("dq", "dk", "dv"), (grads[0][rq], grads[1][rk], grads[2][rk]), ref_g, pt_g):
            check_close(f"{name}[{b}]", ours[None], r, p, 3, scale)


def test_chunks_varlen(device):
    """flash_attn_varlen_func: positions, and so chunks, count from each sequence's own start."""
    chunk_varlen_case(device, [20, 1, 45, 0], [33, 17, 45, 4], 2, 2, 32, torch.float16, 10)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("page_size", [None, 16])
def test_chunks_in_decode(device, page_size, num_splits):
    """flash_attn_with_kvcache: chunks count from cache_leftpad (the first key), with appended keys, split-KV or
    not, contiguous or paged."""
    batch = 2
    x = kvcache_inputs(device, batch, 64, 4, 2, 32, 3, page_size, seed=8)
    q, logical_k, logical_v, new_k, new_v = x["q"], x["logical_k"], x["logical_v"], x["k"], x["v"]
    seqlens = torch.tensor([40, 58], dtype=torch.int32, device=device)
    leftpad = torch.tensor([5, 0], dtype=torch.int32, device=device)
    out = flashtile.flash_attn_with_kvcache(q, x["k_cache"], x["v_cache"], new_k, new_v, cache_seqlens=seqlens,
                                            cache_leftpad=leftpad, causal=True, attention_chunk=16,
                                            num_splits=num_splits, **x["kwargs"])
    for b in range(batch):
        lo, s = int(leftpad[b]), int(seqlens[b])
        keys = torch.cat([logical_k[b:b + 1, lo:s], new_k[b:b + 1]], 1)
        values = torch.cat([logical_v[b:b + 1, lo:s], new_v[b:b + 1]], 1)
        ref, _ = attention_ref(q[b:b + 1].double(), keys.double(), values.double(), causal=True, attention_chunk=16)
        base, _ = attention_ref(q[b:b + 1], keys, values, causal=True, attention_chunk=16, upcast=False)
        check_close(f"out[{b}]", out[b:b + 1], ref, base, 2)


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (2.5, TypeError), (True, TypeError), ("8", TypeError)])
def test_bad_chunks(device, bad, exc):
    q = torch.randn(1, 8, 2, 16, device=device, dtype=torch.float16)
    for call in (lambda: flashtile.flash_attn_func(q, q, q, attention_chunk=bad),
                 lambda: flashtile.flash_attn_with_kvcache(q, q, q, attention_chunk=bad)):
        with pytest.raises(exc, match="attention_chunk"):
            call()
