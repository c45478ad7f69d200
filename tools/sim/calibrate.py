"""Research instrument (the cost model's calibration; not needed to use megatron-cp).

Measures the cost model's numbers on this machine and writes them as JSON (``CostModel.load`` reads it;
pass it to ``mcp.attention(cost_model=...)``, tools/bench_dist.py ``--cost`` or tools/sim/simulate.py).

Kernel (Triton, dense path off), each row class on two lists the backend really runs in that class
(checked): "long" bands of 4096 and 16384 keys per row, "short" bands of 256 and 1024, "blocky"
block-diagonal lists of 512 and 2048 (each class's peak and half-efficiency keys; short and blocky
per visited block cell); one tiny tile (launch cost).
Dense path (CUDA): cuDNN's forward/backward on full pieces of three shapes (peak, per-row and
per-key-column terms), on a square causal piece, and the fixed cost of one dense piece beside Triton
tiles. Every kernel time is GPU time, as tools/bench_dist.py times a step (tools/common.py): after a
sustained warm-up of ``--seconds`` (a cold GPU's bursts run at boost clocks that a training step does
not keep), calls issued while a spin kernel holds the stream, less the model's per-call ``launch_us``;
inputs of the benchmarks' scale. (Until 2026-11-22 the lists were timed in synced calls less a synced tiny call:
the bands' backward came out 10-16% above the same calls held.)
Communication (when started under torchrun with several ranks): all_to_all_single time for small
messages (latency) and large ones (bandwidth), inside a node and, with several nodes, across them (each
the median of five groups of ten calls);
and the time a megatron-cp call exposes beyond its GPU work when timed alone (call_fwd_us / call_bwd_us).

    python tools/sim/calibrate.py --out out/cost.json                      # one GPU, kernels only
    torchrun --nproc-per-node 4 tools/sim/calibrate.py --out out/cost.json   # plus NCCL links
    python tools/sim/calibrate.py --device cpu --tiny --out /tmp/cost.json  # dry run on CPU

While it runs, rank 0 shows a progress bar on stderr naming the measurement under way (redrawn at most
every 30 s where stderr is not a terminal: tools/common.py); each list's times go to stderr with
--verbose. Ends with one table on stdout: every field measured here beside CostModel's default (the
JSON holds the whole model).

It reads the library through public names and these documented internals: ``megatron_cp.runtime.cost``
(``CostModel`` and its tile counters ``tile_areas`` / ``block_counts``), the Triton backend's configs
(``kernels.TritonConfig.for_head_dim``) and its prepared lists' ``row_class``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from dataclasses import fields as dc_fields

import numpy as np
import torch
import torch.distributed as dist

from megatron_cp import kernels
from megatron_cp.planner import Workload
from megatron_cp.runtime import CostModel
from megatron_cp.runtime.cost import block_counts, tile_areas

# tools/ (this file's parent folder): the benchmark's step timer, so that the kernels are timed as
# tools/bench_dist.py times a step (its Timer.HOLD_CYCLES and Timer.run)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import Progress, markdown_table  # noqa: E402
from common import Timer  # noqa: E402


def _passes(args, device) -> tuple[float, float]:
    """Bytes per second of the memory passes around the kernels: (``hbm_gbps``, ``split_gbps``).
    ``hbm_gbps``: the kinds the runtime and the baselines make, timed together on the GPU (held stream):
    an fp32 add of gradient sums (the ring's, the exchange's reductions) and a head-splitting copy of
    bf16 rows (Ulysses' send layout, the exchanges' row placements); bytes read plus written over their
    time. ``split_gbps``: the head-splitting copy alone, the only kind of pass Ulysses' layouts make
    (profiled on 2 x H200 at ~1.55 TB/s against 2.49 for the blend).
    (3000 GB/s was assumed before; in the profile of 4 x H200, 2026-11-22 00:13, such passes ran at
    1.6 TB/s, a head-splitting copy, to 4.3 TB/s, an fp32 to bf16 convert.)"""
    n, h, d, u = (256, 8, 16, 2) if args.tiny else (32768, 32, 128, 4)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, h // 2, d, device=device) for _ in range(2))
    x = torch.randn(n, h, d, device=device).to(dt)
    y = torch.empty((u, n, h // u, d), device=device, dtype=dt)

    def split():
        y.copy_(x.view(n, u, h // u, d).transpose(0, 1))

    def both():
        torch.add(a, b, out=a)
        split()

    both()
    moved_split = 2 * x.numel() * x.element_size()
    moved = 3 * a.numel() * a.element_size() + moved_split
    timer = Timer(device)
    return moved / timer.held_calls(both, 20), moved_split / timer.held_calls(split, 20)


def _kernel(args, device, work: Workload, bar=None):
    """Triton numbers (dense path off), then, on CUDA, the dense (cuDNN) path's; ``bar``: a Progress to
    which it adds and steps its measurements."""
    bar = bar or Progress(None, "", enabled=False)
    be = kernels.get_backend(args.backend, device)
    dense_be = None
    if device.type == "cuda" and isinstance(be, kernels.TritonBackend):
        dense_be, be = be, kernels.TritonBackend(kernels.TritonConfig(dense_fast_path=False))
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    hq, hkv, d = work.num_heads, work.num_kv_heads, work.head_dim
    rows = 256 if args.tiny else 16384
    keys_long = 512 if args.tiny else 16384
    reps = 2 if args.tiny else 10
    secs = 0.0 if args.tiny else args.seconds

    timer = Timer(device)

    def run(tiles, sq, sk, backward=False, backend=be, row_class=None, warm=True):
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = ((torch.randn(n, h, d, generator=g) * 0.5).to(device, dt) for n, h in ((sq, hq), (sk, hkv), (sk, hkv)))
        prep = backend.prepare(torch.tensor(tiles, dtype=torch.int32), sq, sk)
        if row_class is not None and getattr(prep, "row_class", row_class) != row_class:
            raise RuntimeError(f"calibration list meant for the {row_class!r} class runs as {prep.row_class!r}")
        out, lse = backend.forward(q, k, v, prep, None)
        if not backward:
            fn = lambda: backend.forward(q, k, v, prep, None)  # noqa: E731
        else:
            do = torch.randn_like(out)
            fn = lambda: backend.backward(q, k, v, out, lse, do, prep, None, None)  # noqa: E731
        # GPU time, as bench_dist times a step: calls issued while a spin kernel holds the stream (after a
        # sustained warm-up when ``warm``); few enough calls that the host issues them all within the hold
        # (200 tiny calls took longer and timed the host: 59 us a call on 4 x H200, 2026-11-22 00:28)
        if warm:
            timer.sustained(fn, 1, secs)
        return timer.held_calls(fn, reps if warm else 2 * reps)

    per_flop = work.fwd_flops(1.0)
    out = {}
    who = f" (rank {dist.get_rank()})" if dist.is_initialized() else ""  # every rank measures; rank 0's are kept
    # launch_us: what one more kernel call adds to a step's GPU time (a tiny call, queued behind a held
    # stream: its small kernels and their gaps), neither a synced call's round trip (126 us on 4 x H200,
    # charged per call it over-predicted plans with guest rows and stages) nor the host's launch time of
    # a queued loop (76 us, 2026-11-21 23:20), which a training step's host, running ahead, hides
    # no per-tile term: the kernels walk blocks, not tiles (their cost is in the per-block and per-row
    # terms); a probe of 64 tiny tiles measured noise of 0 to 0.5 us per tile, which on the strided
    # mask's 4160 tiles per rank added 2 ms that the kernel does not spend (2 x H200, 20:30)
    bar.running("launch")
    out.update(launch_us=run([[0, 16, 0, 16, 0]], 16, 16, warm=False) * 1e6, tile_us=0.0)
    # every list below: GPU time behind a held stream less launch_us (the model adds launch_us per call).
    # Until 2026-11-22 the Triton lists (and the causal cuDNN square) were timed synced, less a synced
    # tiny forward, which left the calls' host lead and a synced loop's clocks in: the bands' backward
    # was over-predicted by 10-16% against the same calls held (kernel target). Both ways in one lease
    # (2 x H200): the 2 x 64k sliding-window backward 1.16 -> 1.11 kernel
    # alone, 1.19 -> 1.13 GPU time
    t_call = out["launch_us"] * 1e-6

    def timed(tl, sq, sk, backward=False, **kw):
        return run(tl, sq, sk, backward, **kw) - t_call

    def band(w):  # every row keeps w + 1 keys (k - q in [0, w]): one BI_CAUSAL tile
        return [[0, rows, 0, rows + w, 3]]

    # Triton classes, each from lists the backend runs in it: t = (cells + half * rows) / peak, cells kept
    # ("long": bands of 4096, 8192 and 16384 keys) or of every visited block ("short": bands of 256, 512
    # and 1024 keys, mostly partial blocks, and causal documents of 1024; "blocky": block-diagonal lists
    # of 512, 1024 and 2048, all blocks full, and causal documents of 2048), fitted in relative error over
    # the class's lists (packed documents ran 11% slower than bands and full blocks alone predicted:
    # tools/sim/cost_check.py on 2 x 64k)
    hd = work.head_dim
    def docs(b, kind):  # block-diagonal: documents of b tokens, each full (kind 0) or causal (kind 1)
        return [[i, i + b, i, i + b, kind] for i in range(0, rows, b)]

    lists = {
        "long": [band(w) for w in ((128, 256, 512) if args.tiny else (4096, 8192, 16384))],
        "short": [band(w) for w in ((16, 48, 96) if args.tiny else (256, 512, 1024))] + [docs(64 if args.tiny else 1024, 1)],
        "blocky": [docs(b, 0) for b in ((128, 256) if args.tiny else (512, 1024, 2048))] + [docs(128 if args.tiny else 2048, 1)],
    }
    # the steps: launch, each list, the blocky bands, the passes; on CUDA the long rows and the dense path
    bar.add(1 + sum(map(len, lists.values())) + 2 + 1 + (device.type == "cuda") + (11 if dense_be is not None else 0))
    bar.step()
    for cls, pair in lists.items():
        if hasattr(be, "config"):  # the Triton backend's blocks for this class
            stc = be.config.for_head_dim(hd, cls)
            fwd_blk, bwd_blk = (stc.fwd.block_m, stc.fwd.block_n), (stc.dq.block_m, stc.dq.block_n)
        else:  # another backend (CPU dry run): the model's default blocks
            cm = CostModel()
            fwd_blk = (getattr(cm, f"{cls}_block_m", 128), getattr(cm, f"{cls}_block_n", 128))
            bwd_blk = (cm.bwd_block_m, cm.bwd_block_n)
        rf, rb = [], []
        for tl in pair:
            tn = np.array(tl, dtype=np.int64)
            sk = int(tn[:, 3].max())
            bar.running(f"{cls} list of {len(tl)} tiles, {rows} x {sk}")
            tf = timed(tl, rows, sk, row_class=cls)
            tb = timed(tl, rows, sk, True, row_class=cls)
            bar.step(f"calibrate{who}: {cls} list of {len(tl)} tiles, {rows} x {sk}: fwd {tf * 1e3:.3f} ms, bwd {tb * 1e3:.3f} ms")
            if cls == "long":
                cf = cb = float(tile_areas(tn)[0].sum())
            else:
                cf = float(block_counts(tn, *fwd_blk)[0].sum()) * fwd_blk[0] * fwd_blk[1]
                cb = float(block_counts(tn, *bwd_blk)[0].sum()) * bwd_blk[0] * bwd_blk[1]
            rf.append(([cf, rows], tf / per_flop))
            rb.append(([cb, rows], tb / (2.5 * per_flop)))
        pre = "" if cls == "long" else f"{cls}_"
        (peak_f, half_f), (peak_b, half_b) = linear_fit(rf, cls), linear_fit(rb, cls)
        out[f"{pre}fwd_tflops"], out[f"{pre}bwd_tflops"] = peak_f / 1e12, peak_b / 1e12
        if cls == "long":  # one half-efficiency for both phases
            out["half_keys"] = half_f[0]
            out["bwd_tflops"] = linear_fit(rb, cls, fixed=half_f)[0] / 1e12
        else:
            out[f"{cls}_half_keys"], out[f"{cls}_bwd_half_keys"] = half_f[0], half_b[0]
            out[f"{cls}_block_m"], out[f"{cls}_block_n"] = fwd_blk
            out["bwd_block_m"], out["bwd_block_n"] = bwd_blk
        if cls == "blocky":
            # bands in the blocky class (windows of 2048 and 3072 keys): their own peaks at the blocky
            # half terms (a 2048-key band's backward ran 1.15-1.19x faster than this fit on documents said).
            bf, bb = [], []
            for w in ((40, 72) if args.tiny else (2048, 3072)):
                tl = band(w)
                tn = np.array(tl, dtype=np.int64)
                bar.running(f"blocky band {w}")
                tf = timed(tl, rows, rows + w, row_class=cls)
                tb = timed(tl, rows, rows + w, True, row_class=cls)
                bar.step(f"calibrate{who}: blocky band {w}, {rows} x {rows + w}: fwd {tf * 1e3:.3f} ms, bwd {tb * 1e3:.3f} ms")
                cf = float(block_counts(tn, *fwd_blk)[0].sum()) * fwd_blk[0] * fwd_blk[1]
                cb = float(block_counts(tn, *bwd_blk)[0].sum()) * bwd_blk[0] * bwd_blk[1]
                bf.append(([cf, rows], tf / per_flop))
                bb.append(([cb, rows], tb / (2.5 * per_flop)))
            out["blocky_band_fwd_tflops"] = linear_fit(bf, "blocky band", fixed=[out["blocky_half_keys"]])[0] / 1e12
            out["blocky_band_bwd_tflops"] = linear_fit(
                bb, "blocky band", fixed=[out["blocky_bwd_half_keys"] or out["blocky_half_keys"]])[0] / 1e12
    bar.running("memory passes")
    hbm, split = _passes(args, device)
    out["hbm_gbps"], out["split_gbps"] = hbm / 1e9, split / 1e9
    bar.step()
    if device.type == "cuda":
        out["num_sms"] = torch.cuda.get_device_properties(device).multi_processor_count
        bar.running("long rows")
        out.update(fit_long_rows(timed, out, work, rows, args.tiny))
        bar.step()
    if dense_be is not None:
        # full pieces: cells + half_keys * rows + half_rows * keys at the peak, fitted on nine shapes that
        # span the pieces plans make (512 .. 8192 rows: guest rows, stage and ring pieces; 8192 .. 65536
        # keys), so that no piece is an extrapolation (three exact shapes put 1.9 ms on a 512 x 32768
        # guest piece's backward that the kernel does not spend)
        # the pieces' wave efficiency on this GPU, as the model applies it
        waves = CostModel(num_sms=torch.cuda.get_device_properties(device).multi_processor_count)
        # (held, like every list: a synced call of a small piece is mostly the host's issue and round trip,
        # and a synced tiny call subtracted from it varied by more than the piece's 0.1 ms of GPU work: 4 x
        # H200, 06:23: 512 x 8192 at "34098 TFLOP/s", a fit of 30593 and dense_piece_us 124)
        pf, pb, grid_f, grid_b = [], [], [], []
        g_rows, g_keys = (rows // 32, rows // 8, rows // 2), (keys_long // 2, 2 * keys_long, 4 * keys_long)
        for r, kk in ((r, kk) for r in g_rows for kk in g_keys):
            full = [[0, r, 0, kk, 0]]
            bar.running(f"dense piece {r} x {kk}")
            ef, eb = float(waves.wave_efficiency(r, hq)), float(waves.wave_efficiency(kk, hq))
            tf = timed(full, r, kk, backend=dense_be)
            tb = timed(full, r, kk, True, backend=dense_be)
            pf.append(([r * kk, r, kk], tf * ef / per_flop))
            pb.append(([r * kk, r, kk], tb * eb / (2.5 * per_flop)))
            grid_f.append(r * kk * per_flop / tf / 1e12)
            grid_b.append(2.5 * r * kk * per_flop / tb / 1e12)
            bar.step(f"calibrate{who}: dense piece {r} x {kk}: fwd {tf * 1e3:.3f} ms, bwd {tb * 1e3:.3f} ms")
        # the measured rates themselves: the model reads full pieces off this grid
        out.update(dense_grid_rows=list(g_rows), dense_grid_keys=list(g_keys), dense_grid_fwd_tflops=grid_f,
                   dense_grid_bwd_tflops=grid_b, dense_grid_heads=hq)
        (peak_f, (hk_f, hr_f)), (peak_b, (hk_b, hr_b)) = linear_fit(pf, "dense"), linear_fit(pb, "dense")
        out.update(dense_fwd_tflops=peak_f / 1e12, dense_half_keys=hk_f, dense_half_rows=hr_f,
                   dense_bwd_tflops=peak_b / 1e12, dense_bwd_half_keys=hk_b, dense_bwd_half_rows=hr_b)
        n = 2 * rows  # a square causal piece: its own peak, with the full pieces' row and key terms
        causal = [[0, n, 0, n, 1]]
        c_area = n * (n + 1) / 2
        en = float(waves.wave_efficiency(n, hq))
        bar.running("dense causal piece")
        out["dense_causal_fwd_tflops"] = (c_area + (hk_f + hr_f) * n) * per_flop / timed(causal, n, n, backend=dense_be) / en / 1e12
        out["dense_causal_bwd_tflops"] = (c_area + (hk_b + hr_b) * n) * 2.5 * per_flop / timed(
            causal, n, n, True, backend=dense_be) / en / 1e12
        # fixed cost of one piece beside Triton tiles: a minimum-size dense piece next to one tiny tile,
        # less the piece's time in the model and the tiny tile's own call
        bar.step()
        c = dense_be.config
        mr, mk = int(c.dense_min_rows), int(c.dense_min_keys)
        bar.running("dense piece beside a tile")
        t_piece = run([[0, mr, 0, mk, 0], [mr, mr + 16, 0, 16, 0]], mr + 16, mk, backend=dense_be, warm=False)
        model_t = (mr * mk + hk_f * mr + hr_f * mk) * per_flop / peak_f / float(waves.wave_efficiency(mr, hq))
        out["dense_piece_us"] = max(0.0, (t_piece - t_call - model_t) * 1e6)
        bar.step(f"calibrate{who}: a {mr} x {mk} cuDNN piece beside a tiny tile: {t_piece * 1e6:.1f} us a call, "
                 f"{model_t * 1e6:.1f} of it the piece's kernel model: dense_piece_us {out['dense_piece_us']:.1f}")
        out["dense_min_rows"], out["dense_min_keys"] = mr, mk
        # the backend's band rule (not measured: what the kernel backend does with bands)
        out["band_squares"] = int(c.band_squares)
    return out


def summary_table(fields, default):
    """The closing table (lines): each field measured (``fields``) beside ``default``'s value."""
    def cell(v):
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(cell(x) for x in v) + "]"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    return markdown_table(["field", "measured", "default"],
                          [[k, cell(v), cell(getattr(default, k, "-"))] for k, v in fields.items() if k != "source"])


