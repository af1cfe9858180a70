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

Note [varlen ring attention]: `ring_flash_attn_varlen_func` runs the ring over a packed batch (flash-attn's varlen
layout, (total, nheads, headdim) with cu_seqlens), every sequence split across the ranks as the dense function
splits its one sequence: rank r holds the tokens [r L/n, (r+1) L/n) of each sequence of length L (contiguous), or
its chunks r and 2n-1-r of 2n (zigzag), packed in sequence order. The local cu_seqlens are then the same on every
rank, so one varlen call per step serves every sequence: contiguous causal is causal over the local block for
src == r, every pair for src < r and nothing for src > r; zigzag causal takes the halves of the zigzag rule above,
per sequence, which are not one slice of the packed tensor: the rows of each sequence's first (second) half are
gathered by indices built once per call from the cu_seqlens (read to the host once, with zigzag only), with the
halves' cu_seqlens = cu_seqlens / 2. A block's rows of out, lse and dQ are read and written back through the same
indices, whose rows are distinct, so nothing is summed twice and the bits do not depend on the scatter's order.
Sliding windows are refused: in the contiguous layout the offset between rank r's queries and rank src's keys is
(r - src) L/n, another per sequence, while one varlen call applies one window to every sequence. `shard_varlen`,
`unshard_varlen` and `local_cu_seqlens` move packed tensors and their cu_seqlens into and out of either layout.

What this module does not do: sliding windows over varlen shards, or overlap the backward's dK/dV hops beyond one
step.
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .interface import flash_attn_func, flash_attn_varlen_func
from .ops.bwd import attention_bwd
from .ops.common import PACK_NONE, call
from .problem import _check_cu_values, normalize_window, pad_head_dim, varlen_problem

__all__ = ["ring_flash_attn_func", "ring_flash_attn_varlen_func", "shard", "unshard", "shard_varlen",
           "unshard_varlen", "local_cu_seqlens"]


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


