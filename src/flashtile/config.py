"""Tile configurations: how each kernel is blocked, separate from what it computes.

A config is (BLOCK_M, BLOCK_N, num_warps, num_stages). The table is keyed by (kernel, padded head dim, arch) and
each entry says where its numbers came from. Configs do not depend on the mask, the dtype (fp16 and bf16 share
tensor-core rates; fp32 inputs take the fp16 row's shape, Triton lowers their dots to tf32, except where FP32 says
otherwise: tiles of 4-byte elements that would not fit in shared memory) or the sequence length, so one compiled
kernel per feature combination serves every call.

`FLASHTILE_AUTOTUNE=1` (env.py) replaces the table by timing `CANDIDATES` once per feature combination and head
dim, cached on disk by Triton. Under the CPU interpreter the tiles are small so that the tiny test shapes still
cross several block boundaries (32 x 16 is deliberately not square, which catches range code assuming M == N).
"""

from dataclasses import dataclass
from typing import Optional

from . import env


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    source: str = ""

    def kwargs(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n}


@dataclass(frozen=True)
class KeysMajorTile(TileConfig):
    """A decode tile whose score tile is keys x query rows (kernels/decode.py: KEYS_M): block_n keys are the MMA's
    M dimension, so a few query rows need no padding to its 64, and programs_per_sm of it fit an SM."""
    programs_per_sm: int = 1


_H200 = "measured on H200, 2026-11-29, triton 3.6, tools/tune_tiles.py at S=4k"
_H200_S4 = ("measured on H200, 2026-11-29, triton 3.6: fwd+bwd A/B against (64, 64, 4, 2) at S=1k/4k/16k, "
            "causal and not: +1.5-3.2%, S=1k causal even")
_FWD_D64_S4 = ("measured on H200, 2026-11-29, triton 3.6: A/B/A/B against the first tile, (64, 64, 4, 2), which the "
               "forward's host descriptors overtook: +2.5-19% at S=1k/4k/16k, causal and not")
_SMALL_D = "d64's measured config, reused for small head dims (not measured separately)"
_DQ_SMALL_D = ("d64's measured tile at 3 stages, not measured: at 2 the ptxas bundled with Triton 3.6 crashes "
               "(SIGSEGV) on the causal d32 dQ kernel (H200 GPU tier, 2026-11-29; tests/sm90_compile.py)")

_D512 = ("d512 (Gemma 4): a tile that fits sm_90's shared memory without spilling much (tests/sm90_compile.py; "
         "the backward's 32-row tiles run mma.sync, not wgmma), not timed")
_D512_DQ = ("measured on H200, 2026-12-03, triton 3.6: d512 backward ms at b4 x 4k x h4, non-causal / causal, "
            "18.73 / 8.76 against 1 stage's 21.13 / 9.84 (dK/dV at (32, 32, 8, 1)); a (32, 16, 8, 2) dK/dV tile was "
            "slower with either (18.89 / 9.75, 20.94 / 10.61)")
_D512_FWD = ("measured on H200, 2026-12-03, triton 3.6: forward TFLOP/s at S = 4k / 16k, non-causal and causal, "
             "237 / 215 / 233 / 252 against (64, 32, 8, 2)'s 202 / 185 / 203 / 211; (64, 16, 8, 3) 127-147, "
             "(128, 32, 8, 1) 49-61; (64, 32, 8, 3) does not fit shared memory")
_MLA = ("measured on H200, 2026-12-03, triton 3.6: absorbed 576/512 at b32 x 8k, TB/s of cache at 128 / 16 heads "
        "(contiguous): 0.64 / 2.98 against (32, 32, 8, 2)'s 0.35 / 1.58, (32, 64, 4, 2)'s 0.83 / 2.59, "
        "(64, 32, 8, 2)'s 0.60 / 1.59 (wgmma, spills), (16, 64, 4, 2)'s 0.58 / 2.58")
