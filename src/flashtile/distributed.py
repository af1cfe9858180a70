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

Note [ring block masks]: in the contiguous layout query i of rank r and key j of rank src are tokens r S + i and
src S + j, so a mask (causal, a sliding window) is j - i in [lo, hi] with lo = (r - src) S - left and hi = (r - src)
S + right (None where unbounded). `_visible_block` turns that into the rows and keys that see anything and the
bottom-right window flash_attn_func takes on those slices (a band above the diagonal, j - i >= c > 0, becomes rows
[0, S - c) over keys [c, S) with window (0, -1)); tests/test_distributed.py checks it against the mask pair by pair
for every small case. A block no rank's window reaches is never sent: the ring runs only as many steps as the
widest reach, and the backward sends each block's dK/dV home directly from where the last step left it.

Zigzag causal (local halves a = chunk r, b = chunk 2n-1-r): src == r causal over the local 2C x 2C block (which is
exactly the global mask); src < r every query over the block's first half; src > r the second half of the queries
over the whole block. Zigzag takes no window: a sliding window is load-balanced in the contiguous layout already.

What this module does not do: varlen shards, or overlap the backward's dK/dV hops beyond one step.
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
    (`zigzag`: the load-balanced order of `shard(..., zigzag=True)`); window_size likewise, over global positions,
    in the contiguous layout (with zigzag: NotImplementedError). deterministic: accepted; the result is always
    reproducible.
    """
    window = normalize_window(causal, window_size)
    if zigzag and window != ((-1, 0) if causal else (-1, -1)):
        raise NotImplementedError("ring_flash_attn_func: window_size with zigzag=True (a sliding window is "
                                  "load-balanced in the contiguous layout: pass zigzag=False)")
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
    out = _RingAttention.apply(q, k, v, scale, window, bool(zigzag), group)
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

    def _global(self, rank: int) -> int:
        rank %= self.size
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def pass_on(self, *tensors, tag: int = 0, hops: int = 1):
        """Send `tensors` to the rank `hops` ahead (mod size) and receive as many, alike, from `hops` behind:
        (received, requests); with hops 0, the tensors themselves and nothing to wait for. Wait on the requests
        before reading what was received. The backward has two exchanges in flight (K/V and the travelling dK/dV,
        of other dtypes): each has its own tags, so no message lands in the other's buffer."""
        if hops % self.size == 0:
            return list(tensors), []
        dst, src = self._global(self.rank + hops), self._global(self.rank - hops)
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        sent = [t.contiguous() for t in tensors]
        # Each request keeps its tensor referenced until it is waited for.
        requests = [(dist.isend(t, dst, group=self.group, tag=tag + i), t) for i, t in enumerate(sent)]
        requests += [(dist.irecv(t, src, group=self.group, tag=tag + i), t) for i, t in enumerate(received)]
        return received, requests


def _wait(requests) -> None:
    for work, _ in requests:
        work.wait()


def _visible_block(lo, hi, sq: int, sk: int):
    """Query i < sq sees key j < sk iff lo <= j - i <= hi (None: unbounded). None if no pair is visible, else (query
    rows, key rows, (left, right)): the slices holding every visible pair, and the window flash_attn_func applies
    on them, bottom-right aligned (Note [ring block masks])."""
    lo = None if lo is not None and lo <= 1 - sq else lo
    hi = None if hi is not None and hi >= sk - 1 else hi
    r0, r1 = (0 if hi is None else max(0, -hi)), (sq if lo is None else min(sq, sk - lo))
    k0, k1 = (0 if lo is None else max(0, lo)), (sk if hi is None else min(sk, sq + hi))
    if r0 >= r1 or k0 >= k1:
        return None
    shift, diag = k0 - r0, (k1 - k0) - (r1 - r0)  # j - i = j' - i' + shift on the slices; flash's diagonal there
    left = -1 if lo is None else diag - (lo - shift)
    right = -1 if hi is None else (hi - shift) - diag
    return slice(r0, r1), slice(k0, k1), (left, right)


