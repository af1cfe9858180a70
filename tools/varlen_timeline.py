"""The GPU timeline of the benchmark's varlen forward+backward step: each kernel's duration and the idle gap before
it, from torch.profiler, so that a gap where the GPU waits for the host's next launch shows (PERF.md v16, S16-5:
the dQ launch came 22 µs after the causal forward ended).

The step is the bench's: clear 256 MB of L2-sized scratch, the varlen forward on the 16-sequence mix (d128, 16 heads,
bf16), `.backward()`, drop the gradients; 20 steps of warm-up, then 5 profiled, of which the last two are printed.

Usage (GPU): PYTHONPATH=src python3 tools/varlen_timeline.py [causal|full]
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import flashtile
from flashtile.bench.cases import VARLEN_MIX

HEADS, HEAD_DIM = 16, 128


def main() -> None:
    causal = (sys.argv[1] if len(sys.argv) > 1 else "causal") == "causal"
    cu = torch.tensor([0, *torch.tensor(VARLEN_MIX).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, longest = int(cu[-1]), max(VARLEN_MIX)
    q, k, v = (torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    scratch = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def step():
        scratch.zero_()
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal).backward(dout)
        q.grad = k.grad = v.grad = None

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    per_step = len(kernels) // 5
    end = None
    for e in kernels[-2 * per_step:]:
        start, stop = e.time_range.start, e.time_range.end
        gap = start - end if end is not None else 0.0
        print(f"{e.name[:48]:48s} {stop - start:9.1f} µs   gap before {gap:7.1f} µs")
        end = stop


if __name__ == "__main__":
    main()
