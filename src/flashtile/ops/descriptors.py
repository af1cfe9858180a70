"""TMA's requirements on the host side: tensors made TMA-legal (16-byte aligned base and strides), the strides
every kernel takes, host descriptors over dense (B, S, H, D) and packed (total, H, D) tensors, and the launch
pre-hook that fits their boxes to the tile config tried. docs/design/descriptors.md says which kernels take host
descriptors and which build theirs on the device.

What this module does not do: build the Gluon kernels' descriptors, whose boxes and shared layouts are theirs
(ops/hopper.py), or reach below Triton's API (ops/triton_internals.py).
"""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..config import block_d
from .triton_internals import descriptor

_TMA_ALIGN = 16  # bytes: TMA descriptors need 16-byte aligned bases and strides


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """Return t, or a contiguous copy if its base or strides are not 16-byte aligned or are 0 (TMA requirements).

    The copy keeps autograd intact; it only happens for unusual views (odd offsets or strides).
    """
    es = t.element_size()
    if t.is_contiguous() and (t.data_ptr() | t.shape[-1] * es) % _TMA_ALIGN == 0:
        return t  # every stride is a multiple of the last dim's size (the common case, checked first for speed)
    aligned = t.data_ptr() % _TMA_ALIGN == 0 and all(
        s > 0 and (s * es) % _TMA_ALIGN == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)
    return t if aligned else t.contiguous() if not t.is_contiguous() else t.clone()


def kernel_strides(t: torch.Tensor) -> list[int]:
    """t's strides as every kernel takes them (TMA descriptors and pointer arithmetic alike). A dimension of size
    1 is never stepped along, so its stride may be anything; give it the stride it would have in a contiguous
    tensor: TMA wants every stride 16-byte aligned, and a stride of 1 would be an integer Triton specialises into
    a constant, compiling another kernel (Note [runtime integers] in kernels/__init__.py)."""
    return kernel_strides_of(t.shape, t.stride())


def kernel_strides_of(shape: torch.Size, stride: tuple) -> list[int]:
    """kernel_strides of a tensor with this shape and these strides."""
    strides = list(stride)
    if 1 in shape:
        for i in range(len(shape) - 2, -1, -1):
            if shape[i] == 1:
                strides[i] = strides[i + 1] * shape[i + 1]
    return strides


def host_desc(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A TMA descriptor over a dense (B, S, H, D) or packed (total, H, D) tensor (tma_ready), for
    seqlen.load_rows/store_rows, whose box is one head's (rows, BLOCK_D) tile. An autotuned launch resets the box
    for each config it tries (`descriptor_blocks`)."""
    shape, strides = list(t.shape), kernel_strides(t)
    box = [rows, 1, block_d(shape[-1])]
    # Without the dataclass's checks where Triton allows (triton_internals.descriptor): they repeat what tma_ready
    # and the tile table guarantee.
    return descriptor(TensorDescriptor, t, dict(shape=shape, strides=strides,
                                                block_shape=[1, *box] if len(shape) == 4 else box, padding="zero"))


def descriptor_blocks(boxes: dict):
    """A launch pre-hook: set the block shape of each host descriptor argument named in `boxes` (argument name ->
    the constexprs giving its rows and its width: the tile config's BLOCK_M or BLOCK_N, and BLOCK_D or BLOCK_DV),
    so that the boxes follow the config an autotuner or the table picks: (1, rows, 1, width) over (B, S, H, D),
    (rows, 1, width) over (total, H, D)."""
    def hook(nargs):
        for name, (block, width) in boxes.items():
            desc = nargs[name]
            if isinstance(desc, TensorDescriptor):
                box = [nargs[block], 1, nargs[width]]
                desc.block_shape = [1] + box if len(desc.shape) == 4 else box
    return hook


def bmh_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, row, head) strides of a (B, S, H, D) tensor, or of a (total, H, D) one with batch stride 0
    (kernel_strides)."""
    strides = kernel_strides(t)
    if varlen:
        return 0, strides[0], strides[1]
    return strides[0], strides[1], strides[2]
