"""The `flashtile` command: argument parsing into cases and backends, the interpreter switch, and a tiny CPU
run of `bench` and `demo` that writes JSON, CSV and PNG."""

import csv
import json
import os
import subprocess
import sys

import pytest

import flashtile
from flashtile import cli


def select(argv, gpu=True):
    parser = cli.build_parser()
    return cli.select(parser, parser.parse_args(["bench", *argv]), gpu)


def test_presets_and_defaults():
    cases, backends = select([])
    assert {c.mode for c in cases} == {"fwd", "fwdbwd"} and len(cases) == 72
    assert [b.name for b in backends][:2] == ["flashtile", "fa4"] and len(backends) == 8
    cases, backends = select([], gpu=False)
    assert {c.mode for c in cases} == {"fwd", "fwdbwd", "decode", "varlen", "varlenbwd"}
    assert {b.name for b in backends} == {"flashtile", "sdpa-math"} and {c.dtype for c in cases} == {"fp16"}
    assert {c.mode for c in select(["--preset", "decode"])[0]} == {"decode"}


def test_flags_replace_single_axes():
    cases, _ = select(["--preset", "standard", "--head-dim", "128", "--no-causal", "--mode", "fwd"])
    assert len(cases) == 6 and {(c.headdim, c.nheads, c.causal) for c in cases} == {(128, 16, False)}
    cases, _ = select(["--preset", "decode", "--seqlen-k", "8192,65536", "--page-size", "0",
                       "--seqlen-q", "1"])
    assert [(c.batch, c.seqlen_k, c.page_size) for c in cases] == [(32, 8192, 0), (4, 65536, 0)]


def test_varlen_preset_runs_its_dense_baseline_too():
    cases, _ = select(["--preset", "varlen", "--no-causal"])
    assert [(c.mode, c.seqlen_q) for c in cases] == [("varlen", 4096), ("fwd", 1024), ("fwd", 2048), ("fwd", 4096),
                                                     ("varlenbwd", 4096), ("fwdbwd", 1024), ("fwdbwd", 2048),
                                                     ("fwdbwd", 4096)]
    # --mode keeps the preset's shapes for the modes it has, and a mode's own sweep otherwise.
    cases, _ = select(["--preset", "varlen", "--mode", "fwdbwd"])
    assert {(c.mode, c.batch, c.seqlen_q) for c in cases} == {("fwdbwd", 16, 1024), ("fwdbwd", 8, 2048),
                                                              ("fwdbwd", 4, 4096)}
    cases, _ = select(["--mode", "varlenbwd", "--seqlens", "100,28", "--head-dim", "64"])
    assert [(c.mode, c.seqlens, c.nheads) for c in cases] == [("varlenbwd", (100, 28), 32)] * 2


def test_a_fully_specified_custom_case():
    argv = ["--mode", "fwd", "fwdbwd", "--batch", "3", "--seqlen", "100", "--seqlen-k", "300", "--heads", "8",
            "--kv-heads", "2", "--head-dim", "96", "--dtype", "fp16", "--causal", "--window", "64,0",
            "--softcap", "30", "--backends", "flashtile,sdpa-flash"]
    cases, backends = select(argv)
    assert [b.name for b in backends] == ["flashtile", "sdpa-flash"]
    assert [c.mode for c in cases] == ["fwd", "fwdbwd"]
    c = cases[0]
    assert (c.batch, c.seqlen_q, c.seqlen_k, c.nheads, c.nheads_kv, c.headdim) == (3, 100, 300, 8, 2, 96)
    assert (c.dtype, c.causal, c.window_size, c.softcap) == ("fp16", True, (64, 0), 30.0)


def test_model_presets_and_their_flags():
    cases, _ = select(["--preset", "mla"])
    assert [(c.mode, c.headdim, c.headdim_v) for c in cases[::4]] == [("fwd", 192, 128), ("fwd", 128, 0),
                                                                       ("fwdbwd", 192, 128), ("fwdbwd", 128, 0)]
    # --mode keeps every sweep the preset runs the mode over: MLA's and its baseline's.
    cases, _ = select(["--preset", "mla", "--mode", "fwdbwd"])
    assert {(c.mode, c.headdim) for c in cases} == {("fwdbwd", 192), ("fwdbwd", 128)} and len(cases) == 8
    cases, _ = select(["--preset", "sinks", "--no-sink", "--head-dim", "64"])
    assert len(cases) == 4 and not any(c.sink for c in cases)
    cases, _ = select(["--mode", "fwd", "--head-dim", "192", "--head-dim-v", "128", "--sink", "--seqlen", "4096",
                       "--causal"])
    assert [(c.headdim, c.dv, c.sink, c.causal, c.nheads) for c in cases] == [(192, 128, True, True, 10)]
    assert cases[0].label() == "b4 s4096 h10 d192/128 bf16 causal sink"
    cases, _ = select(["--preset", "mla-decode", "--batch", "8", "--seqlen-k", "4096", "--page-size", "64"])
    assert [(c.batch, c.seqlen_k, c.page_size, c.absorbed, c.nheads) for c in cases] == [(8, 4096, 64, True, 16),
                                                                                         (8, 4096, 64, True, 128)]
    cases, _ = select(["--preset", "d512", "--mode", "fwd", "--no-causal", "--seqlen", "4096"])
    assert [(c.headdim, c.nheads) for c in cases] == [(256, 8), (512, 4)]


