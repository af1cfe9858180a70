"""flashtile as a Hugging Face transformers attention implementation (flashtile.integrations.transformers), on tiny
random models built from configs (fp32, 2 layers, hidden 64): Llama (GQA), Mistral (sliding window), Qwen2 (one
full and one sliding layer), Gemma-2 (softcap, alternating sliding layers) and gpt-oss (attention sinks,
alternating sliding layers). Each is compared with the same weights under transformers' own attention: SDPA, or
eager for Gemma-2, whose softcap SDPA refuses, and for gpt-oss, whose sinks it does not have. A batch of
one left-padded and one right-padded row gives the same logits at every real token, one training step the same
gradients, greedy generate() (left padding, DynamicCache) the same tokens."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from flashtile.integrations import transformers as ft_transformers  # noqa: E402

SEQLEN, VOCAB = 12, 100
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
MODELS = {
    "llama": (lambda: transformers.LlamaConfig(**COMMON), "sdpa"),
    "mistral": (lambda: transformers.MistralConfig(**COMMON, sliding_window=4), "sdpa"),
    "qwen2": (lambda: transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=4,
                                               max_window_layers=1), "sdpa"),
    "gemma2": (lambda: transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=4,
                                                 attn_logit_softcapping=2.0, query_pre_attn_scalar=16), "eager"),
    # Attention sinks (s_aux) on alternating sliding and full layers; eager is transformers' sink implementation.
    "gpt_oss": (lambda: transformers.GptOssConfig(**COMMON, head_dim=16, sliding_window=4, num_local_experts=4,
                                                  num_experts_per_tok=2, rope_parameters={"rope_type": "default",
                                                                                          "rope_theta": 10000.0}),
                "eager"),
}


@pytest.fixture(scope="module")
def name():
    return ft_transformers.register()


def models(family: str, name: str, device):
    """(flashtile model, reference model) with the same weights, on `device`."""
    make_config, reference = MODELS[family]
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(make_config(), attn_implementation=name).to(device)
    ref = copy.deepcopy(ours)
    ref.set_attn_implementation(reference)
    assert ours.config._attn_implementation == name and ref.config._attn_implementation == reference
    return ours, ref


def padded_batch(device, seqlen=SEQLEN):
    """Row 0 left-padded by 3, row 1 right-padded by 4."""
    ids = torch.randint(0, VOCAB, (2, seqlen), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, seqlen, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, -4:] = 0
    return ids.to(device), mask.to(device)


@pytest.mark.parametrize("family", list(MODELS))
def test_padded_logits_and_gradients(name, family, device):
    ours, ref = models(family, name, device)
    ids, mask = padded_batch(device)
    real = mask.bool()
    targets = torch.randint(0, VOCAB, (2, SEQLEN), generator=torch.Generator().manual_seed(2)).to(device)
    results = []
    for model in (ours, ref):
        model.train()  # attention dropout is 0 in these configs: a training step without randomness
        model.zero_grad()
        logits = model(ids, attention_mask=mask).logits
        # Padded positions' outputs differ by design (flashtile leaves them 0), so only real tokens count.
        torch.nn.functional.cross_entropy(logits[real], targets[real]).backward()
        results.append((logits[real].detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (logits, grads), (ref_logits, ref_grads) = results
    torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=2e-5)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], atol=2e-5, rtol=2e-4, msg=lambda m: f"{family} {n}: {m}")


@pytest.mark.parametrize("family", list(MODELS))
def test_greedy_generation(name, family, device):
    ours, ref = models(family, name, device)
    ids, mask = padded_batch(device)
    prompt, prompt_mask = ids[:, :8], torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8], device=device)
    with torch.no_grad():
        tokens = [m.eval().generate(prompt, attention_mask=prompt_mask, max_new_tokens=6, do_sample=False)
                  for m in (ours, ref)]
    assert torch.equal(tokens[0], tokens[1])


def test_unpadded_batch_runs_the_dense_kernels(name, device):
    """No padding: the mask function answers None and the layers run flash_attn_func (causal, bottom-right)."""
    ours, ref = models("llama", name, device)
    ids, _ = padded_batch(device)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=2e-5, rtol=2e-5)
    assert ft_transformers.padding_mask(2, SEQLEN, SEQLEN, attention_mask=torch.ones(2, SEQLEN, dtype=torch.bool)) \
        is None


def test_packed_documents_from_position_ids(name, device):
    """One row holding two documents, position ids restarting at the second: each document attends only to itself,
    as if run alone."""
    ours, ref = models("llama", name, device)
    ids, _ = padded_batch(device)
    position_ids = torch.cat([torch.arange(5), torch.arange(7)])[None].to(device)
    with torch.no_grad():
        packed = ours(ids[:1], position_ids=position_ids).logits[0]
        alone = torch.cat([ref(ids[:1, :5]).logits[0], ref(ids[:1, 5:]).logits[0]])
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
def test_bf16_model_at_head_dim_128(name, device):
    """A Llama of head dim 128 (the Gluon kernels on an H100/H200) in bf16, 300 padded tokens a row: flashtile's
    logits and gradients, against the fp32 model under SDPA, err no more than 2x / 3x SDPA's own in bf16."""
    config = transformers.LlamaConfig(**COMMON | dict(hidden_size=1024, intermediate_size=1024,
                                                      num_attention_heads=8, num_key_value_heads=2))
    torch.manual_seed(0)
    exact = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    ours = copy.deepcopy(exact).to(torch.bfloat16)
    ours.set_attn_implementation(name)
    sdpa = copy.deepcopy(exact).to(torch.bfloat16)
    ids, mask = padded_batch(device, 300)
    real = mask.bool()
    results = []
    for model in (exact, ours, sdpa):
        model.zero_grad()
        logits = model(ids, attention_mask=mask).logits[real].float()
        logits.square().mean().backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if "self_attn" in n}
        results.append((logits.detach(), grads))
    (ref, ref_grads), (got, got_grads), (base, base_grads) = results
    assert (got - ref).abs().max() <= 2 * (base - ref).abs().max() + 1e-3 * ref.abs().max()
    for n, g in ref_grads.items():
        bound = 3 * (base_grads[n] - g).abs().max() + 1e-3 * g.abs().max()
        assert (got_grads[n] - g).abs().max() <= bound, n


def test_what_it_refuses(name):
    with pytest.raises(ValueError, match="flash"):
        ft_transformers.register("my_flash_thing")
    with pytest.raises(NotImplementedError, match="mask pattern"):
        ft_transformers.padding_mask(1, 4, 4, use_vmap=True)
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(NotImplementedError, match="4-D mask"):
        ft_transformers.attention_forward(torch.nn.Module(), q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="position_bias"):
        ft_transformers.attention_forward(torch.nn.Module(), q, q, q, None, position_bias=torch.zeros(2))