def local_cu_seqlens(cu_seqlens_global, world_size: int, zigzag: bool = False) -> torch.Tensor:
    """The cu_seqlens of every rank's packed shard (the same on every rank): each sequence's length / world_size,
    int32, on cu_seqlens_global's device. Each length must split into world_size equal chunks (with `zigzag`,
    2 world_size)."""
    cu = _global_cu(cu_seqlens_global, world_size, zigzag)
    device = cu_seqlens_global.device if isinstance(cu_seqlens_global, torch.Tensor) else None
    return (cu // world_size).to(device=device, dtype=torch.int32)


def shard_varlen(x: torch.Tensor, cu_seqlens_global, rank: int, world_size: int,
                 zigzag: bool = False) -> torch.Tensor:
    """Rank `rank`'s packed tokens of a packed batch x (total, ...) whose sequences cu_seqlens_global describes:
    from each sequence, in order, what `shard` takes from a single one (Note [varlen ring attention]). Their
    cu_seqlens are `local_cu_seqlens(cu_seqlens_global, world_size, zigzag)`."""
    cu = _global_cu(cu_seqlens_global, world_size, zigzag, x.shape[0])
    return x.index_select(0, _shard_index(cu, rank, world_size, zigzag).to(x.device))


def unshard_varlen(shards: list[torch.Tensor], cu_seqlens_global, zigzag: bool = False) -> torch.Tensor:
    """The packed batch from every rank's packed shard, in rank order (the inverse of `shard_varlen`)."""
    world_size = len(shards)
    cu = _global_cu(cu_seqlens_global, world_size, zigzag)
    index = [_shard_index(cu, r, world_size, zigzag) for r in range(world_size)]
    for r, (s, i) in enumerate(zip(shards, index)):
        if s.shape[0] != i.numel():
            raise ValueError(f"shards[{r}] has {s.shape[0]} tokens, the layout gives rank {r} {i.numel()}")
    order = torch.argsort(torch.cat(index))  # the packed position of every token of the concatenated shards
    return torch.cat(shards, 0).index_select(0, order.to(shards[0].device))


def _global_cu(cu_seqlens_global, world_size: int, zigzag: bool, total: Optional[int] = None) -> torch.Tensor:
    """cu_seqlens_global on the host (int64), checked: a valid cu_seqlens (ending at `total` if given) whose every
    length splits into world_size (zigzag: 2 world_size) equal chunks."""
    cu = torch.as_tensor(cu_seqlens_global)
    if cu.dim() != 1 or cu.numel() < 1 or cu.is_floating_point() or cu.is_complex():
        raise ValueError(f"cu_seqlens_global must be a 1-d integer tensor, got {cu.dtype} of shape {tuple(cu.shape)}")
    cu = cu.cpu().long()
    lengths = cu.diff()
    if cu[0] != 0 or bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens_global must start at 0 and never decrease, got {cu.tolist()}")
    if total is not None and cu[-1] != total:
        raise ValueError(f"cu_seqlens_global[-1] = {int(cu[-1])} must equal the packed total ({total})")
    parts = 2 * world_size if zigzag else world_size
    uneven = (lengths % parts).nonzero()
    if uneven.numel():
        b = int(uneven[0])
        raise ValueError(f"cu_seqlens_global: sequence {b} has {int(lengths[b])} tokens, which do not split into "
                         f"{parts} equal chunks ({'2 x ' if zigzag else ''}world_size {world_size})")
    return cu


def _runs(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The concatenation of arange(s, s + n) over the pairs of starts and lengths (host int64 tensors)."""
    ends = lengths.cumsum(0)
    total = int(ends[-1]) if ends.numel() else 0
    return torch.arange(total) + torch.repeat_interleave(starts - (ends - lengths), lengths)


def _shard_index(cu: torch.Tensor, rank: int, world_size: int, zigzag: bool) -> torch.Tensor:
    """The packed positions of rank `rank`'s tokens, in its shard's order (cu from _global_cu)."""
    parts = 2 * world_size if zigzag else world_size
    chunks = (rank, parts - 1 - rank) if zigzag else (rank,)
    size = cu.diff() // parts
    starts = torch.stack([cu[:-1] + c * size for c in chunks], 1).flatten()  # sequence-major, then chunk
    return _runs(starts, size.repeat_interleave(len(chunks)))


def _check_shards(q, k, v, deterministic, layout: str) -> None:
    """The checks both ring functions make before the ring starts: q, k and v tensors of the layout's rank."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != layout.count(",") + 1:
            raise ValueError(f"{name} must be a {layout.count(',') + 1}-d tensor {layout}")


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
    _check_shards(q, k, v, deterministic, "(batch, seqlen_local, nheads, headdim)")
    if zigzag and q.shape[1] % 2:
        raise ValueError(f"zigzag shards hold two equal chunks: seqlen_local must be even, got {q.shape[1]}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must hold the same tokens of the sequence, got {q.shape[1]} and {k.shape[1]}")
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    # The kernels take head dims padded to a multiple of 8; F.pad and the slice below carry the gradients.
    q, k = (_pad(t, head_dim) for t in (q, k))
    v = _pad(v, head_dim_v)
    plan = functools.partial(_plan, seqlen=q.shape[1], window=window, zigzag=bool(zigzag))
    out = _RingAttention.apply(q, k, v, scale, plan, group)
    return out[..., :head_dim_v] if out.shape[-1] != head_dim_v else out


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, softmax_scale=None, causal=False,
                                window_size=(-1, -1), deterministic=False, group=None, *, zigzag=False):
    """Attention of a packed batch whose every sequence is sharded across the ranks of `group` (default: the
    world), each rank passing its packed tokens: q (total_local, nheads, headdim), k and v (total_local, nheads_k,
    headdim / headdim_v), cu_seqlens ((batch + 1,), int32) and max_seqlen the local ones, the same on every rank
    (Note [varlen ring attention]; `shard_varlen` and `local_cu_seqlens` make them from the global batch). Returns
    this rank's packed output; differentiable in q, k and v.

    Arguments as `flash_attn_varlen_func` with one cu_seqlens and max_seqlen for queries and keys (GQA and
    headdim_v included); causal is over each whole sequence in the layout given (`zigzag`: the load-balanced order
    of `shard_varlen(..., zigzag=True)`, which needs every local length even: ValueError otherwise). window_size
    other than causal's raises NotImplementedError: rank r's queries sit (r - src) x the local length ahead of
    rank src's keys, another offset in each sequence, and one varlen call applies one window to all of them.
    deterministic: accepted; the result is always reproducible.
    """
    window = normalize_window(causal, window_size)
    if window not in ((-1, -1), (-1, 0)):
        raise NotImplementedError(
            "ring_flash_attn_varlen_func: window_size (a sliding window): rank r's queries sit (r - src) x the "
            "local length ahead of rank src's keys, another offset in each sequence, and one varlen call applies "
            "one window to all of them; pad the sequences to one length and use ring_flash_attn_func")
    _check_shards(q, k, v, deterministic, "(total_local, nheads, headdim)")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must hold the same tokens of the batch, got {q.shape[0]} and {k.shape[0]}")
    # Every argument checked here, before the ring starts, rather than by the first step's kernel call.
    varlen_problem(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale, causal, window_size,
                   0.0, None, 0.0)
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    q, k = (_pad(t, head_dim) for t in (q, k))
    v = _pad(v, head_dim_v)
    plan = _VarlenPlan(cu_seqlens, int(max_seqlen), window, bool(zigzag), q.shape[0])
    out = _RingAttention.apply(q, k, v, scale, plan, group)
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


_Rows = Union[slice, torch.Tensor]


class _Block(NamedTuple):
    """What one ring step computes on the local shards: the query rows and key rows it takes along the token axis
    (a slice, or the indices of a varlen zigzag half), and the bottom-right window the kernels apply on them; a
    varlen block also has the cu_seqlens and max_seqlen of those rows and keys (None and 0 for a dense one)."""
    rows: _Rows
    keys: _Rows
    window: tuple[int, int]
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0


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


def _plan(rank: int, src: int, seqlen: int, window: tuple[int, int], zigzag: bool) -> Optional[_Block]:
    """What step (rank, src) computes on the dense local shards of `seqlen`: None, or a _Block."""
    everything, half = slice(None), seqlen // 2
    if zigzag:  # causal or not, no other window (ring_flash_attn_func checks)
        if window == (-1, -1) or src == rank:
            return _Block(everything, everything, window)
        if src < rank:
            return _Block(everything, slice(0, half), (-1, -1))
        return _Block(slice(half, None), everything, (-1, -1))
    left, right = window
    delta = (rank - src) * seqlen
    visible = _visible_block(None if left < 0 else delta - left, None if right < 0 else delta + right, seqlen,
                             seqlen)
    return None if visible is None else _Block(*visible)


class _VarlenPlan:
    """What step (rank, src) computes on varlen local shards (Note [varlen ring attention]), called as `_plan`:
    None, or a _Block. The zigzag halves' indices and cu_seqlens are built once, here."""

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int, window: tuple[int, int], zigzag: bool,
                 total: int):
        everything = slice(None)
        # One cu_seqlens object for both sides lets the kernels plan the two sides of self-attention as one.
        self.full = _Block(everything, everything, (-1, -1), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
        self.diagonal = self.full._replace(window=window)
        self.causal, self.zigzag = window == (-1, 0), zigzag
        if not zigzag:
            return
        lengths = _check_cu_values("cu_seqlens", cu_seqlens, total)  # the one read of the values to the host
        odd = (lengths % 2).nonzero()
        if odd.numel():
            b = int(odd[0])
            raise ValueError(f"cu_seqlens: zigzag shards hold two equal chunks of each sequence, so every local "
                             f"length must be even; sequence {b} has {int(lengths[b])} tokens")
        if not self.causal:
            return
        starts, half = lengths.cumsum(0) - lengths, lengths // 2
        first, second = (_runs(s, half).to(cu_seqlens.device) for s in (starts, starts + half))
        cu_half, max_half = cu_seqlens // 2, max_seqlen // 2
        # src < r: every query over each sequence's first half of the keys; src > r: each sequence's second half
        # of the queries over all the keys.
        self.first_keys = _Block(everything, first, (-1, -1), cu_seqlens, cu_half, max_seqlen, max_half)
        self.second_rows = _Block(second, everything, (-1, -1), cu_half, cu_seqlens, max_half, max_seqlen)

    def __call__(self, rank: int, src: int) -> Optional[_Block]:
        if not self.causal:
            return self.full
        if src == rank:
            return self.diagonal
        if self.zigzag:
            return self.first_keys if src < rank else self.second_rows
        return self.full if src < rank else None


def _steps(size: int, plan) -> int:
    """Ring steps the call needs: one past the farthest block any rank's mask reaches (Note [ring block masks])."""
    return 1 + max(s for s in range(size) for r in range(size) if plan(r, (r - s) % size) is not None)


def _take(x: torch.Tensor, rows: _Rows, dim: int) -> torch.Tensor:
    """x's `rows` along `dim`: a view for a slice, a copy for indices."""
    if isinstance(rows, slice):
        return x[(slice(None),) * (dim % x.dim()) + (rows,)]
    return x.index_select(dim, rows)


def _add(x: torch.Tensor, rows: _Rows, dim: int, y: torch.Tensor) -> None:
    """x[rows] += y along `dim`, in place. Indices are distinct, so each entry gets one addition, in no order."""
    if isinstance(rows, slice):
        _take(x, rows, dim).add_(y)
    else:
        x.index_add_(dim, rows, y.to(x.dtype))


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: _Rows, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Fold a block's normalised (out, lse) into `rows` of the running fp32 ones, in place; lse (B, H, S) and out
    (B, S, H, D), or for varlen (H, total) and (total, H, D). A row with no visible key has lse +inf from the
    kernels (flash-attn's convention) and weight 0."""
    tokens = out.dim() - 3
    out_rows, lse_rows = _take(out, rows, tokens), _take(lse, rows, -1)
    block_lse = torch.where(torch.isinf(block_lse), float("-inf"), block_lse)
    new = torch.logaddexp(lse_rows, block_lse)
    empty = torch.isneginf(new)
    w_old = torch.where(empty, 0.0, torch.exp(lse_rows - new)).transpose(-1, -2).unsqueeze(-1)
    w_new = torch.where(empty, 0.0, torch.exp(block_lse - new)).transpose(-1, -2).unsqueeze(-1)
    out_rows.mul_(w_old).add_(block_out.float() * w_new)
    lse_rows.copy_(new)
    if not isinstance(rows, slice):  # gathered copies: write them back
        out.index_copy_(tokens, rows, out_rows)
        lse.index_copy_(lse.dim() - 1, rows, lse_rows)


def _block_forward(q, k, v, scale: float, block: _Block):
    """(out, lse) of one block, normalised over its own keys."""
    if block.cu_seqlens_q is None:
        out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, window_size=block.window, return_attn_probs=True)
    else:
        out, lse, _ = flash_attn_varlen_func(q, k, v, block.cu_seqlens_q, block.cu_seqlens_k, block.max_seqlen_q,
                                             block.max_seqlen_k, softmax_scale=scale, window_size=block.window,
                                             return_attn_probs=True)
    return out, lse


@functools.cache
def _bwd_names() -> tuple[str, ...]:
    return tuple(inspect.signature(attention_bwd.impl).parameters)


def _block_backward(dout, q, k, v, out, lse, scale: float, block: _Block):
    """(dq, dk, dv) of one block with the final out and lse (flashtile::bwd with an external LSE)."""
    dense = block.cu_seqlens_q is None
    named = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=block.cu_seqlens_q,
                 cu_seqlens_k=block.cu_seqlens_k, seqused_q=None, seqused_k=None, alibi_slopes=None,
                 learnable_sink=None, rng=None, max_seqlen_q=q.shape[1] if dense else block.max_seqlen_q,
                 max_seqlen_k=k.shape[1] if dense else block.max_seqlen_k, softmax_scale=scale,
                 window_left=block.window[0], window_right=block.window[1], attention_chunk=0, softcap=0.0,
                 dropout_p=0.0, packing=PACK_NONE)
    return call(attention_bwd, *(named[n] for n in _bwd_names()))


