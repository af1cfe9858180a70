"""Host time per call of this tree against another, both imported into ONE process, bursts alternating.

tools/ab_trees.py --host times each tree in its own process; on the H200 machine's shared host CPU the same code
read 96-258 µs per call from process to process (docs/perf.md, "Host time per call"), more than the differences
being looked for. Here the other tree's package is copied to a temporary directory under another name (`ftbase`,
its custom ops' namespace renamed with it, so both trees' `flashtile::fwd` can be registered), both are imported,
and bursts of calls alternate between them (base, this, this, base, ...), so that both see the same CPU state.

Each burst is queued behind a sleep kernel, so that no call waits for the GPU, and is timed in thread CPU time
(the host's work, without descheduling). Cases: a short dense forward (b2 x 256, h16, d128, causal), a four-
sequence varlen forward (422 tokens), and the dense forward+backward. Prints the least and the median of each
tree's bursts per case, µs per call; with --json, writes them.

Usage (GPU): PYTHONPATH=src python3 tools/host_ab.py BASE_TREE [--rounds 8] [--json PATH]
  BASE_TREE: a directory holding src/flashtile (for example `git archive <sha> src | tar -x -C DIR`).
"""

import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

BASE = "ftbase"


def import_base(tree: str):
    """The package at tree/src/flashtile, imported as BASE with its custom ops in the namespace BASE."""
    root = tempfile.mkdtemp(prefix="host_ab_")
    dst = os.path.join(root, BASE)
    shutil.copytree(os.path.join(tree, "src", "flashtile"), dst)
    for folder, _, files in os.walk(dst):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                text = open(path).read()
                if "flashtile::" in text:
                    open(path, "w").write(text.replace("flashtile::", f"{BASE}::"))
    sys.path.insert(0, root)
    return importlib.import_module(BASE)


def cases(m, torch):
    """name -> a call of module m's public API on fixed inputs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 256, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    cu = torch.tensor([0, 128, 165, 421, 422], device="cuda", dtype=torch.int32)
    qv, kv, vv = (torch.randn(422, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)
    return {
        "dense fwd": lambda: m.flash_attn_func(q, k, v, causal=True),
        "varlen fwd": lambda: m.flash_attn_varlen_func(qv, kv, vv, cu, cu, 256, 256, causal=True),
        "dense fwdbwd": lambda: torch.autograd.grad(m.flash_attn_func(*leaves, causal=True), leaves, dout),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("base", help="a tree holding src/flashtile, timed against the imported flashtile")
    parser.add_argument("--rounds", type=int, default=8, help="bursts per tree and case")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch
    import flashtile
    trees = {"base": cases(import_base(args.base), torch), "this": cases(flashtile, torch)}
    for calls in trees.values():
        for fn in calls.values():
            for _ in range(20):
                fn()
    torch.cuda.synchronize()
    rows = []
    for case in trees["this"]:
        n = 30 if "fwdbwd" in case else 100  # few enough launches that the queue never fills behind the sleep
        us = {"base": [], "this": []}
        for r in range(args.rounds):
            for label in ("base", "this") if r % 2 == 0 else ("this", "base"):
                fn = trees[label][case]
                torch.cuda.synchronize()
                torch.cuda._sleep(int(1e9))
                start = time.thread_time()
                for _ in range(n):
                    fn()
                us[label].append((time.thread_time() - start) / n * 1e6)
        torch.cuda.synchronize()
        row = {"case": case, **{f"{t}_{s.__name__}": round(s(us[t]), 1) for t in us for s in (min, statistics.median)}}
        rows.append(row)
        ratio = row["this_median"] / row["base_median"]
        print(f"{case:13s} µs/call  base min {row['base_min']:6.1f} median {row['base_median']:6.1f}   this min "
              f"{row['this_min']:6.1f} median {row['this_median']:6.1f}   this/base {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
