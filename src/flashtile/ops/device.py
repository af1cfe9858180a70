"""What the ops ask of the device they run on: its compute capability and multiprocessor count (read once per
device), whether it is a GPU or a CUDA graph is being captured on it, whether it takes programmatic dependent
launch. Under launch.capture_launches (Note [launch capture] in ops/launch.py) the answers are those of the sm_90
device the capture pretends to be.

What this module does not do: decide which kernels run (ops/hopper.py: hopper_unsupported).
"""

from __future__ import annotations

import functools

import torch

from .. import env
from .launch import capture_target


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA device, read once per device (under launch.capture_launches, the
    capability of the device it pretends to be)."""
    target = capture_target()
    if target is not None:
        return target[0]
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


INTERPRETER_SMS = 4  # a pretend small GPU, so that decode's auto-splitting engages on the interpreter's tiny shapes


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device, read once per device: a persistent grid's size (under
    launch.capture_launches, the pretended device's; under the interpreter, INTERPRETER_SMS)."""
    target = capture_target()
    if target is not None:
        return target[1]
    if not on_gpu(device):
        return INTERPRETER_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def on_gpu(device: torch.device) -> bool:
    """Whether kernels for `device` are compiled for a GPU: a CUDA device, or any under launch.capture_launches."""
    return device.type == "cuda" or capture_target() is not None


def graph_capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched with programmatic dependent launch (sm_90 and later, not under
    the interpreter, not switched off with FLASHTILE_PDL=0)."""
    if env.INTERPRET or not on_gpu(device) or not env.pdl():
        return False
    return capability(device) >= (9, 0)


def require_runnable(device: torch.device) -> None:
    """Raise a RuntimeError saying what to do when no kernel can run for tensors on `device`: CPU tensors need
    Triton's interpreter, which Triton and flashtile read when they are imported (env.py). Without it Triton would
    compile for a GPU and fail deep inside with "Torch not compiled with CUDA enabled" or "0 active drivers".
    Under launch.capture_launches nothing runs, so CPU tensors are what it takes."""
    if device.type == "cpu" and not env.INTERPRET and capture_target() is None:
        raise RuntimeError("flashtile: the tensors are on the CPU, where Triton kernels run only through Triton's "
                           "interpreter. Set TRITON_INTERPRET=1 in the environment before importing flashtile "
                           "(e.g. `TRITON_INTERPRET=1 python script.py`; slow, for tests and demonstrations), or "
                           "move the tensors to a CUDA GPU.")
