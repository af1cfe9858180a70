"""flashtile inside other frameworks, each opt-in and imported only when asked for:

- `flashtile.integrations.sdpa`: PyTorch's flash-attention registry
  (`torch.nn.attention.activate_flash_attention_impl`), so that SDPA's flash backend and the aten flash ops run
  flashtile.
- `flashtile.integrations.transformers`: an attention implementation for Hugging Face transformers 5.x models.

Importing this package imports neither PyTorch's registry nor transformers.
"""
