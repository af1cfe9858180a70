"""GPU tier: regression tests for what a flash-attn-style test matrix found on an H200 (the crashes, the illegal
memory access, the wrong answer), and numerics at the edges that only a GPU reaches. Run with several workers
(`pytest -m gpu -n 8`), so that processes share the GPU: the races showed only then. The matrix itself is
test_gpu_matrix.py; tools/stress.py is the long multi-process run.
"""

import pytest
import torch

import flashtile
from flashtile.ops import launch as launch_module
from flashtile.ops.device import pdl_supported
from flashtile.testing import attention_ref, check_close
from test_attention import run_case
from test_varlen import run_varlen

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("head_dim", [160, 192, 224, 256])
def test_pdl_backward_does_not_share_descriptor_scratch(device, monkeypatch, head_dim):
    """Note [scratch under PDL]: at head dims above 128 both backward kernels build TMA descriptors on the device,
    in scratch buffers the launcher allocates per launch. The dK/dV kernel runs beside the dQ kernel (PDL), so its
    scratch must not be memory the dQ kernel's programs still read their descriptors from; PyTorch's caching
    allocator handed it exactly that block once the dQ launch had dropped it."""
    if not pdl_supported(torch.device(device)):
        pytest.skip("no programmatic dependent launch here")
    monkeypatch.setenv("FLASHTILE_HOPPER", "0")
    blocks = []
    original = launch_module._tma_scratch

    def recording(size, alignment, stream):
        buf = original(size, alignment, stream)
        blocks.append((buf.data_ptr(), buf.data_ptr() + size))
        return buf

    monkeypatch.setattr(launch_module, "_tma_scratch", recording)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 300, 8, head_dim, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 300, 1, head_dim, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
            for _ in range(2))
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
    for _ in range(3):
        blocks.clear()
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out), retain_graph=True)
        assert len(blocks) == 2, blocks  # the dQ kernel's, then the dK/dV kernel's
        (a0, a1), (b0, b1) = blocks
        assert a1 <= b0 or b1 <= a0, f"the dK/dV kernel's descriptor scratch overlaps the dQ kernel's: {blocks}"


