"""Forward-only GPU time of flashtile's d128 forward on dense and varlen batches (16 heads, bf16, 16k tokens), for
A/B runs of source trees: each case's call is captured 10 times in a CUDA graph (no host time between kernels),
replayed back to back for 300 ms (the sustained clock: bench/timing.py, Note [sustained clocks]), then timed over
10 replays between CUDA events. Each line also carries a checksum of out and LSE, to say whether two trees compute
the same bits. Run once per tree, alternating (PERF.md, v14, S14-4 and S14-5):

    PYTHONPATH=<tree>/src python3 tools/fwd_graph_times.py TAG [dense1k,dense4k,uniform1k,uniform4k,mix]

Appends one JSON line per (case, mask) to $OUT/fwd-ab.jsonl (or ./fwd-ab.jsonl) and prints it."""
import json
import os
import sys
import time

import torch

import flashtile
from flashtile.bench.cases import VARLEN_MIX

H, D = 16, 128
tag = sys.argv[1]
cases = sys.argv[2].split(",") if len(sys.argv) > 2 else ["dense1k", "dense4k", "uniform1k", "uniform4k", "mix"]


def case(name):
    g = torch.Generator(device="cuda").manual_seed(0)
    if name.startswith("dense"):
        b, s = {"dense1k": (16, 1024), "dense2k": (8, 2048), "dense4k": (4, 4096)}[name]
        q, k, v = (torch.randn(b, s, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        return lambda causal: flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)[:2]
    lengths = {"mix": VARLEN_MIX, "uniform1k": (1024,) * 16, "uniform4k": (4096,) * 4}[name]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(int(cu[-1]), H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    m = max(lengths)
    return lambda causal: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=causal,
                                                          return_attn_probs=True)[:2]


for name in cases:
    f = case(name)
    for causal in (False, True):
        out, lse = f(causal)
        check = [round(float(out.float().abs().sum()), 2), round(float(lse.float().sum()), 2),
                 bool(torch.isfinite(out).all())]
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            f(causal)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(10):
                    f(causal)
        torch.cuda.synchronize()
        t = time.perf_counter()
        while time.perf_counter() - t < 0.3:
            graph.replay()
            torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            graph.replay()
        e1.record()
        torch.cuda.synchronize()
        row = {"tag": tag, "case": name, "causal": causal, "fwd_us": round(e0.elapsed_time(e1) * 10, 1),
               "check": check}
        print(json.dumps(row), flush=True)
        with open(os.path.join(os.environ.get("OUT", "."), "fwd-ab.jsonl"), "a") as fh:
            fh.write(json.dumps(row) + "\n")
