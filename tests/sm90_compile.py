"""Compile flashtile's prefill kernels (Triton, and the Gluon Hopper ones) for sm_90 on a machine without a GPU,
and report shared memory.

Run as a script (it must not see TRITON_INTERPRET): `python tests/sm90_compile.py [--all-flags] [--ptxas]`.
Prints one JSON line per compiled kernel: kernel, head dim, config, flags, shared bytes, and whether the PTX uses
wgmma and TMA; the registers, spill bytes and whether ptxas serialised the wgmma that the ptxas bundled with
Triton reports for sm_90a, for every kernel that uses wgmma (and with --ptxas for the rest too).
tests/test_compile.py runs it in a subprocess; it is also how to read PTX and register pressure without spending
GPU time.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

assert not os.environ.get("TRITON_INTERPRET"), "sm90_compile.py must run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from flashtile.config import HOPPER, production_configs  # noqa: E402
from flashtile.kernels.bwd import _bwd_dkdv_kernel, _bwd_dq_kernel  # noqa: E402
from flashtile.kernels.fwd import _attn_fwd_kernel  # noqa: E402
from flashtile.kernels.seqlen import MAX_SORT, MAX_STEP, _plan_kernel  # noqa: E402
from flashtile.ops.fwd import HOST_DESCRIPTOR_MAX_D  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from flashtile.kernels.hopper_bwd import _hopper_dkdv_kernel  # noqa: E402
from flashtile.kernels.hopper_dq import _hopper_dq_kernel  # noqa: E402
from flashtile.kernels.hopper_fwd import _hopper_fwd_kernel  # noqa: E402

SHARED_LIMIT = 232448  # bytes of shared memory one H100/H200 block can use
KERNELS = {"fwd": _attn_fwd_kernel, "bwd_dkdv": _bwd_dkdv_kernel, "bwd_dq": _bwd_dq_kernel}
# Pointer arguments and their element types; the rest are i32 scalars, fp32 scalars (below) or constexprs.
FP32_POINTERS = {"LSE", "DELTA", "ALIBI"}
I32_POINTERS = {"READY", "TILES", "CU_SEQLENS_Q", "CU_SEQLENS_K", "SEQUSED_Q", "SEQUSED_K", "SCHEDULE", "BLOCK_TABLE",
                "CU_TILED", "SEQUSED_TILED", "CU_COST", "SEQUSED_COST", "COUNTER", "COUNTERS",
                "LAST_FIRST_LIST", "FIRST_FIRST_LIST"}
FP32_SCALARS = {"qk_scale", "softcap2", "softmax_scale"}
I64_SCALARS = {"page_mul"}  # ops/common.fast_divisor's multiplier is >= 2^31: Triton passes it as int64
# Kernels that take host-built TMA descriptors (DESC 1: dense, 2: packed varlen, whose O stays a pointer; ops/fwd.py,
# Note [host descriptors]): the forward for Q, K, V, O, the dQ kernel for the K and V it streams. Kernel -> argument
# -> box rows.
HOST_DESCS = {"_attn_fwd_kernel": {"Q": "BLOCK_M", "O": "BLOCK_M", "K": "BLOCK_N", "V": "BLOCK_N"},
              "_bwd_dq_kernel": {"K": "BLOCK_N", "V": "BLOCK_N"}}
OPTIONAL = {"ALIBI": "HAS_ALIBI", "CU_SEQLENS_Q": "IS_VARLEN", "CU_SEQLENS_K": "IS_VARLEN",
            "SEQUSED_Q": "HAS_SEQUSED_Q", "SEQUSED_K": "HAS_SEQUSED_K", "SCHEDULE": "IS_VARLEN",
            "BLOCK_TABLE": "PAGED", "SEQUSED_TILED": "HAS_SEQUSED_TILED", "SEQUSED_COST": "HAS_SEQUSED_COST"}


# Integer arguments that production calls usually pass as multiples of 16 (sequence lengths): Triton's launcher
# specialises them so, and that changes the code ptxas sees. The ptxas bundled with Triton 3.6 crashed on the
# causal d32 dQ kernel only with this specialisation (config.py), so the check compiles what the GPU compiles.
DIVISIBLE_INTS = {"seqlen_q", "seqlen_k"}


def compile_kernel(fn, constexprs: dict, num_warps: int, num_stages: int, dtype: str = "bf16"):
    # Pointers and strides (ALiBi's batch stride aside) get the 16-divisibility Triton's launcher specialises on for
    # aligned tensors, so that pointer loads (the paged forward's K/V gathers, the backward's held tiles) are
    # vectorised and pipelined with cp.async as they are in production.
    signature, consts, attrs = {}, dict(constexprs), {}
    for idx, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in OPTIONAL and OPTIONAL[name] in fn.arg_names and not constexprs.get(OPTIONAL[name], False):
            signature[name] = "constexpr"
            consts[name] = None
        elif (name in HOST_DESCS.get(fn.__name__, ()) and constexprs.get("DESC", 0) != 0
              and (name != "O" or constexprs["DESC"] == 1)):
            rows, d = constexprs[HOST_DESCS[fn.__name__][name]], constexprs["BLOCK_D"]
            signature[name] = f"tensordesc<{dtype}[{'1,' if constexprs['DESC'] == 1 else ''}{rows},1,{d}]>"
        elif name.isupper():
            elem = "fp32" if name in FP32_POINTERS else "i32" if name in I32_POINTERS else dtype
            signature[name] = "*" + elem
            attrs[(idx,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in FP32_SCALARS else "i64" if name in I64_SCALARS else "i32"
            if (name.startswith("stride_") and name != "stride_ab") or name in DIVISIBLE_INTS:
                attrs[(idx,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


# PAGED exists only in the forward; a flag set that needs it is skipped for kernels without it.
_DENSE = dict(IS_VARLEN=False, HAS_SEQUSED_Q=False, HAS_SEQUSED_K=False, PAGED=False, DESC=1,
              MASK_LEFT=False, MASK_RIGHT=False, HAS_SOFTCAP=False, HAS_ALIBI=False, UPCAST=False,
              DOT_PRECISION="tf32", PDL=True, STEP=MAX_STEP, LISTED=False, PUBLISH=True)
FLAG_SETS = {
    "dense": _DENSE,
    "causal": dict(_DENSE, MASK_RIGHT=True),
    "all": dict(IS_VARLEN=True, HAS_SEQUSED_Q=True, HAS_SEQUSED_K=True, PAGED=False, DESC=2,
                MASK_LEFT=True, MASK_RIGHT=True, HAS_SOFTCAP=True, HAS_ALIBI=True, UPCAST=False,
                DOT_PRECISION="tf32", PDL=True, STEP=MAX_STEP, LISTED=True, PUBLISH=False),
    "paged": dict(IS_VARLEN=True, HAS_SEQUSED_Q=False, HAS_SEQUSED_K=True, PAGED=True, DESC=0,
                  MASK_LEFT=False, MASK_RIGHT=True, HAS_SOFTCAP=False, HAS_ALIBI=False, UPCAST=False,
                  DOT_PRECISION="tf32", STEP=MAX_STEP),
}


# The Gluon Hopper kernels (ops/hopper.py): tensor arguments -> the tile-config field giving their box rows, of the
# host descriptors both dense and varlen batches pass for them.
HOPPER_KERNELS = {"fwd": _hopper_fwd_kernel, "bwd_dkdv": _hopper_dkdv_kernel, "bwd_dq": _hopper_dq_kernel}
HOPPER_TENSORS = {"Q": "block_m", "O": "block_m", "DO": "block_m", "K": "block_n", "V": "block_n", "DK": "block_n",
                  "DV": "block_n", "DQ": "block_m"}
# Output tensors a varlen batch also passes as pointers, for the partial last tile of a sequence.
HOPPER_POINTERS = {"O_PTR", "DK_PTR", "DV_PTR", "DQ_PTR"}
# Tensors passed as pointers either way: the forward's output, which the dQ kernel reads for delta.
HOPPER_DATA_POINTERS = {"OUT"}
# (MASK_LEFT, MASK_RIGHT, IS_VARLEN): no mask, causal, sliding window; causal varlen.
HOPPER_FLAGS = {"dense": (False, False, False), "causal": (False, True, False), "window": (True, True, False),
                "varlen causal": (False, True, True)}


def compile_hopper(kernel: str, head_dim: int, cfg, mask_left: bool, mask_right: bool, varlen: bool = False,
                   group: int = 2):
    """One Gluon Hopper kernel for sm_90, with the descriptors ops/hopper.py builds ((1, rows, 1, D) boxes over
    dense tensors, (rows, 1, D) over packed ones)."""
    fn = HOPPER_KERNELS[kernel]
    consts = dict(HEAD_DIM=head_dim, GROUP=group, MASK_LEFT=mask_left, MASK_RIGHT=mask_right, IS_VARLEN=varlen,
                  **cfg.kwargs())
    signature = {}
    for name in fn.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in HOPPER_DATA_POINTERS:
            signature[name] = "*bf16"
        elif name in HOPPER_POINTERS:
            signature[name] = "*bf16" if varlen else "constexpr"
            if not varlen:
                consts[name] = None
        elif name in HOPPER_TENSORS:
            box = [*([] if varlen else [1]), getattr(cfg, HOPPER_TENSORS[name]), 1, head_dim]
            layout = gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)
            signature[name] = f"tensordesc<bf16[{','.join(map(str, box))}],{layout!r}>"
        elif name in I32_POINTERS:
            signature[name] = "*i32" if varlen else "constexpr"
            if not varlen:
                consts[name] = None
        elif name in FP32_POINTERS:
            signature[name] = "*fp32"
        elif name in FP32_SCALARS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    src = GluonASTSource(fn=fn, signature=signature, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def ptxas_report(ptx: str) -> dict:
    """Registers and spill bytes of one kernel, from `ptxas -v` (the copy inside Triton's wheel)."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    # "wgmma.mma_async instructions are serialized due to ..." (C7511, C7512, ...): ptxas put a wait after every
    # wgmma of the kernel, which it does for instance when a wgmma result still in flight is the value of a branch
    # (an scf.if yield: its registers get moved), or when the accumulators in flight need more registers than it
    # has; "warpgroup.wait is injected" (C7517): it added one. Neither may happen in a production kernel (PERF.md
    # v18).
    return {"registers": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_stores": int(re.search(r"(\d+) bytes spill stores", log).group(1)),
            "wgmma_serialized": "instructions are serialized" in log or "warpgroup.wait is injected" in log}


def main(argv):
    flag_sets = FLAG_SETS if "--all-flags" in argv else {"dense": FLAG_SETS["dense"]}
    for kernel, d, cfg, dtype in production_configs():
        fn = KERNELS[kernel]
        for flag_name, flags in flag_sets.items():
            if flags["PAGED"] and "PAGED" not in fn.arg_names:
                continue
            flags = {name: value for name, value in flags.items() if name in fn.arg_names}
            if flags.get("DESC") and d > HOST_DESCRIPTOR_MAX_D:
                flags["DESC"] = 0  # what the launcher passes for such head dims (ops/fwd.py)
            if dtype == "fp32" and "DOT_PRECISION" in flags:
                flags["DOT_PRECISION"] = "ieee"  # what problem.kernel_flags gives fp32 inputs
            consts = dict(HEAD_DIM=d, BLOCK_D=d, GROUP=2, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **flags)
            c = compile_kernel(fn, consts, cfg.num_warps, cfg.num_stages, dtype)
            ptx = c.asm["ptx"]
            row = {"kernel": kernel, "head_dim": d, "dtype": dtype, "config": [cfg.block_m, cfg.block_n,
                   cfg.num_warps, cfg.num_stages], "flags": flag_name, "shared": c.metadata.shared,
                   "wgmma": "wgmma" in ptx, "tma": "cp.async.bulk.tensor" in ptx}
            if "--ptxas" in argv or row["wgmma"]:  # every kernel with wgmma is checked for serialised ones
                row |= ptxas_report(ptx)
            print(json.dumps(row), flush=True)
    for kernel, by_d in HOPPER.items():
        for d, cfg in by_d.items():
            for mask_name, (mask_left, mask_right, varlen) in HOPPER_FLAGS.items():
                c = compile_hopper(kernel, d, cfg, mask_left, mask_right, varlen)
                ptx = c.asm["ptx"]
                row = {"kernel": f"hopper_{kernel}", "head_dim": d, "config": [cfg.block_m, cfg.block_n, cfg.stages],
                       "flags": mask_name, "shared": c.metadata.shared, "wgmma": "wgmma" in ptx,
                       "tma": "cp.async.bulk.tensor" in ptx, "setmaxnreg": "setmaxnreg" in ptx}
                row |= ptxas_report(ptx)
                print(json.dumps(row), flush=True)
    c = compile_kernel(_plan_kernel, dict(BLOCK_B=MAX_SORT, BLOCK=128, HAS_SEQUSED_TILED=True, HAS_SEQUSED_COST=False,
                                          COST_PACKED=True), 4, 1)
    print(json.dumps({"kernel": "plan", "block_b": MAX_SORT, "shared": c.metadata.shared}), flush=True)

if __name__ == "__main__":
    main(sys.argv[1:])
