"""The attention problem: what to compute, built and validated once at the public API.

`AttnProblem` is a frozen description of one call: shapes, dtype, mask, score modifiers and the ragged/varlen
layout. The interface builds it from user arguments (`dense_problem`, `varlen_problem`; `kvcache_problem` builds
the decode API's KVCacheProblem), which is where every argument is checked and every error names the argument.
Below the API, code trusts it: the custom ops receive only tensors and scalars, and `kernel_flags` derives the
kernels' constexpr flags from those scalars in one place, so the compile-cache key is what the kernels actually
specialise on and is never maintained by hand.

Window convention (flash-attn's): window_left / window_right of -1 mean unbounded; causal is the window
(left, 0). Both are aligned bottom-right: query i sees key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right.

Checks of shapes, dtypes and devices always run and cost no synchronisation. Checks of the *values* of index
tensors (cu_seqlens, seqused, block_table) need a device-to-host copy, which synchronises a GPU and breaks CUDA-graph
capture, so they run only with FLASHTILE_CHECK=1 (env.debug_checks) or when the tensors are on the CPU, where
reading them costs nothing; never while torch.compile traces (their values are unknown then).
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Optional

import torch

from . import env
from .ops.device import graph_capturing

MAX_HEAD_DIM = 512
# flash_attn_with_kvcache's q/k may be wider: DeepSeek's absorbed MLA decode has 576 (512 latent + 64 rope channels)
# over v 512, a view of the same cache.
MAX_DECODE_HEAD_DIM = 576
# CUDA's limit on a grid's y and z dimensions, where the dense kernels put the heads and the batch (a varlen batch's
# grid folds its tile list past it: ops/schedule.tile_grid).
MAX_GRID_YZ = 65535
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class AttnProblem:
    batch: int
    seqlen_q: int  # max over sequences when varlen
    seqlen_k: int
    nheads: int
    nheads_kv: int
    head_dim: int  # q's and k's, as given by the user (before padding to a multiple of 8)
    head_dim_v: int  # v's and the output's; MLA prefill has q/k 192 and v 128
    dtype: torch.dtype
    softmax_scale: float
    window_left: int  # -1: unbounded
    window_right: int  # -1: unbounded; causal sets it to 0
    softcap: float
    alibi: bool
    varlen: bool = False
    paged: bool = False  # varlen only: k/v are paged caches read through a block table
    dropout_p: float = 0.0  # probability of dropping an attention probability (training)
    sink: bool = False  # a learnable sink logit per query head (learnable_sink)
    attention_chunk: int = 0  # chunked attention's chunk, in keys (0: off)

    @property
    def causal(self) -> bool:
        return self.window_left < 0 and self.window_right == 0

    @property
    def head_dim_padded(self) -> int:
        return pad_head_dim(self.head_dim)

    @property
    def head_dim_v_padded(self) -> int:
        return pad_head_dim(self.head_dim_v)


def pad_head_dim(d: int) -> int:
    return (d + 7) // 8 * 8


def kernel_flags(window_left: int, window_right: int, softcap: float, has_alibi: bool,
                 varlen: bool, seqused_q: bool, seqused_k: bool, dtype: torch.dtype, dropout_p: float = 0.0,
                 sink: bool = False, chunk: int = 0) -> dict:
    """The constexpr flags every attention kernel specialises on; the single source of the compile key."""
    return dict(
        IS_VARLEN=varlen, HAS_SEQUSED_Q=seqused_q, HAS_SEQUSED_K=seqused_k,
        MASK_LEFT=window_left >= 0, MASK_RIGHT=window_right >= 0, MASK_CHUNK=chunk > 0,
        HAS_SOFTCAP=softcap > 0.0, HAS_ALIBI=has_alibi, HAS_DROPOUT=dropout_p > 0.0, HAS_SINK=sink,
        UPCAST=env.INTERPRET and dtype == torch.bfloat16,
        # fp32 inputs get true fp32 products, not Triton's default tf32 (fp32 is for accuracy, not speed).
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )


def normalize_window(causal: bool, window_size) -> tuple[int, int]:
    """(left, right) as ints from what flash-attn accepts: None, or any two-element sequence (tuple, list, tensor,
    numpy array) whose items are integers (Python or numpy ints, one-element integer tensors) or None; -1 or None
    means unbounded. causal sets right to 0."""
    if type(window_size) is tuple and len(window_size) == 2 and all(type(w) is int and w >= -1 for w in window_size):
        return window_size[0], 0 if causal else window_size[1]  # the common case: a pair of Python ints
    if window_size is None:
        window_size = (-1, -1)
    if isinstance(window_size, (str, bytes)):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    try:
        items = list(window_size)
    except TypeError:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    if len(items) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    left, right = (_window_entry(w, window_size) for w in items)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1/None for unbounded; got {(left, right)}")
    if causal:
        right = 0
    return left, right


def _window_entry(w, window_size) -> int:
    if w is None:
        return -1
    if isinstance(w, torch.SymInt):  # torch.compile(dynamic=True) traces ints as symbols
        return w
    if isinstance(w, torch.Tensor):
        if w.numel() != 1 or w.dtype.is_floating_point or w.dtype.is_complex or w.dtype == torch.bool:
            raise TypeError(f"window_size entries must be integers, got a tensor of dtype {w.dtype} and shape "
                            f"{tuple(w.shape)} in {window_size!r}")
        return int(w.item())
    if isinstance(w, bool):
        raise TypeError(f"window_size entries must be integers, got {w!r} in {window_size!r}")
    try:
        return operator.index(w)  # ints and numpy integers; floats and strings raise
    except TypeError:
        raise TypeError(f"window_size entries must be integers or None, got {type(w).__name__} {w!r}") from None


def check_dropout(dropout_p) -> float:
    """flash-attn's rule: a probability in [0, 1) (1 would drop every entry and divide by 0)."""
    if type(dropout_p) is float and 0.0 <= dropout_p < 1.0:  # the common case, without the ABC checks below
        return dropout_p
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (numbers.Real, torch.SymFloat)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:  # NaN fails too
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return dropout_p if isinstance(dropout_p, torch.SymFloat) else float(dropout_p)


