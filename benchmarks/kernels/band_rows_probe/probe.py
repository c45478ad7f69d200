"""Probe: does a band's Triton time per row depend on the list's rows, or on how it is timed?

The cost model's band backward (fitted by tools/calibrate.py on 16384-row bands) over-predicted a rank's
32768-row band of the 2 x 64k sliding window (W = 2048) by 11% against bench_dist's kernel-only time
(benchmarks/dist/run_0752_2gpu). This times BI_CAUSAL bands (row i keeps keys [i, i + W]) and
block-diagonal documents at 16384 and 32768 rows, forward and backward, two ways: as calibrate.py times
its lists (sustained warm-up, then 10 calls behind a held stream, per call) and as bench_dist times a
kernel-only phase (one call behind a held stream, median of 5), with the model's prediction from
``--cost``. bf16, Hq 32, Hkv 8, D 128, one GPU.

    python benchmarks/kernels/band_rows_probe/probe.py --cost cost.json --out DIR
"""

import argparse
import datetime
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from calibrate import _held, _time  # noqa: E402
from bench_dist import Timer  # noqa: E402

from megatron_cp import kernels  # noqa: E402
from megatron_cp.kernels.triton_backend import TritonBackend, TritonConfig  # noqa: E402
from megatron_cp.planner.cost import CostModel, Workload  # noqa: E402


def single_held(fn, n=5):
    """bench_dist's kernel-only timing (``Timer.held``): one call issued behind a held stream, median of
    ``n``. (The recorded run, 08:05, used an inline copy of the same steps: sync, hold, events around
    the call, sync; commit 6ab0ad3.)"""
    timer = Timer(torch.device("cuda"))
    return float(np.median([timer.held(fn, lambda _: None)[0] for _ in range(n)]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cost", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=0.5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cost = CostModel.load(args.cost)
    work = Workload(32, 8, 128, 2)
    launch = cost.launch_us * 1e-6
    calib_be = TritonBackend(TritonConfig(dense_fast_path=False))
    runtime_be = kernels.get_backend("auto", dev)
    cases = []
    for rows in (16384, 32768):
        for w in (2048, 3072, 4096):
            cases.append((f"band {w}", rows, [[0, rows, 0, rows + w, 3]], rows + w))
        cases.append(("docs 2048 full", rows, [[i, i + 2048, i, i + 2048, 0] for i in range(0, rows, 2048)], rows))
    results = []
    for name, rows, tiles, sk in cases:
        for be_name, be in (("calibrate", calib_be), ("runtime", runtime_be)):
            if be_name == "runtime" and not name.startswith("band 2048"):
                continue
            g = torch.Generator(device="cpu").manual_seed(0)
            q, k, v = ((torch.randn(n, h, 128, generator=g) * 0.5).to(dev, torch.bfloat16)
                       for n, h in ((rows, 32), (sk, 8), (sk, 8)))
            prep = be.prepare(torch.tensor(tiles, dtype=torch.int32), rows, sk)
            out, lse = be.forward(q, k, v, prep, None)
            do = torch.randn_like(out)
            for phase, fn in (("fwd", lambda: be.forward(q, k, v, prep, None)),
                              ("bwd", lambda: be.backward(q, k, v, out, lse, do, prep, None, None))):
                _time(fn, dev, 1, args.seconds)
                t_burst = _held(fn, dev, 10) - launch
                _time(fn, dev, 1, args.seconds)
                t_single = single_held(fn) - launch
                pred = cost.tile_time(np.array(tiles, dtype=np.int64), work, phase == "bwd") - launch
                r = dict(list=name, rows=rows, keys=sk, backend=be_name, phase=phase, burst_ms=t_burst * 1e3,
                         single_ms=t_single * 1e3, model_ms=pred * 1e3, row_class=getattr(prep, "row_class", None))
                results.append(r)
                print(f"{name:<16}{rows:>6} {be_name:<10}{phase}  burst {r['burst_ms']:8.3f}  single {r['single_ms']:8.3f}"
                      f"  model {r['model_ms']:8.3f}  model/burst {pred / t_burst:5.2f}  model/single {pred / t_single:5.2f}"
                      f"  ({r['row_class']})", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), date=f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
                       command=" ".join(sys.argv), cost=cost.source, torch=torch.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()
