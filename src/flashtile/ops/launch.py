"""Launching the prefill kernels: the tile config each takes, optional autotuning, and the launch cache through which
a call whose shapes were seen before skips everything Triton and the launchers derive from those shapes.

Note [launch cache]: on the H200 machine's host CPU a B=16, S=1k, d128 causal forward took 170-290 µs of Python
to enqueue a kernel that runs for 205 µs (docs/design/launch-path.md): `JITFunction.run` alone 46 µs (binding and
specialising 55 arguments 15, the compiled-kernel lookup 5, the launcher 26), the launcher's own derivations
(strides, flags, grid, descriptors, the tile config's pre-hook) most of the rest. A benchmark that clears L2
between repetitions hides ~80 µs of that behind the clearing kernel; the rest the GPU spent waiting, so short
sequences timed the host. A model step sees the same thing in every layer.

So a launch is split in two. Its *dynamic* arguments (pointers, host TMA descriptors, float scalars) come first in
the kernel's parameter list and are given on every call. Everything after them (strides, lengths, integer
parameters, constexprs) together with the grid is *static*: a pure function of the call's `key`, which the
launcher builds from what it reads (shapes, strides, dtypes, pointer alignment, integer arguments; `signature`).
The first call with a key computes the static part (a callable, so a repeated call does not) and launches
through Triton, which specialises and compiles as usual; the compiled kernel, grid and static arguments are kept
under the key, and the next calls go straight to the compiled kernel's launcher with `(*dynamic, *static)`.
Measured on the H200 machine: the API forward 170 -> 83 µs, the backward implementation 163 -> 77 µs, and
the S=1k cells that timed the host now time the kernels.

That is only right if the key determines the static part and the specialisation of the dynamic part (Triton
specialises pointers on 16-byte alignment, integers on being 1 or a multiple of 16, and takes None and constexprs
as constants). `signature` puts alignment, dtype, shape and strides of every tensor in the key; under the
interpreter (CI) and with FLASHTILE_CHECK=1, every cache hit recomputes the static part and the dynamic
arguments' specialisation and raises if either differs from what was cached. Calls under a launch hook
(profilers such as proton) and autotuned calls go through Triton every time, and so does every call on a Triton
whose internals the shortcuts were not tested with (ops/triton_internals.py holds everything that reaches below
Triton's public API: Note [triton internals probe]).

What this module does not do: decide the arguments (ops/fwd.py, ops/bwd.py) or hold the tile table (config.py).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch
import triton

from .. import env
from ..config import CANDIDATES, TileConfig, block_d, tile_config
from . import triton_internals

# Distinct signatures kept; a model has a few per layer shape, a varlen stream one per distinct packed total.
MAX_CACHED = 1024


class Static(NamedTuple):
    """The part of a launch that its key determines."""
    args: tuple  # the kernel's non-constexpr parameters after the dynamic ones
    constexprs: dict  # the constexprs except the tile config's
    grid: Callable[[int, int], tuple]  # (BLOCK_M, BLOCK_N) -> grid


class _Entry(NamedTuple):
    compiled: object  # triton's CompiledKernel; None under the interpreter
    grid: tuple
    tail: tuple  # static args then every constexpr, in parameter order: what follows the dynamic args
    options: dict  # num_warps, num_stages, launch_pdl
    # For the checks: Static's args and constexprs (not its grid function, whose closure would keep the first
    # call's tensors alive) and the dynamic arguments' specialisation.
    args: tuple
    constexprs: dict
    spec: tuple
    dynamic_names: tuple  # the kernel's first parameters, the dynamic ones (launch_named takes them by name)
    static_names: tuple
    pick: Callable[[dict], tuple]  # launch_named's dynamic values in dynamic_names' order
    # Keys hold the kernel's id (a JITFunction hashes its source's dependencies in Python, which the interpreter's
    # Gluon kernels cannot); the entry holds the kernel, so that no other object takes that id while it is cached.
    kernel: object


_CACHE: dict[tuple, _Entry] = {}


def tensor_signature(x: torch.Tensor) -> tuple:
    """A tensor's part of a launch key (signature): shape, strides, dtype, 16-byte alignment of its pointer."""
    return x.shape, x.stride(), x.dtype, x.data_ptr() % 16 == 0


