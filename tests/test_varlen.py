"""flash_attn_varlen_func and its packed variants: ragged batches against per-sequence fp64 references.

Every sequence of a packed batch must come out as if it had been computed alone: the fp64 oracle runs per
sequence (testing.attention_ref) with flash-attn's tolerance rule (test_attention.py), and the dense kernel run on
each sequence alone must agree bit for bit, forward and backward. Inputs are carved out of NaN-filled buffers, so
a read past a sequence's rows, or of another sequence's, shows up as NaN or as a wrong value. The GPU tier
(`-m gpu`) runs real sizes, a > 2^31-element batch and the no-synchronisation guarantee.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

import flashtile
from flashtile.kernels.seqlen import tile_coords
from flashtile.testing import (accumulation_floor, attention_ref, check_close, cu_seqlens, nan_guarded, op_args,
                               varlen_inputs)

MASKS = {  # name -> (causal, window_size)
    "none": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "window": (False, (6, 3)),
    "causal_window": (True, (10, -1)),
}


def packed(lengths, nheads, head_dim, dtype, device, g) -> torch.Tensor:
    return nan_guarded((sum(lengths), nheads, head_dim), dtype, device, g)


def reference(q, k, v, lens_q, lens_k, used_q=None, used_k=None, alibi_slopes=None, upcast=True, dout=None,
              **kw):
    """Per-sequence attention_ref, packed back: (out (total_q, H, D), lse (H, total_q)), and with dout the
    accumulation floors (testing.accumulation_floor) of out, lse, dq, dk and dv, packed the same way. Rows past
    used_q[b] are 0 with lse +inf and depend on nothing; keys past used_k[b] are not attended to."""
    outs, lses = [], []
    floors = {name: [] for name in ("out", "lse", "dq", "dk", "dv")}
    q0 = k0 = 0
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        uq = sq if used_q is None else used_q[b]
        uk = sk if used_k is None else used_k[b]
        slopes = None if alibi_slopes is None else alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes
        out = q.new_zeros((sq, q.shape[1], q.shape[2]))
        lse = torch.full((q.shape[1], sq), float("inf"), device=q.device, dtype=torch.float64 if upcast else
                         torch.float32)
        f64 = dict(dtype=torch.float64, device=q.device)
        seq_floors = {"out": torch.zeros(out.shape, **f64), "dq": torch.zeros(out.shape, **f64),
                      "lse": torch.zeros(q.shape[1], sq, **f64), "dk": torch.zeros((sk, *k.shape[1:]), **f64),
                      "dv": torch.zeros((sk, *k.shape[1:]), **f64)}
        if uq > 0:
            qs, ks, vs = q[None, q0:q0 + uq], k[None, k0:k0 + uk], v[None, k0:k0 + uk]
            o, s, probs = attention_ref(qs, ks, vs, alibi_slopes=slopes, upcast=upcast, return_probs=True, **kw)
            out = torch.cat([o[0], out[uq:]])
            lse = torch.cat([s[0], lse[:, uq:]], dim=1)
            if dout is not None:
                f = accumulation_floor(qs, ks, vs, dout[None, q0:q0 + uq], o, probs)
                seq_floors["out"][:uq] = f["out"][0]
                seq_floors["dq"][:uq] = f["dq"][0]
                seq_floors["lse"][:, :uq] = f["lse"][0]
                seq_floors["dk"][:uk] = f["dk"][0]
                seq_floors["dv"][:uk] = f["dv"][0]
        outs.append(out)
        lses.append(lse)
        for name in floors:
            floors[name].append(seq_floors[name])
        q0, k0 = q0 + sq, k0 + sk
    result = torch.cat(outs), torch.cat(lses, dim=1)
    if dout is None:
        return result
    return (*result, {name: torch.cat(parts, dim=1 if name == "lse" else 0) for name, parts in floors.items()})


def run_varlen(device, lens_q, lens_k, nheads=2, nheads_kv=2, head_dim=32, dtype=torch.float16, causal=False,
               window_size=(-1, -1), softcap=0.0, alibi=None, seqused=False, max_seqlen_pad=0, seed=0,
               deterministic=False):
    """Forward and backward of flash_attn_varlen_func against the per-sequence fp64 oracle."""
    q, k, v, dout, cu_q, cu_k = varlen_inputs(device, lens_q, lens_k, nheads, nheads_kv, head_dim, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    batch = len(lens_q)
    alibi_slopes = None
    if alibi == "per_head":
        alibi_slopes = (torch.rand(nheads, generator=g) * 0.3).to(device)
    elif alibi == "per_batch":
        alibi_slopes = (torch.rand(batch, nheads, generator=g) * 0.3).to(device)
    used_q = used_k = None
    if seqused:
        used_q = [int(torch.randint(0, n + 1, (), generator=g)) for n in lens_q]
        used_k = [int(torch.randint(0, n + 1, (), generator=g)) for n in lens_k]
    max_q = max((used_q or lens_q), default=0) + max_seqlen_pad
    max_k = max((used_k or lens_k), default=0) + max_seqlen_pad
    kw = dict(causal=causal, window_size=window_size, softcap=softcap)
    seq_kw = {} if not seqused else dict(
        seqused_q=torch.tensor(used_q, dtype=torch.int32, device=device),
        seqused_k=torch.tensor(used_k, dtype=torch.int32, device=device))

    inputs = [t.detach().requires_grad_() for t in (q, k, v)]  # detach keeps the NaN-guarded strides
    out, lse, _ = flashtile.flash_attn_varlen_func(*inputs, cu_q, cu_k, max_q, max_k, alibi_slopes=alibi_slopes,
                                                   deterministic=deterministic, return_attn_probs=True, **kw,
                                                   **seq_kw)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse, floors = reference(*ref_in, lens_q, lens_k, used_q, used_k, alibi_slopes, dout=dout, **kw)
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout, allow_unused=True, materialize_grads=True)
    pt_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    pt_out, pt_lse = reference(*pt_in, lens_q, lens_k, used_q, used_k, alibi_slopes, upcast=False, **kw)
    pt_grads = torch.autograd.grad(pt_out, pt_in, dout, allow_unused=True, materialize_grads=True)

    check_close("out", out, ref_out, pt_out, 2, floor=floors["out"])
    check_close("lse", lse, ref_lse, pt_lse.to(dtype), 2, floor=floors["lse"])
    scale = max((t.abs().max().item() for t in ref_grads if t.numel()), default=1.0)
    for name, ours, ref, pt in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
        check_close(name, ours, ref, pt, 3, scale, floor=floors[name])
    return out, lse, grads


# ---------------------------------------------------------------------------------------------------------------
# Numerics against the fp64 oracle
# ---------------------------------------------------------------------------------------------------------------

LENGTHS = {  # name -> (lens_q, lens_k)
    "mixed": ([17, 1, 40, 0, 33], [17, 1, 40, 0, 33]),
    "q_shorter": ([5, 33, 1], [40, 47, 20]),
    "q_longer": ([40, 9, 23], [7, 30, 23]),  # causal: the first rows of sequence 0 see no key
    "empty_k": ([9, 12], [0, 12]),  # a query sequence without keys: out 0, lse +inf
}


@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("mask", list(MASKS))
def test_masks_and_lengths(device, mask, lengths):
    causal, window = MASKS[mask]
    run_varlen(device, *LENGTHS[lengths], causal=causal, window_size=window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_dtypes(device, dtype):
    run_varlen(device, [20, 3, 37], [20, 3, 37], dtype=dtype, causal=True)


@pytest.mark.parametrize("heads", [(4, 2), (4, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_gqa_mqa(device, heads, mask):
    causal, window = MASKS[mask]
    run_varlen(device, [19, 34, 2], [25, 34, 9], *heads, causal=causal, window_size=window)


@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("alibi", [None, "per_head", "per_batch"])
def test_softcap_alibi(device, softcap, alibi):
    if softcap == 0.0 and alibi is None:
        pytest.skip("covered by test_masks_and_lengths")
    run_varlen(device, [33, 8, 21], [40, 8, 15], causal=True, softcap=softcap, alibi=alibi)


def test_everything_at_once(device):
    run_varlen(device, [33, 0, 18, 1], [50, 6, 18, 1], 4, 2, 40, torch.bfloat16, True, (12, -1), softcap=8.0,
               alibi="per_batch", seqused=True, max_seqlen_pad=9, seed=3, deterministic=True)


@pytest.mark.parametrize("head_dim", [8, 64])
def test_head_dims(device, head_dim):
    run_varlen(device, [21, 40], [33, 17], head_dim=head_dim, causal=True)


def test_single_sequence(device):
    run_varlen(device, [70], [70], causal=True)


def test_many_tiny_sequences(device):
    """40 sequences of 0..6 tokens: every tile is a boundary tile, and the launch order sorts 40 lengths."""
    lengths = [(3 * b) % 7 for b in range(40)]
    run_varlen(device, lengths, lengths[::-1], causal=True, seed=1)


def test_max_seqlen_larger_than_needed(device):
    run_varlen(device, [12, 30], [12, 30], causal=True, max_seqlen_pad=100)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_seqused(device, mask):
    """seqused_q/k (FlashAttention-3): only the first seqused[b] tokens of each sequence count; the remaining
    rows give out 0, lse +inf and zero gradients, and masks are aligned to the used lengths."""
    causal, window = MASKS[mask]
    run_varlen(device, [20, 35, 9, 16], [28, 35, 9, 5], causal=causal, window_size=window, seqused=True, seed=2)


@pytest.mark.parametrize("causal", [False, True])
def test_rows_past_seqused_k_are_never_used(device, causal):
    """K/V rows past seqused_k[b] may hold anything, NaN included: the output and the gradients are bitwise the
    same as with finite values there (a tile that crosses the used length must not let them through, 0 * NaN being
    NaN; the dQ kernel's K/V boxes run over the packed tensors)."""
    g = torch.Generator().manual_seed(23)
    lens, used = [40, 15], [13, 15]
    cu = torch.tensor([0, 40, 55], dtype=torch.int32, device=device)
    q, k, v, dout = (torch.randn(55, 2, 32, generator=g).to(device, torch.float16) for _ in range(4))
    seqused = torch.tensor(used, dtype=torch.int32, device=device)

    def run(k, v):
        q_, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = flashtile.flash_attn_varlen_func(q_, k, v, cu, cu, 40, 40, causal=causal, seqused_k=seqused)
        return (out, *torch.autograd.grad(out, (q_, k, v), dout))

    expected = run(k, v)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[used[0]:lens[0]] = float("nan")
    v_nan[used[0]:lens[0]] = float("nan")
    for name, got, want in zip(("out", "dq", "dk", "dv"), run(k_nan, v_nan), expected):
        assert torch.equal(got, want), name


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, from the poisoned sequence's own NaN arithmetic
@pytest.mark.parametrize("causal", [False, True])
def test_a_sequence_never_reads_its_neighbours(device, causal):
    """NaN and inf in one sequence's q, k and v change no other sequence's output, lse or gradients, bitwise. The
    Hopper forward reads Q and K through descriptors over the whole packed tensors, so a tile that runs past its
    sequence loads the next one's rows (Note [varlen descriptors] in kernels/hopper_fwd.py); on a GPU this runs
    it (bf16, d128), here the Triton kernels."""
    gpu = device != "cpu"
    dtype, head_dim = (torch.bfloat16, 128) if gpu else (torch.float16, 32)
    lens = [100, 37, 70] if gpu else [20, 9, 14]
    q, k, v, dout, cu, _ = varlen_inputs(device, lens, lens, head_dim=head_dim, dtype=dtype, seed=29)

    def run(q, k, v):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal,
                                                       return_attn_probs=True)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))

    expected = run(q, k, v)
    rows = slice(lens[0], lens[0] + lens[1])
    others = torch.ones(sum(lens), dtype=torch.bool, device=device)
    others[rows] = False
    for bad in (float("nan"), float("inf")):
        poisoned = [t.clone() for t in (q, k, v)]
        for t in poisoned:
            t[rows] = bad
        got = run(*poisoned)
        assert torch.equal(got[1][:, others], expected[1][:, others])
        for name, a, b in zip(("out", "dq", "dk", "dv"), (got[0], *got[2:]), (expected[0], *expected[2:])):
            assert torch.equal(a[others], b[others]), name