def fit_long_rows(timed, fitted, work: Workload, rows: int, tiny: bool) -> dict:
    """``row_alone_tflops`` and ``row_share`` (CostModel.long_rows): one q block of 128 rows keeping
    every one of a long key range (global rows), beside (a) a light background of short rows, where the
    long programs run nearly alone, and (b) a background of 2048-key rows whose work is comparable to
    theirs, where they share their multiprocessors; both lists run in the "blocky" class, as such masks
    do. The two parameters are fitted together: each list's measured forward time through the model."""
    keys = 2048 if tiny else 131072
    bg = 64 if tiny else 2048
    step = 128 if tiny else 512
    long_row = [[0, 128, 0, keys, 0]]
    light = long_row + [[i, i + 128, i, i + 64, 0] for i in range(128, rows, 128)]
    heavy = long_row + [[i, min(i + step, rows), i, i + bg, 0] for i in range(128, rows, step)]
    t_light = timed(light, rows, keys, row_class="blocky")
    t_heavy = timed(heavy, rows, keys, row_class="blocky")
    base = {k: v for k, v in fitted.items() if k in {f.name for f in dc_fields(CostModel)}}
    base.update(launch_us=0.0, tile_us=0.0, dense_fwd_tflops=0.0)

    def model_t(tiles, alone, share):
        return CostModel(**{**base, "row_alone_tflops": alone, "row_share": share}).tile_time(
            np.array(tiles, dtype=np.int64), work)

    def solve(f, target, lo, hi):  # model time decreasing in the parameter: bisection in log space
        for _ in range(60):
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if f(mid) > target else (lo, mid)
        return (lo * hi) ** 0.5

    alone, share = 3.0, 0.5
    for _ in range(8):  # each list mostly pins one parameter: alternate until both settle
        alone = solve(lambda a: model_t(light, a, share), t_light, 1e-3, 1e3)
        share = min(solve(lambda f: model_t(heavy, alone, f), t_heavy, 1e-4, 1.0), 1.0)
    return dict(row_alone_tflops=alone, row_share=share)