_MLA_KEYS_M = ("measured on H100, 2026-12-08, triton 3.6: 16-head absorbed 576/512 decode, contiguous, TB/s at b16 x "
               "4k / 8k / 32k, b32 x 4k, b64 x 4k / 32k: 2.01 / 2.43 / 2.93 / 2.39 / 2.66 / 3.10 against "
               "DECODE_TABLE[1024]'s 1.82 / 2.10 / 2.81 / 2.12 / 2.52 / 3.06")
# kernel -> padded head dim -> config, for sm_90. Other archs use the same shapes until measured.
TABLE: dict[str, dict[int, TileConfig]] = {
    "fwd": {
        16: TileConfig(64, 64, 4, 3, _SMALL_D),
        32: TileConfig(64, 64, 4, 3, _SMALL_D),
        64: TileConfig(64, 64, 4, 3, _FWD_D64_S4),
        128: TileConfig(64, 64, 4, 3, _H200),
        256: TileConfig(64, 64, 4, 3, _H200),
        512: TileConfig(64, 64, 8, 1, _D512_FWD),
    },
    "bwd_dkdv": {
        16: TileConfig(32, 128, 4, 3, _SMALL_D),
        32: TileConfig(32, 128, 4, 3, _SMALL_D),
        64: TileConfig(32, 128, 4, 3, _H200),
        128: TileConfig(64, 64, 4, 2, _H200),
        256: TileConfig(32, 64, 8, 2, _H200),
        512: TileConfig(32, 32, 8, 1, _D512),
    },
    "bwd_dq": {
        16: TileConfig(64, 64, 4, 3, _DQ_SMALL_D),
        32: TileConfig(64, 64, 4, 3, _DQ_SMALL_D),
        64: TileConfig(64, 64, 4, 2, _H200),
        128: TileConfig(128, 64, 8, 3, _H200_S4),
        256: TileConfig(64, 64, 4, 2, _H200),
        512: TileConfig(32, 32, 8, 2, _D512_DQ),
    },
}

_FP32 = ("fp32 inputs (true fp32 dots, problem.kernel_flags): the fp16 row's tiles need more than an H100/H200 "
         "block's 227 KiB of shared memory (found by the GPU tier: the d128 dQ kernel asked for 321 KiB); "
         "a smaller tile that fits (<= 197 KiB by tests/sm90_compile.py), not timed")
# kernel -> padded head dim -> config for fp32 inputs where the table's does not fit (tests/sm90_compile.py builds
# every table entry at fp32 too).
FP32: dict[str, dict[int, TileConfig]] = {
    "fwd": {256: TileConfig(64, 32, 4, 2, _FP32), 512: TileConfig(32, 32, 8, 1, _FP32)},
    "bwd_dkdv": {256: TileConfig(32, 32, 4, 2, _FP32), 512: TileConfig(16, 32, 8, 1, _FP32)},
    "bwd_dq": {128: TileConfig(64, 64, 4, 2, _FP32), 256: TileConfig(32, 32, 4, 2, _FP32),
               512: TileConfig(32, 16, 8, 1, _FP32)},
}
_DROPOUT_D64 = ("measured on H200, 2026-12-03, triton 3.6, p = 0.1 (the dK/dV tile queries x keys with dropout, "
                "kernels/bwd.py): dK/dV kernel µs at S = 4k, non-causal / causal, 2943 / 1614 against (32, 128, 4, "
                "3) 6522 / 3799, (64, 128, 8, 2) 8763 / 5879, (128, 64, 8, 2) 5628 / 3506. Forward and dQ tiles "
                "with 8 warps were slower than the table's too (docs/perf.md)")
# kernel -> padded head dim -> config with dropout where the mask changes which tile is fastest: the dK/dV kernel's
# tile turns queries x keys with dropout (Note [dropout mask]), so the table's, sized for keys x queries, is not.
# d128 keeps the table's (64, 64, 4, 2), spills and all (255 registers, 368 bytes of spill stores in the sm_90
# build): measured on H100, 2026-12-07, triton 3.6, tools/tune_tiles.py --dropout 0.1 at b4 x 4k x h16, backward
# TFLOP/s non-causal / causal 334 / 295 against (32, 64, 8, 2)'s 318 / 280 (no spill), (128, 32, 8, 2) 324 / 279,
# (64, 32, 4, 2) 321 / 275, (64, 64, 8, 2) 314 / 283, (128, 64, 8, 2) 320 / 258, (32, 128, 8, 2) 307 / 272.
_DROPOUT_D512 = ("measured on H200, 2026-12-03, triton 3.6, p = 0.1: d512 backward 2.78 ms at b2 x 2k x h4 causal "
                 "against the table's (32, 32, 8, 1) 12.80 (same gradients, bit for bit), whose build with dropout "
                 "spills 12-17 KB (tests/sm90_compile.py: 948 bytes here)")
