"""The public API's contract: argument checking, packed variants, layouts, special rows, and torch.compile."""

import pytest
import torch

import flashtile
from flashtile.ops.fwd import attention_fwd
from flashtile.testing import attention_ref, check_close, nan_guarded, op_args


def qkv(device, b=2, sq=33, sk=40, h=4, hk=2, d=32, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, sq, h, d, generator=g).to(device, dtype),
            torch.randn(b, sk, hk, d, generator=g).to(device, dtype),
            torch.randn(b, sk, hk, d, generator=g).to(device, dtype))


def grads(fn, inputs, dout):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    return (out, *torch.autograd.grad(out, inputs, dout))


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v: (q[0], k, v), "q must have 4 dimensions"),
    (lambda q, k, v: (q, k.float(), v), "k has dtype"),
    (lambda q, k, v: (q.int(), k, v), "q has dtype"),
    (lambda q, k, v: (q, k, v[:, :-1]), "k and v must have the same shape"),
    (lambda q, k, v: (q, k[:1], v[:1]), "batch sizes differ"),
    (lambda q, k, v: (q[:, :, :3], k, v), "multiple of the number of key/value heads"),
    (lambda q, k, v: (q, k[..., :16], v[..., :16]), "same head_dim"),
    (lambda q, k, v: (q.transpose(1, 3), k, v), "must have unit stride"),
    (lambda q, k, v: ([q], k, v), "q must be a torch.Tensor"),
])
def test_bad_tensors(device, bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        flashtile.flash_attn_func(*bad(*qkv(device)))


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(dropout_p=1.5), ValueError, "dropout_p"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    (dict(softmax_scale=-0.5), ValueError, "softmax_scale"),
    (dict(window_size=(4,)), ValueError, "window_size"),
    (dict(window_size=(-3, 2)), ValueError, "window_size"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError, "alibi_slopes"),
    (dict(deterministic="yes"), TypeError, "deterministic"),
])
def test_bad_arguments(device, kwargs, exc, match):
    if isinstance(kwargs.get("alibi_slopes"), torch.Tensor):
        kwargs = dict(kwargs, alibi_slopes=kwargs["alibi_slopes"].to(device))
    with pytest.raises(exc, match=match):
        flashtile.flash_attn_func(*qkv(device), **kwargs)


def test_head_dim_too_large(device):
    q = torch.randn(1, 4, 1, 520, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="head_dim"):
        flashtile.flash_attn_func(q, q, q)


def test_return_attn_probs(device):
    q, k, v = qkv(device)
    out, lse, s_dmask = flashtile.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, 4, 33) and lse.dtype == torch.float32
    assert s_dmask.numel() == 0
    assert flashtile.flash_attn_func(q, k, v).shape == q.shape


def test_inputs_not_modified(device):
    q, k, v = qkv(device)
    copies = [t.clone() for t in (q, k, v)]
    flashtile.flash_attn_func(q, k, v, causal=True)
    for a, b in zip((q, k, v), copies):
        assert torch.equal(a, b)


def test_qkvpacked_matches_separate_and_grads_one_buffer(device):
    g = torch.Generator().manual_seed(2)
    qkv_t = torch.randn(2, 37, 3, 2, 32, generator=g).to(device, torch.float16).requires_grad_()
    dout = torch.randn(2, 37, 2, 32, generator=g).to(device, torch.float16)
    out = flashtile.flash_attn_qkvpacked_func(qkv_t, causal=True)
    (dqkv,) = torch.autograd.grad(out, qkv_t, dout)
    ref = grads(lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True), qkv_t.unbind(2), dout)
    assert torch.equal(out, ref[0])
    assert dqkv.shape == qkv_t.shape
    for i in range(3):
        assert torch.equal(dqkv[:, :, i], ref[1 + i])


