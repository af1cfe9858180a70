"""Decode tile and split tuning on the GPU: one knob at a time from the table's config, under CUDA-graph replay.

Knobs: the d128 decode tile (BLOCK_N, warps, stages), PAGED_EXTRA_STAGES and PROGRAMS_PER_SM (the split
heuristic). Cases: the decode preset's corners (GQA 32/8, d128, Sq=1, 256k cached tokens as 2 x 128k, 8 x 32k and
64 x 4k), contiguous and paged. Prints K/V read bandwidth (TB/s) per knob setting and case, and writes JSON.

With --splits: the number of KV splits swept at the table's tile, for batches 2..64 of 256k cached tokens; each
row shows the programs launched per resident slot (4 per SM at d128: registers) next to the bandwidth, which is how
wave quantisation shows (a launch of 1.03 waves runs its last 3% on few SMs).

With --mla: the same sweep for absorbed MLA decode (16 query heads on one 576-wide latent head, v its first 512
channels; batches 16-64 of 4k-32k tokens, contiguous and 64-token pages), the heuristic's pick (auto) first: how
ops/decode.py's PARTIAL_SHARE was measured. TB/s counts each cache byte once.

With --mla-tiles: the 16-head MLA decode tile of paged caches (config.DECODE_TABLE[1024]: BLOCK_N, warps, stages;
contiguous ones take config.DECODE_KEYS_M's, Note [keys-major decode] in ops/decode.py) one setting at a time,
each with the register cap of decode_launch_opts (128 a thread at 4 warps, so that PROGRAMS_PER_SM programs fit an
SM) and without it, splits by the heuristic; each row also gives the decode kernel's registers, spill bytes
and shared memory as the GPU built it, which bound the programs an SM holds.

Usage (GPU): PYTHONPATH=src python3 tools/tune_decode.py [--json PATH] [--splits | --mla | --mla-tiles]
"""

import argparse
import dataclasses
import json

import torch
import triton

import flashtile
from flashtile import config
from flashtile.ops import decode as decode_ops

CASES = [(2, 131072), (8, 32768), (64, 4096)]
PAGES = (0, 16, 256)


def _inputs(batch, seqlen, page_size, hk=8, h=32, d=128):
    q = torch.randn(batch, 1, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch * seqlen, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    if not page_size:
        return q, k.view(batch, seqlen, hk, d), v.view(batch, seqlen, hk, d), seqlens, None
    pages = batch * seqlen // page_size
    table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, -1)
    return (q, k.view(pages, page_size, hk, d), v.view(pages, page_size, hk, d), seqlens, table)


def _tbps(batch, seqlen, page_size, num_splits=0, inputs=None):
    q, k, v, seqlens, table = inputs or _inputs(batch, seqlen, page_size)

    def run():
        flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table, causal=True,
                                          num_splits=num_splits)

    run()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(run, rep=20)
    return 2 * k.numel() * k.element_size() / ms / 1e9


SPLIT_CANDIDATES = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64)


def sweep_splits(json_path):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    slots = decode_ops.PROGRAMS_PER_SM * sms
    rows = []
    for batch in (2, 4, 8, 16, 32, 64):
        seqlen = 262144 // batch
        units = batch * 8
        auto = decode_ops.auto_num_splits(units, seqlen // config.DECODE_TABLE[128].block_n, sms)
        for page in (0, 16, 256):
            inputs = _inputs(batch, seqlen, page)
            line = []
            for splits in sorted({auto, *SPLIT_CANDIDATES}):
                if units * splits > 4 * slots:
                    continue
                tbps = _tbps(batch, seqlen, page, splits, inputs)
                rows.append(dict(batch=batch, seqlen=seqlen, page_size=page, splits=splits, auto=auto,
                                 waves=units * splits / slots, tbps=tbps))
                line.append(f"{splits}{'*' if splits == auto else ''}:{tbps:.2f}({units * splits / slots:.2f})")
            del inputs
            print(f"b{batch:<3d} p{page:<4d} " + " ".join(line), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), slots=slots, rows=rows), f, indent=1)


