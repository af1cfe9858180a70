"""Ring attention (flashtile.distributed) across real processes: the gloo backend on the CPU tier (kernels through
the interpreter), NCCL on a machine with several GPUs. Each rank runs its shard forward and backward; the
gathered output and gradients are checked against the fp64 reference of the whole sequence (2x / 3x rule), for
contiguous and zigzag layouts, causal or not, GQA, 2 and 3 ranks; a second run must give the same bits."""

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashtile.distributed import ring_flash_attn_func, shard, unshard
from flashtile.testing import accumulation_floor, attention_ref, check_close


def _inputs(seqlen, nheads, nheads_kv, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seqlen, nheads, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(2, seqlen, nheads_kv, head_dim, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(2, seqlen, nheads, head_dim, generator=g).to(dtype)
    return q, k, v, dout


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
        q, k, v, dout = _inputs(**case["shape"])
        zigzag, causal, window = case["zigzag"], case["causal"], case.get("window", (-1, -1))
        results = []
        for _ in range(2):  # twice: the result must be reproducible
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
