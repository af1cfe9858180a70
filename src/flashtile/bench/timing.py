"""Timing a prepared call: the median and the 20th/80th percentiles of many repetitions.

On a GPU one round of timing is `triton.testing.do_bench`: it sizes the warm-up and the repetition count from a
first estimate (about `rep_ms` of repetitions), times each repetition with its own pair of CUDA events, and
clears the L2 cache before each (a 256 MB write, outside the events) — so cold-cache time is measured, as a real
model step sees it. The warm-up runs the call back to back for at least HEAT_MS first, so that the repetitions
run at the clock a long run settles at, not at the boost clock of a GPU that has just idled (Note [sustained
clocks]). run.py times every backend of a case in several such rounds, interleaved (Note [interleaved rounds]
there), and `summarize` pools the rounds' repetitions.

Note [sustained clocks]: the H200 we measure on runs at 1980 MHz when work starts after an idle moment, and its
power limit (700 W) pulls the SM clock to 1665-1680 MHz within about 100 ms of heavy tensor work (nvidia-smi
every 20 ms beside a back-to-back d128 forward at S=4k: 0.84-0.86 ms a call for the first ~80 ms, then 0.955 ms,
reason "SW power cap"). do_bench's 25 ms warm-up left a round's repetitions partly in the boost window and
partly past it: two modes of one kernel's time (the same kernel at 0.477 or 0.51 ms),
and a case timed after an idle gap (inputs, reference checks) looked faster than one timed after another case.
Heated first, every round measures the sustained clock, which is what a training or serving run sees.

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

CPU_REPS = 3
HEAT_MS = 250  # back-to-back warm-up before each GPU round: past the boost window (Note [sustained clocks])


@dataclass(frozen=True)
class Timing:
    ms: float  # median
    p20: float
    p80: float
    timer: str = "events"  # "events", "cuda graph", "eager (graph capture failed)" or "cpu"


def sample(run, leaves, device: torch.device, rep_ms: int = 100, graph: bool = False) -> tuple[list[float], str]:
    """One round: the time of each repetition (ms) and the timer that took them."""
    # The leaves' gradients from an earlier round would accumulate into the first call of this one (nested
    # tensors, SDPA's varlen layout, cannot accumulate at all): every round starts from none.
    for t in leaves:
        t.grad = None
    if device.type == "cuda":
        import triton.testing

        if graph:
            # do_bench_cudagraph runs on a fresh side stream that does not wait for the default one: let the
            # inputs (and cache lengths) made there land first, or the first call reads unwritten memory.
            torch.cuda.synchronize()
            try:
                return list(triton.testing.do_bench_cudagraph(run, rep=rep_ms, return_mode="all")), "cuda graph"
            except Exception:  # noqa: BLE001  (not capturable: time it eagerly and say so)
                torch.cuda.synchronize()
        times = triton.testing.do_bench(run, warmup=max(HEAT_MS, rep_ms // 4), rep=rep_ms, grad_to_none=list(leaves),
                                        return_mode="all")
        return list(times), "eager (graph capture failed)" if graph else "events"
    run()  # warm-up: the interpreter and torch's first-call costs
    times = []
    for _ in range(CPU_REPS):
        for t in leaves:
            t.grad = None
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return times, "cpu"


def summarize(times: list[float], timer: str) -> Timing:
    """Median and 20th/80th percentiles (linear interpolation, as do_bench computes them) of pooled repetitions."""
    if len(times) == 1:
        return Timing(times[0], times[0], times[0], timer)
    cuts = statistics.quantiles(times, n=5, method="inclusive")  # 20th, 40th, 60th, 80th percentiles
    return Timing(statistics.median(times), cuts[0], cuts[3], timer)


def measure(run, leaves, device: torch.device, rep_ms: int = 100, graph: bool = False) -> Timing:
    """One call timed in one round."""
    return summarize(*sample(run, leaves, device, rep_ms, graph))
