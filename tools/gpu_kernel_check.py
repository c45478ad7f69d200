"""GPU correctness matrix of a tile-list attention backend: --backend triton (TritonBackend), fa4 (FA4Backend:
FlashAttention-4, falling back to its Triton kernels where FA4 cannot run, e.g. float32, or head_dim > 192 in
the backward) or auto (default: the one get_backend("auto", "cuda") picks), each built with
TritonConfig(--configs).

For every kernel-table mask (megatron_cp.masks.catalog.KERNEL_MASKS, tile lists checked cell by cell against their
FlexAttention mask_mod), S in --seqlens, head_dim 64/128, bf16/fp16, GQA ratio 1/4/8:
forward (out, lse) and backward (dq, dk, dv) are compared with a dense fp64 reference. Rule (ANCHORS.md):
rms error <= 2 x the rms error of a plain PyTorch reference run in the same low precision, plus a floor
of 1e-6 x rms(reference). Also: no NaN anywhere, fully masked rows give out 0 / lse -inf, and a second
forward + backward of the backend in deterministic mode (TritonConfig(deterministic=True)) is bitwise
identical: a failure for Triton; for other backends (FA4) reported per case ("deterministic") and counted
in the summary, not failed. --big adds S = 131072 (Hq 32, Hkv 8, D 128) no-NaN and peak-memory runs.
Triton: lists the default backend splits (a single dense tile, dense pieces, the forward's band squares) are
also run through it (its cuDNN pieces); other backends: the default (non-deterministic) mode is always run as
well. Planner-style sliding-window bands are added (band_cases), and the lists the distributed runtime gives
the backend (rank_list_cases: every benchmark mask planned over CP 2 and 4 at the largest S, each rank's rows
against its key buffer, sq != sk). Each case records the path every run took
(``last_path``: [forward's, backward's], e.g. "fa4" or a Triton fallback). The summary says what the cuDNN
probe found per (dtype, head_dim, Hq / Hkv) family and the backend's describe() where it has one.

While it runs a progress bar on stderr names the case being checked (redrawn at most every 30 s where
stderr is not a terminal: tools/common.py); each case's line goes to stderr with --verbose, failures
always. It ends with one table on stdout: per mask and S (and per extra check), cases passed, the worst
error ratio to the low-precision reference and the paths that ran.

Usage: python tools/gpu_kernel_check.py [--backend auto|triton|fa4] [--seqlens 1024 4096 16384] [--big]
       [--json out.json] [--verbose]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import math
import os
import sys
import time

import torch

from megatron_cp.kernels import TritonBackend, TritonConfig, configs_from_json, get_backend
from megatron_cp.masks import catalog

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/: the progress bar and table
from common import Progress, device_name, markdown_table, run_record  # noqa: E402

ERR_KEYS = ("out", "lse", "dq", "dk", "dv")


def make_backend(name, overrides, **config):
    """Backend ``name`` (auto, triton, fa4) built with TritonConfig(overrides, **config): TritonBackend, or
    FA4Backend (the config is its Triton fallback's); auto: the class get_backend("auto", "cuda") picks.
    fa4 where FA4 cannot run here exits with the reason (instead of a matrix of Triton fallbacks)."""
    cfg = TritonConfig(overrides, **config)
    if name == "auto":
        name = getattr(get_backend("auto", "cuda"), "name", "triton")
    if name == "triton":
        return TritonBackend(cfg)
    if name != "fa4":
        raise SystemExit(f"--backend auto picked {name!r}; this check runs triton or fa4")
    try:
        from megatron_cp.kernels import FA4Backend, fa4_unavailable
    except ImportError as e:
        raise SystemExit(f"--backend fa4: this checkout has no FA4 backend ({e})") from e
    why = fa4_unavailable(torch.device("cuda"))
    if why is not None:
        raise SystemExit(f"--backend fa4: FA4 cannot run here: {why}")
    return FA4Backend(cfg)


def backend_info(**backends):
    """The summary's record of the backend: its name and, where it has one, each instance's describe()
    (each saw its own fallbacks)."""
    be = next(iter(backends.values()))
    info = {"name": getattr(be, "name", type(be).__name__)}
    if hasattr(be, "describe"):
        info["describe"] = {role: b.describe() for role, b in backends.items()}
    return info


def chunked_reference(q, k, v, dout, keep, dt, scale, chunk=2048):
    """Dense attention fwd+bwd computed in dtype ``dt`` (matmuls and softmax), row chunks of ``chunk``.

    Returns out [sq,Hq,D], lse [sq,Hq], dq, dk, dv (float64 tensors for comparison)."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[:2]
    g = hq // hkv
    acc = torch.float64 if dt == torch.float64 else torch.float32
    out = torch.zeros(sq, hq, d, dtype=torch.float64, device=q.device)
    lse = torch.zeros(sq, hq, dtype=torch.float64, device=q.device)
    dq = torch.zeros_like(out)
    dk = torch.zeros(sk, hkv, d, dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    for h in range(hq):
        hk = h // g
        K, V = k[:, hk].to(dt), v[:, hk].to(dt)
        for r0 in range(0, sq, chunk):
            r1 = min(sq, r0 + chunk)
            Q, dO = q[r0:r1, h].to(dt), dout[r0:r1, h].to(dt)
            kp = keep[r0:r1]
            S = (Q @ K.T) * scale
            S = S.masked_fill(~kp, float("-inf"))
            P = torch.softmax(S, -1).nan_to_num(0.0)
            L = torch.logsumexp(S, -1)
            O = P @ V
            delta = (dO * O).sum(-1)
            dP = dO @ V.T
            dS = P * (dP - delta[:, None])
            out[r0:r1, h] = O.double()
            lse[r0:r1, h] = L.double()
            dq[r0:r1, h] = ((dS @ K) * scale).double()
            dk[:, hk] += ((dS.T @ Q) * scale).to(acc)
            dv[:, hk] += (P.T @ dO).to(acc)
    return out, lse, dq, dk.double(), dv.double()


def rms(x):
    return float(x.double().pow(2).mean().sqrt()) if x.numel() else 0.0


def check_case(be, be_det, mask, s, d, dtype, g, hkv, keep, tiles, seed, sk=None):
    """One list of ``s`` rows against ``sk`` keys (default ``s``): every run of it against the references."""
    dev = "cuda"
    hq = hkv * g
    sk = s if sk is None else sk
    gen = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(s, hq, d, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(sk, hkv, d, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(sk, hkv, d, device=dev, dtype=dtype, generator=gen)
    dout = torch.randn(s, hq, d, device=dev, dtype=dtype, generator=gen)
    scale = 1.0 / math.sqrt(d)
    # deterministic mode: run twice, bitwise identical (must be for Triton; reported for other backends)
    triton = type(be_det) is TritonBackend
    prep = be_det.prepare(tiles, s, sk, head_dims=(d,))
    out, lse = be_det.forward(q, k, v, prep, scale)
    det_fwd_path = be_det.last_path
    dq, dk, dv = be_det.backward(q, k, v, out, lse, dout, prep, scale)
    # the runs' keys (result fields too): Triton's as before; others "<name>_det" and "<name>_default"
    last_path = {"triton" if triton else f"{be_det.name}_det": [det_fwd_path, be_det.last_path]}
    out2, lse2 = be_det.forward(q, k, v, prep, scale)
    dq2, dk2, dv2 = be_det.backward(q, k, v, out2, lse2, dout, prep, scale)
    torch.cuda.synchronize()
    det = all(torch.equal(a, b) for a, b in ((out, out2), (lse, lse2), (dq, dq2), (dk, dk2), (dv, dv2)))
    del out2, lse2, dq2, dk2, dv2
    runs = {next(iter(last_path)): (out, lse, dq, dk, dv)}
    prep_f = be.prepare(tiles, s, sk, head_dims=(d,))
    # Triton: the default mode differs only where it sends pieces to cuDNN; other backends: always run it
    if not triton or prep_f.cudnn_fwd is not None or prep_f.cudnn_bwd is not None:
        o_f, l_f = be.forward(q, k, v, prep_f, scale)
        path_f = be.last_path
        g_f = be.backward(q, k, v, o_f, l_f, dout, prep_f, scale)
        key = f"fast_{path_f}_{be.last_path}" if triton else f"{be.name}_default"
        runs[key] = (o_f, l_f, *g_f)
        last_path[key] = [path_f, be.last_path]
    ref = chunked_reference(q, k, v, dout, keep, torch.float64, scale)
    low = chunked_reference(q, k, v, dout, keep, dtype, scale)
    empty = ~keep.any(1)
    fin = ~empty
    res = {"mask": mask, "S": s, "Sk": sk, "D": d, "dtype": str(dtype).split(".")[-1], "G": g, "Hq": hq, "Hkv": hkv,
           "deterministic": det, "empty_rows": int(empty.sum()), "paths": list(runs), "last_path": last_path}
    ok = det or not triton
    for path, (out, lse, dq, dk, dv) in runs.items():
        nan = any(bool(torch.isnan(x).any()) for x in (out, lse, dq, dk, dv))
        empty_ok = bool((lse[empty] == float("-inf")).all()) and bool((out[empty] == 0).all())
        res[path] = {"nan": nan, "empty_ok": empty_ok}
        ok = ok and not nan and empty_ok
        ours = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
        for i, name in enumerate(["out", "lse", "dq", "dk", "dv"]):
            r, lo, o = ref[i], low[i], ours[name]
            if name == "lse":
                r, lo, o = r[fin], lo[fin], o[fin]
            e_ours = rms(o.double() - r)
            e_low = rms(lo - r)
            bound = 2 * e_low + 1e-6 * rms(r)
            res[path][name] = {"err": e_ours, "lowp_err": e_low, "ratio": e_ours / max(e_low, 1e-30)}
            ok = ok and e_ours <= bound
    res["nan"] = any(res[p]["nan"] for p in runs)
    res["pass"] = ok
    return res


def band_cases():
    """Sliding windows as the planner emits them (a causal head, then one BI_CAUSAL band), for the forward's
    band squares on cuDNN (run with TritonConfig.band_squares 2048, see main): whole chunks, chunks and
    tail rows, and a window wider than the band's rows (one chunk with a full rectangle)."""
    out = []
    for s, w in ((8192, 2048), (8192 + 700, 2048), (6144, 4096)):
        out.append((f"band_w{w}_s{s}", s, torch.tensor([[0, w, 0, w, 1], [w, s, 0, s, 3]], dtype=torch.int32)))
    return out


def rank_list_cases(s, cps=(2, 4)):
    """What the distributed runtime gives the backend: each rank's rows against its key buffer (sq != sk, causal
    slices off the diagonal, several documents in one list) for every benchmark mask planned over ``cps``."""
    import megatron_cp as mcp

    out = []
    for name in catalog.DIST_MASKS:
        for cp in cps:
            for rp in mcp.plan(catalog.build(name, s), cp).ranks:
                if len(rp.tiles):
                    out.append((f"{name}_cp{cp}_rank{rp.rank}", rp.num_tokens, rp.buffer_len,
                                torch.as_tensor(rp.tiles, dtype=torch.int32)))
    return out


def worst_ratio(r):
    """The largest rms error / low-precision reference's rms error over a case's runs and outputs."""
    return max(r[p][n]["ratio"] for p in r["paths"] for n in ERR_KEYS)


def summary_table(results, big):
    """The closing table (lines): per (mask, S) of the matrix and band cases, cases passed, deterministic
    runs, the worst error ratio and the paths [fwd / bwd] that ran; then each extra and --big check."""
    rows = []
    for mask, s in dict.fromkeys((r["mask"], r["S"]) for r in results):
        rs = [r for r in results if r["mask"] == mask and r["S"] == s]
        paths = sorted({"/".join(map(str, p)) for r in rs for p in r["last_path"].values()})
        rows.append([mask, s, f"{sum(r['pass'] for r in rs)}/{len(rs)}", f"{sum(r['deterministic'] for r in rs)}/{len(rs)}",
                     f"{max(worst_ratio(r) for r in rs):.3f}", ", ".join(paths)])
    for r in big:
        if "check" in r:  # extra_checks: errors against the fp64 reference
            worst = max(r[n]["err"] / max(r[n]["lowp_err"], 1e-30) for n in r if isinstance(r[n], dict))
            rows.append([r["check"], 2048, f"{int(r['pass'])}/1", "-", f"{worst:.3f}", r["last_path"]])
        else:  # big_runs: no NaN, peak memory
            rows.append([f"big {r['mask']} (peak {r['peak_GiB']:.1f} GiB)", r["S"], f"{int(r['pass'])}/1", "-", "-",
                         r["last_path"]])
    return markdown_table(["mask / check", "S", "passed", "deterministic", "worst err/lowp_err", "paths"], rows)


def extra_checks(be):
    """forward_accumulate (two stages == one) and float32 inputs, against the fp64 reference."""
    out = []
    s, d = 2048, 128
    tiles = catalog.tiles(catalog.build("docs_causal", s))
    keep = catalog.tiles_to_dense(tiles, s, s, device="cuda")
    for dt in (torch.bfloat16, torch.float32):
        g = torch.Generator(device="cuda").manual_seed(7)
        q = torch.randn(s, 8, d, device="cuda", dtype=dt, generator=g)
        k = torch.randn(s, 2, d, device="cuda", dtype=dt, generator=g)
        v = torch.randn(s, 2, d, device="cuda", dtype=dt, generator=g)
        dout = torch.randn_like(q)
        ref = chunked_reference(q, k, v, dout, keep, torch.float64, d ** -0.5)
        low = chunked_reference(q, k, v, dout, keep, dt, d ** -0.5)
        # accumulate: odd and even tiles as two stages into a float32 running (out, lse)
        o = torch.zeros(q.shape, device="cuda", dtype=torch.float32)
        lse = torch.full((s, 8), float("-inf"), device="cuda")
        for part in (tiles[0::2], tiles[1::2]):
            be.forward_accumulate(q, k, v, be.prepare(part, s, s, head_dims=(d,)), d ** -0.5, o, lse)
        prep = be.prepare(tiles, s, s, head_dims=(d,))
        o1, l1 = be.forward(q, k, v, prep, d ** -0.5)
        grads = be.backward(q, k, v, o1, l1, dout, prep, d ** -0.5)
        r = {"check": f"accumulate+{str(dt).split('.')[-1]}", "last_path": be.last_path}
        ok = True
        for name, x, i in (("acc_out", o, 0), ("acc_lse", lse, 1), ("out", o1, 0), ("lse", l1, 1),
                           ("dq", grads[0], 2), ("dk", grads[1], 3), ("dv", grads[2], 4)):
            e, el = rms(x.double() - ref[i]), rms(low[i] - ref[i])
            # fp32: the plain fp32 reference is near exact; allow 1e-5 relative instead of 2x
            bound = 2 * el + (1e-5 if dt == torch.float32 else 1e-6) * rms(ref[i])
            r[name] = {"err": e, "lowp_err": el}
            ok = ok and e <= bound and not bool(torch.isnan(x).any())
        r["pass"] = ok
        out.append(r)
    return out


def big_runs(be):
    """S = 131072, Hq 32, Hkv 8, D 128, bf16: no NaN, peak memory (no S^2 buffers)."""
    out = []
    s, hq, hkv, d = 131072, 32, 8, 128
    for mask in ["causal", "docs_causal", "sliding_window_1024", "strided_512x4"]:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        q = torch.randn(s, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(s, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(s, hkv, d, device="cuda", dtype=torch.bfloat16)
        dout = torch.randn_like(q)
        inputs = sum(x.numel() * x.element_size() for x in (q, k, v, dout))
        prep = be.prepare(catalog.tiles(catalog.build(mask, s)), s, s, head_dims=(d,))
        o, lse = be.forward(q, k, v, prep)
        dq, dk, dv = be.backward(q, k, v, o, lse, dout, prep)
        torch.cuda.synchronize()
        nan = any(bool(torch.isnan(x).any()) for x in (o, lse, dq, dk, dv))
        peak = torch.cuda.max_memory_allocated()
        r = {"mask": mask, "S": s, "last_path": be.last_path, "nan": nan, "peak_GiB": peak / 2**30,
             "inputs_GiB": inputs / 2**30,
             "S2_bf16_GiB_per_head": s * s * 2 / 2**30, "pass": (not nan) and peak < 4 * inputs}
        out.append(r)
        del q, k, v, dout, o, lse, dq, dk, dv
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs", default=None, help="tuned configs JSON (tools/bench_kernels.py --tune)")
    ap.add_argument("--backend", choices=["auto", "triton", "fa4"], default="auto",
                    help="the backend checked (auto: FA4 where it can run, else Triton)")
    ap.add_argument("--verbose", action="store_true", help="each case's line on stderr as it finishes")
    ap.add_argument("--parts", default="matrix,bands,rank_lists",
                    help="comma-separated subset of the checks to run (to split a run over time-limited calls)")
    args = ap.parse_args()
    overrides = {}
    if args.configs:
        with open(args.configs) as f:
            overrides = configs_from_json(json.load(f))
    be = make_backend(args.backend, overrides)
    be_det = make_backend(args.backend, overrides, deterministic=True)
    print(f"backend: {be.name} ({type(be).__name__})", flush=True)
    results, t0 = [], time.time()

    def combos_at(s):
        if s >= 16384:  # a diagonal of the matrix keeps the large size affordable
            return [(128, torch.bfloat16, 4, 2), (64, torch.float16, 8, 1), (128, torch.float16, 1, 2)]
        return [(d, dt, g, 2) for d, dt, g in itertools.product([64, 128], [torch.bfloat16, torch.float16], [1, 4, 8])]

    band_combos = [(128, torch.bfloat16, 4, 2), (128, torch.float16, 8, 1), (64, torch.bfloat16, 1, 2)]
    # the rank lists at the largest size, with the recipes' heads (GQA 4, D 128, bf16) and one fp16 family
    parts = set(args.parts.split(","))
    if parts - {"matrix", "bands", "rank_lists"}:
        raise SystemExit(f"--parts: unknown {sorted(parts - {'matrix', 'bands', 'rank_lists'})}")
    rank_lists = rank_list_cases(max(args.seqlens)) if "rank_lists" in parts else []
    rank_combos = [(128, torch.bfloat16, 4, 2), (64, torch.float16, 8, 1)]
    matrix = args.seqlens if "matrix" in parts else []
    bands = band_cases() if "bands" in parts else []
    be_band = make_backend(args.backend, overrides, band_squares=2048)  # these windows are 2048 and 4096
    # (name, rows, keys, tiles, backend, combos, first seed, the mask_mod the tiles must match or None)
    cases = [(mask, s, s, catalog.tiles(catalog.build(mask, s)), be, combos_at(s),
              s * 1000 + catalog.KERNEL_MASKS.index(mask) * 10, mask) for s in matrix for mask in catalog.KERNEL_MASKS]
    cases += [(name, s, s, tiles, be_band, band_combos, s, None) for name, s, tiles in bands]
    cases += [(name, sq, sk, tiles, be, rank_combos, sq + sk, None) for name, sq, sk, tiles in rank_lists]
    bar = Progress(sum(len(c[5]) for c in cases), "gpu_kernel_check", verbose=args.verbose)
    for name, sq, sk, tiles, backend, combos, seed, mask_mod in cases:
        keep = catalog.tiles_to_dense(tiles, sq, sk, device="cuda")
        same = mask_mod is None or bool((keep == catalog.dense(mask_mod, sq, device="cuda")).all())
        if not same:
            bar.note(f"FAIL tile list of {name} at S={sq} differs from its mask_mod")
        for i, (d, dt, g, hkv) in enumerate(combos):
            bar.running(f"{name} {sq}x{sk} D={d} {str(dt).split('.')[-1]} G={g}")
            r = check_case(backend, be_det, name, sq, d, dt, g, hkv, keep, tiles, seed=seed + i, sk=sk)
            if mask_mod is not None:
                r["tiles_match_mask_mod"] = same
                r["pass"] = r["pass"] and same
            results.append(r)
            line = (f"{'ok  ' if r['pass'] else 'FAIL'} {name:22s} {sq}x{sk} D={d:3d} {r['dtype']:8s} G={g} "
                    f"det={r['deterministic']} nan={r['nan']}")
            for p in r["paths"]:
                line += f" | {p}: worst err/lowp_err={max(r[p][n]['ratio'] for n in ERR_KEYS):.3f} dq={r[p]['dq']['err']:.1e}"
            if not r["pass"]:
                bar.note(line)
            bar.step(line if r["pass"] else None)
        del keep
        torch.cuda.empty_cache()
    bar.running("accumulate, float32" + (", S=131072 runs" if args.big else ""))
    big = extra_checks(be_det)
    if args.big:
        be_big = make_backend(args.backend, overrides, dense_fast_path=False)
        big += big_runs(be_big)
    bar.close()
    n_fail = sum(not r["pass"] for r in results) + sum(not r["pass"] for r in big)
    # what the cuDNN probe found per (device, dtype, head_dim, Hq / Hkv) family: its layout, or why not
    cudnn_found = {str(tuple(map(str, key))): f.layout or f.reason for b in (be, be_band)
                   for key, f in getattr(b, "cudnn_probes", {}).items()}
    summary = run_record(device_name(), **{
        "configs": {f"{d}/{c}": str(v) for (d, c), v in overrides.items()}, "cudnn": cudnn_found,
        "triton": __import__("triton").__version__, "cases": len(results) + len(big), "failed": n_fail,
        "seconds": time.time() - t0})
    roles = {"default": be, "deterministic": be_det, "band_squares_2048": be_band}
    if args.big:
        roles["big"] = be_big
    summary["backend"] = backend_info(**roles)
    n_nondet = sum(not r["deterministic"] for r in results)  # a failure for Triton, counted for the others
    if type(be_det) is not TritonBackend:
        summary["not_bitwise_reproducible"] = n_nondet
        try:
            summary["flash_attn_4"] = importlib.metadata.version("flash-attn-4")
        except importlib.metadata.PackageNotFoundError:
            summary["flash_attn_4"] = None
    print(json.dumps(summary, default=str))  # describe() may hold devices, dtypes
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "results": results, "big": big}, f, indent=1, default=str)
    tail = ("" if type(be_det) is TritonBackend else
            f" ({be.name}; deterministic mode bitwise reproducible in {len(results) - n_nondet}/{len(results)} cases)")
    print(f"gpu_kernel_check: {len(results) + len(big) - n_fail}/{len(results) + len(big)} passed{tail}")
    print("\n".join(summary_table(results, big)))
    sys.exit(1 if n_fail else 0)


if __name__ == "__main__":
    main()
