"""What a user's first call waits for on a GPU host: each scenario runs in a fresh Python process, once with an
empty Triton cache (cold: Triton compiles, ptxas, the driver loads the module) and once with the cache the cold
run left (warm: a cache hit and the module load), and prints the wall time of the first call, of the first
backward where there is one, and of a second call (the steady state, for scale). Import time is reported apart.
docs/perf.md quotes it beside tests/sm90_compile.py's compile-only times from a host without a GPU.

Usage (GPU): PYTHONPATH=src python3 tools/first_call.py [--json out.json]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SCENARIOS = {
    "dense-d128-causal": "flash_attn_func(q, k, v, causal=True)",
    "dense-d64": "flash_attn_func(q[..., :64].contiguous(), k[..., :64].contiguous(), v[..., :64].contiguous())",
    "varlen-d128": "flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 1024, 1024, causal=True)",
    "decode-d128": "flash_attn_with_kvcache(q[:, :1].detach(), k.detach(), v.detach(), cache_seqlens=lens)",
    "dropout-d128": "flash_attn_func(q, k, v, dropout_p=0.1)",
}

_CHILD = """
import time, json, sys
t0 = time.perf_counter()
import torch
from flashtile import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
t_import = time.perf_counter() - t0
torch.manual_seed(0)
q, k, v = (torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
cu = torch.tensor([0, 1024, 2048], device="cuda", dtype=torch.int32)
lens = torch.full((2,), 1000, device="cuda", dtype=torch.int32)
torch.cuda.synchronize()
def timed(fn):
    t = time.perf_counter(); r = fn(); torch.cuda.synchronize(); return r, time.perf_counter() - t
out = {"import_s": t_import}
o, out["first_s"] = timed(lambda: EXPR)
if o.requires_grad:
    _, out["first_backward_s"] = timed(lambda: o.float().sum().backward())
o, out["second_s"] = timed(lambda: EXPR)
if o.requires_grad:
    _, out["second_backward_s"] = timed(lambda: o.float().sum().backward())
print(json.dumps(out))
"""


def _run(expr: str, cache: str) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _CHILD.replace("EXPR", expr)], env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    args = parser.parse_args(argv)
    rows = []
    for name in args.only.split(","):
        with tempfile.TemporaryDirectory() as cache:
            for state in ("cold", "warm"):
                t = time.perf_counter()
                r = _run(SCENARIOS[name], cache)
                r.update(scenario=name, cache=state, process_s=time.perf_counter() - t)
                rows.append(r)
    print(f"{'scenario':<20} {'cache':<5} {'import':>7} {'first':>7} {'1st bwd':>7} {'second':>7} {'2nd bwd':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['scenario']:<20} {r['cache']:<5} error: {r['error'][:80]}")
            continue
        cols = [r.get(k) for k in ("import_s", "first_s", "first_backward_s", "second_s", "second_backward_s")]
        print(f"{r['scenario']:<20} {r['cache']:<5} " + " ".join(f"{c:7.3f}" if c is not None else f"{'-':>7}"
                                                             for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