def _signature(x):
    # The exact types a launch passes first, by one dict lookup: this runs for every argument of every launch.
    by_type = _BY_TYPE.get(type(x))
    if by_type is not None:
        return by_type(x)
    if x is None or isinstance(x, (int, str)):  # bools are ints
        return x
    if isinstance(x, torch.Tensor):
        return tensor_signature(x)
    if isinstance(x, float):
        return float
    if hasattr(x, "block_shape") and hasattr(x, "base"):  # Triton's and Gluon's TensorDescriptor
        _BY_TYPE[type(x)] = _descriptor_signature
        return _descriptor_signature(x)
    return x


def _descriptor_signature(x) -> tuple:
    return _signature(x.base), tuple(x.block_shape), getattr(x, "layout", None)


def _same(x):
    return x


_BY_TYPE = {type(None): _same, int: _same, bool: _same, str: _same, float: lambda x: float,
            torch.Tensor: tensor_signature, torch.nn.Parameter: tensor_signature}


def signature(*xs) -> tuple:
    """What a launch key needs from tensors and scalars: for a tensor its shape, strides, dtype and whether its data
    pointer is 16-byte aligned (Triton's pointer specialisation); for a host TMA descriptor its tensor's, its box
    and shared layout; for a float only its type (Triton passes floats as they are, with no specialisation); other
    values as they are."""
    return tuple([None if x is None else _signature(x) for x in xs])  # most optional arguments are None


def _uncached() -> bool:
    """Whether launches go through Triton every time: a launch hook is installed (profilers such as proton; Triton
    calls the hooks), or the shortcuts do not hold for this Triton (Note [triton internals probe])."""
    return not triton_internals.FAST or triton_internals.launch_hooked()


# Note [scratch under PDL]: kernels that build TMA descriptors on the device (tl.make_tensor_descriptor) write
# them into a global scratch buffer that Triton's launcher asks _tma_scratch for, once per launch, and drops when
# the launch call returns. Dropping it is safe for work ordered after the kernel on the stream, which is how
# PyTorch's caching allocator hands the memory out again, but not for a kernel launched with programmatic
# dependent launch, which runs beside the one before it: the backward's dK/dV kernel (kernels/bwd.py, Note [delta
# handoff]) was given the dQ kernel's just-dropped scratch, and its programs wrote their descriptors over those of
# the dQ programs still running. Those loaded through a descriptor of another tensor and box: wrong rows, or an
# illegal address (head dims above 128, where the dQ kernel builds its K/V descriptors on the device; seen under
# load with the backward rerun on one graph). `keep_scratch()` holds every scratch buffer allocated inside it
# until it exits, after the dependent launch: what is allocated next is ordered after that kernel, which ends
# only after the one it overlapped (its griddepcontrol.wait).
_kept = threading.local()


def _tma_scratch(size: int, alignment: int, stream):
    buf = torch.empty(size, dtype=torch.int8, device="cuda")
    kept = getattr(_kept, "buffers", None)
    if kept is not None:
        kept.append(buf)
    return buf


@contextlib.contextmanager
def keep_scratch():
    """Keep the device-descriptor scratch of the launches inside alive until the block ends (Note [scratch under
    PDL])."""
    outer = getattr(_kept, "buffers", None)
    _kept.buffers = []
    try:
        yield
    finally:
        _kept.buffers = outer


def prepare_launch(t: torch.Tensor) -> None:
    """Kernels that build TMA descriptors on the device need a global scratch allocator. Triton keeps it in a
    ContextVar, so set it on every launch: autograd runs the backward on its own thread."""
    if not env.INTERPRET and t.is_cuda:
        triton.set_allocator(_tma_scratch)


