"""The Hopper fast path: which calls run the Gluon kernels, and their launchers.

Note [hopper path]: on sm_90 (H100/H200) the forward and the backward's passes run warp-specialised Gluon kernels
(kernels/hopper_fwd.py, hopper_dq.py, hopper_bwd.py), which Triton's own sm_90 code cannot express (a TMA producer
warp, two consumer warpgroups, wgmma kept in flight under the softmax). They cover fp16/bf16 at head dim 128 and MLA
prefill's q/k 192 with v 128 (config.HOPPER, gluon_head_dims: Q and K read as 128 + 64 columns, Note [head dim
parts] in kernels/hopper_common.py), and the forward at head dim 512 (q, k and v; its consumers split the head dim,
Note [split columns] in kernels/hopper_fwd_wide.py; its backward runs the Triton kernels), dense and varlen batches,
MHA/GQA/MQA, any lengths, causal and sliding windows, chunked attention, learnable sinks, and dropout in the dQ
kernel and in a forward without a causal or right-window mask (at 512 with any mask). Everything else (softcap,
ALiBi, the rest of dropout, seqused_q/k, paged K/V, other head dims or dtypes, other GPUs, the interpreter) runs the
Triton kernels. `hopper_unsupported` is the one decision: the ops ask it on every call, for each kernel (`kernel`:
fwd, bwd_dq, bwd_dkdv), and `flashtile.kernel_paths` asks it for a user, with the reason when the answer is no;
`last_kernel_paths` says which kernels the last forward and backward ran. FLASHTILE_HOPPER=0 switches the path off.

Note [dropout on the Gluon path]: the forward and the dQ kernel draw the mask where P and dP sit, in the wgmma
accumulator (Note [dropout entries] in kernels/dropout.py), one Philox call per sixteen entries as every Triton
kernel does, and test its bytes four at a time (Note [packed keep bits]). The measurements below predate that
packed test (the forward's key loop then issued 1094 sm_90 instructions a warp a block, now 925; 652 at p = 0). The
Gluon dK/dV kernel holds its tile transposed (keys x queries: kernels/hopper_bwd.py), where a
thread's entries are two keys of many queries: the mask's calls, sixteen keys of one query each, would serve two to
four of its entries, four to eight times the Philox work of the other kernels. So a call with dropout runs the
Triton dK/dV kernel (whose tile turns to queries x keys with dropout, kernels/bwd.py) after the Gluon dQ kernel,
which hands it delta through the stream's order instead of the Triton dQ's counters (ops/bwd.py); all regenerate
one mask. The Gluon forward takes dropout only without a causal or right-window mask (`right_mask`): against the
Triton forward with dropout on the H200 (bf16, d128, B·S = 16k, p = 0.1, tools/ab_trees.py --dropout 0.1) the
Gluon one was 1.12-1.14x faster without a mask at S = 1k-16k and on the varlen mix, but causal 0.755x at 1k, 1.04x
at 4k, 1.08x at 16k and 0.92x on the mix: the short causal items, whose first and diagonal blocks run their
softmax and mask with no P V beneath, lost. The d512 forward (kernels/hopper_fwd_wide.py) takes dropout under
any mask: the Triton one it replaces computes all of Q Kᵀ, and draws the whole mask, in each of two programs.

The Gluon kernels are persistent, one program per SM taking (sequence, head, tile) items from a work counter (Notes
[persistent forward], [persistent dQ] and [persistent dK/dV]): a dense batch's items numbered in order
(hopper_common.dense_work_item, on a counter each launch leaves at 0 for the next: schedule.dense_counter), a varlen
batch's from a list written once per call (schedule.varlen_plan, in the order of Note [longest sequences first],
with the counters). They take host TMA descriptors: over the (B, S, H, D) tensors of a dense batch with a (1, rows,
1, D) box, so loads past a sequence's end read zeros and stores past it are dropped, per sequence, whatever the
strides (tma_ready has made them TMA-legal); over the packed (total, H, D) tensors of a varlen batch with a (rows,
1, D) box, where the kernels keep each sequence's rows to itself (Note [varlen descriptors] in
kernels/hopper_fwd.py). The varlen kernels also take the output tensors themselves, for the partial last tile of a
sequence, which they store by pointer under a row mask (hopper_common.store_rows).
"""

