"""GPU correctness of the generalised dense fast path (TritonConfig.dense_tiles; kernels/dense_tiles.py).

1. tools/gpu_kernel_check.py's matrix restricted to full / causal / docs_causal at the given S (default
   backend and deterministic Triton; its rule: rms error <= 2 x plain low-precision rms error + 1e-6 rms).
2. Direct cases run by the default backend on the generalised path (cuDNN pieces + Triton rest), same rule:
   docs_causal, a zigzag rank list (two bottom-right causal rectangles [a, b) x [0, b)), a rectangular
   full + causal mix with small pieces left to Triton, forward_accumulate in two stages, and backward with
   a given delta (== rowsum: cuDNN) and with an LSE gradient (delta != rowsum: must fall back to Triton).

Usage: python benchmarks/kernels/dense_tiles_check.py [--seqlens 4096 16384] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)
import _kernel_masks as M  # noqa: E402
import gpu_kernel_check as G  # noqa: E402
from kernels.tiles import CAUSAL, FULL  # noqa: E402
from kernels.triton_backend import TritonBackend, TritonConfig  # noqa: E402


def compare(name, runs, ref, low, keep):
    empty = ~keep.any(1)
    fin = ~empty
    res, ok = {"case": name}, True
    for path, vals in runs.items():
        nan = any(bool(torch.isnan(x).any()) for x in vals)
        out, lse = vals[0], vals[1]
        empty_ok = bool((lse[empty] == float("-inf")).all()) and bool((out[empty] == 0).all())
        r = {"nan": nan, "empty_ok": empty_ok}
        ok = ok and not nan and empty_ok
        for i, n in enumerate(["out", "lse", "dq", "dk", "dv"]):
            a, lo, o = ref[i], low[i], vals[i]
            if n == "lse":
                a, lo, o = a[fin], lo[fin], o[fin]
            e, el = G.rms(o.double() - a), G.rms(lo - a)
            r[n] = {"err": e, "lowp_err": el, "ratio": e / max(el, 1e-30)}
            ok = ok and e <= 2 * el + 1e-6 * G.rms(a)
        res[path] = r
    res["pass"] = ok
    return res


def direct_case(be, name, tiles, sq, sk, hq=8, hkv=2, d=128, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sq, hq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(sk, hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(sk, hkv, d, device="cuda", dtype=dtype, generator=gen)
    dout = torch.randn(sq, hq, d, device="cuda", dtype=dtype, generator=gen)
    scale = 1.0 / math.sqrt(d)
    keep = M.dense_mask_from_tiles(tiles, sq, sk, device="cuda")
    prep = be.prepare(tiles, sq, sk, head_dims=(d,))
    info = {"dense_plan": prep.dense_plan, "rest_tiles": None if prep.rest is None else prep.rest.tiles.tolist()}
    out, lse = be.forward(q, k, v, prep, scale)
    fpath = be.last_path
    grads = be.backward(q, k, v, out, lse, dout, prep, scale)
    bpath = be.last_path
    runs = {f"general_{fpath}_{bpath}": (out, lse, *grads)}
    # given delta == rowsum(dout*out): still the cuDNN pieces
    delta = (dout.float() * out.float()).sum(-1)
    g2 = be.backward(q, k, v, out, lse, dout, prep, scale, delta)
    runs[f"delta_{be.last_path}"] = (out, lse, *g2)
    # forward_accumulate: first half of the tiles, then the second half, into a running (out, lse)
    o_acc = torch.zeros_like(q)
    l_acc = torch.full((sq, hq), float("-inf"), device="cuda")
    n = tiles.shape[0]
    parts = [tiles[: max(n // 2, 1)], tiles[max(n // 2, 1):]] if n > 1 else [tiles]
    paths = []
    for part in parts:
        if part.shape[0]:
            be.forward_accumulate(q, k, v, be.prepare(part, sq, sk, head_dims=(d,)), scale, o_acc, l_acc)
            paths.append(be.last_path)
    runs[f"accumulate_{'+'.join(paths)}"] = (o_acc, l_acc, *grads)
    ref = G.chunked_reference(q, k, v, dout, keep, torch.float64, scale)
    low = G.chunked_reference(q, k, v, dout, keep, dtype, scale)
    res = compare(name, runs, ref, low, keep)
    # LSE gradient: delta != rowsum(dout*out) -> must not use cuDNN; equals the Triton-only backward
    dlse = torch.randn(sq, hq, device="cuda", generator=gen)
    be_t = TritonBackend(TritonConfig(dense_fast_path=False))
    prep_t = be_t.prepare(tiles, sq, sk, head_dims=(d,))
    g3 = be.backward(q, k, v, out, lse, dout, prep, scale, delta - dlse)
    p3 = be.last_path
    g4 = be_t.backward(q, k, v, out, lse, dout, prep_t, scale, delta - dlse)
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(g3, g4))
    res["dlse_path"], res["dlse_equals_triton"] = p3, same
    res["general_used"] = fpath.startswith("cudnn") and bpath.startswith("cudnn")
    res["pass"] = res["pass"] and same and p3 == "triton" and res["general_used"]
    res.update(info, sq=sq, sk=sk, hq=hq, hkv=hkv, d=d, dtype=str(dtype).split(".")[-1])
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-matrix", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    # pieces from 512 x 512 up (the default dense_min_keys is larger): the packed documents take the path too
    be = TritonBackend(TritonConfig(dense_min_rows=512, dense_min_keys=512))
    be_det = TritonBackend(TritonConfig(deterministic=True))
    results = []
    masks = ["full", "causal", "docs_causal"]
    if not args.skip_matrix:  # gpu_kernel_check's matrix, these masks only
        for s in args.seqlens:
            if s >= 16384:
                combos = [(128, torch.bfloat16, 4, 2), (64, torch.float16, 8, 1), (128, torch.float16, 1, 2)]
            else:
                combos = [(d, dt, g, 2) for d in (64, 128) for dt in (torch.bfloat16, torch.float16) for g in (1, 4, 8)]
            for mask in masks:
                tiles = M.tiles_for(mask, s)
                keep = M.dense_mask_from_tiles(tiles, s, s, device="cuda")
                for i, (d, dt, g, hkv) in enumerate(combos):
                    r = G.check_case(be, be_det, mask, s, d, dt, g, hkv, keep, tiles, seed=s * 1000 + i)
                    r["case"] = "matrix"
                    results.append(r)
                    worst = {p: max(r[p][n]["ratio"] for n in ["out", "lse", "dq", "dk", "dv"]) for p in r["paths"]}
                    print(f"{'ok  ' if r['pass'] else 'FAIL'} matrix {mask:12s} S={s} D={d} {r['dtype']} G={g} "
                          f"det={r['deterministic']} worst={worst}", flush=True)
                del keep
    # direct cases on the generalised path
    cases = []
    for s in args.seqlens:
        cases.append((f"docs_causal_S{s}", M.tiles_for("docs_causal", s), s, s, {}))
    # zigzag rank (cp 2, S 8192 -> 4 chunks of 2048): rank 0 holds chunks 0 and 3 as its 4096 rows
    cases.append(("zigzag_cp2_rank0", torch.tensor([[0, 2048, 0, 2048, CAUSAL], [2048, 4096, 0, 8192, CAUSAL]],
                                                   dtype=torch.int32), 4096, 8192, {}))
    cases.append(("zigzag_cp2_rank1", torch.tensor([[0, 2048, 0, 4096, CAUSAL], [2048, 4096, 0, 6144, CAUSAL]],
                                                   dtype=torch.int32), 4096, 8192, {"dtype": torch.float16, "d": 64,
                                                                                     "hq": 8, "hkv": 8}))
    # rectangular full + causal mix with pieces too small for cuDNN (Triton) and an sk < sq causal tile
    mix = torch.tensor([[0, 1024, 0, 3000, FULL],
                        [0, 1024, 3000, 3500, CAUSAL],     # sk < sq: square 500 < 512 -> Triton
                        [1024, 4096, 0, 5000, CAUSAL],     # full 3072 x 1928 + square causal 3072
                        [1024, 1300, 5000, 5300, FULL],    # 276 rows -> Triton
                        [3000, 4096, 5000, 5600, CAUSAL]],  # sk < sq: 600-row square causal on cuDNN
                       dtype=torch.int32)
    cases.append(("full_causal_mix", mix, 4096, 5600, {}))
    cases.append(("full_causal_mix_g1_fp16", mix, 4096, 5600, {"dtype": torch.float16, "hq": 4, "hkv": 4}))
    for i, (name, tiles, sq, sk, kw) in enumerate(cases):
        r = direct_case(be, name, tiles, sq, sk, seed=100 + i, **kw)
        results.append(r)
        worst = {p: round(max(r[p][n]["ratio"] for n in ["out", "lse", "dq", "dk", "dv"]), 3)
                 for p in r if isinstance(r[p], dict) and "out" in r[p]}
        print(f"{'ok  ' if r['pass'] else 'FAIL'} direct {name} sq={sq} sk={sk} pieces={len(r['dense_plan'])} "
              f"rest={0 if r['rest_tiles'] is None else len(r['rest_tiles'])} dlse_path={r['dlse_path']} "
              f"dlse==triton {r['dlse_equals_triton']} worst err/lowp_err={worst}", flush=True)
        torch.cuda.empty_cache()
    n_fail = sum(not r["pass"] for r in results)
    summary = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "command": "python " + " ".join(sys.argv), "torch": torch.__version__,
               "triton": __import__("triton").__version__, "cases": len(results), "failed": n_fail,
               "fast_path_error": be.fast_path_error, "seconds": time.time() - t0}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "results": results}, f, indent=1, default=str)
    print(f"dense_tiles_check: {len(results) - n_fail}/{len(results)} passed")
    sys.exit(1 if n_fail else 0)


if __name__ == "__main__":
    main()
