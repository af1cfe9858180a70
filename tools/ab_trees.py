"""Timings of one source tree, for an A/B of two trees in alternating processes (tools/ab_trees.sh).

A kernel change is judged against the tree it replaces on the same GPU in the same device call, each tree in its
own process (its own compiled kernels and launch cache), in alternating order, because run-to-run spread on the
H200 (2-3%) is the size of the effects being measured. Which tree is imported is PYTHONPATH's business.

Prints one JSON line per case: bf16, hidden 2048 (d128: H=16; --head-dim 64: H=32), B·S = 16k at S = 1k / 4k /
16k and the varlen preset's mix (bench/cases.VARLEN_MIX), causal and not; with --only uniform, varlen batches of
16 x 1k and 4 x 4k tokens beside the dense batches of the same shapes (the same tiles: what the varlen machinery
alone costs); with --only decode, one-token decode steps over 8 x 32k caches (GQA 32/8, d128), contiguous and in
16-token pages (TB/s of K/V read); with --only mla, absorbed MLA decode steps (16 query heads on one latent head,
q/k 576 over a v_cache view of its first 512 channels, contiguous: TB/s of cache, each byte once) at batch 16 x
4k / 8k / 32k, 32 x 4k and 64 x 4k / 32k; forward, or forward+backward with --fwdbwd. Each line carries the kernel paths
that ran and a checksum of the output (of dq, dk and dv with --fwdbwd), which two trees that compute the same thing
must agree on to within rounding. With --host, each case times the host instead: milliseconds of Python per call
(the least of five bursts of 100 calls, queued behind a sleep kernel so that no call waits for the GPU), on
--only small by default (short dense and varlen batches and a decode step, where host time is what a user
waits for); "tflops" is then calls per millisecond. Only the public API is used, so any older tree can be timed.

Usage (GPU): PYTHONPATH=<tree>/src python3 tools/ab_trees.py LABEL [--fwdbwd] [--only dense,varlen,uniform,decode,mla]
             [--window LEFT,RIGHT] [--head-dim 64] [--host] [--dropout P]
"""

import argparse
import json
import time

import torch
from triton.testing import do_bench, do_bench_cudagraph

import flashtile

# The varlen preset's mix (bench/cases.py), repeated here so that an older tree without it can be timed too.
MIX = (1024, 4096, 300, 2048, 512, 1500, 256, 777, 2200, 384, 640, 256, 1111, 333, 400, 547)
MIXES = {"mix": MIX, "uni1k": (1024,) * 16, "uni4k": (4096,) * 4, "short": (128, 37, 256, 1)}
HIDDEN = 2048
HEAD_DIM = 128


def cases(only: str):
    dense = [(b, s, causal) for b, s in ((16, 1024), (4, 4096), (1, 16384)) for causal in (False, True)]
    varlen = [("mix", 0, causal) for causal in (False, True)]
    uniform = [(b, s, causal) for pair in ((16, 1024), ("uni1k", 0), (4, 4096), ("uni4k", 0)) for b, s in [pair]
               for causal in (False, True)]
    decode = [("decode", 0, False), ("decode_paged", 0, False)]
    small = [(2, 256, True), ("short", 0, True), ("decode_paged", 0, False)]
    mla = [(f"mla{b}", s, False) for b, s in ((16, 4096), (16, 8192), (16, 32768), (32, 4096), (64, 4096),
                                             (64, 32768))]
    groups = {"dense": dense, "varlen": varlen, "uniform": uniform, "decode": decode, "small": small, "mla": mla}
    return [c for name in only.split(",") for c in groups[name]] if only else dense + varlen


