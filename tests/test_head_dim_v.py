"""head_dim_v != head_dim (DeepSeek/Kimi MLA prefill: q/k 192, v 128; FlashAttention-3's hdimv): v and the output
have their own head dim. Forward, lse and gradients against the fp64 reference (2x / 3x rule), dense and varlen,
with masks and the other features; decode over separate caches and over an absorbed MLA cache whose v_cache is a
view of k_cache; the argument rules; the Hopper dispatch's reason; torch.compile's fake shapes. Inputs are carved
out of NaN-filled buffers."""

import pytest
import torch

import flashtile
from flashtile.testing import (attention_ref, check_attention, check_close, kvcache_inputs, nan_guarded,
                               op_args)


def dv_case(device, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, head_dim_v, dtype, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    q = nan_guarded((batch, seqlen_q, nheads, head_dim), dtype, device, g)
    k = nan_guarded((batch, seqlen_k, nheads_kv, head_dim), dtype, device, g)
    v = nan_guarded((batch, seqlen_k, nheads_kv, head_dim_v), dtype, device, g)
    dout = torch.randn(batch, seqlen_q, nheads, head_dim_v, generator=g).to(device, dtype)
    check_attention(q, k, v, dout, **kw)


# v narrower and wider than q/k, head dims below their power-of-two tile (40 -> 64, 24 -> 32), and widths whose
# tiles differ by more than one step (16 -> 64).
@pytest.mark.parametrize("dims", [(48, 32), (32, 64), (40, 24), (16, 64)], ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
def test_against_the_reference(device, mask, dims):
    kw = {"none": {}, "causal": dict(causal=True), "local": dict(causal=True, window_size=(9, -1))}[mask]
    dv_case(device, 2, 37, 45, 4, 2, *dims, torch.float16, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_dtypes(device, dtype):
    dv_case(device, 1, 33, 33, 2, 1, 32, 16, dtype, causal=True)


def test_mla_prefill_shape(device):
    """DeepSeek-V3's prefill head dims, q/k 192 (a 256-wide tile) and v 128."""
    dv_case(device, 1, 20, 20, 2, 2, 192, 128, torch.bfloat16, causal=True)


@pytest.mark.parametrize("features", ["softcap_alibi", "sink", "chunk"])
def test_with_other_features(device, features):
    if features == "softcap_alibi":
        slopes = torch.rand(4, generator=torch.Generator().manual_seed(2)).to(device) * 0.3
        dv_case(device, 2, 30, 41, 4, 1, 32, 48, torch.float16, softcap=6.0, alibi_slopes=slopes)
    elif features == "chunk":
        dv_case(device, 2, 30, 41, 4, 2, 48, 32, torch.float16, causal=True, attention_chunk=12)
    else:
        g = torch.Generator().manual_seed(3)
        q = torch.randn(1, 26, 2, 32, generator=g).to(device, torch.float16).requires_grad_()
        k = torch.randn(1, 31, 2, 32, generator=g).to(device, torch.float16).requires_grad_()
        v = torch.randn(1, 31, 2, 16, generator=g).to(device, torch.float16).requires_grad_()
        sink = torch.randn(2, generator=g).to(device).requires_grad_()
        dout = torch.randn(1, 26, 2, 16, generator=g).to(device, torch.float16)
        out = flashtile.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
        grads = torch.autograd.grad(out, (q, k, v, sink), dout)
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
        ref, _ = attention_ref(*ref_in[:3], causal=True, learnable_sink=ref_in[3])
        ref_grads = torch.autograd.grad(ref, ref_in, dout)
        pt_in = [t.detach().clone().requires_grad_() for t in (q, k, v, sink)]
        pt, _ = attention_ref(*pt_in[:3], causal=True, learnable_sink=pt_in[3], upcast=False)
        pt_grads = torch.autograd.grad(pt, pt_in, dout)
        check_close("out", out, ref, pt, 2)
        for name, ours, r, p in zip(("dq", "dk", "dv", "dsink"), grads, ref_grads, pt_grads):
            assert ours.shape == r.shape
            check_close(name, ours, r, p, 3, r.abs().max().item())


def test_dropout_matches_its_mask(device):
    """With dropout the kept entries (S_dmask >= 0) define the reference: out = (P * keep / (1 - p)) v."""
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 40, 2, 32, generator=g).to(device, torch.float16) for _ in range(2))
    v = torch.randn(1, 40, 2, 16, generator=g).to(device, torch.float16)
    torch.manual_seed(0)
    out, _, s_dmask = flashtile.flash_attn_func(q, k, v, dropout_p=0.2, causal=True, return_attn_probs=True)
    keep = (s_dmask[:, :, :40, :40] >= 0)
    ref, _ = attention_ref(q.double(), k.double(), v.double(), causal=True, dropout_p=0.2, dropout_mask=keep)
    base, _ = attention_ref(q, k, v, causal=True, dropout_p=0.2, dropout_mask=keep, upcast=False)
    assert out.shape == (1, 40, 2, 16)
    check_close("out", out, ref, base, 2)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_varlen(device, mask):
    """Sequences of 0, 1 and ragged lengths, GQA, q/k 48 and v 32, against the reference per sequence."""
    dv_varlen_case(device, [17, 0, 1, 40], [23, 5, 1, 33], 4, 2, 48, 32, torch.float16, mask == "causal")


def dv_varlen_case(device, lens_q, lens_k, nheads, nheads_kv, head_dim, head_dim_v, dtype, causal, seed=6):
    """flash_attn_varlen_func with v's own head dim: out and dq, dk, dv per sequence against the reference."""
    g = torch.Generator().manual_seed(seed)
    q = nan_guarded((sum(lens_q), nheads, head_dim), dtype, device, g)
    k = nan_guarded((sum(lens_k), nheads_kv, head_dim), dtype, device, g)
    v = nan_guarded((sum(lens_k), nheads_kv, head_dim_v), dtype, device, g)
    dout = torch.randn(sum(lens_q), nheads, head_dim_v, generator=g).to(device, dtype)
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
          for n in (lens_q, lens_k)]
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flashtile.flash_attn_varlen_func(*inputs, *cu, max(lens_q), max(lens_k), causal=causal)
    grads = torch.autograd.grad(out, inputs, dout)
    assert out.shape == (sum(lens_q), nheads, head_dim_v)
    for b, (rq, rk) in enumerate(zip((slice(a, c) for a, c in zip(cu[0][:-1], cu[0][1:])),
                                     (slice(a, c) for a, c in zip(cu[1][:-1], cu[1][1:])))):
        if rq.stop == rq.start:
            continue
        ref_in = [t[r].detach().double()[None].requires_grad_() for t, r in ((q, rq), (k, rk), (v, rk))]
        ref, _ = attention_ref(*ref_in, causal=causal)
        ref_grads = torch.autograd.grad(ref, ref_in, dout[rq][None])
        pt_in = [t[r].detach().clone()[None].requires_grad_() for t, r in ((q, rq), (k, rk), (v, rk))]
        pt, _ = attention_ref(*pt_in, causal=causal, upcast=False)
        pt_grads = torch.autograd.grad(pt, pt_in, dout[rq][None])
        check_close(f"out[{b}]", out[None, rq], ref, pt, 2)
        for name, ours, r, p, rows in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads, (rq, rk, rk)):
            check_close(f"{name}[{b}]", ours[None, rows], r, p, 3, max(x.abs().max().item() for x in ref_grads))