def test_fully_masked_rows(device):
    """Causal with seqlen_q > seqlen_k: the first rows of a sequence see no key. They output exactly 0 with lse
    +inf and pass no NaN into any gradient."""
    out, lse, grads = run_varlen(device, [3, 40], [3, 7], causal=True, seed=17)
    masked = slice(3, 3 + 40 - 7)
    assert torch.all(out[masked] == 0) and torch.all(lse[:, masked] == float("inf"))
    assert not any(torch.isnan(t).any() for t in grads)


def test_max_seqlen_is_not_needed(device, monkeypatch):
    """The grid is a tile list bounded by the packed totals, so with the (flash-attn compatibility) value check
    off, a max_seqlen far too small still computes every row."""
    q, k, v, dout, cu_q, cu_k = varlen_inputs(device, [40, 3, 33], [17, 50, 33], seed=18)
    want = grads_of(lambda q, k, v: flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 50, causal=True),
                    (q, k, v), dout)
    monkeypatch.setattr(flashtile.problem, "value_checks", lambda *tensors: False)
    got = grads_of(lambda q, k, v: flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 0, causal=True),
                   (q, k, v), dout)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_schedule_is_longest_first(device):
    from flashtile.kernels.schedule import MAX_SORT
    from flashtile.ops.schedule import varlen_plan

    def schedule(*args):
        return varlen_plan(*args).schedule
    lengths = [3, 9, 0, 9, 4, 1, 7]
    tiled = [5, 6, 7, 8, 9, 10, 11]
    cu, cu_tiled = cu_seqlens(lengths, device), cu_seqlens(tiled, device)
    order, rows = schedule(cu_tiled, None, sum(tiled), cu, None, sum(lengths)).tolist()
    assert order == [1, 3, 6, 4, 0, 5, 2] and rows == [tiled[b] for b in order]
    used = torch.tensor([3, 0, 0, 2, 4, 1, 7], dtype=torch.int32, device=device)
    order, rows = schedule(cu_tiled, used, sum(tiled), cu, used, sum(lengths)).tolist()
    assert order == [6, 4, 0, 3, 5, 1, 2] and rows == [used[b] for b in order]
    # Lengths are clamped as the kernels clamp them: seqused past a sequence's end counts as its length.
    order, rows = schedule(cu_tiled, used + 100, sum(tiled), cu, None, sum(lengths)).tolist()
    assert rows == [tiled[b] for b in order]
    # More sequences than one sort: each chunk of MAX_SORT is sorted on its own, and every sequence is listed.
    lengths = torch.randint(0, 50, (2 * MAX_SORT + 300,), generator=torch.Generator().manual_seed(0)).tolist()
    cu = cu_seqlens(lengths, device)
    order = schedule(cu, None, sum(lengths), cu, None, sum(lengths))[0].tolist()
    assert sorted(order) == list(range(len(lengths)))
    for start in range(0, len(lengths), MAX_SORT):
        chunk = order[start:start + MAX_SORT]
        assert set(chunk) == set(range(start, min(start + MAX_SORT, len(lengths))))
        assert [lengths[b] for b in chunk] == sorted((lengths[b] for b in chunk), reverse=True)


