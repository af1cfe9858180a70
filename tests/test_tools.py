"""The maintained scripts of tools/ (the README lists them): each parses its arguments and imports what it needs
on a machine without a GPU (`--help`), and each shell script is valid bash. They run for real only on the GPU
machine; what they measure is in docs/perf.md."""

import os
import subprocess
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")
SRC = os.path.join(os.path.dirname(__file__), "..", "src")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(TOOLS) if f.endswith(".py")))
def test_python_tool_parses_its_arguments(name):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, name), "--help"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(TOOLS) if f.endswith(".sh")))
def test_shell_tool_is_valid_bash(name):
    subprocess.run(["bash", "-n", os.path.join(TOOLS, name)], check=True)


def test_readme_lists_every_tool():
    readme = open(os.path.join(TOOLS, "..", "README.md")).read()
    for name in os.listdir(TOOLS):
        if name.endswith((".py", ".sh")):
            assert name in readme, f"README.md does not list tools/{name}"


def _tool(name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sass_diff():
    return _tool("sass_diff")


def test_stress_problems_keep_their_kind():
    """tools/stress.py's problems: a dense or varlen one never takes a KV-cache problem's fields (a misplaced
    branch once gave four in five dense problems a KV-cache step's batch and 1-4 query rows, and varlen ones a batch
    their ALiBi slopes were shaped by), and about one dense or varlen problem in five is MLA prefill's 192/128."""
    import random
    stress = _tool("stress")
    rng = random.Random(0)
    kinds = ["dense", "qkvpacked", "varlen", "varlen_short", "kvcache"]
    cases = [stress._case(rng, kinds) for _ in range(2000)]
    for case in cases:
        assert ("capacity" in case) == (case["kind"] == "kvcache"), case
        assert ("lens_q" in case) == case["kind"].startswith("varlen"), case
    prefill = [c for c in cases if c["kind"] in ("dense", "varlen")]
    mla = [c for c in prefill if (c["head_dim"], c.get("head_dim_v")) == (192, 128)]
    assert 0.15 < len(mla) / len(prefill) < 0.3


SASS = """
	code for sm_90a
		Function : _k
        /*0000*/                   LDC R1, c[0x0][0x28] ;                    /* 0x00000a00ff017b82 */
                                                                             /* 0x000e640000000800 */
        /*0010*/              @!P0 BRA 0x30 ;                                /* 0x0000000000108947 */
                                                                             /* 0x000fe20000000000 */
        /*0020*/                   IADD3 R2, R1, 0x10, RZ ;                  /* 0x0000001001027810 */
                                                                             /* 0x000fe20007ffe0ff */
        /*0030*/                   EXIT ;                                    /* 0x000000000000794d */
                                                                             /* 0x000fea0003800000 */
"""


def test_sass_diff_counts_instructions_not_addresses():
    """tools/sass_diff.py keeps each instruction's text and drops addresses and encodings; one inserted
    instruction counts once, not once more per branch whose target it moves."""
    sass_diff = _sass_diff()
    base = sass_diff.normalise(SASS)
    assert base == ["Function : _k", "LDC R1, c[0x0][0x28]", "@!P0 BRA 0x30", "IADD3 R2, R1, 0x10, RZ", "EXIT"]
    moved = base[:2] + ["NOP", "@!P0 BRA 0x40"] + base[3:]
    assert sass_diff.count_differences(base, base) == 0
    assert sass_diff.count_differences(base, moved) == 1
    swapped = base[:3] + ["IADD3 R3, R1, 0x10, RZ"] + base[4:]  # a register renamed is a difference
    assert sass_diff.count_differences(base, swapped) == 1


def test_sass_diff_finds_a_tree_identical_to_itself():
    """The whole tool on one Gluon compile (the d128 dense forward), this tree against itself."""
    root = os.path.join(TOOLS, "..")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    only = "_hopper_fwd_kernel GROUP=1 HAS_SINK=False IS_VARLEN=False MASK_CHUNK=False MASK_RIGHT=False (d128 dense)"
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, "sass_diff.py"), root, root, "--only", only], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows and all('"identical": true' in row for row in rows), proc.stdout


MASK_BENCH_SM90 = """
import importlib.util, re, sys
import triton
from triton.backends.compiler import GPUTarget
spec = importlib.util.spec_from_file_location("mask_bench", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
product = {"OUT": "*fp32", "Q": "*bf16", "K": "*bf16", "seed": "i32", "TILES": "constexpr", "MASK": "constexpr",
           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "HEAD_DIM": "constexpr"}
philox = {"OUT": "*fp32", "seed": "i32", "TILES": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
for name, fn, signature, constexprs in (
        ("product", bench._product, product, dict(TILES=64, MASK=False, BLOCK_M=128, BLOCK_N=128, HEAD_DIM=128)),
        ("masked", bench._product, product, dict(TILES=64, MASK=True, BLOCK_M=128, BLOCK_N=128, HEAD_DIM=128)),
        ("philox", bench._philox, philox, dict(TILES=64, BLOCK_M=128, BLOCK_N=128))):
    ptx = triton.compile(triton.compiler.ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4}).asm["ptx"]
    print(name, len(re.findall(r"\\b(?:ld|st)\\.shared", ptx)))
"""


def test_mask_bench_kernels_compile_for_sm90():
    """tools/mask_bench.py runs only on a GPU: its three kernels at its default shapes build for sm_90 here (as
    tests/sm90_compile.py builds the library's), and the masked product reads and writes shared memory no more
    than the plain one (Note [dropout mask]: the mask is built in the accumulator's registers)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", MASK_BENCH_SM90, os.path.join(TOOLS, "mask_bench.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shared = dict(line.split() for line in proc.stdout.splitlines())
    assert set(shared) == {"product", "masked", "philox"}
    assert shared["masked"] == shared["product"], shared


RACECHECK_PROBE_SM90 = """
import importlib.util, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
spec = importlib.util.spec_from_file_location("racecheck_probe", sys.argv[1])
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)
for wait in (0, 1):
    src = GluonASTSource(probe.handoff_kernel, {"IN": "*fp32", "OUT": "*fp32", "WAIT": "constexpr"}, {(2,): wait})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    print(wait, "try_wait" in ptx, "mbarrier.arrive" in ptx)
"""


def test_racecheck_probe_builds_for_sm90():
    """tools/racecheck_probe.py runs only on a GPU: its kernel builds for sm_90 here, its producer arrives on the
    mbarrier, and only the race-free variant waits on it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", RACECHECK_PROBE_SM90, os.path.join(TOOLS, "racecheck_probe.py")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["0 False True", "1 True True"], proc.stdout