def test_varlen_paged(device):
    """flash_attn_varlen_func over paged caches (pages of 8 rows, shuffled) with v 16 wide beside k's 32: the
    forward, against the reference per sequence."""
    lens_q, lens_k, page = [5, 1, 12], [20, 9, 31], 8
    g = torch.Generator().manual_seed(13)
    n_pages = [-(-n // page) for n in lens_k]
    order = torch.randperm(sum(n_pages), generator=g)
    table = torch.zeros(len(lens_k), max(n_pages), dtype=torch.int32)
    k_cache = torch.randn(sum(n_pages), page, 2, 32, generator=g).to(device, torch.float16)
    v_cache = torch.randn(sum(n_pages), page, 2, 16, generator=g).to(device, torch.float16)
    first = 0
    for b, n in enumerate(n_pages):
        table[b, :n] = order[first:first + n]
        first += n
    q = torch.randn(sum(lens_q), 4, 32, generator=g).to(device, torch.float16)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for n in (lens_q, lens_k))
    out = flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                           block_table=table.to(device))
    assert out.shape == (sum(lens_q), 4, 16)
    for b in range(len(lens_q)):
        rows = torch.cat([torch.arange(int(table[b, n]) * page, int(table[b, n]) * page + page)
                          for n in range(n_pages[b])])[:lens_k[b]]
        k, v = (c.flatten(0, 1)[rows.to(device)][None] for c in (k_cache, v_cache))
        qb = q[int(cu_q[b]):int(cu_q[b + 1])][None]
        ref, _ = attention_ref(qb.double(), k.double(), v.double(), causal=True)
        base, _ = attention_ref(qb, k, v, causal=True, upcast=False)
        check_close(f"out[{b}]", out[None, int(cu_q[b]):int(cu_q[b + 1])], ref, base, 2)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("page_size", [None, 16])
