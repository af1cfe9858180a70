"""Decode launchers and their custom ops: `flashtile::append_kv`, `flashtile::decode`, `flashtile::combine`.

How each kernel is parallelised:
  append_kv   grid (cdiv(S_new, BLOCK_T), Hk, B): each program copies BLOCK_T new rows of one KV head into the
              cache (rotating k when asked). Mutates k_cache and v_cache, which the op declares.
  decode      grid (num_m_tiles * num_splits, Hk, B): one program per packed query tile (GROUP heads x Sq tokens),
              KV split, KV head and sequence; see kernels/decode.py. With num_splits > 1 it writes fp32 partial
              states and `combine` folds them; with one split it writes the output directly.
  combine     grid (cdiv(B * Sq * H, BLOCK_R), cdiv(D, BLOCK_D)): each program merges all splits of BLOCK_R rows
              in BLOCK_D columns (at most COMBINE_BLOCK_D).

Nothing here synchronises with the device: every launch decision (tile sizes, number of splits) comes from
shapes, so a decode step can be captured in a CUDA graph. Argument checking happens at the public API
(flashtile/kvcache.py); these ops trust their inputs.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import env
from ..config import KeysMajorTile, TileConfig, block_d, decode_config, head_dim_parts
from ..kernels.combine import _combine_kernel
from ..kernels.decode import _decode_kernel
from ..kernels.kvcache import _append_kv_kernel
from ..problem import capacity, kernel_flags
from .common import alibi_batch_stride, cdiv, custom_op, fast_divisor, next_power_of_2
from .device import sm_count
from .launch import launch_direct, launch_opts
from .fwd import logit_scales

APPEND_BLOCK_T = 2 if env.INTERPRET else 16  # new tokens per append program (a decode step appends ~1)
COMBINE_BLOCK_R = (4, 16)  # rows per combine program: the first while rows are too few to fill the GPU
COMBINE_SPLITS = (16, 2)  # splits a combine program loads at once, by COMBINE_BLOCK_R (Note [combine groups])
SMALL_KERNEL_OPTS = {"num_warps": 4, "num_stages": 1}  # append: one pass, nothing to pipeline
COMBINE_OPTS = {"num_warps": 4, "num_stages": 1}  # combine: it pipelines its own loads (Note [combine groups])
# Columns per combine program: a wide V's rows (absorbed MLA decode's 512) are merged by several programs, each
# chaining every split's load of its columns, so that few rows still fill the GPU (Note [combine columns]).
COMBINE_BLOCK_D = 128
PAGED_EXTRA_STAGES = 2  # see decode_launch_opts

# Split heuristic (num_splits=0): at most one wave. PROGRAMS_PER_SM is how many decode programs an SM holds at once
# (d128: 4 warps of at most 128 registers a thread, a cap decode_launch_opts sets, and 38 KB of shared memory each; a
# keys-major tile gives its own count, Note [keys-major decode]), and the launch is given as many splits as fit in that
# one wave, rounded down. Rounding up, the first rule, spilled into another wave, which cost up to 25% paged: a launch
# of 1.03-1.45 waves runs its last programs on a few SMs, each reading at one program's latency-bound rate
# (tools/tune_decode.py --splits, 256k cached tokens, Sq=1: at 0.97-1.00 wave 4.11-4.36 TB/s contiguous and 3.96-4.33
# paged for every batch 2..64; at 1.03-1.45 waves 2.89-3.67 paged). Every split also gets at least MIN_BLOCKS_PER_SPLIT
# key blocks so its pipeline fills, and the partial buffers are capped at MAX_SPLITS. Head dims other than 128 use the
# same occupancy, not measured.
# A split also reads at least PARTIAL_SHARE times the bytes of the fp32 partial state it writes, which the combine reads
# back: binding only where a tile's rows carry a wide V, as absorbed MLA decode's 16 heads x 512 channels in the
# row-major tile (32 KB of state against 36 KB of cache a key block), which paged caches take (Note [keys-major decode]:
# a contiguous cache's 64-key blocks read 74 KB). There, at 16 sequences of 4k tokens, 32 splits of 4 blocks read 1.37
# TB/s and 16 splits of 8 blocks 1.59 (paged 1.32 -> 1.47; H200, CUDA graphs, tools/tune_decode.py --mla); at 8k, 32
# splits and the 33 of one wave read the same (2.02 and 1.99), and from 16k on, or from 32 sequences, the rule leaves
# the wave's count. It also binds at 32 or more packed rows of any head dim (GQA 8 with 4 query tokens, GQA 32 with one;
# d128 and 64 rows: 16 blocks) on caches short enough that the blocks, not the wave, bound the splits: the same trade,
# not measured there.
PROGRAMS_PER_SM = 4
REGISTERS_PER_SM = 65536  # sm_80/sm_90 register file (32-bit registers)
MIN_MAXNREG = 128  # below this the kernel spills (d256's 8-warp tile would get 64): no maxnreg there
MIN_BLOCKS_PER_SPLIT = 4
PARTIAL_SHARE = 8
MAX_SPLITS = 128


# The subset of problem.kernel_flags that the decode kernel takes (it has no varlen query and no seqused).
_SHARED_FLAGS = ("MASK_LEFT", "MASK_RIGHT", "MASK_CHUNK", "HAS_SOFTCAP", "HAS_ALIBI", "UPCAST", "DOT_PRECISION")


# Note [keys-major decode]: absorbed MLA decode at 16 heads (DeepSeek under 8-way tensor parallelism) packs 16 query
# rows on one latent head, each cache row 576 channels read once for K and once, as its first 512, for V. Rows x
# keys, 16 rows are one mma.sync tile (wgmma wants 64 rows a warpgroup), and the table's 32-key tile, capped to
# 128 registers so that 4 programs fit an SM, keeps one 36 KB block in flight a program (tests/sm90_compile.py: 56
# KB of shared memory at num_stages 2). Keys x rows (kernels/decode.py: KEYS_M), S^T = K Q^T and O^T += V^T P^T
# take one warpgroup's wgmma of 64 keys x 16 rows, K's shared-memory tile serving as V^T with no copy, and the
# softmax reduces across keys, over the warps, for the max alone (softmax.keys_major_step). Its 64-key tile at 2
# stages holds two 74 KB blocks in flight, 168 KB, one program an SM: programs_per_sm then sizes the split
# heuristic's wave (132 programs on an H100 or H200), whose splits already read more than PARTIAL_SHARE times
# their state. Measured on an H100 80GB HBM3 (2026-12-08, torch 2.11, Triton 3.6, `tools/ab_trees.sh <base> 2
# --only mla`, CUDA graphs, TB/s of cache): b16 x 4k / 8k / 32k 1.82 / 2.10 / 2.81 -> 2.01 / 2.43 / 2.93, b32 x 4k
# 2.12 -> 2.39, b64 x 4k / 32k 2.52 / 3.06 -> 2.66 / 3.10; at b16 x 32k ncu read the DRAM at 88% of its peak (82%
# for a first version that kept the kernel's three loops, masked edge / interior / masked edge, and summed each
# block's probabilities across the warps: 255 registers against 144).
# Paged caches keep the row-major tile: the block table's load takes a pipeline stage of a keys-major tile's two,
# and a third does not fit shared memory; at 64-token pages the keys-major tile was 4-11% faster at b16-b32 x
# 4k-16k but 3-5% slower from 150 MB of cache up (b64 x 8k, b32 x 16k and more).


def programs_per_sm(cfg: TileConfig) -> int:
    """How many programs of the decode tile cfg an SM holds: PROGRAMS_PER_SM, or a keys-major tile's own."""
    return cfg.programs_per_sm if isinstance(cfg, KeysMajorTile) else PROGRAMS_PER_SM