def linear_fit(points, what, fixed=None):
    """(peak FLOP/s, [half terms]) of t = (cells + sum(half_i * x_i)) / peak through ``points`` = [([cells,
    x_1, ...], t / flops per cell)]: least squares in relative error over every point, terms >= 0 (the
    best fit over the subsets of half terms left free: a term the points do not support is 0).
    ``fixed``: the half terms given, only the peak fitted."""
    A = np.array([p[0] for p in points], dtype=np.float64)
    y = np.array([p[1] for p in points], dtype=np.float64)
    W = A / y[:, None]  # rows scaled so that each point weighs by its relative error
    if fixed is not None:
        a = W[:, 0] + W[:, 1:] @ np.asarray(fixed, dtype=np.float64)
        return float((a * a).sum() / a.sum()), list(fixed)
    scaled = A / A.max(0)
    if np.linalg.matrix_rank(scaled, tol=1e-6) < A.shape[1]:
        raise RuntimeError(f"the {what!r} calibration shapes do not separate the cost terms: {A.tolist()}")
    best = None
    m = A.shape[1]
    for free in range(1 << (m - 1)):  # which half terms are free (the peak always is)
        cols = [0] + [i + 1 for i in range(m - 1) if free >> i & 1]
        x, *_ = np.linalg.lstsq(W[:, cols], np.ones(len(y)), rcond=None)
        if (x < 0).any():
            continue
        err = float(((W[:, cols] @ x - 1.0) ** 2).sum())
        if best is None or err < best[0]:
            full = np.zeros(m)
            full[cols] = x
            best = (err, full)
    if best is None or best[1][0] <= 0:
        raise RuntimeError(f"no positive {what!r} fit through {A.tolist()} / {y.tolist()}")
    x = best[1]
    return 1.0 / x[0], (x[1:] / x[0]).tolist()