def test_decode_separate_caches(device, page_size, num_splits):
    """flash_attn_with_kvcache with v_cache 24 wide beside k_cache's 40, appending keys, split-KV or not."""
    batch = 2
    x = kvcache_inputs(device, batch, 64, 4, 2, 40, 2, page_size, seed=9)
    g = torch.Generator().manual_seed(10)
    logical_v = torch.randn(batch, 64, 2, 24, generator=g).to(device, torch.float16)
    new_v = torch.randn(batch, 2, 2, 24, generator=g).to(device, torch.float16)
    v_cache = logical_v.reshape(-1, page_size, 2, 24).clone() if page_size else logical_v.clone()
    seqlens = torch.tensor([30, 57], dtype=torch.int32, device=device)
    out = flashtile.flash_attn_with_kvcache(x["q"], x["k_cache"], v_cache, x["k"], new_v, cache_seqlens=seqlens,
                                            causal=True, num_splits=num_splits, **x["kwargs"])
    assert out.shape == (batch, 2, 4, 24)
    for b in range(batch):
        s = int(seqlens[b])
        keys = torch.cat([x["logical_k"][b:b + 1, :s], x["k"][b:b + 1]], 1)
        values = torch.cat([logical_v[b:b + 1, :s], new_v[b:b + 1]], 1)
        ref, _ = attention_ref(x["q"][b:b + 1].double(), keys.double(), values.double(), causal=True)
        base, _ = attention_ref(x["q"][b:b + 1], keys, values, causal=True, upcast=False)
        check_close(f"out[{b}]", out[b:b + 1], ref, base, 2)


