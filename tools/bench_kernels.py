"""Benchmark: our Triton tile-list kernels vs FlexAttention (torch.compile) vs cuDNN SDPA, one GPU.

bf16, Hq=32, Hkv=8, D=128, batch 1. Masks: megatron_cp.masks.catalog.KERNEL_MASKS (same cells for every
implementation: tile lists for ours, mask_mod/BlockMask for Flex, is_causal for cuDNN on dense masks).
TFLOP/s with FLOPs = 4 * kept_area * Hq * D forward, 2.5x that backward; times are medians of
triton.testing.do_bench (CUDA events). Backward times exclude the forward (Flex/cuDNN: autograd.grad on a
retained graph; ours: backend.backward incl. its delta = rowsum(dout*out) preprocessing).
cuDNN runs with K/V expanded to Hq heads (outside the timed region).

--bwd-mode picks our backward (TritonConfig.bwd_mode): deterministic (default), atomic (dQ by fp32 atomics
inside the dK/dV programs), or both: every backend of ours is timed in each mode, the atomic one under
the impl name + "_atomic" (ours_atomic, ours_triton_atomic, ...), with its dQ's max |difference| from the
deterministic dQ (nonzero when the atomic kernel ran; the fast path's cuDNN ignores the mode).

--autotune times, next to each backend of ours, its twin with TritonConfig(autotune=True) as impl name +
"_tuned" (ours_tuned, ours_triton_tuned, ours_atomic_tuned, ...). Tuning happens in the untimed warmup call
that precedes every timing (time_ours_rect), so no timed region contains it; the autotune cache is
process-wide, so the first case of each (row class, phase) key tunes it and later cases of that key reuse
its winners, as a training run would. Every impl of ours records the block configs it ran with
("configs"), the output JSON the whole cache ("tuned": every candidate's median time) and DIR/tuned{tag}.json
holds it for triton_autotune.load_tuned; the printed table adds tuned/default speed-ups.

Usage: python tools/bench_kernels.py [--seqlens 16384] [--masks ...] [--out DIR] [--tune] [--bwd-mode both]
       [--autotune]
       python tools/bench_kernels.py --device cpu --tiny --bwd-mode both --out /tmp/bk   # CPU dry run
Writes DIR/bench_kernels.json and DIR/bench_kernels.png (device, date and command inside).
The CPU dry run (Triton's interpreter; fp16, Hq=4, Hkv=1, D=32, S=256, 32 x 32 blocks, one timed call
each) checks that the program runs end to end; its times mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
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

try:  # installed package, else the repository checkout (kernels/ imports only torch and triton)
    from megatron_cp.kernels.triton_backend import (
        DEFAULT_CONFIGS, KernelConfig, StageConfigs, TritonBackend, TritonConfig, configs_from_json,
    )
    from megatron_cp.kernels.triton_schedule import kept_area
    from megatron_cp.kernels.triton_autotune import PHASES, TUNED, save_tuned, tuned_to_json, wall_timer
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from kernels.triton_backend import (DEFAULT_CONFIGS, KernelConfig, StageConfigs, TritonBackend, TritonConfig,
                                        configs_from_json)
    from kernels.triton_schedule import kept_area
    from kernels.triton_autotune import PHASES, TUNED, save_tuned, tuned_to_json, wall_timer

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


def time_ours(be, tiles, s, q, k, v, do, grads=None):
    """(fwd ms, bwd ms) of backend be; grads: a list that receives this backward's dq."""
    return time_ours_rect(be, tiles, s, s, q, k, v, do, grads)


def time_ours_rect(be, tiles, sq, sk, q, k, v, do, grads=None):
    """time_ours for sq != sk (zigzag rank tile lists). The first forward and backward are untimed: compiles,
    device schedules and, with TritonConfig.autotune, the tuning of keys met for the first time."""
    prep = be.prepare(tiles, sq, sk, head_dims=(D,))
    be.last_configs.clear()  # so that it holds this case's configs afterwards
    out, lse = be.forward(q, k, v, prep)
    dq = be.backward(q, k, v, out, lse, do, prep)[0]  # compile + build device schedules outside timing
    if grads is not None:
        grads.append(dq)
    tf = bench(lambda: be.forward(q, k, v, prep))
    tb = bench(lambda: be.backward(q, k, v, out, lse, do, prep))
    return tf, tb


def cfg_list(c):
    return [c.block_m, c.block_n, c.num_warps, c.num_stages, int(c.tma)]