def test_packed_backward_writes_one_buffer(device):
    """The backward op itself returns one gradient tensor for packed inputs (no concatenation afterwards)."""
    from flashtile.ops.bwd import attention_bwd
    from flashtile.ops.fwd import attention_fwd
    qkv_t = torch.randn(1, 20, 3, 2, 16, device=device, dtype=torch.float16)
    scalars = dict(max_seqlen_q=20, max_seqlen_k=20, softmax_scale=0.25, packing=1)
    out, lse = attention_fwd(*op_args(attention_fwd, q=qkv_t, **scalars))
    grads_ = attention_bwd(*op_args(attention_bwd, dout=torch.randn_like(out), q=qkv_t, out=out, lse=lse, **scalars))
    assert len(grads_) == 1 and grads_[0].shape == qkv_t.shape


def test_kvpacked_matches_separate(device):
    q, k, v = qkv(device, seed=3)
    kv = torch.stack([k, v], dim=2)
    dout = torch.randn_like(q)
    out, dq, dkv = grads(lambda q_, kv_: flashtile.flash_attn_kvpacked_func(q_, kv_, window_size=(6, 3)),
                         (q, kv), dout)
    ref = grads(lambda q_, k_, v_: flashtile.flash_attn_func(q_, k_, v_, window_size=(6, 3)), (q, k, v), dout)
    assert torch.equal(out, ref[0]) and torch.equal(dq, ref[1])
    assert torch.equal(dkv[:, :, 0], ref[2]) and torch.equal(dkv[:, :, 1], ref[3])


def test_non_contiguous_and_misaligned_layouts(device):
    """(B, H, S, D) storage viewed as (B, S, H, D), and a view starting at an odd element offset (not 16-byte
    aligned: the launcher copies it) give the same result as contiguous inputs."""
    q, k, v = qkv(device, h=2, hk=2)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    buf = torch.empty(k.numel() + 1, device=device, dtype=k.dtype)
    k_odd = buf[1:].view(k.shape)
    k_odd.copy_(k)
    assert k_odd.data_ptr() % 16 != 0
    expected = flashtile.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(flashtile.flash_attn_func(q_t, k_odd, v, causal=True), expected)


def test_size_one_dims_with_any_stride(device):
    """A dimension of size 1 may carry any stride (views and expands make such tensors); TMA wants every stride
    16-byte aligned, so the dense launcher's descriptors replace them (ops/common.py: dense_desc)."""
    q, k, v = qkv(device, b=1, h=1, hk=1)
    odd = [t.as_strided(t.shape, (3, t.stride(1), 5, 1)) for t in (q, k, v)]
    assert [t.stride() for t in odd] != [t.stride() for t in (q, k, v)]
    assert torch.equal(flashtile.flash_attn_func(*odd, causal=True), flashtile.flash_attn_func(q, k, v, causal=True))


