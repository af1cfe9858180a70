"""`flashtile.scaled_dot_product_attention` against PyTorch's SDPA (math backend), forward and backward, and
flashtile in PyTorch's flash-attention registry (flashtile.integrations.sdpa).

Without a GPU, SDPA never routes to its flash backend (that needs CUDA tensors), so the registry's part of the
chain that is PyTorch's own (the router choosing the flash backend, the CUDA dispatch key) is not exercised here.
What is: registering, listing, activating and restoring (the CUDA kernels appear in and leave the dispatcher),
and the very callables activation installs, registered for the CPU key instead, called through the dispatcher
and the aten ops' own autograd formulas."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile.testing import attention_ref, check_close


def bhsd(device, b, h, hk, sq, sk, d, dv=None, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g).to(device, dtype)
                 for shape in ((b, h, sq, d), (b, hk, sk, d), (b, hk, sk, dv or d)))


def with_grads(fn, inputs, dout):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    return (out, *torch.autograd.grad(out, inputs, dout))


def torch_sdpa(*args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


def check_against_sdpa(device, inputs, factor=2, **kwargs):
    """Output and gradients within `factor` x the error of PyTorch's SDPA in the input dtype, against SDPA in
    fp64 (the tolerance rule of flashtile.testing)."""
    q, _, v = inputs
    dout = torch.randn(*q.shape[:-1], v.shape[-1]).to(q.device, q.dtype)
    ours = with_grads(lambda *t: flashtile.scaled_dot_product_attention(*t, **kwargs), inputs, dout)
    ref = with_grads(lambda *t: torch_sdpa(*t, **kwargs), [t.double() for t in inputs], dout.double())
    base = with_grads(lambda *t: torch_sdpa(*t, **kwargs), inputs, dout)
    for name, a, r, b in zip(("out", "dq", "dk", "dv"), ours, ref, base):
        check_close(name, a, r, b, factor if name == "out" else 3 * factor / 2)


@pytest.mark.parametrize("sq, sk", [(17, 17), (9, 23), (23, 9)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_sdpa(device, sq, sk, is_causal):
    """is_causal is top-left for any lengths (Note [top-left causal] in flashtile/sdpa.py)."""
    check_against_sdpa(device, bhsd(device, 2, 2, 2, sq, sk, 32), is_causal=is_causal)


def test_gqa_scale_and_value_head_dim(device):
    check_against_sdpa(device, bhsd(device, 1, 4, 2, 12, 20, 16, dv=24, seed=1), is_causal=True, scale=0.2,
                       enable_gqa=True)
    check_against_sdpa(device, bhsd(device, 1, 2, 1, 12, 7, 24, dv=16, seed=2), enable_gqa=True)


def test_leading_dims_and_layout(device):
    """Any number of leading batch dims (a 3-d query is (heads, seq, dim)); the output is a (B, H, S, D) view of
    a (B, S, H, D) buffer, as SDPA's flash backend returns."""
    q, k, v = (t.float() for t in bhsd(device, 6, 2, 2, 8, 8, 16, seed=3))
    five = [t.reshape(2, 3, *t.shape[1:]) for t in (q, k, v)]
    out = flashtile.scaled_dot_product_attention(*five, is_causal=True)
    torch.testing.assert_close(out, torch_sdpa(*five, is_causal=True), atol=1e-5, rtol=1e-5)
    three = [t[0] for t in (q, k, v)]
    torch.testing.assert_close(flashtile.scaled_dot_product_attention(*three), torch_sdpa(*three), atol=1e-5,
                               rtol=1e-5)
    out = flashtile.scaled_dot_product_attention(q, k, v)
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous()


def test_causal_bias_masks(device):
    """torch.nn.attention.bias's causal masks are read from their variant, without touching the device."""
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left
    q, k, v = (t.float() for t in bhsd(device, 1, 2, 2, 6, 11, 16, seed=4))
    for bias in (causal_upper_left(6, 11), causal_lower_right(6, 11)):
        torch.testing.assert_close(flashtile.scaled_dot_product_attention(q, k, v, attn_mask=bias),
                                   torch_sdpa(q, k, v, attn_mask=bias._materialize(device)), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="causal bias for 5 queries"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(5, 11))
    with pytest.raises(ValueError, match="is_causal"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(6, 11), is_causal=True)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(attn_mask=torch.ones(6, 6, dtype=torch.bool)), NotImplementedError, "attn_mask"),
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(scale=-1.0), ValueError, "softmax_scale"),
])
def test_refusals(device, kwargs, exc, match):
    q, k, v = bhsd(device, 1, 2, 2, 6, 6, 16)
    with pytest.raises(exc, match=match):
        flashtile.scaled_dot_product_attention(q, k, v, **kwargs)


