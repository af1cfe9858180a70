"""`--plot PATH`: results as a PNG of grouped bar charts, in the style of the FlashAttention papers' figures.

One panel per mode × head dims × causal (decode: per query count × page size), one group of bars per sequence
length (decode: batch × KV length; varlen: the mix), one bar per backend in a colour that is the same in every
panel, its value printed on top; cases with sinks get panels of their own. Speed is TFLOP/s, or TB/s of K and V
read in decode. Bars of a backend that failed --refcheck are hatched; unsupported backends leave a gap.

matplotlib is an optional dependency (the `bench` extra) and is imported only here, only when plotting.
"""

from __future__ import annotations

from flashtile.bench.cases import VARLEN_MODES
from flashtile.bench.report import headline, make_parent

MODE_TITLES = {"fwd": "Forward", "fwdbwd": "Forward + backward", "varlen": "Varlen forward",
               "varlenbwd": "Varlen forward + backward"}


def _short(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _panel(r: dict) -> tuple[tuple, object, str, str]:
    """(grid row key, grid column key, title, x-axis label) of the panel a result row belongs to.

    Grid rows are mode × causal (decode: query count); columns are (head dim, v head dim) (decode: page sizes).
    """
    extras = [r["dtype"]]
    if r["window_left"] != -1 or r["window_right"] != -1:
        extras.append(f"window ({r['window_left']}, {r['window_right']})")
    if r["softcap"]:
        extras.append(f"softcap {r['softcap']:g}")
    if r.get("dropout_p"):
        extras.append(f"dropout {r['dropout_p']:g}")
    if r.get("sink"):
        extras.append("sink")
    if r.get("absorbed"):
        extras.append("absorbed")
    dims = f"{r['headdim']}" + (f"/{r['headdim_v']}" if r.get("headdim_v") not in (None, 0, r["headdim"]) else "")
    if r["mode"] == "decode":
        q = f"{r['seqlen_q']} query token" + ("s" if r["seqlen_q"] > 1 else "")
        page = f"page size {r['page_size']}" if r["page_size"] else "contiguous cache"
        heads = f"heads {r['nheads']}/{r['nheads_kv']}"
        title = f"Decode, {q}, {page}, {heads}, d{dims}, {', '.join(extras)}"
        return ("decode", r["seqlen_q"], dims, *extras), r["page_size"], title, "batch × KV length"
    mask = "causal" if r["causal"] else "not causal"
    title = f"{MODE_TITLES[r['mode']]}, head dim {dims}, {mask}, {', '.join(extras)}"
    xlabel = "sequences" if r["mode"] in VARLEN_MODES else "sequence length"
    return (r["mode"], r["causal"], *extras), (r["headdim"], r.get("headdim_v") or 0), title, xlabel


def _group(r: dict) -> str:
    if r["mode"] == "decode" and r.get("cache_lengths"):
        return f"{r['batch']} mixed, {_short(sum(r['cache_lengths']))} tok"
    if r["mode"] == "decode":
        return f"{r['batch']}×{_short(r['seqlen_k'])}"
    if r["mode"] in VARLEN_MODES:
        return f"{r['batch']} seqs, {_short(sum(r['seqlens']))} tok"
    sk = f"/{_short(r['seqlen_k'])}" if r["seqlen_k"] != r["seqlen_q"] else ""
    return _short(r["seqlen_q"]) + sk


def _bars(ax, title, xlabel, groups, backends, colours) -> None:
    present = [b for b in backends if any(b in g for g in groups.values())]
    width = 0.8 / len(present)
    decode = any(r["mode"] == "decode" for g in groups.values() for r in g.values())
    for i, b in enumerate(present):
        xs = [x for x, g in enumerate(groups.values()) if b in g]
        picked = [g[b] for g in groups.values() if b in g]
        values = [r["tbps"] if decode else r["tflops"] for r in picked]
        bars = ax.bar([x + (i - (len(present) - 1) / 2) * width for x in xs], values, width,
                      color=colours[b], label=b, edgecolor="white", linewidth=0.3)
        for bar, r in zip(bars, picked):
            if r["refcheck"] and r["refcheck"].startswith("MISMATCH"):
                bar.set_hatch("///")
        ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=5.5, rotation=90, padding=1.5)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel("Speed (TB/s)" if decode else "Speed (TFLOP/s)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def plot(path: str, env: dict, rows: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'flashtile[bench]'") from e

    backends = list(dict.fromkeys(r["backend"] for r in rows))
    colours = {b: plt.get_cmap("tab10")(i % 10) for i, b in enumerate(backends)}
    grid: dict[tuple, dict[object, tuple]] = {}  # row key -> column key -> (title, xlabel, groups)
    for r in rows:
        if r["status"] == "ok":
            row_key, col_key, title, xlabel = _panel(r)
            panel = grid.setdefault(row_key, {}).setdefault(col_key, (title, xlabel, {}))
            panel[2].setdefault(_group(r), {})[r["backend"]] = r
    if not grid:
        raise SystemExit("--plot: no backend ran successfully, nothing to plot")

    nrows, ncols = len(grid), max(len(cols) for cols in grid.values())
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, 4.2 * nrows), squeeze=False,
                             layout="constrained")
    for ax in axes.flat:
        ax.set_visible(False)
    for axes_row, cols in zip(axes, grid.values()):
        for ax, (_, (title, xlabel, groups)) in zip(axes_row, sorted(cols.items())):
            ax.set_visible(True)
            _bars(ax, title, xlabel, groups, backends, colours)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[b]) for b in backends]
    fig.legend(handles, backends, loc="outside lower center", ncol=min(len(backends), 8), fontsize=8,
               frameon=False)
    title = [headline(env)]
    if env.get("note"):
        title.append(env["note"])
    if any((r["refcheck"] or "").startswith("MISMATCH") for r in rows):
        title.append("hatched bars: output failed --refcheck")
    fig.suptitle("\n".join(title), fontsize=10)
    fig.savefig(make_parent(path), dpi=150)
    plt.close(fig)