@pytest.mark.parametrize("page_size", [None, 1, 16])
def test_absorbed_mla_cache(device, page_size):
    """An absorbed MLA cache (DeepSeek decode: one latent head, 576 wide, whose first 512 channels are the values;
    here 48 and 32): v_cache is a view of k_cache, one storage, and all query heads share the one KV head. The
    output equals the same call with K and V as separate tensors; the appended token lands in the shared storage
    once, its first channels v's."""
    batch, cap, h, d, dv = 2, 48, 8, 48, 32
    g = torch.Generator().manual_seed(11)
    latent = torch.randn(batch, cap, 1, d, generator=g).to(device, torch.float16)
    q = torch.randn(batch, 1, h, d, generator=g).to(device, torch.float16)
    new = torch.randn(batch, 1, 1, d, generator=g).to(device, torch.float16)
    seqlens = torch.tensor([20, 46], dtype=torch.int32, device=device)
    kw = {}
    if page_size:
        pages = batch * cap // page_size
        cache = latent.reshape(pages, page_size, 1, d).clone()
        kw["block_table"] = torch.randperm(pages, generator=g).to(device, torch.int32).reshape(batch, -1)
        cache[kw["block_table"].flatten().long()] = latent.reshape(pages, page_size, 1, d)
    else:
        cache = latent.clone()
    out = flashtile.flash_attn_with_kvcache(q, cache, cache[..., :dv], new, new[..., :dv], cache_seqlens=seqlens,
                                            **kw)
    k_sep, v_sep = cache.clone(), cache[..., :dv].clone()
    expected = flashtile.flash_attn_with_kvcache(q, k_sep, v_sep, cache_seqlens=seqlens + 1, **kw)
    assert out.shape == (batch, 1, h, dv)
    assert torch.equal(out, expected)
    for b in range(batch):
        s = int(seqlens[b])
        keys = torch.cat([latent[b:b + 1, :s], new[b:b + 1]], 1)
        ref, _ = attention_ref(q[b:b + 1].double(), keys.double(), keys[..., :dv].double())
        base, _ = attention_ref(q[b:b + 1], keys, keys[..., :dv], upcast=False)
        check_close(f"out[{b}]", out[b:b + 1], ref, base, 2)


def test_append_into_an_absorbed_cache_splits_the_channels(device):
    """Appending into an absorbed cache: v fills the shared first channels and k only the channels past them
    (kernels/kvcache.py: V_IN_K), so the row holds a documented result even for a v that is not k's first channels;
    storing k whole and v after it from threads in no set order would leave each shared channel either."""
    from flashtile.ops.launch import capture_launches
    g = torch.Generator().manual_seed(12)
    cache = torch.zeros(2, 8, 1, 48, dtype=torch.float16, device=device)
    q = torch.randn(2, 1, 4, 48, generator=g).to(device, torch.float16)
    k = torch.randn(2, 1, 1, 48, generator=g).to(device, torch.float16)
    v = torch.randn(2, 1, 1, 32, generator=g).to(device, torch.float16)
    seqlens = torch.tensor([3, 7], dtype=torch.int32, device=device)
    flashtile.flash_attn_with_kvcache(q, cache, cache[..., :32], k, v, cache_seqlens=seqlens)
    for b, row in enumerate((3, 7)):
        assert torch.equal(cache[b, row, :, :32], v[b, 0]) and torch.equal(cache[b, row, :, 32:], k[b, 0, :, 32:])
    assert cache.count_nonzero() == 2 * 48
    q, cache, k, v, seqlens = (t.cpu() for t in (q, cache, k, v, seqlens))  # recorded, not run
    with capture_launches() as launches:
        flashtile.flash_attn_with_kvcache(q, cache, cache[..., :32], k, v, cache_seqlens=seqlens)
        flashtile.flash_attn_with_kvcache(q, cache, cache[..., :32].clone(), k, v, cache_seqlens=seqlens)
    appends = [launch.kwargs["V_IN_K"] for launch in launches if launch.kernel.__name__ == "_append_kv_kernel"]
    assert appends == [True, False]


