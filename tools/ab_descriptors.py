"""A/B of where the dense forward's TMA descriptors are built: on the host (one per tensor, a kernel parameter)
or on the device (one per program; ops/fwd.py, Note [host descriptors]), in one process on the same inputs.

Prints the forward's milliseconds (median, triton.testing.do_bench) per shape both ways, and writes JSON. (The
backward was measured the same way at commit c1783f4, when its kernels could take host descriptors too: PERF.md.)

Usage (GPU): PYTHONPATH=src python3 tools/ab_descriptors.py [--seqlens 512,1024,2048,4096] [--json PATH]
"""

import argparse
import itertools
import json

import torch
import triton

import flashtile
from flashtile.ops import fwd as fwd_ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="512,1024,2048,4096")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    print("shape                        device    host   (forward ms)")
    for d, s, causal in itertools.product(map(int, args.head_dims.split(",")), map(int, args.seqlens.split(",")),
                                          (False, True)):
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        times = {}
        for host in (False, True):
            fwd_ops.HOST_DESCRIPTORS = host
            times["host" if host else "device"] = triton.testing.do_bench(
                lambda: flashtile.flash_attn_func(q, k, v, causal=causal), warmup=25, rep=50)
        fwd_ops.HOST_DESCRIPTORS = True
        rows.append(dict(head_dim=d, seqlen=s, batch=b, heads=h, causal=causal, ms=times))
        label = f"b{b} s{s} h{h} d{d}{' causal' if causal else ''}"
        print(f"{label:27s} {times['device']:7.3f} {times['host']:7.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
