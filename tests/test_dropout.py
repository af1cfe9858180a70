"""Dropout, as flash-attn 2 does it (Note [dropout mask] in kernels/dropout.py, Note [dropout seed] in
ops/dropout.py): forward and backward against the fp64 reference that applies the mask the call returns in S_dmask
(2x / 3x PyTorch's error rule), the mask's statistics, its reproducibility and independence, and the argument's
rules. Inputs are carved out of NaN-filled buffers."""

import math

import pytest
import torch
import triton
import triton.language as tl

import flashtile
from flashtile.kernels.dropout import PHILOX_ROUNDS, keep_mask, keep_words, packed_keep, packed_threshold, philox
from flashtile.testing import accumulation_floor, attention_ref, check_close, nan_guarded, varlen_inputs

P = 0.17


def _rounded(n):
    return -(-n // 128) * 128


def _check(q, k, v, dout, out, lse, grads, keep, p, **kw):
    """The 2x / 3x rule against attention_ref with the keep mask; q, k, v, dout (B, S, H, D)."""
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse, probs = attention_ref(*ref_in, **kw, dropout_mask=keep, dropout_p=p, return_probs=True)
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout.double())
    floors = accumulation_floor(q, k, v, dout, ref_out, probs)
    pt_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    pt_out, pt_lse = attention_ref(*pt_in, **kw, upcast=False, dropout_mask=keep, dropout_p=p)
    pt_grads = torch.autograd.grad(pt_out, pt_in, dout)
    check_close("out", out, ref_out, pt_out, 2, floor=floors["out"])
    check_close("lse", lse, ref_lse, pt_lse.to(q.dtype), 2, floor=floors["lse"])
    scale = max(g.abs().max().item() for g in ref_grads)
    for name, ours, ref, pt in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
        check_close(name, ours, ref, pt, 3, scale, floor=floors[name])
    return probs


def dropout_case(device, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype, p=P, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    q = nan_guarded((batch, seqlen_q, nheads, head_dim), dtype, device, g)
    k = nan_guarded((batch, seqlen_k, nheads_kv, head_dim), dtype, device, g)
    v = nan_guarded((batch, seqlen_k, nheads_kv, head_dim), dtype, device, g)
    dout = torch.randn(batch, seqlen_q, nheads, head_dim, generator=g).to(device, dtype)
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, s_dmask = flashtile.flash_attn_func(*inputs, dropout_p=p, return_attn_probs=True, **kw)
    grads = torch.autograd.grad(out, inputs, dout)
    assert s_dmask.shape == (batch, nheads, _rounded(seqlen_q), _rounded(seqlen_k))
    assert s_dmask.dtype == torch.float32
    assert not s_dmask[:, :, seqlen_q:].any() and not s_dmask[:, :, :, seqlen_k:].any()
    s = s_dmask[:, :, :seqlen_q, :seqlen_k]
    keep = s >= 0
    probs = _check(q, k, v, dout, out, lse, grads, keep, p, **kw)
    # Magnitudes: the undropped softmax's probabilities (module docstring of ops/dropout.py).
    undropped = probs * (1 - p)
    undropped = torch.where(keep, undropped, attention_ref(*(t.double() for t in (q, k, v)), **kw,
                                                           return_probs=True)[2])
    assert torch.allclose(s.abs().double(), undropped.clamp_min(1.1754943508222875e-38), rtol=5e-3, atol=2e-3)
    return keep


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("seqlens", [(33, 65), (65, 33), (1, 70)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_dropout_against_the_reference(device, mask, seqlens, dtype):
    kw = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(8, 4))}[mask]
    dropout_case(device, 2, *seqlens, 2, 2, 32, dtype, **kw)


@pytest.mark.parametrize("features", ["gqa", "softcap_alibi", "causal_window", "head_dim_40", "head_dim_512"])
def test_dropout_with_other_features(device, features):
    if features == "gqa":
        dropout_case(device, 2, 40, 56, 4, 2, 32, torch.float16, causal=True)
    elif features == "softcap_alibi":
        slopes = torch.rand(2, 2, generator=torch.Generator().manual_seed(3)).to(device) * 0.3
        dropout_case(device, 2, 33, 47, 2, 2, 32, torch.float16, softcap=5.0, alibi_slopes=slopes)
    elif features == "causal_window":
        dropout_case(device, 1, 70, 50, 2, 1, 64, torch.bfloat16, causal=True, window_size=(12, -1))
    elif features == "head_dim_40":
        dropout_case(device, 1, 29, 31, 2, 2, 40, torch.float16)
    else:  # S_dmask's tile at head dim 512 once needed 256 KiB of shared memory (tools/stress.py found it)
        dropout_case(device, 1, 17, 20, 2, 1, 512, torch.float16, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 512])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_at_the_gpu_tiles(device, head_dim, causal):
    """Lengths that cross several of the GPU table's tiles, which differ with dropout (config.DROPOUT: the d64
    dK/dV kernel's 64 x 64), and odd lengths whose last tiles are partial. On an H200, d128 without a causal mask
    runs the Gluon forward and d512 the Gluon split-columns forward, whose 32-key blocks start inside a 64-key
    unit of the mask every other block (keep_words' narrow tiles): the mask must still be the backward's."""
    dropout_case(device, 2, 300, 333, 4, 2, head_dim, torch.bfloat16, causal=causal)