def test_heads_need_enable_gqa(device):
    q, k, v = bhsd(device, 1, 4, 2, 6, 6, 16)
    with pytest.raises(ValueError, match="enable_gqa"):
        flashtile.scaled_dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match="leading"):
        flashtile.scaled_dot_product_attention(q, k[:, :, None], v[:, :, None], enable_gqa=True)


# ---------------------------------------------------------------------------------------------------------------
# PyTorch's flash-attention registry
# ---------------------------------------------------------------------------------------------------------------

registry = pytest.importorskip("torch.nn.attention")
needs_registry = pytest.mark.skipif(not hasattr(registry, "register_flash_attention_impl"),
                                    reason=f"torch {torch.__version__} has no flash-attention registry")


@needs_registry
def test_register_list_activate_restore():
    from flashtile.integrations import sdpa
    op = "aten::_scaled_dot_product_flash_attention"
    had_cuda_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    assert sdpa.register() == "flashtile"
    assert "flashtile" in registry.list_flash_attention_impls()
    assert registry.current_flash_attention_impl() is None  # registration does not activate
    registry.activate_flash_attention_impl("flashtile")
    try:
        assert registry.current_flash_attention_impl() == "flashtile"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    finally:
        registry.restore_flash_attention_impl()
    assert registry.current_flash_attention_impl() is None
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA") == had_cuda_kernel


@pytest.fixture
def cpu_kernels(device):
    """The callables activation installs for CUDA, registered for the CPU key, where these aten ops have none."""
    from flashtile.integrations import sdpa
    if device != "cpu":
        pytest.skip("on a GPU the CUDA registration itself is tested: test_gpu_sdpa_flash_backend_runs_flashtile")
    lib = sdpa.register_kernels("CPU")
    yield
    lib._destroy()


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_flash_op_forward_backward(cpu_kernels, device, is_causal):
    """aten::_scaled_dot_product_flash_attention, whose is_causal is bottom-right (as FlashAttention's), and its
    backward op, reached through the op's autograd formula; GQA as SDPA's flash backend passes it."""
    q, k, v = leaves(*(t.float() for t in bhsd(device, 2, 4, 2, 9, 14, 24, seed=5)))
    out, lse, *rest = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, scale=0.3)
    assert rest[2:4] == [9, 14] and lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    dout = torch.randn_like(out)
    out.backward(dout)
    ref = leaves(q, k, v)
    ref_out, ref_lse = attention_ref(*(t.transpose(1, 2) for t in ref), causal=is_causal, softmax_scale=0.3,
                                     upcast=False)
    ref_out.transpose(1, 2).backward(dout)
    torch.testing.assert_close(out, ref_out.transpose(1, 2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    for got, want in zip((q, k, v), ref):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)


def test_outputs_are_laid_out_as_the_meta_functions_say(cpu_kernels, device):
    """torch.compile plans with the meta functions' strides (empty_like(query)): a contiguous (B, H, S, D) query
    gets a contiguous output, a (B, S, H, D) buffer's view one of the same strides."""
    q = torch.randn(1, 2, 6, 16, device=device)
    for query in (q, q.transpose(1, 2).contiguous().transpose(1, 2)):
        out = torch.ops.aten._scaled_dot_product_flash_attention(query, query, query)[0]
        assert out.stride() == torch.empty_like(query).stride()
        torch.testing.assert_close(out, torch_sdpa(query, query, query), atol=1e-5, rtol=1e-5)
    dense = q.transpose(1, 2)  # (B, S, H, D), not contiguous
    out = torch.ops.aten._flash_attention_forward(dense, dense, dense, None, None, 6, 6, 0.0, False, False)[0]
    assert out.stride() == torch.empty_like(dense).stride()


def test_flash_op_varlen_window(cpu_kernels, device):
    """aten::_flash_attention_forward on a packed batch (cum_seq_q/k) with a window, and its backward op."""
    lengths = [5, 12, 1]
    cu = torch.tensor([0, 5, 17, 18], dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(6)
    q, k, v = leaves(*(torch.randn(18, h, 16, generator=g).to(device) for h in (4, 2, 2)))
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 12, 12, 0.0, True, False,
                                                           window_size_left=3)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref = leaves(q, k, v)
    pieces = []
    for b, n in enumerate(lengths):
        rows = slice(int(cu[b]), int(cu[b]) + n)
        o, _ = attention_ref(*(t[rows][None] for t in ref), causal=True, window_size=(3, -1), upcast=False)
        pieces.append(o[0])
    torch.cat(pieces).backward(dout)
    assert lse.shape == (4, 18)
    torch.testing.assert_close(out, torch.cat(pieces).detach(), atol=1e-5, rtol=1e-5)
    for got, want in zip((q, k, v), ref):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)


