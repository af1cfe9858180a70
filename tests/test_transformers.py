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


def models(family: str, name: str):
    """(flashtile model, reference model) with the same weights."""
    make_config, reference = MODELS[family]
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(make_config(), attn_implementation=name)
    ref = copy.deepcopy(ours)
    ref.set_attn_implementation(reference)
    assert ours.config._attn_implementation == name and ref.config._attn_implementation == reference
    return ours, ref


def padded_batch():
    """Row 0 left-padded by 3, row 1 right-padded by 4."""
    ids = torch.randint(0, VOCAB, (2, SEQLEN), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, SEQLEN, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, -4:] = 0
    return ids, mask


@pytest.mark.parametrize("family", list(MODELS))
def test_padded_logits_and_gradients(name, family):
    ours, ref = models(family, name)
    ids, mask = padded_batch()
    real = mask.bool()
    targets = torch.randint(0, VOCAB, (2, SEQLEN), generator=torch.Generator().manual_seed(2))
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
def test_greedy_generation(name, family):
    ours, ref = models(family, name)
    ids, mask = padded_batch()
    prompt, prompt_mask = ids[:, :8], torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
    with torch.no_grad():
        tokens = [m.eval().generate(prompt, attention_mask=prompt_mask, max_new_tokens=6, do_sample=False)
                  for m in (ours, ref)]
    assert torch.equal(tokens[0], tokens[1])


def test_unpadded_batch_runs_the_dense_kernels(name):
    """No padding: the mask function answers None and the layers run flash_attn_func (causal, bottom-right)."""
    ours, ref = models("llama", name)
    ids, _ = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=2e-5, rtol=2e-5)
    assert ft_transformers.padding_mask(2, SEQLEN, SEQLEN, attention_mask=torch.ones(2, SEQLEN, dtype=torch.bool)) \
        is None


def test_packed_documents_from_position_ids(name):
    """One row holding two documents, position ids restarting at the second: each document attends only to itself,
    as if run alone."""
    ours, ref = models("llama", name)
    ids, _ = padded_batch()
    position_ids = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        packed = ours(ids[:1], position_ids=position_ids).logits[0]
        alone = torch.cat([ref(ids[:1, :5]).logits[0], ref(ids[:1, 5:]).logits[0]])
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=2e-5)


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