def test_dropout_varlen_and_packed(device):
    """flash_attn_varlen_func: S_dmask is (B, H, max_seqlen_q and max_seqlen_k rounded up to 128), sequence b's
    entries in its top-left corner, checked per sequence; the qkv-packed form too."""
    g = torch.Generator().manual_seed(5)
    lens_q, lens_k = [20, 1, 45], [33, 17, 45]
    q, k, v, dout, cu_q, cu_k = varlen_inputs(device, lens_q, lens_k, 4, 2, seed=5)
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, s_dmask = flashtile.flash_attn_varlen_func(*inputs, cu_q, cu_k, 45, 45, dropout_p=0.3, causal=True,
                                                         return_attn_probs=True)
    grads = torch.autograd.grad(out, inputs, dout)
    assert s_dmask.shape == (3, 4, 128, 128)
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        keep = s_dmask[b:b + 1, :, :sq, :sk] >= 0
        assert not s_dmask[b, :, sq:].any() and not s_dmask[b, :, :, sk:].any()
        _check(q[None, rq], k[None, rk], v[None, rk], dout[None, rq], out[None, rq], lse[None, :, rq],
               [grads[0][None, rq], grads[1][None, rk], grads[2][None, rk]], keep, 0.3, causal=True)

    qkv = torch.randn(sum(lens_k), 3, 2, 32, generator=g).to(device, torch.float16).requires_grad_()
    out, _, s_dmask = flashtile.flash_attn_varlen_qkvpacked_func(qkv, cu_k, 45, dropout_p=0.3,
                                                                 return_attn_probs=True)
    dqkv, = torch.autograd.grad(out, qkv, torch.ones_like(out))
    assert s_dmask.shape == (3, 2, 128, 128) and torch.isfinite(dqkv).all()


