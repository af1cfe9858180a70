"""Autograd for the attention custom ops: what the forward saves and how the backward op is called.

Registered with `torch.library.register_autograd`, so `torch.compile(fullgraph=True)` traces forward and
backward without a graph break. No kernel code and no argument checking here.
"""

import torch

from .ops.bwd import attention_bwd
from .ops.common import PACK_KV, PACK_QKV
from .ops.fwd import attention_fwd

# q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, block_table
_N_TENSOR_INPUTS = 9


def _setup_context(ctx, inputs, output):
    out, lse = output
    ctx.save_for_backward(*inputs[:_N_TENSOR_INPUTS], out, lse)
    ctx.scalars = inputs[_N_TENSOR_INPUTS:]
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, cu_q, cu_k, used_q, used_k, alibi, block_table, out, lse = ctx.saved_tensors
    if block_table is not None:
        raise NotImplementedError(
            "flashtile has no backward through a paged KV cache (block_table): paged K/V is an inference feature. "
            "Run the forward under torch.no_grad(), or pass contiguous k and v to get gradients.")
    packing = ctx.scalars[-1]
    grads = attention_bwd(dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, alibi, *ctx.scalars)
    if packing == PACK_QKV:
        dq, dk, dv = grads[0], None, None
    elif packing == PACK_KV:
        (dq, dk), dv = grads, None
    else:
        dq, dk, dv = grads
    return (dq, dk, dv) + (None,) * (_N_TENSOR_INPUTS - 3 + len(ctx.scalars))


torch.library.register_autograd("flashtile::fwd", _backward, setup_context=_setup_context)

__all__ = ["attention_fwd"]
