"""flashtile as an implementation of PyTorch's flash attention, through `torch.nn.attention`'s registry.

PyTorch keeps a registry of flash-attention implementations (`torch.nn.attention.register_flash_attention_impl`,
`activate_flash_attention_impl`, `list_flash_attention_impls`, `current_flash_attention_impl`,
`restore_flash_attention_impl`; FlashAttention-3 and -4 register there). An implementation registers a function;
activating it calls that function, which overrides the CUDA kernels of the aten flash-attention ops:

    _scaled_dot_product_flash_attention(_backward)   what F.scaled_dot_product_attention runs when it picks its
                                                      flash backend: (B, H, S, D), causal aligned bottom-right
    _flash_attention_forward / _backward              the (B, S, H, D) and varlen (total, H, D) ops beneath them,
    _flash_attention_forward_no_dropout_inplace       which torch.nn.attention.varlen calls

`register()` registers flashtile under the name "flashtile" and nothing more: activation stays the user's choice,
as PyTorch asks of providers, and `restore_flash_attention_impl()` puts PyTorch's own kernels back. Each
override takes the op's schema and returns what the op promises: output, log-sum-exp ((B, H, Sq) dense, (H, total)
varlen, fp32), and placeholder RNG state: dropout_p > 0 is refused here, since the state the ops would carry to
their backward is not yet flashtile's (its seed: ops/dropout.py); flashtile.flash_attn_func takes dropout.
The backward overrides recompute nothing: they run flashtile's backward kernels from the saved output and LSE.

What this module does not do: choose between SDPA's backends (PyTorch's router still decides when the flash
backend runs, e.g. fp16/bf16 CUDA tensors without an arbitrary mask), or support what the ops' backward cannot be
told about: ALiBi slopes are refused, and seqused_k / block_table only in a forward that no gradient can reach
(checked in eager mode; a compiled graph's forward cannot see it, so do not differentiate through them).
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.library import Library

from ..interface import flash_attn_func, flash_attn_varlen_func
from ..ops.bwd import attention_bwd
from ..ops.common import PACK_NONE, call
from ..problem import normalize_window, pad_head_dim

__all__ = ["NAME", "register", "register_kernels"]

NAME = "flashtile"


def register() -> str:
    """Register flashtile with PyTorch's flash-attention registry, under NAME ("flashtile"), and return the name.
    Then `torch.nn.attention.activate_flash_attention_impl("flashtile")` makes the aten flash ops (and so SDPA's
    flash backend) run flashtile, and `torch.nn.attention.restore_flash_attention_impl()` undoes it."""
    attention = torch.nn.attention
    if not hasattr(attention, "register_flash_attention_impl"):
        raise RuntimeError(f"torch {torch.__version__} has no flash-attention registry "
                           "(torch.nn.attention.register_flash_attention_impl); call flashtile's functions directly")
    attention.register_flash_attention_impl(NAME, register_fn=_activate)
    return NAME


@dataclass
class _Handle:
    """What activation returns: the registry keeps it, and `remove()` (restore_flash_attention_impl) drops the
    Library, whose finaliser takes the overrides out of the dispatcher."""
    library: Optional[Library]

    def remove(self) -> None:
        # Library._destroy deregisters at once; without it (not public API) dropping the last reference does.
        destroy = getattr(self.library, "_destroy", None)
        if destroy is not None:
            destroy()
        self.library = None


def _activate() -> _Handle:
    return _Handle(register_kernels("CUDA"))


def register_kernels(dispatch_key: str = "CUDA") -> Library:
    """Override the aten flash ops this torch has for `dispatch_key` with flashtile's; the overrides last as long
    as the returned Library. "CUDA" is what activation uses; the CPU tier of the tests registers "CPU" (where
    these ops have no kernel of their own) to run them through the dispatcher and autograd without a GPU."""
    lib = Library("aten", "IMPL", dispatch_key)
    for name, impl in _IMPLS.items():
        if _has_op(name):
            lib.impl(name, impl, dispatch_key)
    return lib


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _refuse(what: str) -> None:
    raise RuntimeError(f"flashtile's flash attention for PyTorch: {what}")


def _check_extra(extra: dict) -> None:
    """Keyword arguments a newer torch's schema may add: accepted while they ask for nothing."""
    given = [name for name, value in extra.items() if value is not None]
    if given:
        _refuse(f"unsupported argument(s) {', '.join(given)}")


def _aux(query: torch.Tensor):
    """The RNG state, offset and debug mask the ops return: placeholders, since nothing is random."""
    return (torch.zeros(2, dtype=torch.uint64, device=query.device),
            torch.zeros((), dtype=torch.uint64, device=query.device),
            torch.empty(0, dtype=query.dtype, device=query.device))


