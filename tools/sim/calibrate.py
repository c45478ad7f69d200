"""Research instrument (the cost model's calibration and check; not needed to use megatron-cp).

Measures the cost model's numbers on this machine into OUT/cost<tag>.json (``CostModel.load``; the tools' ``--cost``;
measured under their flat names, ``runtime.cost.flat_names``, saved nested),
timing kernels as tools/bench_dist.py times a step. ``--check``: ``--cost``'s ``tile_time`` against each kernel call
tools/bench_dist.py makes per ``--masks`` at ``--seqlen`` (131072), cp 4, one GPU: OUT/cost_check<tag>.json, a table.

    python tools/sim/calibrate.py --out out                            # one GPU: kernels and passes
    torchrun --nproc-per-node 4 tools/sim/calibrate.py --out out       # and the links, the call's host time
    python tools/sim/calibrate.py --check --cost out/cost.json --masks causal --seqlen 16384 --out out
    python tools/sim/calibrate.py --dry-run [--check]                  # CPU, tiny sizes
"""

from __future__ import annotations

import itertools
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp import kernels
from megatron_cp.comm import shared_gpu
from megatron_cp.masks import catalog
from megatron_cp.planner import Workload
from megatron_cp.runtime import CostModel
from megatron_cp.runtime.cost import block_counts, tile_areas

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/sim: simulate's call lists
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/common.py
from common import (Progress, Timer, device_name, local_rank_and_world, markdown_table, out_dir, parser,  # noqa: E402
                    run_record, write_json)
from simulate import bench_calls  # noqa: E402

SECONDS, CHECK_SECONDS, CHECK_CP = 0.5, 0.2, 4  # sustained warm-ups before each kernel figure; --check's cp


def kernel_calls(backend, tiles, sq, sk, work: Workload, device, seed=0, accumulate=False):
    """(prepared list, fwd call, bwd call) of ``backend`` on ``tiles``; ``accumulate``: fwd adds up, as the ring's."""
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = ((torch.randn(n, h, work.head_dim, generator=g) * 0.5).to(device, dt)
               for n, h in ((sq, work.num_heads), (sk, work.num_kv_heads), (sk, work.num_kv_heads)))
    prep = backend.prepare(torch.as_tensor(np.asarray(tiles), dtype=torch.int32), sq, sk)
    out, lse = backend.forward(q, k, v, prep, None)
    do = torch.randn_like(out)
    fwd = lambda: backend.forward(q, k, v, prep, None)  # noqa: E731
    if accumulate:
        acc = torch.zeros(out.shape, dtype=kernels.accumulate_dtype(dt), device=device)
        lacc = torch.full(out.shape[:2], float("-inf"), dtype=acc.dtype, device=device)
        fwd = lambda: backend.forward_accumulate(q, k, v, prep, None, acc, lacc)  # noqa: E731
    return prep, fwd, lambda: backend.backward(q, k, v, out, lse, do, prep, None, None)


