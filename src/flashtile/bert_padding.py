"""Between padded batches and the varlen layout: the helpers of flash-attn 2.8's `flash_attn.bert_padding`.

Hugging Face's flash-attention path imports `pad_input`, `unpad_input` and `index_first_axis` from
`flash_attn.bert_padding`; these have the same signatures, return values and gradients, without the einops
dependency. `unpad_input` turns a padded (batch, seqlen, ...) tensor and its attention mask into the
(total, ...) tokens and the `cu_seqlens` / `max_seqlen` that `flash_attn_varlen_func` takes; `pad_input` puts the
varlen output back. Gathers and scatters are autograd Functions over integer indices: indexing with the boolean
mask would make PyTorch expand it and call nonzero again in the backward.

`unpad_input` reads max_seqlen_in_batch back to the host (a synchronisation), as flash-attn's does: the varlen
functions take it as a Python int. Nothing here runs a Triton kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]


class IndexFirstAxis(torch.autograd.Function):
    """input[indices] along the first axis; the backward scatters the gradient into zeros."""

    @staticmethod
    def forward(ctx, input, indices):
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        return input[indices]

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        grad_input = grad_output.new_zeros((ctx.first_axis_dim, *grad_output.shape[1:]))
        grad_input[indices] = grad_output
        return grad_input, None


class IndexPutFirstAxis(torch.autograd.Function):
    """A zero tensor with first dimension first_axis_dim and values at rows `indices`; the backward gathers."""

    @staticmethod
    def forward(ctx, values, indices, first_axis_dim):
        ctx.save_for_backward(indices)
        output = values.new_zeros((first_axis_dim, *values.shape[1:]))
        output[indices] = values
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        return grad_output[indices], None, None


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """input (n, ...) and indices (m,) int64 -> input[indices] (m, ...), differentiable in input."""
    return IndexFirstAxis.apply(input, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """values (m, ...) -> (first_axis_dim, ...) zeros with out[indices] = values, differentiable in values."""
    return IndexPutFirstAxis.apply(values, indices, first_axis_dim)


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Drop the padding tokens of a batch.

    Arguments:
        hidden_states: (batch, seqlen, ...).
        attention_mask: (batch, seqlen), bool or int; 1 means a valid token, 0 padding.
        unused_mask [optional]: (batch, seqlen), bool or int; 1 means allocated but unused. Such tokens are kept in
            the output (counted in cu_seqlens) but not in used_seqlens_in_batch, which the varlen functions take as
            seqused: keep them after the used tokens of their sequence.
    Return:
        hidden_states: (total_nnz, ...), the tokens selected by attention_mask (+ unused_mask), in batch order.
        indices: (total_nnz,) int64, their positions in the flattened (batch * seqlen) input.
        cu_seqlens: (batch + 1,) int32, cumulative sequence lengths, starting at 0.
        max_seqlen_in_batch: int, the longest sequence (selected tokens).
        used_seqlens_in_batch: (batch,) int32, the tokens selected by attention_mask alone in each sequence.
    """
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max()) if seqlens_in_batch.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return (index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens, max_seqlen_in_batch,
            used_seqlens_in_batch)


def pad_input(hidden_states, indices, batch, seqlen):
    """Put unpadded tokens back into a zero-padded batch: the inverse of `unpad_input`.

    Arguments:
        hidden_states: (total_nnz, ...), the tokens selected by the attention mask.
        indices: (total_nnz,), their positions in the flattened (batch * seqlen) batch, as `unpad_input` returns.
        batch: int, batch size of the padded batch.
        seqlen: int, sequence length of the padded batch.
    Return:
        hidden_states: (batch, seqlen, ...), zero at padding positions.
    """
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.unflatten(0, (batch, seqlen))
