"""Ring attention over a torch.distributed process group: each rank holds a shard of the sequence, K/V blocks
travel around the ring, and each rank merges its partial results with the log-sum-exp.

Note [ring attention]: rank r of n holds q, k, v for its tokens. Step s (0 <= s < n) attends r's queries to the
K/V block that started on rank src = r - s (mod n), while that block is sent on to rank r + 1 and the next one
received from rank r - 1 (P2P, posted before the step's kernels, waited for after them, so the transfer hides
behind the compute). Each step's (out, lse) is folded into the running result as `combine` does: lse = log(e^lse
+ e^lse_b), out = e^(lse_old - lse) out + e^(lse_b - lse) out_b, in fp32. The backward walks the same ring with
the final out and lse (the kernels' backward takes an external LSE, so each block's P is the global softmax's):
dQ accumulates on the rank, and each block's dK/dV travels with it, every rank adding its part, then goes home
with one more hop. Sums run in a fixed order, so results are bitwise reproducible from run to run (not equal to
the bits of a single-device call, whose sums run in another order).

Layouts. Contiguous (default): rank r holds tokens [r S/n, (r+1) S/n). Under a causal mask rank n-1 then does n
blocks of work and rank 0 one, so `zigzag=True` takes the load-balanced order of ring-flash-attn and PyTorch's
context parallel: the sequence is cut into 2n chunks and rank r holds chunks r and 2n-1-r, so every rank does the
same work. `shard` and `unshard` move a full tensor into and out of either layout.
Per step, contiguous causal: src < r all keys, src == r causal, src > r nothing (the block still passes through).
Zigzag causal (local halves a = chunk r, b = chunk 2n-1-r): src == r causal over the local 2C x 2C block (which is
exactly the global mask); src < r every query over the block's first half; src > r the second half of the queries
over the whole block.

What this module does not do: sliding windows (NotImplementedError), varlen shards, or overlap the backward's
dK/dV hops beyond one step.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .interface import flash_attn_func
from .ops.bwd import attention_bwd
from .ops.common import PACK_NONE, call
from .problem import normalize_window, pad_head_dim

__all__ = ["ring_flash_attn_func", "shard", "unshard"]


def shard(x: torch.Tensor, rank: int, world_size: int, zigzag: bool = False, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s shard of a full tensor along `dim` (the sequence): a contiguous slice, or with `zigzag` chunks
    rank and 2 world_size - 1 - rank of 2 world_size (Note [ring attention]). The length must divide evenly."""
    parts = 2 * world_size if zigzag else world_size
    if x.shape[dim] % parts:
        raise ValueError(f"the sequence ({x.shape[dim]} tokens) must split into {parts} equal chunks")
    chunks = x.chunk(parts, dim)
    if zigzag:
        return torch.cat([chunks[rank], chunks[parts - 1 - rank]], dim)
    return chunks[rank]


