"""flashtile.bert_padding: flash-attn 2.8's contracts for unpad_input / pad_input / index_first_axis, and the
Hugging Face flow through them: padded batch with a random attention mask -> unpad -> flash_attn_varlen_func ->
pad, forward and backward, against the fp64 reference on each row's valid tokens."""

import pytest
import torch

import flashtile
from flashtile.bert_padding import index_first_axis, index_put_first_axis, pad_input, unpad_input
from flashtile.testing import attention_ref, check_close


def random_mask(batch, seqlen, g, device, empty_row=True):
    """Right-padded rows of random lengths (one of them empty), as a tokenizer produces."""
    lengths = torch.randint(1, seqlen + 1, (batch,), generator=g)
    if empty_row:
        lengths[batch // 2] = 0
    return (torch.arange(seqlen)[None, :] < lengths[:, None]).to(device)


def test_unpad_input_contract(device):
    g = torch.Generator().manual_seed(0)
    mask = random_mask(4, 9, g, device)
    x = torch.randn(4, 9, 3, 2, generator=g).to(device)
    hidden, indices, cu_seqlens, max_seqlen, used = unpad_input(x, mask)
    lengths = mask.sum(-1)
    assert torch.equal(hidden, x[mask])
    assert torch.equal(indices, mask.flatten().nonzero().flatten())
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, *lengths.cumsum(0).tolist()]
    assert isinstance(max_seqlen, int) and max_seqlen == int(lengths.max())
    assert used.dtype == torch.int32 and torch.equal(used, lengths.int())
    assert torch.equal(pad_input(hidden, indices, 4, 9), x * mask[..., None, None])


def test_unused_mask(device):
    """Allocated-but-unused tokens are kept (in cu_seqlens) and excluded from used_seqlens_in_batch."""
    attention_mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], device=device)
    unused_mask = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]], device=device)
    x = torch.arange(8.0, device=device).view(2, 4, 1)
    hidden, indices, cu_seqlens, max_seqlen, used = unpad_input(x, attention_mask, unused_mask)
    assert hidden.flatten().tolist() == [0.0, 1.0, 2.0, 4.0, 5.0, 6.0]
    assert indices.tolist() == [0, 1, 2, 4, 5, 6]
    assert cu_seqlens.tolist() == [0, 3, 6] and max_seqlen == 3 and used.tolist() == [2, 1]


def test_index_gradients(device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 3, generator=g, dtype=torch.float64).to(device).requires_grad_()
    idx = torch.tensor([5, 0, 3], device=device)
    assert torch.autograd.gradcheck(lambda t: index_first_axis(t, idx), (x,))
    vals = torch.randn(3, 2, generator=g, dtype=torch.float64).to(device).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: index_put_first_axis(t, idx, 7), (vals,))
    (grad,) = torch.autograd.grad(index_first_axis(x, idx).sum(), x)
    assert grad[[1, 2, 4, 6]].abs().sum() == 0 and torch.equal(grad[idx], torch.ones(3, 3, dtype=grad.dtype,
                                                                                       device=device))


def padded_reference(q, k, v, mask, upcast=True, **kw):
    """fp64 (or input-dtype) attention of each row's valid tokens; padded positions 0."""
    rows = []
    for b in range(q.shape[0]):
        valid = mask[b]
        row = torch.zeros_like(q[b])
        if valid.any():
            row[valid] = attention_ref(q[b:b + 1, valid], k[b:b + 1, valid], v[b:b + 1, valid], upcast=upcast,
                                       **kw)[0][0]
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_padded_batch_through_varlen(device, causal, seed):
    g = torch.Generator().manual_seed(seed)
    batch, seqlen, nheads, head_dim = 4, 37, 2, 32
    mask = random_mask(batch, seqlen, g, device)
    q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, generator=g).to(device, torch.float16)
               for _ in range(3))
    dout = torch.randn(batch, seqlen, nheads, head_dim, generator=g).to(device, torch.float16)

    def attention(q, k, v):
        q_u, indices, cu, max_seqlen, _ = unpad_input(q, mask)
        k_u, v_u = (unpad_input(t, mask)[0] for t in (k, v))
        out = flashtile.flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_seqlen, max_seqlen, causal=causal)
        return pad_input(out, indices, batch, seqlen)

    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*inputs)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = padded_reference(*ref_in, mask, causal=causal)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
    pt_in = [t.clone().requires_grad_() for t in (q, k, v)]
    pt = padded_reference(*pt_in, mask, upcast=False, causal=causal)
    pt_grads = torch.autograd.grad(pt, pt_in, dout)

    check_close("out", out, ref, pt, 2)
    scale = max(t.abs().max().item() for t in ref_grads)
    for name, ours, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
        check_close(name, ours, r, p, 3, scale)
        assert ours[~mask].abs().sum() == 0, f"{name}: padding positions got a gradient"


def test_unused_tokens_through_seqused(device):
    """FlashAttention-3's flow: unused tokens stay in the packed batch and seqused hides them."""
    g = torch.Generator().manual_seed(2)
    attention_mask = torch.tensor([[1] * 10 + [0] * 6, [1] * 4 + [0] * 12], device=device)
    unused_mask = torch.tensor([[0] * 10 + [1] * 3 + [0] * 3, [0] * 4 + [1] * 8 + [0] * 4], device=device)
    q, k, v = (torch.randn(2, 16, 2, 32, generator=g).to(device, torch.float16) for _ in range(3))
    q_u, indices, cu, max_seqlen, used = unpad_input(q, attention_mask, unused_mask)
    k_u, v_u = (unpad_input(t, attention_mask, unused_mask)[0] for t in (k, v))
    out = flashtile.flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_seqlen, max_seqlen, causal=True,
                                           seqused_q=used, seqused_k=used)
    out = pad_input(out, indices, 2, 16)
    ref = padded_reference(q.double(), k.double(), v.double(), attention_mask.bool(), causal=True)
    pt = padded_reference(q, k, v, attention_mask.bool(), upcast=False, causal=True)
    check_close("out", out, ref, pt, 2)