def auto_num_splits(work_units: int, max_kv_blocks: int, sms: int, min_blocks: int = MIN_BLOCKS_PER_SPLIT,
                    per_sm: int = PROGRAMS_PER_SM) -> int:
    """Splits per (sequence, KV head, M tile) from shapes only: work_units = B * Hk * M tiles and max_kv_blocks is
    the cache capacity in BLOCK_N blocks (never the current lengths, which live on the device); each split gets at
    least min_blocks of them (min_blocks_per_split); per_sm programs fill an SM (programs_per_sm)."""
    wave = per_sm * sms
    return max(1, min(wave // work_units, max_kv_blocks // min_blocks, MAX_SPLITS))


def min_blocks_per_split(rows: int, head_dim_v: int, block_n: int, key_bytes: int) -> int:
    """The fewest key blocks a split reads: MIN_BLOCKS_PER_SPLIT, or enough that the cache it reads (block_n x
    key_bytes a block: K's row, and V's unless the kernel takes V from K) is PARTIAL_SHARE times the fp32 partial
    out of its tile's `rows` query rows."""
    return max(MIN_BLOCKS_PER_SPLIT, cdiv(PARTIAL_SHARE * rows * head_dim_v * 4, block_n * key_bytes))


def packed_tile(group: int, seqlen_q: int, cfg: TileConfig) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_T, num_m_tiles) for GROUP x Sq packed query rows. BLOCK_T bounds the tokens a tile spans;
    it is bucketed to a power of two so that Sq does not enter the compile key beyond that."""
    rows = group * seqlen_q
    block_m = min(cfg.block_m, max(16, next_power_of_2(rows)))
    span = block_m // group if block_m % group == 0 else (block_m - 1) // group + 2
    return block_m, min(span, next_power_of_2(seqlen_q)), cdiv(rows, block_m)


def page_tiled(block_table: Optional[torch.Tensor], k_cache: torch.Tensor, block_n: int) -> bool:
    """Whether the decode kernel can read one block-table entry per key tile: pages hold whole tiles."""
    return block_table is not None and k_cache.shape[1] % block_n == 0


def decode_launch_opts(cfg: TileConfig, paged: bool, block_m: int) -> dict:
    """Triton's software pipeliner gives the block-table load a stage of its own and the K/V loads that depend on
    it fewer buffers: on sm_90 (see the compile check) contiguous caches get 2 K/V tiles in flight at num_stages=3,
    paged ones 1 at 3 or 4 stages and 2 at 5. PAGED_EXTRA_STAGES keeps the paged read depth equal.

    The split heuristic assumes PROGRAMS_PER_SM resident programs, so for the decode step's own tile (BLOCK_M =
    16: one token's GQA group) the register budget that allows is a launch option (maxnreg), wherever it leaves at
    least MIN_MAXNREG registers a thread: without it, pages smaller than a tile took 149 registers at d128 (3
    programs an SM, so a launch of "one wave" ran in 1.3) and now fit 124-128 without a spill with every flag on
    (ptxas, sm_90a; measured 1-3% faster on every decode-preset row). Tiles of more packed rows (larger
    groups, more query tokens) would spill under that cap and keep their registers."""
    opts = launch_opts(cfg)
    if paged:
        opts["num_stages"] += PAGED_EXTRA_STAGES
    budget = REGISTERS_PER_SM // (programs_per_sm(cfg) * 32 * cfg.num_warps)
    if block_m <= 16 and budget >= MIN_MAXNREG:
        opts["maxnreg"] = min(budget, 255)
    return opts


def is_prefix_view(v: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether v is k's first channels: the same storage, offset and strides, fewer channels (an absorbed MLA cache).
    Strides of dimensions of size 1 (one KV head) address nothing, and views disagree on them:
    k.view(...)[..., :512] and k[..., :512].view(...) are the same channels with different strides there."""
    return (v.data_ptr() == k.data_ptr() and v.shape[:-1] == k.shape[:-1] and v.shape[-1] <= k.shape[-1]
            and all(sv == sk for sv, sk, n in zip(v.stride(), k.stride(), k.shape) if n > 1))


def v_is_k(k_cache: torch.Tensor, v_cache: torch.Tensor, block_d_k: int) -> bool:
    """Whether the decode kernel may take V's tile from K's first part (kernels/decode.py: V_IS_K): v_cache is a
    prefix view of k_cache (one storage) as wide a tile as K's first part."""
    return (is_prefix_view(v_cache, k_cache) and v_cache.dtype == k_cache.dtype
            and block_d(v_cache.shape[-1]) == block_d_k)


def page_args(k_cache: torch.Tensor) -> tuple[int, int, int]:
    """(page_size, page_mul, page_shift) as kvcache.cache_coords takes them; a contiguous cache's are unused."""
    return (k_cache.shape[1], *fast_divisor(k_cache.shape[1]))


def _rotary_args(rotary_cos):
    """(stride_cos, rotary_dim, seqlen_ro) of the rotary tables, zeros without them."""
    if rotary_cos is None:
        return 0, 0, 0
    return rotary_cos.stride(0), 2 * rotary_cos.shape[1], rotary_cos.shape[0]


@custom_op("flashtile::append_kv", mutates_args=("k_cache", "v_cache"))
def append_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_seqlens: torch.Tensor,
    cache_batch_idx: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
    rotary_cos: Optional[torch.Tensor], rotary_sin: Optional[torch.Tensor], rotary_interleaved: bool,
) -> None:
    """Write k (rotated at positions cache_seqlens[b] + t when rotary_cos is given) and v into the caches at rows
    [cache_seqlens[b], cache_seqlens[b] + S_new) of sequence b. k: (B, S_new, Hk, D), v: (B, S_new, Hk, D_v)."""
    batch, seqlen_new, nheads_kv, head_dim = k.shape
    head_dim_v = v.shape[-1]
    if k.numel() == 0:
        return
    stride_cos, rotary_dim, seqlen_ro = _rotary_args(rotary_cos)
    grid = (cdiv(seqlen_new, APPEND_BLOCK_T), nheads_kv, batch)
    launch_direct(
        _append_kv_kernel, grid,
        k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, rotary_cos, rotary_sin,
        *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_table.stride(0) if block_table is not None else 0, stride_cos,
        seqlen_new, *page_args(k_cache), k_cache.shape[0], capacity(k_cache, block_table), rotary_dim,
        seqlen_ro, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), HEAD_DIM_V=head_dim_v,
        BLOCK_DV=block_d(head_dim_v), BLOCK_T=APPEND_BLOCK_T,
        PAGED=block_table is not None, HAS_BATCH_IDX=cache_batch_idx is not None,
        HAS_ROTARY=rotary_cos is not None, ROTARY_INTERLEAVED=rotary_interleaved,
        V_IN_K=is_prefix_view(v_cache, k_cache), **SMALL_KERNEL_OPTS,
    )


