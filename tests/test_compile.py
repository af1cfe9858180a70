"""Every production tile config of the prefill kernels compiles for sm_90 on this (GPU-less) machine and fits in
an H100/H200 block's shared memory. The interpreter cannot see GPU compile errors, so this is their only guard
in CI. Runs tests/sm90_compile.py in a subprocess, because it must not see TRITON_INTERPRET."""

import json
import os
import subprocess
import sys

SHARED_LIMIT = 232448


def test_production_configs_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "sm90_compile.py")
    proc = subprocess.run([sys.executable, script, "--all-flags"], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    kernels = {r["kernel"] for r in rows}
    assert {"fwd", "bwd_dkdv", "bwd_dq", "hopper_fwd", "hopper_bwd_dkdv", "hopper_bwd_dq"} <= kernels
    for r in rows:
        assert r["shared"] <= SHARED_LIMIT, r
        if "wgmma" in r:
            # fp32 inputs run true fp32 dots (DOT_PRECISION "ieee"), which are not tensor-core matmuls.
            assert (r["wgmma"] or r.get("dtype") == "fp32") and r["tma"], f"{r}: expected wgmma matmuls and TMA loads"
        if r["kernel"].startswith("hopper_"):
            assert r["setmaxnreg"], f"{r}: expected the warp-specialised partitions' register split"
        if r.get("wgmma"):
            # A serialised kernel waits for each wgmma before issuing the next: the Gluon forward 16-24% slower
            # (PERF.md v18).
            assert not r["wgmma_serialized"], f"{r}: ptxas serialised the wgmma"
