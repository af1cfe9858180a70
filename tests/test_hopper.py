"""Which calls take the Gluon Hopper kernels (Note [hopper path] in ops/hopper.py), and that the answer can be asked.

The kernels themselves need an sm_90 GPU: their numerics are test_gpu.py's (test_hopper_*), their sm_90 compile is
test_compile.py's. Here: the decision, on a fake sm_90 device, and the query functions through the interpreter.
"""

import pytest
import torch

import flashtile
from flashtile import env
from flashtile.config import HOPPER
from flashtile.ops import hopper
from flashtile.ops import launch as launch_module

CUDA = torch.device("cuda", 0)


@pytest.fixture
def fake_sm90(monkeypatch):
    """hopper_unsupported as it decides on an H100/H200, without one: not interpreting, capability 9.0."""
    monkeypatch.setattr(env, "INTERPRET", False)
    monkeypatch.setattr(hopper, "capability", lambda device: (9, 0))
    if hopper._GLUON_ERROR is not None:
        pytest.skip(hopper._GLUON_ERROR)


def test_the_fast_path_covers_dense_bf16_fp16_d128(fake_sm90):
    for dtype in (torch.bfloat16, torch.float16):
        assert hopper.hopper_unsupported(CUDA, dtype, 128) is None


@pytest.mark.parametrize("kw, reason", [
    (dict(dtype=torch.float32), "dtype torch.float32"),
    (dict(head_dim=64), "head dims (q/k 64, v 64)"),
    (dict(head_dim=256), "head dims (q/k 256, v 256)"),
    (dict(head_dim=192), "head dims (q/k 192, v 192)"),
    (dict(head_dim=128, head_dim_v=64), "head dims (q/k 128, v 64)"),
    (dict(paged=True), "paged K/V"),
    (dict(seqused=True), "seqused_q/seqused_k"),
    (dict(softcap=30.0), "softcap"),
    (dict(alibi=True), "ALiBi"),
    (dict(dropout=True, kernel="bwd_dkdv"), "dropout"),
    (dict(device=torch.device("cpu")), "tensors on cpu"),
])
def test_everything_else_runs_triton_and_says_why(fake_sm90, kw, reason):
    args = dict(device=CUDA, dtype=torch.bfloat16, head_dim=128) | kw
    device, dtype, head_dim = args.pop("device"), args.pop("dtype"), args.pop("head_dim")
    assert reason in hopper.hopper_unsupported(device, dtype, head_dim, **args)


@pytest.mark.parametrize("cap", [(8, 0), (10, 0), (12, 0)])
def test_other_gpus_run_triton(monkeypatch, fake_sm90, cap):
    monkeypatch.setattr(hopper, "capability", lambda device: cap)
    assert "compute capability" in hopper.hopper_unsupported(CUDA, torch.bfloat16, 128)


def test_switched_off_by_env(monkeypatch, fake_sm90):
    monkeypatch.setenv("FLASHTILE_HOPPER", "0")
    assert hopper.hopper_unsupported(CUDA, torch.bfloat16, 128) == "switched off by FLASHTILE_HOPPER=0"


def test_kernel_paths_and_last_kernel_paths_here(device):
    """Through the interpreter (CI) every call runs the Triton kernels, and both query functions say so."""
    q = torch.randn(1, 9, 2, 128, device=device, requires_grad=True)
    paths = flashtile.kernel_paths(q, q, q, causal=True)
    assert paths["fwd"] == paths["bwd_dkdv"] == paths["bwd_dq"] == "triton" and paths["reason"]
    flashtile.flash_attn_func(q, q, q, causal=True).sum().backward()
    assert flashtile.last_kernel_paths() == {"fwd": "triton", "bwd_dq": "triton", "bwd_dkdv": "triton"}


def test_kernel_paths_validates_like_the_api():
    q = torch.randn(1, 9, 2, 64)
    with pytest.raises(ValueError, match="window_size"):
        flashtile.kernel_paths(q, q, q, window_size=(1, 2, 3))
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        flashtile.kernel_paths(q, torch.randn(1, 9, 3, 64), torch.randn(1, 9, 3, 64))


