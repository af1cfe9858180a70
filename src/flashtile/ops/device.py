"""What the ops ask of the device they run on: its compute capability and multiprocessor count (read once per
device), whether it is a GPU or a CUDA graph is being captured on it, whether it takes programmatic dependent
launch. Under launch.capture_launches (Note [launch capture] in ops/launch.py) the answers are those of the sm_90
device the capture pretends to be.

What this module does not do: decide which kernels run (ops/hopper.py: hopper_unsupported).
"""

from __future__ import annotations

import functools
import re

import torch
from torch._subclasses.fake_tensor import is_fake

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


# The current stream's handle by device index, what Triton's launcher reads too (torch.cuda.current_stream builds a
# Stream object per call, several microseconds on the host's path).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_handle(device: torch.device) -> int:
    """The handle of `device`'s current CUDA stream (torch.cuda.Stream.cuda_stream)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _raw_stream is None:
        return torch.cuda.current_stream(index).cuda_stream
    return _raw_stream(index)


def graph_capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched with programmatic dependent launch (sm_90 and later, not under
    the interpreter, not switched off with FLASHTILE_PDL=0)."""
    if env.INTERPRET or not on_gpu(device) or not env.pdl():
        return False
    return capability(device) >= (9, 0)


def interpreter_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter cannot run kernels with these versions, or None. Triton 3.6's interpreter hands
    numpy arrays to code that wants Python scalars; numpy 2.4 turned that into an error, so every kernel fails
    ("only 0-dimensional arrays can be converted to Python scalars")."""
    def minor(version):
        return tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", version).groups())
    if minor(triton_version) <= (3, 6) and minor(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s interpreter fails every kernel with numpy {numpy_version}: "
                f"install 'numpy<2.4' to run flashtile on the CPU")
    return None


@functools.cache
def _installed_interpreter_problem() -> str | None:
    import numpy
    import triton
    return interpreter_problem(triton.__version__, numpy.__version__)


def require_runnable(t: torch.Tensor) -> None:
    """Raise a RuntimeError saying what to do when no kernel can run for a call whose tensors live where `t` does:
    CPU tensors need Triton's interpreter, which Triton and flashtile read when they are imported (env.py). Without
    it Triton would compile for a GPU and fail deep inside with "Torch not compiled with CUDA enabled" or "0 active
    drivers". Under launch.capture_launches nothing runs, so CPU tensors are what it takes; a FakeTensor (tracing,
    torch.compile) runs the ops' fakes, which compute shapes only."""
    if t.device.type != "cpu" or capture_target() is not None:
        return
    compiling = torch.compiler.is_compiling()  # dynamo traces the device test, and may not trace is_fake
    if not env.INTERPRET and (compiling or not is_fake(t)):
        raise RuntimeError("flashtile: the tensors are on the CPU, where Triton kernels run only through Triton's "
                           "interpreter. Set TRITON_INTERPRET=1 in the environment before importing flashtile "
                           "(e.g. `TRITON_INTERPRET=1 python script.py`; slow, for tests and demonstrations), or "
                           "move the tensors to a CUDA GPU.")
    if env.INTERPRET and not compiling and not is_fake(t) and _installed_interpreter_problem():
        raise RuntimeError(f"flashtile: {_installed_interpreter_problem()}")
