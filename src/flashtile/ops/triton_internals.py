"""Everything in flashtile that reaches below Triton's public API, in one module, checked against the installed
Triton when it is imported.

The launch cache (ops/launch.py, Note [launch cache]; docs/design/launch-path.md) saves host time on every call
with four shortcuts, each the same thing Triton would do a slower way:

- `launch_compiled`: call a compiled kernel's launcher directly, with the argument layout JITFunction.run uses
  (grid, stream, function, packed metadata, launch metadata, the two launch hooks, then the kernel's arguments);
- `specialisation`: Triton's own argument specialiser (native_specialize_impl), which the cache's checks compare
  between the call that filled an entry and the calls that reuse it;
- `launch_hooked`: whether a profiler (proton, for one) has put a launch hook into knobs.runtime's hook chains, in
  which case launches go through Triton, which calls the hooks;
- `descriptor`: a host TMA descriptor (Triton's or Gluon's TensorDescriptor) built without its dataclass checks,
  which repeat what ops/descriptors.tma_ready and the tile table guarantee (3 µs a descriptor on the H200 machine).

Note [triton internals probe]: at import, `_probe` checks that the installed Triton is one these shortcuts are
tested with (TESTED: the range pyproject.toml allows) and that each internal still has the shape used here. If
any check fails, FAST is False and REASON says why: the launch cache then launches through `kernel[grid](...)`
every time and descriptors are built by their constructors, so flashtile still works on another Triton, with more
host time per call. FLASHTILE_FAST_LAUNCH=0 takes the same fallback (tests/test_launch.py runs the CPU tier's
launches that way).

What this module does not do: decide what is cached (ops/launch.py) or build descriptors' shapes (ops/descriptors.py,
ops/hopper.py).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

import triton

from .. import env

# Triton versions whose internals the shortcuts are tested with (pyproject.toml pins triton to this range).
TESTED = ("3.6.",)

# The launcher call JITFunction.run makes once it has a compiled kernel, which launch_compiled repeats.
_RUN_CALL = ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, "
             "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())")
_DESCRIPTOR_FIELDS = {"triton": ["base", "shape", "strides", "block_shape", "padding"],
                      "gluon": ["base", "shape", "strides", "block_shape", "layout", "padding"]}


def _probe() -> Optional[str]:
    """None when every shortcut holds for the installed Triton, otherwise what does not."""
    if not env.fast_launch():
        return "switched off by FLASHTILE_FAST_LAUNCH=0"
    if not triton.__version__.startswith(TESTED):
        return f"triton {triton.__version__} is not one the launch shortcuts are tested with ({', '.join(TESTED)}x)"
    try:
        from triton import knobs
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import JITFunction
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError as e:
        return f"a Triton internal is missing: {e}"
    if _RUN_CALL not in " ".join(inspect.getsource(JITFunction.run).split()):
        return "JITFunction.run no longer calls the compiled kernel's launcher as launch_compiled does"
    try:
        native_specialize_impl(BaseBackend, 16, False, True, True)
    except Exception as e:  # a changed signature raises TypeError; anything else is as fatal to the shortcut
        return f"native_specialize_impl no longer takes (backend, value, is_const, specialize, align): {e}"
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and not hasattr(hook, "calls"):
            return "knobs.runtime's launch hooks are no longer hook chains with `calls`"
    classes = {"triton": TensorDescriptor}
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
        classes["gluon"] = GluonDescriptor
    except ImportError:  # no Gluon: ops/hopper.py runs every call on the Triton kernels
        pass
    for name, cls in classes.items():
        if [f.name for f in dataclasses.fields(cls)] != _DESCRIPTOR_FIELDS[name]:
            return f"{name}'s TensorDescriptor fields changed: {[f.name for f in dataclasses.fields(cls)]}"
    return None


REASON: Optional[str] = _probe()
FAST: bool = REASON is None

if FAST:
    from triton import knobs
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime import driver


def launch_hooked() -> bool:
    """Whether a launch hook is installed; Triton 3.6 keeps them in chains that are empty by default. Only asked
    when FAST (otherwise every launch goes through Triton)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def specialisation(values) -> tuple:
    """How Triton's launcher specialises these argument values (pointer alignment, integers equal to 1 or
    multiples of 16, None)."""
    return tuple(native_specialize_impl(BaseBackend, x, False, True, True) for x in values)


def launch_compiled(compiled, grid: tuple, device: int, args: tuple) -> None:
    """What JITFunction.run does once it has found the compiled kernel, minus the launch hooks (launch_hooked)."""
    compiled.run(*grid, driver.active.get_current_stream(device), compiled.function, compiled.packed_metadata, None,
                 None, None, *args)


def descriptor(cls, base, fields: dict):
    """A TensorDescriptor of class `cls` over `base` with these other fields: built without the dataclass's checks
    when FAST, by its constructor (which checks them) otherwise."""
    if not FAST:
        return cls(base=base, **fields)
    desc = cls.__new__(cls)
    attributes = desc.__dict__
    attributes.update(fields)
    attributes["base"] = base
    return desc