# Note [launch capture]: the CPU compile check (tests/sm90_compile.py) must build what a GPU run launches, with the
# integer specialisations and descriptor types Triton's launcher would derive from the real arguments, not a
# hand-written signature. Inside `capture_launches()` every launch is recorded instead of run (kernel, grid,
# positional arguments, keyword constexprs and options), and the ops behave as on an sm_90 device with `sms`
# multiprocessors, so that the Gluon path and the PDL handoff are taken with CPU tensors. Nothing is computed:
# outputs hold whatever torch.empty gave them.
class Launch(NamedTuple):
    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict


class _Capture:  # process-wide: an eager backward may run on autograd's own thread
    launches: Optional[list] = None
    capability: tuple = (9, 0)
    sms: int = 132


_capture = _Capture()


@contextlib.contextmanager
def capture_launches(capability: tuple = (9, 0), sms: int = 132):
    """Record the launches inside instead of running them (Note [launch capture]); yields the list of Launch."""
    launches: list[Launch] = []
    _capture.launches, _capture.capability, _capture.sms = launches, capability, sms
    try:
        yield launches
    finally:
        _capture.launches = None


def capture_target() -> Optional[tuple[tuple, int]]:
    """(capability, multiprocessors) of the device a capture pretends to be, None outside one."""
    return None if _capture.launches is None else (_capture.capability, _capture.sms)


def launch_direct(kernel, grid: tuple, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), for the launches that skip the launch cache (decode, append, combine), or
    its record under capture_launches."""
    if _capture.launches is not None:
        _capture.launches.append(Launch(kernel, tuple(grid), args, kwargs))
        return
    kernel[grid](*args, **kwargs)


def launch_opts(cfg: TileConfig) -> dict:
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def head_dims(head_dim: int, head_dim_v: int) -> dict:
    """The prefill kernels' head-dim constexprs: Q/K's and V/O's, each with its power-of-two tile width."""
    return {"HEAD_DIM": head_dim, "BLOCK_D": block_d(head_dim), "HEAD_DIM_V": head_dim_v,
            "BLOCK_DV": block_d(head_dim_v)}


# What a tuned config may depend on: the head dim, the dtype (Triton adds argument dtypes to the key itself) and
# the flags that change the kernel's code. Sequence lengths are deliberately left out, so one tuning run per
# problem class serves every length.
_TUNE_KEY = ["HEAD_DIM", "HEAD_DIM_V", "GROUP", "IS_VARLEN", "PAGED", "MASK_LEFT", "MASK_RIGHT", "HAS_SOFTCAP",
             "HAS_ALIBI", "HAS_DROPOUT", "HAS_SINK", "MASK_CHUNK"]


@functools.cache
def _autotuned(kernel, name: str, pre_hook):
    configs = [triton.Config(c.kwargs(), num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=pre_hook)
               for c in CANDIDATES[name]]
    return triton.autotune(configs=configs, key=_TUNE_KEY, cache_results=True)(kernel)


