"""The backward with and without the delta handoff's programmatic dependent launch (Note [delta handoff] in
kernels/bwd.py): do_bench medians of the backward implementation alone, in alternating rounds, and whether the
gradients are bitwise equal both ways (they must be). PERF.md, session 6, has what it printed on the H200 (S6-8).

Usage (GPU): PYTHONPATH=src python3 tools/ab_pdl.py
"""

import os

import torch
from triton.testing import do_bench

from flashtile.ops.bwd import attention_bwd
from flashtile.ops.fwd import attention_fwd

SHAPES = [(128, 1024, False), (128, 1024, True), (128, 4096, False), (128, 16384, False), (64, 1024, False),
          (64, 4096, True)]


def ab(d: int, s: int, causal: bool) -> None:
    b, h = 16384 // s, 2048 // d
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    args = (s, s, d ** -0.5, -1, 0 if causal else -1, 0.0, 0)
    out, lse = attention_fwd.impl(q, k, v, None, None, None, None, None, None, *args)

    def bwd():
        return attention_bwd.impl(dout, q, k, v, out, lse, None, None, None, None, None, *args)

    grads, times = {}, {"1": [], "0": []}
    for r in range(4):
        for pdl in ("1", "0") if r % 2 == 0 else ("0", "1"):
            os.environ["FLASHTILE_PDL"] = pdl  # read on every call (env.pdl)
            now = bwd()
            assert all(torch.equal(a, b) for a, b in zip(grads.setdefault(pdl, now), now)), "not reproducible"
            times[pdl].append(do_bench(bwd, rep=150))
    os.environ.pop("FLASHTILE_PDL")
    same = all(torch.equal(a, b) for a, b in zip(grads["1"], grads["0"]))
    t1, t0 = (sum(sorted(times[p])[1:3]) / 2 for p in ("1", "0"))  # the middle two of four rounds
    flops = 2.5 * 4 * b * h * s * s * d * (0.5 if causal else 1)
    print(f"d{d} S={s:5d} causal={causal!s:5s} backward with PDL {t1 * 1e3:7.1f} µs "
          f"({flops / t1 / 1e9:4.0f} TFLOP/s), without {t0 * 1e3:7.1f} µs ({flops / t0 / 1e9:4.0f}), "
          f"gain {100 * (t0 / t1 - 1):+.1f}%, bitwise equal {same}", flush=True)


if __name__ == "__main__":
    for shape in SHAPES:
        ab(*shape)
