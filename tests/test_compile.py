"""Every kernel that flashtile's scenarios launch compiles for sm_90 on this (GPU-less) machine, with the
specialisations Triton's launcher would derive from the real arguments (tests/sm90_compile.py), and fits an
H100/H200 block: shared memory within 227 KiB, wgmma and TMA where they belong, the Gluon kernels' register split,
no wgmma that ptxas serialises, no 16-bit kernel spilling like one that lost its registers (MAX_SPILL_BYTES), no
length of a prefill kernel specialised into a constant (Note [runtime integers]). The interpreter cannot see GPU compile errors (a ptxas crash included), so this is their only guard in
CI. Each group builds in its own subprocess (sm90_compile.py must not see TRITON_INTERPRET), so pytest-xdist
spreads them.
"""

import json
import os
import subprocess
import sys

import pytest

SHARED_LIMIT = 232448
SCRIPT = os.path.join(os.path.dirname(__file__), "sm90_compile.py")
# sm90_compile.GROUPS, which must not be imported here (it imports the kernels without the interpreter); the
# longest first (conftest.py runs this file first).
GROUPS = ["prefill-64", "prefill-256", "hopper", "hopper-wide", "prefill-16", "prefill-32", "prefill-128",
          "prefill-512"] + [
    f"decode-{d}" for d in (16, 32, 64, 128, 256, 512, 1024)] + ["plan"]
# The decode kernels keep Triton's own integer specialisation (Note [runtime integers]).
SPECIALISED = {"_decode_kernel", "_append_kv_kernel", "_combine_kernel"}
NARROW_D512 = {"_bwd_dq_kernel", "_bwd_dkdv_kernel"}
# Spill stores a production compile of 16-bit inputs may make (the builds here reach 2.7 KB): past it a kernel
# has lost its registers, as the d512 dK/dV kernel with dropout had (32 registers, 12-17 KB of spill stores, 4.6x
# slower on the H200 than config.DROPOUT's tile since). fp32 inputs' true fp32 dots (DOT_PRECISION "ieee") and
# S_dmask's testing-only kernel are exempt. ptxas reports spills only where it compiled (a cold Triton cache, as CI's).
MAX_SPILL_BYTES = 4096
WGMMA_KERNELS = {"_attn_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel", "_hopper_fwd_kernel", "_hopper_dq_kernel",
                 "_hopper_dkdv_kernel", "_hopper_fwd_wide_kernel"}


def _run(*args, timeout=1500):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_groups_cover_every_compile():
    """Every compile the scenarios derive falls in one of the groups below (and the scenarios run at all)."""
    rows = _run("--list", timeout=600)
    assert {r["group"] for r in rows} == set(GROUPS)


@pytest.mark.parametrize("group", GROUPS)
def test_production_kernels_compile_for_sm90(group):
    rows = _run("--group", group)
    assert any(r["built"] for r in rows), f"no compile in group {group}"
    for r in rows:
        if r["kernel"] not in SPECIALISED:
            assert not r["ints_as_constants"], f"{r}: integer arguments specialised into constants"
        if not r["built"]:
            continue
        assert r["shared"] <= SHARED_LIMIT, r
        if r.get("DOT_PRECISION") != "ieee" and r["kernel"] != "dropout_probs_kernel":
            assert r["spill_stores"] <= MAX_SPILL_BYTES, f"{r}: spills as a kernel that lost its registers does"
        if r["kernel"] in WGMMA_KERNELS:
            # fp32 inputs run true fp32 dots (DOT_PRECISION "ieee"), which are not tensor-core matmuls; the d512
            # backward's 32-row tiles (config.TABLE) are below wgmma's 64 rows a warpgroup and run mma.sync.
            mma_sync = r["kernel"] in NARROW_D512 and r.get("BLOCK_D") == 512
            assert (r["wgmma"] or r.get("DOT_PRECISION") == "ieee" or mma_sync) and r["tma"], \
                f"{r}: expected wgmma and TMA"
            # A serialised kernel waits for each wgmma before issuing the next: the Gluon forward ran 16-24%
            # slower so on the H200.
            assert not r["wgmma_serialized"], f"{r}: ptxas serialised the wgmma"
        if r["kernel"].startswith("_hopper"):
            assert r["setmaxnreg"], f"{r}: expected the warp-specialised partitions' register split"
    pairs = _dropout_pairs(rows)
    assert pairs or group not in ("prefill-64", "hopper", "hopper-wide"), \
        "no compile with dropout beside the same one without"
    for kernel, with_dropout, without in pairs:
        assert (with_dropout["shared_accesses"], with_dropout["barriers"]) == \
            (without["shared_accesses"], without["barriers"]), \
            f"{kernel}: the dropout mask goes through shared memory (Note [dropout mask]): {with_dropout}"


def _dropout_pairs(rows):
    """(kernel, row, row) for each built forward or dQ compile with dropout and the compile that differs from it only in
    having none (the "239x1 causal" scenarios of sm90_compile.py, and the Gluon kernels' "d128 dropout" and "d512
    dropout" beside "d128 dense" and "d512 dense"). Their mask is built in the registers that hold P (Notes
    [dropout mask] and [dropout entries] in kernels/dropout.py), so their PTX must have as many shared-memory
    accesses and barriers as without dropout; the dK/dV kernel's transposed tile still converts the mask's
    layout."""
    def key(r):
        return repr(sorted((k, v) for k, v in r.items() if k.isupper() and k != "HAS_DROPOUT"))
    masked_in_registers = ("_attn_fwd_kernel", "_bwd_dq_kernel", "_hopper_fwd_kernel", "_hopper_dq_kernel",
                           "_hopper_fwd_wide_kernel")
    built = [r for r in rows if r["built"] and r["kernel"] in masked_in_registers]
    plain = {(r["kernel"], key(r)): r for r in built if not r.get("HAS_DROPOUT")}
    return [(r["kernel"], r, plain[r["kernel"], key(r)]) for r in built
            if r.get("HAS_DROPOUT") and (r["kernel"], key(r)) in plain]
