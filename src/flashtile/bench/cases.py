"""What `flashtile bench` measures: `Case`, one attention problem in one mode, and the presets' sweeps.

A preset is a list of runs, each a mode and the sweep its shapes come from: a `Shapes`, one case per point of
the product of its axes. Axes left as None are derived the way the FlashAttention papers fix total work:
batch = tokens // seqlen and heads = hidden // head dim. Command-line flags replace individual axes in every
sweep, so `--preset standard --head-dim 128` is the standard sweep at one head dim, and a fully specified
custom case is just every axis set to one value.

The GPU sweeps:
- dense (modes fwd, fwdbwd): the papers' sweep. B·S = 16k tokens, hidden 2048, head dims 64/128/256,
  S = 512…16k, causal and not.
- decode: GQA 32 query / 8 KV heads, d128, one or four query tokens against KV caches of 4k…128k tokens with
  batch × length = 256k tokens (64 × 4k … 2 × 128k), contiguous and paged (16, 64, 256 tokens a page).
- decode-mixed (in the decode preset): the same heads, 16 sequences whose caches hold 700…64k tokens
  (DECODE_MIX; capacity the longest), one query token, contiguous and 256-token pages: serving batches are
  never uniform.
- varlen (modes varlen, varlenbwd): 16 sequences of 256…4096 tokens, 16k in total, d128, hidden 2048.
- varlen-baseline (modes fwd, fwdbwd, in the varlen preset): dense, d128, hidden 2048, 16k tokens, S = 1k and
  4k. Varlen's TFLOP/s is compared with dense's at the mix's lengths, so the varlen preset
  times both in the same run: one commit, one machine state, no ratio across runs.
- dropout (mode fwdbwd, the dropout preset): dense, d64 and d128, S = 1k, 4k, 16k, causal and not, each at
  dropout_p 0 and 0.1 in the same run, so that dropout's cost is read on the same kernels.
- sinks (modes fwd, fwdbwd, the sinks preset): gpt-oss's attention, 64 query / 8 KV heads at d64 (hidden 4096;
  32 / 8 at d128), 16k tokens, S = 4k and 16k, causal, each with and without a learnable sink in the same run.
- mla (modes fwd, fwdbwd, the mla preset): DeepSeek's MLA prefill, head dim 192 with v head dim 128, 16 heads
  (2048 // 128), 16k tokens, S = 4k and 16k, causal and not; mla-baseline beside it in the same run: dense d128
  at the same heads, tokens and lengths, the shape the (192, 128) kernels are compared with.
- d512 (modes fwd, fwdbwd, the d512 preset): head dims 256 and 512 (hidden 2048: 8 and 4 heads), 16k tokens,
  S = 4k and 16k, causal and not.
- mla-decode (mode decode, the mla-decode preset): DeepSeek's absorbed MLA decode, 128 query heads (one GPU)
  or 16 (tensor-parallel over 8) on one 576-wide latent KV head whose first 512 channels are V (Case.absorbed),
  one query token, batch 16, 32 and 64 against caches of 4k…32k tokens, contiguous and 64-token pages; read as
  TB/s of the cache. At 128 heads each cache byte meets 242 FLOP, at 16 heads 30: only the latter can be
  bandwidth-bound on an H200 (docs/perf.md).
Without a GPU the same sweeps run at toy sizes through the Triton interpreter (the mla-decode and d512 twins keep
their real head dims, 576/512 and 512, at a few tokens and heads).

What this module does not do: allocate tensors (inputs.py) or count FLOPs (metrics.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

# Each mode's own sweep: where its shapes come from when a preset does not say otherwise.
MODE_SWEEPS = {
    "fwd": "dense", "fwdbwd": "dense", "decode": "decode", "varlen": "varlen", "varlenbwd": "varlen",
}
MODES = tuple(MODE_SWEEPS)
VARLEN_MODES = ("varlen", "varlenbwd")  # a packed ragged batch (flash_attn_varlen_func)
BACKWARD_MODES = ("fwdbwd", "varlenbwd")  # the timed region is forward + backward
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Each preset's runs, (mode, sweep), in the order the report lists them.
PRESETS = {
    "standard": (("fwd", "dense"), ("fwdbwd", "dense")),
    "decode": (("decode", "decode"), ("decode", "decode-mixed")),
    "varlen": (("varlen", "varlen"), ("fwd", "varlen-baseline"), ("varlenbwd", "varlen"),
               ("fwdbwd", "varlen-baseline")),
    "dropout": (("fwdbwd", "dropout"),),
    "sinks": (("fwd", "sinks"), ("fwdbwd", "sinks")),
    "mla": (("fwd", "mla"), ("fwd", "mla-baseline"), ("fwdbwd", "mla"), ("fwdbwd", "mla-baseline")),
    "d512": (("fwd", "d512"), ("fwdbwd", "d512")),
    "mla-decode": (("decode", "mla-decode"),),
    "all": tuple(MODE_SWEEPS.items()),
}

# A fixed mix, so runs compare: lengths off the tile grid, long and short interleaved (as a packed batch is).
VARLEN_MIX = (1024, 4096, 300, 2048, 512, 1500, 256, 777, 2200, 384, 640, 256, 1111, 333, 400, 547)
# Decode cache lengths of a mixed batch (186k tokens in all), long and short interleaved.
DECODE_MIX = (65536, 1024, 8192, 3000, 32768, 1500, 16384, 700, 4096, 12000, 2048, 900, 24576, 5000, 6144, 1800)


@dataclass(frozen=True)
class Case:
    """One attention problem in one mode. Layout (B, S, H, D), v (B, S, Hk, Dv); varlen packs its `seqlens` (q and
    k equal).

    An absorbed MLA cache (DeepSeek's decode) is not a field of its own but follows from the shape: a decode case
    with one KV head and a v head dim below q's (576 and 512) keeps one cache whose first headdim_v channels are
    V, so v_cache is a view of k_cache (one storage, read once; the bench's decode appends nothing, so there are
    no new k/v to share it). Such a case cannot ask for a separate V cache of that shape, which no model we time
    uses.
    """

    mode: str  # one of MODES; fwdbwd and varlenbwd time forward + backward, the others the forward only
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    headdim: int
    dtype: str = "bf16"
    causal: bool = False
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    page_size: int = 0  # decode: tokens per KV page; 0 = contiguous cache
    seqlens: tuple[int, ...] = ()  # varlen: per-sequence lengths
    cache_lengths: tuple[int, ...] = ()  # decode: tokens in each sequence's cache (seqlen_k is the capacity)
    dropout_p: float = 0.0  # fwd, fwdbwd and varlen modes; decode has none
    headdim_v: int = 0  # v's (and the output's) head dim; 0 = headdim
    sink: bool = False  # a learnable sink per query head (gpt-oss), fp32 values drawn from the inputs' seed

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {MODES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {tuple(DTYPES)}")
        if self.nheads % self.nheads_kv:
            raise ValueError(f"{self.nheads} query heads are not a multiple of {self.nheads_kv} KV heads")
        if self.headdim_v < 0:
            raise ValueError(f"headdim_v {self.headdim_v} is negative (0 means headdim)")

    @property
    def dv(self) -> int:
        """v's head dim."""
        return self.headdim_v or self.headdim

    @property
    def absorbed(self) -> bool:
        """An absorbed MLA decode cache: V is the first dv channels of the one KV head's K (see the class note)."""
        return self.mode == "decode" and self.nheads_kv == 1 and self.dv < self.headdim

    @property
    def varlen(self) -> bool:
        return self.mode in VARLEN_MODES

    @property
    def backward(self) -> bool:
        return self.mode in BACKWARD_MODES

    def label(self) -> str:
        if self.varlen:
            n = self.seqlens
            shape = f"{len(n)} seqs {min(n)}-{max(n)} ({sum(n)} tok)"
        elif self.mode == "decode" and self.cache_lengths:
            n = self.cache_lengths
            shape = f"b{self.batch} q{self.seqlen_q} kv{min(n)}-{max(n)} ({sum(n)} tok)"
        elif self.mode == "decode":
            shape = f"b{self.batch} q{self.seqlen_q} kv{self.seqlen_k}"
        else:
            kv = f"/{self.seqlen_k}" if self.seqlen_k != self.seqlen_q else ""
            shape = f"b{self.batch} s{self.seqlen_q}{kv}"
        heads = f"h{self.nheads}" + (f"/{self.nheads_kv}" if self.nheads_kv != self.nheads else "")
        dims = f"d{self.headdim}" + (f"/{self.dv}" if self.dv != self.headdim else "")
        parts = [shape, heads, dims, self.dtype]
        if self.causal:
            parts.append("causal")
        if self.window_size != (-1, -1):
            parts.append("window {},{}".format(*self.window_size))
        if self.softcap:
            parts.append(f"softcap {self.softcap:g}")
        if self.dropout_p:
            parts.append(f"dropout {self.dropout_p:g}")
        if self.sink:
            parts.append("sink")
        if self.absorbed:
            parts.append("absorbed")
        if self.mode == "decode":
            parts.append(f"page {self.page_size}" if self.page_size else "contiguous")
        return " ".join(parts)

    def fields(self) -> dict:
        """Flat, JSON-ready description for report rows."""
        d = dataclasses.asdict(self)
        d["window_left"], d["window_right"] = d.pop("window_size")
        d["seqlens"] = list(self.seqlens) or None
        d["cache_lengths"] = list(self.cache_lengths) or None
        d["absorbed"] = self.absorbed
        return d


@dataclass(frozen=True)
class Shapes:
    """A sweep: one case per point of the product of the axes. None means derived (see the module note)."""

    head_dim: tuple[int, ...]
    seqlen_q: tuple[int, ...] = (1,)
    seqlen_k: tuple[int, ...] | None = None  # None: seqlen_q
    batch: tuple[int, ...] | None = None  # None: tokens // seqlen (decode: tokens // seqlen_k, KV tokens)
    tokens: int = 16384
    heads: tuple[int, ...] | None = None  # None: hidden // head_dim
    hidden: int = 2048
    kv_heads: tuple[int, ...] | None = None  # None: heads
    causal: tuple[bool, ...] = (False, True)
    page_size: tuple[int, ...] = (0,)  # decode only
    seqlens: tuple[int, ...] = ()  # varlen only
    cache_lengths: tuple[int, ...] = ()  # decode only: one sequence per entry, replacing batch and seqlen_k
    dropout: tuple[float, ...] = (0.0,)
    head_dim_v: tuple[int, ...] = (0,)  # 0: head_dim
    sink: tuple[bool, ...] = (False,)


GPU_SHAPES = {
    "dense": Shapes(head_dim=(64, 128, 256), seqlen_q=(512, 1024, 2048, 4096, 8192, 16384)),
    "decode": Shapes(
        head_dim=(128,), seqlen_q=(1, 4), seqlen_k=(4096, 8192, 16384, 32768, 65536, 131072), tokens=262144,
        heads=(32,), kv_heads=(8,), causal=(True,), page_size=(0, 16, 64, 256),
    ),
    "decode-mixed": Shapes(head_dim=(128,), heads=(32,), kv_heads=(8,), causal=(True,), page_size=(0, 256),
                           cache_lengths=DECODE_MIX),
    "varlen": Shapes(head_dim=(128,), seqlens=VARLEN_MIX),
    "varlen-baseline": Shapes(head_dim=(128,), seqlen_q=(1024, 2048, 4096)),
    "dropout": Shapes(head_dim=(64, 128), seqlen_q=(1024, 4096, 16384), dropout=(0.0, 0.1)),
    "sinks": Shapes(head_dim=(64, 128), seqlen_q=(4096, 16384), hidden=4096, kv_heads=(8,), causal=(True,),
                    sink=(False, True)),
    "mla": Shapes(head_dim=(192,), head_dim_v=(128,), seqlen_q=(4096, 16384), heads=(16,)),
    "mla-baseline": Shapes(head_dim=(128,), seqlen_q=(4096, 16384)),
    "d512": Shapes(head_dim=(256, 512), seqlen_q=(4096, 16384)),
    "mla-decode": Shapes(head_dim=(576,), head_dim_v=(512,), seqlen_k=(4096, 8192, 16384, 32768), batch=(16, 32, 64),
                         heads=(16, 128), kv_heads=(1,), causal=(True,), page_size=(0, 64)),
}
# Interpreter sizes: each (query tile × key tile) step costs milliseconds on a CPU, so `flashtile bench` without a
# GPU runs one small case per mode and mask (about half a minute on two cores).
CPU_SHAPES = {
    "dense": Shapes(head_dim=(64,), seqlen_q=(64,), batch=(1,), heads=(2,)),
    "decode": Shapes(
        head_dim=(64,), seqlen_k=(256,), batch=(2,), heads=(4,), kv_heads=(2,), causal=(True,),
        page_size=(0, 16),
    ),
    "decode-mixed": Shapes(head_dim=(64,), heads=(4,), kv_heads=(2,), causal=(True,), page_size=(0, 16),
                           cache_lengths=(200, 7, 64)),
    "varlen": Shapes(head_dim=(64,), seqlens=(40, 17, 64), heads=(2,)),
    "varlen-baseline": Shapes(head_dim=(64,), seqlen_q=(64,), batch=(1,), heads=(2,)),
    "dropout": Shapes(head_dim=(64,), seqlen_q=(64,), batch=(1,), heads=(2,), causal=(True,), dropout=(0.0, 0.1)),
    # The model shapes' twins, a few seconds a preset: head dims 512 and 576/512 kept (tiles, and with them the
    # kernels, depend on them; a 512-wide tile row is as cheap to interpret as a narrow one), 192/128 shrunk to
    # 32/16, which keeps what is being timed, a v narrower than q.
    "sinks": Shapes(head_dim=(64,), seqlen_q=(32,), batch=(1,), heads=(2,), kv_heads=(1,), causal=(True,),
                    sink=(False, True)),
    "mla": Shapes(head_dim=(32,), head_dim_v=(16,), seqlen_q=(32,), batch=(1,), heads=(2,)),
    "mla-baseline": Shapes(head_dim=(16,), seqlen_q=(32,), batch=(1,), heads=(2,)),
    "d512": Shapes(head_dim=(256, 512), seqlen_q=(16,), batch=(1,), heads=(1,)),
    "mla-decode": Shapes(head_dim=(576,), head_dim_v=(512,), seqlen_k=(40,), batch=(2,), heads=(8,), kv_heads=(1,),
                         causal=(True,), page_size=(0, 16)),
}


def preset_runs(preset: str, modes=None) -> list[tuple[str, str]]:
    """The (mode, sweep) runs of `preset`, or of `modes` in its place.

    A mode the preset runs keeps the preset's sweeps, all of them (`--preset varlen --mode fwd` is the varlen
    baseline, not the papers' sweep; `--preset mla --mode fwd` is MLA's forward and its d128 baseline); any other
    runs over its own, MODE_SWEEPS.
    """
    runs = PRESETS[preset]
    if modes is None:
        return list(runs)
    if bad := [m for m in modes if m not in MODES]:
        raise ValueError(f"unknown mode {', '.join(bad)}; choose from {', '.join(MODES)}")
    return [run for m in modes for run in [r for r in runs if r[0] == m] or [(m, MODE_SWEEPS[m])]]


def build_cases(runs, shapes: dict[str, Shapes], dtype: str, window_size=(-1, -1),
                softcap=0.0, dropout_p=None) -> list[Case]:
    """Every case of `runs`, (mode, sweep) pairs, in order: run, head dim, causal, (query length, page size),
    the rest, sink last (so a case with a sink follows the same case without). `dropout_p` replaces the sweeps'
    dropout axis.
    """
    cases = []
    for mode, sweep in runs:
        s = shapes[sweep]
        seqlens = s.seqlens if mode in VARLEN_MODES else ()
        lengths = s.cache_lengths if mode == "decode" else ()
        seqlen_q = (max(seqlens),) if seqlens else s.seqlen_q
        pages = s.page_size if mode == "decode" else (0,)
        axes = itertools.product(
            s.head_dim, s.head_dim_v, s.causal, seqlen_q, pages, s.seqlen_k or (None,), s.batch or (None,),
            s.heads or (None,), s.kv_heads or (None,), s.dropout, s.sink,
        )
        for d, dv, causal, sq, page, sk, b, h, hk, p, sink in axes:
            sk = sq if seqlens or sk is None else sk
            sk = max(lengths) if lengths else sk
            h = h or max(1, s.hidden // d)
            b = len(seqlens or lengths) or b or max(1, s.tokens // (sk if mode == "decode" else sq))
            cases.append(Case(mode, b, sq, sk, h, hk or h, d, dtype, causal, tuple(window_size), softcap,
                              page, seqlens, lengths,
                              0.0 if mode == "decode" else dropout_p if dropout_p is not None else p,
                              headdim_v=0 if dv == d else dv, sink=sink))
    return cases