def ours_record(b, tf, tb, ff):
    """Result dict of one of our backends: times, TFLOP/s, path and the block configs its kernels ran with."""
    return {"fwd_ms": tf, "bwd_ms": tb, "fwd_tflops": ff / tf / 1e9, "bwd_tflops": 2.5 * ff / tb / 1e9,
            "path": b.last_path, "configs": {ph: cfg_list(c) for ph, c in b.last_configs.items()}}


def tuned_speedups(r, tuned_of):
    """r[<impl>_tuned_vs_default] = (default fwd ms / tuned fwd ms, same for bwd) where both ran."""
    for impl in tuned_of:
        x, y = r.get(impl, {}), r.get(impl + "_tuned", {})
        if "fwd_ms" in x and "fwd_ms" in y:
            r[f"{impl}_tuned_vs_default"] = {"fwd": x["fwd_ms"] / y["fwd_ms"], "bwd": x["bwd_ms"] / y["bwd_ms"]}


# --autotune on the CPU dry run: candidates small enough for the interpreter (timed by wall clock there)
TINY_CANDIDATES = (KernelConfig(32, 32, 4, 1), KernelConfig(16, 32, 4, 1), KernelConfig(32, 16, 4, 1, True))


def dq_diff(grads):
    """max |dq_deterministic - dq_atomic| from the dq list [deterministic, atomic], or None."""
    if len(grads) != 2:
        return None
    return float((grads[0].float() - grads[1].float()).abs().max())


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
            sc = StageConfigs(c if stage == "fwd" else base.fwd, c if stage == "dkdv" else base.dkdv,
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
    ap.add_argument("--out", default="benchmarks/kernels")
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--tune", action="store_true", help="time candidate block configs instead")
    ap.add_argument("--configs", default=None, help="tuned configs JSON (from --tune) to use")
    ap.add_argument("--compare-dense-tiles", action="store_true",
                    help="also time ours with TritonConfig(dense_tiles=False) (impl ours_nodense)")
    ap.add_argument("--zigzag", type=int, nargs=2, default=None, metavar=("S", "CP"),
                    help="also time causal zigzag rank tile lists (q S/CP rows, keys S): ours vs ours_nodense")
    ap.add_argument("--zigzag-ranks", type=int, nargs="+", default=[0])
    ap.add_argument("--bwd-mode", choices=["deterministic", "atomic", "both"], default="deterministic",
                    help="our backward: TritonConfig.bwd_mode, or both (atomic timed as impl <name>_atomic)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a dry run in Triton's interpreter (use with --tiny; no Flex, no cuDNN)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (Hq=4, Hkv=1, D=32, S=256, 32x32 blocks)")
    ap.add_argument("--autotune", action="store_true",
                    help="also time each backend of ours with TritonConfig(autotune=True) (impl <name>_tuned)")
    args = ap.parse_args()
    if args.tune and args.autotune:
        ap.error("--tune (offline sweep) and --autotune (runtime tuning next to the defaults) exclude each other")
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
            "Hq": HQ, "Hkv": HKV, "D": D, "dtype": str(DTYPE).removeprefix("torch."), "bwd_mode": args.bwd_mode,
            "autotune": args.autotune, "flops": "fwd 4*area*Hq*D, bwd 2.5x", "masks": {m: catalog.DESCRIPTIONS[m] for m in args.masks + args.row_masks}}
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
        overrides = {D: StageConfigs(c, c, c)}
    if args.configs:
        with open(args.configs) as f:
            overrides = configs_from_json(json.load(f))
        meta["configs"] = {f"{d}/{c}": str(v) for (d, c), v in overrides.items()}
    main_mode = "atomic" if args.bwd_mode == "atomic" else "deterministic"
    be = TritonBackend(TritonConfig(overrides, bwd_mode=main_mode))
    be_triton = TritonBackend(TritonConfig(overrides, dense_fast_path=False, bwd_mode=main_mode))
    be_nodense = TritonBackend(TritonConfig(overrides, dense_tiles=False, bwd_mode=main_mode))
    # --bwd-mode both: the same three in atomic mode, timed right after their deterministic twin
    atomic_of = {}
    if args.bwd_mode == "both":
        atomic_of = {"ours": TritonBackend(TritonConfig(overrides, bwd_mode="atomic")),
                     "ours_triton": TritonBackend(TritonConfig(overrides, dense_fast_path=False, bwd_mode="atomic")),
                     "ours_nodense": TritonBackend(TritonConfig(overrides, dense_tiles=False, bwd_mode="atomic"))}
    # --autotune: each of the above with autotune on, timed right after it as impl + "_tuned"
    tuned_of = {}
    if args.autotune:
        kw = {"timer": wall_timer} if DEVICE == "cpu" else {}  # CPU: no CUDA events, exercise the path anyway
        cands = {(D, ph): TINY_CANDIDATES for ph in PHASES} if args.tiny else {}
        for impl, b in (("ours", be), ("ours_triton", be_triton), ("ours_nodense", be_nodense),
                        *((i + "_atomic", a) for i, a in atomic_of.items())):
            tuned_of[impl] = TritonBackend(dataclasses.replace(b.config, autotune=True, autotune_candidates=cands), **kw)
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
            grads = {}  # impl -> [dq deterministic, dq atomic] under --bwd-mode both
            impls = {}
            for impl, b in ours.items():
                keep = impl in atomic_of  # keep dq only to compare the two modes
                impls[impl] = (lambda b=b, impl=impl, keep=keep: time_ours(
                    b, tiles, s, q, k, v, do, grads.setdefault(impl, []) if keep else None), b)
                if impl in atomic_of:
                    a = atomic_of[impl]
                    impls[impl + "_atomic"] = (
                        lambda a=a, impl=impl: time_ours(a, tiles, s, q, k, v, do, grads.setdefault(impl, [])), a)
            impls = {x: y for impl, fb in impls.items() for x, y in [(impl, fb)] + (
                [(impl + "_tuned", ((lambda t=tuned_of[impl]: time_ours(t, tiles, s, q, k, v, do)), tuned_of[impl]))]
                if impl in tuned_of else [])}
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
                    if impl.endswith("_atomic"):
                        r[impl]["dq_maxdiff_vs_det"] = dq_diff(grads[impl[:-len("_atomic")]])
                except Exception as e:  # noqa: BLE001  (record, keep going)
                    r[impl] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                empty_cache()
            for other in ("flex", "cudnn"):
                if other in r and "fwd_ms" in r[other] and "fwd_ms" in r["ours"]:
                    r[f"fwd_vs_{other}"] = r[other]["fwd_ms"] / r["ours"]["fwd_ms"]
                    r[f"bwd_vs_{other}"] = r[other]["bwd_ms"] / r["ours"]["bwd_ms"]
            for impl in atomic_of:  # backward speed-up of atomic dQ over deterministic, same backend
                x, y = r.get(impl, {}), r.get(impl + "_atomic", {})
                if "bwd_ms" in x and "bwd_ms" in y:
                    r[f"{impl}_bwd_atomic_vs_det"] = x["bwd_ms"] / y["bwd_ms"]
            tuned_speedups(r, tuned_of)
            results.append(r)
            line = f"S={s:6d} {name:15s} dens={r['density']:.3f}"
            for impl in [x for i in ("ours", "ours_atomic", "ours_nodense", "ours_nodense_atomic", "ours_triton",
                                     "ours_triton_atomic") for x in (i, i + "_tuned")] + ["flex", "cudnn"]:
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
            grads = {}
            runs = [("ours", be), ("ours_nodense", be_nodense)]
            runs = [x for impl, b in runs for x in [(impl, b)] + ([(impl + "_atomic", atomic_of[impl])]
                                                                   if impl in atomic_of else [])]
            runs = [x for impl, b in runs for x in [(impl, b)] + ([(impl + "_tuned", tuned_of[impl])]
                                                                   if impl in tuned_of else [])]
            for impl, b in runs:
                try:
                    base = impl[:-len("_atomic")] if impl.endswith("_atomic") else impl
                    keep = base in atomic_of  # keep dq only to compare the two modes
                    tf, tb = time_ours_rect(b, tiles, sq, zs, q, k, v, do, grads.setdefault(base, []) if keep else None)
                    r[impl] = ours_record(b, tf, tb, ff)
                    if impl.endswith("_atomic"):
                        r[impl]["dq_maxdiff_vs_det"] = dq_diff(grads[base])
                    line += f" | {impl} [{b.last_path}] fwd {ff / tf / 1e9:6.1f} bwd {2.5 * ff / tb / 1e9:6.1f}"
                except Exception as e:  # noqa: BLE001
                    r[impl] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                    line += f" | {impl} ERR {r[impl]['error'][:80]}"
                empty_cache()
            for impl in atomic_of:
                x, y = r.get(impl, {}), r.get(impl + "_atomic", {})
                if "bwd_ms" in x and "bwd_ms" in y:
                    r[f"{impl}_bwd_atomic_vs_det"] = x["bwd_ms"] / y["bwd_ms"]
            tuned_speedups(r, tuned_of)
            r["ours_path"] = r["ours"].get("path")
            results.append(r)
            print(line, flush=True)
        del q, k, v, do
    path = os.path.join(args.out, f"bench_kernels{args.tag}.json")
    out = {"meta": meta, "results": results}
    if args.autotune:
        out["tuned"] = tuned_to_json(TUNED)
        save_tuned(os.path.join(args.out, f"tuned{args.tag}.json"))
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path, "fast path error:", be.fast_path_error)
    plot(meta, results, os.path.join(args.out, f"bench_kernels{args.tag}.png"))
    print(f"\nTFLOP/s; ours = default backend (path in brackets), triton = our kernel without the dense fast path; "
          f"our backward: {args.bwd_mode}")
    both = args.bwd_mode == "both"
    extra = (" ours bwd atomic | triton bwd atomic | ours bwd atomic/det | triton bwd atomic/det |" if both else "")
    print("| S | mask | ours fwd | triton fwd | flex fwd | cuDNN fwd | ours bwd | triton bwd | flex bwd | cuDNN bwd "
          "| fwd/flex | bwd/flex |" + extra)
    print("|---" * (12 + 4 * both) + "|")
    for r in results:
        def g(impl, key):
            x = r.get(impl, {})
            return f"{x[key]:.0f}" if key in x else "-"

        def ratio(key):
            return f"{r[key]:.2f}" if key in r else "-"
        line = (f"| {r['S']} | {r['mask']} | {g('ours', 'fwd_tflops')} [{r.get('ours_path')}] | "
                f"{g('ours_triton', 'fwd_tflops')} | {g('flex', 'fwd_tflops')} | "
                f"{g('cudnn', 'fwd_tflops')} | {g('ours', 'bwd_tflops')} | {g('ours_triton', 'bwd_tflops')} | "
                f"{g('flex', 'bwd_tflops')} | "
                f"{g('cudnn', 'bwd_tflops')} | {r.get('fwd_vs_flex', float('nan')):.2f} | "
                f"{r.get('bwd_vs_flex', float('nan')):.2f} |")
        if both:
            line += (f" {g('ours_atomic', 'bwd_tflops')} [{r.get('ours_atomic', {}).get('path')}] | "
                     f"{g('ours_triton_atomic', 'bwd_tflops')} | {ratio('ours_bwd_atomic_vs_det')} | "
                     f"{ratio('ours_triton_bwd_atomic_vs_det')} |")
        print(line)
    if args.autotune:
        print_tuned(results, tuned_of)


