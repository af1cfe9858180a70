#!/usr/bin/env bash
# One GPU session's checks in one command (the lent H200 gives little device time): the GPU test tier, then
# decode and varlen (with its dense baseline) benchmarks, peak memory, and a short tile sweep. Every log and JSON
# goes to $OUT.
# Usage on the GPU machine, from the repo root: bash tools/h200_session.sh [git-sha]
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-bench-out}
sha=${1:-unknown}
mkdir -p "$out"
timeout 120 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider -rf tests 2>&1 | cut -c1-300 > "$out/gpu_tests.log"
timeout 60 python3 -m flashtile bench --preset decode --backends flashtile,sdpa-cudnn,sdpa-flash --rep-ms 30 \
  --meta "git_sha=$sha" --json "$out/decode.json" > "$out/decode.log" 2>&1
# The varlen preset also times the dense S=1k/4k baseline (the 90% bar) in the same run; Flex compiles
# once per shape, forward and backward, which is most of this step's time.
timeout 300 python3 -m flashtile bench --preset varlen --backends flashtile,flex --meta "git_sha=$sha" \
  --json "$out/varlen.json" > "$out/varlen.log" 2>&1
timeout 30 python3 tools/peak_memory.py > "$out/memory.log" 2>&1
timeout 50 python3 tools/tune_tiles.py --seqlen 1024 --head-dims 128 --json "$out/tune-s1k.json" > "$out/tune-s1k.log" 2>&1
grep -E "^FAILED|passed|failed" "$out/gpu_tests.log" | head -20
tail -4 "$out/memory.log"
grep -E "BEST" "$out/tune-s1k.log"