@triton.jit
def _tile_coords_probe(SCHEDULE, OUT, batch, BLOCK: tl.constexpr, LAST_FIRST: tl.constexpr, STEP: tl.constexpr,
                       LISTED: tl.constexpr):
    b, tile, h, heads = tile_coords(SCHEDULE, batch, BLOCK, LAST_FIRST, True, STEP, LISTED)
    entry = OUT + 4 * (h * tl.num_programs(1) * tl.num_programs(2) + tl.program_id(2) * tl.num_programs(1)
                       + tl.program_id(1))
    tl.store(entry, b)
    tl.store(entry + 1, tile)
    tl.store(entry + 2, h)
    tl.store(entry + 3, heads)


@pytest.mark.parametrize("many, last_first", [(False, False), (True, True)], ids=["20", "MAX_STEP+77"])
def test_tile_list(device, monkeypatch, many, last_first):
    """Every tile of every sequence exactly once, in schedule order (over more sequences than one step); the
    programs past the list get a tile index past any sequence. The grid is (heads, list) with the list folded into
    z past a limit (7 here, 65535 on a GPU): every head reads the whole list. tile_coords walking a plan's schedule
    and the plan's written-out lists (for the Gluon kernels and the dQ kernel: each sequence's last tile first, and
    first tile first) agree; the plan's work counters are zeroed."""
    from flashtile.kernels.seqlen import MAX_STEP
    from flashtile.ops.schedule import schedule_step, tile_grid, varlen_plan
    batch, block, heads = MAX_STEP + 77 if many else 20, 4, 2
    lengths = torch.randint(0, 3, (batch,), generator=torch.Generator().manual_seed(19))
    lengths[torch.tensor([5, 11, batch - 7])] = torch.tensor([9, 30, 13])
    total = int(lengths.sum())
    cu = cu_seqlens(lengths.tolist(), device)
    limit = 7 if not many else 65535
    # Written into memory filled with 7s, so that an entry the kernel leaves unwritten shows.
    empty = torch.empty

    def poisoned(*args, **kwargs):
        return empty(*args, **kwargs).fill_(7)

    monkeypatch.setattr(torch, "empty", poisoned)
    plan = varlen_plan(cu, None, total, cu, None, total, block, True, True, limit=limit)
    monkeypatch.undo()
    grid = tile_grid(block, 0, total, batch, heads, True, limit)
    programs = grid[1] * grid[2]
    assert grid[0] == heads and programs >= -(-total // block) + batch
    assert many or (grid[1] == 7 and grid[2] > 1)  # folded

    def tiles_in_order(last):
        want = []
        for b in plan.schedule[0].tolist():
            tiles = list(range(math.ceil(int(lengths[b]) / block)))
            want += [(b, t) for t in (tiles[::-1] if last else tiles)]
        return want

    order, rows = plan.schedule.tolist()
    assert sorted(order) == list(range(batch)) and rows == [int(lengths[b]) for b in order]
    # Each list written out, then (-1, -1) up to the grid's entries.
    for last, written in ((False, plan.first_first), (True, plan.last_first)):
        want = tiles_in_order(last)
        assert [tuple(row) for row in written.tolist()] == want + [(-1, -1)] * (programs - len(want))
    assert plan.counters.tolist() == [[0] * 4] * 4
    assert all(t.data_ptr() % 16 == 0 for t in (*plan.counters, plan.last_first, plan.first_first))
    # tile_coords walking the schedule finds the same tiles (in one order per case: the walk is slow under the
    # interpreter), and so does tile_coords reading the list (LISTED, the dQ kernel's way).
    out = torch.full((heads, programs, 4), -1, dtype=torch.int32, device=device)
    _tile_coords_probe[grid](plan.schedule, out, batch, BLOCK=block, LAST_FIRST=last_first,
                             STEP=schedule_step(batch, True), LISTED=False)
    want = tiles_in_order(last_first)
    for h in range(heads):
        got = [tuple(row) for row in out[h].tolist()]
        assert [row[:2] for row in got[:len(want)]] == want
        assert all(tile * block >= 2**31 - block for _, tile, _, _ in got[len(want):])
        assert {row[2:] for row in got} == {(h, heads)}
    listed = torch.full_like(out, -1)
    _tile_coords_probe[grid](plan.last_first if last_first else plan.first_first, listed, batch, BLOCK=block,
                             LAST_FIRST=last_first, STEP=1, LISTED=True)
    assert torch.equal(listed, out)


def test_plan_lists_merge_only_lists_of_one_block():
    """One plan holds the first wanted list and the later ones of its block (0: a kernel walking the schedule);
    a list of another block is left to a plan of its own."""
    from flashtile.ops.schedule import plan_lists
    assert plan_lists((0, False)) == (0, False, False)
    assert plan_lists((128, False)) == (128, True, False)
    assert plan_lists((0, False), (32, False), (0, True)) == (32, True, False)  # Triton forward, dQ, Triton dK/dV
    assert plan_lists((128, False), (128, False), (128, True)) == (128, True, True)  # the Hopper path
    assert plan_lists((128, False), (64, False), (128, True)) == (128, True, True)
    assert plan_lists((64, False), (128, True)) == (64, True, False)


def test_backward_takes_the_forward_plan(device, monkeypatch):
    """Note [one plan per step]: an eager self-attention forward writes the backward's lists, so its backward plans
    nothing; a second backward (retain_graph) plans anew, as the op route (torch.compile's) always does, with the
    same gradients bit for bit."""
    import flashtile.ops.bwd
    q, k, v, dout, cu, _ = varlen_inputs(device, [40, 3, 77], [40, 3, 77], seed=23)
    calls = []
    real = flashtile.ops.bwd.varlen_plan
    monkeypatch.setattr(flashtile.ops.bwd, "varlen_plan", lambda *args: calls.append(args) or real(*args))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 77, 77, causal=True, return_attn_probs=True)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    assert calls == []
    second = torch.autograd.grad(out, (q, k, v), dout)
    assert len(calls) == 1
    scale = q.shape[-1] ** -0.5
    bwd_op = flashtile.ops.bwd.attention_bwd
    op_route = bwd_op(*op_args(bwd_op, dout=dout, q=q.detach(), k=k.detach(), v=v.detach(), out=out.detach(), lse=lse,
                               cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=77, max_seqlen_k=77, softmax_scale=scale,
                               window_right=0))
    for a, b, c in zip(first, second, op_route):
        assert torch.equal(a, b) and torch.equal(a, c)