def test_dropped_fraction_is_the_quantised_p(device):
    """Per row and overall, the dropped fraction of the visible entries is threshold / 256 = round(256 p) / 256
    (Note [dropout mask]: 8-bit numbers), within 5 binomial standard deviations; masks of different heads,
    sequences and calls are independent (they agree on q^2 + (1 - q)^2 of the entries, q the dropped fraction), and
    torch.manual_seed reproduces a call's mask bit for bit."""
    p = 0.3
    q_drop = round(p * 256) / 256  # 77 / 256 = 0.30078
    assert abs(q_drop - p) <= 2**-9
    q, k, v = (torch.randn(2, 96, 2, 16, generator=torch.Generator().manual_seed(i)).to(device, torch.float16)
               for i in range(3))
    torch.manual_seed(1234)
    _, _, s1 = flashtile.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    _, _, s2 = flashtile.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    torch.manual_seed(1234)
    out3, _, s3 = flashtile.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    drop1, drop2, drop3 = ((s[:, :, :96, :96] < 0) for s in (s1, s2, s3))
    assert torch.equal(drop1, drop3)
    n = drop1.numel()
    assert abs(drop1.float().mean().item() - q_drop) <= 5 * math.sqrt(q_drop * (1 - q_drop) / n)
    rows = drop1.float().mean(-1)
    assert (rows - q_drop).abs().max().item() <= 5 * math.sqrt(q_drop * (1 - q_drop) / 96)
    agree = q_drop * q_drop + (1 - q_drop) * (1 - q_drop)
    sigma = math.sqrt(agree * (1 - agree) / (n / 2))
    for a, b in ((drop1[:, 0], drop1[:, 1]), (drop1[0], drop1[1]), (drop1, drop2)):
        assert abs((a == b).float().mean().item() - agree) <= 5 * sigma

    torch.manual_seed(1234)
    assert torch.equal(flashtile.flash_attn_func(q, k, v, dropout_p=p), out3)


@triton.jit
def _keep_kernel(OUT, seed, stream, bh, threshold, ROWS: tl.constexpr, COLS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ENTRIES: tl.constexpr):
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if ENTRIES:
        c, t = packed_threshold(threshold)
        word, byte = keep_words(seed, stream, bh, i[:, None], tl.program_id(1) * BLOCK_N,
                                tl.arange(0, BLOCK_N)[None, :], c, t, BLOCK_N)
        keep = ((word >> (8 * byte + 7).to(tl.uint32)) & 1) != 0  # the bit the Gluon kernels' PRMT reads
    else:
        keep = keep_mask(seed, stream, bh, i[:, None], tl.program_id(1) * BLOCK_N, threshold, BLOCK_M, BLOCK_N)
    tl.store(OUT + i[:, None] * COLS + j[None, :], keep.to(tl.int8))


