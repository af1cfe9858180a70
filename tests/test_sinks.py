"""Learnable attention sinks (gpt-oss; FlashAttention-4's `learnable_sink`): a logit per query head that joins every
row's softmax denominator and contributes no value. Forward, lse and every gradient (the sink's too, by autograd on
the fp64 reference) under the 2x / 3x rule, on every entry point; the decode path against the reference; the
argument's rules. Inputs are carved out of NaN-filled buffers."""

import pytest
import torch

import flashtile
from flashtile.testing import accumulation_floor, attention_ref, check_close, kvcache_inputs, nan_guarded, varlen_inputs


def _sink(nheads, dtype=torch.float32, device="cpu", seed=0):
    # Logits of the size of a row's own: a sink that takes a visible share of each row.
    return (torch.randn(nheads, generator=torch.Generator().manual_seed(seed)) * 2).to(device, dtype)


def _dsink_floor(ref_sink, ref_lse, ref_out, dout, out):
    """Entry-wise floor for dsink = -sum_i P_sink,i delta_i. delta = rowsum(dO * O) is computed from the output the
    forward returned, in the input dtype (as flash-attn's backward computes it): the floor holds exactly what using
    that output instead of the reference's changes in the sum, plus 2 fp32 epsilons of the magnitude of the terms
    (the kernels' fp32 sums, as testing.accumulation_floor)."""
    p_sink = torch.where(torch.isinf(ref_lse), 0.0, torch.exp(ref_sink.detach().view(1, -1, 1) - ref_lse.detach()))
    ref = ref_out.detach().double()
    stored = (dout.double() * (out.detach().double() - ref)).sum(-1).transpose(1, 2)  # (B, H, Sq)
    terms = (dout.double().abs() * ref.abs()).sum(-1).transpose(1, 2)
    return (p_sink * stored).sum((0, 2)).abs() + 2 * torch.finfo(torch.float32).eps * (p_sink * terms).sum((0, 2))


def _check_against_reference(q, k, v, sink, dout, out, lse, grads, **kw):
    """out, lse, dq, dk, dv, dsink against attention_ref with the sink (fp64 oracle; PyTorch in the input dtype as
    the baseline). q, k, v, dout as (B, S, H, D)."""
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
    ref_out, ref_lse, probs = attention_ref(*ref_in[:3], **kw, learnable_sink=ref_in[3], return_probs=True)
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout.double())
    floors = accumulation_floor(q, k, v, dout, ref_out, probs)
    pt_in = [t.detach().clone().requires_grad_() for t in (q, k, v)] + [sink.detach().clone().requires_grad_()]
    pt_out, pt_lse = attention_ref(*pt_in[:3], **kw, learnable_sink=pt_in[3], upcast=False)
    pt_grads = torch.autograd.grad(pt_out, pt_in, dout)
    check_close("out", out, ref_out, pt_out, 2, floor=floors["out"])
    check_close("lse", lse, ref_lse, pt_lse.to(q.dtype), 2, floor=floors["lse"])
    scale = max(g.abs().max().item() for g in ref_grads[:3])
    for name, ours, ref, pt in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3], pt_grads[:3]):
        check_close(name, ours, ref, pt, 3, scale, floor=floors[name])
    check_close("dsink", grads[3], ref_grads[3], pt_grads[3], 3, ref_grads[3].abs().max().item(),
                floor=_dsink_floor(ref_in[3], ref_lse, ref_out, dout, out))


