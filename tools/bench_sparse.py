"""Benchmark: dynamic block-sparse attention (megatron_cp.sparse) against dense attention, one GPU.

Per method and length on one envelope (causal, or catalog's docs_causal documents), bf16, Hq 32, Hkv 8, D 128, CP 1,
selectors at their published defaults, one backend for sparse and dense (auto: FA4 where it runs, else Triton),
Timer.medians of GPU time: the selection alone, sparse_attention forward / backward (selection + gather + kernel),
the backend's kernel alone on that selection and dense attention's on the envelope; kept shares, kernel TFLOP/s
on kept cells against dense (target RATIO_TARGET), the output's error against dense and (--png) the dense mass
the selection keeps per drawn head. Inputs: structured (structured_qk) or random (i.i.d.: nothing to find).
Writes OUT/bench_sparse.json ({meta, results}), OUT/bench_sparse.png, with --png OUT/selection_<method>_S<S>.png
(the selection at the first S beside dense attention's mass per block); a markdown table on stdout.

    python tools/bench_sparse.py --backend fa4 --seqlens 65536 --png --out benchmarks/<date>_1xH100_sparse
    python tools/bench_sparse.py --methods moba xattention --seqlens 65536 --envelope packed
    python tools/bench_sparse.py --dry-run   # CPU, reference kernels: S 1024, Hq 4, Hkv 2, D 32, fp32
"""

from __future__ import annotations

import math
import os
import sys
import traceback
from collections import Counter
from functools import partial

import numpy as np
import torch

import megatron_cp as mcp
from megatron_cp import kernels
from megatron_cp.kernels import BlockKeep
from megatron_cp.masks import catalog
from megatron_cp.masks.draw import block_grid
from megatron_cp.sparse import SELECTORS, HeadPattern, MInference, single_view, sparse_attention, sparse_layout
from megatron_cp.sparse.draw import block_mass, draw_selection

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/: common
from common import Progress, Timer, bar_panels, markdown_table, out_dir, parser, run_record, write_json  # noqa: E402

METHODS = tuple(SELECTORS)
RATIO_TARGET = 0.85  # the block-sparse kernel's TFLOP/s on kept cells over dense FA4's, fwd and bwd
DRY_RUN_BLOCK = {"moba": 128, "xattention": 64, "flexprefill": 64, "minference": 64}  # S 1024: 8 / 16 blocks
STRUCTURE_KINDS = ("a-shape", "vertical-slash", "local", "random")  # per K/V head, cyclic


def make_selector(method: str, args, hq: int, hkv: int):
    """``method``'s selector at its published defaults (the dry run: DRY_RUN_BLOCK; MInference: default_patterns)."""
    kw = {"block": DRY_RUN_BLOCK[method]} if args.dry_run else {}
    if method == "minference":
        if args.minference_config:
            return MInference.from_json(args.minference_config, args.minference_layer, block=kw.get("block", 128))
        return MInference(patterns=default_patterns(hq, hkv), **kw)
    return SELECTORS[method](**kw)


def selector_label(sel) -> str:
    """A short name of a selector and its hyperparameters (MInference: its kinds counted, not every head)."""
    kinds = Counter(p.kind for p in getattr(sel, "patterns", ()))
    return f"{type(sel).__name__}(block={sel.block}, {', '.join(f'{k} x{n}' for k, n in kinds.items())})" if kinds \
        else repr(sel)