def median_time(fn, device, reps, groups=5):
    """Median over ``groups`` of ``Timer.sustained(fn, reps)``: one slow group (a stall on one rank holds
    every rank's collective) does not set a link's rate (4 x H200, 2026-11-22 08:10: a mean of 10
    all-to-alls gave intra_gbps 216 where every other lease measured 297-452 and that lease's Ulysses and
    all-gather steps ran as fast as the previous lease's)."""
    timer = Timer(device)
    return float(np.median([timer.sustained(fn, reps) for _ in range(groups)]))


def _links(args, device):
    """(intra GB/s, inter GB/s or None, latency us, neighbour p2p fields or None) from all_to_all_single and
    ring-step timings."""
    world = dist.get_world_size()
    local = args.gpus_per_node or world
    reps = 2 if args.tiny else 10
    res = {}
    for name, big in (("latency", False), ("bandwidth", True)):
        per_peer = (1 << 20 if args.tiny else 64 << 20) if big else 1024
        x = torch.empty(per_peer * world, dtype=torch.uint8, device=device)
        y = torch.empty_like(x)
        res[name] = median_time(lambda: dist.all_to_all_single(y, x), device, reps)
    # one neighbour: each rank sends a block to the next rank and receives one from the previous, as the
    # ring baseline's steps do (NCCL point-to-point: fewer channels than an all-to-all's)
    # at two sizes (the time is not proportional to the bytes: CostModel.p2p_time)
    blk = 1 << 20 if args.tiny else 128 << 20
    if world > 1:
        rank = dist.get_rank()
        for key, n in (("p2p", blk), ("p2p_big", 2 * blk)):
            xs, xr = (torch.empty(n, dtype=torch.uint8, device=device) for _ in range(2))

            def ring_step():
                ops = [dist.P2POp(dist.isend, xs, (rank + 1) % world), dist.P2POp(dist.irecv, xr, (rank - 1) % world)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()

            res[key] = median_time(ring_step, device, reps)
            del xs, xr
    # bytes leaving each GPU (to the other ranks) per all-to-all
    per_peer = 1 << 20 if args.tiny else 64 << 20
    moved = per_peer * (world - 1)
    nodes = world // local
    if nodes > 1:
        # traffic splits over both kinds of links: (local-1) peers inside, world-local outside
        inter_bytes = per_peer * (world - local)
        inter = inter_bytes / max(res["bandwidth"] - res["latency"], 1e-9) / 1e9
        intra = None
    else:
        inter = None
        intra = moved / max(res["bandwidth"] - res["latency"], 1e-9) / 1e9
    p2p = None
    if "p2p" in res and nodes == 1:
        p2p = {"p2p_gbps": blk / max(res["p2p"] - res["latency"], 1e-9) / 1e9,
               "p2p_big_gbps": 2 * blk / max(res["p2p_big"] - res["latency"], 1e-9) / 1e9, "p2p_bytes": blk}
    return intra, inter, res["latency"] * 1e6, p2p


def _call(args, device, work: Workload, fields: dict):
    """(call_fwd_us, call_bwd_us): the time a megatron-cp attention call exposes beyond its GPU work when
    it is timed alone (synced before and after, as bench_dist's wall time and the simulator's predictions
    are): the host's lead before its kernels and the host time the GPU does not hide. A causal mask with
    milliseconds of GPU work per rank runs through the whole runtime, timed as bench_dist times a step
    (its ``Timer``): alone (wall) and with the stream held while the host issues it (GPU time, CUDA
    events); the difference, medians of the slowest rank. (A tiny call would time its whole host path,
    0.5 / 1.3 ms on 4 x H200, much of which a real call runs while its kernels do; a queued loop of calls
    absorbs the ranks' skew in its all-to-alls and left 0.08 / 0.49 ms.)"""
    import megatron_cp as mcp
    from megatron_cp import masks
    world, rank = dist.get_world_size(), dist.get_rank()
    s = (256 if args.tiny else 8192) * world
    plan = mcp.plan(masks.causal(s), world)
    n = plan.num_local(rank)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(rank)
    q, k, v = ((torch.randn(n, h, work.head_dim, generator=g) * 0.5).to(device, dt).requires_grad_()
               for h in (work.num_heads, work.num_kv_heads, work.num_kv_heads))
    do = torch.randn(n, work.num_heads, work.head_dim, generator=g).to(device, dt)
    be = kernels.get_backend(args.backend, device)

    def fwd():
        return mcp.attention(q, k, v, plan, dist.group.WORLD, backend=be, stages=0)[0]

    def bwd(out):
        out.backward(do)
        q.grad = k.grad = v.grad = None

    gf, gb, wf, wb, _, _ = Timer(device).run(fwd, bwd, 3, 2 if args.tiny else 15, dist.group.WORLD)
    return max(0.0, wf - gf) * 1e6, max(0.0, wb - gb) * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write (CostModel fields)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU dry run)")
    ap.add_argument("--seconds", type=float, default=0.5, help="sustained warm-up before each kernel figure")
    ap.add_argument("--gpus-per-node", type=int, default=None, help="for multi-node runs (default: world)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--verbose", action="store_true", help="each list's times on stderr (rank 0's)")
    args = ap.parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1  # set by torchrun
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    work = Workload(args.heads, args.kv_heads, args.head_dim, 2)
    base = CostModel()
    bar = Progress(2 if distributed else 0, "calibrate", enabled=not distributed or dist.get_rank() == 0,
                   verbose=args.verbose)
    fields = _kernel(args, device, work, bar)
    if distributed:
        bar.running("links")
        intra, inter, lat, p2p = _links(args, device)
        bar.step()
        fields["latency_us"] = lat
        if p2p is not None:
            fields.update(p2p)
        if intra is not None:
            fields["intra_gbps"] = intra
        if inter is not None:
            fields["inter_gbps"] = inter
        bar.running("a megatron-cp call's exposed time")
        fields["call_fwd_us"], fields["call_bwd_us"] = _call(args, device, work, fields)
        bar.step()
    bar.close()
    if device.type == "cuda":
        fields["num_sms"] = torch.cuda.get_device_properties(device).multi_processor_count
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    world = dist.get_world_size() if distributed else 1
    fields["source"] = (f"tools/sim/calibrate.py on {world} x {name}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
                        f"kernel lists timed held, command: tools/sim/calibrate.py "
                        f"{' '.join(sys.argv[1:] if argv is None else argv)}")
    model = CostModel(**{**base.__dict__, **{k: v if isinstance(v, (str, int)) else tuple(v) if isinstance(v, list)
                                             else float(v) for k, v in fields.items()}})
    if not distributed or dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        model.save(args.out)
        print("wrote", args.out)
        print("\n".join(summary_table(fields, base)))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