def _keep(device, rows, cols, block_m, block_n, threshold, seed=1234, stream=7, bh=5, entries=False):
    """keep_mask's booleans over (rows, cols), or keep_words' (the Gluon kernels': tiles of 32 keys or more)."""
    out = torch.empty(rows, cols, dtype=torch.int8, device=device)
    _keep_kernel[(rows // block_m, cols // block_n)](out, seed, stream, bh, threshold, rows, cols, block_m, block_n,
                                                     entries)
    return out.cpu()


def test_the_mask_does_not_depend_on_the_tile(device):
    """keep_mask's bits for one (seed, stream, b * H + h) from tiles 8 to 128 keys wide (narrower than the 64-key
    unit of four Philox calls, one unit, two) and 16 or 32 rows high are the same (Note [dropout mask]): the
    interpreter's kernels use 16- and 32-key tiles, the GPU's 16 to 128, and the forward, both backward kernels and
    S_dmask's kernel each their own. A tile starts at any multiple of its width, so the narrow ones take every part
    of a unit. The dropped fraction is 77 / 256 (p = 0.3)."""
    masks = [_keep(device, 64, 256, block_m, block_n, 77)
             for block_m, block_n in ((16, 8), (32, 16), (16, 32), (32, 64), (16, 128))]
    assert all(torch.equal(m, masks[0]) for m in masks[1:])
    assert abs(1 - masks[0].float().mean().item() - 77 / 256) < 0.02


@triton.jit
def _philox_words(OUT, seed, stream, bh, ROWS: tl.constexpr, CALLS: tl.constexpr):
    zero = tl.zeros([ROWS, CALLS], dtype=tl.int32)
    r0, r1, r2, r3 = tl.philox(seed, tl.arange(0, CALLS)[None, :] + zero, tl.arange(0, ROWS)[:, None] + zero,
                               bh + zero, stream + zero, PHILOX_ROUNDS)
    at = OUT + (tl.arange(0, ROWS)[:, None] * CALLS + tl.arange(0, CALLS)[None, :]) * 4
    tl.store(at, r0.to(tl.int64) & 0xFFFFFFFF)
    tl.store(at + 1, r1.to(tl.int64) & 0xFFFFFFFF)
    tl.store(at + 2, r2.to(tl.int64) & 0xFFFFFFFF)
    tl.store(at + 3, r3.to(tl.int64) & 0xFFFFFFFF)


def test_the_mask_is_the_notes_mapping(device):
    """Key 64 (c // 4) + 8 g + 2 (c % 4) + e of a row survives iff byte 2 g + e of Philox call c's four words (word
    g // 2, bits 8 (2 (g % 2) + e) up) is at least the threshold (Note [dropout mask]), built here from the raw
    words, at thresholds from none dropped to all; keep_words' packed bits (Note [packed keep bits]) too, on both
    sides of 128 where their test changes form."""
    rows, cols = 16, 128
    words = torch.empty(rows, cols // 16, 4, dtype=torch.int64, device=device)
    _philox_words[(1,)](words, 1234, 7, 5, rows, cols // 16)
    words = words.cpu()
    numbers = torch.empty(rows, cols, dtype=torch.int64)
    for c in range(cols // 16):
        for g in range(8):
            for e in range(2):
                numbers[:, 64 * (c // 4) + 8 * g + 2 * (c % 4) + e] = words[:, c, g // 2] >> 8 * (2 * (g % 2) + e)
    numbers &= 0xFF
    for threshold in (0, 1, 77, 127, 128, 129, 200, 255, 256):
        for block_n in (16, 64, 128):
            assert torch.equal(_keep(device, rows, cols, 16, block_n, threshold).bool(), numbers >= threshold), \
                (threshold, block_n)
        for block_n in (32, 64, 128):
            entries = _keep(device, rows, cols, 16, block_n, threshold, entries=True).bool()
            assert torch.equal(entries, numbers >= threshold), (threshold, block_n, "keep_words")


@triton.jit
def _philox_pair_kernel(OURS, TRITONS, SEEDS, COUNTERS, N: tl.constexpr):
    seed = tl.load(SEEDS + tl.program_id(0))
    at = tl.arange(0, N)
    c0 = tl.load(COUNTERS + 4 * at)
    c1 = tl.load(COUNTERS + 4 * at + 1)
    c2 = tl.load(COUNTERS + 4 * at + 2)
    c3 = tl.load(COUNTERS + 4 * at + 3)
    ours = philox(seed, c0, c1, c2, c3)
    theirs = tl.philox(seed, c0, c1, c2, c3, PHILOX_ROUNDS)
    out = (tl.program_id(0) * N + at) * 4
    for w in tl.static_range(4):
        tl.store(OURS + out + w, ours[w].to(tl.int64) & 0xFFFFFFFF)
        tl.store(TRITONS + out + w, theirs[w].to(tl.int64) & 0xFFFFFFFF)


def test_philox_is_tritons(device):
    """kernels/dropout.philox (each product one mul.wide on a GPU) gives tl.philox's words bit for bit, for seeds
    with and without their high word and counters over the whole int32 range."""
    seeds = torch.tensor([0, 1, 2**31 - 1, 2**32 + 5, -1, -(2**62) + 3], dtype=torch.int64, device=device)
    counters = torch.randint(-(2**31), 2**31, (64, 4), generator=torch.Generator().manual_seed(3),
                             dtype=torch.int64).to(torch.int32).to(device)
    ours = torch.empty(len(seeds), 64, 4, dtype=torch.int64, device=device)
    theirs = torch.empty_like(ours)
    _philox_pair_kernel[(len(seeds),)](ours, theirs, seeds, counters, 64)
    assert torch.equal(ours, theirs)
    assert ours.unique().numel() > 0.99 * ours.numel()


@triton.jit
def _packed_keep_kernel(OUT, WORDS: tl.constexpr):
    c, t = packed_threshold(tl.program_id(0))
    k = tl.arange(0, WORDS)  # word k holds the bytes 4k .. 4k + 3, byte 4k + b at bits 8b up
    x = ((4 * k) | ((4 * k + 1) << 8) | ((4 * k + 2) << 16) | ((4 * k + 3) << 24)).to(tl.uint32)
    tl.store(OUT + tl.program_id(0) * WORDS + k, packed_keep(x, c, t).to(tl.int64) & 0x80808080)


def test_the_packed_keep_bits_are_the_byte_test(device):
    """Every byte against every threshold: packed_keep's bit 8 b + 7 of a word is set iff its byte b reaches the
    threshold, four bytes a word (Note [packed keep bits]; the form changes above 128)."""
    out = torch.empty(257, 64, dtype=torch.int64, device=device)
    _packed_keep_kernel[(257,)](out, 64)
    out = out.cpu()
    bits = torch.stack([(out >> (8 * b + 7)) & 1 for b in range(4)], -1).reshape(257, 256).bool()
    assert torch.equal(bits, torch.arange(256)[None, :] >= torch.arange(257)[:, None])


def test_backward_reruns_regenerate_the_forward_mask(device):
    """The backward reads the forward's seed (saved with the graph), not the generator: reruns on one graph give
    the same bits, and the generator drawn in between changes nothing."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 40, 2, 32, generator=g).to(device, torch.float16).requires_grad_() for _ in range(3))
    dout = torch.randn(1, 40, 2, 32, generator=g).to(device, torch.float16)
    out = flashtile.flash_attn_func(q, k, v, dropout_p=0.25, causal=True, deterministic=True)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.rand(10, device=device)  # advances the generator
    second = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_rows_that_see_no_key_stay_zero(device):
    """Under a bottom-right causal mask with more queries than keys the first rows see no key: their output and
    gradient are 0 with dropout too, and their S_dmask row holds no surviving probability."""
    q = torch.randn(1, 70, 2, 16, device=device, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(1, 3, 2, 16, device=device, dtype=torch.float16, requires_grad=True) for _ in range(2))
    out, lse, s_dmask = flashtile.flash_attn_func(q, k, v, dropout_p=0.5, causal=True, return_attn_probs=True)
    assert not out[:, :67].any() and torch.isinf(lse[:, :, :67]).all()
    assert not (s_dmask[:, :, :67, :3] > 0).any()
    dq, = torch.autograd.grad(out, q, torch.ones_like(out))
    assert not dq[:, :67].any()


def test_zero_dropout_is_the_plain_path(device):
    """dropout_p = 0.0 runs the kernels without dropout (the flag is off): bitwise the default call, an empty
    S_dmask, and the generator untouched."""
    q, k, v = (torch.randn(1, 33, 2, 32, generator=torch.Generator().manual_seed(i)).to(device, torch.float16)
               for i in range(3))
    state = torch.random.get_rng_state()
    out, lse, s_dmask = flashtile.flash_attn_func(q, k, v, dropout_p=0.0, return_attn_probs=True)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(out, flashtile.flash_attn_func(q, k, v)) and s_dmask.numel() == 0


@pytest.mark.parametrize("p, exc", [(1.0, ValueError), (-0.01, ValueError), (float("nan"), ValueError),
                                    (float("inf"), ValueError), (True, TypeError), (None, TypeError)])
def test_bad_dropout_values(device, p, exc):
    q = torch.randn(1, 8, 2, 16, device=device, dtype=torch.float16)
    with pytest.raises(exc, match="dropout_p"):
        flashtile.flash_attn_func(q, q, q, dropout_p=p)
    with pytest.raises(exc, match="dropout_p"):
        flashtile.flash_attn_varlen_func(q[0], q[0], q[0], *(torch.tensor([0, 8], dtype=torch.int32,
                                                                          device=device),) * 2, 8, 8, dropout_p=p)


def test_dropout_under_torch_compile(device):
    """fullgraph torch.compile traces the seed's draw and both ops; the compiled call is a valid dropout: it
    matches the reference built from its own S_dmask."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 33, 2, 32, generator=g).to(device, torch.float16) for _ in range(3))
    dout = torch.randn(1, 33, 2, 32, generator=g).to(device, torch.float16)

    def f(q, k, v):
        return flashtile.flash_attn_func(q, k, v, dropout_p=0.2, causal=True, return_attn_probs=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, s_dmask = compiled(*inputs)
    grads = torch.autograd.grad(out, inputs, dout)
    _check(q, k, v, dout, out, lse, grads, s_dmask[:, :, :33, :33] >= 0, 0.2, causal=True)


@pytest.mark.gpu
def test_each_cuda_graph_replay_draws_a_new_mask(device):
    """A captured call draws its seed inside the graph (Note [dropout seed]): every replay gets a fresh mask, as
    PyTorch's own dropout does, and each replay's output is a valid dropout of the same inputs."""
    q, k, v = (torch.randn(2, 256, 4, 64, device=device, dtype=torch.bfloat16) for _ in range(3))
    flashtile.flash_attn_func(q, k, v, dropout_p=0.1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashtile.flash_attn_func(q, k, v, dropout_p=0.1)
    outs = []
    for _ in range(3):
        graph.replay()
        outs.append(out.clone())
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
    plain = flashtile.flash_attn_func(q, k, v)
    for o in outs:  # dropout noise around the undropped output, no NaN
        assert torch.isfinite(o).all() and (o.float() - plain.float()).abs().mean() < 0.5


def test_dropout_tiles_reach_every_launch(monkeypatch):
    """config.DROPOUT's tiles are the ones a call with dropout launches, forward, dQ and dK/dV alike, with the host
    descriptor boxes and the varlen tile list that go with them (ops/fwd.py, ops/bwd.py, schedule.list_blocks).
    The launches as on an sm_90 GPU (capture_launches: recorded, not run)."""
    from flashtile import env
    from flashtile.config import DROPOUT, TileConfig
    from flashtile.ops.launch import capture_launches

    monkeypatch.setattr(env, "INTERPRET", False)  # the GPU's tile table, not the interpreter's tiles
    tiles = {"fwd": (128, 32), "bwd_dq": (128, 16), "bwd_dkdv": (32, 64)}
    for kernel, (m, n) in tiles.items():
        monkeypatch.setitem(DROPOUT, kernel, {64: TileConfig(m, n, 8, 2, "test")})
    q, k, v = (torch.randn(300, 4, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 100, 137, 300], dtype=torch.int32)
    with capture_launches() as launches:
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 163, 163, dropout_p=0.2)
        out.backward(torch.randn_like(out))
    by_kernel = {launch.kernel.__name__: launch for launch in launches}
    for name, kernel in (("_attn_fwd_kernel", "fwd"), ("_bwd_dq_kernel", "bwd_dq"), ("_bwd_dkdv_kernel", "bwd_dkdv")):
        kwargs = by_kernel[name].kwargs
        assert (kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_warps"]) == (*tiles[kernel], 8), name
    boxes = [list(a.block_shape) for a in by_kernel["_attn_fwd_kernel"].args if hasattr(a, "block_shape")]
    assert boxes[:3] == [[128, 1, 64], [32, 1, 64], [32, 1, 64]]  # Q, K, V of the packed batch
    boxes = [list(a.block_shape) for a in by_kernel["_bwd_dq_kernel"].args if hasattr(a, "block_shape")]
    assert boxes == [[16, 1, 64], [16, 1, 64]]  # the dQ kernel streams K and V
    assert by_kernel["_bwd_dq_kernel"].kwargs["LISTED"]
    assert any(launch.kwargs.get("BLOCK") == 128 for launch in launches if launch.kernel.__name__ == "_plan_kernel")
