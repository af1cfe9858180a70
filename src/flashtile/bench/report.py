"""Results out of `flashtile bench`: the terminal table, JSON, CSV, and the environment header they carry.

JSON is {"environment": {...}, "rows": [...]}; CSV is the same rows, long format, with the environment
repeated in every row so that files from several runs concatenate. The environment names the GPU, the torch,
CUDA, cuDNN, Triton, flashtile and flash-attn versions, the git commit and the date: a number without them
cannot be compared with anything.

What this module does not do: plot (plot.py) or measure (run.py).
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import json
import os
import subprocess
import sys

import torch

CPU_NOTE = "CPU demonstration (Triton interpreter): timings are not GPU performance"
ENV_COLUMNS = ("gpu", "torch", "triton", "cudnn", "flashtile", "git_sha", "date")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_sha() -> str | None:
    """The commit of the flashtile source tree, '+dirty' with uncommitted changes; None outside a checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "")


def environment(device: torch.device, interpreted: bool, meta: dict | None = None) -> dict:
    import triton

    import flashtile

    cuda = device.type == "cuda"
    env = {
        "gpu": torch.cuda.get_device_name(device) if cuda else "none (CPU)",
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device))) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "triton": triton.__version__,
        "flashtile": flashtile.__version__,
        "flash_attn": _version("flash-attn"),
        "flash_attn_4": _version("flash-attn-4"),
        "git_sha": _git_sha(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "note": CPU_NOTE if interpreted else None,
    }
    env.update(meta or {})
    return env


def headline(env: dict) -> str:
    return (f"flashtile bench · {env.get('gpu')} · torch {env.get('torch')} · triton {env.get('triton')} · "
            f"cuDNN {env.get('cudnn')} · flashtile {env.get('flashtile')} ({env.get('git_sha')}) · "
            f"{env.get('date')}")


_PREFIXES = (("T", 1.0), ("G", 1e-3), ("M", 1e-6), ("k", 1e-9))


def _scaled(tera: float, unit: str) -> str:
    """A rate given in tera-units, with the largest SI prefix that keeps it >= 1 (the interpreter's rates are
    millions of times below a GPU's)."""
    for prefix, scale in _PREFIXES:
        if tera >= scale:
            return f"{tera / scale:.4g} {prefix}{unit}"
    return f"{tera / _PREFIXES[-1][1]:.3g} {_PREFIXES[-1][0]}{unit}"


def _speed(row: dict) -> str:
    if row["status"] != "ok":
        return ""
    return _scaled(row["tbps"], "B/s") if row["tbps"] is not None else _scaled(row["tflops"], "FLOP/s")


def format_table(rows: list[dict]) -> str:
    """One line per row; mode and case are named on a case's first row only."""
    header = ("mode", "case", "backend", "ms", "p20-p80 ms", "speed", "refcheck", "flashtile vs best", "note")
    lines, last = [], None
    for r in rows:
        first = (r["mode"], r["case"]) != last
        last = (r["mode"], r["case"])
        ok = r["status"] == "ok"
        lines.append((
            r["mode"] if first else "", r["case"] if first else "", r["backend"],
            f"{r['ms']:.3f}" if ok else "-", f"{r['p20']:.3f}-{r['p80']:.3f}" if ok else "",
            _speed(r), r["refcheck"] or "",
            f"{r['vs_best']:.3g}x {r['best_other']}" if r.get("vs_best") else "",
            r["status"] if not ok else r["timer"] if r.get("timer") not in (None, "events", "cpu") else "",
        ))
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*line).rstrip() for line in lines]
    return "\n".join(out)


def make_parent(path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def write_json(path: str, env: dict, rows: list[dict]) -> None:
    with open(make_parent(path), "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1)
        f.write("\n")


def read_json(paths: list[str]) -> tuple[dict, list[dict]]:
    """Rows of several --json files, with the first file's environment (so split runs plot as one)."""
    records = []
    for path in paths:
        with open(path) as f:
            records.append(json.load(f))
    return records[0]["environment"], [r for record in records for r in record["rows"]]


RESULT_COLUMNS = ("gpu", "torch", "triton", "cudnn", "flashtile", "git_sha", "date", "case", "mode", "causal",
                  "backend", "kernels", "metric", "value")
RESULT_METRICS = ("ms", "p20", "p80", "tflops", "tbps")


def append_results(path: str, env: dict, rows: list[dict]) -> int:
    """Append the rows that ran to the long-format results table at `path` (bench-results/results.csv: one line
    per (run, case, backend, metric), the run's environment on every line), creating it with its header; returns
    the lines written. Rows that did not run (unsupported, errors) carry no metric and are left out."""
    lines = [{**{k: env.get(k) for k in RESULT_COLUMNS[:7]}, "case": r["case"], "mode": r["mode"],
              "causal": r.get("causal"), "backend": r["backend"], "kernels": r.get("kernels"), "metric": m,
              "value": r[m]}
             for r in rows if r.get("status") == "ok" for m in RESULT_METRICS if r.get(m) is not None]
    new = not os.path.exists(path)
    with open(make_parent(path), "a", newline="") as f:
        writer = csv.DictWriter(f, RESULT_COLUMNS)
        if new:
            writer.writeheader()
        writer.writerows(lines)
    return len(lines)


def write_csv(path: str, env: dict, rows: list[dict]) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r)) + list(ENV_COLUMNS)
    with open(make_parent(path), "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        for r in rows:
            flat = {k: ";".join(map(str, v)) if isinstance(v, list) else v for k, v in r.items()}
            writer.writerow(flat | {k: env.get(k) for k in ENV_COLUMNS})