def launch(kernel, name: str, head_dim: int, fp32: bool, key, dynamic: tuple, static: Callable[[], Static],
           pre_hook=None, pdl: bool = False, dropout: bool = False, head_dim_v: Optional[int] = None) -> None:
    """Launch `kernel(*dynamic, *static().args, **static().constexprs)` with the tile config of `name`
    (config.py; `fp32`: for fp32 inputs, `dropout`: with dropout, `head_dim_v`: v's head dim) on
    static().grid(BLOCK_M, BLOCK_N), through the launch cache (Note [launch cache]) when `key` is not None (it
    fixes the inputs' dtype).

    With FLASHTILE_AUTOTUNE=1 on a GPU the config is chosen by timing config.CANDIDATES instead (once per problem
    class; Triton caches the choice on disk), and `pre_hook(arguments by name)` adapts the arguments to each
    config tried, as a triton.Config pre-hook does. The interpreter always uses the table.

    `pdl`: launch with programmatic dependent launch (sm_90+), so that the kernel's programs may start while the
    previous kernel's last ones still run; the kernel must itself wait for what it reads from that kernel.
    """
    if _capture.launches is not None:
        s = static()
        cfg = tile_config(name, head_dim, fp32, dropout, head_dim_v)
        options = launch_opts(cfg) | ({"launch_pdl": True} if pdl else {})
        _capture.launches.append(Launch(kernel, _grid(s, cfg), (*dynamic, *s.args), s.constexprs | cfg.kwargs() |
                                        options))
        return
    if env.autotune() and not env.INTERPRET:
        s = static()
        _autotuned(kernel, name, pre_hook)[lambda meta: s.grid(meta["BLOCK_M"], meta["BLOCK_N"])](
            *dynamic, *s.args, **s.constexprs)
        return
    if key is not None and not _uncached():
        device = torch.cuda.current_device() if not env.INTERPRET else -1
        full_key = (id(kernel), device, key)
        entry = _CACHE.get(full_key)
        if entry is not None:
            if env.INTERPRET or env.debug_checks():
                s = static()
                _check(kernel, entry, dynamic, s.args, s.constexprs,
                       _grid(s, tile_config(name, head_dim, fp32, dropout, head_dim_v)))
            _launch_cached(kernel, device, entry, dynamic)
            return
    else:
        full_key = None
    s = static()
    cfg = tile_config(name, head_dim, fp32, dropout, head_dim_v)
    constexprs = s.constexprs | cfg.kwargs()
    n_args = len(dynamic) + len(s.args)
    names = kernel.arg_names
    if set(names[n_args:]) != constexprs.keys():
        raise TypeError(f"{kernel.__name__}: the parameters after the {n_args} dynamic and static arguments are "
                        f"{names[n_args:]}, the constexprs given are {sorted(constexprs)}")
    args = (*dynamic, *s.args)
    grid = _grid(s, cfg)
    options = launch_opts(cfg) | ({"launch_pdl": True} if pdl else {})
    compiled = kernel[grid](*args, **constexprs, **options)
    if full_key is not None:
        _remember(full_key, kernel, None if env.INTERPRET else compiled, grid, dynamic, s.args, constexprs,
                  s.constexprs, options)


def _order(kernel, dynamic: dict, static: dict, constexprs: dict) -> tuple[tuple, tuple]:
    """(dynamic values, static values) in the kernel's parameter order, which must be dynamic's names, then
    static's, then constexprs': anything missing, extra or out of its group raises TypeError."""
    names = kernel.arg_names
    n_dynamic, n_static = len(dynamic), len(static)
    groups = ((names[:n_dynamic], dynamic), (names[n_dynamic:n_dynamic + n_static], static),
              (names[n_dynamic + n_static:], constexprs))
    if any(set(part) != given.keys() for part, given in groups):
        raise TypeError(f"{kernel.__name__} takes {list(names)}; given dynamic {list(dynamic)}, static "
                        f"{list(static)}, constexprs {list(constexprs)}")
    return tuple(dynamic[n] for n in groups[0][0]), tuple(static[n] for n in groups[1][0])


class StaticByName(NamedTuple):
    """The part of a launch_named launch that its key determines."""
    grid: tuple
    static: dict  # the integers after the dynamic arguments, by name
    constexprs: dict  # every constexpr, the tile's included


