"""The sm_90 SASS of every kernel of one compile group (tests/sm90_compile.py), built from two source trees and
compared instruction for instruction: the check that a refactoring of a kernel changed no instruction, where no GPU
can time it.

Each tree builds in a process of its own, its own tests/sm90_compile.py importing its own src/ (so the two trees'
scenarios decide their compiles, and a compile present in one tree only is reported as such). A compile's SASS is
cuobjdump's, each instruction's text kept (opcode, registers, operands, in order) and its address and encoding
dropped; a reordering or a renamed register is a difference. The encodings also carry the scheduling control bits
(stalls, barriers, yields), so "bytes identical" is reported beside it. A differing compile's count is difflib's:
instructions replaced, inserted or deleted, with branch targets masked so that one inserted instruction counts once
and not once per branch after it.

Usage (no GPU needed): python tools/sass_diff.py BASE_TREE [THIS_TREE] [--group hopper] [--keep DIR] [--only TEXT]
  BASE_TREE, THIS_TREE: source trees (THIS_TREE defaults to the one this script is in), e.g. a worktree, or
  `git archive main src tests | tar -x -C /tmp/base`. Exits 1 if any compile differs.
  --keep DIR keeps each tree's normalised SASS under DIR/base and DIR/this, for `diff -r`.
  --only TEXT builds only the compiles whose description contains every word of TEXT (e.g. "IS_VARLEN=True
  GROUP=2"), so that a filter survives a new flag in the descriptions.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*(/\*\s*0x[0-9a-f]+\s*\*/)?\s*$")
TARGET = re.compile(r"\b0x[0-9a-f]+\b")
OPCODE = re.compile(r"^(?:@!?U?P[T0-9]\s+)?([A-Z0-9_]+)")
BRANCHES = {"BRA", "BRX", "CALL", "JMP", "JMX", "BSSY", "SSY", "PBK", "BREAK", "RET", "BPT"}


def cuobjdump() -> str:
    """The cuobjdump that ships with Triton's NVIDIA backend (or the one on PATH)."""
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else "cuobjdump"


def normalise(sass: str) -> list[str]:
    """cuobjdump -sass output as one line per instruction, its text only (address and encoding dropped), with the
    function headers kept as lines of their own."""
    out = []
    for line in sass.splitlines():
        m = INSTRUCTION.match(line)
        if m:
            out.append(m.group(2).rstrip(" ;"))
        elif "Function :" in line:
            out.append(line.strip())
    return out


def masked(lines: list[str]) -> list[str]:
    """The lines with the address operands of branches replaced, for counting differences."""
    out = []
    for line in lines:
        m = OPCODE.match(line)
        out.append(TARGET.sub("ADDR", line) if m and m.group(1) in BRANCHES else line)
    return out


def count_differences(a: list[str], b: list[str]) -> int:
    """Instructions replaced, inserted or deleted between two normalised listings (the larger side of each
    replacement)."""
    ops = difflib.SequenceMatcher(None, masked(a), masked(b), autojunk=False).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


def dump(tree: str, group: str, out_dir: str, only: str | None) -> None:
    """Build the group's compiles from `tree` and write each one's raw and normalised SASS under out_dir, with an
    index.json: compile key -> (file stem, description)."""
    import importlib.util
    path = os.path.join(tree, "tests", "sm90_compile.py")
    spec = importlib.util.spec_from_file_location("sm90_compile", path)
    sm90 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sm90)
    index = {}
    tool = cuobjdump()
    for key, (compile_spec, scenarios, wanted) in sm90.collect().items():
        if sm90.group(compile_spec) != group or not any(wanted):
            continue
        row = sm90.describe(compile_spec)
        flags = " ".join(f"{k}={v}" for k, v in sorted(row.items()) if k != "ints_as_constants")
        description = f"{compile_spec[0].__name__} {flags} ({scenarios[0]})"
        if only and not all(word in description for word in only.split()):
            continue
        stem = compile_spec[0].__name__ + "-" + hashlib.sha256(key.encode()).hexdigest()[:12]
        compiled = sm90.build_compiled(compile_spec)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            raw = subprocess.run([tool, "-sass", f.name], check=True, capture_output=True, text=True).stdout
        with open(os.path.join(out_dir, stem + ".raw"), "w") as f:
            f.write(raw)
        with open(os.path.join(out_dir, stem + ".sass"), "w") as f:
            f.write("\n".join(normalise(raw)) + "\n")
        for stage in ("ttgir", "llir", "ptx"):  # for finding where a difference comes from (--keep)
            with open(os.path.join(out_dir, f"{stem}.{stage}"), "w") as f:
                f.write(compiled.asm[stage])
        index[key] = (stem, description + f" shared={compiled.metadata.shared}")
        print(f"built {description}", file=sys.stderr, flush=True)
    with open(os.path.join(out_dir, "index.json"), "w") as f:
        json.dump(index, f)


def build_tree(tree: str, group: str, out_dir: str, only: str | None) -> subprocess.Popen:
    os.makedirs(out_dir, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(tree, "src")
    cmd = [sys.executable, os.path.abspath(__file__), "--dump", out_dir, "--tree", tree, "--group", group]
    if only:
        cmd += ["--only", only]
    return subprocess.Popen(cmd, env=env)


def compare(base_dir: str, this_dir: str) -> list[dict]:
    """One row per compile of either tree: identical, bytes_identical, differences (instructions)."""
    base = json.load(open(os.path.join(base_dir, "index.json")))
    this = json.load(open(os.path.join(this_dir, "index.json")))
    rows = []
    for key in list(base) + [k for k in this if k not in base]:
        if key not in base or key not in this:
            rows.append({"compile": (base.get(key) or this[key])[1], "only_in": "base" if key in base else "this"})
            continue

        def read(d, stem, ext):
            return open(os.path.join(d, stem + ext)).read()
        a, b = read(base_dir, base[key][0], ".sass"), read(this_dir, this[key][0], ".sass")
        la, lb = a.splitlines(), b.splitlines()
        rows.append({"compile": this[key][1], "identical": a == b and base[key][1] == this[key][1],
                     "bytes_identical": read(base_dir, base[key][0], ".raw") == read(this_dir, this[key][0], ".raw"),
                     "instructions": [len(la), len(lb)], "differences": count_differences(la, lb)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", nargs="?", help="the tree to compare against")
    parser.add_argument("this", nargs="?", default=os.path.dirname(HERE), help="the tree under test")
    parser.add_argument("--group", default="hopper", help="a compile group of tests/sm90_compile.py")
    parser.add_argument("--keep", help="keep the SASS listings under this directory")
    parser.add_argument("--only", help="only the compiles whose description contains every word of this text")
    parser.add_argument("--dump", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dump:
        dump(args.tree, args.group, args.dump, args.only)
        return 0
    if not args.base:
        parser.error("BASE_TREE is required")
    with tempfile.TemporaryDirectory() as scratch:
        root = args.keep or scratch
        dirs = {name: os.path.join(root, name) for name in ("base", "this")}
        procs = [build_tree(os.path.abspath(tree), args.group, dirs[name], args.only)
                 for name, tree in (("base", args.base), ("this", args.this))]
        if any(p.wait() != 0 for p in procs):
            print("a tree failed to build", file=sys.stderr)
            return 2
        rows = compare(dirs["base"], dirs["this"])
    for row in rows:
        print(json.dumps(row))
    same = sum(bool(r.get("identical")) for r in rows)
    print(f"{same} of {len(rows)} compiles identical", file=sys.stderr)
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
