"""Benchmark: our Triton tile-list kernels vs FlexAttention (torch.compile) vs cuDNN SDPA, one GPU.

bf16, Hq=32, Hkv=8, D=128, batch 1. Masks: megatron_cp.masks.catalog.KERNEL_MASKS (same cells for every
implementation: tile lists for ours, mask_mod/BlockMask for Flex, is_causal for cuDNN on dense masks).
TFLOP/s with FLOPs = 4 * kept_area * Hq * D forward, 2.5x that backward; times are medians of
triton.testing.do_bench (CUDA events). Backward times exclude the forward (Flex/cuDNN: autograd.grad on a
retained graph; ours: backend.backward incl. its delta = rowsum(dout*out) preprocessing).
cuDNN runs with K/V expanded to Hq heads (outside the timed region). Every impl of ours records the path
it ran (cudnn / cudnn+triton / triton) and the block configs of its Triton kernels ("configs").

--tune times candidate block configs per phase instead (others at their defaults) and writes the fastest
per row class as DIR/tuned_configs.json, the format ``--configs`` (and ``configs_from_json``) reads.

Usage: python tools/bench_kernels.py [--seqlens 16384] [--masks ...] [--out DIR] [--tune] [--configs JSON]
       python tools/bench_kernels.py --device cpu --tiny --out /tmp/bk   # CPU dry run
Writes DIR/bench_kernels.json and DIR/bench_kernels.png (device, date and command inside).
The CPU dry run (Triton's interpreter; fp16, Hq=4, Hkv=1, D=32, S=256, 32 x 32 blocks, one timed call
each) checks that the program runs end to end; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _interpret_on_cpu():
    """--device cpu runs our kernels in Triton's interpreter, which must be on before triton is imported."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--device", default="cuda")
    if ap.parse_known_args()[0].device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"


_interpret_on_cpu()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from megatron_cp.masks import catalog  # noqa: E402
from megatron_cp.kernels import (  # noqa: E402
    DEFAULT_CONFIGS, KernelConfig, PhaseConfigs, TritonBackend, TritonConfig, configs_from_json, kept_area,
)

HQ, HKV, D = 32, 8, 128
DEVICE = "cuda"  # --device cpu --tiny: "cpu" and the tiny sizes of main()
# the CPU dry run uses fp16: Triton's interpreter computes bf16 tl.dot wrongly (garbage products)
DTYPE = torch.bfloat16


BENCH_MS = {"warmup": 50, "rep": 200}  # --tune uses shorter runs


def bench(fn):
    """Median milliseconds of fn(); on the CPU dry run one wall-clock call (callers ran fn once before)."""
    if DEVICE == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=BENCH_MS["warmup"], rep=BENCH_MS["rep"], return_mode="median")


