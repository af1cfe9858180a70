"""GPU time of each kernel in one forward+backward, flashtile beside FlexAttention (torch.profiler), or with
--dropout P flashtile at p = 0 beside p = P (which kernel the dropout mask costs in).

For a kernel-bound comparison where the ratio alone does not say which kernel is behind: prints, per backend, the
device time of every kernel a `.backward()` of one attention call launches, averaged over the repetitions, and the
total. The standard sweep's shapes: B·S = 16k tokens, d128 with 16 heads (or d64 with 32), bf16, random inputs.
docs/perf.md quotes what it printed on the H200.

Usage (GPU): PYTHONPATH=src python3 tools/kernel_times.py [--seqlens 1024,4096] [--head-dim 128] [--causal]
            [--dropout 0.1]
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import flashtile
from flashtile.bench.backends import _compiled_flex


def profile_step(step, reps: int) -> list[tuple[str, float]]:
    """(kernel name, µs per call) for the kernels one step() launches, longest first, after a warm-up."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / reps) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def kernel_us(fn, q, k, v, dout, reps: int) -> list[tuple[str, float]]:
    """(kernel name, µs per call) for the kernels one fn(q, k, v).backward(dout) launches, longest first."""
    def step():
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(dout)

    return profile_step(step, reps)


def compare(s: int, d: int, causal: bool, reps: int, dropout: float) -> None:
    b, h = 16384 // s, 2048 // d
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    backends = [("flashtile", lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=causal), (q, k, v, dout))]
    if dropout:
        backends.append((f"flashtile p={dropout}", lambda q, k, v: flashtile.flash_attn_func(
            q, k, v, causal=causal, dropout_p=dropout), (q, k, v, dout)))
    else:
        from torch.nn.attention.flex_attention import create_block_mask
        flex = _compiled_flex()
        mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, s, s, device="cuda") if causal else None
        backends.append(("flex", lambda q, k, v: flex(q, k, v, block_mask=mask),
                         [t.transpose(1, 2).contiguous() for t in (q, k, v, dout)]))
    for name, fn, (qq, kk, vv, do) in backends:
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (qq, kk, vv))
        rows = kernel_us(fn, qq, kk, vv, do, reps)
        print(f"--- {name} d{d} S={s} causal={causal}: {sum(t for _, t in rows):.1f} µs per forward+backward")
        for key, t in rows[:8]:
            print(f"   {t:8.1f} µs  {key[:90]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", default="1024,4096")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--dropout", type=float, default=0.0, help="compare p = 0 with this dropout_p, not Flex")
    args = parser.parse_args()
    for s in (int(x) for x in args.seqlens.split(",")):
        compare(s, args.head_dim, args.causal, args.reps, args.dropout)


if __name__ == "__main__":
    main()
