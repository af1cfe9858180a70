"""The read ceiling of a decode step's cache on this GPU: one kernel that reads every byte of a (batch, tokens, D)
bf16 cache once (and sums it), captured 20 launches to a CUDA graph as `flashtile bench` times decode, best of a
few tiles. What a decode kernel's TB/s (each cache byte counted once) can be set against: at few bytes a step the
launch and the last wave's tail take a share no attention kernel avoids (docs/perf.md, absorbed MLA decode).

Usage (GPU): PYTHONPATH=src python3 tools/read_ceiling.py [--head-dim 576] [--json PATH]
"""

import argparse
import json

import torch
import triton
import triton.language as tl

TILES = ((4096, 4, 8), (8192, 2, 8), (2048, 8, 4), (4096, 8, 8))  # (elements a load, loads a program, warps)


@triton.jit
def _read_kernel(X, OUT, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    base = pid.to(tl.int64) * BLOCK * ITERS
    for it in range(ITERS):
        offs = base + it * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(OUT + pid, tl.sum(acc))


def read_tbs(x: torch.Tensor) -> float:
    """The best TB/s over TILES of reading x once, per launch of a 20-launch CUDA graph."""
    n, best = x.numel(), 0.0
    for block, iters, warps in TILES:
        grid = triton.cdiv(n, block * iters)
        out = torch.empty(grid, device=x.device)

        def step():
            _read_kernel[(grid,)](x, out, n, block, iters, num_warps=warps)
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                step()
        graph.replay()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(graph.replay, warmup=20, rep=200) / 20
        best = max(best, n * x.element_size() / ms / 1e9)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=576, help="cache row width (absorbed MLA: 576)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows = []
    for batch in (16, 32, 64):
        for tokens in (4096, 8192, 16384, 32768):
            x = torch.randn(batch * tokens * args.head_dim, device="cuda", dtype=torch.bfloat16)
            tbs = read_tbs(x)
            rows.append(dict(batch=batch, tokens=tokens, head_dim=args.head_dim, mbytes=x.numel() * 2 / 1e6,
                             tbps=tbs, gpu=torch.cuda.get_device_name()))
            print(f"b{batch} x {tokens}: {x.numel() * 2 / 1e6:.1f} MB read at {tbs:.2f} TB/s", flush=True)
            del x
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