def check_scalar_args(dropout_p: float, softmax_scale, softcap: float, head_dim: int) -> float:
    check_dropout(dropout_p)
    # Comparisons rather than math.isfinite (NaN fails them too): under torch.compile(dynamic=True) these floats
    # can be symbolic, and math.isfinite would break the graph.
    if softcap is None or not 0.0 <= softcap < math.inf:
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap}")
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    softmax_scale = float(softmax_scale)
    if not 0.0 < softmax_scale < math.inf:
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale}")
    return softmax_scale


def check_tensor(name: str, t, ndim: int, device=None, dtype=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; flashtile supports float16, bfloat16 and float32")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but q has {dtype}: q, k and v must share one dtype")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}: all inputs must be on one device")
    if t.stride(-1) != 1 and t.numel() > 0:
        raise ValueError(f"{name} must have unit stride in its last (head_dim) dimension, got strides {t.stride()}")


def check_grid_limits(batch: int, nheads: int) -> None:
    """Dense kernels launch one grid row per sequence and per head (MAX_GRID_YZ)."""
    if batch > MAX_GRID_YZ:
        raise ValueError(f"batch_size = {batch} is more than the {MAX_GRID_YZ} sequences one dense launch holds: "
                         f"split the batch, or pass it to flash_attn_varlen_func, whose grid has no such limit")
    if nheads > MAX_GRID_YZ:
        raise ValueError(f"nheads = {nheads} is more than the {MAX_GRID_YZ} heads one launch holds")


def check_alibi(alibi_slopes, batch: int, nheads: int, device) -> None:
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a tensor, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), "
                         f"got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")


