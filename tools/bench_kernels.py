"""Benchmark: our default attention backend against the kernels it replaces and the peers, one GPU.

bf16, Hq 32, Hkv 8, D 128, batch 1; --masks (default: catalog.KERNEL_MASKS at S = 16384, the four FA4 expresses
natively at the other --seqlens; ``--masks all``: the kernel masks and the distributed catalog's, catalog.DIST_MASKS).
A row per S and mask, per implementation (missing peers record their error):

    ours         get_backend("auto")'s backend (FA4Backend where FA4 can run, else TritonBackend)
    triton       TritonBackend, the default FA4 replaces (where ours is not it)
    ours_triton  TritonBackend without the dense fast path (dense masks): the Triton kernel alone
    flex         torch.compile'd FlexAttention on the catalog's mask_mod; flex_flash: on FA4's kernels (BACKEND FLASH)
    fa4          FA4 called directly where it expresses the mask (full, causal, window (1024, 0), varlen documents)
    cudnn        SDPA's cuDNN backend on the dense masks, K/V expanded to Hq heads outside the timed region

do_bench medians (the backward without the forward) and TFLOP/s (4 * kept area * Hq * D FLOPs forward, 2.5x
backward); ours' paths and Triton block configs; fwd_vs_P / bwd_vs_P = peer P's time / ours' (> 1: ours is faster),
*_vs_best against the fastest (best_*_peer). --tune times candidate block configs of TritonBackend per phase
instead: OUT/tune<tag>.json, the fastest per row class in OUT/tuned_configs.json (configs_from_json's format).

Usage: python tools/bench_kernels.py [--seqlens 16384 4096] [--masks ...] [--peers flex_flash,fa4,cudnn] [--tune]
       [--out DIR]
       python tools/bench_kernels.py --dry-run   # CPU, Triton's interpreter, no peers; its times mean nothing
Writes OUT/bench_kernels<tag>.json and .png; ends with a table on stdout.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import sys

if "--dry-run" in sys.argv:  # Triton's interpreter runs the kernels on the CPU: on before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from megatron_cp.kernels import (  # noqa: E402
    DEFAULT_CONFIGS, KernelConfig as K, PhaseConfigs, TritonBackend, TritonConfig, get_backend, kept_area,
)
from megatron_cp.masks import catalog  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    Progress, Timer, bar_panels, device_name, fa4_version, markdown_table, out_dir, parser, run_record, write_json,
)

HQ, HKV, D, DEVICE, DTYPE = 32, 8, 128, "cuda", torch.bfloat16
BENCH_MS = {"warmup": 50, "rep": 200}  # --tune uses shorter runs
PEERS = ("flex", "flex_flash", "fa4", "cudnn")  # what ours is compared with (ratios, best peer)
IMPLS = ("ours", "triton", "ours_triton") + PEERS  # print, table and plot order
PEERS_ON = set(PEERS)  # --peers
OWN_ALTERNATIVES = ("triton", "ours_triton")  # our other paths: in *_vs_best beside the peers
FA4_MASKS = ("full", "causal", "docs_causal", "sliding_window_1024")  # the masks FA4 expresses natively


MIN_RUNS = 10  # a median of at least this many timed runs, however long the kernel


def bench(fn):
    """Median milliseconds of fn() (do_bench: its first call, which compiles, untimed); on the CPU one call.
    do_bench times as many runs as fit in ``rep`` ms: a kernel over rep / MIN_RUNS ms is timed again over
    MIN_RUNS runs (in the default 200 ms a 40 ms kernel would get a median of 5)."""
    if DEVICE == "cpu":
        return Timer(torch.device("cpu")).medians(fn)[0]
    ms = triton.testing.do_bench(fn, warmup=BENCH_MS["warmup"], rep=BENCH_MS["rep"], return_mode="median")
    if ms * MIN_RUNS > BENCH_MS["rep"]:
        ms = triton.testing.do_bench(fn, warmup=0, rep=ms * MIN_RUNS, return_mode="median")
    return ms


def speed(tf, tb, flops):
    return {"fwd_ms": tf, "bwd_ms": tb, "fwd_tflops": flops / tf / 1e9, "bwd_tflops": 2.5 * flops / tb / 1e9}


def make_inputs(s):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    return [torch.randn(s, h, D, device=DEVICE, dtype=DTYPE, generator=g) for h in (HQ, HKV, HKV, HQ)]


def cfg_list(c):
    return [c.block_m, c.block_n, c.num_warps, c.num_stages, int(c.tma)]


def time_ours(be, tiles, s, q, k, v, do):
    """(fwd ms, bwd ms, forward's path) of ``be``."""
    prep = be.prepare(tiles, s, s, head_dims=(D,))
    be.last_configs.clear()  # so that it holds this case's configs afterwards
    out, lse = be.forward(q, k, v, prep)
    fwd_path = be.last_path  # the backward's is be.last_path afterwards (FA4 may fall back in one only)
    tf = bench(lambda: be.forward(q, k, v, prep))
    return tf, bench(lambda: be.backward(q, k, v, out, lse, do, prep)), fwd_path


class PeerMissing(Exception):
    """A peer that cannot run here (flash-attn-4 absent); its message is the row's error as it is."""


def time_autograd(f, leaves, dout):
    """(fwd ms, bwd ms) of a peer: f(*leaves) under no_grad; autograd.grad of its output on a retained graph."""
    with torch.no_grad():
        tf = bench(lambda: f(*leaves))
    o = f(*leaves)
    return tf, bench(lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True))