DROPOUT: dict[str, dict[int, TileConfig]] = {
    "bwd_dkdv": {64: TileConfig(64, 64, 4, 3, _DROPOUT_D64), 512: TileConfig(16, 32, 8, 1, _DROPOUT_D512)},
}
_MLA_FWD = ("measured on H200, 2026-12-03, triton 3.6 (q/k 192, v 128; b4 x 4k x h16 bf16, each kernel's tile tried "
            "with the others at the d256 row's, out and grads checked against an fp32 reference): forward ms "
            "non-causal / causal 1.574 / 0.903 against the d256 row's (64, 64, 4, 3) 1.877 / 1.106; (128, 64, 8, 2) "
            "1.854 / 1.109, (64, 128, 4, 2) 2.175 / 1.272, (128, 32, 8, 2) 1.944 / 1.684; (128, 128, 8, 2) does not "
            "fit")
_MLA_DQ = ("measured as _MLA_FWD: backward ms 9.815 / 5.011 against the d256 row's (64, 64, 4, 2) 10.435 / 5.404; "
           "(128, 64, 8, 2) 9.912 / 4.997, (64, 32, 4, 2) 10.259 / 5.196, (64, 64, 8, 2) 12.327 / 6.368")
_MLA_DKDV = ("measured as _MLA_FWD: backward ms 7.674 / 4.342 against the d256 row's (32, 64, 8, 2) 10.435 / 5.404; "
             "(64, 32, 4, 2) 9.042 / 4.911, (64, 64, 4, 2) 9.797 / 5.399. Faster, but ptxas serialises their wgmma "
             "(255 registers, 544-656 bytes spilled; tests/sm90_compile.py refuses it): (32, 64, 4, 2) 5.749 / "
             "4.171, (32, 128, 8, 2) 6.977 / 4.312")
_D512_PARTS = ("measured on H200, 2026-12-03, triton 3.6: d512 forward as two (512, 256) launches, one per half of V's "
               "columns (Note [V parts] in kernels/fwd.py), TFLOP/s of the d512 problem at S = 4k / 16k, non-causal "
               "and causal: 265 / 228 / 274 / 274 against one d512 launch's 238 / 214 / 233 / 251; (128, 32, 8, 2) "
               "194-260, (64, 32, 4, 2) 160-187, (128, 16, 8, 2) 120-155, 8-warp tiles of 64 rows 67-133")
# kernel -> (padded q/k head dim, padded v head dim) -> config where v is narrower than q/k (MLA prefill's 192/128,
# whose q/k pad to 256): the d256 row's tiles are sized for a V, O, dO and dV 256 wide, and a 128-wide one leaves
# registers and shared memory for others. (512, 256) is the forward's tile for one half of a V 512 wide (Note [V
# parts] in kernels/fwd.py).
NARROW_V: dict[str, dict[tuple[int, int], TileConfig]] = {
    "fwd": {(256, 128): TileConfig(128, 64, 8, 3, _MLA_FWD), (512, 256): TileConfig(64, 32, 4, 3, _D512_PARTS)},
    "bwd_dq": {(256, 128): TileConfig(64, 64, 4, 3, _MLA_DQ)},
    "bwd_dkdv": {(256, 128): TileConfig(64, 64, 8, 2, _MLA_DKDV)},
}
_INTERPRETER = {
    "fwd": TileConfig(32, 16, 4, 1, "CPU interpreter: small tiles to cross block boundaries"),
    "bwd_dkdv": TileConfig(16, 32, 4, 1, "CPU interpreter: small tiles to cross block boundaries"),
    "bwd_dq": TileConfig(32, 16, 4, 1, "CPU interpreter: small tiles to cross block boundaries"),
}

