"""Which calls take the Gluon Hopper kernels (Note [hopper path] in ops/hopper.py), and that the answer can be asked.

The kernels themselves need an sm_90 GPU: their numerics are test_gpu.py's (test_hopper_*), their sm_90 compile is
test_compile.py's. Here: the decision, on a fake sm_90 device, and the query functions through the interpreter.
"""

import pytest
import torch

import flashtile
from flashtile import env
from flashtile.ops import hopper

CUDA = torch.device("cuda", 0)


@pytest.fixture
def fake_sm90(monkeypatch):
    """hopper_unsupported as it decides on an H100/H200, without one: not interpreting, capability 9.0."""
    monkeypatch.setattr(env, "INTERPRET", False)
    monkeypatch.setattr(hopper, "_capability", lambda index: (9, 0))
    if hopper._GLUON_ERROR is not None:
        pytest.skip(hopper._GLUON_ERROR)


def test_the_fast_path_covers_dense_bf16_fp16_d128(fake_sm90):
    for dtype in (torch.bfloat16, torch.float16):
        assert hopper.hopper_unsupported(CUDA, dtype, 128) is None


@pytest.mark.parametrize("kw, reason", [
    (dict(dtype=torch.float32), "dtype torch.float32"),
    (dict(head_dim=64), "head dim 64"),
    (dict(head_dim=256), "head dim 256"),
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
    monkeypatch.setattr(hopper, "_capability", lambda index: cap)
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