def test_decode_reads_v_from_k_only_for_a_view():
    """V_IS_K (kernels/decode.py) is taken only where v_cache is k_cache's own first channels; 576 is read as
    512 + 64, V's 512 then being K's first part."""
    from flashtile.config import head_dim_parts
    from flashtile.ops.decode import v_is_k
    assert head_dim_parts(576) == (512, 64) and head_dim_parts(192) == (128, 64) and head_dim_parts(128) == (128, 0)
    assert head_dim_parts(224) == (256, 0) and head_dim_parts(24) == (32, 0) and head_dim_parts(40) == (32, 16)
    cache = torch.zeros(2, 8, 1, 576, dtype=torch.bfloat16)
    assert v_is_k(cache, cache[..., :512], 512)
    assert not v_is_k(cache, cache[..., :512].clone(), 512)  # same values, another storage
    assert not v_is_k(cache, cache[..., 64:576], 512)  # a view, but not of the first channels
    assert not v_is_k(cache, cache[..., :256], 512)  # narrower than K's first part
    assert not v_is_k(cache, cache[:1, :, :, :512], 512)  # fewer sequences
    flat = cache.view(16, 1, 576)
    view = flat[..., :512].view(2, 8, 1, 512)  # the one KV head's stride is 512 here, 576 in cache
    assert view.stride(2) != cache.stride(2) and v_is_k(cache, view, 512)
    assert not v_is_k(cache, torch.as_strided(cache, (2, 8, 1, 512), (4608, 288, 576, 1)), 512)  # other rows

    # What the decode launch of an absorbed cache carries, and of the same values in two storages (recorded, not run).
    from flashtile.ops.launch import capture_launches
    q = torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16)
    with capture_launches() as launches:
        flashtile.flash_attn_with_kvcache(q, cache, cache[..., :512], cache_seqlens=5, num_splits=1)
        flashtile.flash_attn_with_kvcache(q, cache, cache[..., :512].clone(), cache_seqlens=5, num_splits=1)
    shared, separate = [launch.kwargs for launch in launches if launch.kernel.__name__ == "_decode_kernel"]
    assert (shared["BLOCK_D"], shared["BLOCK_D2"], shared["V_IS_K"]) == (512, 64, True)
    assert (separate["BLOCK_D"], separate["BLOCK_D2"], separate["V_IS_K"]) == (512, 64, False)


def test_absorbed_decode_tiles_follow_the_packed_rows(monkeypatch):
    """128 heads on the latent head take DECODE_WIDE's tile, 16 heads (one 16-row tile) DECODE_KEYS_M's, which
    holds no V of its own: separate K and V caches keep DECODE_TABLE's."""
    from flashtile import config
    monkeypatch.setattr(config.env, "INTERPRET", False)
    assert config.decode_config(576, rows=128, v_in_k=True) is config.DECODE_WIDE[1024]
    assert config.decode_config(576, rows=16, v_in_k=True) is config.DECODE_KEYS_M[1024]
    assert config.decode_config(576, rows=16) is config.DECODE_TABLE[1024]
    assert config.decode_config(576, rows=16, v_in_k=True, paged=True) is config.DECODE_TABLE[1024]
    assert config.decode_config(576, fp32=True, rows=16, v_in_k=True) is config.DECODE_FP32[1024]
    assert config.decode_config(576, fp32=True, rows=128) is config.DECODE_FP32[1024]
    assert config.decode_config(128, rows=16, v_in_k=True) is config.DECODE_TABLE[128]
    assert config.decode_config(128, rows=128) is config.DECODE_TABLE[128]