class _RingAttention(torch.autograd.Function):
    """The ring over dense shards (batch, seqlen, heads, dim) or packed varlen ones (total, heads, dim); `plan`
    (rank, src) says what each step computes (`_plan`, `_VarlenPlan`)."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, plan, group):
        ring = _Ring(group)
        steps, tokens = _steps(ring.size, plan), q.dim() - 3
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device)
        # (B, H, S), or (H, total) for varlen: the kernels' lse layouts.
        lse = torch.full((*q.shape[:-3], q.shape[-2], q.shape[-3]), float("-inf"), dtype=torch.float32,
                         device=q.device)
        k_cur, v_cur = k, v
        for step in range(steps):
            if step < steps - 1:
                (k_next, v_next), requests = ring.pass_on(k_cur, v_cur)
            block = plan(ring.rank, (ring.rank - step) % ring.size)
            if block is not None:
                block_out, block_lse = _block_forward(_take(q, block.rows, tokens), _take(k_cur, block.keys, tokens),
                                                      _take(v_cur, block.keys, tokens), scale, block)
                _merge(out, lse, block.rows, block_out, block_lse)
            if step < steps - 1:
                _wait(requests)
                k_cur, v_cur = k_next, v_next
        lse = torch.where(torch.isneginf(lse), float("inf"), lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.plan, ctx.group, ctx.steps = scale, plan, group, steps
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, steps, tokens = _Ring(ctx.group), ctx.steps, q.dim() - 3
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        # The dK/dV of the block this rank holds, which travel with it (Note [ring attention]).
        dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        k_cur, v_cur = k, v
        grad_requests = []
        for step in range(steps):
            if step < steps - 1:
                (k_next, v_next), requests = ring.pass_on(k_cur, v_cur)
            block = ctx.plan(ring.rank, (ring.rank - step) % ring.size)
            if block is not None:
                rows, keys = block.rows, block.keys
                dq_b, dk_b, dv_b = _block_backward(
                    _take(dout, rows, tokens), _take(q, rows, tokens), _take(k_cur, keys, tokens),
                    _take(v_cur, keys, tokens), _take(out, rows, tokens), _take(lse, rows, -1), ctx.scale, block)
                _add(dq, rows, tokens, dq_b)
            _wait(grad_requests)  # the travelling dK/dV of this step's block has arrived
            if block is not None:
                _add(dk, keys, tokens, dk_b)
                _add(dv, keys, tokens, dv_b)
            if step < steps - 1:
                (dk, dv), grad_requests = ring.pass_on(dk, dv, tag=_GRAD_TAG)
                _wait(requests)
                k_cur, v_cur = k_next, v_next
        # The block held now started steps - 1 ranks behind: its dK/dV, complete, go home (with steps = size, that
        # is one rank ahead, as every other hop).
        (dk, dv), grad_requests = ring.pass_on(dk, dv, tag=_GRAD_TAG, hops=1 - steps)
        _wait(grad_requests)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
