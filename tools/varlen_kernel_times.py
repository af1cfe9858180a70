"""GPU time of each kernel of one flashtile forward+backward: dense 16 x 1k, the same tokens as a uniform varlen
batch (16 sequences of 1k: the dense batch's tiles, so any difference is the varlen machinery), and the benchmark's
16-sequence mix (bench/cases.VARLEN_MIX), causal and not. d128, 16 heads, bf16, random inputs.

Prints one JSON line per (batch, mask): µs per call of each kernel (kernel_times.profile_step: torch.profiler)
and a checksum (the fp32 sum of |out|, |dq|, |dk|, |dv|) that says whether two source trees compute the same bits.
Run it once per tree, each in its own process (PERF.md, v11, S11-3 … S11-5: the variant table):

    PYTHONPATH=<tree>/src python3 tools/varlen_kernel_times.py --tag <name> [--batches dense,uniform,mix] [--reps 20]
"""

import argparse
import json

import torch
from kernel_times import profile_step  # tools/ is on the path of a script run from it

import flashtile
from flashtile.bench.cases import VARLEN_MIX

HEADS, HEAD_DIM = 16, 128
LENGTHS = {"uniform": (1024,) * 16, "mix": VARLEN_MIX}


def make_step(batch: str, causal: bool):
    """A forward+backward of one attention call on fixed random inputs; returns (out, dq, dk, dv)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    if batch == "dense":
        shape, cu, longest = (16, 1024, HEADS, HEAD_DIM), None, 1024
    else:
        lengths = LENGTHS[batch]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        shape, longest = (int(cu[-1]), HEADS, HEAD_DIM), max(lengths)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)

    def step():
        if cu is None:
            out = flashtile.flash_attn_func(q, k, v, causal=causal)
        else:
            out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="", help="a name for the source tree, copied into every line")
    parser.add_argument("--batches", default="dense,uniform,mix")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    for batch in args.batches.split(","):
        for causal in (False, True):
            step = make_step(batch, causal)
            checksum = [round(float(t.float().abs().sum()), 3) for t in step()]
            print(json.dumps({"tag": args.tag, "batch": batch, "causal": causal,
                              "kernels_us": {name: round(us, 1) for name, us in profile_step(step, args.reps)},
                              "checksum": checksum}), flush=True)


if __name__ == "__main__":
    main()
