"""The SM clock beside a forward run back to back after an idle second: what a timing round sees of the GPU's boost
and power limit (Note [sustained clocks] in flashtile/bench/timing.py; PERF.md, v13).

nvidia-smi samples the clock, the power draw and the clock-event reasons every 20 ms while one flashtile forward
(d128 bf16, 16 heads, B x S, causal or not) runs `--calls` times back to back, each call between two CUDA events.
Prints, for every 150 calls, when they ran (ms from the first call, on the GPU's timeline), their median and fastest
time and the nearest sample; writes every call's time and every sample to --json.

    PYTHONPATH=src python3 tools/sustained_clocks.py [--batch 4 --seqlen 4096] [--causal] [--json out.json]
"""

import argparse
import json
import subprocess
import time
from datetime import datetime

import torch

import flashtile

QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(args.batch, args.seqlen, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    for _ in range(5):  # compiled and cached before the idle second
        flashtile.flash_attn_func(q, k, v, causal=args.causal)
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader", "-lms", "20"],
                           stdout=subprocess.PIPE, text=True)
    torch.cuda.synchronize()
    time.sleep(1.0)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(args.calls + 1)]
    host_start = time.time()  # when events[0] is recorded, to within a launch's latency
    events[0].record()
    for i in range(args.calls):
        flashtile.flash_attn_func(q, k, v, causal=args.causal)
        events[i + 1].record()
    torch.cuda.synchronize()
    time.sleep(0.1)
    smi.terminate()
    samples = []
    for line in smi.communicate()[0].splitlines():
        stamp, clock, power, temp, reasons = (f.strip() for f in line.split(","))
        t = datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp() - host_start
        samples.append(dict(t_ms=round(t * 1e3, 1), sm_mhz=int(clock.split()[0]), watts=float(power.split()[0]),
                            celsius=int(temp), reasons=reasons))
    at = [events[0].elapsed_time(e) for e in events[1:]]
    dt = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
    print(f"{'t ms':>8}  {'median ms':>9}  {'min ms':>7}  {'SM MHz':>6}  {'W':>5}  reasons")
    for first in range(0, args.calls, 150):
        chunk = sorted(dt[first:first + 150])
        near = min(samples, key=lambda s: abs(s["t_ms"] - at[first]), default=None)
        clock = f"{near['sm_mhz']:6d}  {near['watts']:5.0f}  {near['reasons']}" if near else ""
        print(f"{at[first]:8.1f}  {chunk[len(chunk) // 2]:9.3f}  {chunk[0]:7.3f}  {clock}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), call_ms=dt, call_end_ms=at, smi=samples), f)


if __name__ == "__main__":
    main()
