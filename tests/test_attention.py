"""Forward and backward numerics of flash_attn_func against the fp64 reference, feature by feature and combined.

Rule (flash-attn's): max error <= 2x the error of PyTorch doing the same math in the input dtype, plus a rounding
atol; 3x for gradients. Inputs are carved out of NaN-filled buffers, so an out-of-bounds read shows up as NaN.
"""

import pytest
import torch

import flashtile
from flashtile.testing import attention_ref, check_attention, check_close, nan_guarded

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SEQLENS = [(1, 1), (17, 17), (33, 65), (65, 33), (100, 128), (1, 70), (70, 1)]
MASKS = {  # name -> (causal, window_size)
    "none": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "window": (False, (8, 4)),
    "left": (False, (16, -1)),
    "right": (False, (-1, 5)),
    "causal_window": (True, (10, -1)),
}


def run_case(device, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype, causal=False,
             window_size=(-1, -1), softcap=0.0, alibi=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = nan_guarded((batch, seqlen_q, nheads, head_dim), dtype, device, g)
    k = nan_guarded((batch, seqlen_k, nheads_kv, head_dim), dtype, device, g)
    v = nan_guarded((batch, seqlen_k, nheads_kv, head_dim), dtype, device, g)
    alibi_slopes = None
    if alibi == "per_head":
        alibi_slopes = torch.rand(nheads, generator=g).to(device) * 0.3
    elif alibi == "per_batch":
        alibi_slopes = torch.rand(batch, nheads, generator=g).to(device) * 0.3
    dout = torch.randn(batch, seqlen_q, nheads, head_dim, generator=g).to(device, dtype)
    check_attention(q, k, v, dout, causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mask", list(MASKS))
def test_masks_and_lengths(device, mask, seqlens, dtype):
    causal, window = MASKS[mask]
    run_case(device, 2, *seqlens, 2, 2, 64, dtype, causal, window)


@pytest.mark.parametrize("seqlens", [(65, 33), (33, 97)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_backward_is_bitwise_reproducible(device, mask, seqlens):
    """flash_attn_func documents its backward as bitwise reproducible whatever `deterministic` says (no gradient
    is summed with atomics): two runs with deterministic=True and one with False give the same bits. GQA, so that
    dK/dV sum over the query heads of a group."""
    causal, window = MASKS[mask]
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, s, h, 64, generator=g).to(device, torch.float16)
               for s, h in ((seqlens[0], 4), (seqlens[1], 2), (seqlens[1], 2)))
    dout = torch.randn(2, seqlens[0], 4, 64, generator=g).to(device, torch.float16)

    def run(deterministic):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flashtile.flash_attn_func(*inputs, causal=causal, window_size=window, deterministic=deterministic)
        return (out, *torch.autograd.grad(out, inputs, dout))

    first = run(True)
    for again in (run(True), run(False)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("head_dim", [8, 32, 40, 64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(device, head_dim, causal):
    run_case(device, 1, 33, 47, 2, 2, head_dim, torch.float16, causal)


@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (6, 3)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_gqa_mqa(device, heads, mask):
    causal, window = MASKS[mask]
    run_case(device, 2, 40, 56, *heads, 32, torch.float16, causal, window)


@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("alibi", [None, "per_head", "per_batch"])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_softcap_alibi(device, softcap, alibi, mask):
    if softcap == 0.0 and alibi is None:
        pytest.skip("covered by test_masks_and_lengths")
    causal, window = MASKS[mask]
    run_case(device, 2, 33, 65, 2, 2, 64, torch.float16, causal, window, softcap, alibi)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seqlens", [(65, 33), (33, 97)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_everything_at_once(device, dtype, seqlens):
    run_case(device, 2, *seqlens, 4, 2, 96, dtype, True, (12, -1), softcap=8.0, alibi="per_batch", seed=3)


def test_custom_scale_and_large_logits(device):
    # A large softmax_scale makes logits of several hundred: the online softmax must rescale without overflow.
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 50, 2, 32, generator=g, dtype=torch.float16).to(device) for _ in range(3))
    out = flashtile.flash_attn_func(q, k, v, softmax_scale=30.0)
    ref, _ = attention_ref(q.double(), k.double(), v.double(), softmax_scale=30.0)
    pt, _ = attention_ref(q, k, v, softmax_scale=30.0, upcast=False)
    check_close("out", out, ref, pt, 2)