@pytest.mark.parametrize("layout", ["dense", "varlen"])
@pytest.mark.parametrize("head_dim", [160, 224, 256])
def test_backward_reruns_on_one_graph_are_bitwise_equal(device, monkeypatch, layout, head_dim):
    """The illegal memory access (and wrong gradients) of the Triton backward at head dims 160-256: 50 backward
    passes on one graph, each against the first and against the two kernels run one after the other (no PDL).
    Grids smaller than the GPU, so that every dK/dV program starts while the dQ programs run."""
    monkeypatch.setenv("FLASHTILE_HOPPER", "0")
    g = torch.Generator(device=device).manual_seed(head_dim)
    if layout == "dense":
        q = torch.randn(2, 127, 9, head_dim, device=device, dtype=torch.float16, generator=g)
        k, v = (torch.randn(2, 513, 3, head_dim, device=device, dtype=torch.float16, generator=g) for _ in range(2))
        kw = dict(window_size=(53, 441))
        fn = flashtile.flash_attn_func
        args = ()
    else:
        cu_q = torch.tensor([0, 127, 217], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 512, 640], dtype=torch.int32, device=device)
        q = torch.randn(217, 9, head_dim, device=device, dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(640, 3, head_dim, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
        kw = dict(causal=True)
        fn = flashtile.flash_attn_varlen_func
        args = (cu_q, cu_k, 127, 512)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    out = fn(*inputs, *args, **kw)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, inputs, dout, retain_graph=True)
    for _ in range(50):
        again = torch.autograd.grad(out, inputs, dout, retain_graph=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    monkeypatch.setenv("FLASHTILE_PDL", "0")
    serial = torch.autograd.grad(out, inputs, dout)
    for a, b in zip(first, serial):
        assert torch.equal(a, b)


CRASHED = [  # (seqlen_q, seqlen_k, head_dim, mask): the shapes ptxas crashed on (Note [runtime integers])
    (239, 1, 59, "causal"), (239, 1, 64, "causal"), (239, 1, 224, "causal"), (239, 1, 256, "causal"),
    (1, 339, 40, "causal"), (1, 339, 40, "local"), (1, 339, 160, "causal"), (1, 339, 160, "local"),
    (1, 1, 64, "causal"), (1, 5, 64, "causal"), (5, 1, 128, "causal"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CRASHED, ids=lambda c: "{}x{}-d{}-{}".format(*c))
def test_lengths_of_one(device, case, dtype):
    seqlen_q, seqlen_k, head_dim, mask = case
    window = (17, 3) if mask == "local" else (-1, -1)
    run_case(device, 4, seqlen_q, seqlen_k, 9, 3, head_dim, dtype, mask == "causal", window)


@pytest.mark.parametrize("heads", [(9, 3), (9, 9), (3, 3)], ids=lambda h: f"h{h[0]}hk{h[1]}")
def test_varlen_one_query_per_sequence_repeated(device, heads):
    """The wrong answer a flash-attn-style matrix saw once under load and put on the persistent Gluon varlen
    forward: causal, 8 sequences of one query against 219-239 keys, d128. On the tree it was reported against
    this shape's dK and dV were wrong with one query head per KV head (errors 0.22-0.40 at 9/9, NaN at 3/3) and
    right with GQA, out and dQ right: the dK/dV fault of Note [one loop per consumer] in kernels/hopper_bwd.py.
    Forward and backward against the oracle with fresh inputs every round, then forward reruns bitwise."""
    lens_k = [219, 222, 225, 228, 231, 234, 237, 239]
    for seed in range(12):
        run_varlen(device, [1] * 8, lens_k, *heads, 128, torch.bfloat16, causal=True, seed=seed)
    assert flashtile.last_kernel_paths() == {"fwd": "gluon-sm90", "bwd_dq": "gluon-sm90", "bwd_dkdv": "gluon-sm90"}
    cu_q = torch.arange(9, dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(8, heads[0], 128, device=device, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(int(cu_k[-1]), heads[1], 128, device=device, dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    first = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 239, causal=True)
    for _ in range(500):
        assert torch.equal(flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 239, causal=True), first)


@pytest.mark.parametrize("lens_k", [[129], [150], [192], [140, 170, 131, 190]], ids=str)
def test_forward_half_last_block_after_no_middle_block(device, lens_k):
    """The Gluon forward's consumer runs its first block before a loop over the middle ones and, for an item of two
    key blocks whose last one it sees at most half of (Note [half last block]), a half step after that loop runs
    zero times: the shape of the zero-trip loop before wgmma that left ptxas's descriptors undefined in dK/dV (Note
    [one loop per consumer] in kernels/hopper_bwd.py). Keys in (128, 192], one and 22 queries per sequence, dense
    and varlen, causal: against the oracle, then 200 reruns bitwise."""
    for lens_q in ([1] * len(lens_k), [22] * len(lens_k)):
        for seed in range(5):
            run_varlen(device, lens_q, lens_k, 4, 4, 128, torch.bfloat16, causal=True, seed=seed)
    if len(lens_k) == 1:
        run_case(device, 2, lens_k[0], lens_k[0], 4, 4, 128, torch.bfloat16, causal=True)
    cu_q = torch.arange(len(lens_k) + 1, dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    g = torch.Generator(device=device).manual_seed(2)
    q = torch.randn(len(lens_k), 4, 128, device=device, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(int(cu_k[-1]), 4, 128, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    first = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, max(lens_k), causal=True)
    for _ in range(200):
        assert torch.equal(flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, max(lens_k), causal=True), first)


FEWER_QUERIES = [([1], [484]), ([64], [484]), ([200], [484]), ([3, 2, 1, 1, 3], [437, 380, 97, 559, 425])]


@pytest.mark.parametrize("window", [(-1, 0), (100, 0), (-1, -1)], ids=["causal", "local", "none"])
@pytest.mark.parametrize("heads", [(2, 2), (1, 1), (4, 2)], ids=lambda h: f"h{h[0]}hk{h[1]}")
@pytest.mark.parametrize("lens", FEWER_QUERIES, ids=lambda lens: f"q{sum(lens[0])}k{sum(lens[1])}")
def test_varlen_backward_with_fewer_queries_than_keys(device, lens, heads, window):
    """Found by tools/stress.py --kinds varlen_short: the persistent Gluon dK/dV kernel's gradients were wrong
    (every key tile whose query tiles all see every key) for varlen causal MHA with fewer queries than keys, and a
    rerun could fault: ptxas left the wgmma descriptors of such a tile undefined (Note [one loop per consumer] in
    kernels/hopper_bwd.py). The Gluon path, against the oracle, then reruns of the backward bitwise."""
    lens_q, lens_k = lens
    causal = window == (-1, 0)
    kw = dict(causal=True) if causal else dict(window_size=window)
    for dtype in (torch.float16, torch.bfloat16):
        run_varlen(device, lens_q, lens_k, *heads, 128, dtype, **kw, seed=sum(lens_k))
    assert flashtile.last_kernel_paths() == {"fwd": "gluon-sm90", "bwd_dq": "gluon-sm90", "bwd_dkdv": "gluon-sm90"}
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for x in lens)
    g = torch.Generator(device=device).manual_seed(3)
    q = torch.randn(sum(lens_q), heads[0], 128, device=device, generator=g).half().requires_grad_()
    k, v = (torch.randn(sum(lens_k), heads[1], 128, device=device, generator=g).half().requires_grad_()
            for _ in range(2))
    out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(50):
        for a, b in zip(first, torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)):
            assert torch.equal(a, b)


def test_paged_cache_lengths_are_checked_in_eager_mode(device, monkeypatch):
    """flash-attn raises for a paged cache whose lengths pass its block table, paying a device-to-host copy; so
    does flashtile. A contiguous cache's call does not synchronise (its values are clamped), nor does a captured
    CUDA graph's (tests/test_kvcache.py: the clamps keep every access inside the cache). FLASHTILE_CHECK=1 would
    check every call's values, the contiguous one's too."""
    monkeypatch.delenv("FLASHTILE_CHECK", raising=False)
    q = torch.randn(2, 1, 8, 128, device=device, dtype=torch.bfloat16)
    k_cache = torch.randn(8, 16, 2, 128, device=device, dtype=torch.bfloat16)
    table = torch.arange(8, dtype=torch.int32, device=device).reshape(2, 4)
    bad = torch.tensor([10, 70], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 70"):
        flashtile.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=bad, block_table=table)
    contiguous = torch.randn(2, 64, 2, 128, device=device, dtype=torch.bfloat16)
    out = flashtile.flash_attn_with_kvcache(q, contiguous, contiguous, cache_seqlens=bad)
    assert torch.isfinite(out).all()
    good = torch.tensor([10, 60], dtype=torch.int32, device=device)
    flashtile.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=good, block_table=table)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flashtile.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=good, block_table=table)
    good.copy_(bad)  # replays read the new lengths, which no check sees: clamped to the cache
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(captured).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_logits_of_ten_thousand(device, dtype, head_dim):
    """Logits up to +-1e4 (|q . k| <= head_dim with entries in [-1, 1], softmax_scale = 1e4 / head_dim): the
    online softmax rescales without overflow, forward and backward."""
    g = torch.Generator(device=device).manual_seed(head_dim)
    q, k, v = (torch.rand(2, 300, 4, head_dim, device=device, generator=g).mul(2).sub(1).to(dtype)
               for _ in range(3))
    scale = 1e4 / head_dim
    out, lse, _ = flashtile.flash_attn_func(q, k, v, softmax_scale=scale, causal=True, return_attn_probs=True)
    ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), softmax_scale=scale, causal=True)
    base, base_lse = attention_ref(q, k, v, softmax_scale=scale, causal=True, upcast=False)
    check_close("out", out, ref, base, 2)
    assert torch.isfinite(lse).all() and (lse.double() - ref_lse).abs().max() < 1e-2 * ref_lse.abs().max()


