"""Head dims past 256: 512 (Gemma 4's global layers) forward and backward, dense and varlen, and decode; DeepSeek's
absorbed MLA decode, q/k 576 over a v_cache view of the cache's first 512 channels. Against the fp64 reference (2x /
3x rule) at odd lengths, head dims below their 512/1024-wide tiles included; the argument limits. Inputs are
carved out of NaN-filled buffers."""

import pytest
import torch

import flashtile
from flashtile.problem import MAX_DECODE_HEAD_DIM, MAX_HEAD_DIM
from flashtile.testing import (attention_ref, check_attention, check_close, kvcache_inputs, nan_guarded,
                               varlen_inputs)


def wide_case(device, seqlen_q, seqlen_k, head_dim, dtype=torch.float16, head_dim_v=None, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    head_dim_v = head_dim_v or head_dim
    q = nan_guarded((1, seqlen_q, 2, head_dim), dtype, device, g)
    k = nan_guarded((1, seqlen_k, 1, head_dim), dtype, device, g)
    v = nan_guarded((1, seqlen_k, 1, head_dim_v), dtype, device, g)
    dout = torch.randn(1, seqlen_q, 2, head_dim_v, generator=g).to(device, dtype)
    check_attention(q, k, v, dout, **kw)


@pytest.mark.parametrize("head_dim", [512, 296])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_dense(device, mask, head_dim):
    """Odd lengths; 296 sits in the 512-wide tile with most columns masked."""
    wide_case(device, 33, 47, head_dim, causal=mask == "causal")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_dtypes(device, dtype):
    wide_case(device, 19, 19, 512, dtype, causal=True, window_size=(7, -1))


def test_v_narrower(device):
    """q/k 512 with v 256, and q/k 64 with v 512."""
    wide_case(device, 21, 30, 512, head_dim_v=256, causal=True)
    wide_case(device, 21, 30, 64, head_dim_v=512, causal=True)


def test_v_parts_read_their_head(device):
    """A V 512 wide runs as two programs per query tile, each half of V's columns (Note [V parts] in
    kernels/fwd.py): the features that read the query head (ALiBi, sinks, GQA) must see the head, not the part."""
    slopes = torch.tensor([0.25, 0.5], device=device)
    sink = torch.tensor([1.5, -0.5], device=device)
    wide_case(device, 25, 40, 512, causal=True, alibi_slopes=slopes, learnable_sink=sink, seed=6)
    wide_case(device, 25, 40, 512, torch.bfloat16, window_size=(11, 3), learnable_sink=sink, seed=7)


def test_v_parts_launch(monkeypatch):
    """Which Triton forwards split V (16-bit inputs with v 512 wide) and the grid that gives them: two programs per
    (query tile, head), each seeing a part's head dim. The Hopper path is off, as on a GPU other than sm_90 (on
    one, q/k/v 512 runs the Gluon forward: test_hopper.py)."""
    from flashtile import env
    from flashtile.ops.launch import capture_launches

    monkeypatch.setattr(env, "INTERPRET", False)
    monkeypatch.setenv("FLASHTILE_HOPPER", "0")
    for dtype, dv, parts in ((torch.float16, 512, 2), (torch.bfloat16, 512, 2), (torch.float32, 512, 1),
                             (torch.float16, 256, 1), (torch.float16, 448, 1)):
        q, k = (torch.randn(2, 70, 3, 512).to(dtype) for _ in range(2))
        v = torch.randn(2, 70, 3, dv).to(dtype)
        with capture_launches() as launches:
            flashtile.flash_attn_func(q, k, v, causal=True)
        (launch,) = launches
        assert launch.kwargs["V_PARTS"] == parts, (dtype, dv)
        assert launch.kwargs["HEAD_DIM_V"] == dv // parts, (dtype, dv)
        assert launch.grid[1:] == (3 * parts, 2), (dtype, dv)


def test_paged_v_parts(device, monkeypatch):
    """A paged varlen prefill at d512: the parts gather V's rows by pointer (kernels/fwd.py, PAGED), each its half
    of the columns, from a NaN-filled cache whose pages come in random order; bitwise the Triton forward over the
    contiguous tensors (on sm_90 these run the Gluon forward unless the Hopper path is off)."""
    from test_varlen import paginate

    monkeypatch.setenv("FLASHTILE_HOPPER", "0")
    lens = [9, 1, 37]
    q, k, v, _, cu, _ = varlen_inputs(device, lens, lens, nheads=2, nheads_kv=1, head_dim=512, seed=8)
    want = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    k_cache, v_cache, table = paginate(k, v, lens, 16, torch.Generator().manual_seed(8))
    got = flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cu, cu, max(lens), max(lens), causal=True,
                                           block_table=table)
    assert torch.equal(got, want)


