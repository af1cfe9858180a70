"""The launch cache (ops/launch.py, Note [launch cache]): a repeated signature launches from the cache and computes
the same thing; whatever changes a kernel argument or its specialisation changes the key; and a key that misses
something is caught, not run. Under the interpreter every cache hit also recomputes the static arguments and the
dynamic ones' specialisation and compares them with the cached ones."""

import pytest
import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

import flashtile
import flashtile.ops.call
from flashtile import env
from flashtile.ops import launch, triton_internals
from flashtile.testing import attention_ref, check_close, op_args


def _inputs(device, seed, b=1, s=40, h=2, d=32, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g).to(device, dtype).requires_grad_() for _ in range(3)]


def _check(q, k, v, out, dout, **kw):
    ref, _ = attention_ref(q, k, v, **kw)
    base, _ = attention_ref(q, k, v, upcast=False, **kw)
    check_close("out", out, ref, base, 2)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = torch.autograd.grad(attention_ref(q, k, v, **kw)[0], (q, k, v), dout)
    bases = torch.autograd.grad(attention_ref(q, k, v, upcast=False, **kw)[0], (q, k, v), dout)
    for name, ours, r, b in zip(("dq", "dk", "dv"), grads, refs, bases):
        check_close(name, ours, r, b, 3)


def test_repeated_signature_hits_the_cache_and_stays_exact(device, monkeypatch):
    monkeypatch.setattr(launch, "_CACHE", {})
    kw = dict(causal=True, softcap=5.0)
    q, k, v = _inputs(device, 0)
    dout = torch.randn_like(q)
    _check(q, k, v, flashtile.flash_attn_func(q, k, v, **kw), dout, **kw)
    assert launch.cache_info() == 3  # forward, dQ, dK/dV
    # New data, the same shapes: every launch comes from the cache.
    q, k, v = _inputs(device, 1)
    _check(q, k, v, flashtile.flash_attn_func(q, k, v, **kw), dout, **kw)
    assert launch.cache_info() == 3


@pytest.mark.parametrize("change", ["window", "strides", "misaligned_alibi", "seqlen", "softmax_scale"])
def test_what_changes_a_kernel_argument_changes_the_key(device, monkeypatch, change):
    """Each call differs from the first in one thing the kernels see. What the static arguments or the
    specialisation read gives each of the three kernels a new key; the softmax scale is a dynamic argument, which
    the cached launch takes anew. Each result is checked (and, under the interpreter, a hit with a stale key would
    raise)."""
    monkeypatch.setattr(launch, "_CACHE", {})
    q, k, v = _inputs(device, 2)
    dout = torch.randn_like(q)
    slopes = torch.tensor([0.5, 0.25], device=device)
    kw = dict(window_size=(5, 3), alibi_slopes=slopes)
    _check(q, k, v, flashtile.flash_attn_func(q, k, v, **kw), dout, **kw)
    q2, k2, v2 = _inputs(device, 3)
    if change == "window":
        kw = dict(kw, window_size=(6, 3))
    elif change == "strides":
        q2 = torch.randn(1, 2, 40, 32, device=device, dtype=torch.float16).transpose(1, 2).requires_grad_()
    elif change == "misaligned_alibi":
        # A float32 view 4 bytes into its buffer: Triton specialises pointers on 16-byte alignment.
        kw = dict(kw, alibi_slopes=torch.tensor([0.0, 0.5, 0.25], device=device)[1:])
    elif change == "seqlen":
        q2, k2, v2 = _inputs(device, 3, s=48)
        dout = torch.randn_like(q2)
    else:
        kw = dict(kw, softmax_scale=0.3)
    assert launch.cache_info() == 3  # forward, dQ, dK/dV
    _check(q2, k2, v2, flashtile.flash_attn_func(q2, k2, v2, **kw), dout, **kw)
    assert launch.cache_info() == (3 if change == "softmax_scale" else 6)


def test_an_incomplete_key_is_caught(device, monkeypatch):
    """If a launcher left something its static arguments depend on out of the key, a hit would launch with stale
    strides or lengths: the checks refuse instead."""
    monkeypatch.setattr(launch, "_CACHE", {})
    monkeypatch.setattr(flashtile.ops.call.OpProblem, "key", lambda self: "the same for every call")
    monkeypatch.setenv("FLASHTILE_CHECK", "1")
    with torch.no_grad():
        flashtile.flash_attn_func(*_inputs(device, 4, s=40))
        with pytest.raises(AssertionError, match="launch cache key does not determine"):
            flashtile.flash_attn_func(*_inputs(device, 4, s=48))