def empty_cache():
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def make_inputs(s, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(s, HQ, D, device=DEVICE, dtype=DTYPE, generator=g)
    k = torch.randn(s, HKV, D, device=DEVICE, dtype=DTYPE, generator=g)
    v = torch.randn(s, HKV, D, device=DEVICE, dtype=DTYPE, generator=g)
    do = torch.randn(s, HQ, D, device=DEVICE, dtype=DTYPE, generator=g)
    return q, k, v, do


def time_ours(be, tiles, s, q, k, v, do):
    """(fwd ms, bwd ms) of backend be."""
    return time_ours_rect(be, tiles, s, s, q, k, v, do)


def time_ours_rect(be, tiles, sq, sk, q, k, v, do):
    """time_ours for sq != sk (zigzag rank tile lists). The first forward and backward are untimed: compiles,
    device schedules and the cuDNN probe of a new (dtype, head_dim, Hq / Hkv) family."""
    prep = be.prepare(tiles, sq, sk, head_dims=(D,))
    be.last_configs.clear()  # so that it holds this case's configs afterwards
    out, lse = be.forward(q, k, v, prep)
    be.backward(q, k, v, out, lse, do, prep)  # compile + build device schedules outside timing
    tf = bench(lambda: be.forward(q, k, v, prep))
    tb = bench(lambda: be.backward(q, k, v, out, lse, do, prep))
    return tf, tb


def cfg_list(c):
    return [c.block_m, c.block_n, c.num_warps, c.num_stages, int(c.tma)]


def ours_record(b, tf, tb, ff):
    """Result dict of one of our backends: times, TFLOP/s, path and the block configs its kernels ran with."""
    return {"fwd_ms": tf, "bwd_ms": tb, "fwd_tflops": ff / tf / 1e9, "bwd_tflops": 2.5 * ff / tb / 1e9,
            "path": b.last_path, "configs": {ph: cfg_list(c) for ph, c in b.last_configs.items()}}


def cudnn_status(be):
    """What the cuDNN probe found per (device, dtype, head_dim, Hq / Hkv) family: a layout or why not."""
    return {str(tuple(map(str, key))): found.layout or found.reason for key, found in be.cudnn_probes.items()}


def zigzag_rank_tiles(s: int, cp: int, rank: int) -> torch.Tensor:
    """Causal zigzag: 2*cp chunks of s/(2cp); rank r holds chunks r and 2cp-1-r as its q rows, keys are the
    whole sequence (an all-gathered K/V buffer): one bottom-right causal tile [0, end of chunk) per chunk."""
    c = s // (2 * cp)
    t = []
    for i, ch in enumerate((rank, 2 * cp - 1 - rank)):
        t.append([i * c, (i + 1) * c, 0, (ch + 1) * c, 1])
    return torch.tensor(t, dtype=torch.int32)


_flex = None


def time_flex(name, s, q, k, v, do):
    global _flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex is None:
        torch._dynamo.config.cache_size_limit = 128
        torch._dynamo.config.accumulated_cache_size_limit = 512
        _flex = torch.compile(flex_attention, dynamic=False)
    mod = None if name == "full" else catalog.mask_mod(name, s, "cuda")  # full: Flex without a mask
    bm = None if mod is None else create_block_mask(mod, None, None, s, s, device="cuda")
    qf, kf, vf, dof = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v, do))
    qf.requires_grad_(True)
    kf.requires_grad_(True)
    vf.requires_grad_(True)
    with torch.no_grad():
        tf = None
        _flex(qf, kf, vf, block_mask=bm, enable_gqa=True)
        tf = bench(lambda: _flex(qf, kf, vf, block_mask=bm, enable_gqa=True))
    o = _flex(qf, kf, vf, block_mask=bm, enable_gqa=True)
    torch.autograd.grad(o, (qf, kf, vf), dof, retain_graph=True)
    tb = bench(lambda: torch.autograd.grad(o, (qf, kf, vf), dof, retain_graph=True))
    return tf, tb


def time_cudnn(is_causal, q, k, v, do):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = HQ // HKV
    qf, dof = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, do))
    kf, vf = (x.repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0).contiguous() for x in (k, v))
    qf.requires_grad_(True)
    kf.requires_grad_(True)
    vf.requires_grad_(True)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        with torch.no_grad():
            tf = bench(lambda: F.scaled_dot_product_attention(qf, kf, vf, is_causal=is_causal))
        o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=is_causal)
        torch.autograd.grad(o, (qf, kf, vf), dof, retain_graph=True)
        tb = bench(lambda: torch.autograd.grad(o, (qf, kf, vf), dof, retain_graph=True))
    return tf, tb


TUNE_FWD = [KernelConfig(128, 128, 8, 3), KernelConfig(64, 64, 4, 3), KernelConfig(128, 128, 8, 3, True),
            KernelConfig(128, 64, 8, 3, True), KernelConfig(64, 64, 4, 3, True), KernelConfig(128, 64, 4, 3, True),
            KernelConfig(64, 128, 4, 3, True), KernelConfig(64, 64, 4, 4, True)]
TUNE_DKDV = [KernelConfig(32, 64, 4, 3), KernelConfig(32, 64, 4, 3, True), KernelConfig(64, 64, 4, 3, True),
             KernelConfig(64, 128, 8, 3, True), KernelConfig(64, 64, 4, 4, True), KernelConfig(32, 128, 4, 3, True),
             KernelConfig(64, 128, 4, 3, True)]
TUNE_DQ = [KernelConfig(64, 64, 4, 3), KernelConfig(64, 64, 4, 3, True), KernelConfig(128, 64, 8, 3, True),
           KernelConfig(128, 128, 8, 3, True), KernelConfig(64, 64, 4, 4, True), KernelConfig(64, 128, 4, 3, True),
           KernelConfig(128, 64, 4, 3, True)]
