"""Multi-process stress run on one GPU: several processes draw random problems (dense, packed, varlen, KV-cache;
dtypes, head dims to 512, lengths, masks, softcap, ALiBi, GQA; the dense ones also dropout, sinks, chunks and a v
head dim of their own; one dense or varlen problem in five is MLA prefill's 192/128 on the Gluon path) and run
each one's backward repeatedly on one graph, checking the first result against the fp64 oracle
(flashtile.testing's 2x-PyTorch-error rule) and every rerun bitwise against the first. Races between
kernels, and between processes sharing the GPU, show only under such load: this is how a flash-attn-style matrix
found the backward's illegal memory access at head dims above 128.

    PYTHONPATH=src python tools/stress.py --minutes 5 --procs 8 [--reruns 20] [--json stress.json]

Prints one line per process at the end and a total; exits 1 if any check failed or any process died. --log PATH
appends one JSON line per finished problem as it finishes (worker, kind, seconds, error), so that a run cut short
by a time limit still says what it ran.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import time
import traceback

LENGTHS = [1, 2, 3, 17, 113, 127, 128, 129, 239, 256, 513, 799, 1023]
HEAD_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]


# Kinds of problem, each as likely as its count here. varlen_short: many sequences of a few queries against a few
# hundred keys at d128, the persistent Gluon forward's shape in the one wrong answer a flash-attn-style matrix saw
# under load (issue: trust, defect 4); its forward reruns are compared bitwise too.
KINDS = ["dense", "dense", "varlen", "varlen", "qkvpacked", "kvcache", "varlen_short"]


def _case(rng: random.Random, kinds: list[str]) -> dict:
    kind = rng.choice(kinds)
    mask = rng.choice(["none", "causal", "local", "causal_local"])
    window = {"none": (-1, -1), "causal": (-1, -1), "local": (rng.randint(0, 300), rng.randint(0, 300)),
              "causal_local": (rng.randint(0, 300), -1)}[mask]
    nheads_kv = rng.choice([1, 2, 3])
    case = dict(kind=kind, causal=mask.startswith("causal"), window=window,
                dtype=rng.choice(["float16", "bfloat16"]), head_dim=rng.choice(HEAD_DIMS),
                nheads_kv=nheads_kv, nheads=nheads_kv * rng.choice([1, 2, 3]),
                softcap=rng.choice([0.0, 0.0, 0.0, 10.0]), alibi=rng.random() < 0.2, seed=rng.randrange(2**31))
    if kind in ("dense", "qkvpacked"):
        case.update(batch=rng.randint(1, 4), seqlen_q=rng.choice(LENGTHS), seqlen_k=rng.choice(LENGTHS),
                    dropout=rng.choice([0.0, 0.0, 0.0, 0.15]) if kind == "dense" else 0.0,
                    sink=kind == "dense" and rng.random() < 0.25,
                    chunk=rng.choice([0, 0, 0, 64, 200]) if kind == "dense" else 0,
                    head_dim_v=rng.choice([0, 0, 0, 64, 128]) if kind == "dense" else 0)
        if kind == "dense" and rng.random() < 0.05:  # head dim 512 (Gemma 4's global layers): small tiles
            case.update(head_dim=512, head_dim_v=0, seqlen_q=min(case["seqlen_q"], 513),
                        seqlen_k=min(case["seqlen_k"], 513))
        if kind == "qkvpacked":
            case.update(seqlen_k=case["seqlen_q"], nheads_kv=case["nheads"])
    elif kind == "varlen_short":
        n = rng.randint(1, 16)
        case.update(head_dim=128, alibi=False, softcap=0.0, fwd_reruns=20,
                    lens_q=[rng.choice([1, 1, 2, 3]) for _ in range(n)],
                    lens_k=[rng.randint(1, 600) for _ in range(n)])
    elif kind == "varlen":
        n = rng.randint(1, 6)
        lens_q = [rng.choice(LENGTHS + [0]) for _ in range(n)]
        case.update(lens_q=lens_q, lens_k=lens_q if rng.random() < 0.5 else [rng.choice(LENGTHS + [0])
                                                                             for _ in range(n)])
        if sum(case["lens_q"]) == 0:
            case["lens_q"][0] = 1
    else:
        case.update(batch=rng.randint(1, 4), seqlen_q=rng.choice([1, 1, 2, 4]), capacity=1024,
                    page_size=rng.choice([None, 1, 16, 256]), seqlen_new=rng.choice([0, 1, 3]),
                    seqlens=[rng.randint(0, 1020) for _ in range(4)])
    if kind in ("dense", "varlen") and rng.random() < 0.2:
        # MLA prefill (q/k 192, v 128) with nothing that keeps it off the Gluon kernels' 128 + 64 reading
        case.update(head_dim=192, head_dim_v=128, softcap=0.0, alibi=False, dropout=0.0)
    return case


def _dense_check(torch, flashtile, testing, q, k, v, dout, kw, reruns):
    """Forward+backward against the oracle, then `reruns` backward passes on the same graph, bitwise. With dropout
    the oracle applies the mask the call returns in S_dmask."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dropout = kw.get("dropout_p", 0.0) > 0.0
    out, _, s_dmask = flashtile.flash_attn_func(*leaves, **kw, return_attn_probs=True)
    grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    for _ in range(reruns):
        for a, b in zip(grads, torch.autograd.grad(out, leaves, dout, retain_graph=True)):
            assert torch.equal(a, b), "a rerun of the backward on the same graph differs"
    if dropout:
        kw = dict(kw, dropout_mask=s_dmask[:, :, :q.shape[1], :k.shape[1]] >= 0)
    _oracle(torch, testing, q, k, v, dout, kw, out, grads)