def _captured_launch(monkeypatch, device, which, varlen):
    """The arguments ops/hopper.py would launch its Gluon kernel with (nothing is launched; a varlen batch's tile
    list is written, on the test device)."""
    from flashtile.ops.schedule import varlen_plan

    calls = []
    def record(kernel, dynamic, statics, num_warps, key=None):  # ordered from the kernel's parameters
        grid, static, constexprs = statics()
        calls.append((kernel, grid, *launch_module._order(kernel, dynamic, static, constexprs), constexprs))

    monkeypatch.setattr(hopper, "launch_named", record)
    monkeypatch.setattr(hopper, "sm_count", lambda device: 7)  # fewer SMs than the persistent kernels' items
    lens_q, lens_k = [100, 0, 37], [130, 5, 37]
    pads = iter(range(8, 200, 8))

    def tensor(*shape):
        # Each tensor a view with its own row and head strides, so that a stride passed for the wrong tensor shows.
        return torch.empty(*shape[:-1], shape[-1] + next(pads), dtype=torch.bfloat16, device=device)[..., :shape[-1]]

    q_shape, kv_shape = ((sum(lens_q), 4, 128), (sum(lens_k), 2, 128)) if varlen else ((2, 100, 4, 128),
                                                                                        (2, 130, 2, 128))
    q, out, dout, dq = (tensor(*q_shape) for _ in range(4))
    k, v, dk, dv = (tensor(*kv_shape) for _ in range(4))
    if varlen:
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
                      for n in (lens_q, lens_k))
        lse = torch.empty(4, q.shape[0], device=device)
        queries = which != "bwd_dkdv"  # the forward and dQ tile the query side, last tile first
        tiled = (cu_q, q.shape[0], cu_k, k.shape[0]) if queries else (cu_k, k.shape[0], cu_q, q.shape[0])
        seq = (cu_q, cu_k, varlen_plan(tiled[0], None, tiled[1], tiled[2], None, tiled[3], 128, queries,
                                       not queries))
    else:
        lse = torch.empty(2, 4, 100, device=device)
        seq = ()
    if which == "fwd":
        hopper.fwd(q, k, v, out, lse, 0.1, -1, 0, *seq)
    elif which == "bwd_dq":
        hopper.bwd_dq(q, k, v, dout, dq, out, lse, torch.empty_like(lse), 0.1, 0.07, -1, 0, *seq)
    else:
        hopper.bwd_dkdv(q, k, v, dout, dk, dv, lse, torch.empty_like(lse), 0.1, 0.07, -1, 0, *seq)
    (call,) = calls
    return call, dict(q=q, k=k, v=v, out=out, dout=dout, dq=dq, dk=dk, dv=dv, lse=lse, plan=seq[-1] if varlen else None,
                      lens=lens_k if which == "bwd_dkdv" else lens_q)