MLA_SPLITS = (4, 8, 12, 16, 20, 24, 32, 48, 64)


def _latent_caches(batch, seqlen, page, d):
    """Two absorbed MLA caches of (batch, seqlen) tokens, d channels on one latent head, contiguous or in `page`-
    token pages (with a shuffled block table): the sweeps read one after the other in a replay, so that the L2
    cannot serve a 4k cache."""
    caches = []
    for _ in range(2):
        latent = torch.randn(batch * seqlen, 1, d, device="cuda", dtype=torch.bfloat16)
        if page:
            pages = batch * seqlen // page
            table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, -1)
            caches.append((latent.view(pages, page, 1, d), table))
        else:
            caches.append((latent.view(batch, seqlen, 1, d), None))
    return caches


def sweep_mla(json_path, heads=16, d=576, dv=512):
    """The splits of each case, the heuristic's (0: auto) first, over two copies of its cache (_latent_caches)."""
    rows = []
    for page in (0, 64):
        for batch in (16, 32, 64):
            for seqlen in (4096, 8192, 16384, 32768):
                caches = _latent_caches(batch, seqlen, page, d)
                q = torch.randn(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16)
                seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
                nbytes = batch * seqlen * d * 2
                line = []
                for splits in (0, *MLA_SPLITS):
                    def run():
                        for k, table in caches:
                            flashtile.flash_attn_with_kvcache(q, k, k[..., :dv], cache_seqlens=seqlens,
                                                              block_table=table, causal=True, num_splits=splits)
                    run()
                    torch.cuda.synchronize()
                    tbps = 2 * nbytes / triton.testing.do_bench_cudagraph(run, rep=20) / 1e9
                    torch.cuda.synchronize()
                    rows.append(dict(batch=batch, seqlen=seqlen, page_size=page, splits=splits, tbps=tbps))
                    line.append(f"{splits or 'auto'}:{tbps:.2f}")
                del caches
                print(f"b{batch:<3d} {seqlen // 1024:>2d}k p{page:<3d} " + " ".join(line), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


MLA_TILES = ((32, 4, 2), (32, 4, 3), (16, 4, 3), (16, 4, 4), (16, 4, 5), (32, 8, 2), (32, 8, 3), (16, 8, 4),
             (64, 8, 2))
MLA_TILE_CASES = ((16, 4096, 64), (16, 8192, 64), (16, 32768, 64), (32, 4096, 64), (64, 4096, 64),
                  (64, 32768, 64))


def sweep_mla_tiles(json_path, heads=16, d=576, dv=512):
    """TB/s of the 16-head absorbed decode for each (BLOCK_N, warps, stages) of MLA_TILES, capped and not."""
    base = config.DECODE_TABLE[1024]
    defaults = {name: getattr(decode_ops, name) for name in ("MIN_MAXNREG", "launch_direct")}
    built = {}

    def recording_launch(kernel, grid, *args, **kwargs):  # the compiled kernel of the decode launch, for its stats
        compiled = kernel[grid](*args, **kwargs)
        if kernel.__name__ == "_decode_kernel":
            built["decode"] = compiled

    decode_ops.launch_direct = recording_launch
    inputs = {}
    for batch, seqlen, page in MLA_TILE_CASES:
        caches = _latent_caches(batch, seqlen, page, d)
        q = torch.randn(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16)
        seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
        inputs[batch, seqlen, page] = (q, caches, seqlens, 2 * batch * seqlen * d * 2)
    print("tile (n, warps, stages) cap  " + "  ".join(f"b{b}x{s // 1024}k/p{p}" for b, s, p in MLA_TILE_CASES)
          + "  regs/spill/smem", flush=True)
    rows = []
    try:
        for block_n, warps, stages in MLA_TILES:
            config.DECODE_TABLE[1024] = dataclasses.replace(base, block_n=block_n, num_warps=warps,
                                                            num_stages=stages)
            # decode_launch_opts caps registers only where the cap leaves MIN_MAXNREG (not at 8 warps): one run there.
            budget = decode_ops.REGISTERS_PER_SM // (decode_ops.PROGRAMS_PER_SM * 32 * warps)
            for capped in (True, False) if budget >= defaults["MIN_MAXNREG"] else (False,):
                decode_ops.MIN_MAXNREG = defaults["MIN_MAXNREG"] if capped else 256  # 256: no cap applies
                speeds, stats = [], ""
                for case, (q, caches, seqlens, nbytes) in inputs.items():
                    def run():
                        for k, table in caches:
                            flashtile.flash_attn_with_kvcache(q, k, k[..., :dv], cache_seqlens=seqlens,
                                                              block_table=table, causal=True)
                    try:
                        run()
                        torch.cuda.synchronize()
                        tbps = nbytes / triton.testing.do_bench_cudagraph(run, rep=20) / 1e9
                    except Exception as e:  # a tile that does not compile or fit is a result, not a crash
                        print(f"  ({block_n}, {warps}, {stages}) {case}: {type(e).__name__}: {str(e)[:120]}")
                        tbps = float("nan")
                    if not stats:  # the first case's build (the interpreter builds nothing)
                        c = built.pop("decode", None)
                        stats = f"{c.n_regs}/{c.n_spills}/{c.metadata.shared}" if hasattr(c, "n_regs") else "n/a"
                    speeds.append(tbps)
                    rows.append(dict(block_n=block_n, num_warps=warps, num_stages=stages, capped=capped,
                                     batch=case[0], seqlen=case[1], page_size=case[2], tbps=tbps, stats=stats))
                print(f"({block_n:2d}, {warps}, {stages}) {'cap' if capped else 'free':4s}    "
                      + "  ".join(f"{x:10.2f}" for x in speeds) + f"  {stats}", flush=True)
    finally:
        config.DECODE_TABLE[1024] = base
        for name, value in defaults.items():
            setattr(decode_ops, name, value)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), base=dataclasses.asdict(base), rows=rows), f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--splits", action="store_true")
    ap.add_argument("--mla", action="store_true")
    ap.add_argument("--mla-tiles", action="store_true")
    args = ap.parse_args()
    if args.splits:
        return sweep_splits(args.json)
    if args.mla:
        return sweep_mla(args.json)
    if args.mla_tiles:
        return sweep_mla_tiles(args.json)
    base = config.DECODE_TABLE[128]
    settings = [("table", {}, {})]
    for bn in (32, 128):
        settings.append((f"block_n={bn}", {"block_n": bn}, {}))
    settings.append(("warps=8", {"num_warps": 8}, {}))
    for st in (2, 4, 5):
        settings.append((f"stages={st}", {"num_stages": st}, {}))
    for pps in (2, 8):
        settings.append((f"programs/SM={pps}", {}, {"PROGRAMS_PER_SM": pps}))
    for extra in (0, 1):
        settings.append((f"paged+stages={extra}", {}, {"PAGED_EXTRA_STAGES": extra}))
    defaults = {name: getattr(decode_ops, name) for name in ("PROGRAMS_PER_SM", "PAGED_EXTRA_STAGES")}
    rows = []
    header = "setting              " + "  ".join(f"b{b}x{s // 1024}k/p{p:<3d}" for b, s in CASES for p in PAGES)
    print(header)
    for name, tile, module in settings:
        config.DECODE_TABLE[128] = dataclasses.replace(base, **tile)
        for key, value in dict(defaults, **module).items():
            setattr(decode_ops, key, value)
        speeds = []
        for b, s in CASES:
            for p in PAGES:
                try:
                    speeds.append(_tbps(b, s, p))
                except Exception as e:  # a config that does not compile or fit is a result, not a crash
                    print(f"  {name} b{b} s{s} p{p}: {type(e).__name__}: {str(e)[:120]}")
                    speeds.append(float("nan"))
                rows.append(dict(setting=name, batch=b, seqlen=s, page_size=p, tbps=speeds[-1]))
        print(f"{name:20s} " + "  ".join(f"{x:12.2f}" for x in speeds), flush=True)
    config.DECODE_TABLE[128] = base
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), base=dataclasses.asdict(base), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
