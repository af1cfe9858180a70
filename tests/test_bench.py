"""flashtile.bench: FLOP and byte counts, presets, paging, the backends registry's failure paths, --refcheck,
ranking, timing, the backward modes' dout. Each test runs in well under a second on a CPU; none needs a
GPU."""

import dataclasses
import math
import sys

import pytest
import torch

from flashtile.bench import run as bench_run
from flashtile.bench.backends import BACKENDS, Backend, Prepared, Unsupported
from flashtile.bench.cases import CPU_SHAPES, DECODE_MIX, GPU_SHAPES, VARLEN_MIX, Case, build_cases, preset_runs
from flashtile.bench.inputs import make_inputs, paginate
from flashtile.bench.metrics import forward_flops, kv_bytes, timed_flops, visible_pairs
from flashtile.bench.refcheck import build_reference, check
from flashtile.bench.timing import CPU_REPS, measure

CPU = torch.device("cpu")


def brute_force_pairs(seqlen_q, seqlen_k, causal, window_size):
    left, right = window_size
    right = 0 if causal else right
    count = 0
    for i in range(seqlen_q):
        diag = i + seqlen_k - seqlen_q
        for j in range(seqlen_k):
            count += (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)
    return count


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 17), (13, 40), (40, 13), (1, 70), (5, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window_size", [(-1, -1), (3, 0), (0, 3), (4, 7), (-1, 2), (10, -1)])
def test_visible_pairs_match_the_mask(seqlen_q, seqlen_k, causal, window_size):
    assert visible_pairs(seqlen_q, seqlen_k, causal, window_size) == brute_force_pairs(
        seqlen_q, seqlen_k, causal, window_size)


def test_flops_follow_the_flash_attn_convention():
    full = Case("fwd", batch=2, seqlen_q=1024, seqlen_k=1024, nheads=16, nheads_kv=16, headdim=128)
    assert forward_flops(full) == 4 * 2 * 16 * 1024 * 1024 * 128
    causal = dataclasses.replace(full, causal=True)
    assert forward_flops(causal) == 4 * 2 * 16 * 128 * (1024 * 1025 // 2)  # exactly the kept pairs: S(S+1)/2
    assert math.isclose(forward_flops(causal) / forward_flops(full), 0.5, rel_tol=2 / 1024)
    gqa = dataclasses.replace(full, nheads_kv=2)
    assert forward_flops(gqa) == forward_flops(full)  # every query head does its own matmuls
    assert timed_flops(dataclasses.replace(full, mode="fwdbwd")) == 3.5 * forward_flops(full)
    window = dataclasses.replace(full, window_size=(255, 0))
    assert forward_flops(window) == 4 * 2 * 16 * 128 * (1024 * 256 - 255 * 256 // 2)


def test_varlen_flops_and_bytes_sum_over_sequences():
    case = Case("varlen", 3, 7, 7, nheads=4, nheads_kv=2, headdim=64, seqlens=(3, 5, 7), causal=True)
    assert forward_flops(case) == 4 * 4 * 64 * (6 + 15 + 28)
    assert kv_bytes(case) == 15 * 2 * 64 * 2 * 2  # tokens · Hk · D · (K and V) · bf16
    assert timed_flops(case) == forward_flops(case)
    both = dataclasses.replace(case, mode="varlenbwd")
    assert timed_flops(both) == 3.5 * 4 * 4 * 64 * (6 + 15 + 28)  # backward 2.5× the same per-sequence pairs


def test_mixed_decode_counts_each_cache_length():
    case = Case("decode", batch=3, seqlen_q=2, seqlen_k=50, nheads=4, nheads_kv=2, headdim=64, causal=True,
                cache_lengths=(50, 7, 20))
    assert kv_bytes(case) == 77 * 2 * 64 * 2 * 2
    assert forward_flops(case) == 4 * 4 * 64 * (99 + 13 + 39)  # causal, bottom-right: n + n - 1 pairs per sequence
    assert "kv7-50 (77 tok)" in case.label()


@pytest.mark.interpreter
def test_mixed_decode_inputs_refcheck_and_backends():
    """Each sequence's cache length reaches the kernel, rows past it are NaN (a read past it fails --refcheck),
    the reference uses each length, and SDPA, which cannot take per-sequence lengths, says so."""
    case = _cpu_case("decode", seqlen_q=1, seqlen_k=40, batch=3, cache_lengths=(40, 9, 23))
    inputs = make_inputs(case, CPU)
    assert inputs.cache_seqlens.tolist() == [40, 9, 23]
    assert inputs.k[1, 9:].isnan().all() and not inputs.k[1, :9].isnan().any()
    reference = build_reference(case, inputs)
    out = BACKENDS["flashtile"].setup(case, inputs).output()
    assert check(reference, out).ok
    wrong = out.clone()
    wrong[-1] += 0.5  # the reference checks the first and the last sequence
    assert not check(reference, wrong).ok
    row = bench_run.run_backend(case, inputs, BACKENDS["sdpa-math"], CPU, None, 10)
    assert row["status"] == "unsupported: SDPA has no per-sequence cache lengths"


def test_decode_bytes_count_k_and_v_of_every_kv_head():
    case = Case("decode", batch=8, seqlen_q=1, seqlen_k=32768, nheads=32, nheads_kv=8, headdim=128,
                dtype="fp16", page_size=64)
    assert kv_bytes(case) == 8 * 32768 * 8 * 128 * 2 * 2
    assert kv_bytes(dataclasses.replace(case, seqlen_q=4)) == kv_bytes(case)  # queries are not counted


def test_standard_sweep_is_the_papers_sweep():
    cases = build_cases(preset_runs("standard"), GPU_SHAPES, "bf16")
    assert len(cases) == 2 * 3 * 2 * 6
    assert all(c.batch * c.seqlen_q == 16384 and c.nheads * c.headdim == 2048 for c in cases)
    assert {c.headdim for c in cases} == {64, 128, 256}
    assert {c.seqlen_q for c in cases} == {512, 1024, 2048, 4096, 8192, 16384}
    assert [c.causal for c in cases[:12]] == [False] * 6 + [True] * 6  # panel by panel


def test_decode_and_varlen_presets():
    cases = build_cases(preset_runs("decode"), GPU_SHAPES, "bf16")
    assert {(c.nheads, c.nheads_kv, c.headdim) for c in cases} == {(32, 8, 128)}
    mixed = [c for c in cases if c.cache_lengths]
    assert [c.page_size for c in mixed] == [0, 256]
    assert all(c.cache_lengths == DECODE_MIX and c.batch == 16 and c.seqlen_k == max(DECODE_MIX)
               and c.seqlen_q == 1 for c in mixed)
    decode = [c for c in cases if not c.cache_lengths]
    assert all(c.batch * c.seqlen_k == 262144 for c in decode)
    assert {c.batch for c in decode} == {64, 32, 16, 8, 4, 2}
    assert {c.page_size for c in decode} == {0, 16, 64, 256} and {c.seqlen_q for c in decode} == {1, 4}
    cases = build_cases(preset_runs("varlen"), GPU_SHAPES, "bf16")
    varlen = [c for c in cases if c.varlen]
    assert [c.mode for c in varlen] == ["varlen"] * 2 + ["varlenbwd"] * 2
    assert sum(VARLEN_MIX) == 16384 and len(VARLEN_MIX) == 16
    assert min(VARLEN_MIX) == 256 and max(VARLEN_MIX) == 4096
    assert all(c.batch == 16 and c.seqlen_q == 4096 and c.seqlens == VARLEN_MIX for c in varlen)
    # The dense baseline issue 4 compares varlen with, in the same run: S = 1k, 2k and 4k at the same width.
    dense = [c for c in cases if not c.varlen]
    assert {c.mode for c in dense} == {"fwd", "fwdbwd"} and len(dense) == 2 * 3 * 2
    assert {(c.batch, c.seqlen_q, c.nheads, c.headdim) for c in dense} == {(16, 1024, 16, 128), (8, 2048, 16, 128),
                                                                         (4, 4096, 16, 128)}
    assert {c.nheads * c.headdim for c in cases} == {2048} and {c.causal for c in cases} == {False, True}


def test_bad_case_is_refused():
    with pytest.raises(ValueError, match="multiple"):
        Case("fwd", 1, 8, 8, nheads=6, nheads_kv=4, headdim=64)


def test_paginate_round_trips_and_poisons_the_tail():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 37, 3, 8, generator=g)
    k_pages, v_pages, table = paginate(k, v, page_size=16)
    assert table.dtype == torch.int32 and table.shape == (2, 3)
    assert sorted(table.flatten().tolist()) == list(range(6))
    for pages, x in ((k_pages, k), (v_pages, v)):
        gathered = pages[table.long()].flatten(1, 2)  # (B, 48, Hk, D)
        assert torch.equal(gathered[:, :37], x)
        assert gathered[:, 37:].isnan().all()


def _fake(name, setup, cpu=True):
    return Backend(name, setup, "test double", cpu=cpu)


def _cpu_case(mode="fwd", **kw):
    base = {"batch": 2, "seqlen_q": 24, "seqlen_k": 24, "nheads": 4, "nheads_kv": 2, "headdim": 16,
            "dtype": "fp32", "causal": True}
    return Case(mode, **base | kw)


def test_failing_backends_become_rows_not_crashes():
    def unsupported(case, inputs):
        raise Unsupported("no such thing")

    def broken(case, inputs):
        raise KeyError("boom")

    backends = [_fake("nope", unsupported), _fake("broken", broken), BACKENDS["sdpa-math"],
                _fake("gpu-only", unsupported, cpu=False)]
    rows = bench_run.run([_cpu_case()], backends, CPU, progress=lambda *a: None)
    status = {r["backend"]: r["status"] for r in rows}
    assert status == {"nope": "unsupported: no such thing", "broken": "error: KeyError: 'boom'",
                      "sdpa-math": "ok", "gpu-only": "unsupported: needs a CUDA GPU"}
    assert rows[2]["ms"] > 0 and rows[2]["tflops"] > 0


@pytest.mark.parametrize("mode, expected", [("fwd", "fwd=triton"),
                                            ("fwdbwd", "fwd=triton bwd_dq=triton bwd_dkdv=triton")])
@pytest.mark.interpreter
def test_flashtile_rows_say_which_kernels_ran(mode, expected):
    """The interpreter runs the Triton kernels; on an H200 the same field says gluon-sm90 where the fast path ran."""
    rows = bench_run.run([_cpu_case(mode, seqlen_q=8, seqlen_k=8)], [BACKENDS["flashtile"], BACKENDS["sdpa-math"]],
                         CPU, progress=lambda *a: None)
    assert [r["kernels"] for r in rows] == [expected, None]


def test_backends_are_set_up_first_then_timed_in_rotated_rounds():
    """Note [interleaved rounds]: every backend of a case is set up (and called once) before any is timed, and the
    rounds rotate which backend goes first; a backend that fails while timed becomes an error row, the others
    still time."""
    log = []

    def make(name, fail_on_call=None):
        def setup(case, inputs):
            log.append(("setup", name))
            calls = []

            def run():
                calls.append(1)
                if len(calls) == fail_on_call:
                    raise RuntimeError("lost the device")
                log.append((name, (len(calls) - 2) // per_round))  # round -1: the setup's call
            return Prepared(run=run, output=lambda: None)
        return _fake(name, setup)

    assert bench_run.ROUNDS == 3  # the turns below are written out for three rounds
    per_round = 1 + CPU_REPS  # the CPU timer's warm-up call and its repetitions
    rows = bench_run.run([_cpu_case()], [make("a"), make("b"), make("c", fail_on_call=2 + per_round)], CPU,
                         progress=lambda *a: None)
    assert log[:6] == [("setup", "a"), ("a", -1), ("setup", "b"), ("b", -1), ("setup", "c"), ("c", -1)]
    turns = [entry for i, entry in enumerate(log[6:], 6) if entry != log[i - 1]]  # (backend, round) in order
    # Rounds a-b-c, b-c-a, c-a-b; c fails on the first call of its second round and sits out the rest.
    assert turns == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    status = {r["backend"]: r["status"] for r in rows}
    assert status == {"a": "ok", "b": "ok", "c": "error: RuntimeError: lost the device"}
    assert all(r["ms"] > 0 for r in rows if r["status"] == "ok")


def test_rows_are_handed_over_after_every_case():
    seen = []
    cases = [_cpu_case(), dataclasses.replace(_cpu_case(), causal=not _cpu_case().causal)]
    rows = bench_run.run(cases, [BACKENDS["sdpa-math"]], CPU, progress=lambda *a: None,
                         on_case=lambda rows: seen.append(len(rows)))
    assert seen == [1, 2] and len(rows) == 2


def test_missing_library_is_unsupported(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` raise ImportError
    row = bench_run.run_backend(_cpu_case(), make_inputs(_cpu_case(), CPU), dataclasses.replace(
        BACKENDS["fa2"], cpu=True), CPU, None, 10)
    assert row["status"].startswith("unsupported: flash_attn not importable")


def test_sdpa_refuses_what_it_cannot_do():
    case = _cpu_case("decode", seqlen_q=1, seqlen_k=40, page_size=16)
    row = bench_run.run_backend(case, make_inputs(case, CPU), BACKENDS["sdpa-math"], CPU, None, 10)
    assert row["status"] == "unsupported: SDPA has no paged KV cache"


@pytest.mark.parametrize("mode,kw", [
    ("fwd", {}), ("fwd", {"seqlen_q": 9}), ("decode", {"seqlen_q": 1}),
    ("decode", {"seqlen_q": 4, "seqlen_k": 50}),
    # CPU torch has no causal SDPA on nested tensors, and nested SDPA has no GQA.
    ("varlen", {"seqlens": (5, 24, 11), "batch": 3, "nheads_kv": 4, "causal": False}),
])
def test_refcheck_passes_sdpa_and_flags_a_wrong_answer(mode, kw):
    case = _cpu_case(mode, **kw)
    inputs = make_inputs(case, CPU)
    reference = build_reference(case, inputs)
    prepared = BACKENDS["sdpa-math"].setup(case, inputs)
    assert check(reference, prepared.output()).ok
    wrong = prepared.output().clone()
    wrong[-1, ..., -1, :] += 0.5  # the last batch's (or sequence's) last head: both ends are checked
    verdict = check(reference, wrong)
    assert not verdict.ok and str(verdict).startswith("MISMATCH")


def test_refcheck_mismatch_is_reported_and_not_a_time_to_beat():
    def halved(case, inputs):
        prepared = BACKENDS["sdpa-math"].setup(case, inputs)
        return Prepared(prepared.run, lambda: prepared.output() * 0.5)

    def flashtile_double(case, inputs):
        return BACKENDS["sdpa-math"].setup(case, inputs)

    backends = [_fake("flashtile", flashtile_double), _fake("fast-but-wrong", halved)]
    rows = bench_run.run([_cpu_case()], backends, CPU, refcheck=True, progress=lambda *a: None)
    assert rows[0]["refcheck"] == "ok" and rows[1]["refcheck"].startswith("MISMATCH")
    assert rows[0]["vs_best"] is None  # the only other backend failed the check


def test_compare_ranks_flashtile_against_the_fastest_other_backend():
    rows = [{"backend": b, "status": s, "ms": ms, "refcheck": rc} for b, s, ms, rc in (
        ("flashtile", "ok", 2.0, "ok"), ("a", "ok", 3.0, "ok"), ("b", "ok", 2.5, None),
        ("c", "unsupported: x", None, None), ("d", "ok", 1.0, "MISMATCH 1>0"))]
    bench_run.compare(rows)
    assert rows[0]["vs_best"] == 1.25 and rows[0]["best_other"] == "b"


def test_cpu_timing_reports_ordered_quantiles():
    calls = []
    t = measure(lambda: calls.append(sum(range(1000))), (), CPU)
    assert len(calls) >= 4 and 0 < t.p20 <= t.ms <= t.p80


def test_cpu_presets_are_small():
    cases = build_cases([*preset_runs("all"), *preset_runs("varlen")], CPU_SHAPES, "fp16")
    assert {c.mode for c in cases} == {"fwd", "fwdbwd", "decode", "varlen", "varlenbwd"}
    assert max(c.seqlen_k for c in cases) <= 256 and max(c.nheads * c.batch for c in cases) <= 8


@pytest.mark.interpreter
def test_varlen_backward_feeds_each_backend_the_same_dout():
    """Both backends' dq from their own layouts of one dout: the same gradient, so the same timed work."""
    case = _cpu_case("varlenbwd", seqlens=(5, 19), batch=2, nheads=2, nheads_kv=2, causal=False)
    inputs = make_inputs(case, CPU)
    assert inputs.dout.shape == inputs.q.shape
    grads = {}
    for name in ("flashtile", "sdpa-math"):
        prepared = BACKENDS[name].setup(case, inputs)
        prepared.run()
        q, k, v = prepared.leaves
        assert k.grad is not None and v.grad is not None
        grads[name] = q.grad.transpose(1, 2).values() if q.grad.is_nested else q.grad
    torch.testing.assert_close(grads["flashtile"], grads["sdpa-math"], atol=1e-4, rtol=1e-4)


def test_dropout_preset_pairs_each_shape_with_and_without_dropout():
    """The dropout preset times each shape at dropout_p 0 and 0.1 in one run (dropout's cost on the same kernels);
    backends without dropout refuse its cases, and --refcheck skips them (each backend draws its own mask)."""
    cases = build_cases(preset_runs("dropout"), GPU_SHAPES, "bf16")
    assert {c.mode for c in cases} == {"fwdbwd"} and {c.headdim for c in cases} == {64, 128}
    assert {c.dropout_p for c in cases} == {0.0, 0.1}
    plain = {dataclasses.replace(c, dropout_p=0.0) for c in cases}
    assert len(plain) * 2 == len(cases)
    dropped = next(c for c in cases if c.dropout_p)
    assert "dropout 0.1" in dropped.label()
    small = dataclasses.replace(dropped, batch=1, seqlen_q=8, seqlen_k=8, nheads=2, nheads_kv=2)
    inputs = make_inputs(small, CPU)
    for name in ("flex", "fa4", "sdpa-cudnn"):
        with pytest.raises(Unsupported, match="dropout"):
            BACKENDS[name].setup(small, inputs)
    assert build_reference(small, inputs) is None
    assert all(c.dropout_p == 0.0 for c in build_cases(preset_runs("decode"), GPU_SHAPES, "bf16", dropout_p=0.1))


def test_speeds_get_readable_units():
    from flashtile.bench.report import _scaled
    assert _scaled(473.0, "FLOP/s") == "473 TFLOP/s"
    assert _scaled(3.264e-5, "FLOP/s") == "32.64 MFLOP/s"
    assert _scaled(6e-7, "B/s") == "600 kB/s"


@pytest.mark.interpreter
def test_sdpa_math_runs_causal_varlen():
    """The math backend's nested-tensor path has no causal mask; the bench runs it a sequence at a time."""
    case = _cpu_case("varlen", seqlens=(5, 19), batch=2, nheads=4, nheads_kv=2, causal=True)
    inputs = make_inputs(case, CPU)
    ours = BACKENDS["flashtile"].setup(case, inputs).output()
    theirs = BACKENDS["sdpa-math"].setup(case, inputs).output()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_flops_count_v_head_dim_separately():
    """2·(D + Dv) per visible pair and head: QKᵀ over D, PV over Dv."""
    mla = Case("fwd", batch=2, seqlen_q=1024, seqlen_k=1024, nheads=16, nheads_kv=16, headdim=192, headdim_v=128)
    assert forward_flops(mla) == 2 * 2 * 16 * 1024 * 1024 * (192 + 128) == 21474836480
    causal = dataclasses.replace(mla, causal=True)
    assert forward_flops(causal) == 2 * 2 * 16 * (192 + 128) * (1024 * 1025 // 2)
    assert timed_flops(dataclasses.replace(mla, mode="fwdbwd")) == 3.5 * 21474836480
    same = dataclasses.replace(mla, headdim=128, headdim_v=128)  # Dv = D: the papers' 4·D
    assert forward_flops(same) == forward_flops(dataclasses.replace(same, headdim_v=0)) == 4 * 2 * 16 * 1024**2 * 128


def test_absorbed_decode_reads_its_cache_once():
    """DeepSeek's absorbed cache: 576 channels a token, V the first 512 of them, counted once."""
    case = Case("decode", batch=4, seqlen_q=1, seqlen_k=4096, nheads=128, nheads_kv=1, headdim=576, headdim_v=512,
                page_size=64)
    assert case.absorbed and "d576/512" in case.label() and "absorbed" in case.label()
    assert kv_bytes(case) == 4 * 4096 * 576 * 2 == 18874368
    mixed = dataclasses.replace(case, batch=3, cache_lengths=(4096, 100, 7))
    assert kv_bytes(mixed) == (4096 + 100 + 7) * 576 * 2
    # Two KV heads, or a v as wide as k, are separate caches: K and V each read.
    separate = dataclasses.replace(case, nheads_kv=2)
    assert not separate.absorbed and kv_bytes(separate) == 4 * 4096 * 2 * (576 + 512) * 2
    assert not dataclasses.replace(case, headdim_v=0).absorbed
    assert not dataclasses.replace(case, mode="fwd").absorbed
    assert case.fields()["absorbed"] is True and case.fields()["headdim_v"] == 512


def test_model_presets_build_their_cases():
    sinks = build_cases(preset_runs("sinks"), GPU_SHAPES, "bf16")
    assert [c.mode for c in sinks] == ["fwd"] * 8 + ["fwdbwd"] * 8
    assert [c.sink for c in sinks] == [False, True] * 8  # each shape with and without, side by side
    assert all(dataclasses.replace(a, sink=True) == b for a, b in zip(sinks[::2], sinks[1::2]))
    assert {(c.nheads, c.nheads_kv, c.headdim) for c in sinks} == {(64, 8, 64), (32, 8, 128)}  # gpt-oss at d64
    assert {(c.batch, c.seqlen_q) for c in sinks} == {(4, 4096), (1, 16384)} and all(c.causal for c in sinks)
    assert sinks[1].label() == "b4 s4096 h64/8 d64 bf16 causal sink"

    mla = build_cases(preset_runs("mla"), GPU_SHAPES, "bf16")
    assert [c.mode for c in mla] == ["fwd"] * 8 + ["fwdbwd"] * 8
    assert {(c.headdim, c.headdim_v, c.nheads) for c in mla[:4]} == {(192, 128, 16)}
    assert {(c.headdim, c.headdim_v, c.nheads) for c in mla[4:8]} == {(128, 0, 16)}  # the dense baseline
    assert {(c.batch, c.seqlen_q, c.causal) for c in mla[:4]} == {(c.batch, c.seqlen_q, c.causal) for c in mla[4:8]}
    assert {(c.batch, c.seqlen_q) for c in mla} == {(4, 4096), (1, 16384)}
    assert mla[0].label() == "b4 s4096 h16 d192/128 bf16" and mla[4].label() == "b4 s4096 h16 d128 bf16"

    d512 = build_cases(preset_runs("d512"), GPU_SHAPES, "bf16")
    assert {(c.headdim, c.nheads) for c in d512} == {(256, 8), (512, 4)} and len(d512) == 2 * 2 * 2 * 2
    assert {c.seqlen_q for c in d512} == {4096, 16384} and {c.causal for c in d512} == {False, True}

    decode = build_cases(preset_runs("mla-decode"), GPU_SHAPES, "bf16")
    assert {c.nheads for c in decode} == {16, 128}
    assert all(c.absorbed and (c.nheads_kv, c.headdim, c.dv, c.seqlen_q) == (1, 576, 512, 1)
               for c in decode)
    assert {(c.batch, c.seqlen_k) for c in decode} == {(b, s) for b in (16, 32, 64)
                                                       for s in (4096, 8192, 16384, 32768)}
    assert sorted((c.nheads, c.page_size) for c in decode) == [(h, p) for h in (16, 128) for p in (0, 64)
                                                               for _ in range(12)]

    # The CPU twins: the same structure at toy sizes, the real head dims where the kernels depend on them.
    twins = {p: build_cases(preset_runs(p), CPU_SHAPES, "fp16") for p in ("sinks", "mla", "d512", "mla-decode")}
    assert [c.sink for c in twins["sinks"]] == [False, True] * 2
    assert [(c.headdim, c.dv) for c in twins["mla"]] == ([(32, 16)] * 2 + [(16, 16)] * 2) * 2  # fwd, then fwdbwd
    assert {c.headdim for c in twins["d512"]} == {256, 512}
    assert all(c.absorbed and (c.headdim, c.dv) == (576, 512) for c in twins["mla-decode"])
    assert [c.page_size for c in twins["mla-decode"]] == [0, 16]
    cases = [c for t in twins.values() for c in t]
    assert max(c.seqlen_k for c in cases) <= 64 and max(c.nheads * c.batch for c in cases) <= 16


def test_model_shape_inputs():
    """v and dout take v's head dim; an absorbed cache is one storage, paged too; a sink changes nothing else."""
    mla = _cpu_case("fwdbwd", headdim=32, headdim_v=16)
    inputs = make_inputs(mla, CPU)
    assert inputs.k.shape[-1] == 32 and inputs.v.shape[-1] == 16 and inputs.dout.shape == (2, 24, 4, 16)
    assert inputs.sink is None
    sink = make_inputs(dataclasses.replace(mla, sink=True), CPU)
    assert sink.sink.dtype == torch.float32 and sink.sink.shape == (4,)
    for a, b in ((inputs.q, sink.q), (inputs.k, sink.k), (inputs.v, sink.v), (inputs.dout, sink.dout)):
        assert torch.equal(a, b)
    decode = _cpu_case("decode", seqlen_q=1, seqlen_k=40, nheads=8, nheads_kv=1, headdim=576, headdim_v=512)
    inputs = make_inputs(decode, CPU)
    assert inputs.v.data_ptr() == inputs.k.data_ptr() and torch.equal(inputs.v, inputs.k[..., :512])
    k_pages, v_pages, table = paginate(inputs.k, inputs.v, page_size=16)
    assert v_pages.data_ptr() == k_pages.data_ptr() and v_pages.shape[-1] == 512
    assert torch.equal(k_pages[table.long()].flatten(1, 2)[:, :40], inputs.k)
    apart = make_inputs(dataclasses.replace(decode, nheads_kv=2), CPU)  # not absorbed: two caches
    assert apart.v.data_ptr() != apart.k.data_ptr() and apart.v.is_contiguous()
    k_pages, v_pages, table = paginate(apart.k, apart.v, page_size=16)
    assert v_pages.data_ptr() != k_pages.data_ptr() and torch.equal(v_pages[table.long()].flatten(1, 2)[:, :40],
                                                                     apart.v)


@pytest.mark.parametrize("preset", ["sinks", "mla", "d512", "mla-decode"])
@pytest.mark.interpreter
def test_flashtile_runs_the_model_presets(preset, monkeypatch):
    """Every CPU case of the preset through `run` with --refcheck: flashtile runs it and matches the reference."""
    from flashtile.bench import timing

    monkeypatch.setattr(timing, "CPU_REPS", 1)  # the rows, not the timings, are under test
    cases = build_cases(preset_runs(preset), CPU_SHAPES, "fp16")
    rows = bench_run.run(cases, [BACKENDS["flashtile"]], CPU, refcheck=True, progress=lambda *a: None)
    assert [(r["case"], r["status"], r["refcheck"]) for r in rows] == [(c.label(), "ok", "ok") for c in cases]
    for r, c in zip(rows, cases):
        assert r["tflops"] == pytest.approx(timed_flops(c) / (r["ms"] * 1e-3) / 1e12)
        assert (r["headdim_v"], r["sink"], r["absorbed"]) == (c.headdim_v, c.sink, c.absorbed)
        if c.mode == "decode":
            assert r["tbps"] == pytest.approx(kv_bytes(c) / (r["ms"] * 1e-3) / 1e12)


@pytest.mark.interpreter
def test_refcheck_holds_sinks_and_v_head_dims_to_the_reference():
    """The reference takes the sink and Dv: flashtile without its sink, or a wrong v channel, fails it."""
    case = _cpu_case("fwd", headdim=32, headdim_v=16, sink=True)
    inputs = make_inputs(case, CPU)
    inputs.sink += 2.0  # sinks that take a visible share of each row
    reference = build_reference(case, inputs)
    out = BACKENDS["flashtile"].setup(case, inputs).output()
    assert out.shape == (2, 24, 4, 16) and check(reference, out).ok
    no_sink = BACKENDS["flashtile"].setup(dataclasses.replace(case, sink=False), inputs).output()
    assert not check(reference, no_sink).ok
    wrong = out.clone()
    wrong[-1, ..., -1, -1] += 0.5  # the last channel of v's head dim is checked
    assert not check(reference, wrong).ok


def test_other_backends_refuse_what_they_cannot_run():
    case = _cpu_case("fwd", sink=True)
    inputs = make_inputs(case, CPU)
    row = bench_run.run_backend(case, inputs, BACKENDS["sdpa-math"], CPU, None, 10)
    assert row["status"] == "unsupported: SDPA has no learnable sinks"
    for name in ("fa2", "flex", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient"):
        with pytest.raises(Unsupported, match="sink"):
            BACKENDS[name].setup(case, inputs)
    mla = _cpu_case("fwd", headdim=32, headdim_v=16)
    with pytest.raises(Unsupported, match="v's head dim"):
        BACKENDS["fa2"].setup(mla, make_inputs(mla, CPU))
    wide = _cpu_case("fwd", headdim=512, seqlen_q=8, seqlen_k=8)
    with pytest.raises(Unsupported, match="up to 256"):
        BACKENDS["fa2"].setup(wide, make_inputs(wide, CPU))


def test_fa4_gets_the_sink(monkeypatch):
    """FlashAttention-4's flash_attn_func takes learnable_sink: the bench hands it the case's sink logits."""
    from flashtile.bench import backends
    seen = []

    def func(q, k, v, **kw):
        seen.append(kw)
        return q, None

    monkeypatch.setattr(backends, "_api", lambda module, *names: [func, func])
    case = _cpu_case("fwd", sink=True)
    inputs = make_inputs(case, CPU)
    BACKENDS["fa4"].setup(case, inputs).run()
    assert seen and seen[-1]["learnable_sink"] is inputs.sink and inputs.sink.dtype == torch.float32


def test_sdpa_math_takes_a_v_head_dim_of_its_own():
    """SDPA's math backend computes 192/128-style attention (here 32/16) and passes the reference."""
    case = _cpu_case("fwd", headdim=32, headdim_v=16)
    inputs = make_inputs(case, CPU)
    out = BACKENDS["sdpa-math"].setup(case, inputs).output()
    assert out.shape == (2, 24, 4, 16) and check(build_reference(case, inputs), out).ok


def test_plot_panels_keep_sinks_and_v_head_dims_apart():
    from flashtile.bench.plot import _panel

    cases = (_cpu_case(headdim=64), _cpu_case(headdim=64, sink=True), _cpu_case(headdim=64, headdim_v=32))
    plain, sink, mla = (_panel(c.fields()) for c in cases)
    assert plain[:2] != sink[:2] and "sink" in sink[2]
    assert plain[:2] != mla[:2] and "head dim 64/32" in mla[2]