# ---------------------------------------------------------------------------------------------------------------
# Varlen is the dense kernel per sequence: bitwise equal
# ---------------------------------------------------------------------------------------------------------------

def grads_of(fn, inputs, dout):
    inputs = [t.detach().requires_grad_() for t in inputs]
    out = fn(*inputs)
    return (out, *torch.autograd.grad(out, inputs, dout))


def test_dq_walks_the_schedule_under_autotune(device, monkeypatch):
    """With FLASHTILE_AUTOTUNE=1 an autotuner may launch the varlen dQ kernel with another BLOCK_M than a written
    tile list's, so it walks the schedule instead (seqlen.tile_coords without LISTED), and no list is written.
    The interpreter launches the table's tiles either way; on a GPU, test_gpu.py's test_autotune_path autotunes."""
    if device != "cpu":
        pytest.skip("on a GPU this would autotune every kernel")
    import flashtile.ops.bwd

    real = flashtile.ops.bwd.varlen_plan

    def no_list(*args, **kwargs):
        plan = real(*args, **kwargs)
        assert plan.last_first is None and plan.first_first is None, "a tile list under FLASHTILE_AUTOTUNE=1"
        return plan

    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "1")
    monkeypatch.setattr(flashtile.ops.bwd, "varlen_plan", no_list)
    monkeypatch.setattr(flashtile.ops.fwd, "varlen_plan", no_list)
    run_varlen(device, [40, 0, 77, 5], [40, 0, 77, 5], causal=True)


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_equals_dense_batch(device, mask):
    """Equal lengths: the packed batch and the padded-free dense batch (B, S, H, D) give identical bits."""
    causal, window = MASKS[mask]
    g = torch.Generator().manual_seed(4)
    batch, sq, sk = 3, 21, 34
    q = nan_guarded((batch, sq, 4, 32), torch.float16, device, g)
    k = nan_guarded((batch, sk, 2, 32), torch.float16, device, g)
    v = nan_guarded((batch, sk, 2, 32), torch.float16, device, g)
    dout = torch.randn(batch, sq, 4, 32, generator=g).to(device, torch.float16)
    kw = dict(causal=causal, window_size=window, softcap=3.0)
    dense = grads_of(lambda q, k, v: flashtile.flash_attn_func(q, k, v, **kw), (q, k, v), dout)
    cu_q, cu_k = cu_seqlens([sq] * batch, device), cu_seqlens([sk] * batch, device)
    varlen = grads_of(lambda q, k, v: flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, sq, sk, **kw),
                      [t.flatten(0, 1) for t in (q, k, v)], dout.flatten(0, 1))
    for name, a, b in zip(("out", "dq", "dk", "dv"), dense, varlen):
        assert torch.equal(a.flatten(0, 1), b), name