def check_chunk(attention_chunk) -> int:
    """attention_chunk (FlashAttention-3's name, Llama 4's chunked attention): an int >= 0, 0 for none."""
    if type(attention_chunk) is int and attention_chunk >= 0:  # the common case, without the ABC checks below
        return attention_chunk
    if isinstance(attention_chunk, bool) or not isinstance(attention_chunk, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"attention_chunk must be an int, got {type(attention_chunk).__name__}")
    if attention_chunk < 0:
        raise ValueError(f"attention_chunk must be >= 0 (0 = no chunking), got {attention_chunk}")
    return attention_chunk if isinstance(attention_chunk, torch.SymInt) else int(attention_chunk)


def check_sink(learnable_sink, nheads: int, device) -> bool:
    """learnable_sink (FlashAttention-4's name): one logit per query head, (nheads,), float32, bfloat16 or float16
    (the kernels read it as float32; its gradient comes back in its own dtype). Whether there is one."""
    if learnable_sink is None:
        return False
    if not isinstance(learnable_sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a tensor, got {type(learnable_sink).__name__}")
    if learnable_sink.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"learnable_sink must be float32, bfloat16 or float16, got {learnable_sink.dtype}")
    if tuple(learnable_sink.shape) != (nheads,):
        raise ValueError(f"learnable_sink must have shape (nheads,) = ({nheads},), got {tuple(learnable_sink.shape)}")
    if learnable_sink.device != device:
        raise ValueError(f"learnable_sink is on {learnable_sink.device} but q is on {device}")
    return True


def check_index(name: str, t, ndim: int, batch: int, device) -> None:
    """An optional int32 index tensor whose first dimension is the batch (seqused, block_table, cache_seqlens)."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != ndim or t.shape[0] != batch:
        shape = "(batch_size,)" if ndim == 1 else "(batch_size, max_num_blocks_per_seq)"
        raise ValueError(f"{name} must have shape {shape} with batch_size = {batch}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    if t.stride(-1) != 1 and t.numel() > 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides {t.stride()}")


def value_checks(*tensors) -> bool:
    """Whether to check the values of these index tensors: see the module note."""
    if torch.compiler.is_compiling():
        return False
    return env.debug_checks() or all(t.device.type == "cpu" for t in tensors if t is not None)


def dense_problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                  learnable_sink=None, attention_chunk=0) -> AttnProblem:
    """Validate flash_attn_func arguments (q (B, Sq, H, D), k/v (B, Sk, Hk, D)) and describe the problem."""
    check_tensor("q", q, 4)
    check_tensor("k", k, 4, q.device, q.dtype)
    check_tensor("v", v, 4, q.device, q.dtype)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch sizes differ: q {batch}, k {k.shape[0]}, v {v.shape[0]}")
    check_kv_shapes(k, v)
    return _common(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, k.shape[-1], v.shape[-1], q, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, dropout_p, varlen=False, learnable_sink=learnable_sink,
                   attention_chunk=attention_chunk)


def check_kv_shapes(k, v, names=("k", "v")) -> None:
    """k and v agree in every dimension but the last: v's head dim may differ (head_dim_v, MLA)."""
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise ValueError(f"{names[0]} and {names[1]} must have the same shape but for the last (head_dim) dimension, "
                         f"got {names[0]} {tuple(k.shape)} and {names[1]} {tuple(v.shape)}")


def check_head_dims(head_dim: int, head_dim_k: int, head_dim_v: int, names=("q", "k", "v"),
                    max_head_dim: int = MAX_HEAD_DIM) -> None:
    """q and k share a head dim, at most max_head_dim; v's may differ (head_dim_v, as FlashAttention-3 allows),
    at most MAX_HEAD_DIM."""
    if head_dim_k != head_dim:
        raise ValueError(f"{names[0]} and {names[1]} must have the same head_dim, got {head_dim} and {head_dim_k}")
    if not 1 <= head_dim <= max_head_dim:
        raise ValueError(f"head_dim must be in [1, {max_head_dim}], got {head_dim}")
    if not 1 <= head_dim_v <= MAX_HEAD_DIM:
        raise ValueError(f"{names[2]}'s head dim (head_dim_v) must be in [1, {MAX_HEAD_DIM}], got {head_dim_v}")