@pytest.mark.skipif(hopper._GLUON_ERROR is not None, reason="no Gluon in this Triton")
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("which", list(HOPPER))
def test_launch_arguments_match_the_kernels(monkeypatch, device, which, varlen):
    """Each Gluon launch passes every kernel parameter once, constexprs as constexprs, and the integers by name:
    a launcher/kernel mismatch would otherwise first show on a GPU."""
    (kernel, grid, dynamic, static, constexprs), t = _captured_launch(monkeypatch, device, which, varlen)
    params = kernel.params
    assert len(dynamic) + len(static) + len(constexprs) == len(params)
    assert {p.name for p in params if p.is_constexpr} == set(constexprs)
    assert all(not p.is_constexpr for p in params[:len(dynamic) + len(static)])
    ints = dict(zip((p.name for p in params[len(dynamic):]), static))
    q, k = t["q"], t["k"]
    # Host descriptors, in the kernel's order, each over its tensor with its box, dense or varlen (Note [varlen
    # descriptors]).
    # Q2, K2, dQ2 and dK2: Q, K, dQ and dK, unused without a tail (Note [head dim parts]).
    order = {"fwd": ("q", "q", "k", "k", "v", "out"),
             "bwd_dkdv": ("q", "q", "k", "k", "v", "dout", "dk", "dk", "dv"),
             "bwd_dq": ("q", "q", "k", "k", "v", "dout", "dq", "dq")}[which]
    descs = [d for d in dynamic if hasattr(d, "block_shape")]
    assert [d.base for d in descs] == [t[n] for n in order]
    rows = [constexprs["BLOCK_N" if n in ("k", "v", "dk", "dv") else "BLOCK_M"] for n in order]
    assert [d.block_shape for d in descs] == [[*([] if varlen else [1]), r, 1, 128] for r in rows]
    assert [d.strides for d in descs] == [list(t[n].stride()) for n in order]
    assert (ints["seqlen_q"], ints["seqlen_k"]) == ((q.shape[0], k.shape[0]) if varlen else (q.shape[1], k.shape[1]))
    assert (ints["stride_lb"], ints["stride_lh"]) == ((0, t["lse"].stride(0)) if varlen else t["lse"].stride()[:2])
    assert (ints["wl"], ints["wr"]) == (-1, 0) and constexprs["MASK_RIGHT"] and not constexprs["MASK_LEFT"]
    assert constexprs["GROUP"] == 2 and constexprs["HEAD_DIM"] == 128
    assert constexprs["IS_VARLEN"] == varlen
    named = dict(zip((p.name for p in params), dynamic))
    if which == "bwd_dq":
        # The forward's output, read for delta, by pointer with its (batch, row, head) strides; LSE and delta.
        assert named["OUT"] is t["out"] and named["LSE"] is t["lse"] and named["DELTA"].shape == t["lse"].shape
        out_strides = (0, *t["out"].stride()[:2]) if varlen else t["out"].stride()[:3]
        assert (ints["stride_ob"], ints["stride_om"], ints["stride_oh"]) == out_strides
    # A varlen batch also passes the output tensors themselves, with their strides, for a sequence's partial last
    # tile (parameter, tensor, stride prefix).
    outputs = {"fwd": [("O_PTR", "out", "o")], "bwd_dkdv": [("DK_PTR", "dk", "dk"), ("DV_PTR", "dv", "dv")],
               "bwd_dq": [("DQ_PTR", "dq", "dq")]}[which]
    for param, name, prefix in outputs:
        assert named[param] is (t[name] if varlen else None), param
        strides = (ints[f"stride_{prefix}m"], ints[f"stride_{prefix}h"])
        assert strides == (t[name].stride()[:2] if varlen else (0, 0)), param
    if varlen:
        # Persistent: one program per SM (7 here) over the items, one per head (KV head for dK/dV) and entry of the
        # plan's tile list (which covers every query or key tile: the forward's and dQ's last tile first, dK/dV's
        # first first), and the kernel's own work counter in the plan, 16 bytes aligned.
        plan = t["plan"]
        tiles = plan.first_first if which == "bwd_dkdv" else plan.last_first
        entries = tiles.shape[0]
        heads = 2 if which == "bwd_dkdv" else 4
        assert named["TILES"] is tiles and entries >= -(-sum(t["lens"]) // 128) + 3
        assert (ints["n_items"], ints["heads"]) == (heads * entries, heads) and grid == (7, 1, 1)
        counter = named["COUNTER"]
        assert counter.data_ptr() == plan.counters[{"fwd": 0, "bwd_dkdv": 1, "bwd_dq": 2}[which]].data_ptr()
        assert counter.data_ptr() % 16 == 0 and counter.tolist() == [0] * 4
    else:
        rows = 2 * (constexprs["BLOCK_N"] if which == "bwd_dkdv" else constexprs["BLOCK_M"])
        side = k.shape[1] if which == "bwd_dkdv" else q.shape[1]
        # Persistent too, over batch x heads (KV heads for dK/dV) x tiles (hopper_common.dense_work_item), with a
        # zeroed work counter of its own.
        heads = 2 if which == "bwd_dkdv" else 4
        n_items = 2 * heads * -(-side // rows)
        assert (ints["n_items"], ints["heads"]) == (n_items, heads) and grid == (min(n_items, 7), 1, 1)
        assert named["COUNTER"].dtype == torch.int32 and named["COUNTER"].tolist() == [0]


def test_fallback_is_logged_once_per_reason(fake_sm90, monkeypatch, caplog):
    """On sm_90, a call that runs the Triton kernels says why, once per reason, at DEBUG on the "flashtile"
    logger; a call on the Gluon path says nothing."""
    import logging
    monkeypatch.setattr(hopper, "_LOGGED", set())
    with caplog.at_level(logging.DEBUG, logger="flashtile"):
        assert hopper.fallback_logging()
        for _ in range(2):
            hopper.log_fallback(CUDA, torch.bfloat16, 128, softcap=30.0)
        hopper.log_fallback(CUDA, torch.bfloat16, 128)
        hopper.log_fallback(CUDA, torch.bfloat16, 64)
        hopper.log_fallback(CUDA, torch.bfloat16, 192, head_dim_v=128)
    messages = [r.getMessage() for r in caplog.records if r.name == "flashtile"]
    assert len(messages) == 2 and "softcap" in messages[0] and "(q/k 64, v 64)" in messages[1]


@pytest.mark.skipif(hopper._GLUON_ERROR is not None, reason="no Gluon in this Triton")
def test_the_problem_key_determines_each_gluon_launch(monkeypatch):
    """The Gluon launchers key the launch cache by the call's OpProblem key (and the SM count), not by their
    arguments, and build their static part only on a miss (Note [launch cache]). The launch path as on an sm_90
    GPU, with CPU tensors and no kernel run (Triton's launch and the compiled launcher stubbed), and
    FLASHTILE_CHECK=1, under which every cache hit re-derives the static part and the specialisation and raises if
    either differs: over dense and varlen shapes, GQA, masks and a backward, every Gluon kernel hits and checks."""
    from triton.runtime.jit import JITFunction
    from flashtile.ops import device as device_module, triton_internals

    target = lambda: ((9, 0), 132)  # noqa: E731
    monkeypatch.setattr(env, "INTERPRET", False)
    monkeypatch.setenv("FLASHTILE_CHECK", "1")
    monkeypatch.setattr(launch_module, "capture_target", target)
    monkeypatch.setattr(device_module, "capture_target", target)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, **kwargs: object())  # a compiled kernel, to keep
    monkeypatch.setattr(triton_internals, "launch_compiled", lambda *args: None)
    monkeypatch.setattr(launch_module, "_CACHE", {})
    checked = []
    check = launch_module._check
    monkeypatch.setattr(launch_module, "_check", lambda kernel, *rest: (checked.append(kernel.__name__),
                                                                         check(kernel, *rest)))
    g = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, 128, generator=g).to(torch.bfloat16).requires_grad_()

    for batch, seqlen, heads, heads_kv, causal in [(2, 256, 4, 4, False), (1, 17, 4, 2, True), (3, 300, 4, 1, True)]:
        q, k, v = leaf(batch, seqlen, heads), leaf(batch, seqlen, heads_kv), leaf(batch, seqlen, heads_kv)
        for _ in range(2):
            flashtile.flash_attn_func(q, k, v, causal=causal).sum().backward()
    cu = torch.tensor([0, 100, 137, 393], dtype=torch.int32)
    q, k, v = leaf(393, 4), leaf(393, 2), leaf(393, 2)
    for _ in range(2):
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 256, 256, causal=True).sum().backward()
    assert flashtile.last_kernel_paths() == {"fwd": "gluon-sm90", "bwd_dq": "gluon-sm90", "bwd_dkdv": "gluon-sm90"}
    for kernel in ("_hopper_fwd_kernel", "_hopper_dq_kernel", "_hopper_dkdv_kernel"):
        assert checked.count(kernel) == 4, checked  # the second call of each of the four problems hit