def test_absorbed_decode_splits_fill_one_wave(monkeypatch):
    """ops/decode.py's split heuristic for absorbed MLA decode (recorded launches, not run): at 16 heads the
    keys-major tile (one program an SM) takes one wave of 132 programs, whose 64-key blocks already read 8 times the
    fp32 state a split writes (PARTIAL_SHARE); paged caches, 128 heads and separate K and V caches take the
    row-major tiles, where PARTIAL_SHARE binds at 16 rows of 32-key blocks."""
    from flashtile import config
    from flashtile.ops.common import cdiv
    from flashtile.ops.decode import MIN_BLOCKS_PER_SPLIT, min_blocks_per_split
    from flashtile.ops.launch import capture_launches
    monkeypatch.setattr(config.env, "INTERPRET", False)

    def splits(batch, seqlen, heads, heads_kv, dim, dim_v, absorbed, page=0):
        q = torch.empty(batch, 1, heads, dim, dtype=torch.bfloat16)
        rows = (batch * seqlen // page, page) if page else (batch, seqlen)
        k = torch.empty(*rows, heads_kv, dim, dtype=torch.bfloat16)
        v = k[..., :dim_v] if absorbed else torch.empty(*rows, heads_kv, dim_v, dtype=torch.bfloat16)
        table = torch.arange(rows[0], dtype=torch.int32).reshape(batch, -1) if page else None
        with capture_launches(sms=132) as launches:
            flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlen, block_table=table, causal=True)
        (launch,) = [launch for launch in launches if launch.kernel.__name__ == "_decode_kernel"]
        assert launch.kwargs["KEYS_M"] == (absorbed and heads <= 16 and not page)
        return launch.grid[0] // cdiv(heads // heads_kv, launch.kwargs["BLOCK_M"])

    assert min_blocks_per_split(16, 512, 64, 576 * 2) == MIN_BLOCKS_PER_SPLIT
    assert splits(16, 4096, 16, 1, 576, 512, True) == 8  # 132 // 16
    assert splits(16, 32768, 16, 1, 576, 512, True) == 8
    assert splits(32, 4096, 16, 1, 576, 512, True) == 4
    assert splits(64, 4096, 16, 1, 576, 512, True) == 2
    assert splits(16, 4096, 128, 1, 576, 512, True) == 8  # 4 tiles of 32 rows a sequence: the wave's
    assert min_blocks_per_split(16, 512, 32, 576 * 2) == 8
    assert min_blocks_per_split(4, 128, 64, 256 * 2) == MIN_BLOCKS_PER_SPLIT  # GQA 32/8 at d128: the floor
    assert splits(16, 4096, 16, 1, 576, 512, True, page=64) == 16  # one wave would be 33, 4 blocks would allow 32
    assert splits(16, 8192, 16, 1, 576, 512, True, page=64) == 32
    assert splits(16, 16384, 16, 1, 576, 512, True, page=64) == 33  # the wave's
    assert splits(64, 4096, 16, 1, 576, 512, True, page=64) == 8
    # V read beside K counts too: the same shapes over separate K and V need fewer blocks a split
    assert min_blocks_per_split(16, 512, 32, (576 + 512) * 2) == 4
    assert splits(16, 4096, 16, 1, 576, 512, False) == 32


@pytest.mark.parametrize("bad, match", [
    (dict(v=(2, 9, 2, 16)), "k and v must have the same shape but for the last"),
    (dict(v=(2, 11, 2, 520)), r"v's head dim \(head_dim_v\) must be in \[1, 512\]"),
    (dict(k=(2, 11, 2, 24)), "q and k must have the same head_dim"),
])
def test_bad_shapes(device, bad, match):
    shapes = dict(q=(2, 7, 4, 32), k=(2, 11, 2, 32), v=(2, 11, 2, 16)) | bad
    q, k, v = (torch.zeros(shapes[n], dtype=torch.float16, device=device) for n in ("q", "k", "v"))
    with pytest.raises(ValueError, match=match):
        flashtile.flash_attn_func(q, k, v)


def test_bad_cache_shapes(device):
    q = torch.zeros(2, 1, 4, 32, dtype=torch.float16, device=device)
    k_cache = torch.zeros(2, 64, 2, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="k_cache and v_cache must have the same shape but for the last"):
        flashtile.flash_attn_with_kvcache(q, k_cache, torch.zeros(2, 63, 2, 16, dtype=torch.float16, device=device))
    v_cache = k_cache[..., :16]
    new = torch.zeros(2, 1, 2, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=r"v must have shape \(batch_size, seqlen_new, nheads_k, v_cache's"):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=3)


def test_hopper_reason():
    """The Gluon kernels take 128/128 and MLA prefill's 192/128, the Gluon forward 512/512 too; other pairs run the
    Triton kernels, and the reason says which pairs the kernel asked about takes."""
    from flashtile.ops.hopper import feature_unsupported
    for kernel in ("fwd", "bwd_dq", "bwd_dkdv"):
        assert feature_unsupported(torch.bfloat16, 128, head_dim_v=128, kernel=kernel) is None
        assert feature_unsupported(torch.bfloat16, 192, head_dim_v=128, kernel=kernel) is None
    assert feature_unsupported(torch.bfloat16, 128, head_dim_v=64) == (
        "head dims (q/k 128, v 64): the Gluon fwd kernel takes (128, 128), (192, 128), (512, 512)")
    assert feature_unsupported(torch.bfloat16, 512, head_dim_v=512) is None
    assert feature_unsupported(torch.bfloat16, 512, head_dim_v=512, kernel="bwd_dq") == (
        "head dims (q/k 512, v 512): the Gluon bwd_dq kernel takes (128, 128), (192, 128)")
    assert "(q/k 192, v 192)" in feature_unsupported(torch.bfloat16, 192)


