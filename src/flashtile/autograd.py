"""Autograd for the attention custom ops: what the forward saves and how the backward is called.

Two routes share one forward and one backward (Note [eager calls skip the dispatcher] in ops/common.py):
`flashtile::fwd`'s registered autograd, which torch.compile traces (fullgraph, no graph break), and an
autograd.Function that eager calls on plain tensors use, calling the implementations without the dispatcher.
No kernel code and no argument checking here.
"""

import functools
import inspect

import torch
from torch.autograd import forward_ad

from .ops.bwd import attention_bwd, backward
from .ops.common import PACK_KV, PACK_QKV, untraced
from .ops.fwd import attention_fwd, forward

def _parameters(op) -> tuple[str, ...]:
    return tuple(inspect.signature(op.impl).parameters)


# The forward op's inputs by name, from its own signature: the tensors (saved for the backward) are the parameters
# annotated as tensors, the rest scalars; the gradients go to DIFFERENTIABLE. The backward op is called by name
# from those, the forward's outputs and dout, so an input added to both ops' signatures needs no edit here.
FWD_INPUTS = _parameters(attention_fwd)
_TENSORS = tuple(i for i, name in enumerate(FWD_INPUTS)
                 if "Tensor" in str(inspect.signature(attention_fwd.impl).parameters[name].annotation))
_SCALARS = tuple(i for i in range(len(FWD_INPUTS)) if i not in _TENSORS)
DIFFERENTIABLE = ("q", "k", "v", "learnable_sink")
_GRAD_SLOTS = tuple(FWD_INPUTS.index(name) for name in DIFFERENTIABLE)
_BWD_INPUTS = _parameters(attention_bwd)


def _setup_context(ctx, inputs, output):
    out, lse = output
    ctx.save_for_backward(*(inputs[i] for i in _TENSORS), out, lse)
    ctx.scalars = tuple(inputs[i] for i in _SCALARS)
    ctx.mark_non_differentiable(lse)


def _gradients(ctx, dout, bwd):
    *saved, out, lse = ctx.saved_tensors
    given = dict(zip((FWD_INPUTS[i] for i in _TENSORS), saved)) | dict(zip((FWD_INPUTS[i] for i in _SCALARS),
                                                                           ctx.scalars))
    if given["block_table"] is not None:
        raise NotImplementedError(
            "flashtile has no backward through a paged KV cache (block_table): paged K/V is an inference feature. "
            "Run the forward under torch.no_grad(), or pass contiguous k and v to get gradients.")
    if dout is None:  # no gradient reached out (the eager route does not materialise one: see its forward)
        dout = torch.zeros_like(out)
    given.update(dout=dout, out=out, lse=lse)
    grads = list(bwd(*(given[name] for name in _BWD_INPUTS)))
    # The backward op returns the packed inputs' gradients, then the sink's when there is one.
    dsink = grads.pop() if given["learnable_sink"] is not None else None
    packing = given["packing"]
    if packing == PACK_QKV:
        grads = [grads[0], None, None]
    elif packing == PACK_KV:
        grads = [*grads, None]
    grads.append(dsink)
    result = [None] * len(FWD_INPUTS)
    for slot, grad in zip(_GRAD_SLOTS, grads):
        result[slot] = grad
    return tuple(result)


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
    """(out, lse) of flashtile::fwd's arguments, differentiable in DIFFERENTIABLE (q, k, v and the sink)."""
    if untraced(inputs):
        # Tangents exist only inside a forward-AD dual level (-1 outside any).
        differentiable = [inputs[i] for i in _GRAD_SLOTS]
        if forward_ad._current_level >= 0 and any(
                t is not None and forward_ad.unpack_dual(t).tangent is not None for t in differentiable):
            raise NotImplementedError("flashtile has no forward-mode AD (jvp): q, k and v must not be dual "
                                      "tensors (torch.autograd.forward_ad)")
        # autograd.Function.apply is about a fifth of an eager forward's Python time (measured on the CPU): skip
        # it when no gradient can flow (inference, torch.no_grad).
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable):
            return _EagerAttention.apply(*inputs)
        return attention_fwd.impl(*inputs)
    return attention_fwd(*inputs)