from __future__ import annotations

import functools
import logging
import operator
from typing import Optional

import torch

from .. import env
from ..config import HOPPER, HopperConfig, head_dim_parts
from ..problem import kernel_flags
from .descriptors import kernel_strides_of
from .device import capability, on_gpu, sm_count
from .schedule import Plan, dense_counter
from .launch import MAX_CACHED, StaticByName, launch_named
from .triton_internals import descriptor

try:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..kernels.hopper_bwd import _hopper_dkdv_kernel
    from ..kernels.hopper_dq import _hopper_dq_kernel
    from ..kernels.hopper_fwd import _hopper_fwd_kernel
    from ..kernels.hopper_fwd_wide import _hopper_fwd_wide_kernel
    _GLUON_ERROR = None
except ImportError as e:  # a Triton without Gluon's Hopper API: every call runs the Triton kernels
    _GLUON_ERROR = f"this Triton has no Gluon Hopper API ({e})"

TRITON, HOPPER_PATH = "triton", "gluon-sm90"
# What the last forward and backward ran (kernel name -> path); `last_kernel_paths` returns a copy.
_LAST: dict[str, str] = {}


def hopper_unsupported(device: torch.device, dtype: torch.dtype, head_dim: int, *, head_dim_v: Optional[int] = None,
                       paged: bool = False, seqused: bool = False, softcap: float = 0.0, alibi: bool = False,
                       dropout: bool = False, kernel: str = "fwd", right_mask: bool = False) -> Optional[str]:
    """None when a call with these properties runs the Gluon Hopper kernel `kernel` (fwd, bwd_dq or bwd_dkdv);
    otherwise why it does not; right_mask: a causal or right-window mask (window_right >= 0). `head_dim` (q's and
    k's) and `head_dim_v` (v's; None: the same) are the padded ones the kernels see."""
    if env.INTERPRET:
        return "the Triton interpreter runs the Triton kernels"
    if not env.hopper():
        return "switched off by FLASHTILE_HOPPER=0"
    if _GLUON_ERROR is not None:
        return _GLUON_ERROR
    if not on_gpu(device):
        return f"tensors on {device.type}, not a CUDA device"
    cap = capability(device)
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]}: the Gluon kernels use sm_90's wgmma"
    return feature_unsupported(dtype, head_dim, head_dim_v=head_dim_v, paged=paged, seqused=seqused, softcap=softcap,
                               alibi=alibi, dropout=dropout, kernel=kernel, right_mask=right_mask)


