"""What flashtile runs where: `flashtile info` (the environment and a coverage table) and `warmup` (compiling the
kernels a workload needs before its first step).

The coverage table crosses each dtype, each head dim of the tile table (config.TABLE; other head dims take the
next one up) and five feature classes, and says which kernels run (the Gluon Hopper kernels or the Triton ones,
and why: ops/hopper.hopper_unsupported, the same decision the ops take) with which tiles (config.py). On a machine
with a GPU it describes that GPU; without one it describes an sm_90 GPU (H100/H200), since the interpreter that
runs the kernels here uses tiles of its own.

Warmup: Triton compiles a kernel the first time a call needs it (seconds per kernel, then cached on disk under
TRITON_CACHE_DIR), so a server's or a training job's first step is slow. The kernels' lengths are runtime
arguments, specialised only on being a multiple of 16 or not (Note [runtime integers] in kernels/__init__.py), so
two calls per class of problem (dtype, head dim, masks, GQA group, dense or varlen, forward or backward), one at a
length that is a multiple of 16 and one at a length that is not, compile what later calls of that class need.
Under the interpreter nothing is compiled; warmup then runs the same calls at tiny lengths, which checks the path
and says so.

What this module does not do: decide anything (ops/call.py and ops/hopper.py do), or compile the decode kernels
(their tiles depend on the cache length; a first decode step compiles them).
"""

from __future__ import annotations

import platform
import time
from typing import Iterable, Optional

import torch

from . import env
from .config import DECODE_TABLE, HOPPER, TABLE, block_d, table_config, v_parts
from .ops import triton_internals
from .ops.hopper import HOPPER_PATH, TRITON, feature_unsupported, hopper_unsupported

# What flashtile is tested with (pyproject.toml says the same): CI on the CPU, the GPU tier on an H200.
TESTED = {"torch": ["2.13.0+cpu (CI, CPU interpreter)", "2.11.0+cu130 (H200)"],
          "triton": [f"{v}x" for v in triton_internals.TESTED], "python": ["3.11"], "transformers": ["5.24.0"]}