def test_fake_shapes_and_compile(device):
    """The ops' fake functions give v's head dim (opcheck), and a compiled call (fullgraph) equals the eager one,
    gradients included."""
    from flashtile.ops.decode import decode
    from flashtile.ops.fwd import attention_fwd
    g = torch.Generator().manual_seed(12)
    q, k = (torch.randn(2, 9, 2, 32, generator=g).to(device, torch.float16) for _ in range(2))
    v = torch.randn(2, 9, 2, 16, generator=g).to(device, torch.float16)
    torch.library.opcheck(attention_fwd, op_args(attention_fwd, q=q, k=k, v=v, max_seqlen_q=9, max_seqlen_k=9,
                                                 softmax_scale=0.2, window_right=0),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(decode, op_args(decode, q=q[:, :1], k_cache=k, v_cache=v,
                                          cache_seqlens=torch.tensor([5, 9], dtype=torch.int32, device=device),
                                          rotary_interleaved=False, seqlen_new=0, softmax_scale=0.2,
                                          num_splits=1),
                          test_utils=("test_schema", "test_faketensor"))

    def fn(q, k, v):
        return flashtile.flash_attn_func(q, k, v, causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    results = []
    for f in (compiled, fn):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = f(*inputs)
        results.append((out, *torch.autograd.grad(out, inputs, torch.ones_like(out))))
    for got, want in zip(*results):
        assert got.shape == want.shape and torch.equal(got, want)


def test_narrow_v_tiles_reach_every_launch(monkeypatch):
    """config.NARROW_V's tiles (MLA prefill: q/k 192 padded to 256 beside v 128) are the ones a 192/128 call
    launches, forward, dQ and dK/dV alike, with the dQ kernel's varlen tile list; a d256 v keeps the table's.
    The launches as on an sm_90 GPU (capture_launches: recorded, not run) with the Gluon path off, as on other
    GPUs (on sm_90, 192/128 runs the Gluon kernels: tests/test_hopper.py)."""
    from flashtile import env
    from flashtile.config import NARROW_V, TABLE
    from flashtile.ops.launch import capture_launches

    monkeypatch.setattr(env, "INTERPRET", False)  # the GPU's tile table, not the interpreter's tiles
    monkeypatch.setenv("FLASHTILE_HOPPER", "0")
    cu = torch.tensor([0, 100, 137, 300], dtype=torch.int32)
    for dv, tiles in ((128, NARROW_V), (256, {kernel: {(256, 256): TABLE[kernel][256]} for kernel in TABLE})):
        q, k = (torch.randn(300, 4, 192, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        v = torch.randn(300, 4, dv, dtype=torch.bfloat16, requires_grad=True)
        with capture_launches() as launches:
            out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 163, 163, causal=True)
            out.backward(torch.randn_like(out))
        by_kernel = {launch.kernel.__name__: launch for launch in launches}
        for name, kernel in (("_attn_fwd_kernel", "fwd"), ("_bwd_dq_kernel", "bwd_dq"),
                             ("_bwd_dkdv_kernel", "bwd_dkdv")):
            cfg = tiles[kernel][(256, dv)]
            kwargs = by_kernel[name].kwargs
            assert (kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_warps"], kwargs["num_stages"]) == (
                cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages), (dv, name)
        dq = tiles["bwd_dq"][(256, dv)]
        assert by_kernel["_bwd_dq_kernel"].kwargs["LISTED"]
        assert any(launch.kwargs.get("BLOCK") == dq.block_m for launch in launches
                   if launch.kernel.__name__ == "_plan_kernel"), dv