def test_flash_op_refusals(cpu_kernels, device):
    q = torch.randn(1, 4, 2, 16, device=device)
    slopes = torch.ones(2, device=device)
    with pytest.raises(RuntimeError, match="alibi_slopes"):
        torch.ops.aten._flash_attention_forward(q, q, q, None, None, 4, 4, 0.0, False, False, alibi_slopes=slopes)
    with pytest.raises(RuntimeError, match="return_debug_mask"):
        torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, False, True)
    used = torch.tensor([3], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="seqused_k"):
        torch.ops.aten._flash_attention_forward(q[0].requires_grad_(), q[0], q[0], cu, cu, 4, 4, 0.0, False, False,
                                                seqused_k=used)


def test_sdpa_default_scale_and_head_dim_padding(cpu_kernels, device):
    """A head dim that is not a multiple of 8 (SDPA pads before calling; a direct caller need not), default scale
    1/sqrt(headdim) of the unpadded dim."""
    q, k, v = leaves(*(t.float() for t in bhsd(device, 1, 2, 2, 5, 7, 20, seed=7)))
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[0]
    out.sum().backward()
    ref = leaves(q, k, v)
    want = torch_sdpa(*ref, scale=1 / math.sqrt(20))
    want.sum().backward()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q.grad, ref[0].grad, atol=1e-5, rtol=1e-5)


def test_torch_varlen_attn_runs_flashtile(cpu_kernels, device):
    """torch.nn.attention.varlen.varlen_attn, which calls aten::_flash_attention_forward (and its backward)."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    q, k, v = leaves(*(torch.randn(12, 2, 16, generator=torch.Generator().manual_seed(s)).to(device)
                       for s in range(3)))
    out = varlen.varlen_attn(q, k, v, cu, cu, 7, 7, window_size=(-1, 0))
    out.sum().backward()
    ref = leaves(q, k, v)
    want = torch.cat([attention_ref(*(t[a:b][None] for t in ref), causal=True, upcast=False)[0][0]
                      for a, b in ((0, 5), (5, 12))])
    want.sum().backward()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k.grad, ref[1].grad, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@needs_registry
def test_gpu_sdpa_flash_backend_runs_flashtile(device):
    """The whole chain on a GPU: activation, SDPA's router picking its flash backend for bf16 CUDA tensors, the
    aten ops' CUDA kernels (flashtile's now) forward and backward; flashtile.last_kernel_paths shows they ran."""
    from flashtile.integrations import sdpa
    from flashtile.ops import hopper
    sdpa.register()
    inputs = bhsd(device, 2, 8, 8, 256, 256, 128, dtype=torch.bfloat16, seed=8)
    dout = torch.randn_like(inputs[0])
    ref = with_grads(lambda *t: torch_sdpa(*t, is_causal=True), [t.double() for t in inputs], dout.double())
    base = with_grads(lambda *t: torch_sdpa(*t, is_causal=True), inputs, dout)
    hopper._LAST.clear()
    registry.activate_flash_attention_impl("flashtile")
    try:
        def flash(*t):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(*t, is_causal=True)
        ours = with_grads(flash, inputs, dout)
    finally:
        registry.restore_flash_attention_impl()
    assert set(flashtile.last_kernel_paths()) == {"fwd", "bwd_dq", "bwd_dkdv"}
    for name, a, r, b in zip(("out", "dq", "dk", "dv"), ours, ref, base):
        check_close(name, a, r, b, 2 if name == "out" else 3)


def test_dropout_reaches_the_kernels_and_not_the_registry(device):
    """The SDPA function takes dropout (flashtile's, drawn from the generator: manual_seed reproduces it); the
    registry's overrides refuse it, since the aten ops' RNG state is not flashtile's seed."""
    from flashtile.integrations import sdpa as registry

    q, k, v = bhsd(device, 1, 2, 2, 16, 16, 16)
    torch.manual_seed(3)
    first = flashtile.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(3)
    assert torch.equal(flashtile.scaled_dot_product_attention(q, k, v, dropout_p=0.3), first)
    assert not torch.equal(first, flashtile.scaled_dot_product_attention(q, k, v))
    with pytest.raises(RuntimeError, match="dropout_p"):
        registry._forward(*(t.transpose(1, 2) for t in (q, k, v)), None, None, 16, 16, 0.3, False, False, None,
                          -1, -1)