def _oracle(torch, testing, q, k, v, dout, kw, out, grads):
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _, probs = testing.attention_ref(*ref_in, **kw, return_probs=True)
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout)
    pt_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    pt_out, _ = testing.attention_ref(*pt_in, **kw, upcast=False)
    pt_grads = torch.autograd.grad(pt_out, pt_in, dout)
    floors = testing.accumulation_floor(q, k, v, dout, ref_out, probs, kw.get("softmax_scale"))
    testing.check_close("out", out, ref_out, pt_out, 2, floor=floors["out"])
    scale = max(g.abs().max().item() for g in ref_grads)
    for name, ours, ref, pt in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
        testing.check_close(name, ours, ref, pt, 3, scale, floor=floors[name])


def _run(case: dict, reruns: int) -> None:
    import torch

    import flashtile
    from flashtile import testing

    g = torch.Generator(device="cuda").manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    d, h, hk = case["head_dim"], case["nheads"], case["nheads_kv"]

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    kw = dict(causal=case["causal"], window_size=case["window"], softcap=case["softcap"])
    if case["kind"] in ("dense", "qkvpacked", "varlen"):
        batch = case.get("batch", len(case.get("lens_q", [])))
        if case["alibi"]:
            kw["alibi_slopes"] = torch.rand(batch, h, device="cuda", generator=g) * 0.3
    if case["kind"] == "dense":
        if case.get("dropout"):
            kw["dropout_p"] = case["dropout"]
        if case.get("sink"):
            kw["learnable_sink"] = torch.randn(h, device="cuda", generator=g) * 2
        if case.get("chunk"):
            kw["attention_chunk"] = case["chunk"]
        dv = case.get("head_dim_v") or d
        q, k = randn(case["batch"], case["seqlen_q"], h, d), randn(case["batch"], case["seqlen_k"], hk, d)
        v = randn(case["batch"], case["seqlen_k"], hk, dv)
        _dense_check(torch, flashtile, testing, q, k, v, randn(*q.shape[:-1], dv), kw, reruns)
    elif case["kind"] == "qkvpacked":
        qkv = randn(case["batch"], case["seqlen_q"], 3, h, d).requires_grad_()
        dout = randn(case["batch"], case["seqlen_q"], h, d)
        out = flashtile.flash_attn_qkvpacked_func(qkv, **kw)
        (dqkv,) = torch.autograd.grad(out, qkv, dout, retain_graph=True)
        for _ in range(reruns):
            assert torch.equal(dqkv, torch.autograd.grad(out, qkv, dout, retain_graph=True)[0])
        q, k, v = (qkv[:, :, i].detach() for i in range(3))
        _oracle(torch, testing, q, k, v, dout, kw, out, [dqkv[:, :, i] for i in range(3)])
    elif case["kind"] in ("varlen", "varlen_short"):
        lens_q, lens_k = case["lens_q"], case["lens_k"]
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                      for x in (lens_q, lens_k))
        dv = case.get("head_dim_v") or d
        q, k, v = randn(sum(lens_q), h, d), randn(sum(lens_k), hk, d), randn(sum(lens_k), hk, dv)
        dout = randn(*q.shape[:-1], dv)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flashtile.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
        for _ in range(case.get("fwd_reruns", 0)):
            again = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
            assert torch.equal(again, out), "a rerun of the varlen forward differs"
        grads = torch.autograd.grad(out, leaves, dout, retain_graph=True, allow_unused=True, materialize_grads=True)
        for _ in range(reruns):
            again = torch.autograd.grad(out, leaves, dout, retain_graph=True, allow_unused=True,
                                        materialize_grads=True)
            for a, b in zip(grads, again):
                assert torch.equal(a, b), "a rerun of the varlen backward on the same graph differs"
        # Each sequence alone is the dense problem of batch 1; its slice of out and of the gradients must pass
        # the oracle there.
        slopes = kw.pop("alibi_slopes", None)
        for b, (q0, q1, k0, k1) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(),
                                                  cu_k[1:].tolist())):
            if q1 == q0 or k1 == k0:
                continue
            seq_kw = dict(kw, alibi_slopes=None if slopes is None else slopes[b:b + 1])
            _oracle(torch, testing, q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dout[None, q0:q1], seq_kw,
                    out[None, q0:q1], [grads[0][None, q0:q1], grads[1][None, k0:k1], grads[2][None, k0:k1]])
    else:
        batch, cap, page = case["batch"], case["capacity"], case["page_size"]
        seqlens = [min(s, cap - case["seqlen_new"]) for s in case["seqlens"][:batch]]
        logical_k, logical_v = randn(batch, cap, hk, d), randn(batch, cap, hk, d)
        q = randn(batch, case["seqlen_q"], h, d)
        new = [randn(batch, case["seqlen_new"], hk, d) for _ in range(2)] if case["seqlen_new"] else [None, None]
        extra = {}
        if page:
            k_cache = logical_k.reshape(batch * cap // page, page, hk, d).clone()
            v_cache = logical_v.reshape(batch * cap // page, page, hk, d).clone()
            extra["block_table"] = torch.arange(batch * cap // page, dtype=torch.int32, device="cuda").reshape(
                batch, -1)
        else:
            k_cache, v_cache = logical_k.clone(), logical_v.clone()
        dec_kw = dict(kw, window_size=case["window"])
        if case["alibi"]:
            dec_kw["alibi_slopes"] = torch.rand(batch, h, device="cuda", generator=g) * 0.3
        seqlens_t = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
        out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, *new, cache_seqlens=seqlens_t, **dec_kw,
                                                **extra)
        for b, s in enumerate(seqlens):
            keys_k = logical_k[b:b + 1, :s]
            keys_v = logical_v[b:b + 1, :s]
            if new[0] is not None:
                keys_k = torch.cat([keys_k, new[0][b:b + 1]], 1)
                keys_v = torch.cat([keys_v, new[1][b:b + 1]], 1)
            ref_kw = dict(dec_kw)
            if "alibi_slopes" in ref_kw:
                ref_kw["alibi_slopes"] = ref_kw["alibi_slopes"][b]
            if keys_k.shape[1] == 0:
                continue
            ref, _ = testing.attention_ref(q[b:b + 1].double(), keys_k.double(), keys_v.double(), **ref_kw)
            base, _ = testing.attention_ref(q[b:b + 1], keys_k, keys_v, **ref_kw, upcast=False)
            testing.check_close(f"decode out[{b}]", out[b:b + 1], ref, base, 2)


def _worker(index: int, seed: int, deadline: float, reruns: int, kinds: list[str], results, log) -> None:
    import torch

    rng = random.Random(seed * 1000 + index)
    done, failures = {}, []
    while time.time() < deadline:
        case = _case(rng, kinds)
        start, error = time.time(), None
        try:
            _run(case, reruns)
        except Exception as e:  # a failed check or a CUDA error: record it, go on while the context lives
            error = f"{type(e).__name__}: {e}"[:2000]
            failures.append({"case": case, "error": error, "trace": traceback.format_exc()[-2000:]})
        if log:
            with open(log, "a") as f:
                f.write(json.dumps({"worker": index, "kind": case["kind"], "seconds": round(time.time() - start, 2),
                                    "error": error, "case": case if error else None}) + "\n")
        if error and error.startswith("OutOfMemoryError"):
            torch.cuda.empty_cache()
        elif error and ("CUDA" in error or "illegal" in error):
            break  # the context is lost: every later call would fail the same way
        done[case["kind"]] = done.get(case["kind"], 0) + 1
    results.put({"worker": index, "cases": done, "failures": failures})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--reruns", type=int, default=20, help="backward passes per problem on one graph")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(dict.fromkeys(KINDS)),
                        help="comma-separated kinds of problem to draw (default: all, as weighted in KINDS)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--log", default=None, help="append a JSON line per finished problem to this file")
    args = parser.parse_args(argv)
    wanted = args.kinds.split(",")
    unknown = set(wanted) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; choose from {sorted(set(KINDS))}")
    kinds = [k for k in KINDS if k in wanted]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    deadline = time.time() + 60 * args.minutes
    procs = [ctx.Process(target=_worker, args=(i, args.seed, deadline, args.reruns, kinds, results, args.log))
             for i in range(args.procs)]
    for p in procs:
        p.start()
    reports = []
    for _ in procs:
        try:
            reports.append(results.get(timeout=60 * args.minutes + 900))
        except Exception:
            break
    for p in procs:
        p.join(timeout=60)
    died = [i for i, p in enumerate(procs) if p.exitcode != 0]
    total = sum(sum(r["cases"].values()) for r in reports)
    failures = [f for r in reports for f in r["failures"]]
    for r in sorted(reports, key=lambda r: r["worker"]):
        print(f"worker {r['worker']}: {sum(r['cases'].values())} problems {r['cases']}, "
              f"{len(r['failures'])} failed")
    for f in failures[:10]:
        print("FAILED", json.dumps(f["case"]), f["error"][:300])
    print(f"stress: {args.procs} processes x {args.minutes} min, {total} problems, each backward "
          f"{args.reruns + 1} times on one graph: {len(failures)} failures, processes died: {died}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "problems": total, "reports": reports, "died": died}, f)
    return 1 if failures or died or len(reports) < len(procs) else 0


if __name__ == "__main__":
    sys.exit(main())