def test_eager_route_and_custom_op_route_agree(device):
    """Eager calls run the op's implementations without the dispatcher (ops/common.py: Note [eager calls skip the
    dispatcher]); the custom op, with its registered autograd, is what tracing sees. Same numbers, bitwise."""
    q, k, v = qkv(device)
    dout = torch.randn_like(q)

    def through_op(q, k, v):
        return torch.ops.flashtile.fwd(*op_args(attention_fwd, q=q, k=k, v=v, max_seqlen_q=q.shape[1],
                                                max_seqlen_k=k.shape[1], softmax_scale=q.shape[-1] ** -0.5,
                                                window_right=0))[0]

    got = grads(lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
    want = grads(through_op, (q, k, v), dout)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("route", ["eager", "custom_op"])
def test_double_backward_raises(device, route):
    """A second-order gradient through attention raises (on either route) rather than silently missing the
    attention's own second-order terms."""
    q, k, v = (t.requires_grad_() for t in qkv(device, sq=16, sk=16))
    if route == "eager":
        out = flashtile.flash_attn_func(q, k, v)
    else:
        out = torch.ops.flashtile.fwd(*op_args(attention_fwd, q=q, k=k, v=v, max_seqlen_q=16, max_seqlen_k=16,
                                               softmax_scale=0.2))[0]
    with pytest.raises(RuntimeError):
        (dq,) = torch.autograd.grad(out.float().sum(), q, create_graph=True)
        torch.autograd.grad(dq.float().sum() + (q.float() ** 2).sum(), q)


def test_forward_mode_ad_raises(device):
    """No jvp is implemented: a dual input must raise, not return an output without its tangent."""
    import torch.autograd.forward_ad as fwAD
    q, k, v = qkv(device, sq=16, sk=16)
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        flashtile.flash_attn_func(fwAD.make_dual(q, torch.randn_like(q)), k, v)


def test_vmap_takes_the_custom_op_route(device):
    """vmap's batched tensors look like plain tensors from Python; they must reach the custom op (and its batching
    fallback), not a kernel."""
    q, k, v = qkv(device, b=1, sq=16, sk=16)
    qs = torch.stack([q, 2 * q])
    out = torch.func.vmap(lambda q: flashtile.flash_attn_func(q, k, v))(qs)
    for i in range(2):
        assert torch.equal(out[i], flashtile.flash_attn_func(qs[i], k, v))


def test_the_interpreter_problem_is_named():
    from flashtile.ops.device import interpreter_problem
    assert "numpy<2.4" in interpreter_problem("3.6.0", "2.4.1")
    assert "numpy<2.4" in interpreter_problem("3.5.1+git1234", "2.5.0rc1")
    assert interpreter_problem("3.6.0", "2.3.5") is None and interpreter_problem("3.7.0", "2.4.1") is None


@pytest.mark.parametrize("interpret", [True, False], ids=["interpreter", "no interpreter"])
def test_tensor_subclasses_take_the_custom_op_route(monkeypatch, interpret):
    """FakeTensors run the ops' fakes, with or without the interpreter (a GPU machine tracing with CPU example
    inputs); a real CPU tensor without the interpreter gets the error that says how to run it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashtile import env
    from flashtile.ops.common import untraced
    monkeypatch.setattr(env, "INTERPRET", interpret)
    q = torch.randn(1, 8, 2, 16)
    assert untraced((q, None, 3)) and untraced((torch.nn.Parameter(q),))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(q)
        assert not untraced((fake, None))
        out = flashtile.flash_attn_func(fake, fake, fake)  # the op's fake runs: no kernel, no error
    assert out.shape == q.shape
    if not interpret:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            flashtile.flash_attn_func(q, q, q)


def test_fully_masked_rows_are_zero_without_nan(device):
    # seqlen_q > seqlen_k with causal: the first Sq - Sk rows see no key.
    q, k, v = nan_guarded((1, 40, 2, 32), torch.float16, device), *(
        nan_guarded((1, 9, 2, 32), torch.float16, device) for _ in range(2))
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = flashtile.flash_attn_func(*inputs, causal=True, return_attn_probs=True)
    out.backward(torch.randn_like(out))
    assert torch.all(out[:, :31] == 0) and torch.all(lse[:, :, :31] == float("inf"))
    assert torch.isfinite(lse[:, :, 31:]).all()
    for t in inputs:
        assert torch.isfinite(t.grad).all()


def test_rows_of_p_sum_to_one(device):
    """With v = 1 everywhere the output is exactly the row sum of P: 1 for every row that sees a key."""
    q, k, _ = qkv(device, sq=50, sk=50, h=2, hk=2)
    out = flashtile.flash_attn_func(q, k, torch.ones_like(k), window_size=(5, 0), softcap=3.0)
    torch.testing.assert_close(out.float(), torch.ones_like(out, dtype=torch.float32), atol=2e-3, rtol=0)


def test_head_dim_padding_and_default_scale(device):
    """head_dim 20 runs padded to 24, with the default scale of the unpadded head dim."""
    q, k, v = qkv(device, d=20)
    out = flashtile.flash_attn_func(q, k, v)
    ref, _ = attention_ref(q.double(), k.double(), v.double())
    pt, _ = attention_ref(q, k, v, upcast=False)
    assert out.shape == q.shape
    check_close("out", out, ref, pt, 2)


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_torch_compile_fullgraph(device, backend):
    torch._dynamo.reset()
    q, k, v = qkv(device)
    dout = torch.randn_like(q)

    def f(q, k, v):
        return flashtile.flash_attn_func(q, k, v, causal=True, softcap=5.0)

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    got = grads(compiled, (q, k, v), dout)
    want = grads(f, (q, k, v), dout)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_torch_compile_dynamic_shapes(device):
    """dynamic=True makes lengths and float arguments symbolic; the API's checks must not break the graph."""
    torch._dynamo.reset()

    def f(q, k, v):
        return flashtile.flash_attn_func(q, k, v, causal=True, softcap=5.0)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    for sq, sk in ((16, 24), (40, 33)):
        q, k, v = qkv(device, sq=sq, sk=sk)
        dout = torch.randn_like(q)
        for a, b in zip(grads(compiled, (q, k, v), dout), grads(f, (q, k, v), dout)):
            assert torch.equal(a, b)


def test_opcheck(device):
    from flashtile.ops.fwd import attention_fwd
    q, k, v = qkv(device, sq=17, sk=23)
    args = op_args(attention_fwd, q=q, k=k, v=v, max_seqlen_q=17, max_seqlen_k=23, softmax_scale=0.2, window_right=0)
    torch.library.opcheck(attention_fwd, args, test_utils=("test_schema", "test_faketensor",
                                                            "test_autograd_registration"))


def test_backward_op_takes_a_strided_lse(device):
    """flashtile::bwd with lse a view into a wider buffer (ring attention's half sequence; an aten op's lse): the
    kernels write delta with lse's strides into a buffer shaped like it, so a view is made dense first
    (ops/call.py; before, the writes ran past that buffer). The gradients equal those of a dense lse, and the
    buffer the view lies in is not written."""
    from flashtile.ops.bwd import attention_bwd
    q, k, v = qkv(device, sq=17, sk=23)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    n = lse.shape[-1]
    wide = torch.full((*lse.shape[:-1], 3 * n), float("nan"), device=device)
    wide[..., n:2 * n] = lse
    before = wide.clone()
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, out.dtype)

    def backward(lse):
        return attention_bwd(*op_args(attention_bwd, dout=dout, q=q, k=k, v=v, out=out, lse=lse, max_seqlen_q=17,
                                      max_seqlen_k=23, softmax_scale=0.25, window_right=0))

    for got, want in zip(backward(wide[..., n:2 * n]), backward(lse)):
        assert torch.equal(got, want)
    assert torch.equal(wide.isnan(), before.isnan()) and torch.equal(wide.nan_to_num(), before.nan_to_num())


