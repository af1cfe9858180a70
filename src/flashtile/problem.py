"""The attention problem: what to compute, built and validated once at the public API.

`AttnProblem` is a frozen description of one call: shapes, dtype, mask, score modifiers and the ragged/varlen
layout. The interface builds it from user arguments (`dense_problem`, `varlen_problem`), which is where every
argument is checked and every error names the argument. Below the API, code trusts it: the custom ops receive
only tensors and scalars, and `kernel_flags` derives the kernels' constexpr flags from those scalars in one
place, so the compile-cache key is what the kernels actually specialise on and is never maintained by hand.

Window convention (flash-attn's): window_left / window_right of -1 mean unbounded; causal is the window
(left, 0). Both are aligned bottom-right: query i sees key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import env

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class AttnProblem:
    batch: int
    seqlen_q: int  # max over sequences when varlen
    seqlen_k: int
    nheads: int
    nheads_kv: int
    head_dim: int  # as given by the user (before padding to a multiple of 8)
    dtype: torch.dtype
    softmax_scale: float
    window_left: int  # -1: unbounded
    window_right: int  # -1: unbounded; causal sets it to 0
    softcap: float
    alibi: bool
    varlen: bool = False

    @property
    def causal(self) -> bool:
        return self.window_left < 0 and self.window_right == 0

    @property
    def head_dim_padded(self) -> int:
        return pad_head_dim(self.head_dim)


def pad_head_dim(d: int) -> int:
    return (d + 7) // 8 * 8


def kernel_flags(window_left: int, window_right: int, softcap: float, has_alibi: bool,
                 varlen: bool, seqused_q: bool, seqused_k: bool, dtype: torch.dtype) -> dict:
    """The constexpr flags every attention kernel specialises on; the single source of the compile key."""
    return dict(
        IS_VARLEN=varlen, HAS_SEQUSED_Q=seqused_q, HAS_SEQUSED_K=seqused_k,
        MASK_LEFT=window_left >= 0, MASK_RIGHT=window_right >= 0,
        HAS_SOFTCAP=softcap > 0.0, HAS_ALIBI=has_alibi,
        UPCAST=env.INTERPRET and dtype == torch.bfloat16,
        # fp32 inputs get true fp32 products, not Triton's default tf32 (fp32 is for accuracy, not speed).
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )


def normalize_window(causal: bool, window_size) -> tuple[int, int]:
    if window_size is None:
        window_size = (-1, -1)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    left, right = (-1 if w is None else int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1/None for unbounded; got {tuple(window_size)}")
    if causal:
        right = 0
    return left, right


def check_scalar_args(dropout_p: float, softmax_scale, softcap: float, head_dim: int) -> float:
    if dropout_p != 0.0:
        if not 0.0 < dropout_p < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
        raise NotImplementedError(
            "dropout_p > 0 is not supported by flashtile yet; pass dropout_p=0.0 (attention dropout has its own "
            "issue). It is never silently ignored.")
    if softcap is None or softcap < 0.0 or not math.isfinite(softcap):
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap}")
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    softmax_scale = float(softmax_scale)
    if not (math.isfinite(softmax_scale) and softmax_scale > 0.0):
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


def dense_problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p) -> AttnProblem:
    """Validate flash_attn_func arguments (q (B, Sq, H, D), k/v (B, Sk, Hk, D)) and describe the problem."""
    check_tensor("q", q, 4)
    check_tensor("k", k, 4, q.device, q.dtype)
    check_tensor("v", v, 4, q.device, q.dtype)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch sizes differ: q {batch}, k {k.shape[0]}, v {v.shape[0]}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    return _common(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, k.shape[-1], q, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, dropout_p, varlen=False)


def _common(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, head_dim_k, q, softmax_scale, causal,
            window_size, softcap, alibi_slopes, dropout_p, varlen) -> AttnProblem:
    if head_dim_k != head_dim:
        raise ValueError(f"q and k must have the same head_dim, got {head_dim} and {head_dim_k}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if nheads_kv < 1 or nheads % nheads_kv != 0:
        raise ValueError(f"number of query heads ({nheads}) must be a multiple of the number of key/value heads "
                         f"({nheads_kv})")
    if not varlen and (seqlen_q < 1 or seqlen_k < 1):
        raise ValueError(f"seqlen_q and seqlen_k must be >= 1, got {seqlen_q} and {seqlen_k}")
    softmax_scale = check_scalar_args(dropout_p, softmax_scale, softcap, head_dim)
    check_alibi(alibi_slopes, batch, nheads, q.device)
    left, right = normalize_window(causal, window_size)
    return AttnProblem(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, q.dtype, softmax_scale,
                       left, right, float(softcap), alibi_slopes is not None, varlen)