def test_the_cache_is_bounded(device, monkeypatch):
    monkeypatch.setattr(launch, "_CACHE", {})
    monkeypatch.setattr(launch, "MAX_CACHED", 2)
    with torch.no_grad():
        for s in (17, 18, 19):
            flashtile.flash_attn_func(*_inputs(device, 5, s=s))
    assert launch.cache_info() == 2


@pytest.mark.parametrize("seqused", [False, True])
def test_varlen_lengths_are_not_part_of_the_key(device, monkeypatch, seqused):
    """Sequence lengths live on the device and are read by the kernels, so a batch with other lengths but the same
    totals launches from the cache, and must still come out right, forward and backward."""
    from test_varlen import run_varlen

    monkeypatch.setattr(launch, "_CACHE", {})
    run_varlen(device, [20, 13, 31], [24, 9, 31], causal=True, seqused=seqused)
    cached = launch.cache_info()
    run_varlen(device, [31, 20, 13], [9, 31, 24], causal=True, seqused=seqused, seed=1)
    assert launch.cache_info() == cached


def test_host_integer_helpers_match_triton():
    """ops/common's cdiv and next_power_of_2, which host code calls in place of Triton's (constexpr functions, a
    few µs a call from Python), give Triton's values."""
    import triton
    from flashtile.ops.common import cdiv, next_power_of_2
    for n in [0, 1, 2, 3, 7, 8, 9, 1000, 4096, 4097, 2**31 - 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in [1, 3, 64, 128, 65535]:
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_the_triton_internals_probe_passes_on_the_tested_triton():
    """Note [triton internals probe]: on the Triton that pyproject.toml pins, every shortcut holds."""
    if not env.fast_launch():
        pytest.skip("FLASHTILE_FAST_LAUNCH=0")
    assert triton_internals.REASON is None and triton_internals.FAST


@pytest.mark.parametrize("change", ["version", "run_call"])
def test_the_probe_says_what_does_not_hold(monkeypatch, change):
    if change == "version":
        monkeypatch.setattr(triton, "__version__", "9.9.0")
        expected = "9.9.0 is not one"
    else:
        monkeypatch.setattr(triton_internals, "_RUN_CALL", "kernel.run(grid, stream)")
        expected = "JITFunction.run"
    reason = triton_internals._probe() if env.fast_launch() else "skip"
    if reason == "skip":
        pytest.skip("FLASHTILE_FAST_LAUNCH=0")
    assert expected in reason


def test_without_the_shortcuts_every_launch_goes_through_triton(device, monkeypatch):
    """When the probe fails (Note [triton internals probe]) nothing is cached and descriptors are built by their
    constructors; the results are the same bits."""
    kw = dict(causal=True)
    q, k, v = _inputs(device, 3, d=64)
    dout = torch.randn_like(q)
    monkeypatch.setattr(launch, "_CACHE", {})
    fast = flashtile.flash_attn_func(q, k, v, **kw)
    fast_grads = torch.autograd.grad(fast, (q, k, v), dout)
    assert launch.cache_info() == 3
    monkeypatch.setattr(launch, "_CACHE", {})
    monkeypatch.setattr(triton_internals, "FAST", False)
    built = []
    monkeypatch.setattr(TensorDescriptor, "__post_init__", lambda self: built.append(self), raising=False)
    slow = flashtile.flash_attn_func(q, k, v, **kw)
    slow_grads = torch.autograd.grad(slow, (q, k, v), dout)
    assert launch.cache_info() == 0
    assert built, "no descriptor went through its constructor"
    assert torch.equal(fast, slow)
    for a, b in zip(fast_grads, slow_grads):
        assert torch.equal(a, b)


def test_named_arguments_are_checked_against_the_kernel():
    """launch_named orders arguments from the kernel's parameter list and refuses a missing, extra or misplaced
    name, naming the kernel's parameters."""
    from flashtile.kernels.schedule import _plan_kernel

    names = _plan_kernel.arg_names
    dynamic = {n: None for n in names[:8]}
    static = {n: 0 for n in names[8:12]}
    constexprs = {n: 0 for n in names[12:]}
    d, s = launch._order(_plan_kernel, dict(reversed(dynamic.items())), static, constexprs)
    assert d == tuple(dynamic.values()) and s == tuple(static.values())
    for broken in ({**static, "extra": 1}, {n: 0 for n in names[8:11]}, {**static, names[0]: 0}):
        with pytest.raises(TypeError, match="_plan_kernel takes"):
            launch._order(_plan_kernel, dynamic, broken, constexprs)


def test_the_problem_key_covers_every_field(device):
    """ops/call.OpProblem.key is derived from every field (tensors by signature), except the per-call floats that
    the kernels take as arguments: a field added to the problem is in the key without an edit."""
    from flashtile.ops.call import OpProblem, op_problem

    q, k, v = _inputs(device, 6)
    p = op_problem(*op_args(op_problem, q=q, k=k, v=v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                            seqused_k=None, alibi_slopes=None, block_table=None, learnable_sink=None, rng=None,
                            max_seqlen_q=40, max_seqlen_k=40, softmax_scale=0.125, window_right=0))
    tensors = OpProblem._fields[:OpProblem._fields.index("varlen")]
    assert p.launch_key == p.key()
    for name, value in zip(OpProblem._fields, p):
        if name == "launch_key":  # the key itself, which the launchers read
            continue
        if name in ("softmax_scale", "softcap", "dropout_p"):
            base = p._replace(softcap=1.0, dropout_p=0.5)
            assert base._replace(**{name: getattr(base, name) + 0.5}).key() == base.key(), name
            continue
        other = (torch.empty(3, 2, 1, device=device) if name in tensors else not value if isinstance(value, bool)
                 else value + 1 if isinstance(value, int) else f"{value} changed")
        assert p._replace(**{name: other}).key() != p.key(), name
    assert p._replace(softcap=1.0).key() != p.key()  # softcap on or off changes the kernel
    assert p._replace(dropout_p=0.1).key() != p.key()  # and so does dropout


def _problem(q, k, v, **kw):
    from flashtile.ops.call import op_problem

    args = dict(q=q, k=k, v=v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                alibi_slopes=None, block_table=None, learnable_sink=None, rng=None, max_seqlen_q=40, max_seqlen_k=40,
                softmax_scale=0.125, window_right=0)
    return op_problem(*op_args(op_problem, **(args | kw)))


def test_a_problem_like_one_seen_is_remembered(device, monkeypatch):
    """ops/call.op_problem remembers a problem's decisions under its arguments' signatures (Note [problem memo]):
    a call like one seen takes them with its own tensors and per-call floats; another layout, integer or
    environment flag is another problem; a call whose tensors had to be copied is not remembered; and a
    remembered problem that is not what op_problem derives is caught (checked at every hit here, under the
    interpreter, or with FLASHTILE_CHECK=1)."""
    from flashtile.ops import call

    monkeypatch.setenv("FLASHTILE_CHECK", "1")
    first = _problem(*_inputs(device, 7))
    assert len(call._MEMO) == 1
    q, k, v = _inputs(device, 8)
    hit = _problem(q, k, v, softmax_scale=0.5, softcap=2.0)
    assert len(call._MEMO) == 2  # softcap on: another kernel
    again = _problem(q, k, v, softmax_scale=0.25, softcap=3.0)
    assert len(call._MEMO) == 2
    assert again.q is q and again.k is k and (again.softmax_scale, again.softcap) == (0.25, 3.0)
    assert again.launch_key == hit.launch_key == again.key() != first.launch_key
    _problem(q, k, v, window_left=7)
    monkeypatch.setenv("FLASHTILE_HOPPER", "0")
    _problem(q, k, v)
    assert len(call._MEMO) == 4
    # A view 2 bytes into its buffer: tma_ready copies it, and the copy's problem is not remembered.
    odd = torch.randn(q.numel() + 1, device=device).to(q.dtype)[1:].view(q.shape)
    assert _problem(odd, k, v).q is not odd
    assert len(call._MEMO) == 4
    key = list(call._MEMO)[-1]  # the last call's: FLASHTILE_HOPPER=0, the window the default
    forged = list(call._MEMO[key][0])
    forged[2] += 1  # the batch
    call._MEMO[key] = (tuple(forged), *call._MEMO[key][1:])
    with pytest.raises(AssertionError, match="problem memo"):
        _problem(*_inputs(device, 9))
