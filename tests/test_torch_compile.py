"""torch.compile over every public entry point: fullgraph (a graph break raises), forward and, where there is one,
backward, bitwise equal to the eager call; dynamic=True compiles once for new lengths; opcheck of the custom ops
the other test files do not check.

Already covered elsewhere and not repeated here: flash_attn_func (tests/test_api.py, with dynamic shapes and
opcheck of flashtile::fwd), flash_attn_varlen_func (tests/test_varlen.py), flash_attn_with_kvcache with opcheck of
flashtile::append_kv and flashtile::decode (tests/test_kvcache.py), combine (tests/test_combine.py). Backends:
aot_eager everywhere (it traces forward and backward as inductor does, without generating code), inductor once.
"""

import inspect

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import flashtile
from flashtile.testing import op_args


def rand(device, *shape, seed=0, dtype=torch.float16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def cu(device, lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def forward_backward(fn, inputs, seed=1):
    """(out, *grads) of fn(*inputs), from one fixed dout."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    dout = rand(out.device, *out.shape, seed=seed, dtype=out.dtype)
    return (out, *torch.autograd.grad(out, inputs, dout))


def assert_same_under_compile(fn, inputs, backend="aot_eager", **compile_kwargs):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend, **compile_kwargs)
    for got, want in zip(forward_backward(compiled, inputs), forward_backward(fn, inputs)):
        assert torch.equal(got, want)


def _entry_points(device):
    """name -> (function of differentiable tensors, those tensors): the entry points test_api.py and
    test_varlen.py do not compile."""
    lens = [7, 0, 12]
    cu_seqlens, total = cu(device, lens), sum(lens)
    return {
        "qkvpacked": (lambda qkv: flashtile.flash_attn_qkvpacked_func(qkv, causal=True),
                      [rand(device, 2, 19, 3, 2, 16)]),
        "kvpacked": (lambda q, kv: flashtile.flash_attn_kvpacked_func(q, kv, window_size=(4, 2)),
                     [rand(device, 2, 9, 4, 16), rand(device, 2, 13, 2, 2, 16, seed=2)]),
        "varlen_qkvpacked": (lambda qkv: flashtile.flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, 12, causal=True),
                             [rand(device, total, 3, 2, 16)]),
        "varlen_kvpacked": (lambda q, kv: flashtile.flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens, 12,
                                                                                     12, softcap=4.0),
                            [rand(device, total, 4, 16), rand(device, total, 2, 2, 16, seed=2)]),
        "scaled_dot_product_attention": (
            lambda q, k, v: flashtile.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            [rand(device, 1, 4, 10, 16), rand(device, 1, 2, 14, 16, seed=2), rand(device, 1, 2, 14, 16, seed=3)]),
    }


@pytest.mark.parametrize("name", ["qkvpacked", "kvpacked", "varlen_qkvpacked", "varlen_kvpacked",
                                  "scaled_dot_product_attention"])
def test_entry_point_fullgraph(device, name):
    fn, inputs = _entry_points(device)[name]
    assert_same_under_compile(fn, inputs)


def test_sdpa_under_inductor(device):
    """Inductor itself (CPU code generation around the custom ops), once: it is the slow backend to build."""
    fn, inputs = _entry_points(device)["scaled_dot_product_attention"]
    assert_same_under_compile(fn, inputs, backend="inductor")


class Compiles:
    """fn compiled with dynamic=True through a backend that counts the graphs dynamo hands it. The first call may
    hand over more than one (an empty graph included); `new()` is how many came since the last look."""

    def __init__(self, fn):
        torch._dynamo.reset()
        self.counter = CompileCounterWithBackend("aot_eager")
        self.fn = torch.compile(fn, fullgraph=True, backend=self.counter, dynamic=True)
        self.seen = 0

    def new(self) -> int:
        count, self.seen = self.counter.frame_count - self.seen, self.counter.frame_count
        return count


def test_dynamic_shapes_compile_once(device):
    """New lengths (and a new batch) under dynamic=True reuse the one graph: nothing in the API specialises on
    them."""
    def f(q, k, v):
        return flashtile.flash_attn_func(q, k, v, causal=True, window_size=(8, -1))

    compiled = Compiles(f)
    # Sizes other than 0 and 1, and no two alike in the first call: dynamo specialises those (duck sizing).
    for i, (b, sq, sk) in enumerate(((2, 20, 24), (3, 40, 33), (2, 7, 50))):
        q, k, v = rand(device, b, sq, 4, 16), rand(device, b, sk, 1, 16, seed=2), rand(device, b, sk, 1, 16, seed=3)
        for got, want in zip(forward_backward(compiled.fn, (q, k, v)), forward_backward(f, (q, k, v))):
            assert torch.equal(got, want)
        assert compiled.new() > 0 if i == 0 else compiled.new() == 0


def test_sdpa_dynamic_shapes_compile_once(device):
    def f(q, k, v):
        return flashtile.scaled_dot_product_attention(q, k, v, is_causal=True)

    compiled = Compiles(f)
    for i, s in enumerate((12, 20, 9)):
        q, k, v = (rand(device, 2, 3, s, 16, seed=i) for i in range(3))
        assert torch.equal(compiled.fn(q, k, v), f(q, k, v))
        assert compiled.new() > 0 if i == 0 else compiled.new() == 0


def test_varlen_needs_no_item_and_compiles_once(device):
    """cu_seqlens are graph inputs whose values dynamo never reads (a .item() would break the fullgraph trace), and
    max_seqlen, an int that sizes nothing in flashtile, does not specialise the graph either."""
    def f(q, k, v, cu_seqlens, max_seqlen):
        return flashtile.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)

    compiled = Compiles(f)
    for i, lens in enumerate(([5, 12], [3, 17, 2], [30])):
        cu_seqlens, total = cu(device, lens), sum(lens)
        q, k, v = (rand(device, total, 2, 16, seed=i) for i in range(3))
        got = forward_backward(lambda *t: compiled.fn(*t, cu_seqlens, max(lens)), (q, k, v))
        want = forward_backward(lambda *t: f(*t, cu_seqlens, max(lens)), (q, k, v))
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert compiled.new() > 0 if i == 0 else compiled.new() == 0


@pytest.mark.parametrize("features", ["plain", "sink_dropout"])
def test_opcheck_backward_op(device, features):
    from flashtile.ops.bwd import attention_bwd
    from flashtile.ops.dropout import draw_rng
    from flashtile.ops.fwd import attention_fwd
    q, k, v = rand(device, 1, 17, 4, 32), rand(device, 1, 23, 2, 32, seed=2), rand(device, 1, 23, 2, 32, seed=3)
    scalars = dict(max_seqlen_q=17, max_seqlen_k=23, softmax_scale=0.2, window_left=-1, window_right=0, softcap=0.0,
                   dropout_p=0.0, packing=0)
    if features == "sink_dropout":
        scalars.update(dropout_p=0.25, learnable_sink=torch.randn(4, device=device), rng=draw_rng(torch.device(device)))
    out, lse = attention_fwd(*op_args(attention_fwd, q=q, k=k, v=v, **scalars))
    args = op_args(attention_bwd, dout=rand(device, 1, 17, 4, 32, seed=4), q=q, k=k, v=v, out=out, lse=lse,
                         **scalars)
    torch.library.opcheck(attention_bwd, args, test_utils=("test_schema", "test_faketensor"))


def test_opcheck_combine_op(device):
    from flashtile.ops.decode import combine
    out_partials = rand(device, 3, 2, 5, 2, 16, dtype=torch.float32)
    lse_partials = rand(device, 3, 2, 2, 5, seed=2, dtype=torch.float32)
    torch.library.opcheck(combine, (out_partials, lse_partials, torch.float16),
                          test_utils=("test_schema", "test_faketensor"))