# (q/k, v) head dims of the coverage table: each tile row of config.TABLE with v as wide, and MLA prefill's pair.
HEAD_DIMS = [(d, d) for d in sorted(TABLE["fwd"])] + [(192, 128)]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Feature class -> the properties hopper_unsupported is asked about for it (causal, windows and varlen change nothing
# in the answer: the Gluon kernels have them; they are rows of their own because users ask about them).
FEATURES = {
    "dense": dict(),
    "causal/window": dict(),
    "softcap/alibi": dict(softcap=1.0, alibi=True),
    "varlen": dict(),
    "learnable sink": dict(),
    "attention chunk": dict(),
    "dropout": dict(dropout=True),
    "paged": dict(paged=True),
}
KERNELS = ("fwd", "bwd_dq", "bwd_dkdv")


def _version(dist: str) -> Optional[str]:
    import importlib.metadata
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """The machine, the versions flashtile runs with and is tested with, and where its kernels run."""
    import triton

    import flashtile

    gpu = torch.cuda.is_available() and not env.INTERPRET
    if gpu:
        props = torch.cuda.get_device_properties(0)
        device = {"name": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count}
    else:
        device = None
    if gpu:
        where = "CUDA GPU: compiled Triton (and on sm_90 Gluon) kernels"
    elif env.INTERPRET:
        where = "CPU tensors through Triton's interpreter (TRITON_INTERPRET=1): slow, for tests and demonstrations"
    else:
        where = ("nothing in this process: no CUDA GPU, and TRITON_INTERPRET=1 was not set before flashtile was "
                 "imported (CPU tensors need it; `flashtile demo|bench|warmup` set it themselves)")
    return {"flashtile": flashtile.__version__, "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__, "transformers": _version("transformers"),
            "gpu": device, "kernels_run_on": where, "interpreter": env.INTERPRET,
            "fast_launch": triton_internals.FAST, "fast_launch_off_because": triton_internals.REASON,
            "hopper_path": env.hopper(), "tested": TESTED}


def _tile(kernel: str, gluon: bool, head_dim: int, head_dim_v: int, fp32: bool, dropout: bool) -> str:
    if gluon:
        c = HOPPER[kernel][head_dim]
        return f"{c.block_m}x{c.block_n} s{c.stages}" + (" columns/2" if c.split_columns else "")
    parts = v_parts(head_dim_v, fp32) if kernel == "fwd" else 1  # Note [V parts] in kernels/fwd.py
    c = table_config(kernel, max(head_dim, head_dim_v), fp32, dropout, head_dim_v // parts)
    return f"{c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages}" + (f" x{parts}" if parts > 1 else "")


def coverage() -> dict:
    """{"target": what the table describes, "rows": [...]}: for each dtype x (q/k, v) head dims x feature class,
    the kernel path ('gluon-sm90', 'triton', or with dropout 'gluon-sm90 (bwd_dkdv: triton)'), why not Gluon, and
    the tile of each kernel (fwd, bwd_dq, bwd_dkdv; paged K/V has no backward, and decode runs its own kernel whose
    tile is given too)."""
    gpu = torch.cuda.is_available() and not env.INTERPRET
    device = torch.device("cuda") if gpu else None
    target = (f"{torch.cuda.get_device_name(0)} (this machine's GPU)" if gpu
              else "an sm_90 GPU (H100/H200): this machine has none; its interpreter uses 32x16 test tiles")
    rows = []
    for dtype_name, dtype in DTYPES.items():
        for d, dv in HEAD_DIMS:
            for feature, props in FEATURES.items():
                paged = feature == "paged"
                reasons = {}  # kernel -> why not Gluon (None: Gluon)
                for kernel in KERNELS[:1] if paged else KERNELS:
                    if gpu:
                        reason = hopper_unsupported(device, dtype, d, head_dim_v=dv, kernel=kernel, **props)
                    elif not env.hopper():
                        reason = "switched off by FLASHTILE_HOPPER=0"
                    else:
                        reason = feature_unsupported(dtype, d, head_dim_v=dv, kernel=kernel, **props)
                    reasons[kernel] = reason
                paths = {HOPPER_PATH if r is None else TRITON for r in reasons.values()}
                # With dropout the dK/dV kernel runs Triton (Note [dropout on the Gluon path] in ops/hopper.py).
                path = paths.pop() if len(paths) == 1 else "{} ({}: {})".format(
                    HOPPER_PATH, ", ".join(k for k, r in reasons.items() if r is not None), TRITON)
                reason = next((r for r in reasons.values() if r is not None), None)
                row = {"dtype": dtype_name, "head_dim": d, "head_dim_v": dv, "feature": feature,
                       "path": path, "why": reason,
                       "tiles": {k: _tile(k, r is None, d, dv, dtype == torch.float32, props.get("dropout", False))
                                 for k, r in reasons.items()}}
                if paged:
                    c = DECODE_TABLE[block_d(d)]
                    row["tiles"]["decode"] = f"{c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages}"
                    row["why"] = f"{reason}; forward only" if reason else "forward only"
                rows.append(row)
    return {"target": target, "rows": rows}


def format_info(env_info: dict, cov: dict) -> str:
    """The text `flashtile info` prints."""
    gpu = env_info["gpu"]
    launch = "on" if env_info["fast_launch"] else f"off ({env_info['fast_launch_off_because']})"
    gpu_text = f"{gpu['name']} (sm_{gpu['capability'].replace('.', '')}, {gpu['sms']} SMs)" if gpu else "none"
    lines = [f"flashtile {env_info['flashtile']} · python {env_info['python']} · torch {env_info['torch']} "
             f"(CUDA {env_info['cuda']}) · triton {env_info['triton']} · transformers {env_info['transformers']}",
             f"GPU: {gpu_text}",
             f"kernels run on: {env_info['kernels_run_on']}",
             f"launch shortcuts: {launch}",
             "tested with: " + "; ".join(f"{k} {', '.join(v)}" for k, v in env_info["tested"].items()),
             "",
             f"coverage on {cov['target']}",
             "(tiles: BLOCK_M x BLOCK_N, warps, stages, and x2 where two programs split V's columns, columns/2"
             " where a Gluon kernel's two warpgroups do. A head dim between two rows runs the larger row's Triton"
             " tiles, a v head dim narrower than q/k's config.NARROW_V's; the Gluon kernels take 128 and MLA"
             " prefill's 192/128 exactly, the Gluon forward 512 too)"]
    header = ("dtype", "d", "feature", "path", "fwd", "bwd_dq", "bwd_dkdv / decode", "why not Gluon")
    table = []
    for r in cov["rows"]:
        tiles = r["tiles"]
        dims = str(r["head_dim"]) if r["head_dim_v"] == r["head_dim"] else f"{r['head_dim']}/{r['head_dim_v']}"
        table.append((r["dtype"], dims, r["feature"], r["path"], tiles["fwd"], tiles.get("bwd_dq", "-"),
                      tiles.get("bwd_dkdv") or f"decode {tiles['decode']}", r["why"] or ""))
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(header[:-1])]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    lines += [fmt.format(*header), fmt.format(*("-" * w for w in widths), "-" * len(header[-1]))]
    lines += [fmt.format(*t).rstrip() for t in table]
    return "\n".join(lines)


def warmup(head_dims: Iterable[int] = (128,), dtypes: Iterable[torch.dtype] = (torch.bfloat16,),
           causal: Iterable[bool] = (False, True), groups: Iterable[int] = (1,), nheads: int = 8,
           varlen: bool = False, backward: bool = True, seqlen: Optional[int] = None,
           device=None) -> list[dict]:
    """Compile the kernels of each problem class by running it once: every combination of head dim, dtype, causal
    (or not), GQA group (nheads // nheads_kv), dense or varlen, forward (+ backward). Returns one record per class:
    its settings, the seconds it took, and whether anything was compiled (False under the interpreter, which
    compiles nothing and runs a tiny call instead).

    Each class runs at `seqlen` (default 256 on a GPU, 16 under the interpreter; a multiple of 16) and at
    seqlen + 1. Use the model's nheads and head dims: tensors whose strides Triton specialises differently (e.g.
    nheads x headdim not a multiple of 16) compile once more on their first real call. The decode kernels are not
    warmed.
    """
    import flashtile

    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available()
                                                             and not env.INTERPRET else "cpu"))
    compiled = device.type == "cuda" and not env.INTERPRET
    seqlen = seqlen or (256 if compiled else 16)
    records = []
    for dtype in dtypes:
        for d in head_dims:
            for group in groups:
                if nheads % group:
                    raise ValueError(f"nheads = {nheads} is not a multiple of the GQA group {group}")
                for is_causal in causal:
                    start = time.perf_counter()
                    for n in (seqlen, seqlen + 1):  # a multiple of 16 and not (Note [runtime integers])
                        _run_once(device, dtype, n, nheads, nheads // group, d, is_causal, varlen, backward)
                    records.append({"dtype": str(dtype).removeprefix("torch."), "head_dim": d, "causal": is_causal,
                                    "group": group, "varlen": varlen, "backward": backward,
                                    "seconds": round(time.perf_counter() - start, 3), "compiled": compiled,
                                    "kernels": flashtile.last_kernel_paths()})
    return records


def _run_once(device, dtype, seqlen: int, nheads: int, nheads_kv: int, head_dim: int, causal: bool, varlen: bool,
              backward: bool) -> None:
    import flashtile

    shapes = [(seqlen, nheads, head_dim), (seqlen, nheads_kv, head_dim), (seqlen, nheads_kv, head_dim)]
    q, k, v = (torch.randn(s if varlen else (1, *s), device=device, dtype=dtype, requires_grad=backward)
               for s in shapes)
    if varlen:
        cu = torch.tensor([0, seqlen // 3, seqlen], dtype=torch.int32, device=device)
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, seqlen, seqlen, causal=causal)
    else:
        out = flashtile.flash_attn_func(q, k, v, causal=causal)
    if backward:
        out.backward(torch.ones_like(out))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
