"""GPU tier (`pytest -m gpu` on the H200): real sizes, bf16/fp16, every feature, and bitwise determinism.

Same oracle as the CPU tier (test_attention.run_case). Skipped without a GPU.
"""

import pytest
import torch

import flashtile
from flashtile.ops import hopper, schedule
from flashtile.ops.device import pdl_supported
from flashtile.ops.hopper import hopper_unsupported
from test_attention import MASKS, run_case
from test_varlen import run_varlen

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_real_sizes(device, dtype, head_dim, mask):
    causal, window = MASKS[mask]
    window = (256, 0) if mask == "window" else window
    run_case(device, 2, 2048, 2048, 8, 2, head_dim, dtype, causal, window)


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_fp32_every_head_dim(device, head_dim, varlen):
    """fp32 inputs take smaller tiles where the table's would not fit in shared memory (config.FP32): the d128 dQ
    kernel asked for 321 KiB of the fp16 row's tile."""
    if varlen:
        run_varlen(device, [300, 0, 129, 517], [300, 0, 129, 517], 4, 2, head_dim, torch.float32, True)
    else:
        run_case(device, 2, 300, 517, 4, 2, head_dim, torch.float32, True)


@pytest.mark.parametrize("seqlens", [(8192, 8192), (1000, 3000), (3000, 1000), (4097, 4095)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True])
def test_long_and_ragged(device, seqlens, causal):
    run_case(device, 1, *seqlens, 4, 4, 128, torch.bfloat16, causal)


@pytest.mark.parametrize("features", ["softcap", "alibi", "all"])
def test_features_real_size(device, features):
    kw = dict(softcap=30.0) if features == "softcap" else dict(alibi="per_batch") if features == "alibi" else \
        dict(causal=True, window_size=(512, -1), softcap=20.0, alibi="per_head")
    run_case(device, 2, 1537, 2049, 8, 4, 128, torch.bfloat16, **kw)