@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_non_finite_inputs_change_only_the_rows_they_reach(device, where, value, head_dim, seqlen=300):
    """A NaN or inf in query row i changes only output row i (NaN: its scores are NaN, or +inf and -inf at once);
    in key row j, only the rows that see key j (a masked key's score is replaced, never multiplied): those whose
    score for j is NaN or +inf become NaN, those whose score is -inf give key j no weight. Every other row equals
    the fp64 reference."""
    g = torch.Generator(device=device).manual_seed(7)
    q, k, v = (torch.randn(2, seqlen, 4, head_dim, device=device, generator=g).to(torch.bfloat16)
               for _ in range(3))
    i0, d0 = seqlen // 2, 5
    (q if where == "q" else k)[1, i0, 2, d0] = value
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    nan_rows = torch.zeros(out.shape[:3], dtype=torch.bool, device=device)
    if where == "q":
        nan_rows[1, i0, 2] = True
    else:
        # Causal: queries i >= i0 see key i0; their score for it is q[i, d0] * value.
        score_sign = q[1, i0:, 2, d0].float() * (1.0 if value != value or value > 0 else -1.0)
        nan_rows[1, i0:, 2] = True if value != value else score_sign > 0
    assert out[nan_rows].isnan().all(), "a row that reaches the non-finite input is not NaN"
    assert torch.isfinite(out[~nan_rows]).all(), "a row that does not reach the non-finite input is not finite"
    # The reference gives the rows whose score for key i0 is -inf no weight for it too (exp(-inf) = 0).
    ref, _ = attention_ref(q.double(), k.double(), v.double(), causal=True)
    base, _ = attention_ref(q, k, v, causal=True, upcast=False)
    rows = ~nan_rows
    check_close("out (rows the input does not reach)", out[rows], ref[rows], base[rows], 2)


