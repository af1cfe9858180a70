"""Ring attention (flashtile.distributed) across real processes: the gloo backend on the CPU tier (kernels through
the interpreter), NCCL on a machine with several GPUs. Each rank runs its shard forward and backward; the
gathered output and gradients are checked against the fp64 reference of the whole sequence (2x / 3x rule), for
contiguous and zigzag layouts, causal or not, GQA, 2 and 3 ranks; a second run must give the same bits. The varlen
form likewise, over a packed batch of three sequences, each checked against its own whole sequence's reference."""

import datetime
import itertools
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashtile.distributed import (local_cu_seqlens, ring_flash_attn_func, ring_flash_attn_varlen_func, shard,
                                   shard_varlen, unshard, unshard_varlen)
from flashtile.testing import accumulation_floor, attention_ref, check_close


def _inputs(seqlen, nheads, nheads_kv, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seqlen, nheads, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(2, seqlen, nheads_kv, head_dim, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(2, seqlen, nheads, head_dim, generator=g).to(dtype)
    return q, k, v, dout


# Local tokens of the varlen batch's sequences (each global length is world times this): ragged, and even, as
# zigzag needs.
VARLEN_LOCAL = (12, 24, 6)


def _varlen_inputs(world, nheads, nheads_kv, head_dim, head_dim_v, dtype, seed=0):
    """A packed batch of len(VARLEN_LOCAL) sequences: q, k, v, dout and the global cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *itertools.accumulate(n * world for n in VARLEN_LOCAL)], dtype=torch.int32)
    total = int(cu[-1])
    q, k = (torch.randn(total, h, head_dim, generator=g).to(dtype) for h in (nheads, nheads_kv))
    v = torch.randn(total, nheads_kv, head_dim_v, generator=g).to(dtype)
    dout = torch.randn(total, nheads, head_dim_v, generator=g).to(dtype)
    return q, k, v, dout, cu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, backend, case, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A send without its receive must fail the test in minutes, not hang it until pytest's timeout.
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        device = f"cuda:{rank}" if backend == "nccl" else "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        zigzag, causal, window = case["zigzag"], case["causal"], case.get("window", (-1, -1))
        if case.get("varlen"):
            q, k, v, dout, cu = _varlen_inputs(world, **case["shape"])
            cu_local = local_cu_seqlens(cu, world, zigzag).to(device)
            max_local = max(VARLEN_LOCAL)
        else:
            q, k, v, dout = _inputs(**case["shape"])
        results = []
        for _ in range(2):  # twice: the result must be reproducible
            if case.get("varlen"):
                local = [shard_varlen(t, cu, rank, world, zigzag).to(device).requires_grad_(t is not dout)
                         for t in (q, k, v, dout)]
                out = ring_flash_attn_varlen_func(*local[:3], cu_local, max_local, causal=causal, zigzag=zigzag)
            else:
                local = [shard(t, rank, world, zigzag).to(device).requires_grad_(t is not dout)
                         for t in (q, k, v, dout)]
                out = ring_flash_attn_func(*local[:3], causal=causal, window_size=window, zigzag=zigzag)
            grads = torch.autograd.grad(out, local[:3], local[3])
            results.append([t.detach().cpu() for t in (out, *grads)])
        torch.save(results, os.path.join(path, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run(world, backend, case, tmp_path):
    mp.spawn(_worker, args=(world, _free_port(), backend, case, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for first, second in zip(*[[rank[i] for rank in ranks] for i in range(2)]):
        for a, b in zip(first, second):
            assert torch.equal(a, b), "a second run gave other bits"
    if case.get("varlen"):
        cu = _varlen_inputs(world, **case["shape"])[-1]
        return [unshard_varlen([rank[0][i] for rank in ranks], cu, case["zigzag"]) for i in range(4)]
    return [unshard([rank[0][i] for rank in ranks], case["zigzag"]) for i in range(4)]


def _check(case, gathered):
    q, k, v, dout = _inputs(**case["shape"])
    kw = dict(causal=case["causal"], window_size=case.get("window", (-1, -1)))
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _, probs = attention_ref(*ref_in, return_probs=True, **kw)
    ref_grads = torch.autograd.grad(ref, ref_in, dout)
    pt_in = [t.clone().requires_grad_() for t in (q, k, v)]
    pt, _ = attention_ref(*pt_in, upcast=False, **kw)
    pt_grads = torch.autograd.grad(pt, pt_in, dout)
    floors = accumulation_floor(q, k, v, dout, ref, probs)
    check_close("out", gathered[0], ref, pt, 2, floor=floors["out"])
    scale = max(g.abs().max().item() for g in ref_grads)
    for name, ours, r, p in zip(("dq", "dk", "dv"), gathered[1:], ref_grads, pt_grads):
        check_close(name, ours, r, p, 3, scale, floor=floors[name])


CASES = {
    "causal zigzag": dict(causal=True, zigzag=True),
    "causal contiguous": dict(causal=True, zigzag=False),
    "full": dict(causal=False, zigzag=False),
    # Shards of 12 tokens: a causal window inside one block back (the ring stops after two steps), one reaching two
    # blocks back, and a two-sided window that needs blocks from both neighbours.
    "causal window 5": dict(causal=True, zigzag=False, window=(5, 0)),
    "causal window 15": dict(causal=True, zigzag=False, window=(15, -1)),
    "window 4,3": dict(causal=False, zigzag=False, window=(4, 3)),
}


@pytest.mark.interpreter
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_ring_gloo(name, world, tmp_path):
    case = CASES[name] | dict(shape=dict(seqlen=12 * world, nheads=4, nheads_kv=2, head_dim=16,
                                         dtype=torch.float16))
    _check(case, _run(world, "gloo", case, tmp_path))


def _check_varlen(case, world, gathered):
    """Each sequence of the gathered packed results against the fp64 reference of that whole sequence."""
    q, k, v, dout, cu = _varlen_inputs(world, **case["shape"])
    per_seq = {name: [] for name in ("ref", "pt", "floor")}
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        seq = [t[None, a:b] for t in (q, k, v, dout)]
        ref_in = [t.double().requires_grad_() for t in seq[:3]]
        ref, _, probs = attention_ref(*ref_in, return_probs=True, causal=case["causal"])
        pt_in = [t.clone().requires_grad_() for t in seq[:3]]
        pt, _ = attention_ref(*pt_in, upcast=False, causal=case["causal"])
        floors = accumulation_floor(*seq, ref, probs)
        per_seq["ref"].append([ref.detach(), *torch.autograd.grad(ref, ref_in, seq[3])])
        per_seq["pt"].append([pt.detach(), *torch.autograd.grad(pt, pt_in, seq[3])])
        per_seq["floor"].append([floors[name] for name in ("out", "dq", "dk", "dv")])
    # Packed back: (total, heads, dim) each, as the gathered results.
    ref, pt, floor = ([torch.cat(ts, 1)[0] for ts in zip(*per_seq[name])] for name in ("ref", "pt", "floor"))
    check_close("out", gathered[0], ref[0], pt[0], 2, floor=floor[0])
    scale = max(g.abs().max().item() for g in ref[1:])
    for name, ours, r, p, f in zip(("dq", "dk", "dv"), gathered[1:], ref[1:], pt[1:], floor[1:]):
        check_close(name, ours, r, p, 3, scale, floor=f)


VARLEN_CASES = {
    "causal contiguous": dict(causal=True, zigzag=False),
    "causal zigzag": dict(causal=True, zigzag=True),
    # Head dims 12 (padded to 16 for the kernels) and 8 for v.
    "full, head dims 12/8": dict(causal=False, zigzag=False, head_dim=12, head_dim_v=8),
}


@pytest.mark.interpreter
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_ring_varlen_gloo(name, world, tmp_path):
    """ring_flash_attn_varlen_func over three sequences of (12, 24, 6) x world tokens, GQA 4/2."""
    case = dict(VARLEN_CASES[name])
    dims = dict(head_dim=case.pop("head_dim", 16), head_dim_v=case.pop("head_dim_v", 16))
    case |= dict(varlen=True, shape=dict(nheads=4, nheads_kv=2, dtype=torch.float16, **dims))
    _check_varlen(case, world, _run(world, "gloo", case, tmp_path))


@pytest.mark.gpu
def test_ring_nccl(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for NCCL, this machine has {torch.cuda.device_count()}")
    world = min(torch.cuda.device_count(), 4)
    case = dict(causal=True, zigzag=True, shape=dict(seqlen=256 * world, nheads=8, nheads_kv=2, head_dim=128,
                                                     dtype=torch.bfloat16))
    _check(case, _run(world, "nccl", case, tmp_path))


def test_layouts_round_trip():
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    for zigzag in (False, True):
        shards = [shard(x, r, 3, zigzag) for r in range(3)]
        assert torch.equal(unshard(shards, zigzag), x)
    # 6 chunks of 4 tokens: rank 0 holds the first and the last.
    assert [int(t) // 3 for t in shard(x, 0, 3, True)[0, :, 0]] == [0, 1, 2, 3, 20, 21, 22, 23]


def test_varlen_layouts_round_trip():
    x = torch.arange(42 * 2).reshape(42, 2)
    cu = torch.tensor([0, 12, 36, 36, 42], dtype=torch.int32)  # a zero-length sequence too
    for zigzag in (False, True):
        shards = [shard_varlen(x, cu, r, 3, zigzag) for r in range(3)]
        assert torch.equal(unshard_varlen(shards, cu, zigzag), x)
        assert local_cu_seqlens(cu, 3, zigzag).tolist() == [0, 4, 12, 12, 14]
    # Zigzag, 6 chunks per sequence: rank 1 holds chunks 1 and 4 of each.
    assert shard_varlen(x, cu, 1, 3, True)[:, 0].tolist() == [
        2 * t for t in (2, 3, 8, 9, 16, 17, 18, 19, 28, 29, 30, 31, 37, 40)]
    # Lengths that do not split into world_size (with zigzag, 2 world_size) chunks; shards of the wrong size.
    with pytest.raises(ValueError, match="cu_seqlens_global: sequence 1 has 24 tokens.* 5 equal chunks"):
        shard_varlen(torch.zeros(29), torch.tensor([0, 5, 29]), 0, 5)
    with pytest.raises(ValueError, match="cu_seqlens_global: sequence 0 has 6 tokens.* 4 equal chunks"):
        local_cu_seqlens(torch.tensor([0, 6, 14]), 2, zigzag=True)
    with pytest.raises(ValueError, match=r"shards\[1\] has 4 tokens"):
        unshard_varlen([x[:14], x[:4]], torch.tensor([0, 12, 28]))


def test_varlen_bad_arguments():
    """Refused before the ring starts (no process group is needed to see it)."""
    q = torch.zeros(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="window_size .*another offset in each sequence"):
        ring_flash_attn_varlen_func(q, q, q, cu, 6, causal=True, window_size=(2, 0))
    with pytest.raises(NotImplementedError, match="window_size"):
        ring_flash_attn_varlen_func(q, q, q, cu, 6, window_size=(3, 3), zigzag=True)
    odd = torch.tensor([0, 4, 7, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens: zigzag .* sequence 1 has 3 tokens"):
        ring_flash_attn_varlen_func(q, q, q, odd, 4, causal=True, zigzag=True)
    with pytest.raises(ValueError, match="q and k must hold the same tokens"):
        ring_flash_attn_varlen_func(q, q[:8], q[:8], cu, 6)


def test_shards_of_the_wrong_rank_refused():
    dense, packed = torch.zeros(1, 4, 2, 16), torch.zeros(4, 2, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"k must be a 4-d tensor \(batch, seqlen_local"):
        ring_flash_attn_func(dense, packed, dense)
    with pytest.raises(ValueError, match=r"q must be a 3-d tensor \(total_local"):
        ring_flash_attn_varlen_func(dense, packed, packed, cu, 4)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        ring_flash_attn_varlen_func(packed, packed, packed, cu, 4, deterministic=1)


def test_zigzag_window_refused():
    q = torch.zeros(1, 4, 2, 16)
    with pytest.raises(NotImplementedError, match="window_size with zigzag=True"):
        ring_flash_attn_func(q, q, q, causal=True, window_size=(2, 0), zigzag=True)


def test_visible_block_is_the_mask():
    """Note [ring block masks]: for every small block and band lo <= j - i <= hi, the slices and bottom-right
    window _visible_block gives select exactly the visible pairs."""
    import itertools
    from flashtile.distributed import _visible_block
    for sq, sk in itertools.product(range(1, 7), repeat=2):
        for lo, hi in itertools.product([None, *range(-8, 9)], repeat=2):
            if lo is not None and hi is not None and lo > hi:
                continue
            want = {(i, j) for i in range(sq) for j in range(sk)
                    if (lo is None or j - i >= lo) and (hi is None or j - i <= hi)}
            block = _visible_block(lo, hi, sq, sk)
            got = set()
            if block is not None:
                rows, keys, (left, right) = block
                n, m = rows.stop - rows.start, keys.stop - keys.start
                assert left >= -1 and right >= -1
                got = {(i + rows.start, j + keys.start) for i in range(n) for j in range(m)
                       if (left < 0 or j >= i + m - n - left) and (right < 0 or j <= i + m - n + right)}
            assert got == want, (sq, sk, lo, hi, block)