def test_equals_dense_per_sequence(device):
    """Mixed lengths: each sequence of the packed batch equals flash_attn_func on that sequence alone."""
    q, k, v, dout, cu_q, cu_k = varlen_inputs(device, [33, 5, 17], [20, 41, 17], seed=5)
    alibi = (torch.rand(3, 4, generator=torch.Generator().manual_seed(5)) * 0.2).to(device)
    out, dq, dk, dv = grads_of(lambda q, k, v: flashtile.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 33, 41, causal=True, alibi_slopes=alibi), (q, k, v), dout)
    for b in range(3):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        one = grads_of(lambda q, k, v, b=b: flashtile.flash_attn_func(q, k, v, causal=True, alibi_slopes=alibi[b]),
                       (q[None, qs], k[None, ks], v[None, ks]), dout[None, qs])
        for name, a, ours in zip(("out", "dq", "dk", "dv"), one, (out[qs], dq[qs], dk[ks], dv[ks])):
            assert torch.equal(a[0], ours), f"sequence {b}: {name}"


def test_deterministic(device):
    q, k, v, dout, cu, _ = varlen_inputs(device, [25, 7, 40], [25, 7, 40], seed=6)
    runs = [grads_of(lambda q, k, v: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 40, 40, causal=True,
                                                                      deterministic=True), (q, k, v), dout)
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# Packed variants
# ---------------------------------------------------------------------------------------------------------------

def test_qkvpacked_grads_into_one_buffer(device):
    g = torch.Generator().manual_seed(7)
    lens = [19, 0, 30]
    qkv = nan_guarded((sum(lens), 3, 2, 32), torch.float16, device, g)
    dout = torch.randn(sum(lens), 2, 32, generator=g).to(device, torch.float16)
    cu = cu_seqlens(lens, device)
    out, dqkv = grads_of(lambda x: flashtile.flash_attn_varlen_qkvpacked_func(x, cu, 30, causal=True), (qkv,), dout)
    ref = grads_of(lambda q, k, v: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 30, 30, causal=True),
                   qkv.unbind(1), dout)
    assert dqkv.shape == qkv.shape
    assert torch.equal(out, ref[0])
    for i in range(3):
        assert torch.equal(dqkv[:, i], ref[1 + i])


def test_kvpacked_grads_into_one_buffer(device):
    g = torch.Generator().manual_seed(8)
    lens_q, lens_k = [7, 26], [31, 12]
    q = packed(lens_q, 4, 32, torch.float16, device, g)
    kv = nan_guarded((sum(lens_k), 2, 2, 32), torch.float16, device, g)
    dout = torch.randn(sum(lens_q), 4, 32, generator=g).to(device, torch.float16)
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    out, dq, dkv = grads_of(lambda q, kv: flashtile.flash_attn_varlen_kvpacked_func(
        q, kv, cu_q, cu_k, 26, 31, window_size=(5, 2)), (q, kv), dout)
    ref = grads_of(lambda q, k, v: flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 26, 31,
                                                                    window_size=(5, 2)), (q, *kv.unbind(1)), dout)
    assert dkv.shape == kv.shape
    for a, b in zip((out, dq, dkv[:, 0], dkv[:, 1]), ref):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# Paged K/V (block_table)
# ---------------------------------------------------------------------------------------------------------------

def paginate(k, v, lens_k, page_size, g, spare_pages=3):
    """Scatter each sequence's keys over randomly placed pages of a NaN-filled cache; returns (k_cache, v_cache,
    block_table). Unused table entries are -1 and the rows past a sequence's end are NaN: a kernel that reads
    either returns NaN."""
    pages_per_seq = [max(1, math.ceil(n / page_size)) for n in lens_k]
    width = max(pages_per_seq) + 1
    num_pages = sum(pages_per_seq) + spare_pages
    perm = torch.randperm(num_pages, generator=g).tolist()
    caches = [k.new_full((num_pages, page_size, *k.shape[1:]), float("nan")) for _ in range(2)]
    table = torch.full((len(lens_k), width), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(lens_k):
        for p in range(pages_per_seq[b]):
            page = perm.pop()
            table[b, p] = page
            rows = slice(p * page_size, min(n, (p + 1) * page_size))
            count = rows.stop - rows.start
            if count > 0:
                caches[0][page, :count] = k[start + rows.start:start + rows.stop]
                caches[1][page, :count] = v[start + rows.start:start + rows.stop]
        start += n
    return caches[0], caches[1], table.to(k.device)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_paged_matches_contiguous(device, page_size, mask):
    """Pages in random order, NaN past every sequence's keys and -1 past its pages; head dim 40 is tiled as 64,
    so the gathers also mask columns."""
    causal, window = MASKS[mask]
    lens_q, lens_k = [9, 1, 24, 0], [40, 17, 24, 3]
    q, k, v, _, cu_q, cu_k = varlen_inputs(device, lens_q, lens_k, head_dim=40, seed=9)
    alibi = torch.tensor([0.1, 0.2, 0.05, 0.3], device=device)
    kw = dict(causal=causal, window_size=window, softcap=4.0, alibi_slopes=alibi)
    want = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 24, 40, **kw)
    k_cache, v_cache, table = paginate(k, v, lens_k, page_size, torch.Generator().manual_seed(page_size))
    got = flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 24, 40, block_table=table, **kw)
    assert torch.equal(got, want)