def test_descriptor_fields_under_a_launch_key_are_checked(monkeypatch):
    """The Gluon launchers find their descriptors' fields by the launch key (hopper._descs); with
    FLASHTILE_CHECK=1 a hit whose tensors are laid out otherwise than the key's first ones raises."""
    monkeypatch.delenv("FLASHTILE_CHECK", raising=False)
    monkeypatch.setattr(hopper, "_DESC_FIELDS", {})
    a = torch.empty(2, 64, 4, 128, dtype=torch.bfloat16)
    b = torch.empty(2, 64, 8, 128, dtype=torch.bfloat16)[:, :, :4]  # a's shape, other strides
    key = ("a problem",)
    (first,) = hopper._descs(key, (a, 64))
    (hit,) = hopper._descs(key, (b, 64))
    assert hit.base is b and hit.strides == first.strides == list(a.stride())  # the key's fields, unchecked
    assert hopper._descs(None, (b, 64))[0].strides == list(b.stride())
    monkeypatch.setenv("FLASHTILE_CHECK", "1")
    assert hopper._descs(key, (a, 64))[0].base is a
    with pytest.raises(AssertionError, match="does not determine the descriptors"):
        hopper._descs(key, (b, 64))


def _capture_inputs(varlen, head_dim, head_dim_v=None):
    """bf16 q, k, v requiring grad for the capture tests: dense (2, 150, 4, d), or packed (300, 4, d) with
    cu_seqlens of three sequences (100, 37, 163 rows); (q, k, v, cu)."""
    g = torch.Generator().manual_seed(0)
    shape = (300, 4) if varlen else (2, 150, 4)
    q, k, v = (torch.randn(*shape, d, generator=g).to(torch.bfloat16).requires_grad_()
               for d in (head_dim, head_dim, head_dim_v or head_dim))
    return q, k, v, torch.tensor([0, 100, 137, 300], dtype=torch.int32)


