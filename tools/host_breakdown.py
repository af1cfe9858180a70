"""Where a short call's host time goes, and whether a benchmark times the host or the kernels.

Host part: microseconds of Python per call for the public API and its pieces (argument checks, the forward and
backward implementations, a whole forward+backward, `.backward()` alone split into before / inside / after our
backward), beside FlexAttention's, with the GPU kept busy by a sleep kernel so that nothing waits on it; the min and
median of five bursts. Kernel part (--cells): each cell's time as a CUDA graph replays it (GPU time only) and as
`triton.testing.do_bench` times it (events, L2 cleared before each repetition, as `flashtile bench` does) for
flashtile and Flex; where the event time is above the graph time, the host is what is being timed. (A captured
forward+backward also accumulates into the inputs' .grad on every replay, three extra adds that the event timing,
which clears the gradients, does not have: compare the forward rows, or backends within a row.) docs/perf.md
quotes what it printed on the H200, and docs/design/launch-path.md why it matters.

Usage (GPU): PYTHONPATH=src python3 tools/host_breakdown.py [--cells] [--json PATH]
"""

import argparse
import json
import statistics
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask
from triton.testing import do_bench, do_bench_cudagraph

import flashtile
import flashtile.autograd
from flashtile.bench.backends import _compiled_flex
from flashtile.ops.bwd import attention_bwd
from flashtile.ops.fwd import attention_fwd
from flashtile.testing import op_args
from flashtile.problem import dense_problem

CELLS = [(128, 1024, True, "fwd"), (64, 1024, True, "fwd"), (128, 1024, False, "fwd"), (128, 1024, True, "fwdbwd"),
         (128, 1024, False, "fwdbwd"), (128, 4096, False, "fwdbwd"), (128, 16384, False, "fwd")]


def _busy():
    torch.cuda._sleep(int(3e9))  # ~1.5 s of GPU time queued first: the calls below never wait for the device


def host_us(fn, n=100, bursts=5) -> tuple[float, float]:
    res = []
    for _ in range(bursts):
        torch.cuda.synchronize()
        _busy()
        fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        res.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return min(res), statistics.median(res)


def _backward_split(q, k, v, dout, n=60):
    """Median µs of `.backward()` before our backward starts, inside it, and after it returns."""
    marks, cls = [], flashtile.autograd._EagerAttention
    orig = cls.backward

    def timed(ctx, *grads):
        t = time.perf_counter()
        result = orig(ctx, *grads)
        marks.append((t, time.perf_counter()))
        return result

    cls.backward = staticmethod(timed)
    try:
        outs = [flashtile.flash_attn_func(q, k, v, causal=True) for _ in range(n)]
        torch.cuda.synchronize()
        _busy()
        rows = []
        for o in outs:
            t0 = time.perf_counter()
            o.backward(dout)
            t3 = time.perf_counter()
            t1, t2 = marks[-1]
            rows.append(((t1 - t0) * 1e6, (t2 - t1) * 1e6, (t3 - t2) * 1e6))
            q.grad = k.grad = v.grad = None
        torch.cuda.synchronize()
    finally:
        cls.backward = orig
    return [statistics.median(r[i] for r in rows[10:]) for i in range(3)]


def host_part(flex) -> dict:
    b, s, h, d = 16, 1024, 16, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    scalars = dict(max_seqlen_q=s, max_seqlen_k=s, softmax_scale=d ** -0.5, window_right=0)
    args = op_args(attention_fwd, q=q, k=k, v=v, **scalars)
    rows = {}
    with torch.no_grad():
        rows["API forward, no grad"] = host_us(lambda: flashtile.flash_attn_func(q, k, v, causal=True))
        rows["argument checks (dense_problem)"] = host_us(
            lambda: dense_problem(q, k, v, None, True, (-1, -1), 0.0, None, 0.0))
        rows["forward implementation"] = host_us(lambda: attention_fwd.impl(*args))
        out, lse = attention_fwd.impl(*args)
        bwd_args = op_args(attention_bwd, dout=dout, q=q, k=k, v=v, out=out, lse=lse, **scalars)
        rows["backward implementation"] = host_us(
            lambda: attention_bwd.impl(*bwd_args), n=50)
    rows["API forward, grad"] = host_us(lambda: flashtile.flash_attn_func(q, k, v, causal=True))

    def fwdbwd():
        flashtile.flash_attn_func(q, k, v, causal=True).backward(dout)
        q.grad = k.grad = v.grad = None

    rows["API forward+backward"] = host_us(fwdbwd, n=50)
    before, inside, after = _backward_split(q, k, v, dout)
    rows[".backward(): before / inside / after our backward (median)"] = (before, inside, after)
    qt, kt, vt, dt = (t.detach().transpose(1, 2).contiguous() for t in (q, k, v, dout))
    mask = create_block_mask(lambda b_, h_, qi, ki: ki <= qi, None, None, s, s, device="cuda")
    with torch.no_grad():
        flex(qt, kt, vt, block_mask=mask)
        rows["Flex forward, no grad"] = host_us(lambda: flex(qt, kt, vt, block_mask=mask))
    qt, kt, vt = (t.requires_grad_() for t in (qt, kt, vt))

    def flex_fwdbwd():
        flex(qt, kt, vt, block_mask=mask).backward(dt)
        qt.grad = kt.grad = vt.grad = None

    flex_fwdbwd()
    rows["Flex forward+backward"] = host_us(flex_fwdbwd, n=50)
    for name, val in rows.items():
        print(f"{name:58s} " + " / ".join(f"{x:7.1f}" for x in val) + " us")
    return rows


def cells_part(flex) -> dict:
    res = {}
    print("cell                          backend    graph ms  events ms")
    for d, s, causal, mode in CELLS:
        b, h = 16384 // s, 2048 // d
        x = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        mask = create_block_mask(lambda b_, h_, qi, ki: ki <= qi, None, None, s, s, device="cuda") if causal else None
        for name in ("flashtile", "flex"):
            ts = x if name == "flashtile" else [t.transpose(1, 2).contiguous() for t in x]
            q, k, v = (t.detach().requires_grad_(mode == "fwdbwd") for t in ts[:3])
            if name == "flashtile":
                def f(q=q, k=k, v=v, causal=causal):
                    return flashtile.flash_attn_func(q, k, v, causal=causal)
            else:
                def f(q=q, k=k, v=v, mask=mask):
                    return flex(q, k, v, block_mask=mask)

            def run(f=f, dout=ts[3], mode=mode):
                if mode == "fwdbwd":
                    f().backward(dout)
                else:
                    with torch.no_grad():
                        f()

            run()
            graph = do_bench_cudagraph(run, rep=100)
            for t in (q, k, v):
                t.grad = None
            events = do_bench(run, rep=100, grad_to_none=[q, k, v])
            key = f"d{d} s{s} {'causal' if causal else 'full'} {mode}"
            res[f"{key} {name}"] = (graph, events)
            print(f"{key:29s} {name:9s} {graph:9.3f} {events:9.3f}")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", action="store_true", help="also time the cells as CUDA graphs and with events")
    ap.add_argument("--json")
    args = ap.parse_args()
    flex = _compiled_flex()  # the bench's: dynamo's recompile limit raised, so every cell stays compiled
    result = {"host_us_min_median": host_part(flex)}
    if args.cells:
        result["graph_events_ms"] = cells_part(flex)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