def test_paged_with_seqused_k(device):
    """Decode-style prefill: the cache holds more keys than are used; only seqused_k[b] are attended to."""
    lens_q, lens_k, used_k = [4, 6], [30, 20], [21, 20]
    q, k, v, _, cu_q, cu_k = varlen_inputs(device, lens_q, lens_k, seed=10)
    seqused_k = torch.tensor(used_k, dtype=torch.int32, device=device)
    k_cache, v_cache, table = paginate(k, v, lens_k, 16, torch.Generator().manual_seed(10))
    got = flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 6, 30, causal=True, block_table=table,
                                           seqused_k=seqused_k)
    want, _ = reference(q.double(), k.double(), v.double(), lens_q, lens_k, None, used_k, causal=True)
    pt, _ = reference(q, k, v, lens_q, lens_k, None, used_k, causal=True, upcast=False)
    check_close("out", got, want, pt, 2)


def test_paged_backward_is_not_implemented(device):
    q, k, v, _, cu, _ = varlen_inputs(device, [5], [5], seed=11)
    q.requires_grad_()
    k_cache, v_cache, table = paginate(k, v, [5], 16, torch.Generator().manual_seed(11))
    out = flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cu, cu, 5, 5, block_table=table)
    with pytest.raises(NotImplementedError, match="paged"):
        out.sum().backward()


# ---------------------------------------------------------------------------------------------------------------
# 64-bit addressing
# ---------------------------------------------------------------------------------------------------------------

def test_head_strides_past_int32(device):
    """q/k/v/dout as (total, H, D) views of head-major buffers whose head stride is 2^30 elements: head 2 starts
    past 2^31, where an int32 `h * stride_h` wraps negative. The buffers are 4 GiB of untouched virtual memory;
    only the used rows are ever written."""
    if device != "cpu":
        pytest.skip("the GPU tier allocates a real > 2^31-element batch instead")
    nheads, head_dim, lens = 3, 32, [15, 25]

    def head_major(values):
        buf = torch.empty((nheads - 1) * 2**30 + values.shape[0] * head_dim, dtype=values.dtype)
        return buf.as_strided(values.shape, (head_dim, 2**30, 1)).copy_(values)

    g = torch.Generator().manual_seed(12)
    values = [torch.randn(sum(lens), nheads, head_dim, generator=g).half() for _ in range(3)]
    dout = torch.randn(sum(lens), nheads, head_dim, generator=g).half()
    cu = cu_seqlens(lens, device)

    def run(q, k, v):
        return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 25, 25, causal=True)

    far = grads_of(run, [head_major(t) for t in values], head_major(dout))
    near = grads_of(run, values, dout)
    for a, b in zip(far, near):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# Argument checking
# ---------------------------------------------------------------------------------------------------------------

def _args(device, lens=(5, 7)):
    q = torch.randn(sum(lens), 2, 16, device=device, dtype=torch.float16)
    cu = cu_seqlens(list(lens), device)
    return q, q.clone(), q.clone(), cu, cu.clone(), max(lens), max(lens)


def _with(args, **changes):
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    values = dict(zip(names, args))
    values.update(changes)
    return values


BAD_CU = {  # name -> (change to the arguments, expected exception, message fragment)
    "not_int32": (lambda a: {"cu_seqlens_q": a[3].long()}, TypeError, "int32"),
    "not_1d": (lambda a: {"cu_seqlens_q": a[3][None]}, ValueError, "1-d"),
    "lengths_differ": (lambda a: {"cu_seqlens_k": a[4][:2]}, ValueError, "both have batch_size"),
    "not_from_0": (lambda a: {"cu_seqlens_q": a[3] + 1}, ValueError, "start at 0"),
    "decreasing": (lambda a: {"cu_seqlens_q": torch.tensor([0, 9, 5, 12], dtype=torch.int32, device=a[3].device),
                              "cu_seqlens_k": torch.tensor([0, 5, 9, 12], dtype=torch.int32, device=a[3].device)},
                   ValueError, "non-decreasing"),
    "last_not_total": (lambda a: {"cu_seqlens_k": a[4] - torch.tensor([0, 0, 1], dtype=torch.int32,
                                                                      device=a[4].device)},
                       ValueError, "packed total"),
    "other_device": (lambda a: {"cu_seqlens_q": a[3].to("meta")}, ValueError, "is on meta"),
    "max_seqlen_small": (lambda a: {"max_seqlen_q": 6}, ValueError, "max_seqlen_q = 6 is smaller"),
    "max_seqlen_float": (lambda a: {"max_seqlen_k": 7.0}, TypeError, "max_seqlen_k must be an int"),
    "max_seqlen_negative": (lambda a: {"max_seqlen_k": -1}, ValueError, ">= 0"),
    "seqused_dtype": (lambda a: {"seqused_q": torch.tensor([1, 2], device=a[3].device)}, TypeError, "int32"),
    "seqused_shape": (lambda a: {"seqused_k": torch.tensor([1, 2, 3], dtype=torch.int32, device=a[3].device)},
                      ValueError, "batch_size = 2"),
    "seqused_too_long": (lambda a: {"seqused_k": torch.tensor([1, 8], dtype=torch.int32, device=a[3].device)},
                         ValueError, r"seqused_k\[1\] = 8"),
    "kv_shape": (lambda a: {"v": a[2][:-1]}, ValueError, "same shape"),
}