@pytest.mark.skipif(hopper._GLUON_ERROR is not None, reason="no Gluon in this Triton")
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_mla_prefill_reads_q_and_k_in_two_parts(monkeypatch, varlen):
    """q/k 192 with v 128 on an sm_90 GPU runs the Gluon kernels, forward and backward, reading Q, K, dQ and dK as
    128 + 64 columns through a descriptor over each part (Note [head dim parts] in kernels/hopper_common.py): the
    second over the same storage, 128 elements in; V, O and dO whole. The launches as on an sm_90 GPU
    (capture_launches: recorded, not run)."""
    from flashtile.ops.launch import capture_launches

    monkeypatch.setattr(env, "INTERPRET", False)
    q, k, v, cu = _capture_inputs(varlen, 192, 128)
    with capture_launches() as launches:
        if varlen:
            out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 163, 163, causal=True)
        else:
            out = flashtile.flash_attn_func(q, k, v, causal=True)
            assert flashtile.kernel_paths(q, k, v, causal=True)["reason"] is None
        out.backward(torch.randn_like(out))
    assert flashtile.last_kernel_paths() == {"fwd": "gluon-sm90", "bwd_dq": "gluon-sm90", "bwd_dkdv": "gluon-sm90"}
    widths = {"_hopper_fwd_kernel": [128, 64, 128, 64, 128, 128],  # Q, Q2, K, K2, V, O
              "_hopper_dq_kernel": [128, 64, 128, 64, 128, 128, 128, 64],  # Q, Q2, K, K2, V, dO, dQ, dQ2
              "_hopper_dkdv_kernel": [128, 64, 128, 64, 128, 128, 128, 64, 128]}  # ..., dO, dK, dK2, dV
    for name, want in widths.items():
        (launch,) = [launch for launch in launches if launch.kernel.__name__ == name]
        assert (launch.kwargs["HEAD_DIM"], launch.kwargs["HEAD_DIM_TAIL"]) == (128, 64), name
        descs = [a for a in launch.args if hasattr(a, "block_shape")]
        assert [d.block_shape[-1] for d in descs] == want, name
        for first, tail in ((0, 1), (2, 3), *(((6, 7),) if name != "_hopper_fwd_kernel" else ())):
            a, b = descs[first].base, descs[tail].base
            assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr(), name
            assert b.data_ptr() - a.data_ptr() == 128 * 2 and a.stride() == b.stride(), name


