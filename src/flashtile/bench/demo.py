"""`flashtile demo`: one attention problem through flashtile, checked against the fp64 reference, then timed.

Random inputs go forward and backward through `flashtile.flash_attn_func`. The max abs errors of out, lse, dq,
dk and dv against `flashtile.testing.attention_ref` in fp64 are printed beside the errors of PyTorch doing the
same math in the input dtype, the yardstick of the tests' rule (within 2× of PyTorch's error for the output,
3× for the gradients, plus a rounding-sized atol). Then the forward and forward+backward times. On a GPU this
runs at a real size; without one, at a small size through the Triton interpreter, whose times say nothing
about a GPU.

What this module does not do: compare with other backends (that is `flashtile bench`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flashtile.bench.cases import DTYPES, Case
from flashtile.bench.metrics import timed_flops
from flashtile.bench.report import CPU_NOTE
from flashtile.bench.timing import measure

GPU_DEFAULTS = {"batch": 2, "seqlen": 2048, "heads": 16, "head_dim": 128, "dtype": "bf16", "causal": True}
CPU_DEFAULTS = {"batch": 1, "seqlen": 128, "heads": 2, "head_dim": 64, "dtype": "fp16", "causal": True}
FACTORS = {"out": 2, "lse": 2, "dq": 3, "dk": 3, "dv": 3}  # the tests' rule: times PyTorch's own error


def _forward_backward(fn, q, k, v, dout, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v, **kw)
    return (out, lse, *torch.autograd.grad(out, (q, k, v), dout.to(out.dtype)))


def demo(batch, seqlen, heads, head_dim, dtype, causal, device: torch.device, interpreted: bool) -> int:
    import flashtile
    from flashtile.testing import attention_ref, rounding_atol

    shape = (batch, seqlen, heads, head_dim)
    gen = torch.Generator(device).manual_seed(0)
    q, k, v, dout = (torch.randn(shape, generator=gen, device=device, dtype=DTYPES[dtype]) for _ in range(4))

    def flashtile_attn(q, k, v, causal):
        out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        return out, lse

    mask = "causal" if causal else "not causal"
    print(f"flashtile demo: batch {batch}, seqlen {seqlen}, heads {heads}, head dim {head_dim}, {dtype}, "
          f"{mask}")
    if interpreted:
        print(CPU_NOTE)
    ours = _forward_backward(flashtile_attn, q, k, v, dout, causal=causal)
    oracle = _forward_backward(attention_ref, q.double(), k.double(), v.double(), dout, causal=causal)
    pytorch = _forward_backward(attention_ref, q, k, v, dout, causal=causal, upcast=False)

    print("\nmax |error| against the fp64 reference:")
    print(f"{'':6}{'flashtile':>11}{f'PyTorch {dtype}':>16}  passes")
    passed = True
    for name, mine, ref, base in zip(FACTORS, ours, oracle, pytorch):
        err = (mine.double() - ref.double()).abs().max().item()
        base_err = (base.double() - ref.double()).abs().max().item()
        ok = err <= FACTORS[name] * base_err + rounding_atol(ref, q.dtype)
        passed &= ok
        print(f"{name:6}{err:>11.2e}{base_err:>16.2e}  {'yes' if ok else 'NO'}")
    print("(passes: within 2x (out, lse) or 3x (gradients) PyTorch's error plus a rounding-sized atol, "
          "as in the tests)\n")

    case = Case("fwd", batch, seqlen, seqlen, heads, heads, head_dim, dtype, causal)
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
    with torch.no_grad():
        fwd = measure(lambda: flashtile.flash_attn_func(q, k, v, causal=causal), (), device)
    both = measure(lambda: flashtile.flash_attn_func(*leaves, causal=causal).backward(dout), leaves, device)
    for what, t, mode in (("forward", fwd, "fwd"), ("forward+backward", both, "fwdbwd")):
        speed = "" if interpreted else f", {timed_flops(replace(case, mode=mode)) / t.ms / 1e9:.1f} TFLOP/s"
        print(f"{what:17} {t.ms:9.3f} ms (p20 {t.p20:.3f}, p80 {t.p80:.3f}){speed}")
    return 0 if passed else 1
