"""A/B of where dense batches' TMA descriptors are built: on the host (one per tensor, a kernel parameter) or on
the device (one per program and tile; ops/fwd.py, Note [host descriptors]), for the forward and the backward
separately, in one process on the same inputs.

Prints milliseconds (median, triton.testing.do_bench) per shape for the forward, and for forward+backward with
each combination of (forward, backward) descriptor placement; writes JSON.

Usage (GPU): PYTHONPATH=src python3 tools/ab_descriptors.py [--seqlens 512,1024,2048,4096] [--json PATH]
"""

import argparse
import itertools
import json

import torch
import triton

import flashtile
from flashtile.ops import bwd as bwd_ops
from flashtile.ops import fwd as fwd_ops

VARIANTS = {"dev/dev": (False, False), "host/dev": (True, False), "dev/host": (False, True), "host/host": (True, True)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="512,1024,2048,4096")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    print("shape                       fwd dev  fwd host | fwdbwd " + "  ".join(f"{v:>9s}" for v in VARIANTS))
    for d, s, causal in itertools.product(map(int, args.head_dims.split(",")), map(int, args.seqlens.split(",")),
                                          (False, True)):
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)

        def fwd():
            with torch.no_grad():
                flashtile.flash_attn_func(q, k, v, causal=causal)

        def fwdbwd():
            flashtile.flash_attn_func(q, k, v, causal=causal).backward(dout)
            q.grad = k.grad = v.grad = None

        times = {}
        for name, (host_fwd, host_bwd) in VARIANTS.items():
            fwd_ops.HOST_DESCRIPTORS, bwd_ops.HOST_DESCRIPTORS = host_fwd, host_bwd
            if host_bwd == host_fwd:
                times[f"fwd {name.split('/')[0]}"] = triton.testing.do_bench(fwd, warmup=25, rep=50)
            times[f"fwdbwd {name}"] = triton.testing.do_bench(fwdbwd, warmup=25, rep=50)
        fwd_ops.HOST_DESCRIPTORS = bwd_ops.HOST_DESCRIPTORS = True
        rows.append(dict(head_dim=d, seqlen=s, batch=b, heads=h, causal=causal, ms=times))
        label = f"b{b} s{s} h{h} d{d}{' causal' if causal else ''}"
        print(f"{label:27s} {times['fwd dev']:7.3f}  {times['fwd host']:8.3f} |        "
              + "  ".join(f"{times['fwdbwd ' + v]:9.3f}" for v in VARIANTS), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
