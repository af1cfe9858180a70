"""Every entry point once, on small shapes, for NVIDIA's compute-sanitizer (memcheck, racecheck, synccheck):

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/sanitize.py
    compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 1 python3 tools/sanitize.py --small

Covers the Triton and the Gluon (sm_90) kernels: dense forward+backward at head dims 64 (Triton), 128 (Gluon) and
256 (Triton, whose backward's dK/dV kernel runs beside dQ through PDL), causal and windowed; varlen forward+backward
through the persistent Gluon kernels (one query per sequence among them) and the Triton ones; paged varlen;
KV-cache decode with append, rotary and pages; combine; the features (dropout at d64 and on the Gluon forward and
dQ at d128, learnable sinks, chunked attention, head_dim_v 192/128, head dim 512, DeepSeek's absorbed 576/512 decode).
--small halves the shapes (racecheck is slow); --only runs some of the sections (dense, varlen, paged, kvcache,
combine, features) and --head-dims some of the dense and varlen head dims, and --forward runs no backward, so that
a sanitizer's report can be narrowed to one kernel. Prints one line per call; the sanitizer's own report says what
it found.
"""

import argparse
import sys

import torch

import flashtile


SECTIONS = ["dense", "varlen", "paged", "kvcache", "combine", "features"]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections to run")
    parser.add_argument("--head-dims", default="64,128,256", help="dense and varlen head dims (64, 128, 256)")
    parser.add_argument("--forward", action="store_true", help="run no backward")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    if only - set(SECTIONS):
        parser.error(f"unknown sections {sorted(only - set(SECTIONS))}; choose from {SECTIONS}")
    head_dims = [int(d) for d in args.head_dims.split(",")]
    s = 160 if args.small else 300
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, grad=False):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(grad)

    for d in head_dims if "dense" in only else ():
        for kw in (dict(causal=True), dict(window_size=(37, 11))):
            q, k, v = randn(2, s, 4, d, grad=True), randn(2, s + 17, 2, d, grad=True), randn(2, s + 17, 2, d,
                                                                                               grad=True)
            out = flashtile.flash_attn_func(q, k, v, **kw)
            if not args.forward:
                out.float().sum().backward()
            print(f"dense d{d} {kw}: {flashtile.last_kernel_paths()}", flush=True)
    for d in [d for d in head_dims if d != 256] if "varlen" in only else ():
        for lens_q, lens_k in (([1] * 8, [219, 222, 225, 228, 231, 234, 237, 239]), ([s, 0, 129, 1, 65], None)):
            lens_k = lens_k or lens_q
            q, k, v = randn(sum(lens_q), 4, d, grad=True), randn(sum(lens_k), 2, d, grad=True), randn(
                sum(lens_k), 2, d, grad=True)
            out = flashtile.flash_attn_varlen_func(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k),
                                                   causal=True)
            if not args.forward:
                out.float().sum().backward()
            print(f"varlen d{d} {len(lens_q)} sequences: {flashtile.last_kernel_paths()}", flush=True)
    pages = randn(12, 64, 2, 128), randn(12, 64, 2, 128)
    table = torch.arange(12, dtype=torch.int32, device="cuda").reshape(3, 4)
    lens = [200, 1, 77]
    if "paged" in only:
        flashtile.flash_attn_varlen_func(randn(sum(lens), 4, 128), *pages, _cu(lens), _cu(lens), 200, 200,
                                         causal=True, block_table=table)
        print("paged varlen d128", flush=True)
    cos, sin = (torch.rand(256, 32, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    caches = ((table, *pages), (None, randn(3, 256, 2, 128), randn(3, 256, 2, 128))) if "kvcache" in only else ()
    for table_or_none, k_cache, v_cache in caches:
        out = flashtile.flash_attn_with_kvcache(
            randn(3, 2, 8, 128), k_cache, v_cache, randn(3, 2, 2, 128), randn(3, 2, 2, 128), rotary_cos=cos,
            rotary_sin=sin, cache_seqlens=torch.tensor([100, 0, 253], dtype=torch.int32, device="cuda"),
            block_table=table_or_none, causal=True, num_splits=3)
        print(f"kvcache {'paged' if table_or_none is not None else 'contiguous'}", flush=True)
    if "combine" in only:
        flashtile.combine(torch.randn(3, 2, 5, 4, 64, device="cuda"), torch.randn(3, 2, 4, 5, device="cuda"))
        print("combine", flush=True)
    features = (("dropout", 64, 64, dict(dropout_p=0.1, causal=True)),
                ("dropout", 128, 128, dict(dropout_p=0.1, window_size=(70, -1))),  # Gluon forward and dQ on sm_90
                ("sinks", 128, 128, dict(learnable_sink=torch.randn(4, device="cuda", generator=g), causal=True)),
                ("chunk", 128, 128, dict(attention_chunk=96, causal=True)),
                ("head_dim_v", 192, 128, dict(causal=True)),
                ("d512", 512, 512, dict(window_size=(70, 3)))) if "features" in only else ()
    for name, d, dv, kw in features:
        q, k, v = randn(2, s, 4, d, grad=True), randn(2, s + 17, 2, d, grad=True), randn(2, s + 17, 2, dv, grad=True)
        out = flashtile.flash_attn_func(q, k, v, **kw)
        if not args.forward:
            out.float().sum().backward()
        print(f"{name} d{d}/{dv}: {flashtile.last_kernel_paths()}", flush=True)
    if "features" in only:
        latent = randn(12, 64, 1, 576)
        new = randn(3, 1, 1, 576)
        flashtile.flash_attn_with_kvcache(randn(3, 1, 16, 576), latent, latent[..., :512], new, new[..., :512],
                                          cache_seqlens=torch.tensor([100, 0, 253], dtype=torch.int32,
                                                                     device="cuda"),
                                          block_table=table, num_splits=3)
        print("absorbed MLA decode 576/512", flush=True)
    torch.cuda.synchronize()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