def feature_unsupported(dtype: torch.dtype, head_dim: int, *, head_dim_v: Optional[int] = None, paged: bool = False,
                        seqused: bool = False, softcap: float = 0.0, alibi: bool = False,
                        dropout: bool = False, kernel: str = "fwd", right_mask: bool = False) -> Optional[str]:
    """The part of hopper_unsupported that depends on the call alone: None when, on an sm_90 GPU with the fast path
    on, a call with these properties runs the Gluon kernels; otherwise why not (`flashtile info` tabulates it)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype}: the Gluon kernels take fp16 and bf16"
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    pairs = gluon_head_dims(kernel)
    if (head_dim, head_dim_v) not in pairs:
        return (f"head dims (q/k {head_dim}, v {head_dim_v}): the Gluon {kernel} kernel takes "
                + ", ".join(f"({d}, {dv})" for d, dv in pairs))
    if not (paged or seqused or softcap > 0.0 or alibi or dropout):  # the common case, without building the list
        return None
    for cond, what in ((paged, "paged K/V"), (seqused, "seqused_q/seqused_k"),
                       (softcap > 0.0, "softcap"), (alibi, "ALiBi")):
        if cond:
            return f"{what}: not in the Gluon kernels"
    if dropout and kernel == "bwd_dkdv":
        return "dropout: not in the Gluon dK/dV kernel (Note [dropout on the Gluon path] in ops/hopper.py)"
    if dropout and right_mask and kernel == "fwd" and not HOPPER["fwd"][head_dim].split_columns:
        return ("dropout with a causal or right-window mask: the Triton forward is the faster one there (Note "
                "[dropout on the Gluon path] in ops/hopper.py)")
    return None


@functools.cache
def gluon_head_dims(kernel: Optional[str] = None) -> tuple[tuple[int, int], ...]:
    """The (q/k, v) head dims the Gluon kernel `kernel` takes (None: all three): config.HOPPER's q/k head dims,
    each with the v head dim of its first part (config.head_dim_parts: 128 at 128, and MLA prefill's 192 read as
    128 + 64, whose v is 128), the width V's, O's and dO's tiles share with the first part of Q's and K's, whose
    buffers stage O, dQ and dK for their stores; or q's own where the consumers split the columns (the forward at
    512: Note [split columns] in kernels/hopper_fwd_wide.py)."""
    kernels = ("fwd", "bwd_dq", "bwd_dkdv") if kernel is None else (kernel,)
    dims = set.intersection(*(set(HOPPER[k]) for k in kernels))
    return tuple((d, d if HOPPER[kernels[0]][d].split_columns else head_dim_parts(d)[0]) for d in sorted(dims))


_log = logging.getLogger("flashtile")
_LOGGED: set[str] = set()


def log_fallback(device: torch.device, dtype: torch.dtype, head_dim: int, **features) -> None:
    """On an sm_90 device, log once per reason (at DEBUG, logger "flashtile") that a call runs the Triton kernels
    instead of the Gluon ones, and why (`features`: hopper_unsupported's keywords). The public API calls it only
    when that logger takes DEBUG records, so an ordinary call pays one isEnabledFor check; the decision itself stays
    with ops/call.py."""
    if not on_gpu(device) or capability(device) != (9, 0):
        return
    reason = hopper_unsupported(device, dtype, head_dim, **features)
    if reason is not None and reason not in _LOGGED:
        _LOGGED.add(reason)
        _log.debug("flashtile: sm_90 call runs the Triton kernels, not the Gluon ones: %s", reason)


def fallback_logging() -> bool:
    """Whether log_fallback would emit anything: the "flashtile" logger takes DEBUG records, and the call is not being
    traced by torch.compile (whose dynamo cannot trace logging calls, and would break the graph)."""
    return not torch.compiler.is_compiling() and _log.isEnabledFor(logging.DEBUG)


def record(kernel: str, path: str) -> None:
    _LAST[kernel] = path


def last_kernel_paths() -> dict[str, str]:
    """Which kernels the last forward and backward ran: {'fwd': ..., 'bwd_dq': ..., 'bwd_dkdv': ...}, each
    'gluon-sm90' (the Hopper fast path) or 'triton'. A kernel not yet run in this process is absent."""
    return dict(_LAST)


_GL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


@functools.cache
def _layout(box: tuple, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(box), getattr(gl, _GL_DTYPES[dtype]))


# Descriptor fields by launch key (_descs).
_DESC_FIELDS: dict[tuple, tuple[dict, ...]] = {}


def _descs(key: Optional[tuple], *boxes: tuple[torch.Tensor, int]) -> tuple:
    """A descriptor over each (tensor, rows) in `boxes`, a (B, S, H, D) or packed (total, H, D) tensor, whose box
    is one head's (rows, D) tile; built without the dataclass's checks where Triton allows, as
    descriptors.host_desc. A launch key (the problem's key with the SM count and the kernel) determines every
    tensor's layout (the problem's tensors by their signatures; outputs and gradients are fresh allocations whose
    layouts those fix), so with one the fields take one lookup per launch rather than one per tensor, several
    microseconds of a short call's host time. FLASHTILE_CHECK=1 checks each hit against the tensors."""
    fields = None if key is None else _DESC_FIELDS.get(key)
    if fields is None or env.debug_checks():
        derived = tuple(_desc_fields(t.shape, t.stride(), t.dtype, rows) for t, rows in boxes)
        if fields is not None and fields != derived:
            raise AssertionError(f"the launch key does not determine the descriptors: cached {fields}, now {derived}")
        fields = derived
        if key is not None:
            if len(_DESC_FIELDS) >= MAX_CACHED:
                del _DESC_FIELDS[next(iter(_DESC_FIELDS))]
            _DESC_FIELDS[key] = fields
    return tuple(descriptor(TensorDescriptor, t, f) for (t, _), f in zip(boxes, fields))


def _part_descs(key: Optional[tuple], first: int, tail: int, boxes: tuple, split: tuple) -> tuple:
    """_descs over `boxes`, each tensor whose index is in `split` (q/k-wide: Q, K, dQ, dK) followed by its tail's
    descriptor (Note [head dim parts] in kernels/hopper_common.py): with a tail, descriptors over the tensor's
    first `first` columns and over the rest (a view HEAD_DIM elements in, on the same storage); without one, the
    tensor's own descriptor twice, the second unused."""
    if tail:
        parts = []
        for i, (t, rows) in enumerate(boxes):
            parts += [(t[..., :first], rows), (t[..., first:], rows)] if i in split else [(t, rows)]
        return _descs(key, *parts)
    return _doubler(split, len(boxes))(_descs(key, *boxes))


@functools.cache
def _doubler(split: tuple, n: int) -> operator.itemgetter:
    """An itemgetter that repeats each of n items whose index is in `split` (on every d128 launch: one C call)."""
    return operator.itemgetter(*(i for i in range(n) for _ in range(2 if i in split else 1)))


@functools.lru_cache(maxsize=1024)
def _desc_fields(shape: torch.Size, stride: tuple, dtype: torch.dtype, rows: int) -> dict:
    """A descriptor's fields but the tensor, per layout (a model has a few; Triton's launcher only reads them)."""
    box = (*(1,) * (len(shape) - 3), rows, 1, shape[-1])
    return dict(shape=list(shape), strides=kernel_strides_of(shape, stride), block_shape=list(box),
                layout=_layout(box, dtype), padding="zero")


def _constexprs(cfg: HopperConfig, q: torch.Tensor, k: torch.Tensor, window_left: int, window_right: int,
                attention_chunk: int, varlen: bool, head_dim: Optional[int] = None) -> dict:
    """The constexprs every Gluon kernel takes: tile, head dim (q's unless given), GQA group, mask flags."""
    return dict(_shared_constexprs(cfg, q.shape[-1] if head_dim is None else head_dim, q.shape[-2] // k.shape[-2],
                                   window_left >= 0, window_right >= 0, attention_chunk > 0, varlen))


@functools.lru_cache(maxsize=256)
def _shared_constexprs(cfg: HopperConfig, head_dim: int, group: int, left: bool, right: bool, chunk: bool,
                       varlen: bool) -> dict:
    """_constexprs of a problem class, built once: the flags from kernel_flags (their one source), whose window
    and chunk arguments matter only as on or off."""
    flags = kernel_flags(0 if left else -1, 0 if right else -1, 0.0, False, False, False, False, torch.float16,
                         chunk=1 if chunk else 0)
    return dict(HEAD_DIM=head_dim, GROUP=group, MASK_LEFT=flags["MASK_LEFT"], MASK_RIGHT=flags["MASK_RIGHT"],
                MASK_CHUNK=flags["MASK_CHUNK"], IS_VARLEN=varlen, **cfg.kwargs())


def _persistent_grid(n_items: int, programs: int) -> tuple[int, int, int]:
    return (min(n_items, programs), 1, 1)


def _items(batch: int, heads: int, length: int, rows: int) -> int:
    """The work items of a dense batch in a persistent Gluon kernel: batch x heads x the tiles of `rows` rows over
    `length` (hopper_common.dense_work_item numbers them); a varlen batch's plan lists them."""
    return batch * heads * -(-length // rows)


def _fwd_static(cfg: HopperConfig, q, k, out, lse, window_left: int, window_right: int, attention_chunk: int,
                plan: Optional[Plan]) -> dict:
    """The static integers of a Gluon forward, n_items among them: a dense batch's (B, S, H, D) lengths and
    items numbered over cfg.item_rows-row tiles, or a varlen batch's packed totals and its plan's listed tiles
    (plan: None for a dense batch)."""
    nheads = q.shape[-2]
    common = dict(wl=window_left, wr=window_right, chunk=attention_chunk, heads=nheads)
    if plan is None:
        batch, seqlen_q = q.shape[:2]
        return dict(common, stride_lb=lse.stride(0), stride_lh=lse.stride(1), seqlen_q=seqlen_q, seqlen_k=k.shape[1],
                    stride_om=0, stride_oh=0, n_items=_items(batch, nheads, seqlen_q, cfg.item_rows))
    return dict(common, stride_lb=0, stride_lh=lse.stride(0), seqlen_q=q.shape[0], seqlen_k=k.shape[0],
                stride_om=out.stride(0), stride_oh=out.stride(1), n_items=plan.last_first.shape[0] * nheads)


def fwd(q, k, v, out, lse, qk_scale: float, window_left: int, window_right: int, cu_seqlens_q=None,
        cu_seqlens_k=None, plan: Optional[Plan] = None, learnable_sink: Optional[torch.Tensor] = None,
        attention_chunk: int = 0, rng: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
        key: Optional[tuple] = None) -> None:
    """out and lse of a problem that hopper_unsupported accepts: dense (B, S, H, D), or varlen (total, H, D) with
    its cu_seqlens and a plan holding the last-first list of 2 x BLOCK_M-row query tiles (ops/fwd.py);
    learnable_sink: fp32 (H,) or None; attention_chunk: 0 for none; rng: the call's seed and stream when
    dropout_p > 0 (ops/dropout.py). key: the problem's launch key
    (ops/call.OpProblem.key), which with the SM count determines the launch (launch.launch_named); None to derive
    one from the arguments."""
    head_dim = q.shape[-1]
    cfg = HOPPER["fwd"][head_dim]
    if cfg.split_columns:
        return _fwd_wide(cfg, q, k, v, out, lse, qk_scale, window_left, window_right, cu_seqlens_q, cu_seqlens_k,
                         plan, learnable_sink, attention_chunk, rng, dropout_p, key)
    first, tail = head_dim_parts(head_dim)
    varlen = cu_seqlens_q is not None
    programs = sm_count(q.device)
    # Persistent (Note [persistent forward] in kernels/hopper_fwd.py): one program per SM over the work items,
    # which a varlen batch's plan lists (its writer zeroed the work counter) and a dense batch's numbers.
    if varlen:
        assert plan.has(cfg.item_rows, 0)

    def statics() -> StaticByName:
        static = _fwd_static(cfg, q, k, out, lse, window_left, window_right, attention_chunk,
                             plan if varlen else None)
        return StaticByName(_persistent_grid(static["n_items"], programs), static,
                            dict(_constexprs(cfg, q, k, window_left, window_right, attention_chunk, varlen, first),
                                 HEAD_DIM_TAIL=tail, HAS_SINK=learnable_sink is not None,
                                 HAS_DROPOUT=dropout_p > 0.0))

    key = None if key is None else (key, programs, 0)
    Q, Q2, K, K2, V, O = _part_descs(key, first, tail, ((q, cfg.block_m), (k, cfg.block_n), (v, cfg.block_n),
                                                        (out, cfg.block_m)), split=(0, 1))
    dynamic = dict(Q=Q, Q2=Q2, K=K, K2=K2, V=V, O=O, O_PTR=out if varlen else None, LSE=lse, SINK=learnable_sink,
                   RNG=rng, TILES=plan.last_first if varlen else None, CU_SEQLENS_Q=cu_seqlens_q,
                   CU_SEQLENS_K=cu_seqlens_k, COUNTER=plan.counters[0] if varlen else dense_counter(q.device, 0),
                   qk_scale=qk_scale, dropout_p=dropout_p)
    launch_named(_hopper_fwd_kernel, dynamic, statics, num_warps=4, key=key)


def _fwd_wide(cfg: HopperConfig, q, k, v, out, lse, qk_scale: float, window_left: int, window_right: int,
              cu_seqlens_q, cu_seqlens_k, plan: Optional[Plan], learnable_sink, attention_chunk: int, rng,
              dropout_p: float, key: Optional[tuple]) -> None:
    """fwd at a head dim whose consumers split its columns (Note [split columns] in kernels/hopper_fwd_wide.py):
    one program per work item (block_m query rows of one sequence and head; a varlen batch's plan lists them), each
    tensor read and written through descriptors over its two column halves."""
    half = q.shape[-1] // 2
    varlen = cu_seqlens_q is not None
    if varlen:
        assert plan.has(cfg.item_rows, 0)

    def statics() -> StaticByName:
        static = _fwd_static(cfg, q, k, out, lse, window_left, window_right, attention_chunk,
                             plan if varlen else None)
        n_items = static.pop("n_items")  # one program per item
        return StaticByName((n_items, 1, 1), static,
                            dict(_constexprs(cfg, q, k, window_left, window_right, attention_chunk, varlen, half),
                                 HAS_SINK=learnable_sink is not None, HAS_DROPOUT=dropout_p > 0.0))

    key = None if key is None else (key, 0, 3)
    Q, Q2, K, K2, V, V2, O, O2 = _part_descs(key, half, half, ((q, cfg.block_m), (k, cfg.block_n),
                                                               (v, cfg.block_n), (out, cfg.block_m)),
                                             split=(0, 1, 2, 3))
    dynamic = dict(Q=Q, Q2=Q2, K=K, K2=K2, V=V, V2=V2, O=O, O2=O2, O_PTR=out if varlen else None, LSE=lse,
                   SINK=learnable_sink, RNG=rng, TILES=plan.last_first if varlen else None,
                   CU_SEQLENS_Q=cu_seqlens_q, CU_SEQLENS_K=cu_seqlens_k, qk_scale=qk_scale, dropout_p=dropout_p)
    launch_named(_hopper_fwd_wide_kernel, dynamic, statics, num_warps=4, key=key)


def bwd_dq(q, k, v, dout, dq, out, lse, delta, qk_scale: float, softmax_scale: float, window_left: int,
           window_right: int, cu_seqlens_q=None, cu_seqlens_k=None, plan: Optional[Plan] = None,
           attention_chunk: int = 0, rng: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
           key: Optional[tuple] = None) -> None:
    """dq and delta = rowsum(dout * out) of a problem that hopper_unsupported accepts: dense (B, S, H, D), or varlen
    (total, H, D) with its cu_seqlens and a plan holding the last-first list of 2 x BLOCK_M-row query tiles; rng:
    the forward's seed and stream when dropout_p > 0. key: as fwd's."""
    nheads, head_dim = q.shape[-2:]
    cfg = HOPPER["bwd_dq"][head_dim]
    first, tail = head_dim_parts(head_dim)
    varlen = cu_seqlens_q is not None
    programs = sm_count(q.device)
    # Persistent (Note [persistent dQ] in kernels/hopper_dq.py), as the forward, a varlen batch on the same list.
    if varlen:
        assert plan.has(2 * cfg.block_m, 0)

    def statics() -> StaticByName:
        if not varlen:
            batch, seqlen_q = q.shape[:2]
            n_items = _items(batch, nheads, seqlen_q, 2 * cfg.block_m)
            static = dict(stride_lb=lse.stride(0), stride_lh=lse.stride(1), stride_ob=out.stride(0),
                          stride_om=out.stride(1), stride_oh=out.stride(2), seqlen_q=seqlen_q, seqlen_k=k.shape[1],
                          wl=window_left, wr=window_right, chunk=attention_chunk, stride_dqm=0, stride_dqh=0,
                          n_items=n_items, heads=nheads)
        else:
            n_items = plan.last_first.shape[0] * nheads
            static = dict(stride_lb=0, stride_lh=lse.stride(0), stride_ob=0, stride_om=out.stride(0),
                          stride_oh=out.stride(1), seqlen_q=q.shape[0], seqlen_k=k.shape[0], wl=window_left,
                          wr=window_right, chunk=attention_chunk, stride_dqm=dq.stride(0), stride_dqh=dq.stride(1),
                          n_items=n_items, heads=nheads)
        return StaticByName(_persistent_grid(n_items, programs), static,
                            dict(_constexprs(cfg, q, k, window_left, window_right, attention_chunk, varlen, first),
                                 HEAD_DIM_TAIL=tail, HAS_DROPOUT=dropout_p > 0.0))

    key = None if key is None else (key, programs, 2)
    Q, Q2, K, K2, V, DO, DQ, DQ2 = _part_descs(key, first, tail, ((q, cfg.block_m), (k, cfg.block_n),
                                                                  (v, cfg.block_n), (dout, cfg.block_m),
                                                                  (dq, cfg.block_m)), split=(0, 1, 4))
    dynamic = dict(Q=Q, Q2=Q2, K=K, K2=K2, V=V, DO=DO, DQ=DQ, DQ2=DQ2, DQ_PTR=dq if varlen else None, OUT=out,
                   LSE=lse, DELTA=delta, RNG=rng,
                   TILES=plan.last_first if varlen else None, CU_SEQLENS_Q=cu_seqlens_q, CU_SEQLENS_K=cu_seqlens_k,
                   COUNTER=plan.counters[2] if varlen else dense_counter(q.device, 2), qk_scale=qk_scale,
                   softmax_scale=softmax_scale, dropout_p=dropout_p)
    launch_named(_hopper_dq_kernel, dynamic, statics, num_warps=4, key=key)


def bwd_dkdv(q, k, v, dout, dk, dv, lse, delta, qk_scale: float, softmax_scale: float, window_left: int,
             window_right: int, cu_seqlens_q=None, cu_seqlens_k=None, plan: Optional[Plan] = None,
             attention_chunk: int = 0, key: Optional[tuple] = None) -> None:
    """dk and dv of a problem that hopper_unsupported accepts, from the delta the dQ kernel wrote; varlen with a
    plan of the key side holding the first-first list of 2 x BLOCK_N-row key tiles (ops/bwd.py). key: as fwd's."""
    head_dim, nheads_kv = q.shape[-1], k.shape[-2]
    cfg = HOPPER["bwd_dkdv"][head_dim]
    first, tail = head_dim_parts(head_dim)
    varlen = cu_seqlens_q is not None
    programs = sm_count(q.device)
    # Persistent (Note [persistent dK/dV] in kernels/hopper_bwd.py), as the forward.
    if varlen:
        assert plan.has(0, 2 * cfg.block_n)

    def statics() -> StaticByName:
        if not varlen:
            batch, seqlen_q = q.shape[:2]
            seqlen_k = k.shape[1]
            n_items = _items(batch, nheads_kv, seqlen_k, 2 * cfg.block_n)
            static = dict(stride_lb=lse.stride(0), stride_lh=lse.stride(1), seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                          wl=window_left, wr=window_right, chunk=attention_chunk, stride_dkm=0, stride_dkh=0,
                          stride_dvm=0, stride_dvh=0, n_items=n_items, heads=nheads_kv)
        else:
            n_items = plan.first_first.shape[0] * nheads_kv
            static = dict(stride_lb=0, stride_lh=lse.stride(0), seqlen_q=q.shape[0], seqlen_k=k.shape[0],
                          wl=window_left, wr=window_right, chunk=attention_chunk, stride_dkm=dk.stride(0),
                          stride_dkh=dk.stride(1), stride_dvm=dv.stride(0), stride_dvh=dv.stride(1),
                          n_items=n_items, heads=nheads_kv)
        return StaticByName(_persistent_grid(n_items, programs), static,
                            dict(_constexprs(cfg, q, k, window_left, window_right, attention_chunk, varlen, first),
                                 HEAD_DIM_TAIL=tail))

    key = None if key is None else (key, programs, 1)
    Q, Q2, K, K2, V, DO, DK, DK2, DV = _part_descs(key, first, tail, ((q, cfg.block_m), (k, cfg.block_n),
                                                                      (v, cfg.block_n), (dout, cfg.block_m),
                                                                      (dk, cfg.block_n), (dv, cfg.block_n)),
                                                   split=(0, 1, 4))
    dynamic = dict(Q=Q, Q2=Q2, K=K, K2=K2, V=V, DO=DO, DK=DK, DK2=DK2, DV=DV, DK_PTR=dk if varlen else None,
                   DV_PTR=dv if varlen else None,
                   LSE=lse, DELTA=delta, TILES=plan.first_first if varlen else None, CU_SEQLENS_Q=cu_seqlens_q,
                   CU_SEQLENS_K=cu_seqlens_k, COUNTER=plan.counters[1] if varlen else dense_counter(q.device, 1),
                   qk_scale=qk_scale, softmax_scale=softmax_scale)
    launch_named(_hopper_dkdv_kernel, dynamic, statics, num_warps=4, key=key)