@append_kv.register_fake
def _(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, rotary_cos, rotary_sin,
      rotary_interleaved):
    return None


def combine_into(out_partials: torch.Tensor, lse_partials: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor) -> None:
    """Merge (num_splits, B, Sq, H, D) / (num_splits, B, H, Sq) partial states into out (B, Sq, H, D) and lse
    (B, H, Sq).

    Note [combine columns]: a program waits a memory latency for each group of COMBINE_SPLITS splits (Note
    [combine groups] in kernels/combine.py), so the combine is bound by latency where its programs are few.
    Absorbed MLA decode at 16 heads has 16 rows a sequence 512 wide: at b16, 64 programs of 4 rows read 16 splits
    each. With COMBINE_BLOCK_D columns a program, 256 programs share
    that work, each merging the lse of its rows again (a load of 4 bytes a row and split beside its o's 512);
    the first column block stores the lse. Measured on the H200 (`--preset mla-decode --heads 16 --page-size 0`,
    TB/s of cache, CUDA graphs, one run each): b16 at 4k / 8k / 32k 1.55 / 1.99 / 3.27 -> 1.73 / 2.24 / 3.45, b32
    2.29 / 2.96 / 3.84 -> 2.46 / 3.10 / 3.91, b64 even (3.13 / 3.60 / 4.09 -> 3.11 / 3.61 / 4.08), when a program
    still merged its splits one at a time. Head dims up to 128 keep one column block."""
    num_splits, batch, seqlen_q, nheads, head_dim = out_partials.shape
    n_rows = batch * seqlen_q * nheads
    if n_rows == 0 or head_dim == 0:
        return
    small, large = COMBINE_BLOCK_R
    many = n_rows >= large * sm_count(out.device)
    block_r = large if many else small
    columns = min(block_d(head_dim), COMBINE_BLOCK_D)
    launch_direct(
        _combine_kernel, (cdiv(n_rows, block_r), cdiv(head_dim, columns)),
        out_partials, lse_partials, out, lse,
        *out_partials.stride()[:4], *lse_partials.stride()[:4], *out.stride()[:3], *lse.stride(),
        num_splits, seqlen_q, nheads, n_rows,
        HEAD_DIM=head_dim, BLOCK_D=columns, BLOCK_R=block_r, SPLITS=COMBINE_SPLITS[many], **COMBINE_OPTS,
    )