def test_deterministic_backward(device):
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(2, 2048, 16, 128, device=device, dtype=torch.bfloat16, generator=g,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    first = None
    for _ in range(20):
        out = flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        if first is None:
            first = (out, *grads)
        else:
            for a, b in zip(first, (out, *grads)):
                assert torch.equal(a, b)


@pytest.mark.parametrize("head_dim, causal, nheads_kv", [(128, False, 8), (64, True, 2)])
def test_pdl_backward_matches_serial(device, monkeypatch, head_dim, causal, nheads_kv):
    """The dK/dV kernel started early through PDL and the delta counters (Note [delta handoff]) gives bitwise the
    gradients of the two kernels run one after the other (FLASHTILE_PDL=0)."""
    if not pdl_supported(torch.device(device)):
        pytest.skip("no programmatic dependent launch on this GPU: both runs would be the serial path")
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(3, 2048, 8, head_dim, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (torch.randn(3, 2048, nheads_kv, head_dim, device=device, dtype=torch.bfloat16, generator=g,
                        requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    grads = {}
    monkeypatch.setenv("FLASHTILE_HOPPER", "0")  # the handoff is between the Triton kernels
    for pdl in ("1", "0", "1"):
        monkeypatch.setenv("FLASHTILE_PDL", pdl)
        out = flashtile.flash_attn_func(q, k, v, causal=causal)
        now = torch.autograd.grad(out, (q, k, v), dout)
        for a, b in zip(grads.setdefault(pdl, now), now):
            assert torch.equal(a, b)
    for a, b in zip(grads["1"], grads["0"]):
        assert torch.equal(a, b)


GLUON = {"fwd": "gluon-sm90", "bwd_dq": "gluon-sm90", "bwd_dkdv": "gluon-sm90"}
# (batch, seqlen_q, seqlen_k, nheads, nheads_kv): lengths off the kernels' 128-row tiles, one row, more queries
# than keys (rows that see no key under a causal mask), GQA and MQA.
HOPPER_CASES = [(2, 1, 1, 4, 4), (1, 17, 33, 4, 2), (2, 100, 300, 4, 1), (1, 300, 100, 4, 4),
                (2, 1023, 1025, 4, 2), (1, 640, 640, 8, 8)]


def _need_hopper(device, head_dim=128):
    """Skip unless the Gluon kernels run on this device for this head dim."""
    reason = hopper_unsupported(torch.device(device), torch.bfloat16, head_dim)
    if reason is not None:
        pytest.skip(f"the Gluon Hopper kernels do not run here: {reason}")


@pytest.mark.parametrize("case", HOPPER_CASES, ids=lambda c: "b{}_{}x{}_h{}kv{}".format(*c))
@pytest.mark.parametrize("mask", ["none", "causal", "window", "left", "right"])
def test_hopper_path(device, case, mask):
    """The Gluon kernels (Note [hopper path]) against the fp64 oracle, and that they are what ran."""
    head_dim = 128
    _need_hopper(device, head_dim)
    causal, window = MASKS[mask]
    dtype = torch.float16 if case[1] % 2 else torch.bfloat16
    run_case(device, *case, head_dim, dtype, causal, window)
    assert flashtile.last_kernel_paths() == GLUON
    q = torch.empty(case[0], case[1], case[3], head_dim, device=device, dtype=dtype)
    k = torch.empty(case[0], case[2], case[4], head_dim, device=device, dtype=dtype)
    assert flashtile.kernel_paths(q, k, k, causal=causal, window_size=window) == dict(GLUON, reason=None)


def test_hopper_dense_counters_reset(device):
    """A dense batch's work counters are not zeroed per call: each launch leaves its own at 0 for the next (Note
    [self-resetting counter]). Calls whose grids differ (one item, fewer items than SMs, more), on the default
    stream and on a side stream, each match the oracle, and afterwards every counter reads 0."""
    _need_hopper(device)
    side = torch.cuda.Stream(device)
    for case in [(1, 17, 33, 4, 2), (2, 1023, 1025, 4, 2), (1, 1, 1, 4, 4), (4, 2048, 2048, 8, 2)]:
        for stream in (torch.cuda.current_stream(device), side):
            with torch.cuda.stream(stream):
                run_case(device, *case, 128, torch.bfloat16, True, (-1, -1))
                assert flashtile.last_kernel_paths() == GLUON
    torch.cuda.synchronize(device)
    counters = [(key, c) for key, cs in schedule._DENSE_COUNTERS.items() for c in cs]
    assert {key[1] for key, _ in counters} >= {torch.cuda.current_stream(device).cuda_stream, side.cuda_stream}
    assert all(int(c) == 0 for _, c in counters)


@pytest.mark.parametrize("causal", [False, True])
def test_hopper_packed_and_switch(device, monkeypatch, causal):
    """Packed qkv (strided views, one gradient buffer) through the Gluon kernels gives what separate tensors give,
    and FLASHTILE_HOPPER=0 runs the Triton kernels, whose results agree to rounding."""
    _need_hopper(device)
    g = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(2, 777, 3, 8, 128, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
    dout = torch.randn(2, 777, 8, 128, device=device, dtype=torch.bfloat16, generator=g)
    out = flashtile.flash_attn_qkvpacked_func(qkv, causal=causal)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    assert flashtile.last_kernel_paths() == GLUON
    q, k, v = (qkv[:, :, i].detach().clone().requires_grad_() for i in range(3))
    out2 = flashtile.flash_attn_func(q, k, v, causal=causal)
    grads2 = torch.autograd.grad(out2, (q, k, v), dout)
    assert torch.equal(out, out2)
    for i in range(3):
        assert torch.equal(dqkv[:, :, i], grads2[i])
    for d, kw in ((64, {}), (128, dict(softcap=5.0))):
        x = torch.empty(1, 8, 2, d, device=device, dtype=torch.bfloat16)
        assert flashtile.kernel_paths(x, x, x, **kw)["fwd"] == "triton"
        flashtile.flash_attn_func(x.normal_(), x, x, **kw)
        assert flashtile.last_kernel_paths()["fwd"] == "triton"
    monkeypatch.setenv("FLASHTILE_HOPPER", "0")
    assert flashtile.kernel_paths(q, k, v, causal=causal)["reason"] == "switched off by FLASHTILE_HOPPER=0"
    out3 = flashtile.flash_attn_func(q, k, v, causal=causal)
    grads3 = torch.autograd.grad(out3, (q, k, v), dout)
    assert flashtile.last_kernel_paths() == {"fwd": "triton", "bwd_dq": "triton", "bwd_dkdv": "triton"}
    for a, b in zip((out2, *grads2), (out3, *grads3)):
        assert (a.float() - b.float()).abs().max().item() <= 0.02 * b.float().abs().max().item()


# (lens_q, lens_k): a mix with empty sequences, one sequence, queries longer than keys (rows that see no key under
# a causal mask), a sequence without keys, and sequences off the 128-row tiles.
HOPPER_VARLEN = {"mixed": ([700, 0, 129, 1, 2048, 65], [700, 0, 129, 1, 2048, 65]),
                 "single": ([1000], [1000]),
                 "q_longer": ([300, 90, 513], [100, 90, 200]),
                 "no_keys": ([77, 128], [0, 300])}


@pytest.mark.parametrize("programs", ["per_sm", 3])
@pytest.mark.parametrize("lengths", list(HOPPER_VARLEN))
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_hopper_varlen(device, monkeypatch, lengths, mask, programs):
    """Varlen batches through the Gluon kernels (descriptors over the packed tensors, Note [varlen descriptors];
    the tile list of ops/schedule.varlen_plan) against the per-sequence fp64 oracle, on NaN-guarded inputs. The
    persistent kernels (Notes [persistent forward], [persistent dQ] and [persistent dK/dV]) also
    run on 3 programs, each of which then works through items of every length, its ring and its two buffer sets
    running on from one item to the next."""
    _need_hopper(device)
    if programs != "per_sm":
        monkeypatch.setattr(hopper, "sm_count", lambda device: programs)
    causal, window = MASKS[mask]
    lens_q, lens_k = HOPPER_VARLEN[lengths]
    run_varlen(device, lens_q, lens_k, 8, 2, 128, torch.bfloat16, causal, window)
    assert flashtile.last_kernel_paths() == GLUON


@pytest.mark.parametrize("layout", ["dense", "varlen"])
@pytest.mark.parametrize("mask", ["causal", "window"])
def test_hopper_persistent_deterministic(device, mask, layout):
    """The persistent kernels (forward, dQ, dK/dV) take their items from atomic work counters, dense and varlen
    batches alike, so which program computes which item changes from run to run; each item is still computed whole
    by one program, so the output and the gradients come out bitwise the same every time (flash-attn's
    deterministic=True contract holds without the flag)."""
    _need_hopper(device)
    causal, window = MASKS[mask]
    lens = [700, 0, 129, 1, 2048, 65, 3000, 300]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    shape = (sum(lens),) if layout == "varlen" else (3, 1100)
    q = torch.randn(*shape, 8, 128, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (torch.randn(*shape, 2, 128, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)
    first = None
    for _ in range(10):
        if layout == "varlen":
            out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal,
                                                   window_size=window)
        else:
            out = flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        assert flashtile.last_kernel_paths() == GLUON
        if first is None:
            first = (out, *grads)
        else:
            for a, b in zip(first, (out, *grads)):
                assert torch.equal(a, b)


def test_hopper_under_torch_compile(device):
    """torch.compile(fullgraph=True) over forward and backward reaches the Gluon kernels through the custom ops,
    with the eager route's results bitwise."""
    _need_hopper(device)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(2, 300, 4, 128, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    results = []
    for fn in (flashtile.flash_attn_func,
               torch.compile(flashtile.flash_attn_func, fullgraph=True, backend="aot_eager")):
        out = fn(q, k, v, causal=True)
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
        assert flashtile.last_kernel_paths() == GLUON
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_long_sequence_memory(device):
    """B=1, H=16, D=128, S=128k forward+backward runs; memory beyond inputs/outputs/grads is O(S)."""
    torch.cuda.empty_cache()
    s = 131072
    q, k, v = (torch.randn(1, s, 16, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    out.backward(dout)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    tensor_bytes = q.numel() * q.element_size()
    # out + dq + dk + dv are 4 tensors of q's size; lse and delta are S*H fp32 each.
    assert extra <= 4 * tensor_bytes + 2 * s * 16 * 4 + (64 << 20), f"extra memory {extra / 2**20:.0f} MiB"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_autotune_path(device, monkeypatch, head_dim):
    """FLASHTILE_AUTOTUNE=1 picks the Triton kernels' tiles by timing config.CANDIDATES; results must not change
    beyond rounding. The Gluon kernels (d128 on sm_90) have no candidates, so they are switched off here: the
    forward, dQ and dK/dV must each go through the autotuner."""
    from flashtile.ops import launch
    tuned = set()
    real = launch._autotuned

    def spy(kernel, name, pre_hook):
        tuned.add(name)
        return real(kernel, name, pre_hook)

    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "1")
    monkeypatch.setenv("FLASHTILE_HOPPER", "0")
    monkeypatch.setattr(launch, "_autotuned", spy)
    run_case(device, 2, 1024, 1024, 8, 2, head_dim, torch.bfloat16, causal=True)
    assert tuned == {"fwd", "bwd_dq", "bwd_dkdv"}, tuned
    # Varlen: the dQ kernel walks the schedule, as no tile list fits every candidate's BLOCK_M (ops/bwd.py).
    run_varlen(device, [1000, 0, 300, 2048], [1000, 0, 300, 2048], 8, 2, head_dim, torch.bfloat16, causal=True)
