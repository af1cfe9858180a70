"""The bad-input catalogue: every entry point, every kind of argument. Each bad call raises a TypeError or
ValueError (NotImplementedError for a documented unsupported combination) whose message names the argument and
says what was expected, before any kernel runs; no input tensor is modified, the caches of flash_attn_with_kvcache
included. Checks of index values run with FLASHTILE_CHECK=1, as they would on CPU tensors anyway (on a GPU
without it they run for paged KV caches only: problem.py, kvcache.py)."""

import numpy as np
import pytest
import torch

import flashtile

F16 = torch.float16


def _t(*shape, dtype=F16, device="cpu"):
    return torch.randn(*shape).to(device=device, dtype=dtype)


def _cu(*lengths):
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)


def dense(**over):
    args = dict(q=_t(2, 9, 4, 32), k=_t(2, 11, 2, 32), v=_t(2, 11, 2, 32))
    return flashtile.flash_attn_func, {**args, **over}


def qkvpacked(**over):
    return flashtile.flash_attn_qkvpacked_func, {"qkv": _t(2, 9, 3, 4, 32), **over}


def kvpacked(**over):
    return flashtile.flash_attn_kvpacked_func, {"q": _t(2, 9, 4, 32), "kv": _t(2, 11, 2, 2, 32), **over}


def varlen(**over):
    args = dict(q=_t(12, 4, 32), k=_t(15, 2, 32), v=_t(15, 2, 32), cu_seqlens_q=_cu(5, 7),
                cu_seqlens_k=_cu(6, 9), max_seqlen_q=7, max_seqlen_k=9)
    return flashtile.flash_attn_varlen_func, {**args, **over}


def varlen_paged(**over):
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    return varlen(**{"k": _t(6, 4, 2, 32), "v": _t(6, 4, 2, 32), "block_table": table, **over})


def varlen_qkv(**over):
    return flashtile.flash_attn_varlen_qkvpacked_func, {"qkv": _t(12, 3, 4, 32), "cu_seqlens": _cu(5, 7),
                                                        "max_seqlen": 7, **over}


def kvcache(**over):
    args = dict(q=_t(2, 1, 4, 32), k_cache=_t(2, 64, 2, 32), v_cache=_t(2, 64, 2, 32),
                cache_seqlens=torch.tensor([10, 20], dtype=torch.int32))
    return flashtile.flash_attn_with_kvcache, {**args, **over}


def kvcache_paged(**over):
    return kvcache(**{"k_cache": _t(8, 16, 2, 32), "v_cache": _t(8, 16, 2, 32),
                      "block_table": torch.arange(8, dtype=torch.int32).reshape(2, 4), **over})


def new_kv(s=1):
    return dict(k=_t(2, s, 2, 32), v=_t(2, s, 2, 32))


def combine(**over):
    return flashtile.combine, {"out_partials": torch.randn(3, 2, 5, 4, 32), "lse_partials": torch.randn(3, 2, 4, 5),
                               **over}