def test_varlen(device):
    varlen_case(device, [9, 0, 1, 37], 2, seed=4)


def varlen_case(device, lens, nheads, seed):
    """A causal fp16 d512 varlen forward over sequences of `lens` (0 allowed) against the fp64 reference, sequence
    by sequence."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (nan_guarded((sum(lens), nheads, 512), torch.float16, device, g) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    for b in range(len(lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if rows.start == rows.stop:
            continue
        ref, _ = attention_ref(*(t[rows][None].double() for t in (q, k, v)), causal=True)
        base, _ = attention_ref(*(t[rows][None] for t in (q, k, v)), causal=True, upcast=False)
        check_close(f"out[{b}]", out[None, rows], ref, base, 2)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("page_size", [None, 16])
def test_decode_512(device, page_size, num_splits):
    x = kvcache_inputs(device, 2, 48, 4, 2, 512, 1, page_size, seed=5)
    seqlens = torch.tensor([17, 40], dtype=torch.int32, device=device)
    out = flashtile.flash_attn_with_kvcache(x["q"], x["k_cache"], x["v_cache"], x["k"], x["v"],
                                            cache_seqlens=seqlens, num_splits=num_splits, **x["kwargs"])
    for b in range(2):
        s = int(seqlens[b])
        keys, values = (torch.cat([c[b:b + 1, :s], n[b:b + 1]], 1) for c, n in
                        ((x["logical_k"], x["k"]), (x["logical_v"], x["v"])))
        ref, _ = attention_ref(x["q"][b:b + 1].double(), keys.double(), values.double())
        base, _ = attention_ref(x["q"][b:b + 1], keys, values, upcast=False)
        check_close(f"out[{b}]", out[b:b + 1], ref, base, 2)


@pytest.mark.parametrize("page_size", [None, 16])
def test_deepseek_absorbed_decode(device, page_size):
    """DeepSeek-V3's absorbed MLA decode: 16 query heads on one latent head of 576 channels, v_cache the view of
    its first 512 (one storage), one new token appended, split-KV; equal to the reference, and paged to the same
    call over separate K and V tensors (the same tile; a contiguous absorbed cache runs the keys-major one, Note
    [keys-major decode] in ops/decode.py, whose sums run in another order: both are held to the reference)."""
    batch, cap, h = 2, 32, 16
    g = torch.Generator().manual_seed(6)
    latent = torch.randn(batch, cap, 1, 576, generator=g).to(device, torch.bfloat16)
    q = torch.randn(batch, 1, h, 576, generator=g).to(device, torch.bfloat16)
    new = torch.randn(batch, 1, 1, 576, generator=g).to(device, torch.bfloat16)
    seqlens = torch.tensor([9, 30], dtype=torch.int32, device=device)
    kw = dict(softmax_scale=192 ** -0.5, num_splits=2)
    if page_size:
        cache = latent.reshape(-1, page_size, 1, 576).clone()
        kw["block_table"] = torch.arange(batch * cap // page_size, dtype=torch.int32,
                                         device=device).reshape(batch, -1)
    else:
        cache = latent.clone()
    out = flashtile.flash_attn_with_kvcache(q, cache, cache[..., :512], new, new[..., :512], cache_seqlens=seqlens,
                                            **kw)
    assert out.shape == (batch, 1, h, 512)
    separate = flashtile.flash_attn_with_kvcache(q, cache.clone(), cache[..., :512].clone(),
                                                 cache_seqlens=seqlens + 1, **kw)
    if page_size:
        assert torch.equal(out, separate)
    for b in range(batch):
        s = int(seqlens[b])
        keys = torch.cat([latent[b:b + 1, :s], new[b:b + 1]], 1)
        ref, _ = attention_ref(q[b:b + 1].double(), keys.double(), keys[..., :512].double(),
                               softmax_scale=kw["softmax_scale"])
        base, _ = attention_ref(q[b:b + 1], keys, keys[..., :512], softmax_scale=kw["softmax_scale"], upcast=False)
        check_close(f"out[{b}]", out[b:b + 1], ref, base, 2)
        check_close(f"separate[{b}]", separate[b:b + 1], ref, base, 2)


@pytest.mark.parametrize("case", ["causal sink", "window", "alibi softcap", "leftpad", "two tokens"])
def test_keys_major_decode_features(device, case):
    """The keys-major decode tile (kernels/decode.py: KEYS_M; an absorbed 576/512 cache over contiguous storage at up
    to 16 packed rows) under each mask and logit feature, against the fp64 reference: its masks, ALiBi and sink take
    the score tile transposed. "two tokens": 8 heads x 2 query tokens packed into its 16 rows, causal."""
    from flashtile import config
    assert isinstance(config.decode_config(576, False, 16, True), config.KeysMajorTile)
    batch, cap = 2, 40
    h, sq = (8, 2) if case == "two tokens" else (16, 1)
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(batch, cap, 1, 576, generator=g).to(device, torch.bfloat16)
    q = torch.randn(batch, sq, h, 576, generator=g).to(device, torch.bfloat16)
    seqlens = torch.tensor([37, 21], dtype=torch.int32, device=device)
    leftpad = torch.tensor([5, 0], dtype=torch.int32, device=device) if case == "leftpad" else None
    kw = dict(softmax_scale=192 ** -0.5, causal=case in ("causal sink", "two tokens", "leftpad"))
    if case == "causal sink":
        kw["learnable_sink"] = torch.randn(h, generator=g).to(device)
    if case == "window":
        kw["window_size"] = (9, 0)
    if case == "alibi softcap":
        kw["alibi_slopes"], kw["softcap"] = (torch.rand(batch, h, generator=g) * 0.3).to(device), 3.0
    out = flashtile.flash_attn_with_kvcache(q, cache, cache[..., :512], cache_seqlens=seqlens, cache_leftpad=leftpad,
                                            num_splits=3, **kw)
    ref_kw = {k: v for k, v in kw.items() if k != "alibi_slopes"}
    for b in range(batch):
        lo = 0 if leftpad is None else int(leftpad[b])
        keys = cache[b:b + 1, lo:int(seqlens[b])]
        if "alibi_slopes" in kw:
            ref_kw["alibi_slopes"] = kw["alibi_slopes"][b:b + 1]
        ref, _ = attention_ref(q[b:b + 1].double(), keys.double(), keys[..., :512].double(), **ref_kw)
        base, _ = attention_ref(q[b:b + 1], keys, keys[..., :512], upcast=False, **ref_kw)
        check_close(f"out[{b}]", out[b:b + 1], ref, base, 2)


def test_limits(device):
    """Prefill head dims up to 512; flash_attn_with_kvcache's q/k up to 576 (its v still 512)."""
    assert (MAX_HEAD_DIM, MAX_DECODE_HEAD_DIM) == (512, 576)
    z = lambda *shape: torch.zeros(*shape, dtype=torch.float16, device=device)  # noqa: E731
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 512\], got 520"):
        flashtile.flash_attn_func(z(1, 4, 1, 520), z(1, 4, 1, 520), z(1, 4, 1, 520))
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 512\], got 576"):
        flashtile.flash_attn_func(z(1, 4, 1, 576), z(1, 4, 1, 576), z(1, 4, 1, 512))
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 576\], got 584"):
        flashtile.flash_attn_with_kvcache(z(1, 1, 1, 584), z(1, 8, 1, 584), z(1, 8, 1, 512))
    with pytest.raises(ValueError, match=r"v_cache's head dim \(head_dim_v\) must be in \[1, 512\], got 576"):
        flashtile.flash_attn_with_kvcache(z(1, 1, 1, 576), z(1, 8, 1, 576), z(1, 8, 1, 576))
