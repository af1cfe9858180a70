"""Timing a prepared call: the median and the 20th/80th percentiles of many repetitions.

On a GPU this is `triton.testing.do_bench`: it sizes the warm-up and the repetition count from a first
estimate (about `rep_ms` of repetitions), times each repetition with its own pair of CUDA events, and clears
the L2 cache before each (a 256 MB write, outside the events) — so cold-cache time is measured, as a real
model step sees it.

Decode is timed with `graph=True`: the repetitions are captured into one CUDA graph and replayed
(`triton.testing.do_bench_cudagraph`), as serving stacks run decode steps. A decode step takes a fraction of a
millisecond of device time, so eager calls back to back would time the host's launch overhead rather than the
kernels. A backend that cannot be captured is timed eagerly and its row says so.

Without a GPU (the Triton interpreter) it is `time.perf_counter` around a few repetitions: enough to show the
pipeline working, not a measurement of anything a GPU would do.

What this module does not do: decide what is timed (backends.py) or turn times into FLOP/s (run.py).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

QUANTILES = (0.5, 0.2, 0.8)
CPU_REPS = 3


@dataclass(frozen=True)
class Timing:
    ms: float  # median
    p20: float
    p80: float
    timer: str = "events"  # "events", "cuda graph", "eager (graph capture failed)" or "cpu"


def measure(run, leaves, device: torch.device, rep_ms: int = 100, graph: bool = False) -> Timing:
    if device.type == "cuda":
        import triton.testing

        if graph:
            # do_bench_cudagraph runs on a fresh side stream that does not wait for the default one: let the
            # inputs (and cache lengths) made there land first, or the first call reads unwritten memory.
            torch.cuda.synchronize()
            try:
                ms, p20, p80 = triton.testing.do_bench_cudagraph(run, rep=rep_ms, quantiles=list(QUANTILES))
                return Timing(ms, p20, p80, "cuda graph")
            except Exception:  # noqa: BLE001  (not capturable: time it eagerly and say so)
                torch.cuda.synchronize()
        ms, p20, p80 = triton.testing.do_bench(
            run, warmup=max(25, rep_ms // 4), rep=rep_ms, grad_to_none=list(leaves), quantiles=list(QUANTILES)
        )
        return Timing(ms, p20, p80, "eager (graph capture failed)" if graph else "events")
    run()  # warm-up: the interpreter and torch's first-call costs
    times = []
    for _ in range(CPU_REPS):
        for t in leaves:
            t.grad = None
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    cuts = statistics.quantiles(times, n=5, method="inclusive")  # 20th, 40th, 60th, 80th percentiles
    return Timing(statistics.median(times), cuts[0], cuts[3], "cpu")