def launch_named(kernel, dynamic: dict, statics: Callable[[], StaticByName], num_warps: int,
                 key: Optional[tuple] = None) -> None:
    """Launch `kernel` (the Gluon kernels: ops/hopper.py; the varlen plan: ops/schedule.py) with its arguments by
    name, ordered from the kernel's own parameter list: the dynamic ones (tensors, descriptors, pointers that may
    be None, float scalars) first, then statics()'s static integers, then its constexprs, on statics()'s grid.

    Through the launch cache (Note [launch cache]). Its key is derived from the arguments themselves (the
    signature of every dynamic value, every static value and constexpr, the grid), so it is complete by
    construction; or, given `key`, it is that key, which must determine statics() and the dynamic values'
    specialisation: an OpProblem's (ops/call.py), which a call computes once for all its launches, with whatever
    else the launcher reads (the SM count of a persistent grid). Then statics() runs only on a miss, or to check a
    hit as launch() checks one (under the interpreter and FLASHTILE_CHECK=1)."""
    if _capture.launches is not None:
        s = statics()
        d, st = _order(kernel, dynamic, s.static, s.constexprs)
        _capture.launches.append(Launch(kernel, tuple(s.grid), (*d, *st), s.constexprs | {"num_warps": num_warps}))
        return
    device = torch.cuda.current_device() if not env.INTERPRET else -1
    s = None
    if key is None:
        s = statics()
        # Name order is the launcher's own, fixed per call site: the values' order matches from call to call.
        key = (signature(*dynamic.values()), tuple(s.static.values()), tuple(s.constexprs.values()), s.grid,
               tuple(dynamic), tuple(s.static))
    key = (id(kernel), device, key)
    uncached = _uncached()
    entry = _CACHE.get(key) if not uncached else None
    if entry is not None:
        d = entry.pick(dynamic)
        if env.INTERPRET or env.debug_checks():
            s = s or statics()
            _check(kernel, entry, d, tuple(s.static[n] for n in entry.static_names), s.constexprs, tuple(s.grid))
        _launch_cached(kernel, device, entry, d)
        return
    s = s or statics()
    d, st = _order(kernel, dynamic, s.static, s.constexprs)
    options = {"num_warps": num_warps}
    compiled = kernel[s.grid](*d, *st, **s.constexprs, **options)
    if uncached:
        return
    _remember(key, kernel, None if env.INTERPRET else compiled, tuple(s.grid), d, st, s.constexprs, s.constexprs,
              options)


def _remember(full_key, kernel, compiled, grid: tuple, dynamic: tuple, static_args: tuple, constexprs: dict,
              checked_constexprs: dict, options: dict) -> None:
    """Keep a launch under its key: what follows the dynamic arguments (the static ones, then every constexpr in
    parameter order), and for _check what the key should have determined."""
    if len(_CACHE) >= MAX_CACHED:
        del _CACHE[next(iter(_CACHE))]
    n_dynamic, n_static = len(dynamic), len(static_args)
    names = kernel.arg_names[n_dynamic + n_static:]
    _CACHE[full_key] = _Entry(compiled, grid, (*static_args, *(constexprs[n] for n in names)), options, static_args,
                              checked_constexprs, triton_internals.specialisation(dynamic),
                              tuple(kernel.arg_names[:n_dynamic]),
                              tuple(kernel.arg_names[n_dynamic:n_dynamic + n_static]),
                              _picker(kernel.arg_names[:n_dynamic]), kernel)


def _picker(names) -> Callable[[dict], tuple]:
    """A function of a dict giving the values of `names` in order, as a tuple (itemgetter gives a bare value for
    one name)."""
    if len(names) > 1:
        return operator.itemgetter(*names)
    return lambda values: tuple(values[n] for n in names)


def _grid(s: Static, cfg: TileConfig) -> tuple[int, int, int]:
    grid = tuple(s.grid(cfg.block_m, cfg.block_n))
    return grid + (1,) * (3 - len(grid))


def _check(kernel, entry: _Entry, dynamic: tuple, args: tuple, constexprs: dict, grid: tuple) -> None:
    """That the key determined everything a cache hit reuses (Note [launch cache])."""
    if (args, constexprs, grid) != (entry.args, entry.constexprs, entry.grid):
        raise AssertionError(f"{kernel.__name__}: launch cache key does not determine the static arguments: cached "
                             f"{entry.args}, {entry.constexprs}, grid {entry.grid}; now {args}, {constexprs}, "
                             f"grid {grid}")
    spec = triton_internals.specialisation(dynamic)
    if spec != entry.spec:
        raise AssertionError(f"{kernel.__name__}: launch cache key does not determine the specialisation of the "
                             f"dynamic arguments: cached {entry.spec}, now {spec}")


def _launch_cached(kernel, device: int, entry: _Entry, dynamic: tuple) -> None:
    c = entry.compiled
    if c is None:  # the interpreter: the same arguments, in the same order, through Triton
        kernel[entry.grid](*dynamic, *entry.tail, **entry.options)
        return
    triton_internals.launch_compiled(c, entry.grid, device, (*dynamic, *entry.tail))


def cache_info() -> int:
    """Number of launch signatures cached (tests)."""
    return len(_CACHE)