def default_patterns(hq: int, hkv: int) -> list:
    """MInference without a searched config: per K/V head the kind fitting ``structured_qk``'s structure there, at
    the published sizes (on other inputs a stand-in that runs every kind's path, not a model's config)."""
    kind = {"a-shape": "a_shape", "vertical-slash": "vertical_slash", "local": "a_shape", "random": "block_sparse"}
    return [HeadPattern(kind=kind[k]) for k in structure_kinds(hkv) for _ in range(hq // hkv)]


def structure_kinds(hkv: int) -> list:
    """The kind of each K/V head's structure in ``structured_qk``."""
    return [STRUCTURE_KINDS[h % len(STRUCTURE_KINDS)] for h in range(hkv)]


def structured_qk(s: int, hq: int, hkv: int, d: int, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [S, Hq, D], k [S, Hkv, D] float32: noise (std 0.5) plus per K/V head (``structure_kinds``): a-shape =
    sink (64 keys sharing a direction with every query: +10 logits) + local band; vertical-slash = 32 random
    such keys (+8) + slashes at multiples of max(S / 16, 256) (+10); local = a band (+10 falling to ~0 by ~2S / M);
    random = noise. Bands and slashes are M harmonics, sum_m cos(w_m (i - j)) / M = q_i . k_j for q_i, k_j =
    c (cos w_m i, sin w_m i)_m: functions of i - j, as under rotary."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)  # on the device: 128k x 32 x 128 is slow on a CPU core
    q = torch.randn(s, hq, d, generator=g, device=dev) * 0.5
    k = torch.randn(s, hkv, d, generator=g, device=dev) * 0.5
    nd = min(8, d // 4)  # direction dims
    m = max(1, min(24, (d - nd) // 4))  # harmonics
    pos = torch.arange(s, dtype=torch.float64, device=dev)  # float64: positions up to 1M keep their phase
    root = math.sqrt(math.sqrt(d))  # logits are q.k / sqrt(D): a +L logit shift is (sqrt(L) root)^2 / sqrt(D)
    hd = slice(nd, nd + 2 * m)
    for h, kind in enumerate(structure_kinds(hkv)):
        qs = slice(h * (hq // hkv), (h + 1) * (hq // hkv))
        if kind in ("a-shape", "vertical-slash"):  # a direction every query shares with some keys
            u = torch.randn(nd, generator=g, dtype=torch.float64, device=dev)
            u = (u / u.norm() * math.sqrt(10.0 if kind == "a-shape" else 8.0) * root).float()
            keys = (torch.arange(min(64, s), device=dev) if kind == "a-shape"
                    else torch.randperm(s, generator=g, device=dev)[:32])
            q[:, qs, :nd] += u
            k[keys, h, :nd] += u
        if kind != "random":  # a band (period 2 S) or slashes: M harmonics
            period = max(s // 16, 256) if kind == "vertical-slash" else 2 * s
            ang = pos[:, None] * (2 * math.pi * torch.arange(1, m + 1, dtype=torch.float64, device=dev) / period)
            f = (torch.stack([ang.cos(), ang.sin()], -1).reshape(s, 2 * m) * (math.sqrt(10.0 / m) * root)).float()
            q[:, qs, hd] += f[:, None]
            k[:, h, hd] += f
    return q, k


def make_inputs(args, s: int, device, dtype, seed: int = 0) -> dict:
    """q [S, Hq, D], k / v [S, Hkv, D], dout [S, Hq, D] of ``dtype`` on ``device`` (global order)."""
    g = torch.Generator(device=device).manual_seed(seed + 1)
    randn = lambda *shape: torch.randn(*shape, generator=g, device=device)  # noqa: E731
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    q, k = structured_qk(s, hq, hkv, d, device, seed) if args.inputs == "structured" else \
        (randn(s, hq, d), randn(s, hkv, d))
    q, k, v = (x.to(device=device, dtype=dtype) for x in (q, k, randn(s, hkv, d)))
    return {"q": q, "k": k, "v": v, "do": randn(*q.shape).to(dtype)}


def time_api(fn, t: dict, clock):
    """(fwd ms, bwd ms) of fn(q, k, v) -> (out, lse), backward by autograd from out (.grad accumulates: same work)."""
    q, k, v = (t[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
    return clock(lambda: fn(q, k, v), lambda res: torch.autograd.backward(res[0], t["do"]))


def time_kernel(be, prepared, t: dict, k, v, scale, keep, clock):
    """(fwd ms, bwd ms, paths) of the backend's forward / backward on ``prepared`` with ``keep`` (a BlockKeep or
    None): the kernels alone, without the selection, gather or autograd around them."""
    q, do = t["q"], t["do"]
    out, lse = be.forward(q, k, v, prepared, scale, keep=keep)
    f, _ = clock(lambda: be.forward(q, k, v, prepared, scale, keep=keep))
    fwd_path = getattr(be, "last_path", None)
    _, b = clock(lambda: None, lambda _: be.backward(q, k, v, out, lse, do, prepared, scale, None, keep=keep))
    return f, b, {"fwd": fwd_path, "bwd": getattr(be, "last_path", None)}


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Relative errors of out against ref ([S, H, D]) over rows (one row = one token and head), fp32."""
    o, r = out.float(), ref.float()
    num, den = (o - r).square().sum(-1), r.square().sum(-1)
    rel = (num / den.clamp_min(1e-30)).flatten()
    return {"out_rel_err": float(rel.mean().sqrt()), "out_rel_rms": float((num.sum() / den.sum()).sqrt()),
            "out_row_rel_p99": float(torch.kthvalue(rel.sqrt().cpu(), max(1, math.ceil(0.99 * rel.numel()))).values)}


def dense_case(mask, t: dict, be, clock) -> dict:
    """Dense attention on the envelope: mcp.attention and the backend's kernel on the tile list."""
    s, hq, d = t["q"].shape
    plan = mcp.plan(mask, 1)
    attn = lambda q, k, v: mcp.attention(q, k, v, plan, None, backend=be)  # noqa: E731
    f, b = time_api(attn, t, clock)
    with torch.no_grad():
        out = attn(t["q"], t["k"], t["v"])[0]
    tiles = catalog.tiles(mask)  # one GPU's tile list of the envelope (bench_kernels' lists)
    kf, kb, path = time_kernel(be, be.prepare(tiles, s, s), t, t["k"], t["v"], 1.0 / math.sqrt(d), None, clock)
    cells = int(kernels.kept_area(tiles))
    flops = 4.0 * hq * d * cells
    return {"fwd_ms": f, "bwd_ms": b, "kernel_fwd_ms": kf, "kernel_bwd_ms": kb, "kernel_path": path,
            "cells": cells, "tflops_fwd": flops / kf / 1e9, "tflops_bwd": 2.5 * flops / kb / 1e9, "out": out}


def sparse_case(method, sel, mask, t: dict, be, clock, dense: dict, args, plans: dict) -> dict:
    """One method at one S: selection, the sparse call, its kernel alone, against ``dense``."""
    s, hq, d = t["q"].shape
    B = sel.block
    if B not in plans:  # one plan per block and S: the runtime caches its layout and prepared tiles on the plan
        plans[B] = mcp.plan(mask, 1, guest_rows="none", block=B)
        if not np.array_equal(plans[B].local_ids(0), np.arange(s)):  # CP = 1 keeps global order
            raise RuntimeError("a one-rank plan reordered the tokens")
    plan = plans[B]
    q, k = t["q"], t["k"]
    # the selection alone, as select_blocks runs it at CP = 1 (the view is static: built outside the timing)
    sel.check(hq, k.shape[1], d, s)
    view = single_view(mask, B, k)
    env = view.envelope > 0
    with torch.no_grad():
        keep = sel.select(q, k, view) & env[None]  # [Hq, nb, nb]: q blocks in global order at CP = 1
        select_ms, _ = clock(lambda: sel.select(q, k, view))
        stats = {}
        out = sparse_attention(q, k, t["v"], plan, None, sel, backend=be, stats=stats)[0]
    if stats["blocks_selected"] != int(keep.sum()):  # the runtime selected what the view gave
        raise RuntimeError(f"sparse_attention selected {stats['blocks_selected']}, single_view {int(keep.sum())}")
    f, b = time_api(lambda q_, k_, v_: sparse_attention(q_, k_, v_, plan, None, sel, backend=be), t, clock)

    # the kernel alone on rank 0's layout, as sparse_attention builds it: at CP = 1 the key buffer holds the
    # envelope's key blocks in ascending order (all of them for causal and documents)
    lay = sparse_layout(plan, 0, B)
    prep = be.prepare(lay.tiles, lay.nq * B, lay.ne * B)
    ids = torch.as_tensor(lay.env_ids, dtype=torch.long, device=q.device)
    rows = (ids[:, None] * B + torch.arange(B, device=q.device)).reshape(-1)
    kbuf, vbuf = (t["k"], t["v"]) if lay.ne == s // B else (t["k"][rows], t["v"][rows])
    kf, kb, path = time_kernel(be, prep, t, kbuf, vbuf, 1.0 / math.sqrt(d), BlockKeep(keep[:, :, ids].contiguous(), B),
                               clock)

    grid = torch.as_tensor(block_grid(mask.traps, s, s, B), device=q.device)  # envelope cells per block pair
    kc = int((keep.to(torch.int64) * grid[None]).sum())
    flops = 4.0 * d * kc
    r = {"method": method, "S": s, "block": B, "selector": selector_label(sel), "selector_repr": repr(sel),
         "blocks_selected": stats["blocks_selected"], "blocks_envelope": stats["blocks_envelope"],
         "kept_blocks": stats["blocks_selected"] / stats["blocks_envelope"],
         "cells_kept": kc, "cells_envelope": hq * dense["cells"], "kept_cells": kc / (hq * dense["cells"]),
         "select_ms": select_ms, "fwd_ms": f, "bwd_ms": b, "attn_fwd_ms": f - select_ms,
         "kernel_fwd_ms": kf, "kernel_bwd_ms": kb, "kernel_path": path,
         **{f"dense_{x}": dense[x] for x in ("fwd_ms", "bwd_ms", "kernel_fwd_ms", "kernel_bwd_ms", "kernel_path")},
         "speedup_fwd": dense["fwd_ms"] / f, "speedup_bwd": dense["bwd_ms"] / b,
         # what "sparse never loses to dense" reads: <= 1 on every row, forward and backward
         "sparse_over_dense_fwd": f / dense["fwd_ms"], "sparse_over_dense_bwd": b / dense["bwd_ms"],
         "kernel_speedup_fwd": dense["kernel_fwd_ms"] / kf, "kernel_speedup_bwd": dense["kernel_bwd_ms"] / kb,
         "kernel_tflops_fwd": flops / kf / 1e9, "kernel_tflops_bwd": 2.5 * flops / kb / 1e9,
         "dense_tflops_fwd": dense["tflops_fwd"], "dense_tflops_bwd": dense["tflops_bwd"]}
    r.update({f"tflops_ratio_{p}": r[f"kernel_tflops_{p}"] / r[f"dense_tflops_{p}"] for p in ("fwd", "bwd")})
    r["tflops_ratio_ok"] = min(r["tflops_ratio_fwd"], r["tflops_ratio_bwd"]) >= RATIO_TARGET
    r.update(row_errors(out, dense["out"]))
    if args.png and args.png_done.get(method) is None:
        r["recall"] = draw_case(method, sel, mask, t, keep, env, args)
    return r


def draw_case(method, sel, mask, t: dict, keep, env, args) -> dict:
    """selection_<method>_S<S>.png: the selection of the first q head of each structure kind beside dense
    attention's block mass; returns {head: recall} (the dense mass the selection keeps)."""
    (s, hq), hkv = t["q"].shape[:2], t["k"].shape[1]
    heads = [j * (hq // hkv) for j in range(min(len(STRUCTURE_KINDS), hkv))]
    dense = block_mass(t["q"], t["k"], sel.block, heads, mask, rows_per_block=16)
    path = os.path.join(args.out, f"selection_{method}_S{s}.png")
    draw_selection(keep, path, heads=heads, dense=dense, envelope=env,
                   title=f"{selector_label(sel)}  S={s}  {args.envelope} envelope, {args.inputs} inputs")
    args.png_done[method] = path
    return {int(h): float((dense[n] * keep[h]).sum() / dense[n].sum().clamp_min(1e-30)) for n, h in enumerate(heads)}


def table(rows: list) -> list:
    """The closing markdown table: a row per (method, S); err where the case failed."""
    f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    tf = lambda x: f"{x:.0f}" if x >= 10 else f"{x:.3g}"  # noqa: E731  (TFLOP/s; the dry run's are tiny)
    two = lambda r, key, fmt=f: " / ".join(fmt(r[key.format(p)]) for p in ("fwd", "bwd"))  # noqa: E731
    ratio = lambda x: f(x) + ("*" if x < RATIO_TARGET else "")  # noqa: E731
    head = ["method", "S", "kept blocks %", "kept cells %", "select ms", "fwd ms", "bwd ms", "dense fwd / bwd ms",
            "speedup fwd / bwd", "TFLOP/s kept fwd / bwd", "dense TFLOP/s fwd / bwd",
            f"TFLOP/s ratio fwd / bwd (* < {RATIO_TARGET})", "out rel. err"]
    return markdown_table(head, [
        [r["method"], r["S"], "err"] + ["-"] * (len(head) - 4) + [r["error"][:80]] if "error" in r else
        [r["method"], r["S"], f"{100 * r['kept_blocks']:.1f}", f"{100 * r['kept_cells']:.1f}", f(r["select_ms"]),
         f(r["fwd_ms"]), f(r["bwd_ms"]), two(r, "dense_{}_ms"), two(r, "speedup_{}"), two(r, "kernel_tflops_{}", tf),
         two(r, "dense_tflops_{}", tf), two(r, "tflops_ratio_{}", ratio), f"{r['out_rel_err']:.2e}"] for r in rows])


def plot(meta: dict, rows: list, path: str) -> None:
    """Speedup (API time), TFLOP/s of the sparse kernel on kept cells against dense, kept fraction."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return
    labels = [f"{r['method']}\nS={r['S'] // 1024}k" if r["S"] >= 1024 else f"{r['method']}\nS={r['S']}" for r in ok]
    col = lambda key: [r[key] for r in ok]  # noqa: E731
    bar_panels(path, [
        {"labels": labels, "series": {"fwd": col("speedup_fwd"), "bwd": col("speedup_bwd")},
         "ylabel": "speedup vs dense (x)", "hline": 1.0},
        {"labels": labels, "series": {f"{who} {p}": col(f"{key}_tflops_{p}") for p in ("fwd", "bwd")
                                      for who, key in (("sparse", "kernel"), ("dense", "dense"))},
         "ylabel": "kernel TFLOP/s"},
        {"labels": labels, "series": {"blocks": col("kept_blocks"), "cells": col("kept_cells")},
         "ylabel": "kept fraction of envelope"}],
        f"{meta['device']}  {meta['date']}  {meta['dtype']} Hq={meta['Hq']} Hkv={meta['Hkv']} D={meta['D']}  "
        f"{meta['envelope']} envelope, {meta['inputs']} inputs, backend {meta['backend']['name']}\n{meta['command']}")


def main(argv=None):
    ap = parser(__doc__, os.path.join("out", "sparse"), timing=(2, 5))  # FA4 compiles in the first warm-up step
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--seqlens", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--envelope", choices=("causal", "packed"), default="causal")
    ap.add_argument("--inputs", choices=("random", "structured"), default="structured")
    ap.add_argument("--backend", default="auto", choices=kernels.BACKEND_CHOICES)
    ap.add_argument("--minference-config", default=None, help="MInference pattern JSON (tools/minference_search.py)")
    ap.add_argument("--minference-layer", type=int, default=0, help="the layer of --minference-config (0-based)")
    ap.add_argument("--png", action="store_true", help="also draw each method's selection at the first S")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.seqlens = [1024] if args.seqlens == ap.get_default("seqlens") else args.seqlens
        args.backend, args.warmup, args.iters = "reference", 0, 1
    args.heads, args.kv_heads, args.head_dim, args.dtype = (4, 2, 32, "fp32") if args.dry_run else (32, 8, 128, "bf16")
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: run on a GPU, or --dry-run on the CPU")
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    args.png_done = {}
    be = kernels.get_backend(args.backend, device)  # one object: its prepared tiles are cached per object
    meta = run_record(
        torch.cuda.get_device_name() if device.type == "cuda" else "cpu (reference kernels)",
        None if argv is None else " ".join(["python tools/bench_sparse.py", *argv]),
        dtype=args.dtype, Hq=args.heads, Hkv=args.kv_heads, D=args.head_dim, envelope=args.envelope,
        inputs=args.inputs, warmup=args.warmup, iters=args.iters,
        timing="medians; CUDA: Timer.held (GPU time behind a held stream); CPU: wall clock",
        flops="fwd 4*D*kept cells (sum over heads), bwd 2.5x; dense: 4*Hq*D*envelope cells",
        backend={"name": getattr(be, "name", type(be).__name__)}, selection_png=args.png_done,  # filled by --png
        **({"structure": {"kv_heads": structure_kinds(args.kv_heads), "q_heads_per_kv_head": args.heads //
                          args.kv_heads}} if args.inputs == "structured" else {}))
    rows = []
    path = os.path.join(out_dir(args), f"bench_sparse{args.tag}.json")
    save = lambda: write_json(path, {"meta": meta, "results": rows})  # noqa: E731  (after every case)
    bar = Progress(len(args.seqlens) * (1 + len(args.methods)), "bench_sparse", verbose=args.verbose)
    clock = partial(Timer(device).medians, warmup=args.warmup, iters=args.iters)  # -> (fwd ms, bwd ms)
    for s in args.seqlens:
        t = make_inputs(args, s, device, dtype)
        mask = mcp.masks.causal(s) if args.envelope == "causal" else catalog.build("docs_causal", s)
        plans = {}
        bar.running(f"S={s} dense")
        try:
            dense = dense_case(mask, t, be, clock)
            bar.step(f"S={s:7d} dense  fwd {dense['fwd_ms']:.2f} ms bwd {dense['bwd_ms']:.2f} ms "
                     f"kernel {dense['tflops_fwd']:.0f} / {dense['tflops_bwd']:.0f} TFLOP/s")
        except Exception as e:  # noqa: BLE001  (record, go on with the next length)
            bar.note(f"S={s} dense: {type(e).__name__}: {e}")
            rows += [{"method": m, "S": s, "error": f"dense: {type(e).__name__}: {str(e)[:200]}",
                      "traceback": traceback.format_exc()[-3000:]} for m in args.methods]
            save()
            bar.step(n=1 + len(args.methods))
            continue
        for method in args.methods:
            bar.running(f"S={s} {method}")
            try:
                sel = make_selector(method, args, t["q"].shape[1], t["k"].shape[1])
                r = sparse_case(method, sel, mask, t, be, clock, dense, args, plans)
                line = f"S={s:7d} {method:11s} " + " ".join(f"{x} {r[x]:.3g}" for x in (
                    "kept_blocks", "fwd_ms", "speedup_fwd", "bwd_ms", "speedup_bwd", "tflops_ratio_fwd",
                    "tflops_ratio_bwd", "out_rel_err")) + f" kernel {r['kernel_path']}"
            except Exception as e:  # noqa: BLE001  (record, keep going: e.g. out of memory)
                r = {"method": method, "S": s, "error": f"{type(e).__name__}: {str(e)[:200]}",
                     "traceback": traceback.format_exc()[-3000:]}
                line = f"S={s:7d} {method:11s} ERR {r['error']}"
                bar.note(line)
            rows.append(r)
            save()
            bar.step(line)
            torch.cuda.empty_cache()  # a no-op on the CPU
        del t, dense, plans
        torch.cuda.empty_cache()
    bar.close()
    if hasattr(be, "describe"):
        meta["backend"]["describe"] = be.describe()  # after the runs: the fallbacks it took
    save()
    plot(meta, rows, os.path.join(args.out, f"bench_sparse{args.tag}.png"))
    print("wrote", path, *args.png_done.values())
    print("\n" + "\n".join(table(rows)))  # the summary: the last lines of stdout
    return rows


if __name__ == "__main__":
    main()