def sink_case(device, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    q = nan_guarded((batch, seqlen_q, nheads, head_dim), dtype, device, g)
    k = nan_guarded((batch, seqlen_k, nheads_kv, head_dim), dtype, device, g)
    v = nan_guarded((batch, seqlen_k, nheads_kv, head_dim), dtype, device, g)
    sink = _sink(nheads, device=device, seed=seed).requires_grad_()
    dout = torch.randn(batch, seqlen_q, nheads, head_dim, generator=g).to(device, dtype)
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = flashtile.flash_attn_func(*inputs, learnable_sink=sink, return_attn_probs=True, **kw)
    grads = torch.autograd.grad(out, [*inputs, sink], dout)
    _check_against_reference(q, k, v, sink, dout, out, lse, grads, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("seqlens", [(33, 65), (65, 33), (1, 70)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
def test_sink_against_the_reference(device, mask, seqlens, dtype):
    """gpt-oss alternates full attention and 128-token sliding windows, both with sinks: causal and local here."""
    kw = {"none": {}, "causal": dict(causal=True), "local": dict(causal=True, window_size=(8, -1))}[mask]
    sink_case(device, 2, *seqlens, 2, 2, 32, dtype, **kw)


@pytest.mark.parametrize("features", ["gqa", "softcap_alibi", "dropout", "head_dim_40"])
def test_sink_with_other_features(device, features):
    if features == "gqa":
        sink_case(device, 2, 40, 56, 4, 1, 32, torch.float16, causal=True)
    elif features == "softcap_alibi":
        slopes = torch.rand(2, generator=torch.Generator().manual_seed(3)).to(device) * 0.3
        sink_case(device, 2, 33, 47, 2, 2, 32, torch.float16, softcap=5.0, alibi_slopes=slopes)
    elif features == "dropout":
        g = torch.Generator().manual_seed(4)
        q, k, v = (torch.randn(1, 40, 2, 32, generator=g).to(device, torch.float16) for _ in range(3))
        sink = _sink(2, device=device).requires_grad_()
        dout = torch.randn(1, 40, 2, 32, generator=g).to(device, torch.float16)
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse, s_dmask = flashtile.flash_attn_func(*inputs, dropout_p=0.2, causal=True, learnable_sink=sink,
                                                      return_attn_probs=True)
        grads = torch.autograd.grad(out, [*inputs, sink], dout)
        keep = s_dmask[:, :, :40, :40] >= 0
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
        ref_out, ref_lse = attention_ref(*ref_in[:3], causal=True, learnable_sink=ref_in[3], dropout_mask=keep,
                                         dropout_p=0.2)
        ref_grads = torch.autograd.grad(ref_out, ref_in, dout.double())
        pt_in = [t.detach().clone().requires_grad_() for t in (q, k, v)] + [sink.detach().clone().requires_grad_()]
        pt_out, _ = attention_ref(*pt_in[:3], causal=True, learnable_sink=pt_in[3], dropout_mask=keep,
                                  dropout_p=0.2, upcast=False)
        pt_grads = torch.autograd.grad(pt_out, pt_in, dout)
        check_close("out", out, ref_out, pt_out, 2)
        for name, ours, ref, pt in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
            check_close(name, ours, ref, pt, 3, ref.abs().max().item())
        check_close("dsink", grads[3], ref_grads[3], pt_grads[3], 3, ref_grads[3].abs().max().item(),
                    floor=_dsink_floor(ref_in[3], ref_lse, ref_out, dout, out))
    else:
        sink_case(device, 1, 29, 31, 2, 2, 40, torch.float16)


def test_sink_in_the_model_dtype_gets_its_gradient_in_that_dtype(device):
    """A bf16 sink parameter (as a bf16 model stores it) is read as fp32 and gets a bf16 gradient."""
    q, k, v = (torch.randn(1, 16, 2, 32, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    sink = _sink(2, torch.bfloat16, device).requires_grad_()
    out = flashtile.flash_attn_func(q, k, v, learnable_sink=sink)
    out.float().sum().backward()
    assert sink.grad.dtype == torch.bfloat16 and torch.isfinite(sink.grad).all()


def test_rows_that_see_no_key_give_zero_and_the_sink_as_lse(device):
    """With a sink a row that sees no key still has a softmax: all its mass on the sink, so out 0, lse = sink, and
    no gradient anywhere from it."""
    q = torch.randn(1, 70, 2, 16, device=device, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(1, 3, 2, 16, device=device, dtype=torch.float16, requires_grad=True) for _ in range(2))
    sink = torch.tensor([0.5, -1.0], device=device, requires_grad=True)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_attn_probs=True)
    assert not out[:, :67].any()
    torch.testing.assert_close(lse[0, :, :67], sink.detach()[:, None].expand(2, 67))
    dq, = torch.autograd.grad(out, q, torch.ones_like(out))
    assert not dq[:, :67].any()


def sink_varlen_case(device, lens_q, lens_k, nheads, nheads_kv, head_dim, dtype, seed=6):
    """flash_attn_varlen_func, causal, with a sink: out, lse and dq, dk, dv per sequence against the reference, and
    the sink's gradient, which sums over every sequence."""
    q, k, v, dout, cu_q, cu_k = varlen_inputs(device, lens_q, lens_k, nheads, nheads_kv, head_dim, dtype, seed)
    sink = _sink(nheads, device=device, seed=seed).requires_grad_()
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = flashtile.flash_attn_varlen_func(*inputs, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                   learnable_sink=sink, return_attn_probs=True)
    grads = torch.autograd.grad(out, [*inputs, sink], dout)
    ref_dsink = torch.zeros(nheads, dtype=torch.float64, device=device)
    dsink_floor = torch.zeros(nheads, dtype=torch.float64, device=device)
    pt_dsink = torch.zeros(nheads, dtype=dtype, device=device)
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if sq == 0:
            continue
        ref_in = [t[None].detach().double().requires_grad_() for t in (q[rq], k[rk], v[rk])]
        ref_sink = sink.detach().double().requires_grad_()
        ref_out, ref_lse = attention_ref(*ref_in, causal=True, learnable_sink=ref_sink)
        *ref_g, ref_gs = torch.autograd.grad(ref_out, [*ref_in, ref_sink], dout[None, rq].double())
        dsink_floor = dsink_floor + _dsink_floor(ref_sink, ref_lse, ref_out, dout[None, rq], out[None, rq])
        pt_in = [t[None].detach().clone().requires_grad_() for t in (q[rq], k[rk], v[rk])]
        pt_sink = sink.detach().clone().requires_grad_()
        pt_out, pt_lse = attention_ref(*pt_in, causal=True, learnable_sink=pt_sink, upcast=False)
        *pt_g, pt_gs = torch.autograd.grad(pt_out, [*pt_in, pt_sink], dout[None, rq])
        check_close(f"out[{b}]", out[None, rq], ref_out, pt_out, 2)
        check_close(f"lse[{b}]", lse[None, :, rq], ref_lse, pt_lse.to(dtype), 2)
        for name, ours, ref, pt in zip(("dq", "dk", "dv"), (grads[0][rq], grads[1][rk], grads[2][rk]), ref_g, pt_g):
            check_close(f"{name}[{b}]", ours[None], ref, pt, 3, max(r.abs().max().item() for r in ref_g))
        ref_dsink += ref_gs
        pt_dsink += pt_gs.to(dtype)
    check_close("dsink", grads[3], ref_dsink, pt_dsink, 3, ref_dsink.abs().max().item(), floor=dsink_floor)


def test_sink_varlen_and_packed(device):
    """flash_attn_varlen_func with a sink (a zero-length sequence too), and the qkv-packed entry points."""
    sink_varlen_case(device, [20, 0, 1, 45], [33, 5, 17, 45], 4, 2, 32, torch.float16)
    qkv = torch.randn(2, 24, 3, 2, 32, generator=torch.Generator().manual_seed(7)).to(device, torch.float16)
    qkv.requires_grad_()
    sink2 = _sink(2, device=device).requires_grad_()
    out = flashtile.flash_attn_qkvpacked_func(qkv, causal=True, learnable_sink=sink2)
    ref, _ = attention_ref(*(qkv[:, :, i].detach().double() for i in range(3)), causal=True,
                           learnable_sink=sink2.detach().double())
    assert (out.double() - ref).abs().max().item() < 5e-3
    dqkv, dsink = torch.autograd.grad(out, (qkv, sink2), torch.ones_like(out))
    assert dqkv.shape == qkv.shape and dsink.shape == (2,)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("page_size", [None, 16])
def test_sink_in_decode(device, page_size, num_splits):
    """flash_attn_with_kvcache: the sink is folded into one split's state, so a split-KV call equals the same
    attention computed at once; against the reference on each sequence's cache, with appended keys."""
    batch, h = 2, 4
    x = kvcache_inputs(device, batch, 64, h, 2, 32, 2, page_size, seed=8)
    q, logical_k, logical_v, new_k, new_v = x["q"], x["logical_k"], x["logical_v"], x["k"], x["v"]
    seqlens = torch.tensor([40, 62], dtype=torch.int32, device=device)
    sink = _sink(h, device=device, seed=8)
    out, lse = flashtile.flash_attn_with_kvcache(q, x["k_cache"], x["v_cache"], new_k, new_v, cache_seqlens=seqlens,
                                                 causal=True, learnable_sink=sink, num_splits=num_splits,
                                                 return_softmax_lse=True, **x["kwargs"])
    for b in range(batch):
        s = int(seqlens[b])
        keys = torch.cat([logical_k[b:b + 1, :s], new_k[b:b + 1]], 1)
        values = torch.cat([logical_v[b:b + 1, :s], new_v[b:b + 1]], 1)
        ref, ref_lse = attention_ref(q[b:b + 1].double(), keys.double(), values.double(), causal=True,
                                     learnable_sink=sink.double())
        base, _ = attention_ref(q[b:b + 1], keys, values, causal=True, learnable_sink=sink.half(), upcast=False)
        check_close(f"out[{b}]", out[b:b + 1], ref, base, 2)
        torch.testing.assert_close(lse[b:b + 1].double(), ref_lse, atol=1e-4, rtol=0)


@pytest.mark.parametrize("bad, exc, match", [
    (torch.zeros(3), ValueError, r"learnable_sink must have shape \(nheads,\) = \(2,\)"),
    (torch.zeros(2, dtype=torch.int32), TypeError, "learnable_sink must be float32, bfloat16 or float16"),
    ([0.0, 1.0], TypeError, "learnable_sink must be a tensor"),
])
def test_bad_sinks(device, bad, exc, match):
    q = torch.randn(1, 8, 2, 16, device=device, dtype=torch.float16)
    bad = bad.to(device) if isinstance(bad, torch.Tensor) else bad
    for call in (lambda: flashtile.flash_attn_func(q, q, q, learnable_sink=bad),
                 lambda: flashtile.flash_attn_with_kvcache(q, q, q, learnable_sink=bad)):
        with pytest.raises(exc, match=match):
            call()


def test_sink_under_torch_compile(device):
    """fullgraph torch.compile: the sink is one more input of the op and one more gradient of its backward."""
    q, k, v = (torch.randn(1, 24, 2, 32, device=device, dtype=torch.float16, requires_grad=True) for _ in range(3))
    sink = _sink(2, device=device).requires_grad_()

    def f(q, k, v, sink):
        return flashtile.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    dout = torch.randn_like(q)
    want = torch.autograd.grad(f(q, k, v, sink), (q, k, v, sink), dout)
    got = torch.autograd.grad(compiled(q, k, v, sink), (q, k, v, sink), dout)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
