"""Build, for sm_90 and on a machine without a GPU, every kernel that a GPU run of flashtile's scenarios launches,
and report shared memory, registers, spills and whether ptxas serialised the wgmma.

What is compiled is what the launchers ask for, not a signature written here: the scenarios below call the public
API on CPU tensors inside `ops.launch.capture_launches()` (Note [launch capture]), which records every launch
(kernel, grid, arguments, constexprs, options) instead of running it and makes the ops behave as on an sm_90
device, so the Gluon path and the PDL handoff are taken. Each launch then goes through Triton's own binder for an
sm_90 target, which derives the signature, the constexprs and the integer and pointer specialisations exactly as
Triton's launcher would from those arguments: a length of 1, a stride divisible by 16, a host TMA descriptor's box
and layout. Launches that derive the same compile are built once.

The scenarios span every tile config of config.py's tables (each padded head dim, 2-byte and fp32 inputs), the
feature sets the old hand-written matrix had (dense, causal, everything on, paged), head dims below their tile
(masked columns), strides that are not multiples of 16, the Gluon kernels' dense / causal / window / varlen
variants, decode's tiles and flags, and the lengths, batch sizes, head counts and windows of 1 that Triton
specialises into constants unless a kernel says otherwise (Note [runtime integers] in kernels/__init__.py): a
ptxas crash on such a specialisation (SIGSEGV, "error code -11") reached users before this check built them.

Run as a script (it must not see TRITON_INTERPRET):
    python tests/sm90_compile.py [--group NAME] [--list]
--list prints every group and its compiles without building; --group builds one group (tests/test_compile.py runs
each group in its own subprocess, so pytest-xdist spreads them). One JSON line per compile.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import time

assert not os.environ.get("TRITON_INTERPRET"), "sm90_compile.py must run without TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import flashtile  # noqa: E402
from flashtile.config import TABLE  # noqa: E402
from flashtile.config import DECODE_TABLE, decode_config  # noqa: E402
from flashtile.ops.decode import packed_tile  # noqa: E402
from flashtile.ops.launch import capture_launches  # noqa: E402

SHARED_LIMIT = 232448  # bytes of shared memory one H100/H200 block can use
TARGET = GPUTarget("cuda", 90, 32)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _rand(*shape, dtype=BF16, grad=False):
    return torch.randn(*shape).to(dtype).requires_grad_(grad)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def dense(d, dtype, b=2, sq=128, sk=128, h=4, hk=2, backward=True, dv=None, **kw):
    """flash_attn_func forward (+ backward) of (b, sq, h, d) queries over (b, sk, hk, d) keys and (b, sk, hk, dv)
    values (dv: d by default)."""
    q = _rand(b, sq, h, d, dtype=dtype, grad=backward)
    k = _rand(b, sk, hk, d, dtype=dtype, grad=backward)
    v = _rand(b, sk, hk, dv or d, dtype=dtype, grad=backward)
    out = flashtile.flash_attn_func(q, k, v, **kw)
    if backward:
        out.float().sum().backward()


def varlen(d, dtype, lens_q=(70, 1, 130), lens_k=None, h=4, hk=2, backward=True, seqused=False, paged=None,
           dv=None, **kw):
    """flash_attn_varlen_func forward (+ backward); paged: page size of a paged K/V cache (forward only); dv: v's
    head dim (d by default)."""
    lens_k = lens_q if lens_k is None else lens_k
    q = _rand(sum(lens_q), h, d, dtype=dtype, grad=backward)
    extra = {}
    if paged:
        pages = [-(-n // paged) for n in lens_k]
        k, v = (_rand(sum(pages) + 1, paged, hk, w, dtype=dtype) for w in (d, dv or d))
        table = torch.zeros(len(lens_k), max(pages), dtype=torch.int32)
        first = 0
        for b, n in enumerate(pages):
            table[b, :n] = torch.arange(first, first + n)
            first += n
        extra["block_table"] = table
    else:
        k, v = (_rand(sum(lens_k), hk, w, dtype=dtype, grad=backward) for w in (d, dv or d))
    if seqused:
        extra.update(seqused_q=torch.tensor([max(n - 1, 0) for n in lens_q], dtype=torch.int32),
                     seqused_k=torch.tensor([max(n - 2, 0) for n in lens_k], dtype=torch.int32))
    out = flashtile.flash_attn_varlen_func(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k), **kw,
                                           **extra)
    if backward:
        out.float().sum().backward()


def kvcache(d, dtype, b=2, sq=1, h=16, hk=4, cap=512, page=None, append=1, splits=0, features=True, absorbed=0):
    """flash_attn_with_kvcache: sq new queries over a (cap-row) cache, contiguous or paged with `page`-row pages,
    appending `append` tokens; `features`: rotary, ALiBi, softcap, a window, cache_leftpad (and cache_batch_idx on
    a contiguous cache); `absorbed`: v_cache (and v) are views of k_cache's (and k's) first `absorbed` channels,
    an absorbed MLA cache."""
    kw = {}
    if page:
        n = cap // page
        k_cache, v_cache = (_rand(b * n, page, hk, d, dtype=dtype) for _ in range(2))
        kw["block_table"] = torch.arange(b * n, dtype=torch.int32).reshape(b, n)
    else:
        k_cache, v_cache = (_rand(b, cap, hk, d, dtype=dtype) for _ in range(2))
        if features:
            kw["cache_batch_idx"] = torch.arange(b, dtype=torch.int32).flip(0)
    q = _rand(b, sq, h, d, dtype=dtype)
    k, v = (_rand(b, append, hk, d, dtype=dtype) for _ in range(2)) if append else (None, None)
    seqlens = torch.full((b,), cap // 2, dtype=torch.int32)
    if features:
        rot = d // 2 if d >= 16 else d
        cos, sin = (torch.rand(cap, rot // 2).to(dtype) for _ in range(2))
        kw.update(rotary_cos=cos, rotary_sin=sin, alibi_slopes=torch.rand(h), softcap=10.0, window_size=(64, 0),
                  cache_leftpad=torch.full((b,), 3, dtype=torch.int32), learnable_sink=torch.rand(h),
                  attention_chunk=64)
    if absorbed:
        v_cache, v = k_cache[..., :absorbed], None if k is None else k[..., :absorbed]
    flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, num_splits=splits, **kw)


def scenarios():
    """(name, thunk) or (name, thunk, build) tuples; each thunk calls the API and so launches kernels, and
    build=False derives its specialisations without compiling them. Feature sets as the old matrix had
    them (no mask; causal; everything on: varlen, seqused, both window sides, softcap, ALiBi; paged), MHA and GQA
    both, so that GROUP 1 and 2 are built. Dense lengths are multiples of 16, which Triton marks as such (the common
    case: 1k, 4k), and varlen totals are not (the common case there), nor are the lengths of 1, 239 or 339 of the
    scenarios after them: both variants of each integer are built (Note [runtime integers])."""
    out = []
    every = dict(causal=True, window_size=(24, -1), softcap=8.0, attention_chunk=48)
    for d in sorted(TABLE["fwd"]):
        name = f"d{d}"
        out += [(f"{name} dense", lambda d=d: dense(d, BF16, h=4, hk=4)),
                (f"{name} causal", lambda d=d: dense(d, BF16, causal=True)),
                (f"{name} varlen causal", lambda d=d: varlen(d, BF16, h=2, hk=2, causal=True)),
                (f"{name} varlen everything", lambda d=d: varlen(
                    d, BF16, seqused=True, alibi_slopes=torch.rand(3, 4), **every)),
                (f"{name} everything", lambda d=d: dense(d, BF16, alibi_slopes=torch.rand(4), dropout_p=0.1,
                                                         learnable_sink=torch.rand(4), **every)),
                (f"{name} paged", lambda d=d: varlen(d, BF16, backward=False, paged=16, causal=True)),
                # fp32's true-fp32 dots take ptxas 20-70 s a kernel at d128 and d256: their backward and paged
                # forward only at d <= 64, where every kernel of the table builds in seconds.
                (f"{name} fp32 dense", lambda d=d: dense(d, FP32, h=4, hk=4, backward=d <= 64))]
        if d <= 64:
            out.append((f"{name} fp32 paged", lambda d=d: varlen(d, FP32, backward=False, paged=16, causal=True)))
        if d == 512:  # the fp32 tiles of the widest head dim must fit shared memory, spills or not
            out.append((f"{name} fp32 backward", lambda d=d: dense(d, FP32, h=2, hk=2)))
        # Lengths, batches and windows of 1 (Note [runtime integers]), and the shapes that crashed ptxas when Triton
        # specialised them: dense causal 239 x 1; one query over 339 keys, causal and local; a length-1 sequence;
        # one query per sequence, varlen; pages of one row. Their lengths are not multiples of 16: the variants
        # that builds are compiled at d64 (Triton) and d128 (Gluon); at the other head dims the scenarios only
        # derive their specialisations, which must turn no length into a constant.
        ones = [(f"{name} ones: 239x1 causal", lambda d=d: dense(d, BF16, sq=239, sk=1, causal=True)),
                (f"{name} ones: 239x1 causal dropout", lambda d=d: dense(d, BF16, sq=239, sk=1, causal=True,
                                                                         dropout_p=0.1)),
                (f"{name} ones: 1x339 local", lambda d=d: dense(d, BF16, sq=1, sk=339, window_size=(1, 1))),
                (f"{name} ones: b1 1x1", lambda d=d: dense(d, BF16, b=1, sq=1, sk=1, causal=True)),
                (f"{name} ones: varlen 8 x 1 over 219-239", lambda d=d: varlen(
                    d, BF16, lens_q=(1,) * 8, lens_k=(219, 222, 225, 228, 231, 234, 237, 239), h=2, hk=2,
                    causal=True)),
                (f"{name} ones: pages of 1", lambda d=d: varlen(
                    d, BF16, lens_q=(1, 5), backward=False, paged=1, causal=True))]
        out += [(n, thunk, d in (64, 128) and ("239x1" in n or "8 x 1" in n or (d == 64 and "local" in n)))
                for n, thunk in ones]
    # Dropout's S_dmask pass (return_attn_probs), dense and varlen with every flag.
    out += [(f"d{d} dropout probs", lambda d=d: flashtile.flash_attn_func(
        *(_rand(2, 70, 4, d) for _ in range(3)), dropout_p=0.1, return_attn_probs=True, **every))
        for d in (64, 128, 512)]
    out += [("d64 varlen dropout probs", lambda: flashtile.flash_attn_varlen_func(
        _rand(71, 4, 64), _rand(60, 2, 64), _rand(60, 2, 64), _cu((70, 1)), _cu((30, 30)), 70, 30, dropout_p=0.1,
        return_attn_probs=True, seqused_q=torch.tensor([60, 1], dtype=torch.int32), alibi_slopes=torch.rand(4),
        **every))]
    # fp32 with every feature where its true-fp32 dots compile in seconds (d <= 64; the features change none of
    # the dot code that costs the time at d128 and d256).
    out += [(f"d{d} fp32 varlen everything", lambda d=d: varlen(d, FP32, seqused=True, alibi_slopes=torch.rand(3, 4),
                                                                 **every)) for d in (16, 32, 64)]
    # Head dims below their tile (columns masked on load and store), strides that are not multiples of 16, fp16,
    # and the Gluon kernels' other mask and layout variants.
    out += [(f"d{d} varlen everything", lambda d=d: varlen(d, BF16, seqused=True, **every))
            for d in (8, 40, 96, 224)]
    out += [("d40 h3 odd strides", lambda: dense(40, BF16, h=3, hk=3, causal=True)),
            ("d64 fp16 causal", lambda: dense(64, FP16, causal=True)),
            ("d128 window", lambda: dense(128, BF16, window_size=(40, 8))),
            ("d128 varlen", lambda: varlen(128, BF16)),
            ("d128 varlen window", lambda: varlen(128, BF16, window_size=(40, 8))),
            ("d128 sink causal", lambda: dense(128, BF16, causal=True, learnable_sink=torch.rand(4))),
            ("d128 varlen sink window", lambda: varlen(128, BF16, window_size=(40, 8), learnable_sink=torch.rand(4))),
            ("d128 chunk causal", lambda: dense(128, BF16, causal=True, attention_chunk=48)),
            ("d128 chunk", lambda: dense(128, BF16, h=4, hk=4, attention_chunk=48)),
            ("d128 varlen chunk causal", lambda: varlen(128, BF16, h=2, hk=2, causal=True, attention_chunk=48)),
            # Dropout: the Gluon forward and dQ with the mask, the Triton dK/dV (Note [dropout on the Gluon path]).
            ("d128 dropout", lambda: dense(128, BF16, h=4, hk=4, dropout_p=0.1)),
            ("d128 dropout window sink", lambda: dense(128, BF16, window_size=(40, -1), dropout_p=0.1,
                                                       learnable_sink=torch.rand(4))),
            ("d128 varlen dropout window", lambda: varlen(128, BF16, window_size=(40, -1), dropout_p=0.1)),
            # d512's Gluon forward, whose consumers split the columns (kernels/hopper_fwd_wide.py).
            ("d512 varlen window sink", lambda: varlen(512, BF16, window_size=(40, 8), learnable_sink=torch.rand(4),
                                                       backward=False)),
            ("d512 chunk causal sink", lambda: dense(512, BF16, causal=True, attention_chunk=48,
                                                     learnable_sink=torch.rand(4), backward=False)),
            ("d512 dropout", lambda: dense(512, BF16, h=4, hk=4, dropout_p=0.1, backward=False)),
            ("d512 varlen dropout chunk", lambda: varlen(512, BF16, attention_chunk=48, dropout_p=0.1,
                                                         backward=False))]
    # head_dim_v != head_dim: MLA prefill (192, 128) on the Gluon forward's variants and with every feature
    # (config.NARROW_V's tiles), the pair (128, 64), v wider than q/k, and paged.
    out += [("d192 v128 causal", lambda: dense(192, BF16, dv=128, causal=True)),
            ("d192 v128 dense", lambda: dense(192, BF16, dv=128, h=4, hk=4)),
            ("d192 v128 varlen window sink", lambda: varlen(192, BF16, dv=128, window_size=(40, 8),
                                                            learnable_sink=torch.rand(4))),
            ("d192 v128 varlen chunk causal", lambda: varlen(192, BF16, dv=128, h=2, hk=2, causal=True,
                                                             attention_chunk=48)),
            ("d192 v128 varlen dropout chunk", lambda: varlen(192, BF16, dv=128, attention_chunk=48, dropout_p=0.1)),
            ("d192 v128 everything", lambda: dense(192, BF16, dv=128, alibi_slopes=torch.rand(4), dropout_p=0.1,
                                                   learnable_sink=torch.rand(4), **every)),
            ("d192 v128 varlen everything", lambda: varlen(192, BF16, dv=128, seqused=True,
                                                           alibi_slopes=torch.rand(3, 4), **every)),
            ("d128 v64 varlen everything", lambda: varlen(128, BF16, dv=64, seqused=True, **every)),
            ("d64 v128 dense", lambda: dense(64, BF16, dv=128)),
            ("d192 v128 paged", lambda: varlen(192, BF16, dv=128, backward=False, paged=16, causal=True))]
    # Decode: every tile of DECODE_TABLE's (BLOCK_M from one token's GQA group up to the table's), contiguous,
    # paged with pages smaller than a key tile and paged with whole tiles, every flag on; the plain step with one
    # split (output in q's dtype) and several (fp32 partials and combine); fp32; the append kernel's variants.
    # The 1024-wide tile is DeepSeek's absorbed MLA decode's: q/k 576 over a v_cache view of 512 channels
    # (whose combine is d512's).
    for d in sorted(DECODE_TABLE):
        cfg = decode_config(d)
        v_view = 512 if d == 1024 else 0
        d = 576 if d == 1024 else d
        for page in (None, 1, 256):
            sq = 1
            while True:
                block_m = packed_tile(4, sq, cfg)[0]
                out.append((f"decode d{d} page {page} rows {block_m}", lambda d=d, p=page, s=sq, a=v_view: kvcache(
                    d, BF16, sq=s, page=p, append=1, absorbed=a)))
                if block_m >= cfg.block_m:
                    break
                sq *= 8 if sq == 1 else 2
        out += [(f"decode d{d} plain", lambda d=d, a=v_view: kvcache(d, BF16, features=False, append=0, splits=1,
                                                                      absorbed=a)),
                (f"decode d{d} plain split", lambda d=d, a=v_view: kvcache(d, BF16, features=False, splits=4,
                                                                            absorbed=a)),
                (f"decode d{d} fp32", lambda d=d, a=v_view: kvcache(d, FP32, features=False, splits=4, absorbed=a))]
        if not v_view:
            out += [(f"combine d{d}", lambda d=d: flashtile.combine(torch.randn(3, 2, 5, 4, d),
                                                                    torch.randn(3, 2, 4, 5), BF16)),
                    (f"combine d{d} many rows", lambda d=d: flashtile.combine(torch.randn(2, 8, 64, 16, d),
                                                                              torch.randn(2, 8, 16, 64)))]
    # Absorbed MLA caches with every query head on one latent head (DeepSeek: 16-128 heads), contiguous and paged:
    # DeepSeek's own 576/512, and q/k 192 over a 128-wide view.
    out += [(f"decode d{d} v{dv} absorbed h{h} page {page}", lambda d=d, dv=dv, h=h, p=page: kvcache(
        d, BF16, h=h, hk=1, page=p, features=False, splits=0, absorbed=dv))
        for d, dv, h in ((576, 512, 128), (192, 128, 16)) for page in (None, 64)]
    return out


def specialise(launch) -> tuple:
    """(kernel, signature, constexprs, attrs, options) of a recorded launch, as Triton's launcher derives them for
    an sm_90 device (JITFunction.run: its binder, then _pack_args)."""
    fn = launch.kernel
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, dict(launch.kwargs), bound, specialization,
                                                          options)
    return fn, signature, constexprs, attrs, options


def _key(spec) -> str:
    fn, signature, constexprs, attrs, options = spec
    return repr((fn.__name__, sorted(signature.items()), sorted((k, repr(v)) for k, v in constexprs.items()),
                 sorted((k, repr(v)) for k, v in attrs.items()), sorted(options.__dict__.items())))


def group(spec) -> str:
    """Which test_compile group builds a compile: kernel family and padded head dim."""
    fn, _, constexprs, _, _ = spec
    name = fn.__name__
    by_name = {fn.arg_names[path[0]]: v for path, v in constexprs.items()}
    d = by_name.get("BLOCK_D", by_name.get("HEAD_DIM", 0))
    if name == "_hopper_fwd_wide_kernel":  # a group of its own, so that a second worker builds it
        return "hopper-wide"
    if name.startswith("_hopper"):
        return "hopper"
    if name in ("_decode_kernel", "_append_kv_kernel", "_combine_kernel"):
        return f"decode-{d}"
    if name == "_plan_kernel":
        return "plan"
    return f"prefill-{d}"


GROUPS = (["plan", "hopper", "hopper-wide"] + [f"prefill-{d}" for d in sorted(TABLE["fwd"])]
          + [f"decode-{d}" for d in sorted(DECODE_TABLE)])


def collect() -> dict[str, tuple]:
    """Every distinct compile the scenarios launch: key -> (spec, scenarios that launch it, whether each wants it
    built)."""
    specs: dict[str, tuple] = {}
    torch.manual_seed(0)
    for name, thunk, *build in scenarios():
        with capture_launches() as launches:
            thunk()
        assert launches, f"scenario {name!r} launched nothing"
        for launch in launches:
            spec = specialise(launch)
            entry = specs.setdefault(_key(spec), (spec, [], []))
            entry[1].append(name)
            entry[2].append(build[0] if build else True)
    return specs


def _ptxas(log: str) -> dict:
    """Registers, spill bytes and serialised-wgmma warnings from ptxas -v's log (Triton runs ptxas with -v)."""
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
    # "wgmma.mma_async instructions are serialized due to ..." (C7511, C7512, ...), or an injected
    # warpgroup.wait (C7517): ptxas waits after every wgmma, which may not happen in a production kernel.
    serialized = "instructions are serialized" in log or "warpgroup.wait is injected" in log
    return {"registers": max(regs, default=0), "spill_stores": max(spills, default=0),
            "wgmma_serialized": serialized}


