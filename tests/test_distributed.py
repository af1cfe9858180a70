"""Ring attention (flashtile.distributed) across real processes: the gloo backend on the CPU tier (kernels through
the interpreter), NCCL on a machine with several GPUs. Each rank runs its shard forward and backward; the
gathered output and gradients are checked against the fp64 reference of the whole sequence (2x / 3x rule), for
contiguous and zigzag layouts, causal or not, GQA, 2 and 3 ranks; a second run must give the same bits."""

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
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        device = f"cuda:{rank}" if backend == "nccl" else "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        q, k, v, dout = _inputs(**case["shape"])
        zigzag, causal = case["zigzag"], case["causal"]
        results = []
        for _ in range(2):  # twice: the result must be reproducible
            local = [shard(t, rank, world, zigzag).to(device).requires_grad_(t is not dout)
                     for t in (q, k, v, dout)]
            out = ring_flash_attn_func(*local[:3], causal=causal, zigzag=zigzag)
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
    causal = case["causal"]
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _, probs = attention_ref(*ref_in, causal=causal, return_probs=True)
    ref_grads = torch.autograd.grad(ref, ref_in, dout)
    pt_in = [t.clone().requires_grad_() for t in (q, k, v)]
    pt, _ = attention_ref(*pt_in, causal=causal, upcast=False)
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
}


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


def test_window_refused():
    q = torch.zeros(1, 4, 2, 16)
    with pytest.raises(NotImplementedError, match="window_size"):
        ring_flash_attn_func(q, q, q, window_size=(2, 0))