def _plan(rank: int, src: int, seqlen: int, window: tuple[int, int], zigzag: bool):
    """What step (rank, src) computes: None, or (query rows, key rows, window) on the local shards of `seqlen`."""
    everything, half = slice(None), seqlen // 2
    if zigzag:  # causal or not, no other window (ring_flash_attn_func checks)
        if window == (-1, -1):
            return everything, everything, window
        if src == rank:
            return everything, everything, window
        if src < rank:
            return everything, slice(0, half), (-1, -1)
        return slice(half, None), everything, (-1, -1)
    left, right = window
    delta = (rank - src) * seqlen
    return _visible_block(None if left < 0 else delta - left, None if right < 0 else delta + right, seqlen, seqlen)


def _steps(size: int, seqlen: int, window: tuple[int, int], zigzag: bool) -> int:
    """Ring steps the call needs: one past the farthest block any rank's mask reaches (Note [ring block masks])."""
    return 1 + max(s for s in range(size) for r in range(size)
                   if _plan(r, (r - s) % size, seqlen, window, zigzag) is not None)


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


def _block_backward(dout, q, k, v, out, lse, scale: float, window: tuple[int, int]):
    """(dq, dk, dv) of one block with the final out and lse (flashtile::bwd with an external LSE)."""
    named = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=None, cu_seqlens_k=None,
                 seqused_q=None, seqused_k=None, alibi_slopes=None, learnable_sink=None, rng=None,
                 max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1], softmax_scale=scale, window_left=window[0],
                 window_right=window[1], attention_chunk=0, softcap=0.0, dropout_p=0.0,
                 packing=PACK_NONE)
    return call(attention_bwd, *(named[n] for n in _bwd_names()))


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, scale: float, window: tuple[int, int], zigzag: bool, group):
        ring = _Ring(group)
        seqlen = q.shape[1]
        steps = _steps(ring.size, seqlen, window, zigzag)
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], seqlen), float("-inf"), dtype=torch.float32, device=q.device)
        k_cur, v_cur = k, v
        for step in range(steps):
            if step < steps - 1:
                (k_next, v_next), requests = ring.pass_on(k_cur, v_cur)
            plan = _plan(ring.rank, (ring.rank - step) % ring.size, seqlen, window, zigzag)
            if plan is not None:
                rows, keys, block_window = plan
                block_out, block_lse, _ = flash_attn_func(q[:, rows], k_cur[:, keys], v_cur[:, keys],
                                                          softmax_scale=scale, window_size=block_window,
                                                          return_attn_probs=True)
                _merge(out[:, rows], lse[..., rows], block_out, block_lse)
            if step < steps - 1:
                _wait(requests)
                k_cur, v_cur = k_next, v_next
        lse = torch.where(torch.isneginf(lse), float("inf"), lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.window, ctx.zigzag, ctx.group, ctx.steps = scale, window, zigzag, group, steps
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, steps, seqlen = _Ring(ctx.group), ctx.steps, q.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        # The dK/dV of the block this rank holds, which travel with it (Note [ring attention]).
        dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        k_cur, v_cur = k, v
        grad_requests = []
        for step in range(steps):
            if step < steps - 1:
                (k_next, v_next), requests = ring.pass_on(k_cur, v_cur)
            plan = _plan(ring.rank, (ring.rank - step) % ring.size, seqlen, ctx.window, ctx.zigzag)
            if plan is not None:
                rows, keys, block_window = plan
                dq_b, dk_b, dv_b = _block_backward(dout[:, rows], q[:, rows], k_cur[:, keys], v_cur[:, keys],
                                                   out[:, rows], lse[..., rows], ctx.scale, block_window)
                dq[:, rows] += dq_b
            _wait(grad_requests)  # the travelling dK/dV of this step's block has arrived
            if plan is not None:
                dk[:, keys] += dk_b
                dv[:, keys] += dv_b
            if step < steps - 1:
                (dk, dv), grad_requests = ring.pass_on(dk, dv, tag=_GRAD_TAG)
                _wait(requests)
                k_cur, v_cur = k_next, v_next
        # The block held now started steps - 1 ranks behind: its dK/dV, complete, go home (with steps = size, that
        # is one rank ahead, as every other hop).
        (dk, dv), grad_requests = ring.pass_on(dk, dv, tag=_GRAD_TAG, hops=1 - steps)
        _wait(grad_requests)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