def print_tuned(results, tuned_of):
    """Defaults vs autotuned, side by side: TFLOP/s and speed-ups per case, then each tuned key's
    candidates with their median times (the winner first)."""
    print("\nautotune: TFLOP/s default -> tuned (speed-up), per backend of ours")
    impls = [i for i in tuned_of if any(i + "_tuned" in r for r in results)]
    print("| S | mask | " + " | ".join(f"{i} fwd | {i} bwd" for i in impls) + " |")
    print("|---" * (2 + 2 * len(impls)) + "|")
    for r in results:
        cells = []
        for i in impls:
            x, y, sp = r.get(i, {}), r.get(i + "_tuned", {}), r.get(f"{i}_tuned_vs_default")
            for key, ph in (("fwd_tflops", "fwd"), ("bwd_tflops", "bwd")):
                cells.append(f"{x[key]:.0f} -> {y[key]:.0f} ({sp[ph]:.2f}x)" if sp else "-")
        print(f"| {r['S']} | {r['mask']} | " + " | ".join(cells) + " |")
    print("\ntuned keys (device, head_dim, dtype, group, row class, phase): winner; candidates ms")
    for key, res in TUNED.items():
        times = sorted(res.times_ms.items(), key=lambda kv: kv[1])
        print(f"{tuple(key)}: {cfg_list(res.config)}; " + ", ".join(f"{cfg_list(c)} {t:.3f}" for c, t in times)
              + "".join(f"; {cfg_list(c)} {m[:60]}" for c, m in res.errors.items()))


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
    impls = [i for i in ("ours", "ours_tuned", "ours_atomic", "ours_triton", "ours_triton_tuned", "ours_triton_atomic",
                         "flex", "cudnn") if any(i in r for r in results)]
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
