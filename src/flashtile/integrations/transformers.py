"""flashtile as an attention implementation of Hugging Face transformers (5.x) models.

    from flashtile.integrations import transformers as ft_transformers
    name = ft_transformers.register()           # "tile_attention"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=name)

`register()` puts two functions into transformers' global registries, under one name:

- `attention_forward` in `AttentionInterface`: what each attention layer calls with its (B, H, S, D) query and
  (B, Hk, S_kv, D) key/value (the whole cache during generation), the mask below, dropout, scaling,
  sliding_window and softcap. It runs flashtile's dense kernels when nothing is padded, and its varlen kernels on
  the unpadded tokens otherwise (left or right padding alike), with GQA, sliding windows and softcap as the layer
  asks. Masks are bottom-right aligned, as in FlashAttention: new query tokens sit at the end of the cache.
- `padding_mask` in `AttentionMaskInterface`: what the model builds once per forward in place of SDPA's 4-D
  mask: the 2-D (batch, kv_length) padding mask, or None when nothing is padded (one device-to-host check per
  forward). Without a mask function registered under the same name, transformers would build no mask at all for
  an unknown implementation, and padding would be silently attended to.

The name avoids "flash": transformers sends any implementation name containing it to its own FlashAttention
loader.

Packed batches without padding (one row of several documents, as DataCollatorWithFlattening makes) run varlen
from the `cu_seq_lens_q/k` keyword arguments when the collator provides them, or from `position_ids` restarting
at each document (a device-to-host check per layer, as in transformers' FlashAttention path).

What this module does not do: masks beyond causal + sliding window + padding. A prepared 4-D mask, or a model
that adds its own mask pattern (or_mask_function / and_mask_function, e.g. bidirectional image tokens), raises
NotImplementedError instead of being ignored; so do position biases. Attention sinks (gpt-oss's `s_aux`) run as
flashtile's learnable_sink, their gradient included. With padding
holes inside a sequence (not only at its ends), windows count unpadded tokens, as in FlashAttention. It imports
transformers only in `register()`.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..bert_padding import index_first_axis, pad_input, unpad_input
from ..interface import flash_attn_func, flash_attn_varlen_func

__all__ = ["NAME", "attention_forward", "padding_mask", "register"]

NAME = "tile_attention"


def register(name: str = NAME) -> str:
    """Register flashtile's attention and mask functions with transformers under `name` and return it, the value
    to pass as `attn_implementation` (from_pretrained, from_config, or model.set_attn_implementation)."""
    if "flash" in name:
        raise ValueError(f"name {name!r} contains 'flash': transformers would route it to its own FlashAttention "
                         "loader")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function=None, attention_mask: Optional[torch.Tensor] = None, use_vmap: bool = False,
                   **kwargs) -> Optional[torch.Tensor]:
    """transformers' mask interface: the (batch, kv_length) bool padding mask the layers get, or None when no
    token is padded. `use_vmap` is what create_causal_mask sets when a model adds its own mask pattern to the
    causal one, which flashtile cannot express (yet), so it raises."""
    if use_vmap:
        raise NotImplementedError("flashtile's transformers attention: this model adds its own mask pattern "
                                  "(or_mask_function / and_mask_function) to the causal mask, which flashtile does "
                                  "not express yet; use attn_implementation='sdpa' for it")
    if attention_mask is None:
        return None
    # The cache's layer decides kv_length (a sliding-window layer keeps only the window): its keys are the last
    # kv_length positions of the mask. A static cache is longer than the mask; the layer cuts its keys to it.
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[-1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def _refuse(**features) -> None:
    for name, value in features.items():
        if value is not None and value is not False:
            raise NotImplementedError(f"flashtile's transformers attention does not support {name} yet; use "
                                      "attn_implementation='sdpa' for this model")


def _packed_from_position_ids(position_ids: Optional[torch.Tensor], batch: int, seqlen: int):
    """cu_seqlens of a batch of one row holding several documents whose position ids restart (at their minimum)
    at each, or None: a device-to-host check, as transformers' FlashAttention path does."""
    if position_ids is None or batch != 1 or seqlen == 1 or position_ids.shape[-1] != seqlen:
        return None
    ids = position_ids.reshape(-1)
    starts = (ids == ids.min()).nonzero().flatten()
    if starts.numel() <= 1:
        return None
    return torch.cat([starts, starts.new_tensor([seqlen])]).to(torch.int32)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface. query (B, H, Sq, D), key/value (B, Hk, Skv, D), attention_mask from
    `padding_mask` above; returns ((B, Sq, H, Dv), None): no attention weights are materialised."""
    _refuse(position_bias=kwargs.get("position_bias"))
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(f"flashtile's transformers attention takes the 2-D padding mask its mask function "
                                  f"makes, got a {attention_mask.dim()}-D mask (a custom or prepared mask); use "
                                  "attn_implementation='sdpa' for it")
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    batch, seqlen_q = query.shape[0], query.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D) views
    # transformers counts a sliding window in tokens including the query's own; flash-attn's left bound excludes
    # it. A non-causal layer's window is symmetric (causal sets the right bound to 0).
    window = (sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1)
    kw = dict(dropout_p=dropout, softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap or 0.0,
              learnable_sink=kwargs.get("s_aux"))
    if attention_mask is not None:
        out = _padded(q, k, v, attention_mask, kw)
    elif (cu_q := kwargs.get("cu_seq_lens_q")) is not None and kwargs.get("cu_seq_lens_k") is not None:
        out = _packed(q, k, v, cu_q.to(torch.int32), kwargs["cu_seq_lens_k"].to(torch.int32), kw)
    elif key.shape[2] == seqlen_q and (
            cu := _packed_from_position_ids(kwargs.get("position_ids"), batch, seqlen_q)) is not None:
        out = _packed(q, k, v, cu, cu, kw)
    else:
        out = flash_attn_func(q, k, v, **kw)
    return out, None


def _padded(q, k, v, mask: torch.Tensor, kw: dict) -> torch.Tensor:
    """A padded batch through the varlen kernels: the valid keys of each row, its valid queries (the last Sq
    positions of the mask), bottom-right aligned."""
    batch, seqlen_q = q.shape[:2]
    if k.shape[1] > mask.shape[-1]:  # a static cache holds more rows than have been written
        k, v = k[:, :mask.shape[-1]], v[:, :mask.shape[-1]]
    k_tokens, k_indices, cu_k, max_k, _ = unpad_input(k, mask)
    v_tokens = index_first_axis(v.flatten(0, 1), k_indices)
    if seqlen_q == mask.shape[-1]:
        q_tokens, q_indices, cu_q, max_q = index_first_axis(q.flatten(0, 1), k_indices), k_indices, cu_k, max_k
    else:
        q_tokens, q_indices, cu_q, max_q, _ = unpad_input(q, mask[:, -seqlen_q:])
    out = flash_attn_varlen_func(q_tokens, k_tokens, v_tokens, cu_q, cu_k, max_q, max_k, **kw)
    return pad_input(out, q_indices, batch, seqlen_q)


def _packed(q, k, v, cu_q: torch.Tensor, cu_k: torch.Tensor, kw: dict) -> torch.Tensor:
    """Documents packed along the sequence axis (batch of one, or rows flattened): varlen over the flattened
    tokens. max_seqlen is each side's whole length, an upper bound that needs no device read (flashtile sizes
    nothing with it)."""
    batch = q.shape[0]
    q, k, v = (t.flatten(0, 1) for t in (q, k, v))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, q.shape[0], k.shape[0], **kw)
    return out.unflatten(0, (batch, -1))
