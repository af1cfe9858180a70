"""Autograd for the attention custom ops: what the forward saves and how the backward is called.

Two routes share one forward and one backward (Note [eager calls skip the dispatcher] in ops/common.py):
`flashtile::fwd`'s registered autograd, which torch.compile traces (fullgraph, no graph break), and an
autograd.Function that eager calls on plain tensors use, calling the implementations without the dispatcher.
No kernel code and no argument checking here.
"""

import functools

import torch
from torch.autograd import forward_ad

from .ops.bwd import attention_bwd, backward
from .ops.common import PACK_KV, PACK_QKV, untraced
from .ops.fwd import attention_fwd, forward

# q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, block_table
_N_TENSOR_INPUTS = 9


def _setup_context(ctx, inputs, output):
    out, lse = output
    ctx.save_for_backward(*inputs[:_N_TENSOR_INPUTS], out, lse)
    ctx.scalars = inputs[_N_TENSOR_INPUTS:]
    ctx.mark_non_differentiable(lse)


def _gradients(ctx, dout, bwd):
    q, k, v, cu_q, cu_k, used_q, used_k, alibi, block_table, out, lse = ctx.saved_tensors
    if block_table is not None:
        raise NotImplementedError(
            "flashtile has no backward through a paged KV cache (block_table): paged K/V is an inference feature. "
            "Run the forward under torch.no_grad(), or pass contiguous k and v to get gradients.")
    packing = ctx.scalars[-1]
    if dout is None:  # no gradient reached out (the eager route does not materialise one: see its forward)
        dout = torch.zeros_like(out)
    grads = bwd(dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, alibi, *ctx.scalars)
    if packing == PACK_QKV:
        dq, dk, dv = grads[0], None, None
    elif packing == PACK_KV:
        (dq, dk), dv = grads, None
    else:
        dq, dk, dv = grads
    return (dq, dk, dv) + (None,) * (_N_TENSOR_INPUTS - 3 + len(ctx.scalars))


def _backward(ctx, dout, _dlse):
    return _gradients(ctx, dout, attention_bwd)


torch.library.register_autograd("flashtile::fwd", _backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """flashtile::fwd and its backward for eager calls, without the dispatcher."""

    @staticmethod
    def forward(ctx, *inputs):
        # The forward also plans the backward's varlen kernels (Note [one plan per step] in ops/bwd.py).
        out, lse, ctx.plan = forward(*inputs, for_backward=True)
        # The LSE takes no gradient, and a zero-filled one that the backward ignores would cost an allocation and
        # a kernel launch on the host's way to the dQ launch, which the GPU waits for on short varlen batches.
        ctx.set_materialize_grads(False)
        _setup_context(ctx, inputs, (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        # Autograd enables grad mode here only for create_graph=True. The kernels are not differentiable, so
        # gradients built here would carry no graph and their second-order terms would go missing without a word:
        # refuse instead, as the custom op route does.
        if torch.is_grad_enabled():
            raise RuntimeError("flashtile attention is not twice differentiable: its backward cannot run with "
                               "create_graph=True")
        # A plan serves one backward (its work counter): a second one (retain_graph) plans its own.
        plan, ctx.plan = ctx.plan, None
        return _gradients(ctx, dout, functools.partial(backward, plan=plan))


def attention(*inputs):
    """(out, lse) of flashtile::fwd's arguments, differentiable in q, k and v."""
    if untraced(inputs):
        # Tangents exist only inside a forward-AD dual level (-1 outside any).
        if forward_ad._current_level >= 0 and any(
                t is not None and forward_ad.unpack_dual(t).tangent is not None for t in inputs[:3]):
            raise NotImplementedError("flashtile has no forward-mode AD (jvp): q, k and v must not be dual "
                                      "tensors (torch.autograd.forward_ad)")
        # autograd.Function.apply is about a fifth of an eager forward's Python time (measured on the CPU): skip
        # it when no gradient can flow (inference, torch.no_grad).
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs[:3]):
            return _EagerAttention.apply(*inputs)
        return attention_fwd.impl(*inputs)
    return attention_fwd(*inputs)