def unshard(shards: list[torch.Tensor], zigzag: bool = False, dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order (the inverse of `shard`)."""
    if not zigzag:
        return torch.cat(shards, dim)
    halves = [s.chunk(2, dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def ring_flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), deterministic=False,
                         group=None, *, zigzag=False):
    """Attention of a sequence sharded across the ranks of `group` (default: the world), each rank passing its
    shards: q (batch, seqlen_local, nheads, headdim), k and v (batch, seqlen_local, nheads_k, headdim), the same
    seqlen_local on every rank (even with `zigzag`). Returns this rank's shard of the output; differentiable in q,
    k and v (Note [ring attention]).

    Arguments as `flash_attn_func` (GQA included); causal is over the whole sequence in the layout given
    (`zigzag`: the load-balanced order of `shard(..., zigzag=True)`). deterministic: accepted; the result is always
    reproducible. window_size other than (-1, -1) raises NotImplementedError.
    """
    left, right = normalize_window(False, window_size)
    if (left, right) != (-1, -1):
        raise NotImplementedError("ring_flash_attn_func: window_size is not supported yet (a window's edge blocks "
                                  "need masks that flash_attn_func's bottom-right windows cannot express)")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor (batch, seqlen_local, nheads, headdim)")
    if zigzag and q.shape[1] % 2:
        raise ValueError(f"zigzag shards hold two equal chunks: seqlen_local must be even, got {q.shape[1]}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must hold the same tokens of the sequence, got {q.shape[1]} and {k.shape[1]}")
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    # The kernels take head dims padded to a multiple of 8; F.pad and the slice below carry the gradients.
    q, k = (_pad(t, head_dim) for t in (q, k))
    v = _pad(v, head_dim_v)
    out = _RingAttention.apply(q, k, v, scale, bool(causal), bool(zigzag), group)
    return out[..., :head_dim_v] if out.shape[-1] != head_dim_v else out


def _pad(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    width = pad_head_dim(head_dim)
    return t if width == head_dim else F.pad(t, (0, width - head_dim))


_GRAD_TAG = 16  # tags of the backward's dK/dV exchange; K/V's start at 0


class _Ring:
    """This rank's place in the ring, and its P2P exchange with its neighbours."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = self._global((self.rank + 1) % self.size)
        self.prev = self._global((self.rank - 1) % self.size)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def pass_on(self, *tensors, tag: int = 0):
        """Send `tensors` to the next rank and receive as many, alike, from the previous: (received, requests).
        Wait on the requests before reading what was received. The backward has two exchanges in flight (K/V and
        the travelling dK/dV, of other dtypes): each has its own tags, so no message lands in the other's buffer."""
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        sent = [t.contiguous() for t in tensors]
        # Each request keeps its tensor referenced until it is waited for.
        requests = [(dist.isend(t, self.next, group=self.group, tag=tag + i), t) for i, t in enumerate(sent)]
        requests += [(dist.irecv(t, self.prev, group=self.group, tag=tag + i), t) for i, t in enumerate(received)]
        return received, requests


def _wait(requests) -> None:
    for work, _ in requests:
        work.wait()


def _plan(rank: int, src: int, causal: bool, zigzag: bool, half: int):
    """What step (rank, src) computes: None, or (query rows, key rows, causal) as slices of the local shards."""
    everything = slice(None)
    if not causal:
        return everything, everything, False
    if src == rank:
        return everything, everything, True
    if not zigzag:
        return (everything, everything, False) if src < rank else None
    if src < rank:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's normalised (out, lse) into the running fp32 ones, in place; lse (B, H, S), out (B, S, H, D).
    A row with no visible key has lse +inf from the kernels (flash-attn's convention) and weight 0."""
    block_lse = torch.where(torch.isinf(block_lse), float("-inf"), block_lse)
    new = torch.logaddexp(lse, block_lse)
    empty = torch.isneginf(new)
    w_old = torch.where(empty, 0.0, torch.exp(lse - new)).transpose(1, 2).unsqueeze(-1)
    w_new = torch.where(empty, 0.0, torch.exp(block_lse - new)).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).add_(block_out.float() * w_new)
    lse.copy_(new)


@functools.cache
def _bwd_names() -> tuple[str, ...]:
    return tuple(inspect.signature(attention_bwd.impl).parameters)


def _block_backward(dout, q, k, v, out, lse, scale: float, causal: bool):
    """(dq, dk, dv) of one block with the final out and lse (flashtile::bwd with an external LSE)."""
    named = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=None, cu_seqlens_k=None,
                 seqused_q=None, seqused_k=None, alibi_slopes=None, learnable_sink=None, rng=None,
                 max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1], softmax_scale=scale, window_left=-1,
                 window_right=0 if causal else -1, attention_chunk=0, softcap=0.0, dropout_p=0.0,
                 packing=PACK_NONE)
    return call(attention_bwd, *(named[n] for n in _bwd_names()))


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, scale: float, causal: bool, zigzag: bool, group):
        ring = _Ring(group)
        half = q.shape[1] // 2
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
        k_cur, v_cur = k, v
        for step in range(ring.size):
            if step < ring.size - 1:
                (k_next, v_next), requests = ring.pass_on(k_cur, v_cur)
            plan = _plan(ring.rank, (ring.rank - step) % ring.size, causal, zigzag, half)
            if plan is not None:
                rows, keys, block_causal = plan
                block_out, block_lse, _ = flash_attn_func(q[:, rows], k_cur[:, keys], v_cur[:, keys],
                                                          softmax_scale=scale, causal=block_causal,
                                                          return_attn_probs=True)
                _merge(out[:, rows], lse[..., rows], block_out, block_lse)
            if step < ring.size - 1:
                _wait(requests)
                k_cur, v_cur = k_next, v_next
        lse = torch.where(torch.isneginf(lse), float("inf"), lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal, ctx.zigzag, ctx.group = scale, causal, zigzag, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        half = q.shape[1] // 2
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        # The dK/dV of the block this rank holds, which travel with it (Note [ring attention]).
        dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        k_cur, v_cur = k, v
        grad_requests = []
        for step in range(ring.size):
            if step < ring.size - 1:
                (k_next, v_next), requests = ring.pass_on(k_cur, v_cur)
            plan = _plan(ring.rank, (ring.rank - step) % ring.size, ctx.causal, ctx.zigzag, half)
            if plan is not None:
                rows, keys, block_causal = plan
                dq_b, dk_b, dv_b = _block_backward(dout[:, rows], q[:, rows], k_cur[:, keys], v_cur[:, keys],
                                                   out[:, rows], lse[..., rows], ctx.scale, block_causal)
                dq[:, rows] += dq_b
            _wait(grad_requests)  # the travelling dK/dV of this step's block has arrived
            if plan is not None:
                dk[:, keys] += dk_b
                dv[:, keys] += dv_b
            # On to the next rank (after the last step: home, to the block's own rank).
            (dk, dv), grad_requests = ring.pass_on(dk, dv, tag=_GRAD_TAG)
            if step < ring.size - 1:
                _wait(requests)
                k_cur, v_cur = k_next, v_next
        _wait(grad_requests)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
