#!/bin/bash
# Session 8's first device call, on branch exp/gluon-dq (which holds exp/gluon-varlen too; nothing to carry).
# 1. GPU tests of the Gluon path: dense (test_hopper_*), varlen (test_hopper_varlen and test_varlen.py's GPU tier,
#    whose d128 bf16 cases take the Gluon kernels), determinism, torch.compile. A failure here: rerun on
#    exp/gluon-varlen (no Gluon dQ) to tell which change it is.
# 2. Per-kernel times (tools/kernel_times.py): the Gluon dQ against session 7's Triton dQ (319 us at d128 S=1k causal).
# 3. The d128 forward+backward cells and the varlen preset beside Flex.
# Two calls: `bash tools/gluon_branch_gpu.sh a` (tests, kernel times), then `... b` (benchmarks).
export PYTHONPATH=src PYTHONUNBUFFERED=1
if [ "$1" = a ]; then
timeout 400 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_varlen.py -k "hopper or deterministic or gpu_mixed or gpu_features or 2_31" -p no:cacheprovider --durations=3 > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; grep -E "passed|failed|FAIL|Error" $OUT/pytest.log | tail -12
timeout 90 python3 tools/kernel_times.py --seqlens 1024,4096 --causal 2>&1 | grep -v Warn | tail -14
else
timeout 200 python3 -m flashtile bench --preset standard --head-dim 128 --seqlen 1024,4096,16384 --backends flashtile,flex,sdpa-cudnn --json $OUT/s8-d128.json 2>&1 | grep -E "^(fwd|fwdbwd) |^ +(flex|sdpa)"
timeout 120 python3 -m flashtile bench --preset varlen --backends flashtile,flex --json $OUT/s8-varlen.json 2>&1 | grep -E "^(varlen|varlenbwd|fwd|fwdbwd) |^ +flex"
fi
