#!/bin/bash
# A/B of this tree against another on the GPU machine, in one device call (tools/ab_trees.py times one tree).
# Before the call, here: rm -rf .ab_main && mkdir .ab_main && git archive main src | tar -x -C .ab_main
# Then run `bash tools/ab_trees.sh .ab_main [ROUNDS] [ab_trees.py options]` with carry [".ab_main"].
# Order: base, this, base, this, ... (ROUNDS pairs, default 2), each tree in its own process; the JSON lines go to
# $OUT/ab_trees.jsonl and the summary (the lower of each tree's medians per case) is printed last.
set -u
base=$1
rounds=${2:-2}
shift $(( $# < 2 ? $# : 2 ))
out=${OUT:-.}/ab_trees.jsonl
export PYTHONUNBUFFERED=1
for _ in $(seq "$rounds"); do
  PYTHONPATH="$base/src" timeout 150 python3 tools/ab_trees.py base "$@" >> "$out"
  PYTHONPATH=src timeout 150 python3 tools/ab_trees.py this "$@" >> "$out"
done
python3 - "$out" <<'PY'
import json, sys
best = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    cur = best.setdefault((r["case"], r["causal"], r["fwdbwd"]), {})
    if r["label"] not in cur or r["ms"] < cur[r["label"]]["ms"]:
        cur[r["label"]] = r
for (case, causal, fwdbwd), d in best.items():
    b, t = d.get("base"), d.get("this")
    if b and t:
        print(f"{'fwdbwd' if fwdbwd else 'fwd':6s} {case:9s} {'causal' if causal else '      '} base {b['tflops']:6.1f}"
              f"  this {t['tflops']:6.1f}  x{t['tflops'] / b['tflops']:.3f}"
              f"  checksum rel diff {abs(t['checksum'] - b['checksum']) / b['checksum']:.1e}  {t['paths']}")
PY
