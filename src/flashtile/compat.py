"""Run code written for flash-attn on flashtile without editing it: `flashtile.compat.install()`.

After `install()`, these imports resolve to flashtile (entries in sys.modules, made here):

    flash_attn                        flash_attn_func, the packed and varlen variants, flash_attn_with_kvcache
    flash_attn.flash_attn_interface   the same functions (where flash-attn 2 defines them)
    flash_attn.bert_padding           flashtile.bert_padding (unpad_input, pad_input, index_first_axis, ...)
    flash_attn.layers.rotary          apply_rotary_emb (flashtile.rotary: plain PyTorch, flash-attn's semantics)
    flash_attn.cute                   FlashAttention-4's flash_attn_func / flash_attn_varlen_func, returning
                                      (out, lse), with window_size entries None for unbounded

Opt-in and process-wide: nothing is installed by importing flashtile, and `uninstall()` removes the entries again.
`install()` refuses when a real flash_attn is already imported (its objects may be held elsewhere, and mixing the
two would be confusing); an installed but not yet imported flash-attn is shadowed.

What this module does not do: make flash-attn's distribution metadata appear (libraries that check
`importlib.metadata.version("flash-attn")`, such as transformers' flash_attention_2 loader, still see none: use
flashtile.integrations.transformers there), or provide flash-attn's other modules (layers.rotary's RotaryEmbedding,
ops, losses, models). FlashAttention-4 arguments that flashtile has no counterpart for (mask_mod, score_mod, block
sparsity, aux tensors) raise NotImplementedError naming the argument; learnable_sink is flashtile's; its performance
hints (num_splits, pack_gqa, deterministic) are accepted and ignored: flashtile's backward is always deterministic.
"""

from __future__ import annotations

import sys
import types

from . import bert_padding, interface, kvcache, rotary

__all__ = ["install", "uninstall", "installed", "cute_flash_attn_func", "cute_flash_attn_varlen_func"]

FLASH_ATTN_VERSION = "2.8.3"  # the flash-attn API flashtile's signatures follow
_INTERFACE = ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
              "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func")
_MARK = "__flashtile_compat__"


def _refuse_fa4(**given) -> None:
    for name, value in given.items():
        if value is not None:
            raise NotImplementedError(f"{name} (a FlashAttention-4 feature) is not supported by flashtile")


def _window(window_size) -> tuple[int, int]:
    """FA4's (left, right) with None for unbounded, in flash-attn 2's convention (-1). As FA4, a pair whose sum is
    negative means no window."""
    left, right = (-1 if w is None else int(w) for w in window_size)
    if window_size[0] is not None and window_size[1] is not None and left + right < 0:
        return -1, -1
    return left, right


def cute_flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None,
                         softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, mask_mod=None,
                         full_block_cnt=None, full_block_idx=None, mask_block_cnt=None, mask_block_idx=None,
                         block_size=None, return_lse=False):
    """FlashAttention-4's `flash_attn.cute.flash_attn_func`: q (B, Sq, H, D), k/v (B, Sk, Hk, D); returns
    (out, lse) with lse (B, H, Sq) fp32 (computed whether or not return_lse asks for it; it takes no gradient)."""
    _refuse_fa4(mask_mod=mask_mod, full_block_cnt=full_block_cnt, full_block_idx=full_block_idx,
                mask_block_cnt=mask_block_cnt, mask_block_idx=mask_block_idx, block_size=block_size)
    out, lse, _ = interface.flash_attn_func(q, k, v, 0.0, softmax_scale, causal, _window(window_size), softcap or 0.0,
                                            return_attn_probs=True, learnable_sink=learnable_sink)
    return out, lse