@pytest.mark.skipif(hopper._GLUON_ERROR is not None, reason="no Gluon in this Triton")
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_head_dim_512_splits_columns_on_the_gluon_forward(monkeypatch, varlen):
    """q, k, v 512 in 16-bit inputs on an sm_90 GPU run the Gluon forward whose consumers split the head dim (Note
    [split columns] in kernels/hopper_fwd_wide.py), and the Triton backward, which kernel_paths and
    last_kernel_paths say: one program per 64-row tile and head (a varlen batch's tiles from its plan's list), every
    tensor through descriptors over its two 256-column halves of one storage, the second 256 elements in. The
    launches as on an sm_90 GPU (capture_launches: recorded, not run)."""
    from flashtile.ops.launch import capture_launches

    monkeypatch.setattr(env, "INTERPRET", False)
    q, k, v, cu = _capture_inputs(varlen, 512)
    with capture_launches() as launches:
        if varlen:
            out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 163, 163, causal=True)
        else:
            out = flashtile.flash_attn_func(q, k, v, causal=True)
            paths = flashtile.kernel_paths(q, k, v, causal=True)
            assert (paths["fwd"], paths["bwd_dq"], paths["bwd_dkdv"]) == ("gluon-sm90", "triton", "triton")
            assert "the Gluon bwd_dq kernel takes" in paths["reason"]
        out.backward(torch.randn_like(out))
    assert flashtile.last_kernel_paths() == {"fwd": "gluon-sm90", "bwd_dq": "triton", "bwd_dkdv": "triton"}
    (launch,) = [launch for launch in launches if launch.kernel.__name__ == "_hopper_fwd_wide_kernel"]
    assert (launch.kwargs["HEAD_DIM"], launch.kwargs["BLOCK_M"]) == (256, 64)
    if varlen:  # 64-row tiles of 100, 37, 163 rows; the list is sized by a bound on them (ops/schedule.py)
        assert launch.grid[0] % 4 == 0 and launch.grid[0] >= (2 + 1 + 3) * 4 and launch.grid[1:] == (1, 1)
    else:
        assert launch.grid == (2 * 3 * 4, 1, 1)
    descs = [a for a in launch.args if hasattr(a, "block_shape")]
    assert [d.block_shape[-1] for d in descs] == [256] * 8  # Q, Q2, K, K2, V, V2, O, O2
    for first in range(0, 8, 2):
        a, b = descs[first].base, descs[first + 1].base
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        assert b.data_ptr() - a.data_ptr() == 256 * 2 and a.stride() == b.stride()


def test_dropout_on_the_gluon_forward_and_dq(fake_sm90):
    """Dropout on the Gluon forward and dQ kernels, not on the dK/dV one (Note [dropout on the Gluon path] in
    ops/hopper.py), at each head dim pair the Gluon kernels take; the forward not under a causal or right-window
    mask, whose short items the Triton forward computes faster, except at d512."""
    def why(d, dv, **kw):
        return hopper.hopper_unsupported(CUDA, torch.bfloat16, d, head_dim_v=dv, **kw)
    for d, dv in hopper.gluon_head_dims():
        for right_mask in (False, True):
            assert why(d, dv, dropout=True, kernel="bwd_dq", right_mask=right_mask) is None
            assert "dK/dV" in why(d, dv, dropout=True, kernel="bwd_dkdv", right_mask=right_mask)
            assert all(why(d, dv, kernel=kernel, right_mask=right_mask) is None
                       for kernel in ("fwd", "bwd_dq", "bwd_dkdv"))
        assert why(d, dv, dropout=True) is None
        assert "causal" in why(d, dv, dropout=True, right_mask=True)
    # The d512 forward splits the head dim (kernels/hopper_fwd_wide.py) and takes dropout under any mask.
    assert why(512, 512, dropout=True, right_mask=True) is None