def _common(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, head_dim_k, head_dim_v, q, softmax_scale,
            causal, window_size, softcap, alibi_slopes, dropout_p, varlen, paged=False, learnable_sink=None,
            attention_chunk=0) -> AttnProblem:
    check_head_dims(head_dim, head_dim_k, head_dim_v)
    if nheads_kv < 1 or nheads % nheads_kv != 0:
        raise ValueError(f"number of query heads ({nheads}) must be a multiple of the number of key/value heads "
                         f"({nheads_kv})")
    if not varlen and (seqlen_q < 1 or seqlen_k < 1):
        raise ValueError(f"seqlen_q and seqlen_k must be >= 1, got {seqlen_q} and {seqlen_k}")
    if not varlen:
        check_grid_limits(batch, nheads)
    dropout_p = check_dropout(dropout_p)
    softmax_scale = check_scalar_args(dropout_p, softmax_scale, softcap, head_dim)
    check_alibi(alibi_slopes, batch, nheads, q.device)
    left, right = normalize_window(causal, window_size)
    return AttnProblem(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, head_dim_v, q.dtype, softmax_scale,
                       left, right, float(softcap), alibi_slopes is not None, varlen, paged, dropout_p,
                       check_sink(learnable_sink, nheads, q.device), check_chunk(attention_chunk))


def varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, dropout_p, seqused_q=None, seqused_k=None,
                   block_table=None, learnable_sink=None, attention_chunk=0) -> AttnProblem:
    """Validate flash_attn_varlen_func arguments and describe the problem.

    q (total_q, H, D); k/v (total_k, Hk, D), or paged caches (num_blocks, page_size, Hk, D) with block_table
    (B, max_num_blocks_per_seq); cu_seqlens_q/k (B + 1,) int32. Value checks (see the module note): cu_seqlens start
    at 0, never decrease and end at the packed total; seqused lies in [0, length]; a paged sequence fits its
    block-table row, whose pages it owns are pages of the cache; max_seqlen is at least every sequence's length
    (flashtile's kernels do not use it, flash-attn's do: the check keeps code portable).
    """
    paged = block_table is not None
    check_tensor("q", q, 3)
    check_tensor("k", k, 4 if paged else 3, q.device, q.dtype)
    check_tensor("v", v, 4 if paged else 3, q.device, q.dtype)
    check_kv_shapes(k, v)
    total_q, nheads, head_dim = q.shape
    nheads_kv = k.shape[-2]
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have batch_size + 1 entries, got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    batch = cu_seqlens_q.shape[0] - 1
    max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    check_index("seqused_q", seqused_q, 1, batch, q.device)
    check_index("seqused_k", seqused_k, 1, batch, q.device)
    check_index("block_table", block_table, 2, batch, q.device)
    if paged and (k.shape[1] < 1 or block_table.shape[1] < 1):
        raise ValueError(f"a paged cache needs page_block_size >= 1 and a block_table with >= 1 column, got "
                         f"k {tuple(k.shape)} and block_table {tuple(block_table.shape)}")
    if value_checks(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table):
        lengths_q = _check_cu_values("cu_seqlens_q", cu_seqlens_q, total_q)
        lengths_k = _check_cu_values("cu_seqlens_k", cu_seqlens_k, None if paged else k.shape[0])
        lengths_q = _check_seqused("seqused_q", seqused_q, lengths_q, max_seqlen_q, "max_seqlen_q")
        lengths_k = _check_seqused("seqused_k", seqused_k, lengths_k, max_seqlen_k, "max_seqlen_k")
        if paged:
            _check_block_table(block_table, lengths_k, k.shape[0], k.shape[1])
    return _common(batch, max_seqlen_q, max_seqlen_k, nheads, nheads_kv, head_dim, k.shape[-1], v.shape[-1], q,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, varlen=True, paged=paged,
                   learnable_sink=learnable_sink, attention_chunk=attention_chunk)