def _passes(dry, device) -> dict:
    """``hbm_gbps``: an fp32 add of gradient sums and a head-splitting copy; ``split_gbps``: the copy (Ulysses')."""
    n, h, d, u = (256, 8, 16, 2) if dry else (32768, 32, 128, 4)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, h // 2, d, device=device) for _ in range(2))
    x = torch.randn(n, h, d, device=device).to(dt)
    y = torch.empty((u, n, h // u, d), device=device, dtype=dt)

    split = lambda: y.copy_(x.view(n, u, h // u, d).transpose(0, 1))  # noqa: E731

    def both():
        torch.add(a, b, out=a)
        split()

    both()
    moved, timer = 2 * x.numel() * x.element_size(), Timer(device)
    return dict(hbm_gbps=(3 * a.numel() * a.element_size() + moved) / timer.held_calls(both, 20) / 1e9,
                split_gbps=moved / timer.held_calls(split, 20) / 1e9)


def _kernel(dry, device, work: Workload, bar) -> dict:
    """The kernel fields: Triton's (dense path off), then on CUDA the dense (cuDNN) path's."""
    be = kernels.get_backend("auto", device)
    dense_be = None
    if device.type == "cuda" and isinstance(be, kernels.TritonBackend):
        dense_be, be = be, kernels.TritonBackend(kernels.TritonConfig(dense_fast_path=False))
    hq, d = work.num_heads, work.head_dim
    rows, keys_long, reps = (256, 512, 1) if dry else (16384, 16384, 10)
    timer = Timer(device)

    def run(tiles, sq, sk, backward=False, backend=be, row_class=None, warm=True):
        prep, fwd, bwd = kernel_calls(backend, tiles, sq, sk, work, device)
        if row_class is not None and getattr(prep, "row_class", row_class) != row_class:
            raise RuntimeError(f"calibration list meant for the {row_class!r} class runs as {prep.row_class!r}")
        fn = bwd if backward else fwd
        if dry:  # a CPU smoke run on a shared machine: load only adds to a timing, so the least of a few is the call's
            return min(timer.held_calls(fn, 2) for _ in range(3))
        if warm:
            timer.sustained(fn, 1, SECONDS)
        return timer.held_calls(fn, reps if warm else 2 * reps)  # few: the host issues all within the hold

    per_flop = work.fwd_flops(1.0)
    # launch_us: a tiny call, held (a synced round trip over-predicted many calls); no per-tile term: it was noise
    bar.running("launch")
    out = dict(launch_us=run([[0, 16, 0, 16, 0]], 16, 16, warm=False) * 1e6, tile_us=0.0)
    t_call = out["launch_us"] * 1e-6

    timed = lambda tl, sq, sk, bwd=False, **kw: run(tl, sq, sk, bwd, **kw) - t_call  # noqa: E731  the model adds it
    band = lambda w: [[0, rows, 0, rows + w, 3]]  # noqa: E731  rows keep w + 1 keys (k - q in [0, w]): BI_CAUSAL
    docs = lambda b, kind: [[i, i + b, i, i + b, kind] for i in range(0, rows, b)]  # noqa: E731  full 0 / causal 1

    def points(tl, cls, blocks):
        """Fit points fwd, bwd: ([cells, rows], s/FLOP); cells kept, or with ``blocks`` those of every block visited."""
        tn = np.array(tl, dtype=np.int64)
        sk = int(tn[:, 3].max())
        bar.running(f"{cls} list of {len(tl)} tiles, {rows} x {sk}")
        tf, tb = timed(tl, rows, sk, row_class=cls), timed(tl, rows, sk, True, row_class=cls)
        bar.step(f"calibrate: {cls} list of {len(tl)} tiles, {rows} x {sk}: fwd {tf * 1e3:.3f} ms, "
                 f"bwd {tb * 1e3:.3f} ms")
        cf, cb = [float(tile_areas(tn)[0].sum())] * 2 if blocks is None else \
            [float(block_counts(tn, m, n)[0].sum()) * m * n for m, n in blocks]
        return ([cf, rows], tf / per_flop), ([cb, rows], tb / (2.5 * per_flop))

    # t = (cells + half * rows) / peak per class; causal documents too (packed ones ran 11% slower than predicted)
    lists = {"long": [band(w) for w in ((128, 512) if dry else (4096, 8192, 16384))],
             "short": [band(w) for w in ((16, 96) if dry else (256, 512, 1024))] + [docs(64 if dry else 1024, 1)],
             "blocky": [docs(b, 0) for b in ((128, 256) if dry else (512, 1024, 2048))]
             + [docs(128 if dry else 2048, 1)]}
    bands = (40,) if dry else (2048, 3072)  # bands in the blocky class
    bar.step()
    for cls, tls in lists.items():
        if hasattr(be, "config"):  # the Triton backend's blocks for this class
            c = be.config.for_head_dim(d, cls)
            blocks = ((c.fwd.block_m, c.fwd.block_n), (c.dq.block_m, c.dq.block_n))
        else:  # another backend (CPU dry run): the model's default blocks
            t = CostModel().triton
            blocks = ((getattr(t, cls).block_m or 128, getattr(t, cls).block_n or 128), (t.bwd_block_m, t.bwd_block_n))
        rf, rb = zip(*(points(tl, cls, None if cls == "long" else blocks) for tl in tls))
        (peak_f, half_f), (peak_b, half_b) = linear_fit(rf, cls), linear_fit(rb, cls)
        if cls == "long":  # one half-efficiency for both phases
            out.update(fwd_tflops=peak_f / 1e12, bwd_tflops=linear_fit(rb, cls, fixed=half_f)[0] / 1e12,
                       half_keys=half_f[0])
            continue
        out.update({f"{cls}_fwd_tflops": peak_f / 1e12, f"{cls}_bwd_tflops": peak_b / 1e12,
                    f"{cls}_half_keys": half_f[0], f"{cls}_bwd_half_keys": half_b[0], f"{cls}_block_m": blocks[0][0],
                    f"{cls}_block_n": blocks[0][1], "bwd_block_m": blocks[1][0], "bwd_block_n": blocks[1][1]})
        if cls == "blocky":  # its bands: own peaks at its half terms (bands' bwd ran 1.15-1.19x the documents' fit)
            bf, bb = zip(*(points(band(w), cls, blocks) for w in bands))
            out["blocky_band_fwd_tflops"] = linear_fit(bf, "blocky band", fixed=[out["blocky_half_keys"]])[0] / 1e12
            out["blocky_band_bwd_tflops"] = linear_fit(
                bb, "blocky band", fixed=[out["blocky_bwd_half_keys"] or out["blocky_half_keys"]])[0] / 1e12
    bar.running("memory passes")
    out.update(_passes(dry, device))
    bar.step()
    if device.type == "cuda":
        out["num_sms"] = torch.cuda.get_device_properties(device).multi_processor_count
        bar.running("long rows")
        out.update(fit_long_rows(timed, out, work, rows, dry))
        bar.step()
    if dense_be is None:
        return out
    # full pieces on a 3 x 3 grid spanning plans' shapes (no extrapolation); a fit of cells + half terms at a peak
    waves = CostModel(num_sms=out["num_sms"])
    pf, pb, grid_f, grid_b = [], [], [], []
    g_rows, g_keys = (rows // 32, rows // 8, rows // 2), (keys_long // 2, 2 * keys_long, 4 * keys_long)
    for r, kk in itertools.product(g_rows, g_keys):
        bar.running(f"dense piece {r} x {kk}")
        tf, tb = (timed([[0, r, 0, kk, 0]], r, kk, bwd, backend=dense_be) for bwd in (False, True))
        pf.append(([r * kk, r, kk], tf * float(waves.wave_efficiency(r, hq)) / per_flop))
        pb.append(([r * kk, r, kk], tb * float(waves.wave_efficiency(kk, hq)) / (2.5 * per_flop)))
        grid_f.append(r * kk * per_flop / tf / 1e12)
        grid_b.append(2.5 * r * kk * per_flop / tb / 1e12)
        bar.step(f"calibrate: dense piece {r} x {kk}: fwd {tf * 1e3:.3f} ms, bwd {tb * 1e3:.3f} ms")
    (peak_f, (hk_f, hr_f)), (peak_b, (hk_b, hr_b)) = linear_fit(pf, "dense"), linear_fit(pb, "dense")
    out.update(dense_grid_rows=list(g_rows), dense_grid_keys=list(g_keys), dense_grid_fwd_tflops=grid_f,
               dense_grid_bwd_tflops=grid_b, dense_grid_heads=hq, dense_fwd_tflops=peak_f / 1e12, dense_half_keys=hk_f,
               dense_half_rows=hr_f, dense_bwd_tflops=peak_b / 1e12, dense_bwd_half_keys=hk_b, dense_bwd_half_rows=hr_b)
    n = 2 * rows  # a square causal piece: its own peak, with the full pieces' row and key terms
    bar.running("dense causal piece")
    cells, en = n * (n + 1) / 2, float(waves.wave_efficiency(n, hq))
    for key, bwd, half, flops in (("fwd", False, hk_f + hr_f, per_flop), ("bwd", True, hk_b + hr_b, 2.5 * per_flop)):
        t = timed([[0, n, 0, n, 1]], n, n, bwd, backend=dense_be)
        out[f"dense_causal_{key}_tflops"] = (cells + half * n) * flops / t / en / 1e12
    bar.step()
    # a piece's fixed cost beside Triton tiles: a minimum piece and a tiny tile, less the model's piece and the call
    c = dense_be.config
    mr, mk = int(c.dense_min_rows), int(c.dense_min_keys)
    bar.running("dense piece beside a tile")
    t_piece = run([[0, mr, 0, mk, 0], [mr, mr + 16, 0, 16, 0]], mr + 16, mk, backend=dense_be, warm=False)
    model_t = (mr * mk + hk_f * mr + hr_f * mk) * per_flop / peak_f / float(waves.wave_efficiency(mr, hq))
    out.update(dense_piece_us=max(0.0, (t_piece - t_call - model_t) * 1e6), dense_min_rows=mr, dense_min_keys=mk,
               band_squares=int(c.band_squares))  # the backend's band rule (not measured)
    bar.step(f"calibrate: a {mr} x {mk} cuDNN piece beside a tiny tile: {t_piece * 1e6:.1f} us a call, "
             f"{model_t * 1e6:.1f} of it the piece's kernel model: dense_piece_us {out['dense_piece_us']:.1f}")
    return out


def fit_long_rows(timed, fitted, work: Workload, rows: int, tiny: bool) -> dict:
    """``row_alone_tflops``, ``row_share``: long rows beside short rows (alone) and 2048-key rows (sharing SMs)."""
    keys, bg, step = (2048, 64, 128) if tiny else (131072, 2048, 512)
    long_row = [[0, 128, 0, keys, 0]]
    light = long_row + [[i, i + 128, i, i + 64, 0] for i in range(128, rows, 128)]
    heavy = long_row + [[i, min(i + step, rows), i, i + bg, 0] for i in range(128, rows, step)]
    t_light, t_heavy = (timed(tl, rows, keys, row_class="blocky") for tl in (light, heavy))
    base = {k: v for k, v in fitted.items() if k in CostModel().flat()}  # the fields measured so far
    base.update(launch_us=0.0, tile_us=0.0, dense_fwd_tflops=0.0)

    def model_t(tiles, alone, share):
        return CostModel.from_flat({**base, "row_alone_tflops": alone, "row_share": share}).tile_time(
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
    """(peak, [half terms]) of t = (cells + sum(half_i * x_i)) / peak, in relative error, terms >= 0 or ``fixed``."""
    A = np.array([p[0] for p in points], dtype=np.float64)
    y = np.array([p[1] for p in points], dtype=np.float64)
    W = A / y[:, None]  # rows scaled so that each point weighs by its relative error
    if fixed is not None:
        a = W[:, 0] + W[:, 1:] @ np.asarray(fixed, dtype=np.float64)
        return float((a * a).sum() / a.sum()), list(fixed)
    if np.linalg.matrix_rank(A / A.max(0), tol=1e-6) < A.shape[1]:
        raise RuntimeError(f"the {what!r} calibration shapes do not separate the cost terms: {A.tolist()}")
    best = None
    m = A.shape[1]
    for free in range(1 << (m - 1)):  # which half terms are free (the peak always is)
        cols = [0] + [i + 1 for i in range(m - 1) if free >> i & 1]
        x, *_ = np.linalg.lstsq(W[:, cols], np.ones(len(y)), rcond=None)
        err = float(((W[:, cols] @ x - 1.0) ** 2).sum())
        if (x >= 0).all() and (best is None or err < best[0]):
            best = (err, np.zeros(m))
            best[1][cols] = x
    if best is None or best[1][0] <= 0:
        raise RuntimeError(f"no positive {what!r} fit through {A.tolist()} / {y.tolist()}")
    return 1.0 / best[1][0], (best[1][1:] / best[1][0]).tolist()


def median_time(fn, device, reps, groups=5):
    """Median of ``groups`` timings: one stall (it holds every rank's collective) does not set a link's rate."""
    timer = Timer(device)
    return float(np.median([timer.sustained(fn, reps) for _ in range(groups)]))


def _links(dry, device) -> dict:
    """all_to_all_single latency and bandwidth; a ring step's send|receive at two sizes (CostModel.p2p_time)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    reps, big, blk = (2, 1 << 20, 1 << 20) if dry else (10, 64 << 20, 128 << 20)
    t = {}
    for name, per_peer in (("latency", 1024), ("bandwidth", big)):
        x = torch.empty(per_peer * world, dtype=torch.uint8, device=device)
        y = torch.empty_like(x)
        t[name] = median_time(lambda: dist.all_to_all_single(y, x), device, reps)
    for name, n in (("p2p", blk), ("p2p_big", 2 * blk)):
        xs, xr = (torch.empty(n, dtype=torch.uint8, device=device) for _ in range(2))

        def ring_step():
            ops = [dist.P2POp(dist.isend, xs, (rank + 1) % world), dist.P2POp(dist.irecv, xr, (rank - 1) % world)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        t[name] = median_time(ring_step, device, reps)
    gbps = lambda nbytes, key: nbytes / max(t[key] - t["latency"], 1e-9) / 1e9  # noqa: E731
    if world // local > 1:  # each GPU's bytes to the other nodes
        return dict(latency_us=t["latency"] * 1e6, inter_gbps=gbps(big * (world - local), "bandwidth"))
    return dict(latency_us=t["latency"] * 1e6, intra_gbps=gbps(big * (world - 1), "bandwidth"),
                p2p_gbps=gbps(blk, "p2p"), p2p_big_gbps=gbps(2 * blk, "p2p_big"), p2p_bytes=blk)


def _call(dry, device, work: Workload) -> tuple[float, float]:
    """(call_fwd_us, call_bwd_us): wall less GPU time of a causal call of ms of work (a tiny one's host shows)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    plan = mcp.plan(mcp.masks.causal((256 if dry else 8192) * world), world)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(rank)
    q, k, v = ((torch.randn(plan.num_local(rank), h, work.head_dim, generator=g) * 0.5).to(device, dt).requires_grad_()
               for h in (work.num_heads, work.num_kv_heads, work.num_kv_heads))
    do = torch.randn(q.shape, generator=g).to(device, dt)
    be = kernels.get_backend("auto", device)

    def bwd(out):
        out.backward(do)
        q.grad = k.grad = v.grad = None

    fwd = lambda: mcp.attention(q, k, v, plan, dist.group.WORLD, backend=be, stages=0)[0]  # noqa: E731
    gf, gb, wf, wb, _, _ = Timer(device).run(fwd, bwd, 3, 2 if dry else 15, dist.group.WORLD)
    return max(0.0, wf - gf) * 1e6, max(0.0, wb - gb) * 1e6


def summary_table(fields, default):
    """The closing table (lines): each field measured (``fields``) beside ``default``'s value."""
    cell = lambda v: f"[{', '.join(map(cell, v))}]" if isinstance(v, (list, tuple)) else f"{v:.4g}" \
        if isinstance(v, float) else str(v)  # noqa: E731
    return markdown_table(["field", "measured", "default"],
                          [[k, cell(v), cell(default.flat().get(k, "-"))] for k, v in fields.items() if k != "source"])


def check_table(rows):
    """--check's table (lines): per mask and impl, the calls' summed ms and the call predicted furthest off."""
    out = []
    for key in dict.fromkeys((r["mask"], r["impl"]) for r in rows):
        rs = [r for r in rows if (r["mask"], r["impl"]) == key]
        cells = []
        for ph in ("fwd", "bwd"):
            meas, pred = sum(r[f"{ph}_ms"] for r in rs), sum(r[f"{ph}_pred_ms"] for r in rs)
            worst = max(rs, key=lambda r: abs(np.log(r[f"{ph}_pred_ms"] / r[f"{ph}_ms"])))
            cells += [f"{meas:.3f} / {pred:.3f} ({pred / meas:.2f})",
                      f"{worst[f'{ph}_pred_ms'] / worst[f'{ph}_ms']:.2f} (rank {worst['rank']} step {worst['step']})"]
        out.append([*key, len(rs), *cells])
    return markdown_table(["mask", "impl", "calls", "fwd meas / pred ms (ratio)", "fwd worst call",
                           "bwd meas / pred ms (ratio)", "bwd worst call"], out)


def check(args, device, work: Workload) -> list[dict]:
    """--check: each of ``bench_calls`` timed fwd and bwd with the default backend, beside ``tile_time``."""
    masks = (args.masks or ("causal" if args.dry_run else ",".join(catalog.DIST_MASKS))).split(",")
    s = args.seqlen or (1024 if args.dry_run else 131072)
    cost = CostModel.load(args.cost) if args.cost else CostModel()
    be, timer, rows = kernels.get_backend("auto", device), Timer(device), []
    path = os.path.join(out_dir(args), f"cost_check{args.tag}.json")
    jobs = [dict(c, mask=m) for m in masks for c in bench_calls(catalog.build(m, s), CHECK_CP, work)]
    with Progress(len(jobs), "calibrate --check", verbose=args.verbose) as bar:
        for c in jobs:
            what = f"{c['mask']} {c['impl']} rank {c['rank']} step {c['step']}"
            bar.running(what)
            w = Workload(c["heads"], c["kv_heads"], c["head_dim"], 2)
            _, fwd, bwd = kernel_calls(be, c["tiles"], c["sq"], c["sk"], w, device, c["rank"] * 131 + c["step"],
                                       accumulate=c["impl"] == "ring")
            sec = 0.0 if args.dry_run else CHECK_SECONDS  # back to back, not held: as a step runs its calls
            tf, tb = timer.sustained(fwd, 3, sec), timer.sustained(bwd, 3, sec)
            tiles = np.asarray(c.pop("tiles"))
            rows.append(c | dict(n_tiles=len(tiles), area=float(tile_areas(tiles)[0].sum()), fwd_ms=tf * 1e3,
                                 bwd_ms=tb * 1e3, fwd_pred_ms=cost.tile_time(tiles, w) * 1e3,
                                 bwd_pred_ms=cost.tile_time(tiles, w, True) * 1e3))
            write_json(path, run_record(device_name(device), cost=cost.source, results=rows))
            r = rows[-1]
            bar.step(f"{what}: {len(tiles)} tiles, fwd {r['fwd_ms']:.3f} / {r['fwd_pred_ms']:.3f} ms, bwd "
                     f"{r['bwd_ms']:.3f} / {r['bwd_pred_ms']:.3f}")
    print("wrote", path)
    print("\n".join(check_table(sorted(rows, key=lambda r: (r["mask"], r["impl"], r["step"], r["rank"])))))
    return rows


def main(argv=None):
    ap = parser(__doc__, "out")
    ap.add_argument("--check", action="store_true", help="check --cost's kernel model call by call (one GPU)")
    ap.add_argument("--cost", default=None, help="--check: CostModel JSON (this tool's cost.json; default CostModel())")
    ap.add_argument("--masks", default=None, help="--check: comma list (default every benchmark mask; dry run: causal)")
    ap.add_argument("--seqlen", type=int, default=None, help="--check: default 131072 (a dry run: 1024)")
    args = ap.parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1 and not args.check  # under torchrun
    # a GPU per rank: ranks sharing one would time each other (shared_gpu.rank_device refuses them)
    device = torch.device("cpu") if args.dry_run else shared_gpu.rank_device(*local_rank_and_world())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    work = Workload(4, 2, 16, 2) if args.dry_run else Workload()
    threads = torch.get_num_threads()
    if args.dry_run:  # tiny calls on CPU threads that other processes contend for time noise (the fits fail)
        torch.set_num_threads(1)
    if args.check:
        rows = check(args, device, work)
        torch.set_num_threads(threads)
        return rows
    if distributed:
        dist.init_process_group("gloo" if args.dry_run else "nccl")
    rank0 = not distributed or dist.get_rank() == 0
    bar = Progress(None, "calibrate", enabled=rank0, verbose=args.verbose)
    fields = _kernel(args.dry_run, device, work, bar)
    if distributed:
        bar.running("links")
        fields.update(_links(args.dry_run, device))
        bar.step()
        bar.running("a megatron-cp call's exposed time")
        fields["call_fwd_us"], fields["call_bwd_us"] = _call(args.dry_run, device, work)
        bar.step()
    bar.close()
    torch.set_num_threads(threads)
    rec = run_record(f"{dist.get_world_size() if distributed else 1} x {device_name(device)}")
    fields["source"] = f"tools/sim/calibrate.py on {rec['device']}, {rec['date']}, kernel lists timed held, " \
                       f"command: {rec['command']}"
    if rank0:
        path = os.path.join(out_dir(args), f"cost{args.tag}.json")
        CostModel.from_flat(fields).save(path)
        print("wrote", path)
        print("\n".join(summary_table(fields, CostModel())))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
