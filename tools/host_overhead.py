"""Host-side cost of a flashtile call: how long Python takes to enqueue the work, beside how long the GPU takes.

When the enqueue time is longer than the GPU time, a benchmark measures the host, not the kernels: short
sequences (S=1k) are where that shows. This prints, per case and route, the host time per call (wall clock of
a burst of calls) and the device time per call (CUDA events around the same burst: equal to the host time when
the host is the bottleneck), and a cProfile of the eager calls sorted by own time, so the expensive Python frames
are named. Routes: `eager`, the public API on plain tensors (implementations called directly), and `dispatcher`,
the custom op `flashtile::fwd` with its registered autograd, which is what torch.compile traces (Note [eager calls
skip the dispatcher] in ops/common.py).

Usage (GPU): PYTHONPATH=src python3 tools/host_overhead.py [--seqlen 1024] [--head-dim 128] [--profile 25]
"""

import argparse
import cProfile
import pstats
import time

import torch

import flashtile


def _burst(fn, n):
    """(host ms per call, device ms per call) over n back-to-back calls."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    host = (time.perf_counter() - t) / n * 1e3
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--profile", type=int, default=25, help="rows of the cProfile table; 0 for none")
    args = ap.parse_args()
    d, s = args.head_dim, args.seqlen
    b, h = args.tokens // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)

    def eager(causal):
        return flashtile.flash_attn_func(q, k, v, causal=causal)

    def dispatcher(causal):
        return torch.ops.flashtile.fwd(q, k, v, None, None, None, None, None, None, s, s, d**-0.5, -1,
                                       0 if causal else -1, 0.0, 0)[0]

    def fwd(route, causal):
        with torch.no_grad():
            route(causal)

    def fwdbwd(route, causal):
        route(causal).backward(dout)
        q.grad = k.grad = v.grad = None

    print(f"B={b} S={s} H={h} D={d} bf16; per call, milliseconds")
    print("case            route        host   device")
    for name, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        for causal in (False, True):
            for route in (eager, dispatcher):
                for _ in range(3):
                    fn(route, causal)
                host, dev = _burst(lambda: fn(route, causal), args.calls)
                print(f"{name:7s}{' causal' if causal else '       '}  {route.__name__:10s}  {host:6.3f}  {dev:7.3f}")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fwdbwd(eager, True)
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
