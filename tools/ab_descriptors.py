"""A/B of where the dense forward's TMA descriptors are built: on the host (one per tensor, a kernel parameter)
or on the device (one per program; ops/fwd.py, Note [host descriptors]), in one process on the same inputs.

Prints the forward's milliseconds (median, triton.testing.do_bench) per shape both ways, and writes JSON.

With --backward: forward+backward milliseconds under each backward setting (ops/bwd.py HOST_DESCRIPTORS, and the
dQ kernel's num_stages where it takes host descriptors, since its table config does not compile that way).

Usage (GPU): PYTHONPATH=src python3 tools/ab_descriptors.py [--seqlens 512,1024,2048,4096] [--backward] [--json PATH]
"""

import argparse
import dataclasses
import itertools
import json

import torch
import triton

import flashtile
from flashtile import config
from flashtile.ops import bwd as bwd_ops
from flashtile.ops import fwd as fwd_ops

# name -> (dK/dV host, dQ host, dQ num_stages or None for the table's)
BACKWARD_SETTINGS = {"device": (False, False, None), "dkdv-host": (True, False, None),
                     "both-host-s1": (True, True, 1), "both-host-s3": (True, True, 3)}


def backward_ab(args):
    rows = []
    print("shape                        " + " ".join(f"{n:>13s}" for n in BACKWARD_SETTINGS) + "  (fwd+bwd ms)")
    for d, s, causal in itertools.product(map(int, args.head_dims.split(",")), map(int, args.seqlens.split(",")),
                                          (False, True)):
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        base = config.TABLE["bwd_dq"][d]
        times = {}
        for name, (dkdv, dq, stages) in BACKWARD_SETTINGS.items():
            bwd_ops.HOST_DESCRIPTORS = {"bwd_dkdv": dkdv, "bwd_dq": dq}
            config.TABLE["bwd_dq"][d] = dataclasses.replace(base, num_stages=stages or base.num_stages)

            def step():
                flashtile.flash_attn_func(q, k, v, causal=causal).backward(dout)
            try:
                times[name] = triton.testing.do_bench(step, warmup=25, rep=60, grad_to_none=[q, k, v])
            except Exception as e:  # noqa: BLE001  (a setting that does not compile is a result)
                print(f"  {name}: {type(e).__name__}: {str(e)[:100]}")
                times[name] = float("nan")
        config.TABLE["bwd_dq"][d] = base
        bwd_ops.HOST_DESCRIPTORS = {"bwd_dkdv": True, "bwd_dq": False}
        rows.append(dict(head_dim=d, seqlen=s, batch=b, heads=h, causal=causal, ms=times))
        label = f"b{b} s{s} h{h} d{d}{' causal' if causal else ''}"
        print(f"{label:27s} " + " ".join(f"{times[n]:13.3f}" for n in BACKWARD_SETTINGS), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="512,1024,2048,4096")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.backward:
        rows = backward_ab(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                               settings=BACKWARD_SETTINGS, rows=rows), f, indent=1)
        return
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