SHORT_MASKS = ("docs_causal", "sliding_window_1024", "streaming_1024", "global_local_512", "strided_512x4")


def pick_best(rows):
    """Per row class ('long': causal/full/block_causal rows, 'short': the rest), the fastest config of each
    stage (fwd by forward time; dkdv and dq by backward time), as configs_from_json input."""
    best = {}
    for cls in ("long", "short"):
        st = {}
        for stage, key in (("fwd", "fwd_ms"), ("dkdv", "bwd_ms"), ("dq", "bwd_ms")):
            tot = {}
            for r in rows:
                if r["stage"] == stage and (r["mask"] in SHORT_MASKS) == (cls == "short"):
                    tot.setdefault(tuple(r["cfg"]), []).append(r[key])
            full = [c for c, v in tot.items() if len(v) == max(map(len, tot.values()))]
            if full:
                st[stage] = list(min(full, key=lambda c: sum(tot[c])))
        if len(st) == 3:
            best[f"{D}/{cls}"] = st
    return best


def tune(s, masks):
    """Time each candidate config per stage (others at default); prints a table, returns rows."""
    q, k, v, do = make_inputs(s)
    base = DEFAULT_CONFIGS[(D, "long")]
    rows = []
    for stage, cands in (("fwd", TUNE_FWD), ("dkdv", TUNE_DKDV), ("dq", TUNE_DQ)):
        for c in cands:
            sc = PhaseConfigs(c if stage == "fwd" else base.fwd, c if stage == "dkdv" else base.dkdv,
                              c if stage == "dq" else base.dq)
            be = TritonBackend(TritonConfig({D: sc}, dense_fast_path=False))
            for name in masks:
                tiles = catalog.tiles(catalog.build(name, s))
                try:
                    tf, tb = time_ours(be, tiles, s, q, k, v, do)
                except Exception as e:  # noqa: BLE001  (e.g. out of shared memory)
                    print(f"tune {stage} {c} {name}: {type(e).__name__} {str(e)[:80]}", flush=True)
                    continue
                area = kept_area(tiles)
                ff = 4 * area * HQ * D
                r = {"stage": stage, "cfg": [c.block_m, c.block_n, c.num_warps, c.num_stages, int(c.tma)], "mask": name,
                     "fwd_tflops": ff / tf / 1e9, "bwd_tflops": 2.5 * ff / tb / 1e9, "fwd_ms": tf, "bwd_ms": tb}
                rows.append(r)
                print(f"tune {stage:4s} {r['cfg']} {name:15s} fwd {r['fwd_tflops']:6.1f} bwd {r['bwd_tflops']:6.1f}",
                      flush=True)
            empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", type=int, nargs="+", default=[16384])
    ap.add_argument("--masks", nargs="+", default=list(catalog.KERNEL_MASKS))
    ap.add_argument("--row-masks", nargs="+", default=["full", "causal", "docs_causal", "sliding_window_1024"],
                    help="masks run at the seqlens other than 16384")
    ap.add_argument("--out", default="out/kernels",
                    help="output folder (results the README quotes go to a dated benchmarks/ folder: benchmarks/RESULTS.md)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--tune", action="store_true", help="time candidate block configs instead")
    ap.add_argument("--configs", default=None, help="tuned configs JSON (from --tune) to use")
    ap.add_argument("--compare-dense-tiles", action="store_true",
                    help="also time ours with TritonConfig(dense_tiles=False) (impl ours_nodense)")
    ap.add_argument("--zigzag", type=int, nargs=2, default=None, metavar=("S", "CP"),
                    help="also time causal zigzag rank tile lists (q S/CP rows, keys S): ours vs ours_nodense")
    ap.add_argument("--zigzag-ranks", type=int, nargs="+", default=[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a dry run in Triton's interpreter (use with --tiny; no Flex, no cuDNN)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (Hq=4, Hkv=1, D=32, S=256, 32x32 blocks)")
    args = ap.parse_args()
    global DEVICE, DTYPE, HQ, HKV, D
    DEVICE = args.device
    if DEVICE == "cpu":
        DTYPE = torch.float16
    if args.device == "cpu" and not args.tiny:
        ap.error("--device cpu is a dry run in Triton's interpreter: add --tiny")
    if args.tiny:
        HQ, HKV, D = 4, 1, 32
        if args.seqlens == ap.get_default("seqlens"):
            args.seqlens = [256]
    if args.device == "cpu":
        args.no_flex = True
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (Triton interpreter)",
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": "python " + " ".join(sys.argv), "torch": torch.__version__, "triton": triton.__version__,
            "Hq": HQ, "Hkv": HKV, "D": D, "dtype": str(DTYPE).removeprefix("torch."), "flops": "fwd 4*area*Hq*D, bwd 2.5x", "masks": {m: catalog.DESCRIPTIONS[m] for m in args.masks + args.row_masks}}
    if args.tune:
        BENCH_MS.update(warmup=20, rep=80)
        rows = tune(args.seqlens[0], args.masks)
        best = pick_best(rows)
        print("best:", json.dumps(best))
        with open(os.path.join(args.out, f"tune{args.tag}.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows, "best": best}, f, indent=1)
        with open(os.path.join(args.out, "tuned_configs.json"), "w") as f:
            json.dump(best, f)
        return
    overrides = {}
    if args.tiny:  # small blocks: the interpreter's time grows with the block size
        c = KernelConfig(32, 32, 4, 1)
        overrides = {D: PhaseConfigs(c, c, c)}
    if args.configs:
        with open(args.configs) as f:
            overrides = configs_from_json(json.load(f))
        meta["configs"] = {f"{d}/{c}": str(v) for (d, c), v in overrides.items()}
    be = TritonBackend(TritonConfig(overrides))
    be_triton = TritonBackend(TritonConfig(overrides, dense_fast_path=False))
    be_nodense = TritonBackend(TritonConfig(overrides, dense_tiles=False))
    results = []
    for s in args.seqlens:
        q, k, v, do = make_inputs(s)
        for name in (args.masks if s == 16384 else args.row_masks):
            tiles = catalog.tiles(catalog.build(name, s))
            area = kept_area(tiles)
            ff = 4 * area * HQ * D
            r = {"S": s, "mask": name, "area": area, "density": area / s / s, "n_tiles": int(tiles.shape[0])}
            ours = {"ours": be}
            if args.compare_dense_tiles:
                ours["ours_nodense"] = be_nodense
            if catalog.sdpa_is_causal(name) is not None:  # record the measurement behind the dense fast path
                ours["ours_triton"] = be_triton
            impls = {impl: ((lambda b=b: time_ours(b, tiles, s, q, k, v, do)), b) for impl, b in ours.items()}
            if not args.no_flex:
                impls["flex"] = (lambda: time_flex(name, s, q, k, v, do), None)
            if catalog.sdpa_is_causal(name) is not None and DEVICE == "cuda":
                impls["cudnn"] = (lambda: time_cudnn(catalog.sdpa_is_causal(name), q, k, v, do), None)
            for impl, (fn, b) in impls.items():
                try:
                    tf, tb = fn()
                    if b is not None:
                        r[impl] = ours_record(b, tf, tb, ff)
                    else:
                        r[impl] = {"fwd_ms": tf, "bwd_ms": tb, "fwd_tflops": ff / tf / 1e9,
                                   "bwd_tflops": 2.5 * ff / tb / 1e9}
                    if impl == "ours":
                        r["ours_path"] = be.last_path
                except Exception as e:  # noqa: BLE001  (record, keep going)
                    r[impl] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                empty_cache()
            for other in ("flex", "cudnn"):
                if other in r and "fwd_ms" in r[other] and "fwd_ms" in r["ours"]:
                    r[f"fwd_vs_{other}"] = r[other]["fwd_ms"] / r["ours"]["fwd_ms"]
                    r[f"bwd_vs_{other}"] = r[other]["bwd_ms"] / r["ours"]["bwd_ms"]
            results.append(r)
            line = f"S={s:6d} {name:15s} dens={r['density']:.3f}"
            for impl in ("ours", "ours_nodense", "ours_triton", "flex", "cudnn"):
                if impl in r:
                    x = r[impl]
                    line += (f" | {impl} fwd {x['fwd_tflops']:6.1f} bwd {x['bwd_tflops']:6.1f}" if "fwd_ms" in x
                             else f" | {impl} ERR {x['error'][:60]}")
            print(line, flush=True)
        del q, k, v, do
        empty_cache()
    if args.zigzag:
        zs, cp = args.zigzag
        sq = zs // cp
        q, _, _, do = make_inputs(sq, seed=1)
        _, k, v, _ = make_inputs(zs, seed=2)
        for rank in args.zigzag_ranks:
            tiles = zigzag_rank_tiles(zs, cp, rank)
            area = kept_area(tiles)
            ff = 4 * area * HQ * D
            r = {"S": zs, "mask": f"zigzag_cp{cp}_rank{rank}", "sq": sq, "sk": zs, "area": area,
                 "density": area / sq / zs, "n_tiles": int(tiles.shape[0]), "tiles": tiles.tolist()}
            line = f"zigzag S={zs} cp={cp} rank={rank} tiles={tiles.tolist()}"
            for impl, b in (("ours", be), ("ours_nodense", be_nodense)):
                try:
                    tf, tb = time_ours_rect(b, tiles, sq, zs, q, k, v, do)
                    r[impl] = ours_record(b, tf, tb, ff)
                    line += f" | {impl} [{b.last_path}] fwd {ff / tf / 1e9:6.1f} bwd {2.5 * ff / tb / 1e9:6.1f}"
                except Exception as e:  # noqa: BLE001
                    r[impl] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                    line += f" | {impl} ERR {r[impl]['error'][:80]}"
                empty_cache()
            r["ours_path"] = r["ours"].get("path")
            results.append(r)
            print(line, flush=True)
        del q, k, v, do
    path = os.path.join(args.out, f"bench_kernels{args.tag}.json")
    meta["cudnn"] = cudnn_status(be)
    out = {"meta": meta, "results": results}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path, "cuDNN:", meta["cudnn"])
    plot(meta, results, os.path.join(args.out, f"bench_kernels{args.tag}.png"))
    print("\nTFLOP/s; ours = default backend (path in brackets), triton = our kernel without the dense fast path")
    print("| S | mask | ours fwd | triton fwd | flex fwd | cuDNN fwd | ours bwd | triton bwd | flex bwd | cuDNN bwd "
          "| fwd/flex | bwd/flex |")
    print("|---" * 12 + "|")
    for r in results:
        def g(impl, key):
            x = r.get(impl, {})
            return f"{x[key]:.0f}" if key in x else "-"
        line = (f"| {r['S']} | {r['mask']} | {g('ours', 'fwd_tflops')} [{r.get('ours_path')}] | "
                f"{g('ours_triton', 'fwd_tflops')} | {g('flex', 'fwd_tflops')} | "
                f"{g('cudnn', 'fwd_tflops')} | {g('ours', 'bwd_tflops')} | {g('ours_triton', 'bwd_tflops')} | "
                f"{g('flex', 'bwd_tflops')} | "
                f"{g('cudnn', 'bwd_tflops')} | {r.get('fwd_vs_flex', float('nan')):.2f} | "
                f"{r.get('bwd_vs_flex', float('nan')):.2f} |")
        print(line)


def plot(meta, results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.3 * len(results)), 8))
    labels = [f"{r['mask']}\nS={r['S'] // 1024}k" if r["S"] >= 1024 else f"{r['mask']}\nS={r['S']}" for r in results]
    impls = [i for i in ("ours", "ours_nodense", "ours_triton", "flex", "cudnn") if any(i in r for r in results)]
    w = 0.8 / max(len(impls), 1)
    for ax, key in zip(axes, ("fwd_tflops", "bwd_tflops")):
        for j, impl in enumerate(impls):
            xs = [i + (j - (len(impls) - 1) / 2) * w for i in range(len(results))]
            ys = [r.get(impl, {}).get(key, 0.0) for r in results]
            ax.bar(xs, ys, width=w, label=impl)
        ax.set_xticks(range(len(results)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel(key.replace("_", " "))
        ax.legend(fontsize=8)
    fig.suptitle(f"{meta['device']}  {meta['date']}  {meta['dtype']} Hq={HQ} Hkv={HKV} D={D}\n{meta['command']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


if __name__ == "__main__":
    main()
