"""Host time and do_bench time of one varlen call on the benchmark's 16-sequence mix, one source tree per process, and
of the same tokens as a dense 4 x 4k batch (what the varlen machinery adds to the host's work).

Host part: microseconds of Python per call (host_breakdown.host_us: min and median of five bursts, here of 50
calls) for the forward under no_grad and for a forward+backward (torch.autograd.grad), with the GPU kept busy by a
sleep kernel so that no call waits on it. Device part: `triton.testing.do_bench` of the same call (median, 20th
and 80th percentiles, ms). Causal and not; d128, 16 heads, bf16, random inputs. PERF.md, v12 (S12-2) has what it
printed on the H200 for two trees; the host's speed varies from one burst to the next, so compare minima, in one
process after another.

Usage (GPU): PYTHONPATH=<tree>/src python3 tools/varlen_host_times.py <tag>
"""

import json
import statistics
import sys

import torch
from host_breakdown import host_us  # tools/ is on the path of a script run from it
from triton.testing import do_bench

import flashtile
from flashtile.bench.cases import VARLEN_MIX

HEADS, HEAD_DIM = 16, 128


def main() -> None:
    tag = sys.argv[1] if len(sys.argv) > 1 else ""
    cu = torch.tensor([0, *torch.tensor(VARLEN_MIX).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, longest = int(cu[-1]), max(VARLEN_MIX)
    q, k, v = (torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

    # The same tokens as a dense batch of 4 x 4k, for the host time that is the varlen machinery's own.
    q4, k4, v4, dout4 = (t.detach().view(4, total // 4, HEADS, HEAD_DIM) for t in (q, k, v, dout))
    q4, k4, v4 = (t.requires_grad_() for t in (q4, k4, v4))

    def fwd(causal):
        with torch.no_grad():
            flashtile.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)

    def fwdbwd(causal):
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)
        torch.autograd.grad(out, (q, k, v), dout)

    def dense_fwd(causal):
        with torch.no_grad():
            flashtile.flash_attn_func(q4, k4, v4, causal=causal)

    def dense_fwdbwd(causal):
        out = flashtile.flash_attn_func(q4, k4, v4, causal=causal)
        torch.autograd.grad(out, (q4, k4, v4), dout4)

    for causal in (False, True):
        for name, call in (("fwd", fwd), ("fwdbwd", fwdbwd), ("dense4k_fwd", dense_fwd),
                           ("dense4k_fwdbwd", dense_fwdbwd)):
            def f():
                call(causal)
            f()
            torch.cuda.synchronize()
            ms = do_bench(f, warmup=25, rep=200, return_mode="all")
            cuts = statistics.quantiles(ms, n=5)
            print(json.dumps({"tag": tag, "call": name, "causal": causal, "host_us_min_med": host_us(f, n=50),
                              "bench_ms": [round(statistics.median(ms), 4), round(cuts[0], 4), round(cuts[3], 4)]}),
                  flush=True)


if __name__ == "__main__":
    main()