def _check_cu_seqlens(name: str, t, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] < 1:
        raise ValueError(f"{name} must be 1-d with batch_size + 1 entries, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    if t.stride(0) != 1 and t.shape[0] > 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")


def _check_max_seqlen(name: str, value) -> int:
    # A tensor would need a device-to-host copy to be read; flash-attn's API takes a Python int.
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value if isinstance(value, torch.SymInt) else int(value)


def _check_cu_values(name: str, cu: torch.Tensor, total) -> torch.Tensor:
    """Value checks of one cu_seqlens (total None: a paged cache, which has no packed total); returns the
    sequence lengths, on the host."""
    cu = cu.cpu().long()
    lengths = cu[1:] - cu[:-1]
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {int(cu[0])}")
    if bool((lengths < 0).any()):
        b = int((lengths < 0).nonzero()[0])
        raise ValueError(f"{name} must be non-decreasing, got {name}[{b}] = {int(cu[b])} > "
                         f"{name}[{b + 1}] = {int(cu[b + 1])}")
    if total is not None and cu[-1] != total:
        raise ValueError(f"{name}[-1] = {int(cu[-1])} must equal the packed total, the first dimension of the "
                         f"tensor it describes ({total})")
    return lengths


def _check_seqused(name: str, seqused, lengths: torch.Tensor, max_seqlen: int, max_name: str) -> torch.Tensor:
    """Value checks of an optional seqused against the sequence lengths, and of max_seqlen against the lengths
    the kernels use (seqused where given, as in FlashAttention-3); returns those lengths, on the host."""
    if seqused is not None:
        used = seqused.cpu().long()
        bad = (used < 0) | (used > lengths)
        if bool(bad.any()):
            b = int(bad.nonzero()[0])
            raise ValueError(f"{name}[{b}] = {int(used[b])} must lie in [0, {int(lengths[b])}], the length of "
                             f"sequence {b}")
        lengths = used
    longest = int(lengths.max()) if lengths.numel() else 0
    if longest > max_seqlen:
        raise ValueError(f"{max_name} = {max_seqlen} is smaller than the longest sequence ({longest} tokens)")
    return lengths


def _check_block_table(block_table: torch.Tensor, lengths_k: torch.Tensor, num_blocks: int, page_size: int):
    """Every key of a paged sequence has a block-table entry, and the entries it owns are pages of the cache (the
    rest of the row is never read and may hold anything, e.g. -1)."""
    table = block_table.cpu().long()
    capacity = table.shape[1] * page_size
    if bool((lengths_k > capacity).any()):
        b = int((lengths_k > capacity).nonzero()[0])
        raise ValueError(f"sequence {b} has {int(lengths_k[b])} keys but its block_table row holds only "
                         f"{table.shape[1]} pages of {page_size} ({capacity} keys)")
    owned = torch.arange(table.shape[1])[None, :] * page_size < lengths_k[:, None]
    bad = owned & ((table < 0) | (table >= num_blocks))
    if bool(bad.any()):
        b, n = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_table[{b}, {n}] = {int(table[b, n])} is not a page of the cache (must lie in "
                         f"[0, {num_blocks}), k.shape[0])")


@dataclass(frozen=True)
class KVCacheProblem:
    """flash_attn_with_kvcache's call, validated and normalised, as kvcache.py passes it to the decode ops."""
    batch: int
    seqlen_q: int
    nheads: int
    nheads_kv: int
    head_dim: int
    head_dim_v: int  # v_cache's; an absorbed MLA cache's v_cache is a view of k_cache's first channels
    capacity: int  # rows one sequence's cache holds
    seqlen_new: int  # tokens appended (k.shape[1]; 0 without k and v)
    softmax_scale: float
    window_left: int  # -1: unbounded; past the capacity, unbounded too
    window_right: int
    softcap: float
    block_table: Optional[torch.Tensor]  # block_table or page_table, whichever was given
    cache_seqlens: torch.Tensor  # (batch,) int32; an int or None made a tensor
    attention_chunk: int = 0