def test_batch_times_heads_beyond_one_grid_dimension(device):
    """4096 sequences x 32 heads (more than the 65535 programs one grid dimension holds), dense, varlen and decode."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(4096, 4, 32, 64, device=device, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(4096, 9, 8, 64, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    ref, _ = attention_ref(q[-3:].double(), k[-3:].double(), v[-3:].double(), causal=True)
    base, _ = attention_ref(q[-3:], k[-3:], v[-3:], causal=True, upcast=False)
    check_close("dense out (last sequences)", out[-3:], ref, base, 2)
    cu_q = torch.arange(0, 4097 * 4, 4, dtype=torch.int32, device=device)
    cu_k = torch.arange(0, 4097 * 9, 9, dtype=torch.int32, device=device)
    packed = flashtile.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, 4, 9,
                                              causal=True)
    assert torch.equal(packed.view_as(out), out)
    decoded = flashtile.flash_attn_with_kvcache(q[:, -1:], k, v, cache_seqlens=9)
    assert torch.allclose(decoded.float(), out[:, -1:].float(), atol=2e-2, rtol=0)


def test_more_than_two_to_the_31_elements(device, large_gpu_memory):
    """Dense q, k, v of 1025 x 1024 x 16 x 128 (> 2^31 elements each): every offset past 2^31 is 64-bit."""
    b, s, h, d = 1025, 1024, 16, 128
    assert b * s * h * d > 2**31
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3))
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    ref, _ = attention_ref(q[-1:].double(), k[-1:].double(), v[-1:].double(), causal=True)
    base, _ = attention_ref(q[-1:], k[-1:], v[-1:], causal=True, upcast=False)
    check_close("out (last sequence)", out[-1:], ref, base, 2)
