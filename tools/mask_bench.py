"""What the dropout mask costs beside the product it masks: one program per 128 query rows loops over 128-key
tiles, computing S = Q Kᵀ (bf16, d128) and, in the second kernel, S ∘ keep_mask (Note [dropout mask] in
kernels/dropout.py) on the accumulator's own layout, as the forward does; a third times Philox alone on the same
counters, one call per 16 entries as the mask draws them. Prints G entries of S per second for each and the mask's
cost relative to the product; docs/perf.md (Dropout) points to it.

Usage (GPU): PYTHONPATH=src python3 tools/mask_bench.py [--tiles 64] [--warps 4,8]
"""

import argparse

import torch
import triton
import triton.language as tl

from flashtile.kernels.dropout import PHILOX_ROUNDS, keep_mask

THRESHOLD = tl.constexpr(26)  # p = 0.1: round(0.1 * 256)


@triton.jit
def _product(OUT, Q, K, seed, TILES: tl.constexpr, MASK: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    pid = tl.program_id(0)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + tl.arange(0, BLOCK_M)[:, None] * HEAD_DIM + d[None, :])
    kT = tl.load(K + d[:, None] + tl.arange(0, BLOCK_N)[None, :] * HEAD_DIM)
    i = (pid * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(TILES):
        s = tl.dot(q, kT)
        if MASK:
            s = tl.where(keep_mask(seed, 3, pid, i, t * BLOCK_N, THRESHOLD, BLOCK_M, BLOCK_N), s, 0.0)
        acc += s
    tl.store(OUT + pid, tl.sum(acc))


@triton.jit
def _philox(OUT, seed, TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    CALLS: tl.constexpr = BLOCK_N // 16  # sixteen 8-bit numbers a call (Note [dropout mask])
    i = (pid * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    zero = tl.zeros([BLOCK_M, CALLS], dtype=tl.int32)
    # Philox's words are uint32: the loop-carried sum must be too, or the loop changes its type.
    acc = tl.zeros([BLOCK_M, CALLS], dtype=tl.uint32)
    for t in range(TILES):
        calls = (t * CALLS + tl.arange(0, CALLS))[None, :] + zero
        r0, r1, r2, r3 = tl.philox(seed, calls, i + zero, pid + zero, 3 + zero, PHILOX_ROUNDS)
        acc += (r0 ^ r1 ^ r2 ^ r3) & 1
    tl.store(OUT + pid, tl.sum(acc).to(tl.float32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", type=int, default=64)
    parser.add_argument("--warps", default="4,8")
    args = parser.parse_args()
    programs = torch.cuda.get_device_properties(0).multi_processor_count * 8
    out = torch.empty(programs, device="cuda")
    q, k = (torch.randn(128, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    entries = programs * args.tiles * 128 * 128
    for warps in (int(w) for w in args.warps.split(",")):
        runs = {"QKᵀ": lambda: _product[(programs,)](out, q, k, 1234, args.tiles, False, 128, 128, 128,
                                                       num_warps=warps),
                "QKᵀ ∘ mask": lambda: _product[(programs,)](out, q, k, 1234, args.tiles, True, 128, 128, 128,
                                                             num_warps=warps),
                "Philox alone": lambda: _philox[(programs,)](out, 1234, args.tiles, 128, 128, num_warps=warps)}
        ms = {name: triton.testing.do_bench(run, warmup=50, rep=200) for name, run in runs.items()}
        for name, t in ms.items():
            print(f"{warps} warps  {name:14s} {entries / t / 1e6:8.1f} G entries/s  {t / ms['QKᵀ']:5.2f}x QKᵀ")


if __name__ == "__main__":
    main()
