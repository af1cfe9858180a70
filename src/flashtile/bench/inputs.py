"""Input tensors for one case, shared by every backend so they all see the same numbers.

Random normal values, never zeros: zero operands make every softmax row uniform, which hides masking and
scaling errors from --refcheck, and draw less power, which flatters the clock. In flashtile's layout; each
backend converts to its own layout in its setup, outside the timed region. Decode gets several copies of its
KV cache, enough that together they exceed the L2 cache several times over, and the timed call rotates through
them: no repetition can read a cache the one before left in L2. (timing.py's do_bench also clears L2 between
repetitions; the rotation keeps decode honest under a timer that replays calls back to back, like CUDA
graphs.)

v (and dout) have v's head dim, which may differ from q's (MLA). An absorbed MLA decode case (Case.absorbed) gets
one cache per copy, v a view of its first channels, as DeepSeek's kernels read it; paging keeps the view. A case
with a sink gets fp32 sink logits, drawn after everything else, so the same case with and without a sink sees the
same q, k and v.

What this module does not do: choose shapes (cases.py) or time anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashtile.bench.cases import DTYPES, Case
from flashtile.bench.metrics import kv_bytes
from flashtile.ops.decode import is_prefix_view

L2_MULTIPLE = 4  # decode KV copies together span this many L2 caches
MAX_KV_COPIES = 16
DEFAULT_L2_BYTES = 60 * 2**20  # the H100/H200 L2, for devices that do not report theirs


@dataclass
class Inputs:
    q: torch.Tensor  # (B, Sq, H, D); varlen: (total, H, D)
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # (k, v): (B, Sk, Hk, D or Dv) or (total, Hk, ...); decode: copies
    dout: torch.Tensor | None = None  # like the output (q with Dv); fwdbwd and varlenbwd only
    cu_seqlens: torch.Tensor | None = None  # varlen: (n + 1,) int32, for q and k alike
    cache_seqlens: torch.Tensor | None = None  # decode: (B,) int32
    sink: torch.Tensor | None = None  # (H,) fp32 learnable sink logits, when the case has them

    @property
    def k(self) -> torch.Tensor:
        return self.kv[0][0]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[0][1]


def kv_copies(case: Case, device: torch.device) -> int:
    """How many KV caches decode rotates through; 1 for other modes and off the GPU."""
    if case.mode != "decode" or device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or DEFAULT_L2_BYTES
    return max(1, min(MAX_KV_COPIES, math.ceil(L2_MULTIPLE * l2 / kv_bytes(case))))


def make_inputs(case: Case, device: torch.device, seed: int = 0) -> Inputs:
    gen = torch.Generator(device).manual_seed(seed)
    dtype = DTYPES[case.dtype]

    def randn(*shape, dtype=dtype):
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    def sink():  # drawn last: the same case without a sink sees the same q, k, v and dout
        return randn(case.nheads, dtype=torch.float32) if case.sink else None

    h, hk, d, dv = case.nheads, case.nheads_kv, case.headdim, case.dv
    if case.varlen:
        total = sum(case.seqlens)
        offsets = [0, *torch.tensor(case.seqlens).cumsum(0).tolist()]
        cu = torch.tensor(offsets, dtype=torch.int32, device=device)
        q = randn(total, h, d)
        kv = [(randn(total, hk, d), randn(total, hk, dv))]
        dout = randn(total, h, dv) if case.backward else None
        return Inputs(q, kv, dout, cu_seqlens=cu, sink=sink())
    q = randn(case.batch, case.seqlen_q, h, d)
    kv_shape = (case.batch, case.seqlen_k, hk)
    if case.absorbed:
        kv = [(k, k[..., :dv]) for k in (randn(*kv_shape, d) for _ in range(kv_copies(case, device)))]
    else:
        kv = [(randn(*kv_shape, d), randn(*kv_shape, dv)) for _ in range(kv_copies(case, device))]
    for b, n in enumerate(case.cache_lengths):  # mixed decode: a read past a cache's length shows as NaN
        for k, v in kv:
            k[b, n:] = float("nan")
            v[b, n:] = float("nan")
    dout = randn(case.batch, case.seqlen_q, h, dv) if case.backward else None
    cache_seqlens = None
    if case.mode == "decode":
        lengths = case.cache_lengths or (case.seqlen_k,) * case.batch
        cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return Inputs(q, kv, dout, cache_seqlens=cache_seqlens, sink=sink())


def paginate(k: torch.Tensor, v: torch.Tensor, page_size: int, seed: int = 0):
    """A contiguous cache (B, L, Hk, D) as pages (num_pages, page_size, Hk, D) and a block table (B, L/page).

    v has its own head dim. Pages are placed in a random order, so logically adjacent pages are not physically
    adjacent (as in a serving cache). The tail of a partly filled last page is NaN: a kernel that reads past
    cache_seqlens fails --refcheck. A v that is a view of k's first channels (an absorbed MLA cache) stays one:
    its pages are the same view of k's pages.
    """
    b, seqlen, hk, _ = k.shape
    per_seq = math.ceil(seqlen / page_size)
    perm = torch.randperm(b * per_seq, generator=torch.Generator().manual_seed(seed)).to(k.device)
    block_table = perm.view(b, per_seq).to(torch.int32)

    def to_pages(x):
        d = x.shape[-1]
        padded = x.new_full((b, per_seq * page_size, hk, d), float("nan"))
        padded[:, :seqlen] = x
        pages = torch.empty_like(padded).view(b * per_seq, page_size, hk, d)
        pages[perm] = padded.view(b * per_seq, page_size, hk, d)
        return pages

    k_pages = to_pages(k)
    v_pages = k_pages[..., :v.shape[-1]] if is_prefix_view(v, k) else to_pages(v)
    return k_pages, v_pages, block_table