def build_compiled(spec, log=None):
    """The compiled kernel of a spec (ptxas's -v log into `log`, a StringIO, if given)."""
    fn, signature, constexprs, attrs, options = spec
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else triton.compiler.ASTSource
    src = source(fn, signature, constexprs, attrs)
    knobs.nvidia.dump_ptxas_log = log is not None
    with contextlib.redirect_stdout(log if log is not None else io.StringIO()):
        return triton.compile(src, target=TARGET, options=options.__dict__)


def build(spec) -> dict:
    fn, signature, constexprs, attrs, options = spec
    log = io.StringIO()
    start = time.perf_counter()
    compiled = build_compiled(spec, log)
    seconds = time.perf_counter() - start
    ptx = compiled.asm["ptx"]
    row = {"kernel": fn.__name__, "shared": compiled.metadata.shared, "wgmma": "wgmma" in ptx,
           "tma": "cp.async.bulk.tensor" in ptx, "setmaxnreg": "setmaxnreg" in ptx,
           "num_warps": options.num_warps, "num_stages": options.num_stages, "seconds": round(seconds, 1),
           "shared_accesses": len(re.findall(r"\b(?:ld|st)\.shared", ptx)),
           "barriers": len(re.findall(r"\b(?:bar|barrier)\.sync", ptx))}
    return row | describe(spec) | _ptxas(log.getvalue())


def describe(spec) -> dict:
    """A spec's constexprs, and the integer arguments Triton turned into constants (a value of 1: Note [runtime
    integers])."""
    fn, _, constexprs, _, _ = spec
    by_name = {fn.arg_names[path[0]]: v for path, v in constexprs.items()}
    row = {name: v for name, v in by_name.items() if name.isupper() and v is not None}
    row["ints_as_constants"] = sorted(name for name, v in by_name.items() if not name.isupper()
                                      and isinstance(v, int) and not isinstance(v, bool))
    return row


def main(argv):
    specs = collect()
    chosen = argv[argv.index("--group") + 1] if "--group" in argv else None
    for key, (spec, names, wanted) in specs.items():
        g = group(spec)
        assert g in GROUPS, f"{spec[0].__name__} falls in no compile group ({g})"
        if chosen is not None and g != chosen:
            continue
        built = any(wanted) and "--list" not in argv
        row = build(spec) if built else {"kernel": spec[0].__name__, **describe(spec)}
        row |= {"group": g, "built": built,
                "scenarios": names[:3] + ([f"... {len(names) - 3} more"] if len(names) > 3 else [])}
        print(json.dumps(row, default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
