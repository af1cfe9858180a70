"""The `flashtile` command: `flashtile info|warmup|demo|bench` (also `python -m flashtile ...`).

    flashtile info [--json]                # versions, where kernels run, which kernels and tiles each case takes
    flashtile warmup --head-dim 64,128 --dtype bf16   # compile the kernels of those problem classes now
    flashtile demo                         # flashtile vs the fp64 reference, then timed
    flashtile bench                        # the standard sweep, every backend (GPU)
    flashtile bench --preset decode --refcheck --json out.json --plot out.png
    flashtile bench --preset varlen --backends flashtile,flex   # varlen fwd, fwd+bwd beside dense S=1k, 4k
    flashtile bench --preset mla --backends flashtile,fa4       # head dim 192/v 128 beside d128, one run
    flashtile bench --mode fwd,fwdbwd --batch 4 --seqlen 4096 --heads 32 --kv-heads 8 --head-dim 128 --causal
    flashtile bench --list-backends

This module parses arguments, settles where the kernels run, and hands over to flashtile.bench. It imports no
kernel code itself: see Note [interpreter switch].
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

# Note [interpreter switch]
# Without a GPU, Triton kernels can only run through Triton's interpreter, chosen by TRITON_INTERPRET=1.
# Triton reads it when a kernel is decorated, i.e. when flashtile's kernel modules are imported, and
# flashtile.env captures it at import too. Both the `flashtile` script and `python -m flashtile` import the
# flashtile package, and with it those modules, before this one runs; so when the variable has to be set here,
# the process is started again with it set. Called as a function (`main([...])`) in a process that imported
# the kernels for the GPU, it cannot restart its caller, and says so instead.
_NOT_KERNELS = ("flashtile.cli", "flashtile.bench", "flashtile.__main__")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def _interpret(argv) -> bool:
    """Whether kernels run through the interpreter, setting it up (and restarting) when there is no GPU."""
    if _truthy(os.environ.get("TRITON_INTERPRET")):
        return True
    import torch

    if torch.cuda.is_available():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    if any(m.startswith("flashtile.") and not m.startswith(_NOT_KERNELS) for m in sys.modules):
        if argv is not None:
            raise SystemExit("flashtile: no CUDA GPU, and flashtile was imported without TRITON_INTERPRET=1; "
                             "set it before importing flashtile")
        os.execv(sys.executable, [sys.executable, "-m", "flashtile", *sys.argv[1:]])
    return True


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _window(text: str) -> tuple[int, int]:
    left, right = _ints(text)
    return left, right


def _words(text: str) -> list[str]:
    return [w for w in text.split(",") if w]


def build_parser() -> argparse.ArgumentParser:
    from flashtile.bench.cases import DTYPES, MODES, PRESETS

    parser = argparse.ArgumentParser(prog="flashtile", description="flashtile: FlashAttention in Triton.")
    sub = parser.add_subparsers(dest="command", metavar="{info,warmup,demo,bench}")

    info = sub.add_parser("info", help="versions, where the kernels run, and which kernels and tiles each dtype, "
                                       "head dim and feature takes (and why)")
    info.add_argument("--json", action="store_true", help="print the same as JSON")

    warm = sub.add_parser("warmup", help="compile the kernels of the given problem classes now, not on first use",
                          description="Runs one forward(+backward) per class at a length that is a multiple of 16 "
                                      "and one that is not, which compiles what later calls of the class need "
                                      "(Triton caches it on disk). Under the interpreter nothing is compiled.")
    warm.add_argument("--head-dim", type=_ints, default=(128,), help="comma-separated head dims (default 128)")
    warm.add_argument("--dtype", type=_words, default=["bf16"], help=f"comma-separated, of {', '.join(DTYPES)} "
                      "(default bf16)")
    warm.add_argument("--causal", action=argparse.BooleanOptionalAction,
                      help="only causal (--causal) or only not (--no-causal); default both")
    warm.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    warm.add_argument("--groups", type=_ints, default=(1,), help="GQA groups, query heads per KV head (default 1)")
    warm.add_argument("--varlen", action="store_true", help="the varlen kernels instead of the dense ones")
    warm.add_argument("--no-backward", dest="backward", action="store_false", help="forward kernels only")
    warm.add_argument("--seqlen", type=int, help="default 256 on a GPU, 16 under the interpreter")
    warm.add_argument("--json", action="store_true", help="print the records as JSON")

    demo = sub.add_parser("demo", help="run flashtile once, check it against the fp64 reference, time it",
                          description="Defaults: B=2 S=2048 H=16 D=128 bf16 causal on a GPU; "
                                      "B=1 S=128 H=2 D=64 fp16 causal without one (Triton interpreter).")
    demo.add_argument("--batch", type=int, help="sequences in the batch")
    demo.add_argument("--seqlen", type=int, help="tokens per sequence (queries and keys)")
    demo.add_argument("--heads", type=int, help="attention heads")
    demo.add_argument("--head-dim", type=int, help="features per head")
    demo.add_argument("--dtype", choices=DTYPES, help="input dtype")
    demo.add_argument("--causal", action=argparse.BooleanOptionalAction, help="causal mask (--no-causal: none)")

    bench = sub.add_parser(
        "bench", help="benchmark flashtile against other attention backends",
        description="Each preset runs its modes over the sweeps in flashtile.bench.cases; the shape "
                    "flags replace single axes of every sweep (comma lists allowed), so giving all of them "
                    "defines a custom case.",
    )
    bench.add_argument("--preset", choices=PRESETS,
                       help="standard: fwd + fwdbwd (default on a GPU); decode; varlen: varlen + varlenbwd "
                            "beside dense fwd + fwdbwd at S=1k, 4k; dropout: p=0 beside p=0.1; sinks: with and "
                            "without learnable sinks; mla: head dim 192/v 128 beside d128; d512: d512 beside "
                            "d256; mla-decode: DeepSeek's absorbed 576/512 cache; all (default without a GPU); "
                            "shapes in flashtile.bench.cases")
    bench.add_argument("--mode", nargs="+", metavar="MODE", help=f"any of {', '.join(MODES)}, run instead of "
                       "the preset's modes, each over the preset's sweeps for it if it has any (space- or "
                       "comma-separated)")
    bench.add_argument("--backends", type=_words, help="comma-separated names (see --list-backends)")
    bench.add_argument("--list-backends", action="store_true", help="list the backends and exit")
    shape = bench.add_argument_group("shape axes (each replaces the preset's)")
    shape.add_argument("--batch", type=_ints, help="default: tokens // seqlen")
    shape.add_argument("--tokens", type=int, help="tokens per batch when --batch is not given")
    shape.add_argument("--seqlen-q", "--seqlen", type=_ints, dest="seqlen_q", help="query tokens per sequence")
    shape.add_argument("--seqlen-k", type=_ints, help="default: seqlen-q (decode: the KV cache length)")
    shape.add_argument("--heads", type=_ints, help="default: hidden // head dim")
    shape.add_argument("--hidden", type=int, help="model width that --heads defaults from (default 2048)")
    shape.add_argument("--kv-heads", type=_ints, dest="kv_heads", help="default: heads (GQA when fewer)")
    shape.add_argument("--head-dim", type=_ints, dest="head_dim", help="features per head")
    shape.add_argument("--head-dim-v", type=_ints, dest="head_dim_v",
                       help="v's features per head (MLA: 128 beside a head dim of 192); 0 = the head dim")
    shape.add_argument("--seqlens", type=_ints, help="varlen: the per-sequence lengths")
    shape.add_argument("--page-size", type=_ints, dest="page_size", help="decode: 0 = contiguous KV cache")
    shape.add_argument("--causal", action=argparse.BooleanOptionalAction, help="default: both")
    shape.add_argument("--sink", action=argparse.BooleanOptionalAction,
                       help="a learnable sink per query head (--no-sink: none); default: the preset's (sinks: both)")
    bench.add_argument("--dtype", choices=DTYPES, help="default: bf16 on a GPU, fp16 without one")
    bench.add_argument("--window", type=_window, default=(-1, -1), metavar="L,R",
                       help="sliding window; -1 = unbounded")
    bench.add_argument("--softcap", type=float, default=0.0, help="tanh soft cap of the scores; 0 = off")
    bench.add_argument("--dropout", type=float, default=None, metavar="P",
                       help="dropout probability of every case but decode (default: the preset's; the dropout "
                            "preset times 0 and 0.1)")
    bench.add_argument("--refcheck", action="store_true",
                       help="check every output against the fp64 reference first")
    bench.add_argument("--rep-ms", type=int, default=100,
                       help="GPU: milliseconds of repetitions per case and backend, split over the "
                            "interleaved timing rounds (bench/run.py)")
    bench.add_argument("--json", metavar="PATH", help="write the environment and every row as JSON (rewritten "
                       "after each case, so an interrupted run keeps what it measured)")
    bench.add_argument("--csv", metavar="PATH", help="write the rows as CSV, the environment in every row")
    bench.add_argument("--results", metavar="PATH", help="append the rows, one line per metric, to a long-format "
                       "results table (bench-results/results.csv)")
    bench.add_argument("--plot", metavar="PATH", help="PNG of grouped bars (needs matplotlib)")
    bench.add_argument("--load", nargs="+", metavar="JSON",
                       help="report saved --json results (several runs merge) instead of running anything")
    bench.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE",
                       help="extra environment fields for the records, e.g. git_sha=... where git is absent")
    return parser


def _shapes(args, gpu: bool):
    from flashtile.bench.cases import CPU_SHAPES, GPU_SHAPES

    axes = ("batch", "tokens", "seqlen_q", "seqlen_k", "heads", "hidden", "kv_heads", "head_dim", "head_dim_v",
            "seqlens", "page_size")
    overrides = {a: getattr(args, a) for a in axes if getattr(args, a) is not None}
    for flag in ("causal", "sink"):
        if getattr(args, flag) is not None:
            overrides[flag] = (getattr(args, flag),)
    base = GPU_SHAPES if gpu else CPU_SHAPES
    return {sweep: dataclasses.replace(s, **overrides) for sweep, s in base.items()}


def select(parser, args, gpu: bool):
    """The cases and backends the bench arguments ask for (parser.error on bad names or shapes)."""
    from flashtile.bench.backends import BACKENDS
    from flashtile.bench.cases import build_cases, preset_runs

    names = args.backends or [b.name for b in BACKENDS.values() if gpu or b.cpu]
    if bad := [n for n in names if n not in BACKENDS]:
        parser.error(f"unknown backend {', '.join(bad)}; choose from {', '.join(BACKENDS)}")
    preset = args.preset or ("standard" if gpu else "all")
    modes = [m for word in args.mode for m in _words(word)] if args.mode else None
    dtype = args.dtype or ("bf16" if gpu else "fp16")
    try:
        shapes, runs = _shapes(args, gpu), preset_runs(preset, modes)
        if args.batch is not None or args.seqlen_k is not None:
            # A mixed decode batch is its list of cache lengths; uniform --batch/--seqlen-k replace it entirely.
            runs = [(mode, sweep) for mode, sweep in runs if not shapes[sweep].cache_lengths]
        cases = build_cases(runs, shapes, dtype, args.window, args.softcap, args.dropout)
    except ValueError as e:
        parser.error(str(e))
    return cases, [BACKENDS[n] for n in names]


def _bench(parser, args, device, interpreted: bool) -> int:
    from flashtile.bench import plot, report
    from flashtile.bench.backends import BACKENDS
    from flashtile.bench.run import run

    if args.list_backends:
        for b in BACKENDS.values():
            print(f"{b.name:16} {b.description}{'' if b.cpu else '  [CUDA only]'}")
        return 0
    if args.load:
        env, rows = report.read_json(args.load)
    else:
        cases, backends = select(parser, args, device.type == "cuda")
        env = report.environment(device, interpreted, dict(kv.split("=", 1) for kv in args.meta if "=" in kv))
        if interpreted:
            print(report.CPU_NOTE, file=sys.stderr)
        save = (lambda rows: report.write_json(args.json, env, rows)) if args.json else None
        rows = run(cases, backends, device, args.refcheck, args.rep_ms, on_case=save)
    print("\n" + report.headline(env))
    if env.get("note"):
        print(env["note"])
    print(report.format_table(rows))
    if args.json:
        report.write_json(args.json, env, rows)
    if args.csv:
        report.write_csv(args.csv, env, rows)
    if args.results:
        report.append_results(args.results, env, rows)
    if args.plot:
        plot.plot(args.plot, env, rows)
    # A failing flashtile row fails the command (useful in CI); other backends' failures are only reported.
    failed = [r for r in rows if r["backend"].startswith("flashtile")
              and (r["status"].startswith("error") or (r["refcheck"] or "").startswith("MISMATCH"))]
    return 1 if failed else 0


def _info(args) -> int:
    import json

    from flashtile import info

    env, coverage = info.environment(), info.coverage()
    print(json.dumps({"environment": env, "coverage": coverage}, indent=1) if args.json
          else info.format_info(env, coverage))
    return 0


def _warmup(parser, args, interpreted: bool) -> int:
    import json

    from flashtile.bench.cases import DTYPES
    from flashtile.info import warmup

    if bad := [d for d in args.dtype if d not in DTYPES]:
        parser.error(f"unknown dtype {', '.join(bad)}; choose from {', '.join(DTYPES)}")
    causal = (False, True) if args.causal is None else (args.causal,)
    try:
        records = warmup(args.head_dim, [DTYPES[d] for d in args.dtype], causal, args.groups, args.heads,
                         args.varlen, args.backward, args.seqlen)
    except ValueError as e:
        parser.error(str(e))
    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    if interpreted:
        print("Triton interpreter: nothing is compiled here (kernels are interpreted on every call); each class "
              "below ran once at a tiny length to check its path.")
    for r in records:
        print(f"{r['dtype']:8} d{r['head_dim']:<4} {'causal' if r['causal'] else 'full':6} group {r['group']} "
              f"{'varlen' if r['varlen'] else 'dense':6} {'fwd+bwd' if r['backward'] else 'fwd':7} "
              f"{r['seconds']:7.2f} s  {'compiled' if r['compiled'] else 'ran'}  {r['kernels'].get('fwd')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "info":  # runs no kernel: no interpreter switch
        return _info(args)
    interpreted = _interpret(argv)
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not interpreted else "cpu")
    if args.command == "demo":
        from flashtile.bench.demo import CPU_DEFAULTS, GPU_DEFAULTS, demo

        settings = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
        given = {k: getattr(args, k) for k in settings if getattr(args, k) is not None}
        return demo(**(settings | given), device=device, interpreted=interpreted)
    if args.command == "warmup":
        return _warmup(parser, args, interpreted)
    return _bench(parser, args, device, interpreted)
