"""Time every candidate tile config of each prefill kernel on the GPU and print the best per head dim.
The backward kernels are scored on the whole backward (dQ with delta, then dK/dV), so tune dK/dV first, then dQ.

Usage (GPU machine): PYTHONPATH=src python3 tools/tune_tiles.py [--json PATH] [--seqlen 4096]
           [--head-dims 192 --head-dim-v 128 --heads 16] [--dropout 0.1 --kernels bwd_dkdv]
Feeds config.TABLE by hand (with --head-dim-v narrower than the head dim, config.NARROW_V: MLA prefill's 192/128;
with --dropout, config.DROPOUT, the tiles of the kernels that draw the mask): each entry there names the run it
came from. Shapes follow the standard sweep (B*S = 16k tokens, hidden 2048
unless --heads), bf16, causal and not; the score is the geometric mean of TFLOPs over both, FLOPs
2·B·H·S²·(d + d_v) for the forward (halved causal), 2.5x that for the backward.
"""

import argparse
import json
import math
import os

# The launch cache keys a launch by its problem, not its tile (Note [launch cache] in ops/launch.py): with it, every
# config after the first would run the first one's compiled kernel. Launching through Triton, each config compiles
# and runs its own.
os.environ["FLASHTILE_FAST_LAUNCH"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

from flashtile import config  # noqa: E402
from flashtile.ops.bwd import attention_bwd  # noqa: E402
from flashtile.ops.dropout import draw_rng  # noqa: E402
from flashtile.ops.fwd import attention_fwd  # noqa: E402
from flashtile.testing import op_args  # noqa: E402


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--head-dim-v", type=int, help="v's head dim (default: each head dim's own)")
    ap.add_argument("--heads", type=int, help="query heads (default: 2048 // head dim)")
    ap.add_argument("--kernels", default="fwd,bwd_dkdv,bwd_dq")
    ap.add_argument("--dropout", type=float, default=0.0, help="dropout_p: tune config.DROPOUT's tiles")
    args = ap.parse_args()
    rows = []
    for d in map(int, args.head_dims.split(",")):
        dv = args.head_dim_v or d
        s, h = args.seqlen, args.heads or 2048 // d
        b = max(1, 16384 // s)
        q, k = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v, do = (torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        flops = 2 * b * h * s * s * (d + dv)
        # The entry a call of these head dims reads (config.table_config): NARROW_V's where v is narrower, DROPOUT's
        # with dropout.
        narrow = config.block_d(dv) < config.block_d(max(d, dv))
        entry = (config.block_d(d), config.block_d(dv)) if narrow else config.block_d(max(d, dv))
        tables = config.NARROW_V if narrow else config.TABLE
        if args.dropout:  # table_config takes DROPOUT's tile before any other (not fp32)
            tables, entry = config.DROPOUT, config.block_d(max(d, dv))
        rng = draw_rng(q.device) if args.dropout else None
        for kernel in args.kernels.split(","):
            table = tables.setdefault(kernel, {})
            best = None
            for cfg in config.CANDIDATES[kernel]:
                table[entry] = cfg
                tf = []
                try:
                    for causal in (False, True):
                        wr = 0 if causal else -1
                        f = flops / (2 if causal else 1)
                        scalars = dict(max_seqlen_q=s, max_seqlen_k=s, softmax_scale=d ** -0.5, window_right=wr,
                                       rng=rng, dropout_p=args.dropout)
                        fwd_args = op_args(attention_fwd, q=q, k=k, v=v, **scalars)
                        out, lse = attention_fwd(*fwd_args)
                        if kernel == "fwd":
                            ms = bench(lambda: attention_fwd(*fwd_args))
                            tf.append(f / ms * 1e-9)
                        else:
                            bwd_args = op_args(attention_bwd, dout=do, q=q, k=k, v=v, out=out, lse=lse, **scalars)
                            ms = bench(lambda: attention_bwd(*bwd_args))
                            tf.append(2.5 * f / ms * 1e-9)
                except Exception as e:  # a config that does not fit (shared memory, registers) is skipped
                    print(f"{kernel} d{d} {cfg}: failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                score = math.sqrt(tf[0] * tf[1])
                rows.append({"kernel": kernel, "head_dim": d, "head_dim_v": dv, "seqlen": s, "dropout_p": args.dropout,
                             "config": [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages],
                             "tflops_noncausal": tf[0], "tflops_causal": tf[1]})
                print(f"{kernel:9s} d{d:<3d} {cfg.block_m:3d}x{cfg.block_n:<3d} w{cfg.num_warps} s{cfg.num_stages}"
                      f"  {tf[0]:6.1f} / {tf[1]:6.1f} TFLOPs (non-causal / causal)", flush=True)
                if best is None or score > best[0]:
                    best = (score, cfg)
            table[entry] = best[1]  # so that dQ is tuned beside the best dK/dV
            print(f"BEST {kernel} d{d}: {best[1]} ({best[0]:.1f} TFLOPs geo-mean)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