def _forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
             scale, window_size_left, window_size_right, seqused_k=None, alibi_slopes=None, block_table=None):
    """(out, lse) for the flash ops' arguments: dense (B, S, H, D) or, with cum_seq_q, varlen (total, H, D)."""
    if return_debug_mask:
        _refuse("return_debug_mask=True (there is no attention-probability matrix to return)")
    if dropout_p:
        _refuse("dropout_p > 0 (the ops' RNG state is not carried to flashtile's backward yet; "
                "flashtile.flash_attn_func takes dropout_p)")
    if alibi_slopes is not None:
        _refuse("alibi_slopes: the ops' backward has no slopes argument, so gradients would ignore them")
    if (seqused_k is not None or block_table is not None) and torch.is_grad_enabled() and any(
            t.requires_grad for t in (query, key, value)):
        _refuse("seqused_k / block_table with inputs that require grad: the ops' backward cannot be given them")
    window = (-1 if window_size_left is None else int(window_size_left),
              -1 if window_size_right is None else int(window_size_right))
    with torch.no_grad():  # the op's own derivative runs the backward
        if cum_seq_q is None:
            out, lse, _ = flash_attn_func(query, key, value, dropout_p, scale, is_causal, window,
                                          return_attn_probs=True)
        else:
            out, lse, _ = flash_attn_varlen_func(query, key, value, cum_seq_q, cum_seq_k, int(max_q), int(max_k),
                                                 dropout_p, scale, is_causal, window, return_attn_probs=True,
                                                 block_table=block_table, seqused_k=seqused_k)
    return out, lse


@functools.cache
def _parameters(op) -> tuple[str, ...]:
    return tuple(inspect.signature(op.impl).parameters)


def _backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
              is_causal, scale, window_size_left, window_size_right):
    """(dq, dk, dv) of the flash ops' backward: flashtile's backward kernels from the forward's out and LSE."""
    if dropout_p:
        _refuse("dropout_p > 0 (the forward refuses it too)")
    head_dim = query.shape[-1]
    left, right = normalize_window(is_causal, (window_size_left, window_size_right))
    # The kernels take head dims padded to a multiple of 8 (interface.py does the same with F.pad): zero columns
    # change no score, and their gradients are cut off again below.
    width = pad_head_dim(head_dim)
    dout, q, k, v, o = (t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))
                        for t in (grad_out, query, key, value, out))
    named = dict(dout=dout, q=q, k=k, v=v, out=o, lse=logsumexp, cu_seqlens_q=cum_seq_q, cu_seqlens_k=cum_seq_k,
                 seqused_q=None, seqused_k=None, alibi_slopes=None, learnable_sink=None, rng=None,
                 max_seqlen_q=int(max_q), max_seqlen_k=int(max_k),
                 softmax_scale=1.0 / math.sqrt(head_dim) if scale is None else float(scale), window_left=left,
                 window_right=right, attention_chunk=0, softcap=0.0, dropout_p=0.0, packing=PACK_NONE)
    names = _parameters(attention_bwd)
    if missing := [n for n in names if n not in named]:
        raise TypeError(f"flashtile::bwd takes {missing}, which flashtile/integrations/sdpa.py does not pass")
    dq, dk, dv = call(attention_bwd, *(named[n] for n in names))
    return tuple(g if g.shape[-1] == head_dim else g[..., :head_dim] for g in (dq, dk, dv))


def _laid_out_like(out: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """out with the strides of torch.empty_like(query), which is what the ops' meta functions promise (and what
    torch.compile's graphs then assume). flashtile writes (B, S, H, D) or (total, H, D) buffers: the same strides
    when query is a view of such a buffer, as a model's projections make it; otherwise one copy."""
    if out.stride() == torch.empty_like(query, device="meta").stride():
        return out
    return torch.empty_like(query).copy_(out)


def _bhsd(*tensors):
    """(B, H, S, D) <-> (B, S, H, D) views."""
    return tuple(t.transpose(1, 2) for t in tensors)


def _sdpa_flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None,
                        **extra):
    _check_extra(extra)
    q, k, v = _bhsd(query, key, value)
    out, lse = _forward(q, k, v, None, None, q.shape[1], k.shape[1], dropout_p, is_causal, return_debug_mask, scale,
                        None, None)
    (out,) = _bhsd(out)
    return (_laid_out_like(out, query), lse, None, None, query.shape[2], key.shape[2], *_aux(query))


def _sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                         is_causal, philox_seed, philox_offset, *, scale=None, **extra):
    _check_extra(extra)
    grads = _backward(*_bhsd(grad_out, query, key, value, out), logsumexp, None, None, query.shape[2],
                      key.shape[2], dropout_p, is_causal, scale, None, None)
    return _bhsd(*grads)


def _flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                   *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
                   block_table=None, num_splits=None, **extra):
    # num_splits is a split-KV hint for decode; flashtile's varlen forward does not split and ignores it.
    _check_extra(extra)
    out, lse = _forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                        return_debug_mask, scale, window_size_left, window_size_right, seqused_k, alibi_slopes,
                        block_table)
    return (_laid_out_like(out, query), lse, *_aux(query))


def _flash_forward_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                           return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                           seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None, **extra):
    _check_extra(extra)
    if dropout_p:
        _refuse("the no-dropout op was called with dropout_p > 0")
    result, lse = _forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                           return_debug_mask, scale, window_size_left, window_size_right, seqused_k, alibi_slopes,
                           block_table)
    out.copy_(result)  # the kernels write fresh buffers; one copy into the caller's
    return lse


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                    is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None,
                    **extra):
    _check_extra(extra)
    return _backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                     is_causal, scale, window_size_left, window_size_right)


_IMPLS = {
    "_scaled_dot_product_flash_attention": _sdpa_flash_forward,
    "_scaled_dot_product_flash_attention_backward": _sdpa_flash_backward,
    "_flash_attention_forward": _flash_forward,
    "_flash_attention_forward_no_dropout_inplace": _flash_forward_inplace,
    "_flash_attention_backward": _flash_backward,
}