def test_autotune_flag_under_the_interpreter(device, monkeypatch):
    """FLASHTILE_AUTOTUNE=1 tunes only on a GPU (ops/launch.launch): under the interpreter the autotuner is never
    built, and the table's tiles give the same bits as without the flag."""
    from flashtile import env
    from flashtile.ops import launch
    if not env.INTERPRET:
        pytest.skip("on a GPU this tunes for real; tests/test_gpu.py::test_autotune_path covers it")
    q, k, v = qkv(device, sq=20, sk=20)
    expected = flashtile.flash_attn_func(q, k, v, causal=True)

    def no_tuner(kernel, name, pre_hook):
        raise AssertionError(f"{name}: an autotuner built under the interpreter")

    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "1")
    monkeypatch.setattr(launch, "_autotuned", no_tuner)
    assert torch.equal(flashtile.flash_attn_func(q, k, v, causal=True), expected)


@pytest.mark.parametrize("mapping", [True, False], ids=["environ mapping", "os.environ.get"])
def test_flags_follow_the_environment_at_every_read(monkeypatch, mapping):
    """env.py reads its flags on every call, through CPython's environ mapping where it has one, parsing each
    distinct value once: a variable set, changed or removed mid-process is seen at the next read."""
    from flashtile import env
    if not mapping:
        monkeypatch.setattr(env, "_ENVIRON", None)
    for name in ("FLASHTILE_HOPPER", "FLASHTILE_CHECK"):
        monkeypatch.delenv(name, raising=False)
    assert env.hopper() and not env.debug_checks()  # the defaults
    for value, on in (("0", False), (" Off ", False), ("no", False), ("", False), ("1", True), ("Yes", True)):
        monkeypatch.setenv("FLASHTILE_HOPPER", value)
        monkeypatch.setenv("FLASHTILE_CHECK", value)
        assert (env.hopper(), env.debug_checks()) == (on, on), value
    monkeypatch.delenv("FLASHTILE_HOPPER")
    monkeypatch.delenv("FLASHTILE_CHECK")
    assert env.hopper() and not env.debug_checks()