@pytest.mark.interpreter
def test_tiny_cpu_mla_decode_run(tmp_path):
    """The absorbed-cache preset end to end: flashtile checked against the reference, TB/s of the cache read once,
    the layout in the JSON rows."""
    path = tmp_path / "mla.json"
    argv = ["bench", "--preset", "mla-decode", "--refcheck", "--backends", "flashtile,sdpa-math", "--json", str(path)]
    assert cli.main(argv) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["backend"], r["page_size"], r["status"]) for r in rows] == [
        ("flashtile", 0, "ok"), ("sdpa-math", 0, "ok"), ("flashtile", 16, "ok"),
        ("sdpa-math", 16, "unsupported: SDPA has no paged KV cache")]
    for r in rows[:3]:
        assert r["refcheck"] == "ok" and r["absorbed"] and (r["headdim"], r["headdim_v"]) == (576, 512)
        assert r["tbps"] == pytest.approx(2 * 40 * 576 * 2 / (r["ms"] * 1e-3) / 1e12)  # the cache, read once


@pytest.mark.parametrize("argv,message", [
    (["--mode", "sideways"], "unknown mode"),
    (["--backends", "flashtile,nope"], "unknown backend"),
    (["--heads", "6", "--kv-heads", "4"], "multiple"),
])
def test_bad_arguments_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit):
        select(argv)
    assert message in capsys.readouterr().err


def test_interpreter_switch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cli._interpret(["bench"]) is True
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    # This process imported flashtile's kernels already (conftest + `import flashtile`): it cannot switch now.
    with pytest.raises(SystemExit, match="TRITON_INTERPRET"):
        cli._interpret(["bench"])


