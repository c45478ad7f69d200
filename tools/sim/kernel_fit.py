"""Research instrument's FA4 kernel model (tools/sim/step_model.py uses it): a rank's attention time by the route
FA4 takes for its tile list, fitted to one H100's kernel benchmark (benchmarks/2026-11-24_1xH100_fa4)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from megatron_cp.masks.geometry import traps_to_tiles
from megatron_cp.planner import Workload


_CALLS: dict = {}


@dataclass(frozen=True)
class Kernels:
    """FA4 attention time of a rank's tile list, by the route the FA4 backend takes for it (``kernels.fa4.calls``:
    the kernels own the split): ``varlen`` calls cost ``(cells + half * rows) * 4 * Hq * D / peak`` per segment
    (backward 2.5x the FLOPs), plus an LSE merge of the rows per extra forward call; ``blocks`` (one block-sparse
    call) costs its visited 128 x 128 blocks, full and partial at their own rates; ``triton`` (the fallback) the
    varlen formula at Triton's rates. ``fit[route][direction] = (peak TFLOP/s, half keys)``, blocks: (full, partial)
    TFLOP/s over a block's cells."""

    fit: dict
    hbm_gbps: float = 3000.0

    def time(self, tiles, sq: int, sk: int, work: Workload, backward: bool = False, route: str | None = None) -> float:
        """Seconds of one call on ``tiles`` (int [n, 5]) over ``sq`` rows and ``sk`` keys (``route``: instead of
        the backend's own choice)."""
        from megatron_cp.kernels.fa4.calls import BLOCK, fa4_calls

        if len(tiles) == 0:
            return 0.0
        d = "bwd" if backward else "fwd"
        t = np.ascontiguousarray(np.asarray(tiles, dtype=np.int64).reshape(-1, 5))
        key = (t.tobytes(), int(sq), int(sk))
        if key not in _CALLS:  # the same lists are priced many times (fits, candidates, steps)
            _CALLS[key] = fa4_calls(t, sq, sk)
        calls = _CALLS[key]
        route = route or calls.route(d)
        per_cell = 4.0 * work.num_heads * work.head_dim * (2.5 if backward else 1.0)
        if route == "blocks":
            full, part = self.fit["blocks"][d]
            b = calls.blocks
            return per_cell * BLOCK * BLOCK * (b.full_blocks / full + b.partial_blocks / part) * 1e-12
        peak, half = self.fit["triton" if route == "triton" else "varlen"][d]
        segs = [s for c in (calls.bwd if backward else calls.fwd) for s in c.segments]
        cells = sum(s.area() + half * (s.q1 - s.q0) for s in segs)
        merge = 0.0 if backward else max(0, len(calls.fwd) - 1) * 10.0 * sq * work.num_heads * work.head_dim
        return cells * per_cell / (peak * 1e12) + merge / (self.hbm_gbps * 1e9)


def fit_kernels(path: str) -> tuple[Kernels, dict]:
    """``Kernels`` fitted (least squares of log time) to one H100's kernel benchmark: megatron-cp's FA4 path on
    full, causal, documents and window masks at 4k-64k (varlen), on block-causal, strided and global + local at 16k
    (block-sparse), and its Triton path on full and causal (triton); returns it and each case's fit ratio."""
    from megatron_cp.kernels.fa4.calls import fa4_calls
    from megatron_cp.masks import catalog

    with open(path) as f:
        data = json.load(f)
    meta = data["meta"]
    work = Workload(meta["Hq"], meta["Hkv"], meta["D"], 2)
    cases, seen = {"varlen": [], "blocks": [], "triton": []}, set()
    for r in data["results"]:
        if (r["S"], r["mask"]) in seen or r["mask"] == "streaming_1024":  # its backward: Triton on a band list
            continue
        seen.add((r["S"], r["mask"]))
        tiles = traps_to_tiles(catalog.build(r["mask"], r["S"]).traps, None, [[0, r["S"]]])
        route = fa4_calls(tiles, r["S"], r["S"]).route("fwd")
        cases[route].append((f"{r['mask']} {r['S']}", tiles, r["S"], r["ours"]))
        if r.get("ours_triton"):
            cases["triton"].append((f"{r['mask']} {r['S']}", tiles, r["S"], r["ours_triton"]))
    fit, ratios = {"varlen": {}, "triton": {}, "blocks": {}}, {}
    for route, rows in cases.items():
        for d in ("fwd", "bwd"):
            meas = np.array([c[3][d + "_ms"] * 1e-3 for c in rows])
            best = None
            for h in (np.arange(0.0, 2000.0, 10.0) if route != "blocks" else np.linspace(0.2, 5.0, 97)):
                # varlen / triton: half keys h, the peak in closed form; blocks: partial blocks cost h full ones
                k = Kernels({route: {d: (1000.0, 1000.0 / h) if route == "blocks" else (1000.0, h)}})
                pred = np.array([k.time(t, S, S, work, d == "bwd", route) for _, t, S, _ in rows])
                s = float(np.exp(np.mean(np.log(pred / meas))))
                err = float(np.sqrt(np.mean(np.log(pred / s / meas) ** 2)))
                if best is None or err < best[0]:
                    best = (err, h, 1000.0 * s, pred / s / meas)
            _, h, peak, r = best
            fit[route][d] = (peak, float(peak / h)) if route == "blocks" else (peak, float(h))
            ratios[f"{route} {d}"] = {c[0]: round(float(x), 3) for c, x in zip(rows, r)}
    return Kernels(fit), ratios
