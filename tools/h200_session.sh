#!/usr/bin/env bash
# One GPU session's measurements in back-to-back device calls. FlashAttention-4's wheels travel in two halves
# (../shared/tools/fa4-wheels.sh makes .fa4a/ and .fa4b/), and the machine stays warm ~30 s between calls:
#   part 1 (carry .fa4a): the GPU test tier (pytest -m gpu, 6 workers) beside tools/stress.py (3 processes), so
#     that processes share the GPU as races need; ~480 s
#   part 2 (carry .fa4b): FA4 installed, then the standard sweep at d128 and d64, one JSON per head dim and mode
#   part 3 (no carry, straight after part 2: FA4 is still installed on the warm machine): the sweep at d256
#   part 4 (after part 2 or 3, FA4 still installed): the model-shape presets (sinks, mla, d512, mla-decode) and
#   dropout, one JSON each
#   part 5: the varlen preset (with its dense baseline) and the decode preset
# A measured run needed ~350 s for part 2's sweeps and ~300 s for d256 with every backend: one call (600 s) cannot
# hold all three head dims. The GPU tier alone ran past 420 s at 8 workers beside a stress run (2026-12-03). Every
# log and JSON goes to $OUT; a bench cut short by its time limit keeps the cases it finished. The time limits were
# sized before the bench timed backends in interleaved rounds (bench/run.py), which adds a do_bench warm-up per
# round: watch for runs cut short.
# Usage on the GPU machine, from the repo root: bash tools/h200_session.sh 1|2|3|4|5 [git-sha]
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${OUT:-bench-out}
part=${1:?part 1, 2, 3, 4 or 5}
sha=${2:-unknown}
mkdir -p "$out" /tmp/fa4
bench="python3 -m flashtile bench --meta git_sha=$sha"
if [ "$part" = 1 ]; then
  cp .fa4a/* /tmp/fa4/ 2>/dev/null
  python3 tools/stress.py --minutes 2.5 --procs 3 --json "$out/stress.json" > "$out/stress.log" 2>&1 &
  stress=$!
  timeout 450 python3 -m pytest -m gpu -q -n 6 -p no:cacheprovider -rf tests 2>&1 | cut -c1-300 > "$out/gpu_tests.log"
  wait "$stress"
  grep -E "^FAILED|^ERROR|passed|failed" "$out/gpu_tests.log" | head -20
  tail -3 "$out/stress.log"
elif [ "$part" = 5 ]; then
  timeout 220 $bench --preset varlen --backends flashtile,flex --json "$out/varlen.json" > "$out/varlen.log" 2>&1
  timeout 190 $bench --preset decode --backends flashtile,sdpa-cudnn,sdpa-flash,flex --rep-ms 15 \
    --json "$out/decode.json" > "$out/decode.log" 2>&1
  grep -E "^decode" "$out/decode.log" | grep flashtile | cut -c1-120
  grep -E "^(varlen|fwd)|^ " "$out/varlen.log" | cut -c1-130
else
  cp .fa4b/* /tmp/fa4/ 2>/dev/null
  if [ -f /tmp/fa4/part.aa ] && [ -f /tmp/fa4/part.ab ]; then
    cat /tmp/fa4/part.aa /tmp/fa4/part.ab > /tmp/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
    rm -f /tmp/fa4/part.*
    python3 -m pip install -q --no-index --no-deps --target /tmp/fa4site /tmp/fa4/*.whl
  fi
  if [ -d /tmp/fa4site ]; then
    export PYTHONPATH=src:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
  else
    echo "FA4 not installed (an earlier part ran on another machine): the fa4 rows will say unsupported"
  fi
  if [ "$part" = 4 ]; then
    for spec in "sinks flashtile,fa4 110" "mla flashtile,fa4 130" "d512 flashtile,sdpa-efficient 110" \
                "mla-decode flashtile 90" "dropout flashtile,fa2,sdpa-flash 140"; do
      set -- $spec
      timeout "$3" $bench --preset "$1" --backends "$2" --rep-ms 10 --json "$out/$1.json" > /tmp/preset.log 2>&1
      cat /tmp/preset.log >> "$out/presets.log"
      grep -E "^(fwd|fwdbwd|decode) " /tmp/preset.log | cut -c1-120
    done
    exit 0
  fi
  specs=("128 fwd 80" "128 fwdbwd 110" "64 fwd 70" "64 fwdbwd 100")
  [ "$part" = 3 ] && specs=("256 fwd 110" "256 fwdbwd 250")
  for spec in "${specs[@]}"; do
    set -- $spec
    timeout "$3" $bench --preset standard --mode "$2" --head-dim "$1" \
      --backends flashtile,flex,sdpa-cudnn,sdpa-flash,sdpa-efficient,fa4 --rep-ms 20 \
      --json "$out/std-d$1-$2.json" > /tmp/std.log 2>&1
    cat /tmp/std.log >> "$out/std.log"  # one log: $OUT brings back at most 8 files
    grep -E "^(fwd|fwdbwd) " /tmp/std.log | cut -c1-120
  done
fi
