"""Peak device memory of one forward+backward at long sequence lengths (issue: B=1, H=16, D=128, S=128k).

Usage (GPU): PYTHONPATH=src python3 tools/peak_memory.py [--seqlens 32768,65536,131072]
Prints, per length, the peak memory allocated beyond the inputs (q, k, v, dout) and how it compares with the
outputs and gradients it must hold (out, dq, dk, dv in bf16, lse and delta in fp32): a linear-in-S extra.
"""

import argparse

import torch

import flashtile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="32768,65536,131072")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    print("seqlen   peak beyond inputs (MiB)   out+grads+lse+delta (MiB)   ratio")
    for s in map(int, args.seqlens.split(",")):
        q, k, v = (torch.randn(1, s, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = flashtile.flash_attn_func(q, k, v, causal=args.causal)
        out.backward(dout)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        needed = 4 * q.numel() * q.element_size() + 2 * s * 16 * 4
        print(f"{s:7d}  {extra / 2**20:24.1f}  {needed / 2**20:26.1f}  {extra / needed:6.3f}")
        del q, k, v, dout, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
