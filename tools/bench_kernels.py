"""Benchmark: our default attention backend vs the kernels it replaces and the peers, one GPU.

bf16, Hq=32, Hkv=8, D=128, batch 1. Masks: megatron_cp.masks.catalog.KERNEL_MASKS (the same cells for every
implementation). Implementations, the keys of each JSON row:

    ours          the backend get_backend("auto", device) picks (FA4Backend where fa4_unavailable(device) is
                  None, else TritonBackend), built with this run's TritonConfig (--configs, the dry run's
                  blocks); tile lists
    triton        TritonBackend(TritonConfig(...)), the default before FA4: what FA4 replaces (only when ours
                  is not already it)
    ours_triton   TritonBackend without the dense fast path (dense masks): the Triton kernel alone
    flex          torch.compile'd FlexAttention, catalog mask_mod -> BlockMask (full: no mask): Triton kernels
    flex_flash    the same call and BlockMask with kernel_options={"BACKEND": "FLASH"}: Flex on FA4's kernels
    fa4           FA4 called directly (flash_attn.cute.interface), only where it expresses the mask natively:
                  full and causal (flash_attn_func, causal=True), sliding_window_1024 (window_size=(1024, 0):
                  key j kept for query i iff i - 1024 <= j <= i), docs_causal (flash_attn_varlen_func over
                  the documents' cu_seqlens, causal=True)
    cudnn         SDPA's cuDNN backend on the dense masks (is_causal), K/V expanded to Hq heads outside the
                  timed region
flash-attn-4 not installed: flex_flash and fa4 record {"error": "flash-attn-4 not installed"}.

TFLOP/s with FLOPs = 4 * kept_area * Hq * D forward, 2.5x that backward; times are medians of
triton.testing.do_bench (CUDA events). Backward times exclude the forward (the peers: autograd.grad on a
retained graph; ours: backend.backward incl. its delta = rowsum(dout*out) preprocessing). Every impl of ours
records the path it ran (e.g. fa4 / cudnn / cudnn+triton / triton) and the block configs of its Triton
kernels ("configs"). Per row, fwd_vs_P / bwd_vs_P = P's time / ours' time for each peer P in flex,
flex_flash, fa4, cudnn that ran (> 1: ours is faster); fwd_vs_best / bwd_vs_best the same against the
fastest of them per direction, named in best_fwd_peer / best_bwd_peer. The run ends with a markdown table
(stdout); while it runs a progress bar on stderr names the case and implementation being timed (redrawn
at most every 30 s where stderr is not a terminal: tools/common.py), and each case's line goes to
stderr with --verbose.

--tune times candidate block configs of TritonBackend per phase instead (others at their defaults) and
writes the fastest per row class as DIR/tuned_configs.json, the format ``--configs`` (and
``configs_from_json``) reads; it ends with a table of the chosen configs.

Usage: python tools/bench_kernels.py [--seqlens 16384] [--masks ...] [--out DIR] [--tune] [--configs JSON]
       python tools/bench_kernels.py --device cpu --tiny --out /tmp/bk   # CPU dry run
Writes DIR/bench_kernels.json and DIR/bench_kernels.png (device, date, command, our backend's describe()
and the flash-attn-4 version inside).
The CPU dry run (Triton's interpreter; fp16, Hq=4, Hkv=1, D=32, S=256, 32 x 32 blocks, one timed call
each; no Flex, FA4 or cuDNN) checks that the program runs end to end; its times mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/: the progress bar and table
from common import Progress, device_name, markdown_table, run_record  # noqa: E402


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
    DEFAULT_CONFIGS, KernelConfig, PhaseConfigs, TritonBackend, TritonConfig, configs_from_json, get_backend,
    kept_area,
)

HQ, HKV, D = 32, 8, 128
DEVICE = "cuda"  # --device cpu --tiny: "cpu" and the tiny sizes of main()
# the CPU dry run uses fp16: Triton's interpreter computes bf16 tl.dot wrongly (garbage products)
DTYPE = torch.bfloat16


BENCH_MS = {"warmup": 50, "rep": 200}  # --tune uses shorter runs
PEERS = ("flex", "flex_flash", "fa4", "cudnn")  # what ours is compared with (ratios, best peer)
IMPLS = ("ours", "triton", "ours_triton") + PEERS  # print, table and plot order
FA4_MASKS = ("full", "causal", "docs_causal", "sliding_window_1024")  # the masks FA4 expresses natively
FA4_MISSING = "flash-attn-4 not installed"


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


def default_backend(config):
    """The backend get_backend("auto", DEVICE) picks (FA4Backend where fa4_unavailable(DEVICE) is None, else
    TritonBackend), built with ``config`` (--configs, the dry run's small blocks) as auto's plain one is not.
    Where auto picks neither (the reference backend on the CPU) TritonBackend: the dry run's interpreter."""
    auto = get_backend("auto", DEVICE)
    return type(auto)(config) if getattr(auto, "name", None) in ("triton", "fa4") else TritonBackend(config)


def backend_info(be):
    """meta's record of a backend: its name, and its describe() where it has one (FA4: version, arch,
    the fallbacks it took)."""
    info = {"name": getattr(be, "name", type(be).__name__)}
    if hasattr(be, "describe"):
        info["describe"] = be.describe()
    return info


def time_ours(be, tiles, s, q, k, v, do):
    """(fwd ms, bwd ms, forward's path) of backend be. The first forward and backward are untimed: compiles,
    device schedules and the cuDNN probe of a new (dtype, head_dim, Hq / Hkv) family."""
    prep = be.prepare(tiles, s, s, head_dims=(D,))
    be.last_configs.clear()  # so that it holds this case's configs afterwards
    out, lse = be.forward(q, k, v, prep)
    fwd_path = be.last_path  # the backward's is be.last_path afterwards (FA4 may fall back in one only)
    be.backward(q, k, v, out, lse, do, prep)  # compile + build device schedules outside timing
    tf = bench(lambda: be.forward(q, k, v, prep))
    tb = bench(lambda: be.backward(q, k, v, out, lse, do, prep))
    return tf, tb, fwd_path


def cfg_list(c):
    return [c.block_m, c.block_n, c.num_warps, c.num_stages, int(c.tma)]


def ours_record(b, tf, tb, ff, fwd_path):
    """Result dict of one of our backends: times, TFLOP/s, paths (path: the backward's, fwd_path: the
    forward's) and the block configs its Triton kernels ran with (none when FA4 ran everything)."""
    return {"fwd_ms": tf, "bwd_ms": tb, "fwd_tflops": ff / tf / 1e9, "bwd_tflops": 2.5 * ff / tb / 1e9,
            "path": b.last_path, "fwd_path": fwd_path,
            "configs": {ph: cfg_list(c) for ph, c in b.last_configs.items()}}


def cudnn_status(*backends):
    """What the cuDNN probes of these backends found per (device, dtype, head_dim, Hq / Hkv) family: a layout
    or why not (backends without cuDNN pieces have no probes)."""
    return {str(tuple(map(str, key))): found.layout or found.reason
            for be in backends for key, found in getattr(be, "cudnn_probes", {}).items()}


class PeerMissing(Exception):
    """A peer that cannot run here (flash-attn-4 absent); its message is the row's error as it is."""


def time_autograd(f, leaves, dout):
    """(fwd ms, bwd ms) of a peer: out = f(*leaves) timed under no_grad; the backward as torch.autograd.grad
    of out on a retained graph (the forward excluded). The first calls (compiles) are untimed."""
    with torch.no_grad():
        f(*leaves)
        tf = bench(lambda: f(*leaves))
    o = f(*leaves)
    torch.autograd.grad(o, leaves, dout, retain_graph=True)
    tb = bench(lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True))
    return tf, tb


