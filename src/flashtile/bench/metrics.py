"""FLOP and byte counts for attention problems, by the FlashAttention papers' conventions.

Forward FLOPs are 2·(D + Dv) per visible (query, key) pair and query head: QKᵀ (over D) and PV (over Dv, v's head
dim) are two matmuls of 2 FLOPs per multiply-add, so an unmasked problem is 2·B·H·Sq·Sk·(D + Dv), the papers'
4·B·H·Sq·Sk·D when Dv = D. Masked pairs are not counted. Causal and sliding-window
problems count exactly the pairs their mask keeps, bottom-right aligned as in flash-attn (query i sees key j
iff i + Sk − Sq − left ≤ j ≤ i + Sk − Sq + right); for a square causal problem that is S(S+1)/2 pairs, 1/S
more than the papers' S²/2 (0.2% at S = 512). A varlen batch counts each sequence's own pairs: no work is done
across sequences, so none is counted. Backward is 2.5× forward (five matmuls against forward's two), so
forward+backward (fwdbwd, varlenbwd) is 3.5×. Softmax, masking and softcap work is not counted, by the same
convention. GQA does not change the count: every query head does its own matmuls.

Decode is bound by memory, so it is measured in bytes: the K and V a kernel must read, Σ_b seqlen_k · Hk · (D +
Dv) · element size. An absorbed MLA cache (Case.absorbed: V is the first Dv channels of K's one storage) is read
once, Σ_b seqlen_k · D · element size: counting a V beside it would credit a kernel with bytes no kernel needs
to read. Q, the output and page tables are small next to them and not counted.

What this module does not do: time anything or know about backends.
"""

from __future__ import annotations

import torch

from flashtile.bench.cases import DTYPES, Case

BWD_FLOPS_FACTOR = 2.5


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size=(-1, -1)) -> int:
    """Number of (query, key) pairs the mask keeps, for one sequence and one head."""
    left, right = window_size
    if causal:
        right = 0
    diag = torch.arange(seqlen_q, dtype=torch.int64) + (seqlen_k - seqlen_q)  # key aligned with each query
    lo = (diag - left).clamp(min=0) if left >= 0 else torch.zeros_like(diag)
    hi = (diag + right).clamp(max=seqlen_k - 1) if right >= 0 else torch.full_like(diag, seqlen_k - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


def forward_flops(case: Case) -> int:
    """FLOPs of one forward pass; varlen sums over its sequences."""
    if case.seqlens:
        pairs = sum(visible_pairs(n, n, case.causal, case.window_size) for n in case.seqlens)
    elif case.cache_lengths:
        pairs = sum(visible_pairs(case.seqlen_q, n, case.causal, case.window_size) for n in case.cache_lengths)
    else:
        pairs = case.batch * visible_pairs(case.seqlen_q, case.seqlen_k, case.causal, case.window_size)
    return 2 * case.nheads * (case.headdim + case.dv) * pairs


def timed_flops(case: Case) -> float:
    """FLOPs of the timed region: the forward, plus the backward in fwdbwd and varlenbwd modes."""
    return forward_flops(case) * (1 + BWD_FLOPS_FACTOR if case.backward else 1)


def kv_bytes(case: Case) -> int:
    """Bytes of K and V a forward pass must read; the decode bandwidth numerator."""
    kv_tokens = sum(case.seqlens or case.cache_lengths) or case.batch * case.seqlen_k
    channels = case.headdim if case.absorbed else case.headdim + case.dv
    return kv_tokens * case.nheads_kv * channels * DTYPES[case.dtype].itemsize