# Autotuning search space (FLASHTILE_AUTOTUNE=1), per kernel.
CANDIDATES: dict[str, list[TileConfig]] = {
    "fwd": [TileConfig(m, n, w, st) for m, n, w, st in
            [(64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2),
             (64, 128, 4, 2), (128, 128, 4, 3)]],
    "bwd_dkdv": [TileConfig(m, n, w, st) for m, n, w, st in
                 [(64, 64, 4, 2), (64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3),
                  (32, 64, 4, 2), (32, 32, 4, 2), (64, 32, 4, 2), (32, 64, 8, 2), (64, 64, 8, 1)]],
    "bwd_dq": [TileConfig(m, n, w, st) for m, n, w, st in
               [(64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 2), (64, 32, 4, 2), (32, 64, 4, 2),
                (64, 64, 8, 2), (32, 32, 4, 2)]],
}


@dataclass(frozen=True)
class HopperConfig:
    """A tile of the Gluon Hopper kernels (kernels/hopper_fwd.py, hopper_dq.py, hopper_bwd.py): each consumer
    warpgroup's rows (block_m queries or block_n keys), the ring depth, and the registers setmaxnreg gives the
    partitions."""
    block_m: int
    block_n: int
    stages: int
    consumer_regs: int = 240
    loader_regs: int = 24
    source: str = ""
    split_columns: bool = False  # both consumers on the same rows, each on half of the head dim (hopper_fwd_wide.py)

    @property
    def item_rows(self) -> int:
        """Query rows of a work item (its varlen tile list's tiles): one consumer's block_m with split columns,
        else two consumers' (the forward's and dQ's; dK/dV's items are 2 x block_n keys)."""
        return self.block_m if self.split_columns else 2 * self.block_m

    def kwargs(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "STAGES": self.stages,
                "CONSUMER_REGS": self.consumer_regs, "LOADER_REGS": self.loader_regs}


_HOPPER_FWD = ("measured on H200, 2026-11-29, triton 3.6: stages 2/3 x in-warpgroup overlap on/off at S=1k/4k/16k, "
               "causal and not; 3 stages with overlap fastest in all six")
_HOPPER_DQ = ("the Gluon dQ's tile (BLOCK_N = BLOCK_M: the consumers' ranges differ by whole key blocks), "
              "3 stages as dK/dV; measured on H200, 2026-11-30, triton 3.6, against the Triton dQ")
_HOPPER_DKDV = ("measured on H200, 2026-11-29, triton 3.6: stages 2/3 at S=1k/4k/16k; 3 faster at 1k and 16k, "
                "even at 4k, 1.5% slower at 1k causal")

_HOPPER_FWD_MLA = ("q/k 192 (128 + 64) with v 128: 2 stages, the one depth whose buffers fit shared memory (two Q "
                   "sets of 4 x 24 KiB, 1 K slot of 48, 2 V slots of 32: 208 KiB)")
_HOPPER_FWD_WIDE = ("q, k, v 512 split 256 + 256 between the consumers (Note [split columns] in "
                    "kernels/hopper_fwd_wide.py): 64 rows, 32-key blocks, 2 stages: 224 KiB of shared memory")
_HOPPER_BWD_MLA = ("q/k 192 (128 + 64) with v 128: the streamed tiles halved (dQ's key blocks, dK/dV's query tiles) "
                   "so that 3 stages fit shared memory beside the held sets (220 KiB each)")