@pytest.mark.parametrize("case", list(BAD_CU))
def test_bad_arguments(device, case, monkeypatch):
    # Value checks read the tensors back; on a GPU they run only with FLASHTILE_CHECK=1.
    monkeypatch.setenv("FLASHTILE_CHECK", "1")
    change, exc, match = BAD_CU[case]
    args = _args(device)
    with pytest.raises(exc, match=match):
        flashtile.flash_attn_varlen_func(**_with(args, **change(args)))


def test_bad_block_table(device, monkeypatch):
    monkeypatch.setenv("FLASHTILE_CHECK", "1")
    q, _, _, cu, _, _, _ = _args(device)
    cache = torch.randn(4, 4, 2, 16, device=device, dtype=torch.float16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    ok = dict(q=q, k=cache, v=cache, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7)
    flashtile.flash_attn_varlen_func(**ok, block_table=table)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 4 is not a page"):
        flashtile.flash_attn_varlen_func(**ok, block_table=table + torch.tensor([[0, 0], [0, 1]], dtype=torch.int32,
                                                                                 device=device))
    with pytest.raises(ValueError, match="holds only 1 pages"):
        flashtile.flash_attn_varlen_func(**ok, block_table=table[:, :1])
    with pytest.raises(ValueError, match="dimensions"):
        flashtile.flash_attn_varlen_func(**dict(ok, k=cache[0], v=cache[0]), block_table=table)


# ---------------------------------------------------------------------------------------------------------------
# torch.compile and the custom op
# ---------------------------------------------------------------------------------------------------------------

def test_torch_compile_fullgraph(device):
    q, k, v, dout, cu, _ = varlen_inputs(device, [11, 0, 20], [11, 0, 20], 2, 1, seed=13)
    used = torch.tensor([11, 0, 17], dtype=torch.int32, device=device)

    def f(q, k, v):
        return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 20, 20, causal=True, softcap=6.0, seqused_k=used)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for a, b in zip(grads_of(compiled, (q, k, v), dout), grads_of(f, (q, k, v), dout)):
        assert torch.equal(a, b)


def test_opcheck_varlen(device):
    from flashtile.ops.fwd import attention_fwd
    q, k, v, cu_q, cu_k, _, _ = _args(device)
    used = torch.tensor([5, 3], dtype=torch.int32, device=device)
    args = op_args(attention_fwd, q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used, max_seqlen_q=7,
                   max_seqlen_k=7, softmax_scale=0.25, window_right=0)
    torch.library.opcheck(attention_fwd, args, test_utils=("test_schema", "test_faketensor",
                                                            "test_autograd_registration"))


# ---------------------------------------------------------------------------------------------------------------
# GPU tier: real sizes
# ---------------------------------------------------------------------------------------------------------------

MIXED = [1024, 4096, 300, 2048, 512, 1500, 256, 777, 2200, 384, 640, 256, 1111, 333, 400, 547]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_mixed_lengths(device, causal):
    """16 sequences of 256..4096 tokens (the benchmark's mix), bf16, d128, 16 heads over 4 KV heads."""
    run_varlen(device, MIXED, MIXED, 16, 4, 128, torch.bfloat16, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("features", ["window_softcap_alibi", "seqused", "cross"])
def test_gpu_features(device, features):
    if features == "cross":
        run_varlen(device, MIXED[:8], MIXED[8:], 8, 8, 64, torch.float16, causal=True)
    elif features == "seqused":
        run_varlen(device, MIXED[:8], MIXED[:8], 8, 2, 128, torch.bfloat16, causal=True, seqused=True)
    else:
        run_varlen(device, MIXED[:8], MIXED[:8], 8, 2, 256, torch.bfloat16, True, (300, -1), softcap=20.0,
                   alibi="per_batch")


@pytest.mark.gpu
def test_gpu_many_sequences(device):
    lengths = [int(x) for x in torch.randint(0, 200, (1030,), generator=torch.Generator().manual_seed(0))]
    run_varlen(device, lengths, lengths, 4, 2, 64, torch.bfloat16, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 256])
def test_gpu_paged(device, page_size):
    lens_q, lens_k = [1, 700, 31, 2048], [4000, 700, 1500, 2048]
    q, k, v, _, cu_q, cu_k = varlen_inputs(device, lens_q, lens_k, 16, 4, 128, torch.bfloat16, seed=14)
    k_cache, v_cache, table = paginate(k, v, lens_k, page_size, torch.Generator().manual_seed(14))
    got = flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 2048, 4000, causal=True,
                                           block_table=table)
    want, _ = reference(q.double(), k.double(), v.double(), lens_q, lens_k, causal=True)
    pt, _ = reference(q, k, v, lens_q, lens_k, causal=True, upcast=False)
    check_close("out", got, want, pt, 2)