def fa4_interface():
    """flash_attn.cute.interface; PeerMissing where flash-attn-4 is not installed (broken: the ImportError)."""
    if fa4_version() is None:
        raise PeerMissing("flash-attn-4 not installed")
    from flash_attn.cute import interface
    return interface


@functools.cache
def flex_call(backend):
    """torch.compile'd flex_attention(q, k, v, block_mask) with GQA on Flex's ``backend`` (None: Triton, "FLASH")."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.cache_size_limit = 128
    torch._dynamo.config.accumulated_cache_size_limit = 512
    opts = None if backend is None else {"BACKEND": backend}
    return torch.compile(lambda q, k, v, bm: flex_attention(q, k, v, block_mask=bm, enable_gqa=True,
                                                            kernel_options=opts), dynamic=False)


@functools.lru_cache(maxsize=1)  # flex and flex_flash share the latest
def block_mask(name, s):
    """The BlockMask of catalog mask ``name`` at S (None for full: Flex without a mask)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return None if name == "full" else create_block_mask(catalog.mask_mod(name, s, "cuda"), None, None, s, s,
                                                         device="cuda")


def heads_first(*xs):
    """[S, H, D] -> contiguous [1, H, S, D] leaves (Flex, SDPA)."""
    return tuple(x.transpose(0, 1).unsqueeze(0).contiguous().requires_grad_(True) for x in xs)


def time_flex(name, s, q, k, v, do, backend=None):
    """Flex; backend "FLASH": kernel_options={"BACKEND": "FLASH"} (needs flash-attn-4)."""
    if backend == "FLASH":
        fa4_interface()  # Flex's FLASH backend runs flash_attn.cute: say so plainly when it is missing
    fn, bm = flex_call(backend), block_mask(name, s)
    return time_autograd(lambda a, b, c: fn(a, b, c, bm), heads_first(q, k, v), heads_first(do)[0].detach())


def fa4_call(name, s):
    """(f, batched): f(q, k, v) -> out runs FA4 directly on catalog mask ``name`` (one of FA4_MASKS) at S;
    batched: f takes [1, S, H, D] (flash_attn_func), else [S, H, D] (flash_attn_varlen_func). GQA native."""
    fa, batched = fa4_interface(), name != "docs_causal"
    if not batched:  # one causal sequence per document
        lens = catalog.doc_lengths(name, s)
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEVICE)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens), causal=True)
    else:  # FA4's window (left, right) keeps j in [i - left, i + right] (bottom-right aligned; S_q = S_k here)
        kw = {"full": {}, "causal": {"causal": True}, "sliding_window_1024": {"window_size": (1024, 0)}}[name]

    def call(q, k, v):  # out, or (out, lse): FA4's return differs by version and return_lse
        out = (fa.flash_attn_func if batched else fa.flash_attn_varlen_func)(q, k, v, **kw)
        return out[0] if isinstance(out, tuple) else out
    return call, batched


def time_fa4(name, s, q, k, v, do):
    f, batched = fa4_call(name, s)
    q, k, v, do = (x.unsqueeze(0) if batched else x for x in (q, k, v, do))
    return time_autograd(f, tuple(x.detach().requires_grad_(True) for x in (q, k, v)), do)