CATALOGUE = {
    # ranks and shapes
    "dense q rank": (dense(q=_t(9, 4, 32)), ValueError, "q must have 4 dimensions"),
    "dense k/v shapes": (dense(v=_t(2, 10, 2, 32)), ValueError, "k and v must have the same shape"),
    "dense batch": (dense(k=_t(1, 11, 2, 32), v=_t(1, 11, 2, 32)), ValueError, "batch sizes differ"),
    "dense head dims": (dense(k=_t(2, 11, 2, 16), v=_t(2, 11, 2, 16)), ValueError, "same head_dim"),
    "dense head dim too large": (dense(q=_t(1, 4, 1, 520), k=_t(1, 4, 1, 520), v=_t(1, 4, 1, 520)), ValueError,
                                 "head_dim must be in"),
    "dense head counts": (dense(q=_t(2, 9, 3, 32)), ValueError, "multiple of the number of key/value heads"),
    "dense empty q": (dense(q=_t(2, 0, 4, 32)), ValueError, "seqlen_q and seqlen_k must be >= 1"),
    "qkvpacked shape": (qkvpacked(qkv=_t(2, 9, 2, 4, 32)), ValueError, "qkv must have 5 dimensions with size 3"),
    "kvpacked shape": (kvpacked(kv=_t(2, 11, 3, 2, 32)), ValueError, "kv must have 5 dimensions with size 2"),
    "varlen q rank": (varlen(q=_t(1, 12, 4, 32)), ValueError, "q must have 3 dimensions"),
    "varlen qkv shape": (varlen_qkv(qkv=_t(12, 4, 4, 32)), ValueError, "qkv must have 4 dimensions"),
    "kvcache q rank": (kvcache(q=_t(2, 4, 32)), ValueError, "q must have 4 dimensions"),
    "kvcache head dims": (kvcache(q=_t(2, 1, 4, 16)), ValueError, "q and k_cache must have the same head"),
    "kvcache cache batch": (kvcache(k_cache=_t(1, 64, 2, 32), v_cache=_t(1, 64, 2, 32)), ValueError,
                            "holds 1 sequences"),
    "kvcache new k shape": (kvcache(k=_t(2, 1, 4, 32), v=_t(2, 1, 4, 32)), ValueError, "k must have shape"),
    "combine rank": (combine(out_partials=torch.randn(2, 5, 4, 32)), ValueError, "lse_partials"),
    "combine lse shape": (combine(lse_partials=torch.randn(3, 2, 4, 6)), ValueError, "lse_partials must have shape"),
    # types, dtypes, devices, strides
    "dense q type": (dense(q=np.zeros((2, 9, 4, 32))), TypeError, "q must be a torch.Tensor"),
    "dense int q": (dense(q=torch.zeros(2, 9, 4, 32, dtype=torch.int32)), TypeError, "q has dtype"),
    "dense mixed dtypes": (dense(k=_t(2, 11, 2, 32, dtype=torch.bfloat16)), TypeError, "k has dtype"),
    "dense device": (dense(v=torch.empty(2, 11, 2, 32, dtype=F16, device="meta")), ValueError, "v is on meta"),
    "dense last stride": (dense(q=_t(2, 9, 32, 4).transpose(2, 3)), ValueError, "q must have unit stride"),
    "kvcache cache dtype": (kvcache(k_cache=_t(2, 64, 2, 32, dtype=torch.float32)), TypeError, "k_cache has dtype"),
    "kvcache cache stride": (kvcache(v_cache=_t(2, 64, 32, 2).transpose(2, 3)), ValueError,
                             "v_cache must have unit stride"),
    "combine lse dtype": (combine(lse_partials=torch.randn(3, 2, 4, 5, dtype=torch.float64)), TypeError,
                          "lse_partials float32"),
    # scalar arguments: window, softcap, scale, ALiBi, dropout, deterministic
    "window length": (dense(window_size=(4,)), ValueError, "window_size must be a pair"),
    "window value": (dense(window_size=(-3, 2)), ValueError, "window_size entries must be >= 0"),
    "window float": (dense(window_size=(2.5, 1)), TypeError, "window_size entries must be integers"),
    "window float tensor": (dense(window_size=torch.tensor([2.0, 1.0])), TypeError,
                            "window_size entries must be integers"),
    "window string": (varlen(window_size="4,4"), ValueError, "window_size must be a pair"),
    "kvcache window": (kvcache(window_size=(-2, 0)), ValueError, "window_size"),
    "softcap negative": (dense(softcap=-1.0), ValueError, "softcap must be a finite number >= 0"),
    "softcap inf": (varlen(softcap=float("inf")), ValueError, "softcap must be a finite number"),
    "scale nan": (dense(softmax_scale=float("nan")), ValueError, "softmax_scale must be a finite number > 0"),
    "scale zero": (qkvpacked(softmax_scale=0.0), ValueError, "softmax_scale must be a finite number > 0"),
    "alibi shape": (dense(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes must have shape"),
    "alibi dtype": (kvpacked(alibi_slopes=torch.ones(4, dtype=F16)), TypeError, "alibi_slopes must be float32"),
    "alibi type": (varlen(alibi_slopes=[0.1] * 4), TypeError, "alibi_slopes must be a tensor"),
    "dropout range": (dense(dropout_p=1.5), ValueError, "dropout_p must be in"),
    "dropout one": (varlen(dropout_p=1.0), ValueError, "dropout_p must be in"),
    "dropout negative": (dense(dropout_p=-0.1), ValueError, "dropout_p must be in"),
    "dropout nan": (dense(dropout_p=float("nan")), ValueError, "dropout_p must be in"),
    "dropout string": (dense(dropout_p="0.1"), TypeError, "dropout_p must be a float"),
    "sink shape": (dense(learnable_sink=_t(3)), ValueError, "learnable_sink must have shape"),
    "sink varlen dtype": (varlen(learnable_sink=torch.zeros(4, dtype=torch.int64)), TypeError,
                          "learnable_sink must be float32"),
    "deterministic type": (dense(deterministic="yes"), TypeError, "deterministic must be a bool"),
    "num_splits": (kvcache(num_splits=-1), ValueError, "num_splits must be an int >= 0"),
    # varlen index tensors
    "cu_seqlens dtype": (varlen(cu_seqlens_q=_cu(5, 7).long()), TypeError, "cu_seqlens_q must be int32"),
    "cu_seqlens rank": (varlen(cu_seqlens_k=_cu(6, 9)[None]), ValueError, "cu_seqlens_k must be 1-d"),
    "cu_seqlens batch": (varlen(cu_seqlens_k=_cu(6, 4, 5)), ValueError, "batch_size \\+ 1 entries"),
    "cu_seqlens start": (varlen(cu_seqlens_q=torch.tensor([1, 5, 12], dtype=torch.int32)), ValueError,
                         "cu_seqlens_q must start at 0"),
    "cu_seqlens decreasing": (varlen(cu_seqlens_k=torch.tensor([0, 9, 6], dtype=torch.int32)), ValueError,
                              "cu_seqlens_k must be non-decreasing"),
    "cu_seqlens total": (varlen(cu_seqlens_q=torch.tensor([0, 5, 11], dtype=torch.int32)), ValueError,
                         "cu_seqlens_q\\[-1\\] = 11 must equal the packed total"),
    "max_seqlen type": (varlen(max_seqlen_q=7.0), TypeError, "max_seqlen_q must be an int"),
    "max_seqlen small": (varlen(max_seqlen_k=8), ValueError, "max_seqlen_k = 8 is smaller"),
    "seqused dtype": (varlen(seqused_k=torch.tensor([3, 4])), TypeError, "seqused_k must be int32"),
    "seqused shape": (varlen(seqused_q=torch.tensor([3], dtype=torch.int32)), ValueError,
                      "seqused_q must have shape"),
    "seqused too long": (varlen(seqused_q=torch.tensor([3, 9], dtype=torch.int32)), ValueError, "seqused_q"),
    "block table dtype": (varlen_paged(block_table=torch.zeros(2, 3, dtype=torch.int64)), TypeError,
                          "block_table must be int32"),
    "block table page": (varlen_paged(block_table=torch.tensor([[0, 1, 2], [3, 6, 5]], dtype=torch.int32)),
                         ValueError, "block_table\\[1, 1\\] = 6 is not a page"),
    "block table width": (varlen_paged(block_table=torch.tensor([[0], [1]], dtype=torch.int32)), ValueError,
                          "block_table"),
    "paged backward": (None, NotImplementedError, "no backward through a paged KV cache"),
    # KV cache lengths, pages, rotary tables
    "cache seqlens dtype": (kvcache(cache_seqlens=torch.tensor([1, 2])), TypeError, "cache_seqlens must be int32"),
    "cache seqlens int": (kvcache(cache_seqlens=64, **new_kv()), ValueError, "cache_seqlens = 64"),
    "cache seqlens past capacity": (kvcache(cache_seqlens=torch.tensor([10, 64], dtype=torch.int32), **new_kv()),
                                    ValueError, "cache_seqlens\\[1\\] = 64"),
    "cache seqlens negative": (kvcache(cache_seqlens=torch.tensor([-4, 2], dtype=torch.int32)), ValueError,
                               "cache_seqlens\\[0\\] = -4"),
    "cache seqlens past block table": (kvcache_paged(cache_seqlens=torch.tensor([60, 3], dtype=torch.int32),
                                                     **new_kv(8)), ValueError, "cache_seqlens\\[0\\] = 60"),
    "cache page out of range": (kvcache_paged(block_table=torch.tensor([[0, 1, 2, 3], [8, 5, 6, 7]],
                                                                       dtype=torch.int32)),
                                ValueError, "block_table\\[1, 0\\] = 8 is not a page"),
    "cache batch idx": (kvcache(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)), ValueError,
                        "cache_batch_idx\\[1\\] = 2"),
    "cache leftpad": (kvcache(cache_leftpad=torch.tensor([0, 30], dtype=torch.int32)), ValueError,
                      "cache_leftpad\\[1\\] = 30"),
    "append without seqlens": (kvcache(cache_seqlens=None, **new_kv()), ValueError, "needs cache_seqlens"),
    "append too long": (kvcache(**new_kv(65)), ValueError, "cannot append 65 tokens"),
    "rotary without k": (kvcache(rotary_cos=_t(64, 8), rotary_sin=_t(64, 8)), ValueError, "need new keys"),
    "rotary too short": (kvcache(rotary_cos=_t(63, 8), rotary_sin=_t(63, 8), **new_kv()), ValueError,
                         "seqlen_ro must be >= the capacity"),
    "rotary too wide": (kvcache(rotary_cos=_t(64, 17), rotary_sin=_t(64, 17), **new_kv()), ValueError,
                        "rotary_dim <= headdim"),
    "rotary shapes": (kvcache(rotary_cos=_t(64, 8), rotary_sin=_t(64, 4), **new_kv()), ValueError,
                      "rotary_cos and rotary_sin must have the same shape"),
    "batch idx with pages": (kvcache_paged(cache_batch_idx=torch.zeros(2, dtype=torch.int32)), ValueError,
                             "cache_batch_idx cannot be used with a paged cache"),
}


def _on(device, args):
    return {k: v.to(device) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v
            for k, v in args.items()}


def _paged_backward(device):
    fn, args = varlen_paged()
    args = _on(device, args)
    args["q"].requires_grad_()
    out = fn(**args)
    out.float().sum().backward()


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_bad_call_raises_and_names_the_argument(device, name, monkeypatch):
    # On a GPU the checks of index values need FLASHTILE_CHECK=1 (a synchronising copy), except for paged caches.
    monkeypatch.setenv("FLASHTILE_CHECK", "1")
    call, exc, match = CATALOGUE[name]
    if call is None:
        with pytest.raises(exc, match=match):
            _paged_backward(device)
        return
    fn, args = call[0], _on(device, call[1])
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    with pytest.raises(exc, match=match):
        fn(**args)
    for k, v in before.items():
        assert torch.equal(args[k].nan_to_num(0.0), v.nan_to_num(0.0)), f"{name}: {k} was modified"


def test_catalogue_is_large():
    assert len(CATALOGUE) >= 40


@pytest.mark.parametrize("window", [torch.tensor([3, 2]), np.array([3, 2]), [np.int64(3), torch.tensor(2)],
                                    (torch.tensor([3]), None)], ids=["tensor", "numpy", "mixed", "one-element"])
def test_window_size_as_flash_attn_takes_it(device, window):
    """Any two-element sequence of integers (tensors, numpy ints) is a window, at every entry point, with the
    same result as the tuple of Python ints."""
    expected_window = tuple(-1 if w is None else int(w) for w in window)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 2, 32, generator=g).to(device, F16) for _ in range(3))
    for fn, make in ((flashtile.flash_attn_func, lambda w: dict(q=q, k=k, v=v, window_size=w)),
                     (flashtile.flash_attn_qkvpacked_func,
                      lambda w: dict(qkv=torch.stack([q, k, v], 2), window_size=w)),
                     (flashtile.flash_attn_kvpacked_func, lambda w: dict(q=q, kv=torch.stack([k, v], 2),
                                                                         window_size=w)),
                     (flashtile.flash_attn_varlen_func,
                      lambda w: dict(q=q.flatten(0, 1), k=k.flatten(0, 1), v=v.flatten(0, 1),
                                     cu_seqlens_q=_cu(9, 9).to(device), cu_seqlens_k=_cu(9, 9).to(device),
                                     max_seqlen_q=9, max_seqlen_k=9, window_size=w)),
                     (flashtile.flash_attn_with_kvcache,
                      lambda w: dict(q=q[:, :2], k_cache=k, v_cache=v, window_size=w,
                                     cache_seqlens=torch.tensor([9, 7], dtype=torch.int32, device=device)))):
        assert torch.equal(fn(**make(window)), fn(**make(expected_window))), fn.__name__
    paths = flashtile.kernel_paths(q, k, v, window_size=window)
    assert paths == flashtile.kernel_paths(q, k, v, window_size=expected_window)