def fa4_version():
    """The installed flash-attn-4's version, or None."""
    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None


def fa4_interface():
    """flash_attn.cute.interface (imported on first use); PeerMissing where flash-attn-4 is not installed."""
    try:
        from flash_attn.cute import interface
    except ImportError as e:
        if fa4_version() is None:
            raise PeerMissing(FA4_MISSING) from e
        raise  # installed but broken: the row records the ImportError itself
    return interface


_flex = {}  # kernel_options["BACKEND"] (None: Flex's default, its Triton kernels) -> compiled flex_attention
_block_mask = {}  # (mask, S) -> BlockMask, the latest one: flex and flex_flash share it


def flex_call(backend):
    """torch.compile'd flex_attention(q, k, v, block_mask) with GQA, run by Flex's ``backend`` (None or "FLASH")."""
    if backend not in _flex:
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = 128
        torch._dynamo.config.accumulated_cache_size_limit = 512
        opts = None if backend is None else {"BACKEND": backend}

        def call(q, k, v, block_mask):
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=opts)

        _flex[backend] = torch.compile(call, dynamic=False)
    return _flex[backend]


def block_mask(name, s):
    """The BlockMask of catalog mask ``name`` at S (None for full: Flex without a mask)."""
    if (name, s) not in _block_mask:
        from torch.nn.attention.flex_attention import create_block_mask

        _block_mask.clear()
        _block_mask[(name, s)] = (None if name == "full" else
                                  create_block_mask(catalog.mask_mod(name, s, "cuda"), None, None, s, s, device="cuda"))
    return _block_mask[(name, s)]


