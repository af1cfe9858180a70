"""GPU tier: a test matrix in flash-attn's style (tests/test_flash_attn.py there), for the H200. Lengths 1, 3,
113, 127, 239, 513, 799 and 1023 on either side; head dims 32 to 256, odd ones included; causal, local, ALiBi,
softcap, GQA/MQA; dense, packed, varlen and KV-cache layouts; the backward rerun on one graph and compared bitwise.
Every result against the fp64 oracle with the 2x-PyTorch-error rule (testing.check_close). Meant to run with
several workers sharing the GPU: `PYTHONPATH=src python -m pytest -m gpu -n 8 tests/test_gpu_matrix.py`.
"""

import pytest
import torch

import flashtile
from test_attention import run_case
from test_kvcache import run_case as run_kvcache_case
from test_varlen import run_varlen

pytestmark = pytest.mark.gpu

LENGTHS = [1, 3, 113, 127, 239, 513, 799, 1023]
# (seqlen_q, seqlen_k): each length against the shortest and the longest other side, both ways round.
PAIRS = sorted({pair for a in LENGTHS for b in (1, 1023) for pair in ((a, b), (b, a))})
HEAD_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "local": (False, (97, 31)),
         "causal_local": (True, (200, -1))}
DTYPES = [torch.float16, torch.bfloat16]


def _dtype(*numbers):
    """fp16 or bf16 by the case (deterministically: every worker collects the same matrix), so that both meet
    every length and head dim."""
    return DTYPES[sum(numbers) % 2]


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlens", PAIRS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_dense(device, seqlens, head_dim, mask):
    causal, window = MASKS[mask]
    run_case(device, 2, *seqlens, 4, 2, head_dim, _dtype(*seqlens, head_dim, len(mask)), causal, window,
             seed=head_dim + seqlens[0])


@pytest.mark.parametrize("features", ["alibi", "softcap", "alibi_softcap_causal", "mqa", "gqa8"])
@pytest.mark.parametrize("head_dim", [40, 64, 111, 128, 256])
@pytest.mark.parametrize("seqlens", [(1, 1023), (113, 239), (513, 127), (799, 799)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_features(device, seqlens, head_dim, features):
    heads = {"mqa": (8, 1), "gqa8": (16, 2)}.get(features, (4, 4))
    kw = dict(alibi=dict(alibi="per_batch"), softcap=dict(softcap=20.0),
              alibi_softcap_causal=dict(causal=True, alibi="per_head", softcap=10.0)).get(features, dict(causal=True))
    run_case(device, 2, *seqlens, *heads, head_dim, _dtype(*seqlens, head_dim, len(features)), **kw)


@pytest.mark.parametrize("packing", ["qkv", "kv"])
@pytest.mark.parametrize("head_dim", [59, 128, 224])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_packed(device, packing, head_dim, mask):
    """Packed inputs give what separate tensors give, bitwise, and one gradient buffer."""
    causal, window = MASKS[mask]
    g = torch.Generator(device=device).manual_seed(head_dim)
    s = 239
    if packing == "qkv":
        packed = torch.randn(2, s, 3, 6, head_dim, device=device, dtype=torch.bfloat16, generator=g)
        q, k, v = (packed[:, :, i] for i in range(3))
    else:
        q = torch.randn(2, s, 6, head_dim, device=device, dtype=torch.bfloat16, generator=g)
        packed = torch.randn(2, 513, 2, 2, head_dim, device=device, dtype=torch.bfloat16, generator=g)
        k, v = packed[:, :, 0], packed[:, :, 1]
    dout = torch.randn_like(q)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flashtile.flash_attn_func(*leaves, causal=causal, window_size=window)
    grads = torch.autograd.grad(out, leaves, dout)
    packed = packed.detach().requires_grad_()
    if packing == "qkv":
        out_p = flashtile.flash_attn_qkvpacked_func(packed, causal=causal, window_size=window)
        (d_packed,) = torch.autograd.grad(out_p, packed, dout)
        packed_grads = [d_packed[:, :, i] for i in range(3)]
    else:
        q_leaf = q.detach().clone().requires_grad_()
        out_p = flashtile.flash_attn_kvpacked_func(q_leaf, packed, causal=causal, window_size=window)
        dq, d_packed = torch.autograd.grad(out_p, (q_leaf, packed), dout)
        packed_grads = [dq, d_packed[:, :, 0], d_packed[:, :, 1]]
    assert torch.equal(out, out_p)
    for a, b in zip(grads, packed_grads):
        assert torch.equal(a, b)


VARLEN = {"lengths_of_the_matrix": ([1, 3, 113, 127, 239, 513, 799, 1023], [1023, 799, 513, 239, 127, 113, 3, 1]),
          "self": ([1, 239, 0, 1023, 113, 3], [1, 239, 0, 1023, 113, 3]),
          "one_query_each": ([1] * 8, [219, 222, 225, 228, 231, 234, 237, 239]),
          "q_longer": ([799, 513, 127], [127, 239, 113])}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("head_dim", [32, 59, 64, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("lengths", list(VARLEN))
def test_varlen(device, lengths, head_dim, mask):
    causal, window = MASKS[mask]
    run_varlen(device, *VARLEN[lengths], 9, 3, head_dim, _dtype(len(lengths), head_dim, len(mask)), causal, window,
               seed=head_dim)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("features", ["plain", "seqused", "softcap_alibi"])
def test_varlen_features(device, head_dim, features):
    lens_q, lens_k = VARLEN["lengths_of_the_matrix"]
    kw = dict(seqused=dict(seqused=True, causal=True), softcap_alibi=dict(softcap=15.0, alibi="per_batch",
                                                                          window_size=(97, 31))).get(features, {})
    run_varlen(device, lens_q, lens_k, 8, 2, head_dim, torch.bfloat16, **kw)


@pytest.mark.parametrize("page_size", [None, 1, 16, 256])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", ["decode", "append_causal", "rotary_local", "alibi_softcap"])
def test_kvcache(device, case, head_dim, page_size):
    kw = dict(decode=dict(seqlens=(1023, 3)), append_causal=dict(seqlen_q=3, seqlen_new=3, causal=True,
                                                                 seqlens=(799, 1)),
              rotary_local=dict(seqlen_q=4, seqlen_new=2, window=(113, 0), rotary="neox", seqlens=(513, 239)),
              alibi_softcap=dict(seqlen_q=2, alibi="bh", softcap=5.0, seqlens=(1020, 127)))[case]
    if page_size is not None and 1024 % page_size:
        pytest.skip("capacity must be a multiple of the page size")
    run_kvcache_case(dtype=torch.bfloat16, head_dim=head_dim, nheads=16, nheads_kv=4, capacity=1024,
                     page_size=page_size, **kw)


@pytest.mark.parametrize("head_dim", [40, 64, 128, 160, 256])
@pytest.mark.parametrize("mask", ["causal", "local"])
def test_deterministic_reruns(device, head_dim, mask):
    """deterministic=True: the backward run 20 times on one graph (retain_graph) gives bitwise one result, and a
    fresh forward+backward the same again."""
    causal, window = MASKS[mask]
    g = torch.Generator(device=device).manual_seed(head_dim)
    q = torch.randn(4, 513, 9, head_dim, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (torch.randn(4, 239, 3, head_dim, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
            for _ in range(2))
    out = flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window, deterministic=True)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(20):
        for a, b in zip(first, torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)):
            assert torch.equal(a, b)
    out2 = flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window, deterministic=True)
    assert torch.equal(out, out2)
    for a, b in zip(first, torch.autograd.grad(out2, (q, k, v), dout)):
        assert torch.equal(a, b)