@pytest.mark.interpreter
def test_the_script_restarts_itself_into_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # as on a machine without a GPU
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(flashtile.__file__)),
                                         env.get("PYTHONPATH", "")])
    argv = ["bench", "--mode", "fwd", "--batch", "1", "--seqlen", "16", "--heads", "1", "--head-dim", "16",
            "--backends", "flashtile"]
    out = subprocess.run([sys.executable, "-m", "flashtile", *argv], env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    # A kernel decorated for the GPU cannot take CPU tensors: the flashtile row (and so the exit status) is ok
    # only if the process restarted with the interpreter on.
    assert out.returncode == 0, out.stdout + out.stderr
    assert "CPU demonstration" in out.stdout


def test_list_backends(capsys):
    assert cli.main(["bench", "--list-backends"]) == 0
    assert "flashtile" in capsys.readouterr().out


@pytest.mark.interpreter
def test_tiny_cpu_run_writes_json_csv_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    paths = {ext: tmp_path / f"out.{ext}" for ext in ("json", "csv", "png")}
    argv = ["bench", "--mode", "fwd", "--batch", "1", "--seqlen", "32", "--heads", "2", "--head-dim", "32",
            "--causal", "--refcheck", "--backends", "sdpa-math,flashtile", "--meta", "run=test",
            "--json", str(paths["json"]), "--csv", str(paths["csv"]), "--plot", str(paths["png"])]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "CPU demonstration" in printed and "sdpa-math" in printed

    record = json.loads(paths["json"].read_text())
    env = record["environment"]
    assert env["run"] == "test" and env["torch"] and env["triton"]
    assert env["flashtile"] == flashtile.__version__
    assert "CPU demonstration" in env["note"]
    rows = {r["backend"]: r for r in record["rows"]}
    assert set(rows) == {"sdpa-math", "flashtile"}
    math_row = rows["sdpa-math"]
    assert math_row["status"] == "ok" and math_row["refcheck"] == "ok" and math_row["ms"] > 0
    assert (math_row["mode"], math_row["seqlen_q"], math_row["causal"]) == ("fwd", 32, True)
    if rows["flashtile"]["status"] == "ok":
        assert rows["flashtile"]["best_other"] == "sdpa-math"

    with open(paths["csv"]) as f:
        table = list(csv.DictReader(f))
    assert len(table) == 2 and {"backend", "ms", "tflops", "gpu", "git_sha"} <= set(table[0])
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    merged = tmp_path / "merged.csv"  # --load: two saved runs reported as one, nothing rerun
    assert cli.main(["bench", "--load", str(paths["json"]), str(paths["json"]), "--csv", str(merged)]) == 0
    with open(merged) as f:
        assert len(list(csv.DictReader(f))) == 4

    # --results appends to the long-format table: one line per (case, backend, metric) of each row that ran.
    results = tmp_path / "results.csv"
    for _ in range(2):
        assert cli.main(["bench", "--load", str(paths["json"]), "--results", str(results)]) == 0
    with open(results) as f:
        lines = list(csv.DictReader(f))
    ran = [r for r in record["rows"] if r["status"] == "ok"]
    per_run = sum(1 for r in ran for m in ("ms", "p20", "p80", "tflops", "tbps") if r[m] is not None)
    assert len(lines) == 2 * per_run and per_run > 0
    first = lines[0]
    assert first["git_sha"] == env["git_sha"] and first["metric"] == "ms" and float(first["value"]) > 0
    assert {r["backend"] for r in lines} == {r["backend"] for r in ran}


def test_tiny_cpu_varlen_preset_writes_json_and_png(tmp_path):
    pytest.importorskip("matplotlib")
    paths = {ext: tmp_path / f"varlen.{ext}" for ext in ("json", "png")}
    argv = ["bench", "--preset", "varlen", "--seqlens", "9,24", "--seqlen", "16", "--heads", "1",
            "--head-dim", "16", "--no-causal", "--refcheck", "--backends", "flashtile,sdpa-math",
            "--json", str(paths["json"]), "--plot", str(paths["png"])]
    assert cli.main(argv) == 0
    rows = json.loads(paths["json"].read_text())["rows"]
    assert [r["mode"] for r in rows[::2]] == ["varlen", "fwd", "varlenbwd", "fwdbwd"]  # one run, both kinds
    assert all(r["status"] == "ok" and r["refcheck"] == "ok" for r in rows)
    flops = 3.5 * 4 * 1 * 16 * (9 * 9 + 24 * 24)  # 3.5 × forward, each sequence its own pairs
    for r in (r for r in rows if r["mode"] == "varlenbwd"):
        assert r["seqlens"] == [9, 24] and r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_on_cpu(capsys):
    if not hasattr(flashtile, "flash_attn_func"):
        pytest.skip("flashtile.flash_attn_func not built yet")
    assert cli.main(["demo", "--seqlen", "40", "--heads", "1", "--head-dim", "32"]) == 0
    out = capsys.readouterr().out
    for name in ("out", "lse", "dq", "dk", "dv", "forward+backward"):
        assert name in out


def test_bare_command_prints_the_help(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    assert "usage: flashtile" in out and "warmup" in out and "info" in out


def test_every_option_has_help_text():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    missing = [f"{name} {' / '.join(a.option_strings)}" for name, sub in subparsers.items() for a in sub._actions
               if a.option_strings and a.help is None]
    assert not missing, f"options without help text: {missing}"


def test_info_text_and_json(capsys):
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert "tested with" in text and "gluon-sm90" in text and "why not Gluon" in text
    assert cli.main(["info", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    rows = record["coverage"]["rows"]
    assert {r["feature"] for r in rows} == {"dense", "causal/window", "softcap/alibi", "varlen", "learnable sink",
                                           "attention chunk", "dropout", "paged"}
    assert {r["dtype"] for r in rows} == {"fp16", "bf16", "fp32"}
    by_key = {(r["dtype"], r["head_dim"], r["feature"]): r for r in rows}
    if record["environment"]["gpu"] is None:  # the table describes an sm_90 GPU
        assert by_key[("bf16", 128, "dense")]["path"] == "gluon-sm90"
        assert "softcap" in by_key[("bf16", 128, "softcap/alibi")]["why"]
        assert by_key[("bf16", 128, "learnable sink")]["path"] == "gluon-sm90"
        assert by_key[("bf16", 128, "attention chunk")]["path"] == "gluon-sm90"
        dropout = by_key[("bf16", 128, "dropout")]  # Note [dropout on the Gluon path]
        assert dropout["path"] == "gluon-sm90 (bwd_dkdv: triton)" and "dK/dV" in dropout["why"]
        assert dropout["tiles"]["fwd"] == by_key[("bf16", 128, "dense")]["tiles"]["fwd"]
        assert "w" in dropout["tiles"]["bwd_dkdv"]  # a Triton tile: its warps
        assert by_key[("fp32", 128, "dense")]["path"] == "triton"
        assert by_key[("bf16", 192, "varlen")]["path"] == "gluon-sm90"  # MLA prefill's 192/128
        assert by_key[("bf16", 192, "varlen")]["tiles"]["bwd_dkdv"] == "32x64 s3"
    assert "decode" in by_key[("fp16", 64, "paged")]["tiles"]


def test_warmup_runs_each_class(capsys):
    argv = ["warmup", "--head-dim", "16", "--dtype", "fp16", "--heads", "2", "--groups", "2", "--causal", "--json"]
    assert cli.main(argv) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert (record["head_dim"], record["group"], record["causal"], record["backward"]) == (16, 2, True, True)
    assert record["kernels"]["bwd_dkdv"] in ("triton", "gluon-sm90")
    from flashtile import env
    assert record["compiled"] is not env.INTERPRET
