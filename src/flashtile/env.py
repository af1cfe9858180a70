"""Every environment variable flashtile reads, read here and nowhere else.

- ``FLASHTILE_AUTOTUNE=1``: autotune tile configs on first use of each problem class (results cached on disk by
  Triton under ``TRITON_CACHE_DIR``) instead of taking them from the table in :mod:`flashtile.config`.
- ``FLASHTILE_CHECK=1``: run the input checks that need a device-to-host copy (for example that ``cu_seqlens`` is
  non-decreasing, or that block-table entries are in range). Off by default because such a copy synchronises the
  device and breaks CUDA-graph capture. It also makes every launch-cache hit re-derive what it reuses and compare
  (ops/launch.py, Note [launch cache]; always on under the interpreter).
- ``FLASHTILE_PDL=0``: launch the backward's dK/dV kernel without programmatic dependent launch (on by default on
  sm_90 and later: kernels/bwd.py, Note [delta handoff]). For measuring what it gains.
- ``FLASHTILE_HOPPER=0``: run the Triton kernels where the Gluon Hopper kernels would run (sm_90; ops/hopper.py
  says which calls). For measuring, and for ruling the fast path out when chasing a problem.
- ``FLASHTILE_FAST_LAUNCH=0``: launch through ``kernel[grid](...)`` every time and build TMA descriptors through
  their constructors, as flashtile does on a Triton whose internals it was not tested with (ops/triton_internals.py,
  Note [triton internals probe]). Read once, at import.
- ``TRITON_INTERPRET=1`` (Triton's own): kernels run on the CPU through Triton's interpreter. Read once, at
  import, exactly as Triton reads it.
"""

import os


# Flags are read on every call, so that a test or a user may set them at any time. os.environ.get costs over a
# microsecond for a variable that is not set (it raises and catches KeyError inside), several per call: read
# CPython's os._Environ mapping directly where it has one, and parse each distinct value once.
_ENVIRON = getattr(os.environ, "_data", None)
_ENCODED: dict[str, object] = {}
_PARSED: dict[object, bool] = {}


def _raw(name: str):
    if _ENVIRON is None:
        return os.environ.get(name)
    key = _ENCODED.get(name)
    if key is None:
        key = _ENCODED[name] = os.environ.encodekey(name)
    return _ENVIRON.get(key)


def _flag(name: str, default: str = "0") -> bool:
    raw = _raw(name)
    parsed = _PARSED.get((raw, default))
    if parsed is None:
        value = default if raw is None else os.environ.decodevalue(raw) if _ENVIRON is not None else raw
        parsed = _PARSED[(raw, default)] = value.strip().lower() not in ("", "0", "false", "no", "off")
    return parsed


INTERPRET: bool = _flag("TRITON_INTERPRET")


def autotune() -> bool:
    return _flag("FLASHTILE_AUTOTUNE")


def pdl() -> bool:
    return _flag("FLASHTILE_PDL", default="1")


def hopper() -> bool:
    return _flag("FLASHTILE_HOPPER", default="1")


def fast_launch() -> bool:
    return _flag("FLASHTILE_FAST_LAUNCH", default="1")


def debug_checks() -> bool:
    return _flag("FLASHTILE_CHECK")