def time_flex(name, s, q, k, v, do, backend=None):
    """Flex on [1, H, S, D] copies; backend "FLASH": kernel_options={"BACKEND": "FLASH"} (needs flash-attn-4)."""
    if backend == "FLASH":
        fa4_interface()  # Flex's FLASH backend runs flash_attn.cute: say so plainly when it is missing
    fn, bm = flex_call(backend), block_mask(name, s)
    qf, kf, vf, dof = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v, do))
    return time_autograd(lambda a, b, c: fn(a, b, c, bm), (qf.requires_grad_(True), kf.requires_grad_(True),
                                                            vf.requires_grad_(True)), dof)


def fa4_call(name, s):
    """(f, batched): f(q, k, v) -> out runs FA4 directly on catalog mask ``name`` (one of FA4_MASKS) at S;
    batched: f takes [1, S, H, D] (flash_attn_func), else [S, H, D] (flash_attn_varlen_func). GQA native."""
    fa = fa4_interface()

    def first(x):  # out, or (out, lse): FA4's return differs by version and return_lse
        return x[0] if isinstance(x, tuple) else x

    if name == "docs_causal":  # one causal sequence per document
        lens = catalog.doc_lengths(name, s)
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEVICE)
        mx = max(lens)
        return (lambda q, k, v: first(fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                                 max_seqlen_q=mx, max_seqlen_k=mx, causal=True)),
                False)
    # FA4's window (left, right) keeps j in [i - left, i + right] (bottom-right aligned; S_q = S_k here):
    # sliding_window_1024 is "k <= q and q - k <= 1024"
    kw = {"full": {}, "causal": {"causal": True}, "sliding_window_1024": {"window_size": (1024, 0)}}[name]
    return (lambda q, k, v: first(fa.flash_attn_func(q, k, v, **kw))), True


def time_fa4(name, s, q, k, v, do):
    f, batched = fa4_call(name, s)
    q, k, v, do = (x.unsqueeze(0) if batched else x for x in (q, k, v, do))
    return time_autograd(f, tuple(x.detach().requires_grad_(True) for x in (q, k, v)), do)


def time_cudnn(is_causal, q, k, v, do):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = HQ // HKV
    qf, dof = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, do))
    kf, vf = (x.repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0).contiguous() for x in (k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return time_autograd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=is_causal),
                             (qf.requires_grad_(True), kf.requires_grad_(True), vf.requires_grad_(True)), dof)