@pytest.mark.gpu
def test_gpu_more_than_2_31_elements(device, large_gpu_memory):
    """1025 sequences of 1024 tokens, 16 heads of 128: 2^31 + 2^21 elements per tensor (4.3 GB in bf16, ~35 GB in
    all). The first and last sequences, forward and backward, against the fp64 reference. head_major views
    (H, total, D) storage as (total, H, D), so that the head stride is the large one. The layouts run one after the
    other to keep the peak at one problem's memory."""
    seqs, n, nheads, head_dim = 1025, 1024, 16, 128
    total = seqs * n
    assert total * nheads * head_dim > 2**31
    g = torch.Generator(device=device).manual_seed(15)
    cu = torch.arange(0, total + 1, n, dtype=torch.int32, device=device)
    for layout in ("token_major", "head_major"):
        torch.cuda.empty_cache()

        def make():
            shape = (nheads, total, head_dim) if layout == "head_major" else (total, nheads, head_dim)
            t = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=g)
            return (t.transpose(0, 1) if layout == "head_major" else t).requires_grad_()

        q, k, v = make(), make(), make()
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True)
        dout = torch.randn(out.shape, device=device, dtype=torch.bfloat16, generator=g)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        for rows in (slice(0, n), slice(total - n, total)):
            ref_in = [t[rows].detach().double().requires_grad_() for t in (q, k, v)]
            ref_out, _ = attention_ref(*(t[None] for t in ref_in), causal=True)
            ref_grads = torch.autograd.grad(ref_out, ref_in, dout[None, rows])
            pt_in = [t[rows][None].detach().clone().requires_grad_() for t in (q, k, v)]
            pt_out, _ = attention_ref(*pt_in, causal=True, upcast=False)
            pt_grads = torch.autograd.grad(pt_out, pt_in, dout[None, rows])
            check_close(f"{layout} out", out[rows], ref_out[0], pt_out[0], 2)
            scale = max(t.abs().max().item() for t in ref_grads)
            for name, ours, ref, pt in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, pt_grads):
                check_close(f"{layout} {name}", ours[rows], ref, pt[0], 3, scale)
        del q, k, v, out, dout, dq, dk, dv


@pytest.mark.gpu
def test_gpu_tile_list_past_the_grid_y_limit(device, large_gpu_memory):
    """66,000 sequences of 128 tokens (8.4M, one head of 128): the Gluon kernels' tile lists have more entries than
    a grid's y axis takes (65,535) and fold into z (ops/schedule.tile_grid). The first and last sequences, forward
    and backward, against the fp64 reference: the last one's tiles are in the second fold."""
    seqs, n, nheads, head_dim = 66000, 128, 1, 128
    total = seqs * n
    g = torch.Generator(device=device).manual_seed(16)
    cu = torch.arange(0, total + 1, n, dtype=torch.int32, device=device)
    q, k, v = (torch.randn((total, nheads, head_dim), device=device, dtype=torch.bfloat16, generator=g)
               .requires_grad_() for _ in range(3))
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, n, n)
    dout = torch.randn(out.shape, device=device, dtype=torch.bfloat16, generator=g)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    paths = flashtile.last_kernel_paths()
    assert (paths["fwd"], paths["bwd_dkdv"]) == ("gluon-sm90", "gluon-sm90"), paths
    for rows in (slice(0, n), slice(total - n, total)):
        ref_in = [t[rows].detach().double().requires_grad_() for t in (q, k, v)]
        ref_out, _ = attention_ref(*(t[None] for t in ref_in))
        ref_grads = torch.autograd.grad(ref_out, ref_in, dout[None, rows])
        pt_in = [t[rows][None].detach().clone().requires_grad_() for t in (q, k, v)]
        pt_out, _ = attention_ref(*pt_in, upcast=False)
        pt_grads = torch.autograd.grad(pt_out, pt_in, dout[None, rows])
        check_close("out", out[rows], ref_out[0], pt_out[0], 2)
        scale = max(t.abs().max().item() for t in ref_grads)
        for name, ours, ref, pt in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, pt_grads):
            check_close(name, ours[rows], ref, pt[0], 3, scale)


@pytest.mark.gpu
def test_gpu_no_host_sync_by_default(device, monkeypatch):
    """Without FLASHTILE_CHECK the varlen path never synchronises (CUDA-graph capturable); with it, a too-small
    max_seqlen is caught."""
    monkeypatch.delenv("FLASHTILE_CHECK", raising=False)
    q, k, v, _, cu, _ = varlen_inputs(device, [100, 300], [100, 300], 4, 4, 64, torch.bfloat16, seed=16)
    used = torch.tensor([90, 300], dtype=torch.int32, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, causal=True, seqused_q=used)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monkeypatch.setenv("FLASHTILE_CHECK", "1")
    with pytest.raises(ValueError, match="max_seqlen_q = 200 is smaller"):
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 200, 300)


def test_bad_device_side_lengths_stay_inside_the_tensors(device):
    """Without FLASHTILE_CHECK nothing validates cu_seqlens/seqused values on a GPU (that would be a host sync), so
    the kernels clamp them to the packed totals. Called below the API (which checks CPU tensors), with inputs in
    NaN-filled buffers: a read past the tensors would put NaN into the output."""
    from flashtile.ops.fwd import attention_fwd
    g = torch.Generator().manual_seed(11)
    q = nan_guarded((24, 2, 32), torch.float16, device, g)
    k = nan_guarded((20, 2, 32), torch.float16, device, g)
    v = nan_guarded((20, 2, 32), torch.float16, device, g)
    cu_q = torch.tensor([0, 10, 1000], dtype=torch.int32, device=device)  # past total_q = 24
    cu_k = torch.tensor([0, 7, 5000], dtype=torch.int32, device=device)  # past total_k = 20
    seqused_k = torch.tensor([100, 9], dtype=torch.int32, device=device)  # longer than sequence 0
    out, lse = attention_fwd(*op_args(attention_fwd, q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      seqused_k=seqused_k, max_seqlen_q=24, max_seqlen_k=20, softmax_scale=0.2))
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    # Sequence 0 is well formed except for seqused_k, which is clamped to its 7 keys.
    ref, _ = attention_ref(q[None, :10].double(), k[None, :7].double(), v[None, :7].double(), softmax_scale=0.2)
    torch.testing.assert_close(out[:10].double(), ref[0], atol=2e-3, rtol=0)
