"""Plumbing shared by the attention ops: the custom-op wrapper and its eager shortcut, packed-input views and small
integer helpers for kernel arguments. Device facts are ops/device.py, TMA alignment, strides and host descriptors
ops/descriptors.py, varlen grids and launch order ops/schedule.py, launching itself ops/launch.py.

Note [eager calls skip the dispatcher]: every kernel entry point is a `torch.library.custom_op` with a fake, which
is what torch.compile, FakeTensor and the other tracing modes see. A plain eager call does not need the
dispatcher, and at short lengths it cost more than the kernels: on the H200 machine (torch 2.11) the host took
1.1-1.6 ms to enqueue one B=16, S=1k, d128 forward+backward through the custom ops and their registered
autograd, while the GPU needed ~1.1 ms (causal), so the call ran at the host's pace. So `call` runs the
implementation directly when nothing traces the call (not compiling, every tensor a plain torch.Tensor or
Parameter), and the op otherwise; autograd.py does the same with a torch.autograd.Function around the two
implementations, which enqueues the same forward+backward in 0.85-0.95 ms (docs/design/launch-path.md).
Both routes run the same functions.
"""

from __future__ import annotations

import functools
import inspect

import torch

def custom_op(name: str, mutates_args=()):
    """`torch.library.custom_op`, keeping the undecorated implementation as the op's `.impl` and the positions of
    the arguments it writes as `.mutated`, for `call`."""
    def wrap(fn):
        op = torch.library.custom_op(name, fn, mutates_args=mutates_args)
        op.impl = fn
        op.mutated = tuple(i for i, arg in enumerate(inspect.signature(fn).parameters) if arg in mutates_args)
        return op
    return wrap


# torch.func's wrappers (vmap's batched tensors, grad's tracking tensors) look like plain torch.Tensors from
# Python; this private predicate is the only way to tell them apart, and without it vmap would reach a kernel.
_functorch_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda t: False)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_SCALARS = (type(None), int, float, bool, str)


def untraced(args) -> bool:
    """True when a call with these arguments can run an op's implementation directly: eager mode and plain
    tensors (a tensor subclass such as FakeTensor, or a torch.func wrapper, needs the dispatcher). Note [eager
    calls skip the dispatcher]."""
    if torch.compiler.is_compiling():  # first: dynamo need not trace the checks below
        return False
    for a in args:
        kind = type(a)  # by exact type first: most arguments are None, ints and floats
        if kind in _PLAIN:
            if _functorch_wrapped(a):
                return False
        elif kind not in _SCALARS and isinstance(a, torch.Tensor):
            return False
    return True


def call(op, *args):
    """op(*args), through the dispatcher only when something may be tracing it."""
    if not untraced(args):
        return op(*args)
    result = op.impl(*args)
    # The dispatcher bumps the version counter of every tensor an op writes in place, which is how autograd
    # notices a tensor it saved being changed; kernels bypass that, so do it here.
    if op.mutated:
        torch.autograd.graph.increment_version([args[i] for i in op.mutated])
    return result


def cdiv(a: int, b: int) -> int:
    """triton.cdiv for host code. Triton 3.6's is a constexpr function, and each call from Python costs a few µs
    (its wrapper imports and unwraps its arguments): 20 µs of a varlen forward's host time on the CI machine."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for host code (see cdiv)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# Packing of the custom ops' (q, k, v) arguments, so that packed entry points get one gradient buffer.
PACK_NONE, PACK_QKV, PACK_KV = 0, 1, 2


def unpack(q, k, v, packing: int):
    """Views of q, k, v from (q, k, v), (qkv, None, None) or (q, kv, None); packed dim is -3."""
    if packing == PACK_QKV:
        return q.select(-3, 0), q.select(-3, 1), q.select(-3, 2)
    if packing == PACK_KV:
        return q, k.select(-3, 0), k.select(-3, 1)
    return q, k, v


@functools.lru_cache(maxsize=64)  # a handful of page sizes per process; every paged or dense forward asks
def fast_divisor(d: int) -> tuple[int, int]:
    """(mul, shift) with n // d == (n * mul) >> shift for every 0 <= n < 2^31, for kernels that divide by a
    runtime value (kvcache.cache_coords: rows by the page size). Division by an invariant integer (Granlund and
    Montgomery, 1994): with l = ceil(log2 d), shift = 31 + l and mul = ceil(2^shift / d) <= 2^32, so n * mul < 2^63
    fits int64, and the rounding error e = mul * d - 2^shift < d <= 2^l keeps n * e < 2^shift: the product never
    reaches the next multiple of d."""
    if d < 1:
        raise ValueError(f"divisor must be >= 1, got {d}")
    shift = 31 + (d - 1).bit_length()
    return -(-(1 << shift) // d), shift


def alibi_batch_stride(alibi_slopes) -> int:
    """Slopes are (H,) or (B, H); a batch stride of 0 makes the first shape read like the second."""
    return alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0