def compare_with_peers(r):
    """Adds to row r, for each peer P of PEERS that ran, fwd_vs_P / bwd_vs_P = P's ms / ours' ms (> 1: ours
    is faster), and fwd_vs_best / bwd_vs_best against the fastest peer per direction, named in
    best_fwd_peer / best_bwd_peer."""
    ours = r.get("ours", {})
    ran = [p for p in PEERS if "fwd_ms" in r.get(p, {})]
    if "fwd_ms" not in ours or not ran:
        return
    for p in ran:
        r[f"fwd_vs_{p}"] = r[p]["fwd_ms"] / ours["fwd_ms"]
        r[f"bwd_vs_{p}"] = r[p]["bwd_ms"] / ours["bwd_ms"]
    for d in ("fwd", "bwd"):
        best = min(ran, key=lambda p: r[p][f"{d}_ms"])
        r[f"best_{d}_peer"] = best
        r[f"{d}_vs_best"] = r[best][f"{d}_ms"] / ours[f"{d}_ms"]


def table(results, ours_name):
    """The closing markdown table (lines): TFLOP/s as fwd / bwd per impl, ratios as in compare_with_peers."""
    def tflops(r, impl):
        x = r.get(impl)
        if x is None:
            return "-"
        return f"{x['fwd_tflops']:.0f} / {x['bwd_tflops']:.0f}" if "fwd_ms" in x else "err"

    def ratio(r, key, peer_key=None):
        if key not in r:
            return "-"
        return f"{r[key]:.2f}" + (f" ({r[peer_key]})" if peer_key else "")

    def ours(r):
        x, cell = r.get("ours", {}), tflops(r, "ours")
        if "fwd_ms" in x:  # one path, or the forward's / the backward's where they differ
            bwd = x.get("path")
            fwd = x.get("fwd_path", bwd)
            cell += f" [{bwd}]" if fwd == bwd else f" [{fwd} / {bwd}]"
        return cell

    lines = [f"TFLOP/s as fwd / bwd; ours = {ours_name} (its path in brackets), triton = TritonBackend, the "
             "default FA4 replaces; ratios = peer time / ours time (> 1: ours is faster)",
             "| S | mask | ours fwd/bwd | triton | flex | flex FLASH | FA4 direct | cuDNN | ours/best peer fwd | bwd "
             "| ours/flex FLASH fwd | bwd |",
             "|---" * 12 + "|"]
    for r in results:
        lines.append(f"| {r['S']} | {r['mask']} | {ours(r)} | {tflops(r, 'triton')} | {tflops(r, 'flex')} | "
                     f"{tflops(r, 'flex_flash')} | {tflops(r, 'fa4')} | {tflops(r, 'cudnn')} | "
                     f"{ratio(r, 'fwd_vs_best', 'best_fwd_peer')} | {ratio(r, 'bwd_vs_best', 'best_bwd_peer')} | "
                     f"{ratio(r, 'fwd_vs_flex_flash')} | {ratio(r, 'bwd_vs_flex_flash')} |")
    return lines


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


def tune(s, masks, verbose=False):
    """Time each candidate config per stage (others at default); returns rows (each with --verbose)."""
    q, k, v, do = make_inputs(s)
    base = DEFAULT_CONFIGS[(D, "long")]
    rows = []
    bar = Progress(len(masks) * (len(TUNE_FWD) + len(TUNE_DKDV) + len(TUNE_DQ)), "tune", verbose=verbose)
    for stage, cands in (("fwd", TUNE_FWD), ("dkdv", TUNE_DKDV), ("dq", TUNE_DQ)):
        for c in cands:
            sc = PhaseConfigs(c if stage == "fwd" else base.fwd, c if stage == "dkdv" else base.dkdv,
                              c if stage == "dq" else base.dq)
            be = TritonBackend(TritonConfig({D: sc}, dense_fast_path=False))
            for name in masks:
                tiles = catalog.tiles(catalog.build(name, s))
                bar.running(f"{stage} {cfg_list(c)} {name}")
                try:
                    tf, tb, _ = time_ours(be, tiles, s, q, k, v, do)
                except Exception as e:  # noqa: BLE001  (e.g. out of shared memory)
                    bar.step(f"tune {stage} {c} {name}: {type(e).__name__} {str(e)[:80]}")
                    continue
                area = kept_area(tiles)
                ff = 4 * area * HQ * D
                r = {"stage": stage, "cfg": [c.block_m, c.block_n, c.num_warps, c.num_stages, int(c.tma)], "mask": name,
                     "fwd_tflops": ff / tf / 1e9, "bwd_tflops": 2.5 * ff / tb / 1e9, "fwd_ms": tf, "bwd_ms": tb}
                rows.append(r)
                bar.step(f"tune {stage:4s} {r['cfg']} {name:15s} fwd {r['fwd_tflops']:6.1f} bwd {r['bwd_tflops']:6.1f}")
            empty_cache()
    bar.close()
    return rows