def time_cudnn(is_causal, q, k, v, do):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kv = (x.repeat_interleave(HQ // HKV, 1) for x in (k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return time_autograd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=is_causal),
                             heads_first(q, *kv), heads_first(do)[0].detach())


def compare_with_peers(r):
    """Row r's fwd_vs_P / bwd_vs_P = peer P's ms / ours' for each peer that ran, *_vs_best: the fastest's. Our own
    Triton paths count among the peers (where ours is another backend): ours must never lose to a path we have."""
    ran = [p for p in PEERS + OWN_ALTERNATIVES if "fwd_ms" in r.get(p, {})]
    for d in ("fwd", "bwd") if ran and "fwd_ms" in r.get("ours", {}) else ():
        for p in ran:
            r[f"{d}_vs_{p}"] = r[p][f"{d}_ms"] / r["ours"][f"{d}_ms"]
        r[f"best_{d}_peer"] = best = min(ran, key=lambda p: r[p][f"{d}_ms"])
        r[f"{d}_vs_best"] = r[f"{d}_vs_{best}"]


def table(results, ours_name):
    """The closing markdown table (lines): TFLOP/s as fwd / bwd per impl, ratios as in compare_with_peers."""
    def tflops(r, impl):
        x = r.get(impl)
        return "-" if x is None else f"{x['fwd_tflops']:.0f} / {x['bwd_tflops']:.0f}" if "fwd_ms" in x else "err"

    def ratio(r, key, peer_key=None):
        return "-" if key not in r else f"{r[key]:.2f}" + (f" ({r[peer_key]})" if peer_key else "")

    def ours(r):  # its path, or the forward's / the backward's where they differ
        x = r.get("ours", {})
        paths = dict.fromkeys([x.get("fwd_path", x.get("path")), x.get("path")])
        return tflops(r, "ours") + (f" [{' / '.join(map(str, paths))}]" if "fwd_ms" in x else "")

    return [f"TFLOP/s as fwd / bwd; ours = {ours_name} (its path in brackets), triton = TritonBackend, the default "
            "FA4 replaces; ratios = peer time / ours time (> 1: ours is faster)"] + markdown_table(
        ["S", "mask", "ours fwd/bwd", "triton", "flex", "flex FLASH", "FA4 direct", "cuDNN", "ours/best peer fwd",
         "bwd", "ours/flex FLASH fwd", "bwd"],
        [[r["S"], r["mask"], ours(r), *(tflops(r, i) for i in IMPLS[1:] if i != "ours_triton"),
          ratio(r, "fwd_vs_best", "best_fwd_peer"), ratio(r, "bwd_vs_best", "best_bwd_peer"),
          ratio(r, "fwd_vs_flex_flash"), ratio(r, "bwd_vs_flex_flash")] for r in results])


TUNE = {"fwd": [K(128, 128, 8, 3), K(64, 64, 4, 3), K(128, 128, 8, 3, True), K(128, 64, 8, 3, True),
                K(64, 64, 4, 3, True), K(128, 64, 4, 3, True), K(64, 128, 4, 3, True), K(64, 64, 4, 4, True)],
        "dkdv": [K(32, 64, 4, 3), K(32, 64, 4, 3, True), K(64, 64, 4, 3, True), K(64, 128, 8, 3, True),
                 K(64, 64, 4, 4, True), K(32, 128, 4, 3, True), K(64, 128, 4, 3, True)],
        "dq": [K(64, 64, 4, 3), K(64, 64, 4, 3, True), K(128, 64, 8, 3, True), K(128, 128, 8, 3, True),
               K(64, 64, 4, 4, True), K(64, 128, 4, 3, True), K(128, 64, 4, 3, True)]}
SHORT_MASKS = ("docs_causal", "sliding_window_1024", "streaming_1024", "global_local_512", "strided_512x4")


def pick_best(rows):
    """Per row class (short: SHORT_MASKS' rows, long: the rest) each stage's config of least total time (fwd:
    forward, dkdv and dq: backward) among those that ran the most masks, as configs_from_json reads it."""
    best = {}
    for cls in ("long", "short"):
        st = {}
        for stage in TUNE:
            tot = {}
            for r in rows:
                if r["stage"] == stage and (r["mask"] in SHORT_MASKS) == (cls == "short"):
                    tot.setdefault(tuple(r["cfg"]), []).append(r["fwd_ms" if stage == "fwd" else "bwd_ms"])
            full = [c for c, v in tot.items() if len(v) == max(map(len, tot.values()))]
            if full:
                st[stage] = list(min(full, key=lambda c: sum(tot[c])))
        if len(st) == 3:
            best[f"{D}/{cls}"] = st
    return best


def tune(s, masks, bar):
    """Rows of each candidate config per stage (the other stages at their defaults) on each mask."""
    base, rows, inputs = DEFAULT_CONFIGS[(D, "long")], [], make_inputs(s)
    for stage, c in ((st, c) for st, cands in TUNE.items() for c in cands):
        be = TritonBackend(TritonConfig({D: dataclasses.replace(base, **{stage: c})}, dense_fast_path=False))
        for name in masks:
            tiles = catalog.tiles(catalog.build(name, s))
            bar.running(f"{stage} {cfg_list(c)} {name}")
            try:
                r = {"stage": stage, "cfg": cfg_list(c), "mask": name,
                     **speed(*time_ours(be, tiles, s, *inputs)[:2], 4 * kept_area(tiles) * HQ * D)}
            except Exception as e:  # noqa: BLE001  (e.g. out of shared memory)
                bar.step(f"tune {stage} {c} {name}: {type(e).__name__} {str(e)[:80]}")
                continue
            rows.append(r)
            bar.step(f"tune {stage:4s} {r['cfg']} {name:15s} fwd {r['fwd_tflops']:6.1f} bwd {r['bwd_tflops']:6.1f}")
        torch.cuda.empty_cache()
    return rows


def run_case(s, name, backends, inputs, bar):
    """One row: ours (``backends``, by impl name) and the peers on catalog mask ``name`` at S."""
    q, k, v, do = inputs
    tiles = catalog.tiles(catalog.build(name, s))
    area = kept_area(tiles)
    r = {"S": s, "mask": name, "area": area, "density": area / s / s, "n_tiles": int(tiles.shape[0])}
    causal = catalog.sdpa_is_causal(name)  # None: not a dense mask
    ours = {i: b for i, b in backends.items() if b is not None and (i != "ours_triton" or causal is not None)}
    peers = {"flex": lambda: time_flex(name, s, q, k, v, do),
             "flex_flash": lambda: time_flex(name, s, q, k, v, do, backend="FLASH"),
             "fa4": lambda: time_fa4(name, s, q, k, v, do), "cudnn": lambda: time_cudnn(causal, q, k, v, do)}
    ran = {"fa4": name in FA4_MASKS, "cudnn": causal is not None, "flex": True, "flex_flash": True}
    ran = {p: ok and p in PEERS_ON for p, ok in ran.items()}
    for impl in [*ours, *(p for p in peers if ran[p] and DEVICE == "cuda")]:  # the peers run on the GPU alone
        bar.running(f"S={s} {name} {impl}")
        try:
            if impl in peers:
                r[impl] = speed(*peers[impl](), 4 * area * HQ * D)
            else:  # its paths (path: the backward's) and the block configs its Triton kernels ran with
                tf, tb, fwd_path = time_ours(ours[impl], tiles, s, *inputs)
                r[impl] = {**speed(tf, tb, 4 * area * HQ * D), "path": ours[impl].last_path, "fwd_path": fwd_path,
                           "configs": {ph: cfg_list(c) for ph, c in ours[impl].last_configs.items()}}
        except PeerMissing as e:
            r[impl] = {"error": str(e)}
        except Exception as e:  # noqa: BLE001  (record, keep going)
            r[impl] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        torch.cuda.empty_cache()
    compare_with_peers(r)
    bar.step(f"S={s:6d} {name:15s} dens={r['density']:.3f}" + "".join(
        f" | {i} fwd {r[i]['fwd_tflops']:6.1f} bwd {r[i]['bwd_tflops']:6.1f}" if "fwd_ms" in r[i]
        else f" | {i} ERR {r[i]['error'][:60]}" for i in IMPLS if i in r))
    return r


def main():
    ap = parser(__doc__, "out/kernels")
    ap.add_argument("--seqlens", type=int, nargs="+", default=None, help="default 16384 (a dry run: 256)")
    ap.add_argument("--masks", nargs="+", default=None, help="catalog masks (default: see above)")
    ap.add_argument("--tune", action="store_true", help="time candidate block configs instead")
    ap.add_argument("--peers", default=",".join(PEERS), help="comma list of the peers to time (default: all of "
                    + ", ".join(PEERS) + "; each flex peer compiles per mask and size)")
    args = ap.parse_args()
    unknown = set(args.peers.split(",")) - set(PEERS)
    if unknown:
        ap.error(f"--peers: unknown {sorted(unknown)}")
    PEERS_ON.clear()
    PEERS_ON.update(args.peers.split(","))
    global HQ, HKV, D, DEVICE, DTYPE
    overrides = {}  # the dry run's blocks
    if args.dry_run:  # fp16: the interpreter computes bf16 tl.dot wrongly; 64 x 64 blocks: fewest interpreted steps
        HQ, HKV, D, DEVICE, DTYPE = 2, 1, 32, "cpu", torch.float16
        overrides = {D: PhaseConfigs(*[K(64, 64, 4, 1)] * 3)}
    seqlens, out = args.seqlens or ([256] if args.dry_run else [16384]), out_dir(args)
    if args.masks == ["all"]:
        args.masks = list(dict.fromkeys(catalog.KERNEL_MASKS + catalog.DIST_MASKS))
    masks = {s: args.masks or list(catalog.KERNEL_MASKS if s == 16384 else FA4_MASKS) for s in seqlens}
    meta = run_record(device_name(DEVICE), triton=triton.__version__, Hq=HQ, Hkv=HKV, D=D,
                      dtype=str(DTYPE).removeprefix("torch."), flops="fwd 4*area*Hq*D, bwd 2.5x",
                      masks={m: catalog.DESCRIPTIONS[m] for m in dict.fromkeys(sum(masks.values(), []))})
    auto = get_backend("auto", DEVICE)  # built with this run's config; TritonBackend where auto picks neither
    be = (type(auto) if getattr(auto, "name", None) in ("triton", "fa4") else TritonBackend)(TritonConfig(overrides))
    backends = {"ours": be,  # the default before FA4 gets a column where ours is not it (a subclass is not it)
                "triton": TritonBackend(TritonConfig(overrides)) if type(be) is not TritonBackend else None,
                "ours_triton": TritonBackend(TritonConfig(overrides, dense_fast_path=False))}
    if args.tune:
        BENCH_MS.update(warmup=20, rep=80)
        with Progress(len(masks[seqlens[0]]) * sum(map(len, TUNE.values())), "tune", verbose=args.verbose) as bar:
            rows = tune(seqlens[0], masks[seqlens[0]], bar)
        best = pick_best(rows)
        write_json(os.path.join(out, f"tune{args.tag}.json"), {"meta": meta, "rows": rows, "best": best})
        write_json(os.path.join(out, "tuned_configs.json"), best)
        print("wrote", os.path.join(out, f"tune{args.tag}.json"), "and tuned_configs.json")
        print("\n".join(markdown_table(["class", "stage", "block_m", "block_n", "warps", "stages", "tma"], [
            [cls, st, *cfg] for cls, stages in best.items() for st, cfg in stages.items()])))
        return
    results = []
    with Progress(sum(map(len, masks.values())), "bench_kernels", verbose=args.verbose) as bar:
        for s in seqlens:
            inputs = make_inputs(s)
            results += [run_case(s, name, backends, inputs, bar) for name in masks[s]]
            inputs = None  # freed before the next size's are made
            torch.cuda.empty_cache()
    # what the cuDNN probes found per (device, dtype, head_dim, Hq / Hkv) family: a layout or why not
    meta["cudnn"] = {str(tuple(map(str, key))): found.layout or found.reason for b in (be, backends["triton"])
                     for key, found in getattr(b, "cudnn_probes", {}).items()}
    meta["ours_backend"] = {"name": be.name, **({"describe": be.describe()} if hasattr(be, "describe") else {})}
    write_json(os.path.join(out, f"bench_kernels{args.tag}.json"), {"meta": meta, "results": results})
    print("wrote", os.path.join(out, f"bench_kernels{args.tag}.json"))
    impls = [i for i in IMPLS if any(i in r for r in results)]
    bar_panels(os.path.join(out, f"bench_kernels{args.tag}.png"), [{
        "labels": [f"{r['mask']}\nS={r['S']}" for r in results], "ylabel": f"{d} TFLOP/s",
        "series": {i: [r.get(i, {}).get(f"{d}_tflops", 0.0) for r in results] for i in impls}} for d in ("fwd", "bwd")],
        f"{meta['device']}  {meta['date']}  {meta['dtype']} Hq={HQ} Hkv={HKV} D={D}  ours = {be.name}\n"
        + meta["command"])
    print("\n" + "\n".join(table(results, be.name)))  # the summary: the last lines of stdout


if __name__ == "__main__":
    main()
