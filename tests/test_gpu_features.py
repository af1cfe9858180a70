"""GPU tier, real sizes, for the features the Triton kernels gained after the matrix (tests/test_gpu_matrix.py):
learnable sinks, chunked attention, v head dims other than q's (MLA prefill 192/128), head dim 512, DeepSeek's
absorbed MLA decode (576/512) and dropout, forward and backward against the fp64 reference (2x / 3x rule). The
CPU tier runs the same code on tiny shapes (tests/test_sinks.py, test_chunked.py, test_head_dim_v.py,
test_head_dim_512.py, test_dropout.py); these are the sizes whose tiles and pipelines only a GPU runs."""

import pytest
import torch

import flashtile
from flashtile.testing import attention_ref, check_attention, check_close, nan_guarded
from test_chunked import chunk_case, chunk_varlen_case
from test_head_dim_512 import varlen_case
from test_head_dim_v import dv_case, dv_varlen_case
from test_sinks import sink_case, sink_varlen_case

pytestmark = pytest.mark.gpu


def _case(device, seqlen, nheads, nheads_kv, head_dim, head_dim_v=None, dtype=torch.bfloat16, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    q = nan_guarded((1, seqlen, nheads, head_dim), dtype, device, g)
    k = nan_guarded((1, seqlen, nheads_kv, head_dim), dtype, device, g)
    v = nan_guarded((1, seqlen, nheads_kv, head_dim_v or head_dim), dtype, device, g)
    dout = torch.randn(1, seqlen, nheads, head_dim_v or head_dim, generator=g).to(device, dtype)
    check_attention(q, k, v, dout, **kw)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", ["causal", "window"])
def test_sinks(device, mask, head_dim):
    """gpt-oss: causal layers and 128-token sliding ones, each with a sink per head; GQA 8/2."""
    kw = dict(causal=True) if mask == "causal" else dict(causal=True, window_size=(127, 0))
    # check_attention differentiates q, k and v; the sink's gradient is covered on the CPU tier.
    _case(device, 1500, 8, 2, head_dim, learnable_sink=torch.randn(8, device=device), **kw)


def _assert_the_last_call_ran_gluon(device):
    """On a GPU where a plain d128 bf16 call takes the Gluon path (an sm_90 one, fast path on), the last forward and
    backward ran the Gluon kernels too."""
    plain = flashtile.kernel_paths(*(torch.empty(1, 1, 4, 128, device=device, dtype=torch.bfloat16)
                                     for _ in range(3)))
    if plain["reason"] is None:
        assert set(flashtile.last_kernel_paths().values()) == {"gluon-sm90"}, flashtile.last_kernel_paths()


@pytest.mark.parametrize("mask", ["causal", "window", "varlen"])
def test_sinks_on_the_hopper_kernels(device, mask):
    """d128 bf16 with a sink runs the Gluon kernels on an sm_90 GPU: the forward folds the sink into each row's
    denominator, the backward needs only that LSE, and the sink's gradient comes from the Gluon dQ kernel's delta.
    out, lse and every gradient, the sink's included, against the reference; then the kernel paths."""
    if mask == "varlen":
        sink_varlen_case(device, [700, 1, 129, 1000], [900, 300, 129, 1000], 4, 2, 128, torch.bfloat16)
    else:
        kw = dict(causal=True) if mask == "causal" else dict(causal=True, window_size=(127, 0))
        sink_case(device, 2, 700, 900, 4, 2, 128, torch.bfloat16, **kw)
    _assert_the_last_call_ran_gluon(device)


@pytest.mark.parametrize("chunk", [192, 1000])
def test_chunked(device, chunk):
    _case(device, 2100, 4, 2, 128, causal=True, attention_chunk=chunk)


@pytest.mark.parametrize("case", ["causal", "none", "local", "varlen", "varlen-mha"])
def test_chunked_on_the_hopper_kernels(device, case):
    """d128 bf16 chunked attention runs the Gluon kernels on an sm_90 GPU (kv_block_range and apply_mask take the
    chunk in the forward and dQ, per-key query bounds in dK/dV): chunks ending inside and on the edges of their
    64- and 128-row tiles, with and without causal, under a window, and varlen (chunks count from each
    sequence's start); against the reference, then the kernel paths."""
    if case.startswith("varlen"):
        heads = (4, 2) if case == "varlen" else (2, 2)
        chunk_varlen_case(device, [700, 1, 129, 1000], [900, 300, 129, 1000], *heads, 128, torch.bfloat16, 192)
    else:
        kw = {"causal": dict(causal=True), "none": {}, "local": dict(causal=True, window_size=(300, -1))}[case]
        chunk_case(device, 2, 700, 900, 4, 2, 128, torch.bfloat16, 100 if case == "none" else 192, **kw)
    _assert_the_last_call_ran_gluon(device)


@pytest.mark.parametrize("dims", [(192, 128), (128, 64), (64, 128)], ids=lambda d: f"{d[0]}-{d[1]}")
def test_head_dim_v(device, dims):
    _case(device, 1100, 4, 2, dims[0], dims[1], causal=True)


@pytest.mark.parametrize("case", ["causal", "none", "window-sink", "chunk", "fp16-mqa", "varlen", "varlen-causal"])
def test_mla_prefill_on_the_hopper_kernels(device, case):
    """q/k 192 with v 128 (DeepSeek-V3/Kimi prefill) runs the Gluon kernels on an sm_90 GPU, reading Q, K, dQ and
    dK as 128 + 64 columns (Note [head dim parts] in kernels/hopper_common.py): lengths that end inside and on the
    edges of the tiles, GQA and MQA, fp16, windows with a sink, chunks, ragged varlen sequences (0, 1, 129 tokens);
    out, lse and every gradient against the reference, then the paths the calls took (check_attention's call
    last; a varlen case's)."""
    if case.startswith("varlen"):
        dv_varlen_case(device, [700, 0, 1, 129, 1000], [900, 5, 300, 129, 1000], 4, 2, 192, 128, torch.bfloat16,
                       case == "varlen-causal")
    elif case == "window-sink":
        g = torch.Generator().manual_seed(4)
        sink = torch.randn(4, generator=g).to(device)
        dv_case(device, 2, 700, 900, 4, 2, 192, 128, torch.bfloat16, causal=True, window_size=(127, 0),
                learnable_sink=sink)
    else:
        kw = {"causal": dict(causal=True), "none": {}, "chunk": dict(causal=True, attention_chunk=192),
              "fp16-mqa": dict(causal=True)}[case]
        heads = (4, 1) if case == "fp16-mqa" else (4, 2)
        dtype = torch.float16 if case == "fp16-mqa" else torch.bfloat16
        dv_case(device, 2, 1000 if case == "none" else 700, 1000 if case == "none" else 900, *heads, 192, 128, dtype,
                **kw)
    _assert_the_last_call_ran_gluon(device)


@pytest.mark.parametrize("head_dim", [512, 448])
def test_head_dim_512(device, head_dim):
    _case(device, 900, 2, 1, head_dim, causal=True)


@pytest.mark.parametrize("case", ["none", "window-sink", "chunk", "fp16-varlen", "mqa-rows-without-keys"])
def test_head_dim_512_gluon_forward(device, case):
    """d512 on the Gluon forward whose consumers split the columns (kernels/hopper_fwd_wide.py) at lengths that end
    inside key blocks and query tiles: no mask over 1000 x 1300 keys, GQA 4/2, a window with a sink, chunks under
    a causal mask, fp16 varlen with an empty sequence, and MQA with a sink where a causal mask over fewer keys than
    queries leaves the first rows (and tiles) no key; the backward runs the Triton kernels."""
    if case == "fp16-varlen":
        varlen_case(device, [700, 0, 1, 333, 129], 4, seed=5)
    elif case == "mqa-rows-without-keys":
        g = torch.Generator().manual_seed(6)
        q = nan_guarded((2, 300, 4, 512), torch.bfloat16, device, g)
        k, v = (nan_guarded((2, 100, 1, 512), torch.bfloat16, device, g) for _ in range(2))
        dout = torch.randn(2, 300, 4, 512, generator=g).to(device, torch.bfloat16)
        check_attention(q, k, v, dout, causal=True, learnable_sink=torch.randn(4, generator=g).to(device))
    elif case == "none":
        g = torch.Generator().manual_seed(2)
        q = nan_guarded((2, 1000, 4, 512), torch.bfloat16, device, g)
        k, v = (nan_guarded((2, 1300, 2, 512), torch.bfloat16, device, g) for _ in range(2))
        dout = torch.randn(2, 1000, 4, 512, generator=g).to(device, torch.bfloat16)
        check_attention(q, k, v, dout)
    else:
        sink = torch.randn(4, generator=torch.Generator().manual_seed(3)).to(device)
        kw = dict(window_size=(200, 30), learnable_sink=sink) if case == "window-sink" else dict(
            causal=True, attention_chunk=192)
        _case(device, 777, 4, 2, 512, **kw)
    if flashtile.kernel_paths(*(torch.empty(1, 1, 4, 512, device=device, dtype=torch.bfloat16)
                                for _ in range(3)))["fwd"] == "gluon-sm90":
        assert flashtile.last_kernel_paths()["fwd"] == "gluon-sm90"


@pytest.mark.parametrize("h, page", [(128, 64), (16, 64), (16, 0)])
def test_absorbed_mla_decode(device, h, page):
    """DeepSeek-V3's decode step: h query heads on one 576-wide latent head (128; 16 as tensor parallelism over 8
    leaves them, the keys-major tile), v_cache its first 512 channels, 4k-token caches (64-token pages, or
    contiguous: page 0), one token appended."""
    batch, cap = 4, 4096
    g = torch.Generator().manual_seed(1)
    latent = torch.randn(batch, cap, 1, 576, generator=g).to(device, torch.bfloat16)
    q = torch.randn(batch, 1, h, 576, generator=g).to(device, torch.bfloat16)
    new = torch.randn(batch, 1, 1, 576, generator=g).to(device, torch.bfloat16)
    seqlens = torch.tensor([4000, 17, 2048, 3000], dtype=torch.int32, device=device)
    if page:
        cache = latent.reshape(-1, page, 1, 576).clone()
        table = torch.arange(batch * cap // page, dtype=torch.int32, device=device).reshape(batch, -1)
    else:
        cache, table = latent.clone(), None
    scale = 192 ** -0.5
    out = flashtile.flash_attn_with_kvcache(q, cache, cache[..., :512], new, new[..., :512], cache_seqlens=seqlens,
                                            block_table=table, softmax_scale=scale)
    for b in range(batch):
        s = int(seqlens[b])
        keys = torch.cat([latent[b:b + 1, :s], new[b:b + 1]], 1)
        ref, _ = attention_ref(q[b:b + 1].double(), keys.double(), keys[..., :512].double(), softmax_scale=scale)
        base, _ = attention_ref(q[b:b + 1], keys, keys[..., :512], softmax_scale=scale, upcast=False)
        check_close(f"out[{b}]", out[b:b + 1], ref, base, 2)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_dropout(device, head_dim):
    """Against the reference that applies the mask S_dmask returns; causal, GQA, 1k tokens."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 1000, 4, head_dim, generator=g).to(device, torch.bfloat16)
    k, v = (torch.randn(1, 1000, 2, head_dim, generator=g).to(device, torch.bfloat16) for _ in range(2))
    dout = torch.randn(1, 1000, 4, head_dim, generator=g).to(device, torch.bfloat16)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(3)
    out, _, s_dmask = flashtile.flash_attn_func(*inputs, dropout_p=0.1, causal=True, return_attn_probs=True)
    grads = torch.autograd.grad(out, inputs, dout)
    keep = s_dmask[..., :1000, :1000] >= 0
    kw = dict(causal=True, dropout_p=0.1, dropout_mask=keep)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_ref(*ref_in, **kw)
    ref_grads = torch.autograd.grad(ref, ref_in, dout)
    pt_in = [t.clone().requires_grad_() for t in (q, k, v)]
    pt, _ = attention_ref(*pt_in, upcast=False, **kw)
    pt_grads = torch.autograd.grad(pt, pt_in, dout)
    check_close("out", out, ref, pt, 2)
    for name, ours, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
        check_close(name, ours, r, p, 3, r.abs().max().item())
