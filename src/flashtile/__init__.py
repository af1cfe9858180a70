"""flashtile: FlashAttention for PyTorch, written in Triton, with flash-attn's API."""

__version__ = "0.1.0"

from .interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                        kernel_paths)
from .kvcache import combine, flash_attn_with_kvcache
from .ops.hopper import last_kernel_paths
from .sdpa import scaled_dot_product_attention
from .info import warmup
from . import bert_padding, compat

__all__ = ["__version__", "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_with_kvcache", "combine", "kernel_paths", "last_kernel_paths",
           "scaled_dot_product_attention", "warmup", "bert_padding", "compat"]
