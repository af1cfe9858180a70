"""The innermost loops of a compile group's sm_90 SASS that issue tensor-core instructions, with their instruction
count and opcode mix: what one iteration of a kernel's main loop (one key block of a consumer, one tile pair)
costs in issue slots, where no GPU can time it.

Each compile of the group (tests/sm90_compile.py, built from this tree as tools/sass_diff.py builds it) is
disassembled with cuobjdump; a loop is the instructions from a backward branch's target to the branch, and the ones
listed are, for each HGMMA (wgmma) or HMMA (mma.sync), the smallest loop that holds it. A warp issues at most one instruction a
cycle, so an iteration's count bounds its time from below; docs/perf.md (lead 4) reads the Gluon forward's with and
without dropout against the time its matmuls take.

Usage (no GPU needed): python tools/sass_loops.py [--group hopper] [--only TEXT] [--top 14]
  --only TEXT builds only the compiles whose description contains every word of TEXT (as sass_diff.py's), e.g.
  "_hopper_fwd_kernel HAS_DROPOUT=True IS_VARLEN=False MASK_RIGHT=False".
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from sass_diff import OPCODE, dump  # noqa: E402

ADDRESSED = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BACK_BRANCH = re.compile(r"\bBRA\b.*?\b(0x[0-9a-f]+)\b")
MMA = ("HGMMA", "HMMA")


def instructions(raw: str) -> list[tuple[int, str]]:
    """(address, text) of each instruction of cuobjdump -sass output, in order."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(ADDRESSED.match, raw.splitlines()) if m]


def opcode(text: str) -> str:
    """An instruction's opcode without its modifiers (IMAD.WIDE.U32 -> IMAD)."""
    m = OPCODE.match(text)
    return m.group(1).split(".")[0] if m else "?"


def mma_loops(raw: str) -> list[dict]:
    """For each tensor-core instruction the smallest loop holding it, each such loop once, in address order: first
    and last address, size, opcode counts."""
    ins = instructions(raw)
    index = {address: i for i, (address, _) in enumerate(ins)}
    spans = []  # (first, last) instruction indices of each backward branch's loop
    for i, (address, text) in enumerate(ins):
        m = BACK_BRANCH.search(text)
        target = int(m.group(1), 16) if m else None
        if target is not None and target < address and target in index:
            spans.append((index[target], i))
    chosen = set()
    for i, (_, text) in enumerate(ins):
        if opcode(text) in MMA:
            holding = [(last - first, first, last) for first, last in spans if first <= i <= last]
            if holding:
                chosen.add(min(holding)[1:])
    return [{"start": ins[first][0], "end": ins[last][0], "instructions": last + 1 - first,
             "ops": collections.Counter(opcode(t) for _, t in ins[first:last + 1])} for first, last in sorted(chosen)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group", default="hopper", help="a compile group of tests/sm90_compile.py")
    parser.add_argument("--only", help="only the compiles whose description contains every word of this text")
    parser.add_argument("--top", type=int, default=14, help="opcodes listed per loop")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # sm90_compile.py builds for sm_90, not the interpreter
    with tempfile.TemporaryDirectory() as out_dir:
        dump(os.path.dirname(HERE), args.group, out_dir, args.only)
        index = json.load(open(os.path.join(out_dir, "index.json")))
        for stem, description in index.values():
            print(description)
            for loop in mma_loops(open(os.path.join(out_dir, stem + ".raw")).read()):
                mix = ", ".join(f"{name} {n}" for name, n in loop["ops"].most_common(args.top))
                print(f"  loop {loop['start']:#x}-{loop['end']:#x}: {loop['instructions']} instructions: {mix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
