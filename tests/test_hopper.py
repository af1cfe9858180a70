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
    (dict(head_dim=64), "head dim 64"),
    (dict(head_dim=256), "head dim 256"),
    (dict(varlen=True), "varlen batches"),
    (dict(paged=True), "paged K/V"),
    (dict(seqused=True), "seqused_q/seqused_k"),
    (dict(softcap=30.0), "softcap"),
    (dict(alibi=True), "ALiBi"),
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


def _captured_launch(monkeypatch, which):
    """The arguments ops/hopper.py would launch its Gluon kernel with, for CPU tensors (nothing is launched)."""
    calls = []
    monkeypatch.setattr(hopper, "launch_fixed", lambda kernel, key, grid, dynamic, static, constexprs, num_warps:
                        calls.append((kernel, grid, dynamic, static, constexprs)))
    pads = iter(range(8, 200, 8))

    def tensor(*shape):
        # Each tensor a view with its own strides, so that a descriptor built over the wrong tensor shows.
        return torch.empty(*shape[:-1], shape[-1] + next(pads), dtype=torch.bfloat16)[..., :shape[-1]]

    q, out, dout = (tensor(2, 100, 4, 128) for _ in range(3))
    k, v, dk, dv = (tensor(2, 130, 2, 128) for _ in range(4))
    lse = torch.empty(2, 4, 100)
    if which == "fwd":
        hopper.fwd(q, k, v, out, lse, 0.1, -1, 0)
        tensors = [(q, "BLOCK_M"), (k, "BLOCK_N"), (v, "BLOCK_N"), (out, "BLOCK_M")]
    else:
        hopper.bwd_dkdv(q, k, v, dout, dk, dv, lse, torch.empty_like(lse), 0.1, 0.07, -1, 0)
        tensors = [(q, "BLOCK_M"), (k, "BLOCK_N"), (v, "BLOCK_N"), (dout, "BLOCK_M"), (dk, "BLOCK_N"),
                   (dv, "BLOCK_N")]
    (call,) = calls
    return call, tensors, q, k, lse


@pytest.mark.skipif(hopper._GLUON_ERROR is not None, reason="no Gluon in this Triton")
@pytest.mark.parametrize("which", list(HOPPER))
def test_launch_arguments_match_the_kernels(monkeypatch, which):
    """Each Gluon launch passes every kernel parameter once, constexprs as constexprs, the integers by name and
    a descriptor over the right tensor with the right box in each place: a launcher/kernel mismatch would
    otherwise first show on a GPU."""
    (kernel, grid, dynamic, static, constexprs), tensors, q, k, lse = _captured_launch(monkeypatch, which)
    params = kernel.params
    assert len(dynamic) + len(static) + len(constexprs) == len(params)
    assert {p.name for p in params if p.is_constexpr} == set(constexprs)
    assert all(not p.is_constexpr for p in params[:len(dynamic) + len(static)])
    descs = [d for d in dynamic if hasattr(d, "block_shape")]
    assert [d.base for d in descs] == [t for t, _ in tensors]
    assert [d.block_shape for d in descs] == [[1, constexprs[rows], 1, 128] for _, rows in tensors]
    assert [d.strides for d in descs] == [list(t.stride()) for t, _ in tensors]
    ints = dict(zip((p.name for p in params[len(dynamic):]), static))
    assert (ints["seqlen_q"], ints["seqlen_k"]) == (q.shape[1], k.shape[1])
    assert (ints["stride_lb"], ints["stride_lh"]) == lse.stride()[:2]
    assert (ints["wl"], ints["wr"]) == (-1, 0) and constexprs["MASK_RIGHT"] and not constexprs["MASK_LEFT"]
    assert constexprs["GROUP"] == 2 and constexprs["HEAD_DIM"] == 128
    side, rows, heads = (k.shape[1], constexprs["BLOCK_N"], 2) if which == "bwd_dkdv" else \
        (q.shape[1], constexprs["BLOCK_M"], 4)
    assert grid == (-(-side // (2 * rows)), heads, 2)