def capacity(k_cache: torch.Tensor, block_table: Optional[torch.Tensor]) -> int:
    """Rows one sequence's cache can hold."""
    return block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]


def kvcache_problem(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                    cache_leftpad, block_table, page_table, softmax_scale, causal, window_size, softcap,
                    alibi_slopes, num_splits, learnable_sink=None, attention_chunk=0) -> KVCacheProblem:
    """Validate flash_attn_with_kvcache's arguments (kvcache.py documents them) and describe the call. The values
    of the index tensors are checked as Note [cache index checks] says."""
    if page_table is not None:
        if block_table is not None:
            raise ValueError("pass the page table as block_table or as page_table, not both")
        block_table = page_table
    check_tensor("q", q, 4)
    check_tensor("k_cache", k_cache, 4, q.device, q.dtype)
    check_tensor("v_cache", v_cache, 4, q.device, q.dtype)
    check_kv_shapes(k_cache, v_cache, ("k_cache", "v_cache"))
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_kv, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    check_head_dims(head_dim, k_cache.shape[3], head_dim_v, ("q", "k_cache", "v_cache"), MAX_DECODE_HEAD_DIM)
    if seqlen_q < 1:
        raise ValueError(f"q must have at least one token (seqlen_q >= 1), got shape {tuple(q.shape)}")
    check_grid_limits(batch, nheads)
    if nheads_kv < 1 or nheads % nheads_kv != 0:
        raise ValueError(f"number of query heads ({nheads}) must be a multiple of the number of key/value heads "
                         f"in k_cache ({nheads_kv})")
    check_index("block_table", block_table, 2, batch, q.device)
    check_index("cache_batch_idx", cache_batch_idx, 1, batch, q.device)
    check_index("cache_leftpad", cache_leftpad, 1, batch, q.device)
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be used with a paged cache (block_table): the block table "
                             "already maps each sequence to its pages")
        if k_cache.shape[1] < 1 or block_table.shape[1] < 1:
            raise ValueError(f"a paged cache needs page_block_size >= 1 and block_table with >= 1 column, got "
                             f"k_cache {tuple(k_cache.shape)} and block_table {tuple(block_table.shape)}")
    elif cache_batch_idx is None and k_cache.shape[0] < batch:
        raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences but q has batch_size {batch}; pass "
                         "cache_batch_idx to pick cache rows")
    cap = capacity(k_cache, block_table)

    seqlen_new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append), or both be None")
    if k is not None:
        check_tensor("k", k, 4, q.device, q.dtype)
        check_tensor("v", v, 4, q.device, q.dtype)
        for name, t, d in (("k", k, head_dim), ("v", v, head_dim_v)):
            expected = (batch, k.shape[1], nheads_kv, d)
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} must have shape (batch_size, seqlen_new, nheads_k, {name}_cache's "
                                 f"headdim) = {expected}, got {tuple(t.shape)}")
        seqlen_new = k.shape[1]
        if seqlen_new > cap:
            raise ValueError(f"cannot append {seqlen_new} tokens (k.shape[1]) to a cache of capacity {cap}")
        if cache_seqlens is None:
            raise ValueError("appending k/v needs cache_seqlens: the new tokens are written at rows "
                             "[cache_seqlens[b], cache_seqlens[b] + seqlen_new)")

    softmax_scale = check_scalar_args(0.0, softmax_scale, softcap, head_dim)
    check_alibi(alibi_slopes, batch, nheads, q.device)
    check_sink(learnable_sink, nheads, q.device)
    attention_chunk = check_chunk(attention_chunk)
    window_left, window_right = normalize_window(causal, window_size)
    # flash-attn's rule: a window reaching past the capacity restricts nothing, so it is not local (this also
    # decides at which positions q is rotated).
    window_left = -1 if window_left >= cap else window_left
    window_right = -1 if window_right >= cap else window_right
    if seqlen_q == 1:
        # A single query row sits on the last key, so a right bound (causal included) hides nothing: dropping it
        # keeps the common decode step on the kernel variant without masks. Rotary positions are unaffected.
        window_right = -1
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = choose automatically), got {num_splits!r}")
    _check_rotary(rotary_cos, rotary_sin, k, q, head_dim, cap)

    if cache_seqlens is None:
        cache_seqlens = torch.full((batch,), cap, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= cap - seqlen_new:
            raise ValueError(f"cache_seqlens = {cache_seqlens} must be in [0, capacity - seqlen_new] = "
                             f"[0, {cap - seqlen_new}]")
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    else:
        check_index("cache_seqlens", cache_seqlens, 1, batch, q.device)
    if _cache_value_checks(q.device, block_table is not None, cache_seqlens, cache_batch_idx, cache_leftpad,
                     block_table):
        _check_values(k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, cap, seqlen_new)

    return KVCacheProblem(batch, seqlen_q, nheads, nheads_kv, head_dim, head_dim_v, cap, seqlen_new, softmax_scale,
                          window_left, window_right, float(softcap), block_table, cache_seqlens, attention_chunk)


def _cache_value_checks(device, paged: bool, *tensors) -> bool:
    """Note [cache index checks]: whether this call checks the values of its index tensors (cache_seqlens,
    cache_leftpad, cache_batch_idx, block_table), which on a GPU costs a device-to-host copy that waits for the
    queued work. flash-attn pays it for paged caches only and raises there; so does flashtile, and on CPU tensors
    (free) and with FLASHTILE_CHECK=1 for every cache. Never while torch.compile traces (the values are unknown)
    or a CUDA graph is captured (a copy would break the capture). Unchecked values are clamped by the kernels:
    cache_seqlens into [0, capacity - seqlen_new], cache_leftpad into [0, cache_seqlens + seqlen_new], pages and
    cache rows into the cache, and appended rows past a sequence's capacity are dropped; a bad value can give a
    wrong answer for its own sequence but never reads or writes memory outside the caches."""
    if torch.compiler.is_compiling() or graph_capturing(device):
        return False
    return paged or value_checks(*tensors)


def _check_rotary(cos, sin, k, q, head_dim: int, cap: int) -> None:
    if cos is None and sin is None:
        return
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if k is None:
        raise ValueError("rotary_cos/rotary_sin need new keys k and v: rotary embedding is applied to q and to the "
                         "appended k (the cache holds already-rotated keys)")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        check_tensor(name, t, 2, q.device)
    if tuple(sin.shape) != tuple(cos.shape):
        raise ValueError(f"rotary_cos and rotary_sin must have the same shape, got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if sin.stride() != cos.stride():
        raise ValueError(f"rotary_cos and rotary_sin must have the same strides, got {cos.stride()} and "
                         f"{sin.stride()}")
    rotary_dim = 2 * cos.shape[1]
    if not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_cos must be (seqlen_ro, rotary_dim / 2) with 0 < rotary_dim <= headdim = "
                         f"{head_dim}; got shape {tuple(cos.shape)} (rotary_dim = {rotary_dim})")
    # flash-attn's rule: the tables cover the cache. A query of a causal or local step can sit past the cache's
    # last row (more queries than appended keys); such a position is not rotated and reads no table row
    # (kernels/kvcache.rotary_load).
    if cos.shape[0] < cap:
        raise ValueError(f"rotary_cos/rotary_sin have {cos.shape[0]} positions (seqlen_ro) but the cache holds {cap} "
                         f"rows (its capacity): seqlen_ro must be >= the capacity")


def _check_values(k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, cap: int,
                  seqlen_new: int) -> None:
    """Checks on the values of the index tensors (Note [cache index checks]): the extremes that decide them, a few
    reductions read back in one device-to-host copy (each op of an eager call costs host time: a paged decode step
    pays this on every call), and only when one fails a second pass that names the first bad entry."""
    if cache_seqlens.numel() == 0:
        return
    # (least, greatest, the greatest allowed) of each check's values; the least must be >= 0.
    bounds = [(*torch.aminmax(cache_seqlens), cap - seqlen_new)]
    if cache_leftpad is not None:
        bounds.append((cache_leftpad.min(), (cache_leftpad - cache_seqlens).max(), 0))
    if cache_batch_idx is not None:
        bounds.append((*torch.aminmax(cache_batch_idx), k_cache.shape[0] - 1))
    if block_table is not None:
        # Only the pages a sequence owns (those holding rows < cache_seqlens + seqlen_new) must be pages of the
        # cache; the rest of its row may hold anything (e.g. -1 padding), since it is never read.
        page_size = k_cache.shape[1]
        first_rows = torch.arange(0, block_table.shape[1] * page_size, page_size, device=block_table.device)
        owned = first_rows[None, :] < (cache_seqlens.clamp(0, cap) + seqlen_new)[:, None]
        bounds.append((*torch.aminmax(torch.where(owned, block_table, 0)), k_cache.shape[0] - 1))
    values = torch.stack([t for least, greatest, _ in bounds for t in (least, greatest)]).tolist()
    if all(values[2 * i] >= 0 and values[2 * i + 1] <= allowed for i, (_, _, allowed) in enumerate(bounds)):
        return
    _name_first_bad(k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, cap, seqlen_new)


def _name_first_bad(k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, cap: int,
                    seqlen_new: int) -> None:
    """Raise the ValueError that names the first bad entry of the index tensors (_check_values found one)."""
    seqlens = cache_seqlens.long()
    conditions = [("cache_seqlens", (seqlens < 0) | (seqlens + seqlen_new > cap))]
    if cache_leftpad is not None:
        conditions.append(("cache_leftpad", (cache_leftpad < 0) | (cache_leftpad.long() > seqlens)))
    if cache_batch_idx is not None:
        conditions.append(("cache_batch_idx", (cache_batch_idx < 0) | (cache_batch_idx >= k_cache.shape[0])))
    if block_table is not None:
        page_size = k_cache.shape[1]
        owned = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * page_size < (
            seqlens.clamp(0, cap) + seqlen_new)[:, None]
        conditions.append(("block_table", owned & ((block_table < 0) | (block_table >= k_cache.shape[0]))))
    name, bad = next(((name, bad) for name, bad in conditions if bad.any()), (None, None))
    if name is None:  # a table of pages whose rows hold no key: nothing owned, nothing to name
        return
    index = tuple(int(i) for i in bad.nonzero()[0])
    if name == "cache_seqlens":
        b = index[0]
        raise ValueError(f"cache_seqlens[{b}] = {int(seqlens[b])}: cache_seqlens + seqlen_new ({seqlen_new}) must "
                         f"lie in [0, {cap}], the rows a sequence's cache holds (block_table.shape[1] x "
                         f"page_block_size for a paged cache, k_cache.shape[1] otherwise)")
    if name == "cache_leftpad":
        b = index[0]
        raise ValueError(f"cache_leftpad[{b}] = {int(cache_leftpad[b])} must lie in [0, cache_seqlens[{b}] = "
                         f"{int(seqlens[b])}]")
    if name == "cache_batch_idx":
        b = index[0]
        raise ValueError(f"cache_batch_idx[{b}] = {int(cache_batch_idx[b])} must lie in [0, {k_cache.shape[0]}) "
                         f"(k_cache.shape[0])")
    b, n = index
    raise ValueError(f"block_table[{b}, {n}] = {int(block_table[b, n])} is not a page of the cache: the pages a "
                     f"sequence's rows live in must lie in [0, {k_cache.shape[0]}) (k_cache.shape[0])")
