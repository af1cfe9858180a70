"""Runs a benchmark: per case, inputs made once; per backend, setup and --refcheck; then every backend timed in
interleaved rounds (Note [interleaved rounds]); one row each.

A backend's failure never stops the run. `Unsupported` and NotImplementedError become "unsupported: why"
(SDPA's refusal to run a forced kernel is one too, with the warning that says why), anything else "error:
what", and the next backend runs. Rows are flat dicts, long format: one per (case, backend), with the case's
fields, the timing, TFLOP/s (and TB/s in decode), the refcheck verdict and, on flashtile's rows, its speed
relative to the fastest other backend that passed.

Note [interleaved rounds]: a GPU that has idled for a few seconds (a backend compiling, inputs being made) runs
the next kernels faster for a while: on the H200, d128 forward at S=16k read 568 TFLOP/s as the first backend
timed in a process and 503-510 when it came second (docs/perf.md, Method); the ratio to the other backend moved by
up to 15% with the order alone. So every backend of a case is set up first (compiled, checked), and then timed
in ROUNDS rounds of rep_ms / ROUNDS each, the order rotated by one backend per round, and each row's median and
percentiles are taken over all its rounds' repetitions: each backend meets the same mix of machine states.
Setting up includes one call of the timed region, so that compilation (torch.compile, Triton's JIT) never
happens between two timed rounds.

What this module does not do: format or write results (report.py, plot.py) or parse arguments (cli.py).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

import torch

from flashtile.bench.backends import Backend, Unsupported
from flashtile.bench.cases import Case
from flashtile.bench.inputs import make_inputs
from flashtile.bench.metrics import kv_bytes, timed_flops
from flashtile.bench.refcheck import build_reference, check
from flashtile.bench.timing import sample, summarize
from flashtile.ops.hopper import last_kernel_paths

ROUNDS = 3  # timing rounds per case, in rotated backend order (Note [interleaved rounds])

# SDPA with a forced backend raises these when that backend cannot take the case.
_SDPA_REFUSALS = ("No available kernel", "No viable backend")


def _status(e: BaseException, caught: list) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:160]
    if isinstance(e, (Unsupported, NotImplementedError)):
        return f"unsupported: {first}"
    if isinstance(e, RuntimeError) and any(s in str(e) for s in _SDPA_REFUSALS):
        why = [str(w.message) for w in caught if not str(w.message).rstrip().endswith(":")]
        return f"unsupported: {(why[0] if why else first)[:160]}"
    if isinstance(e, torch.OutOfMemoryError):
        return "error: out of memory"
    return f"error: {type(e).__name__}: {first}"


def _row(case: Case, backend: Backend) -> dict:
    row = {"backend": backend.name, "case": case.label(), **case.fields(), "status": "ok"}
    return row | dict.fromkeys(("ms", "p20", "p80", "tflops", "tbps", "refcheck", "ref_err", "ref_bound",
                                "vs_best", "best_other", "timer", "kernels"))


def setup_backend(case: Case, inputs, backend: Backend, device: torch.device, reference):
    """(row, prepared call): the backend set up and, with a reference, checked; prepared is None when it cannot
    run (the row's status says why)."""
    row = _row(case, backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if device.type != "cuda" and not backend.cpu:
                raise Unsupported("needs a CUDA GPU")
            prepared = backend.setup(case, inputs)
            # One call here, so that every backend compiles (torch.compile, Triton) before any is timed (each timing
            # round starts by clearing the gradients this leaves).
            prepared.run()
            if backend.name == "flashtile" and case.mode != "decode":
                # Which kernels the call ran (Note [hopper path] in ops/hopper.py), so that a number is never
                # read as the fast path's when it was not.
                paths = last_kernel_paths()
                row["kernels"] = " ".join(f"{k}={paths.get(k)}" for k in
                                          (("fwd", "bwd_dq", "bwd_dkdv") if case.backward else ("fwd",)))
            if reference is not None:
                with torch.no_grad():
                    verdict = check(reference, prepared.output())
                row.update(refcheck=str(verdict), ref_err=verdict.err, ref_bound=verdict.bound)
        except Exception as e:  # noqa: BLE001  (a failing backend is a row, never a crash)
            row["status"] = _status(e, caught)
            if isinstance(e, torch.OutOfMemoryError):
                torch.cuda.empty_cache()
            return row, None
    return row, prepared


def time_backends(case: Case, live: list, device: torch.device, rep_ms: int, rounds: int = ROUNDS) -> None:
    """Time each (row, prepared) of one case in `rounds` interleaved rounds and fill the rows in (Note
    [interleaved rounds]). A backend that fails while timed gets an error row and leaves the rounds."""
    times = {id(row): [] for row, _ in live}
    timers = {}
    for r in range(rounds):
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        for row, prepared in order:
            if row["status"] != "ok":
                continue
            # The first call of a backend can be its refusal (SDPA with a forced kernel), whose warning says why.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    t, timers[id(row)] = sample(prepared.run, prepared.leaves, device, max(1, rep_ms // rounds),
                                                graph=case.mode == "decode")
                    times[id(row)] += t
                except Exception as e:  # noqa: BLE001  (a failing backend is a row, never a crash)
                    row["status"] = _status(e, caught)
                    if isinstance(e, torch.OutOfMemoryError):
                        torch.cuda.empty_cache()
    for row, _ in live:
        if row["status"] != "ok":
            continue
        t = summarize(times[id(row)], timers[id(row)])
        seconds = t.ms * 1e-3
        row.update(ms=t.ms, p20=t.p20, p80=t.p80, timer=t.timer, tflops=timed_flops(case) / seconds / 1e12)
        if case.mode == "decode":
            row["tbps"] = kv_bytes(case) / seconds / 1e12


def run_backend(case: Case, inputs, backend: Backend, device: torch.device, reference, rep_ms: int) -> dict:
    """One backend alone: set up, checked and timed."""
    row, prepared = setup_backend(case, inputs, backend, device, reference)
    if prepared is not None:
        time_backends(case, [(row, prepared)], device, rep_ms)
    return row


def compare(rows: list[dict]) -> None:
    """On flashtile's rows of one case: vs_best = fastest other backend's time / flashtile's (> 1: faster).

    Backends that failed --refcheck are left out of "fastest": a wrong answer is not a time to beat.
    """
    others = [r for r in rows if not r["backend"].startswith("flashtile") and r["status"] == "ok"
              and not (r["refcheck"] or "").startswith("MISMATCH")]
    best = min(others, key=lambda r: r["ms"], default=None)
    for r in rows:
        if r["backend"].startswith("flashtile") and r["status"] == "ok" and best is not None:
            r.update(vs_best=best["ms"] / r["ms"], best_other=best["backend"])


def progress_line(done: int, total: int, text: str) -> None:
    """A progress bar on stderr: redrawn in place on a terminal, one line per step in a log."""
    width = 24
    filled = width * done // max(total, 1)
    line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {text}"
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K" + line + ("\n" if done == total else ""))
    else:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _reference(case: Case, inputs):
    """(reference, None), or (None, why the check is skipped): a failed reference must not stop the run."""
    try:
        reference = build_reference(case, inputs)
    except Exception as e:  # noqa: BLE001
        return None, f"skipped: reference failed ({type(e).__name__})"
    return (reference, None) if reference is not None else (None, "skipped: too large")


def run(cases: list[Case], backends: list[Backend], device: torch.device, refcheck: bool = False,
        rep_ms: int = 100, progress: Callable[[int, int, str], None] = progress_line,
        on_case: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Rows of every (case, backend). on_case(rows so far) runs after each case: the CLI saves its JSON there, so
    a run cut short (a time limit on a lent GPU) keeps the cases it finished."""
    rows = []
    steps, step = len(cases) * len(backends), 0
    for case in cases:
        inputs = make_inputs(case, device)
        reference, skipped = _reference(case, inputs) if refcheck else (None, None)
        case_rows, live = [], []
        for backend in backends:
            progress(step, steps, f"{case.mode} {case.label()} · {backend.name}")
            row, prepared = setup_backend(case, inputs, backend, device, reference)
            row["refcheck"] = row["refcheck"] or skipped
            case_rows.append(row)
            if prepared is not None:
                live.append((row, prepared))
            step += 1
        time_backends(case, live, device, rep_ms)
        compare(case_rows)
        rows += case_rows
        if on_case is not None:
            on_case(rows)
        del inputs, reference, live
    progress(steps, steps, "done")
    return rows
