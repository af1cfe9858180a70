"""Runs a benchmark: per case, inputs made once; per backend, setup, --refcheck, timing; one row each.

A backend's failure never stops the run. `Unsupported` and NotImplementedError become "unsupported: why"
(SDPA's refusal to run a forced kernel is one too, with the warning that says why), anything else "error:
what", and the next backend runs. Rows are flat dicts, long format: one per (case, backend), with the case's
fields, the timing, TFLOP/s (and TB/s in decode), the refcheck verdict and, on flashtile's rows, its speed
relative to the fastest other backend that passed.

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
from flashtile.bench.timing import measure

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


def run_backend(case: Case, inputs, backend: Backend, device: torch.device, reference, rep_ms: int) -> dict:
    row = {"backend": backend.name, "case": case.label(), **case.fields(), "status": "ok"}
    row |= dict.fromkeys(("ms", "p20", "p80", "tflops", "tbps", "refcheck", "ref_err", "ref_bound", "vs_best",
                          "best_other", "timer"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if device.type != "cuda" and not backend.cpu:
                raise Unsupported("needs a CUDA GPU")
            prepared = backend.setup(case, inputs)
            if reference is not None:
                with torch.no_grad():
                    verdict = check(reference, prepared.output())
                row.update(refcheck=str(verdict), ref_err=verdict.err, ref_bound=verdict.bound)
            t = measure(prepared.run, prepared.leaves, device, rep_ms, graph=case.mode == "decode")
        except Exception as e:  # noqa: BLE001  (a failing backend is a row, never a crash)
            row["status"] = _status(e, caught)
            if isinstance(e, torch.OutOfMemoryError):
                torch.cuda.empty_cache()
            return row
    seconds = t.ms * 1e-3
    row.update(ms=t.ms, p20=t.p20, p80=t.p80, timer=t.timer, tflops=timed_flops(case) / seconds / 1e12)
    if case.mode == "decode":
        row["tbps"] = kv_bytes(case) / seconds / 1e12
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
        case_rows = []
        for backend in backends:
            progress(step, steps, f"{case.mode} {case.label()} · {backend.name}")
            row = run_backend(case, inputs, backend, device, reference, rep_ms)
            row["refcheck"] = row["refcheck"] or skipped
            case_rows.append(row)
            step += 1
        compare(case_rows)
        rows += case_rows
        if on_case is not None:
            on_case(rows)
        del inputs, reference
    progress(steps, steps, "done")
    return rows