def decode_problem(paged: bool, gen):
    """(call, leaves, bytes of K/V read): one query token of 8 sequences over their 32k-token caches."""
    batch, cap, heads, heads_kv, d = 8, 32768, 32, 8, 128
    q = torch.randn(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache, v_cache = (torch.randn(batch * cap // 16 if paged else batch, 16 if paged else cap, heads_kv, d,
                                    device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    table = (torch.randperm(batch * cap // 16, device="cuda", generator=gen).int().reshape(batch, -1) if paged
             else None)
    seqlens = torch.full((batch,), cap, dtype=torch.int32, device="cuda")

    def call(q, k_cache, v_cache):
        return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
    return call, (q, k_cache, v_cache), 2 * batch * cap * heads_kv * d * 2


def mla_problem(batch: int, cap: int, gen):
    """(call, leaves, bytes of cache read): one query token of 16 heads over an absorbed MLA cache (DeepSeek's
    576 / 512 channels on one latent head; v_cache a view of k_cache)."""
    q = torch.randn(batch, 1, 16, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache = torch.randn(batch, cap, 1, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.full((batch,), cap, dtype=torch.int32, device="cuda")

    def call(q, k_cache):
        return flashtile.flash_attn_with_kvcache(q, k_cache, k_cache[..., :512], cache_seqlens=seqlens)
    return call, (q, k_cache), batch * cap * 576 * 2


def is_decode(b) -> bool:
    return b in ("decode", "decode_paged") or str(b).startswith("mla")


def problem(b, s, causal: bool, gen, window=(-1, -1), dropout_p=0.0):
    """(call, leaves, flops of the forward): the call runs the forward on fresh leaves each time. Under a sliding
    window the flops are still the full (or causal) mask's: nominal, for comparing two trees only."""
    if b in ("decode", "decode_paged"):
        return decode_problem(b == "decode_paged", gen)
    if str(b).startswith("mla"):
        return mla_problem(int(b[3:]), s, gen)
    HEADS = HIDDEN // HEAD_DIM
    varlen = b in MIXES
    if varlen:
        lens = MIXES[b]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        shape = (int(cu[-1]), HEADS, HEAD_DIM)
        flops = sum(4 * HEADS * n * n * HEAD_DIM for n in lens)
    else:
        shape = (b, s, HEADS, HEAD_DIM)
        flops = 4 * b * HEADS * s * s * HEAD_DIM
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    if varlen:
        def call(q, k, v):
            return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal,
                                                    window_size=window, dropout_p=dropout_p)
    else:
        def call(q, k, v):
            return flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window, dropout_p=dropout_p)
    return call, (q, k, v), flops * (0.5 if causal else 1.0)


def host_ms(fn, n=100, bursts=5) -> float:
    """Least over `bursts` of the host milliseconds per call of fn, each burst queued behind ~1 s of GPU sleep."""
    best = float("inf")
    for _ in range(bursts):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))
        fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e3)
        torch.cuda.synchronize()
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("label")
    parser.add_argument("--fwdbwd", action="store_true", help="time forward + backward (FLOPs: 3.5x forward)")
    parser.add_argument("--only", default=None,
                        help="comma-separated groups: dense, varlen, uniform, decode, small, mla")
    parser.add_argument("--window", default="-1,-1", help="window_size as LEFT,RIGHT (nominal FLOPs)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim (heads: 2048 / head dim)")
    parser.add_argument("--host", action="store_true", help="time the host per call (default --only small)")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout_p (the mask's seeds: torch.manual_seed(0))")
    args = parser.parse_args()
    if args.host and args.only is None:
        args.only = "small"
    global HEAD_DIM
    HEAD_DIM = args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    torch.manual_seed(0)  # the same dropout masks in both trees: each draws its seeds in the same order
    for b, s, causal in cases(args.only):
        call, leaves, flops = problem(b, s, causal, gen, tuple(int(x) for x in args.window.split(",")),
                                      args.dropout)
        decode = is_decode(b)
        if args.fwdbwd and not decode:
            leaves = [t.requires_grad_() for t in leaves]
            dout = torch.randn(leaves[0].shape, device="cuda", dtype=leaves[0].dtype, generator=gen)

            def fn():
                return torch.autograd.grad(call(*leaves), leaves, dout)
            checked = torch.cat([g.flatten() for g in fn()])
            flops *= 3.5
        else:
            def fn():
                return call(*leaves)
            checked = fn()
        if args.host:
            ms = host_ms(fn)
            flops = 1e9  # "tflops" = calls per ms
        elif decode:  # as serving stacks run it, and as `flashtile bench` times it: replays of a CUDA graph
            torch.cuda.synchronize()  # do_bench_cudagraph runs on a side stream that does not wait for this one
            ms = do_bench_cudagraph(fn, rep=400, return_mode="median")
        else:
            ms = do_bench(fn, warmup=50, rep=400, return_mode="median")
        # decode: "tflops" is K/V bytes / time in TB/s
        print(json.dumps(dict(label=args.label, case=f"{b} s{s} d{HEAD_DIM}", causal=causal,
                              fwdbwd=args.fwdbwd and not decode, ms=ms, tflops=flops / ms / 1e9,
                              paths=flashtile.last_kernel_paths(), checksum=checked.float().abs().sum().item())),
              flush=True)


if __name__ == "__main__":
    main()
