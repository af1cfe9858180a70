"""Property-based tests (hypothesis): random shapes, features and dtypes against the fp64 oracle, dense, varlen
and KV-cache, with the same tolerance rule as every other numerics test (testing.check_close).

The examples are drawn deterministically (derandomize), so a CI run is reproducible and a failure shrinks to the
same minimal case every time; the CPU tier keeps them small and few (the interpreter costs ~5 ms per tile), the
GPU tier (`-m gpu`) draws more and larger ones.
"""

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import DEVICE
from test_attention import run_case
from test_kvcache import run_case as run_kvcache_case
from test_varlen import run_varlen

GPU = DEVICE == "cuda"
EXAMPLES = 120 if GPU else 12
MAX_LEN = 700 if GPU else 48
HEAD_DIMS = [8, 24, 32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256] if GPU else [8, 16, 24, 32, 40, 64]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]

SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@st.composite
def masks(draw):
    """(causal, window_size): no mask, causal, a window on one or both sides, or causal with a left window."""
    kind = draw(st.sampled_from(["none", "causal", "window", "causal_window"]))
    side = st.integers(-1, MAX_LEN)
    if kind == "none":
        return False, (-1, -1)
    if kind == "causal":
        return True, (-1, -1)
    if kind == "window":
        return False, (draw(side), draw(side))
    return True, (draw(st.integers(0, MAX_LEN)), -1)


@st.composite
def heads(draw):
    nheads_kv = draw(st.integers(1, 2))
    return nheads_kv * draw(st.integers(1, 3)), nheads_kv


@SETTINGS
@given(batch=st.integers(1, 2), seqlen_q=st.integers(1, MAX_LEN), seqlen_k=st.integers(1, MAX_LEN),
       heads=heads(), head_dim=st.sampled_from(HEAD_DIMS), dtype=st.sampled_from(DTYPES), mask=masks(),
       softcap=st.sampled_from([0.0, 0.0, 6.0]), alibi=st.sampled_from([None, None, "per_head", "per_batch"]),
       seed=st.integers(0, 2**16))
def test_dense_matches_the_oracle(batch, seqlen_q, seqlen_k, heads, head_dim, dtype, mask, softcap, alibi, seed):
    causal, window = mask
    run_case(DEVICE, batch, seqlen_q, seqlen_k, *heads, head_dim, dtype, causal, window, softcap, alibi, seed)


@SETTINGS
@given(lengths=st.lists(st.tuples(st.integers(0, MAX_LEN), st.integers(0, MAX_LEN)), min_size=1, max_size=4),
       heads=heads(), head_dim=st.sampled_from(HEAD_DIMS), dtype=st.sampled_from(DTYPES), mask=masks(),
       softcap=st.sampled_from([0.0, 0.0, 6.0]), seqused=st.booleans(), seed=st.integers(0, 2**16))
def test_varlen_matches_the_oracle(lengths, heads, head_dim, dtype, mask, softcap, seqused, seed):
    lens_q, lens_k = (list(x) for x in zip(*lengths))
    assume(sum(lens_q) > 0)
    causal, window = mask
    run_varlen(DEVICE, lens_q, lens_k, *heads, head_dim, dtype, causal, window, softcap, seqused=seqused,
               seed=seed)


@SETTINGS
@given(seqlens=st.tuples(st.integers(0, 90), st.integers(0, 90)), seqlen_q=st.integers(1, 4),
       seqlen_new=st.integers(0, 3), heads=heads(), page_size=st.sampled_from([None, 1, 3, 16, 32]),
       dtype=st.sampled_from(DTYPES), mask=st.sampled_from([(False, (-1, -1)), (True, (-1, -1)), (False, (7, 1))]),
       rotary=st.sampled_from([None, "interleaved", "neox"]), seed=st.integers(0, 2**16))
def test_kvcache_matches_the_oracle(seqlens, seqlen_q, seqlen_new, heads, page_size, dtype, mask, rotary, seed):
    causal, window = mask
    capacity = 96
    seqlens = tuple(min(s, capacity - seqlen_new) for s in seqlens)
    rotary = rotary if seqlen_new else None  # rotary embedding applies to appended keys
    run_kvcache_case(dtype=dtype, seqlen_q=seqlen_q, nheads=heads[0], nheads_kv=heads[1], seqlens=seqlens,
                     seqlen_new=seqlen_new, page_size=page_size, causal=causal, window=window, rotary=rotary,
                     seed=seed, capacity=capacity)