def tune_table(best):
    """The closing table of --tune: the chosen config per row class and stage."""
    return markdown_table(["class", "stage", "block_m", "block_n", "warps", "stages", "tma"],
                          [[cls, st, *cfg] for cls, stages in best.items() for st, cfg in stages.items()])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", type=int, nargs="+", default=[16384])
    ap.add_argument("--masks", nargs="+", default=list(catalog.KERNEL_MASKS))
    ap.add_argument("--row-masks", nargs="+", default=["full", "causal", "docs_causal", "sliding_window_1024"],
                    help="masks run at the seqlens other than 16384")
    ap.add_argument("--out", default="out/kernels",
                    help="output folder (results the README quotes go to a dated benchmarks/ folder: benchmarks/RESULTS.md)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--tune", action="store_true", help="time candidate block configs instead")
    ap.add_argument("--configs", default=None, help="tuned configs JSON (from --tune) to use")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a dry run in Triton's interpreter (use with --tiny; no Flex, FA4 or cuDNN)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (Hq=4, Hkv=1, D=32, S=256, 32x32 blocks)")
    ap.add_argument("--verbose", action="store_true", help="each case's line on stderr as it finishes")
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
    os.makedirs(args.out, exist_ok=True)
    meta = run_record(device_name() if DEVICE == "cuda" else "cpu (Triton interpreter)", **{
            "triton": triton.__version__, "Hq": HQ, "Hkv": HKV, "D": D, "dtype": str(DTYPE).removeprefix("torch."), "flops": "fwd 4*area*Hq*D, bwd 2.5x", "masks": {m: catalog.DESCRIPTIONS[m] for m in args.masks + args.row_masks}})
    if args.tune:
        BENCH_MS.update(warmup=20, rep=80)
        rows = tune(args.seqlens[0], args.masks, args.verbose)
        best = pick_best(rows)
        with open(os.path.join(args.out, f"tune{args.tag}.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows, "best": best}, f, indent=1)
        with open(os.path.join(args.out, "tuned_configs.json"), "w") as f:
            json.dump(best, f)
        print("wrote", os.path.join(args.out, f"tune{args.tag}.json"), "and", os.path.join(args.out, "tuned_configs.json"))
        print("\n".join(tune_table(best)))
        return
    overrides = {}
    if args.tiny:  # small blocks: the interpreter's time grows with the block size
        c = KernelConfig(32, 32, 4, 1)
        overrides = {D: PhaseConfigs(c, c, c)}
    if args.configs:
        with open(args.configs) as f:
            overrides = configs_from_json(json.load(f))
        meta["configs"] = {f"{d}/{c}": str(v) for (d, c), v in overrides.items()}
    be = default_backend(TritonConfig(overrides))
    # the default before FA4, a column of its own where ours is not it (a subclass is not it either)
    be_tri = TritonBackend(TritonConfig(overrides)) if type(be) is not TritonBackend else None
    be_triton = TritonBackend(TritonConfig(overrides, dense_fast_path=False))
    results = []
    n_cases = sum(len(args.masks if s == 16384 else args.row_masks) for s in args.seqlens)
    bar = Progress(n_cases, "bench_kernels", verbose=args.verbose)
    for s in args.seqlens:
        q, k, v, do = make_inputs(s)
        for name in (args.masks if s == 16384 else args.row_masks):
            tiles = catalog.tiles(catalog.build(name, s))
            area = kept_area(tiles)
            ff = 4 * area * HQ * D
            r = {"S": s, "mask": name, "area": area, "density": area / s / s, "n_tiles": int(tiles.shape[0])}
            ours = {"ours": be}
            if be_tri is not None:
                ours["triton"] = be_tri
            if catalog.sdpa_is_causal(name) is not None:  # record the measurement behind the dense fast path
                ours["ours_triton"] = be_triton
            impls = {impl: ((lambda b=b: time_ours(b, tiles, s, q, k, v, do)), b) for impl, b in ours.items()}
            if DEVICE == "cuda":  # Flex compiles for the GPU
                impls["flex"] = (lambda: time_flex(name, s, q, k, v, do), None)
                impls["flex_flash"] = (lambda: time_flex(name, s, q, k, v, do, backend="FLASH"), None)
            if name in FA4_MASKS and DEVICE == "cuda":
                impls["fa4"] = (lambda: time_fa4(name, s, q, k, v, do), None)
            if catalog.sdpa_is_causal(name) is not None and DEVICE == "cuda":
                impls["cudnn"] = (lambda: time_cudnn(catalog.sdpa_is_causal(name), q, k, v, do), None)
            for impl, (fn, b) in impls.items():
                bar.running(f"S={s} {name} {impl}")
                try:
                    if b is not None:
                        tf, tb, fwd_path = fn()
                        r[impl] = ours_record(b, tf, tb, ff, fwd_path)
                    else:
                        tf, tb = fn()
                        r[impl] = {"fwd_ms": tf, "bwd_ms": tb, "fwd_tflops": ff / tf / 1e9,
                                   "bwd_tflops": 2.5 * ff / tb / 1e9}
                    if impl == "ours":
                        r["ours_path"] = be.last_path
                except PeerMissing as e:
                    r[impl] = {"error": str(e)}
                except Exception as e:  # noqa: BLE001  (record, keep going)
                    r[impl] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                empty_cache()
            compare_with_peers(r)
            results.append(r)
            line = f"S={s:6d} {name:15s} dens={r['density']:.3f}"
            for impl in IMPLS:
                if impl in r:
                    x = r[impl]
                    line += (f" | {impl} fwd {x['fwd_tflops']:6.1f} bwd {x['bwd_tflops']:6.1f}" if "fwd_ms" in x
                             else f" | {impl} ERR {x['error'][:60]}")
            bar.step(line)
        q = k = v = do = None  # the inputs freed before the next size's are made
        empty_cache()
    bar.close()
    path = os.path.join(args.out, f"bench_kernels{args.tag}.json")
    meta["cudnn"] = cudnn_status(be, be_tri)
    meta["ours_backend"] = backend_info(be)  # after the runs: describe() lists the fallbacks it took
    meta["flash_attn_4"] = fa4_version()
    out = {"meta": meta, "results": results}
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)  # describe() may hold devices, dtypes
    print("wrote", path, "cuDNN:", meta["cudnn"], "ours:", json.dumps(meta["ours_backend"], default=str))
    plot(meta, results, os.path.join(args.out, f"bench_kernels{args.tag}.png"))
    print()
    print("\n".join(table(results, meta["ours_backend"]["name"])))  # the summary: the last lines of stdout


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
    impls = [i for i in IMPLS if any(i in r for r in results)]
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
    fig.suptitle(f"{meta['device']}  {meta['date']}  {meta['dtype']} Hq={HQ} Hkv={HKV} D={D}  "
                 f"ours = {meta.get('ours_backend', {}).get('name')}\n{meta['command']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


if __name__ == "__main__":
    main()