@pytest.mark.skipif(hopper._GLUON_ERROR is not None, reason="no Gluon in this Triton")
@pytest.mark.parametrize("varlen", [False, True, "cross"], ids=["dense", "varlen", "varlen-cross"])
def test_dropout_launches_gluon_fwd_and_dq_triton_dkdv(monkeypatch, varlen):
    """With dropout (and a left window, no right one) an sm_90 call launches the Gluon forward and dQ kernels with
    the mask on (HAS_DROPOUT, the call's seed and stream and p) and the Triton dK/dV kernel with the same seed and
    stream, so that they regenerate the forward's mask, its delta counts past every length (no Triton dQ publishes
    them) and no PDL; kernel_paths and last_kernel_paths say so, and that a causal one runs the Triton forward. The
    launches as on an sm_90 GPU (capture_launches: recorded, not run)."""
    from flashtile.ops.launch import capture_launches

    monkeypatch.setattr(env, "INTERPRET", False)
    q, k, v, cu = _capture_inputs(varlen, 128)
    cu_k = torch.tensor([0, 120, 137, 300], dtype=torch.int32) if varlen == "cross" else cu
    with capture_launches() as launches:
        if varlen:
            out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu_k, 163, 163, dropout_p=0.25, window_size=(40, -1))
        else:
            out = flashtile.flash_attn_func(q, k, v, dropout_p=0.25, window_size=(40, -1))
            paths = flashtile.kernel_paths(q, k, v, dropout_p=0.25, window_size=(40, -1))
            assert (paths["fwd"], paths["bwd_dq"], paths["bwd_dkdv"]) == ("gluon-sm90", "gluon-sm90", "triton")
            assert "dropout" in paths["reason"]
            assert flashtile.kernel_paths(q, k, v, dropout_p=0.25, causal=True)["fwd"] == "triton"
        out.backward(torch.randn_like(out))
    assert flashtile.last_kernel_paths() == {"fwd": "gluon-sm90", "bwd_dq": "gluon-sm90", "bwd_dkdv": "triton"}
    by_name = {launch.kernel.__name__: launch for launch in launches}
    fwd = by_name["_hopper_fwd_kernel"]
    named = dict(zip((p.name for p in fwd.kernel.params), fwd.args))
    assert fwd.kwargs["HAS_DROPOUT"] and named["dropout_p"] == 0.25
    dq = by_name["_hopper_dq_kernel"]
    dq_named = dict(zip((p.name for p in dq.kernel.params), dq.args))
    assert dq.kwargs["HAS_DROPOUT"] and dq_named["dropout_p"] == 0.25 and dq_named["RNG"] is named["RNG"]
    dkdv = by_name["_bwd_dkdv_kernel"]
    assert dkdv.kwargs["HAS_DROPOUT"] and not dkdv.kwargs["PDL"] and "launch_pdl" not in dkdv.kwargs
    dkdv_named = dict(zip(dkdv.kernel.arg_names, dkdv.args))
    assert torch.equal(dkdv_named["RNG"], named["RNG"]) and dkdv_named["dropout_p"] == 0.25
    assert dkdv_named["DELTA"] is dq_named["DELTA"]
    ready = dkdv_named["READY"]  # (sequence, head)
    assert (ready == 2 ** 31 - 1).all() and ready.numel() == (3 if varlen else 2) * 4
    if varlen:  # the Triton dK/dV kernel walks a schedule (of the key side's lengths), the Gluon dQ a tile list
        assert dkdv_named["SCHEDULE"] is not None and dq_named["TILES"] is not None