# Gluon Hopper kernels, sm_90 only: kernel -> q/k head dim (exact: others run the Triton kernels; v's is the first
# part's, or q's with split columns: ops/hopper.gluon_head_dims) -> config. At d64 the same structure ran the
# standard sweep's S=1k forward slower than the Triton kernel (docs/design/hopper-pipeline.md).
HOPPER: dict[str, dict[int, HopperConfig]] = {
    "fwd": {128: HopperConfig(64, 128, 3, source=_HOPPER_FWD), 192: HopperConfig(64, 128, 2, source=_HOPPER_FWD_MLA),
            512: HopperConfig(64, 32, 2, source=_HOPPER_FWD_WIDE, split_columns=True)},
    "bwd_dkdv": {128: HopperConfig(64, 64, 3, source=_HOPPER_DKDV),
                 192: HopperConfig(32, 64, 3, source=_HOPPER_BWD_MLA)},
    "bwd_dq": {128: HopperConfig(64, 64, 3, source=_HOPPER_DQ), 192: HopperConfig(64, 32, 3, source=_HOPPER_BWD_MLA)},
}


def block_d(head_dim: int) -> int:
    """Head dim as the kernels tile it: a power of two, at least 16 (the smallest tl.dot K)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def head_dim_parts(head_dim: int) -> tuple[int, int]:
    """(first, tail): the q/k head dim as the decode kernel tiles it, two powers of two (tail 0: one part,
    block_d(head_dim) wide). A head dim between powers of two is read as the lower one plus the narrowest tail
    (>= 16) that covers the rest, where that is narrower than padding to the next power: DeepSeek's 576 is
    512 + 64 (a 1024-wide tile would spend 44% of the Q Kᵀ product on zeros), 192 is 128 + 64, 96 is 64 + 32."""
    padded = block_d(head_dim)
    first = padded // 2
    tail = block_d(head_dim - first) if head_dim > first else 0
    if first < 16 or first + tail >= padded:
        return padded, 0
    return first, tail


def v_parts(head_dim_v: int, fp32: bool) -> int:
    """How many programs of the Triton forward share a query tile, each its part of V's and O's columns (Note [V
    parts] in kernels/fwd.py): 2 for a V 512 wide in 16-bit inputs (each part takes NARROW_V's (512, 256) tile),
    else 1."""
    return 2 if head_dim_v == 512 and not fp32 else 1


def tile_config(kernel: str, head_dim: int, fp32: bool = False, dropout: bool = False,
                head_dim_v: Optional[int] = None) -> TileConfig:
    """The config of `kernel` at this head dim (the wider of q/k's and v's), for fp32 inputs if `fp32`, with
    dropout if `dropout`, with v's head dim `head_dim_v` (None: the same)."""
    if env.INTERPRET:
        return _INTERPRETER[kernel]
    return table_config(kernel, head_dim, fp32, dropout, head_dim_v)


def table_config(kernel: str, head_dim: int, fp32: bool = False, dropout: bool = False,
                 head_dim_v: Optional[int] = None) -> TileConfig:
    """The GPU table's config of `kernel` (what tile_config gives outside the interpreter; `flashtile info` shows
    it on any machine). fp32 takes precedence: its tiles are the ones that fit shared memory; then dropout's,
    then a narrower v's (NARROW_V)."""
    d = block_d(head_dim)
    if fp32 and d in FP32[kernel]:
        return FP32[kernel][d]
    if dropout and d in DROPOUT.get(kernel, {}):
        return DROPOUT[kernel][d]
    narrow = NARROW_V[kernel].get((d, block_d(head_dim_v))) if head_dim_v is not None else None
    return narrow or TABLE[kernel][d]


# The decode kernel's tiles (kernels/decode.py, ops/decode.py).
_GUESS = "initial guess for H200 (bandwidth-bound decode), not measured"
_TUNED = "measured on H200, 2026-11-29, triton 3.6, tools/tune_decode.py"
_SCALED = "d128's measured tile scaled to the same K/V bytes per stage, not measured"

# Padded head dim -> decode tile config. block_m is the most packed query rows (GQA group x tokens) per tile: a
# decode step packs fewer, and the launcher shrinks BLOCK_M to the next power of two >= 16 of what it packs.
# Decode streams K/V: the tile sets the bytes each load moves and, through shared memory, how many programs an
# SM holds (d128: a 16 KB K+V stage at 32 rows, ~38 KB of shared memory per program for one token's GQA group).
# Measured at d128 (tools/tune_decode.py): 32-row tiles read 4.07 / 3.93 / 4.08 TB/s on 2 x 128k tokens
# (contiguous / 16-token pages / 256-token pages) against 3.61 / 2.82 / 3.41 with 64 rows, and won 6 of 9
# corners; they lost on 8 x 32k paged (3.04 / 2.94 against 3.24 / 3.78), a case then launched in 1.09 waves
# (see the split heuristic in ops/decode.py).
DECODE_TABLE: dict[int, TileConfig] = {
    16: TileConfig(64, 128, 4, 3, _GUESS),
    32: TileConfig(64, 128, 4, 3, _GUESS),
    64: TileConfig(64, 64, 4, 3, _SCALED),
    128: TileConfig(64, 32, 4, 3, _TUNED),
    256: TileConfig(32, 32, 8, 3, _GUESS),
    512: TileConfig(32, 32, 8, 2, _D512),
    # DeepSeek's absorbed MLA decode: q/k 576 (512 latent + 64 rope channels, read as 512 + 64: head_dim_parts),
    # v 512 read from K's first part (kernels/decode.py: V_IS_K). This tile is for 16 heads; 128 take DECODE_WIDE's.
    1024: TileConfig(32, 32, 4, 2, _MLA),
}
# Tiles for decode steps that pack more than 16 query rows (GQA groups over 16 heads, several query tokens), where
# they differ from DECODE_TABLE's: the absorbed MLA cache at 128 heads does more work a cache byte, and wider key
# tiles pay there (_MLA: 0.83 against 0.64 TB/s at b32 x 8k; the mla-decode preset 0.64-1.02 against 0.53-0.69,
# with 100-120 spill stores plain) but not at 16 heads (2.59 against 2.98).
DECODE_WIDE: dict[int, TileConfig] = {
    1024: TileConfig(32, 64, 4, 2, _MLA),
}
# Absorbed MLA decode of up to 16 packed rows over a contiguous cache: keys x rows tiles, one warpgroup's wgmma
# (M = 64 keys, N = 16 rows), two 74 KB key blocks in flight and one program an SM (168 KB of shared memory, 144
# registers, no spill; tests/sm90_compile.py). Note [keys-major decode] in ops/decode.py.
DECODE_KEYS_M: dict[int, KeysMajorTile] = {
    1024: KeysMajorTile(16, 64, 4, 2, _MLA_KEYS_M, programs_per_sm=1),
}
# fp32 caches where the table's 4-byte K/V stages would not fit shared memory.
DECODE_FP32: dict[int, TileConfig] = {
    512: TileConfig(32, 16, 8, 2, _FP32),
    1024: TileConfig(32, 16, 8, 2, _FP32),
}
DECODE_INTERPRETER = TileConfig(16, 16, 4, 1, "CPU interpreter: small tiles so tiny caches cross blocks, M tiles")
DECODE_INTERPRETER_KEYS_M = KeysMajorTile(16, 16, 4, 1, "CPU interpreter: DECODE_KEYS_M's orientation, small")


def decode_config(head_dim: int, fp32: bool = False, rows: int = 1, v_in_k: bool = False,
                  paged: bool = False) -> TileConfig:
    """The decode tile at this head dim (the wider of q/k's and v's), for fp32 caches if `fp32`, for `rows` packed
    query rows (GQA group x query tokens) per KV head, where V's tile is K's first part if `v_in_k` (kernels/
    decode.py: V_IS_K; DECODE_KEYS_M's tiles hold no V of their own), over a paged cache if `paged` (which
    DECODE_KEYS_M's tiles leave to the others: Note [keys-major decode] in ops/decode.py)."""
    d = block_d(head_dim)
    keys_m = (v_in_k and not paged and rows <= 16 and d in DECODE_KEYS_M
              and not (fp32 and d in DECODE_FP32))
    if env.INTERPRET:
        return DECODE_INTERPRETER_KEYS_M if keys_m else DECODE_INTERPRETER
    if fp32 and d in DECODE_FP32:
        return DECODE_FP32[d]
    if keys_m:
        return DECODE_KEYS_M[d]
    return DECODE_WIDE[d] if rows > 16 and d in DECODE_WIDE else DECODE_TABLE[d]