@custom_op("flashtile::combine", mutates_args=())
def combine(out_partials: torch.Tensor, lse_partials: torch.Tensor,
            out_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out (B, Sq, H, D) in out_dtype (default fp32), lse (B, H, Sq) fp32)."""
    _, batch, seqlen_q, nheads, head_dim = out_partials.shape
    out = out_partials.new_empty((batch, seqlen_q, nheads, head_dim), dtype=out_dtype or out_partials.dtype)
    lse = lse_partials.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    combine_into(out_partials, lse_partials, out, lse)
    return out, lse


@combine.register_fake
def _(out_partials, lse_partials, out_dtype):
    _, batch, seqlen_q, nheads, head_dim = out_partials.shape
    return (out_partials.new_empty((batch, seqlen_q, nheads, head_dim), dtype=out_dtype or out_partials.dtype),
            lse_partials.new_empty((batch, nheads, seqlen_q), dtype=torch.float32))


@custom_op("flashtile::decode", mutates_args=())
def decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
    cache_batch_idx: Optional[torch.Tensor], cache_leftpad: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
    rotary_cos: Optional[torch.Tensor], rotary_sin: Optional[torch.Tensor], rotary_interleaved: bool,
    learnable_sink: Optional[torch.Tensor],
    seqlen_new: int, softmax_scale: float, window_left: int, window_right: int, attention_chunk: int, softcap: float,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, Sq, H, D) over rows [leftpad, cache_seqlens + seqlen_new) of each sequence's cache.

    Returns (out (B, Sq, H, D_v), lse (B, H, Sq) fp32), D_v being v_cache's head dim. num_splits = 0 picks the
    number of KV splits from shapes.
    learnable_sink: fp32 (H,), folded into the first split's state (kernels/decode.py: HAS_SINK).
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_kv, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    out = q.new_empty((batch, seqlen_q, nheads, head_dim_v))
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    group = nheads // nheads_kv
    block_d_k, block_d_tail = head_dim_parts(head_dim)
    shared_v = v_is_k(k_cache, v_cache, block_d_k)
    cfg = decode_config(max(head_dim, head_dim_v), q.dtype == torch.float32, group * seqlen_q, shared_v,
                        block_table is not None)
    block_m, block_t, num_m_tiles = packed_tile(group, seqlen_q, cfg)
    if num_splits == 0:
        key_bytes = (head_dim + (0 if shared_v else head_dim_v)) * k_cache.element_size()
        num_splits = auto_num_splits(batch * nheads_kv * num_m_tiles,
                                     cdiv(capacity(k_cache, block_table), cfg.block_n), sm_count(q.device),
                                     min_blocks_per_split(min(block_m, group * seqlen_q), head_dim_v, cfg.block_n,
                                                          key_bytes), programs_per_sm(cfg))
    if num_splits == 1:
        o_part, lse_part, stride_os, stride_ls = out, lse, 0, 0
    else:
        o_part = q.new_empty((num_splits, batch, seqlen_q, nheads, head_dim_v), dtype=torch.float32)
        lse_part = q.new_empty((num_splits, batch, nheads, seqlen_q), dtype=torch.float32)
        stride_os, stride_ls = o_part.stride(0), lse_part.stride(0)
    qk_scale, softcap2 = logit_scales(softmax_scale, softcap)
    stride_cos, rotary_dim, seqlen_ro = _rotary_args(rotary_cos)
    flags = kernel_flags(window_left, window_right, softcap, alibi_slopes is not None, False, False, False, q.dtype,
                         chunk=attention_chunk)
    grid = (num_m_tiles * num_splits, nheads_kv, batch)
    launch_direct(
        _decode_kernel, grid,
        q, k_cache, v_cache, o_part, lse_part, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        alibi_slopes, rotary_cos, rotary_sin, learnable_sink,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        stride_os, *o_part.stride()[-4:-1], stride_ls, *lse_part.stride()[-3:],
        block_table.stride(0) if block_table is not None else 0, alibi_batch_stride(alibi_slopes), stride_cos,
        seqlen_q, seqlen_new, *page_args(k_cache), k_cache.shape[0], capacity(k_cache, block_table), rotary_dim,
        seqlen_ro, num_splits,
        num_m_tiles,
        qk_scale, softcap2, window_left, window_right, attention_chunk,
        HEAD_DIM=head_dim, BLOCK_D=block_d_k, BLOCK_D2=block_d_tail, HEAD_DIM_V=head_dim_v,
        BLOCK_DV=block_d(head_dim_v), V_IS_K=shared_v,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_T=block_t,
        GROUP=group, PAGED=block_table is not None, PAGE_TILED=page_tiled(block_table, k_cache, cfg.block_n),
        HAS_BATCH_IDX=cache_batch_idx is not None,
        HAS_LEFTPAD=cache_leftpad is not None, HAS_ROTARY=rotary_cos is not None,
        ROTARY_INTERLEAVED=rotary_interleaved, HAS_SINK=learnable_sink is not None,
        KEYS_M=isinstance(cfg, KeysMajorTile),
        **{name: flags[name] for name in _SHARED_FLAGS},
        **decode_launch_opts(cfg, block_table is not None, block_m),
    )
    if num_splits > 1:
        combine_into(o_part, lse_part, out, lse)
    return out, lse


@decode.register_fake
def _(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
      rotary_cos, rotary_sin, rotary_interleaved, learnable_sink, seqlen_new, softmax_scale, window_left,
      window_right, attention_chunk, softcap, num_splits):
    batch, seqlen_q, nheads, _ = q.shape
    return (q.new_empty((batch, seqlen_q, nheads, v_cache.shape[3])),
            q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32))