def cute_flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                                seqused_q=None, seqused_k=None, page_table=None, softmax_scale=None, causal=False,
                                window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1,
                                pack_gqa=None, deterministic=False, score_mod=None, mask_mod=None,
                                block_sparse_tensors=None, cu_total_m_blocks=None, cu_total_n_blocks=None,
                                aux_tensors=None, return_lse=False):
    """FlashAttention-4's `flash_attn.cute.flash_attn_varlen_func`, returning (out, lse).

    Packed q, k, v with cu_seqlens_q/k (max_seqlen optional: flashtile needs none), seqused_q/k as FA4. A paged
    KV cache (page_table, the key counts in seqused_k, no cu_seqlens_k) with a dense q (B, Sq, H, D) runs
    flash_attn_with_kvcache, bottom-right aligned, forward only."""
    _refuse_fa4(score_mod=score_mod, mask_mod=mask_mod, block_sparse_tensors=block_sparse_tensors,
                cu_total_m_blocks=cu_total_m_blocks, cu_total_n_blocks=cu_total_n_blocks, aux_tensors=aux_tensors)
    window = _window(window_size)
    if page_table is not None:
        if cu_seqlens_q is not None or cu_seqlens_k is not None or seqused_q is not None:
            raise NotImplementedError("page_table with cu_seqlens_q/cu_seqlens_k/seqused_q: flashtile takes a paged "
                                      "cache with a dense (batch, seqlen_q, nheads, headdim) q and seqused_k")
        return kvcache.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqused_k, block_table=page_table,
                                               softmax_scale=softmax_scale, causal=causal, window_size=window,
                                               softcap=softcap or 0.0, return_softmax_lse=True,
                                               learnable_sink=learnable_sink)
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("cu_seqlens_q and cu_seqlens_k are required without page_table")
    # flashtile checks max_seqlen against the lengths where that is free (CPU tensors, FLASHTILE_CHECK=1) but sizes
    # nothing with it; FA4 makes it optional, so the packed totals stand in, an upper bound of every length.
    max_q = q.shape[0] if max_seqlen_q is None else max_seqlen_q
    max_k = k.shape[0] if max_seqlen_k is None else max_seqlen_k
    out, lse, _ = interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, 0.0,
                                                   softmax_scale, causal, window, softcap or 0.0,
                                                   return_attn_probs=True, seqused_q=seqused_q, seqused_k=seqused_k,
                                                   learnable_sink=learnable_sink)
    return out, lse


def _module(name: str, doc: str, package: bool = False, **attributes) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    if package:
        module.__path__ = []  # a package: its submodules are the sys.modules entries below
    module.__dict__.update(attributes)
    setattr(module, _MARK, True)
    return module


def _modules() -> dict[str, types.ModuleType]:
    api = {name: getattr(interface, name) for name in _INTERFACE} | {
        "flash_attn_with_kvcache": kvcache.flash_attn_with_kvcache}
    shim = "flashtile.compat's stand-in for flash-attn"
    rotary_module = _module("flash_attn.layers.rotary", shim, apply_rotary_emb=rotary.apply_rotary_emb)
    layers = _module("flash_attn.layers", shim, package=True, rotary=rotary_module)
    interface_module = _module("flash_attn.flash_attn_interface", shim, **api)
    cute = _module("flash_attn.cute", shim, flash_attn_func=cute_flash_attn_func,
                   flash_attn_varlen_func=cute_flash_attn_varlen_func)
    root = _module("flash_attn", shim, package=True, __version__=FLASH_ATTN_VERSION,
                   flash_attn_interface=interface_module, bert_padding=bert_padding, layers=layers, cute=cute, **api)
    return {"flash_attn": root, "flash_attn.flash_attn_interface": interface_module,
            "flash_attn.bert_padding": bert_padding, "flash_attn.layers": layers,
            "flash_attn.layers.rotary": rotary_module, "flash_attn.cute": cute}


def installed() -> bool:
    """Whether `import flash_attn` gives flashtile's stand-in."""
    return getattr(sys.modules.get("flash_attn"), _MARK, False)


def install() -> None:
    """Make `import flash_attn` (and the submodules listed in the module docstring) resolve to flashtile."""
    if installed():
        return
    present = [name for name in sys.modules if name == "flash_attn" or name.startswith("flash_attn.")]
    if present:
        raise RuntimeError(f"flash-attn is already imported ({', '.join(sorted(present))}); call "
                           "flashtile.compat.install() before anything imports flash_attn")
    sys.modules.update(_modules())


def uninstall() -> None:
    """Remove what `install()` put into sys.modules."""
    if not installed():
        return
    for name in list(sys.modules):
        if name == "flash_attn" or name.startswith("flash_attn."):
            del sys.modules[name]
