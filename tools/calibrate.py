"""Measure the cost model's numbers on this machine and write them as JSON (``CostModel.load`` reads it).

Kernel (Triton, dense path off), each class on lists the backend really runs in that class (checked):
"long" full tiles of two key lengths (peak TFLOP/s and half-efficiency keys), "short" sliding windows of
two widths and "blocky" block-diagonal lists of two block sizes (each class's peak and half-efficiency
keys, per visited block cell), one tiny tile (launch cost) and many tiny tiles (per-tile cost).
Dense path (CUDA): cuDNN's forward/backward rate on full pieces of two row counts (peak and
half-efficiency rows), on a square causal piece, and the fixed cost of one dense piece beside Triton
tiles. Every kernel time is sustained: a warm-up of ``--seconds`` then repeats for ``--seconds`` (short
bursts run at boost clocks that a training step does not keep), on inputs of the benchmarks' scale.
Communication (when started under torchrun with several ranks): all_to_all_single time for small
messages (latency) and large ones (bandwidth), inside a node and, with several nodes, across them;
and the fixed time of a whole megatron-cp call on a tiny mask (call_fwd_us / call_bwd_us).

    python tools/calibrate.py --out benchmarks/cost_model.json                     # one GPU, kernels only
    torchrun --nproc-per-node 4 tools/calibrate.py --out benchmarks/cost_model.json  # plus NCCL links
    python tools/calibrate.py --device cpu --tiny --out /tmp/cost.json             # dry run on CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from megatron_cp import kernels
from megatron_cp.planner.cost import CostModel, Workload


def _time(fn, device, reps, seconds=0.0):
    """Mean seconds of ``fn``: after a warm-up of ``seconds`` (at least one call), at least ``reps`` calls
    and ``seconds`` of them."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    fn()
    sync()
    while time.perf_counter() - t0 < seconds:
        fn()
        sync()
    n, t0 = 0, time.perf_counter()
    while n < reps or time.perf_counter() - t0 < seconds:
        fn()
        n += 1
        if n >= reps:
            sync()
    sync()
    return (time.perf_counter() - t0) / n


def _fit(k1, r1, k2, r2):
    """(peak, half) of r(k) = peak * k / (k + half) through two points; half 0 when the slower point is
    not the one with fewer keys (no half-efficiency measurable)."""
    if k1 > k2:
        k1, r1, k2, r2 = k2, r2, k1, r1
    h = (r2 - r1) / (r1 / k1 - r2 / k2) if r1 < r2 and r1 / k1 != r2 / k2 else 0.0
    h = max(h, 0.0)
    return r2 * (k2 + h) / k2, h


def _kernel(args, device, work: Workload):
    """Triton numbers (dense path off), then, on CUDA, the dense (cuDNN) path's."""
    be = kernels.get_backend(args.backend, device)
    dense_be = None
    if device.type == "cuda" and be.name == "triton":
        from megatron_cp.kernels.triton_backend import TritonBackend, TritonConfig

        dense_be, be = be, TritonBackend(TritonConfig(dense_fast_path=False))
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    hq, hkv, d = work.num_heads, work.num_kv_heads, work.head_dim
    rows = 256 if args.tiny else 8192
    keys_long = 512 if args.tiny else 16384
    reps = 2 if args.tiny else 10
    secs = 0.0 if args.tiny else args.seconds

    def run(tiles, sq, sk, backward=False, backend=be, row_class=None):
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = ((torch.randn(n, h, d, generator=g) * 0.5).to(device, dt) for n, h in ((sq, hq), (sk, hkv), (sk, hkv)))
        prep = backend.prepare(torch.tensor(tiles, dtype=torch.int32), sq, sk)
        if row_class is not None and getattr(prep, "row_class", row_class) != row_class:
            raise RuntimeError(f"calibration list meant for the {row_class!r} class runs as {prep.row_class!r}")
        out, lse = backend.forward(q, k, v, prep, None)
        if not backward:
            return _time(lambda: backend.forward(q, k, v, prep, None), device, reps, secs)
        do = torch.randn_like(out)
        return _time(lambda: backend.backward(q, k, v, out, lse, do, prep, None, None), device, reps, secs)

    from megatron_cp.masks import sliding_window
    from megatron_cp.planner.cost import block_counts, tile_areas
    from megatron_cp.planner.schedule import clip_tiles

    flops = lambda area: work.fwd_flops(area)  # noqa: E731
    out = {}
    # "long": full tiles of two key lengths (both at least the long-row threshold)
    pts = []
    for keys in ((keys_long // 4, keys_long)):
        t = [[0, rows, 0, keys, 0]]
        pts.append((keys, flops(rows * keys) / run(t, rows, keys, row_class="long") / 1e12,
                    2.5 * flops(rows * keys) / run(t, rows, keys, True, row_class="long") / 1e12))
    (k1, f1, b1), (k2, f2, b2) = pts
    out["fwd_tflops"], out["half_keys"] = _fit(k1, f1, k2, f2)
    out["bwd_tflops"] = b2 * (k2 + out["half_keys"]) / k2
    t_launch = run([[0, 16, 0, 16, 0]], 16, 16)
    many = [[i, i + 16, i, i + 16, 0] for i in range(0, 16 * 64, 16)]
    t_many = run(many, 16 * 64, 16 * 64)
    out.update(launch_us=t_launch * 1e6, tile_us=max(0.0, (t_many - t_launch) / 63 * 1e6))
    # "short" (sliding windows) and "blocky" (block-diagonal lists, every block full): time per visited
    # block cell, t = (visited cells + half * rows) / peak, from two lists of each class
    hd = work.head_dim
    lists = {
        "short": [clip_tiles(sliding_window(rows, w, 0).traps, None, [[0, rows]]).tolist()
                  for w in ((16, 96) if args.tiny else (256, 1024))],
        "blocky": [[[i, i + b, i, i + b, 0] for i in range(0, rows, b)] for b in ((128, 256) if args.tiny else (512, 2048))],
    }
    for cls, pair in lists.items():
        if hasattr(be, "config"):  # the Triton backend's blocks for this class
            stc = be.config.for_head_dim(hd, cls)
            fwd_blk, bwd_blk = (stc.fwd.block_m, stc.fwd.block_n), (stc.dq.block_m, stc.dq.block_n)
        else:  # another backend (CPU dry run): the model's default blocks
            cm = CostModel()
            fwd_blk = (getattr(cm, f"{cls}_block_m"), getattr(cm, f"{cls}_block_n"))
            bwd_blk = (cm.bwd_block_m, cm.bwd_block_n)
        eq = []
        for tl in pair:
            tn = np.array(tl, dtype=np.int64)
            area = float(tile_areas(tn)[0].sum())
            tf, tb = run(tl, rows, rows, row_class=cls), run(tl, rows, rows, True, row_class=cls)
            vf = float(block_counts(tn, *fwd_blk)[0].sum()) * fwd_blk[0] * fwd_blk[1]
            vb = float(block_counts(tn, *bwd_blk)[0].sum()) * bwd_blk[0] * bwd_blk[1]
            # kernel time less launch, in FLOP units: flops(visited)/peak + flops(half * rows)/peak
            eq.append((vf, vb, rows, flops(1.0) / max(tf - t_launch, 1e-9), 2.5 * flops(1.0) / max(tb - t_launch, 1e-9), area))
        res = {}
        for ph, vi, ri in (("fwd", 0, 3), ("bwd", 1, 4)):
            # 1 / rate_i = (v_i + h * rows) / peak  ->  linear in (1 / peak, h / peak)
            A = np.array([[e[vi], e[2]] for e in eq])
            y = np.array([1.0 / e[ri] for e in eq])
            if abs(np.linalg.det(A / A.max(0))) < 1e-6:
                raise RuntimeError(f"the two {cls!r} calibration lists visit the same blocks per row: {A.tolist()}")
            inv_peak, h_over = np.linalg.solve(A, y)
            if inv_peak <= 0 or h_over < 0:  # noisy points (tiny CPU runs): no half, the bigger list's rate
                j = int(np.argmax(A[:, 0]))
                inv_peak, h_over = y[j] / A[j, 0], 0.0
            res[ph] = (1.0 / inv_peak / 1e12, h_over / inv_peak)
        out[f"{cls}_fwd_tflops"], out[f"{cls}_half_keys"] = res["fwd"]
        out[f"{cls}_bwd_tflops"], out[f"{cls}_bwd_half_keys"] = res["bwd"]
        out[f"{cls}_block_m"], out[f"{cls}_block_n"] = fwd_blk
        out["bwd_block_m"], out["bwd_block_n"] = bwd_blk
    if dense_be is not None:
        # full pieces of two row counts: rate(rows) = peak * rows / (rows + half_rows)
        pts = []
        for r in (rows // 4, rows):
            full = [[0, r, 0, keys_long, 0]]
            pts.append((r, flops(r * keys_long) / run(full, r, keys_long, backend=dense_be) / 1e12,
                        2.5 * flops(r * keys_long) / run(full, r, keys_long, True, backend=dense_be) / 1e12))
        (r1, f1, b1), (r2, f2, b2) = pts
        out["dense_fwd_tflops"], out["dense_half_rows"] = _fit(r1, f1, r2, f2)
        out["dense_bwd_tflops"], out["dense_bwd_half_rows"] = _fit(r1, b1, r2, b2)
        sq = 2 * rows  # a square causal piece of the same cell count as the full tile
        causal = [[0, sq, 0, sq, 1]]
        c_area = sq * (sq + 1) / 2
        cf = flops(c_area) / run(causal, sq, sq, backend=dense_be) / 1e12
        cb = 2.5 * flops(c_area) / run(causal, sq, sq, True, backend=dense_be) / 1e12
        out["dense_causal_fwd_tflops"] = cf * (sq + out["dense_half_rows"]) / sq  # the peak at many rows
        out["dense_causal_bwd_tflops"] = cb * (sq + out["dense_bwd_half_rows"]) / sq
        # fixed cost of one piece beside Triton tiles: a minimum-size dense piece next to one tiny tile,
        # less its FLOPs at the dense rate and the tiny tile's own call
        c = dense_be.config
        mr, mk = int(c.dense_min_rows), int(c.dense_min_keys)
        t_piece = run([[0, mr, 0, mk, 0], [mr, mr + 16, 0, 16, 0]], mr + 16, mk, backend=dense_be)
        rate = out["dense_fwd_tflops"] * 1e12 * mr / (mr + out["dense_half_rows"])
        out["dense_piece_us"] = max(0.0, (t_piece - t_launch - flops(mr * mk) / rate) * 1e6)
        out["dense_min_rows"], out["dense_min_keys"] = mr, mk
    return out


def _links(args, device):
    """(intra GB/s, inter GB/s or None, latency us) from all_to_all_single timings."""
    world, rank = dist.get_world_size(), dist.get_rank()
    local = args.gpus_per_node or world
    reps = 2 if args.tiny else 10
    res = {}
    for name, big in (("latency", False), ("bandwidth", True)):
        per_peer = (1 << 20 if args.tiny else 64 << 20) if big else 1024
        x = torch.empty(per_peer * world, dtype=torch.uint8, device=device)
        y = torch.empty_like(x)
        t = _time(lambda: dist.all_to_all_single(y, x), device, reps)
        res[name] = t
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
    return intra, inter, res["latency"] * 1e6


def _call(args, device, work: Workload, fields: dict):
    """(call_fwd_us, call_bwd_us): the fixed time of one megatron-cp attention call timed alone (synced
    before and after, as a training step's calls are when nothing else is queued): a tiny causal mask
    through the whole runtime, less the tiny kernel's call (launch_us) and one collective's latency."""
    import megatron_cp as mcp
    from megatron_cp import masks

    world, rank = dist.get_world_size(), dist.get_rank()
    s = 64 * world
    plan = mcp.plan(masks.causal(s), world)
    n = plan.num_local(rank)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(rank)
    q, k, v = ((torch.randn(n, h, work.head_dim, generator=g) * 0.5).to(device, dt).requires_grad_()
               for h in (work.num_heads, work.num_kv_heads, work.num_kv_heads))
    do = torch.randn(n, work.num_heads, work.head_dim, generator=g).to(device, dt)
    be = kernels.get_backend(args.backend, device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    tf, tb = [], []
    for i in range(3 + (3 if args.tiny else 30)):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        out, _ = mcp.attention(q, k, v, plan, dist.group.WORLD, backend=be, stages=0)
        sync()
        t1 = time.perf_counter()
        out.backward(do)
        sync()
        t2 = time.perf_counter()
        q.grad = k.grad = v.grad = None
        if i >= 3:
            tf.append(t1 - t0)
            tb.append(t2 - t1)
    base = fields.get("launch_us", CostModel.launch_us) + fields.get("latency_us", CostModel.latency_us)
    return (max(0.0, float(np.median(tf)) * 1e6 - base), max(0.0, float(np.median(tb)) * 1e6 - base))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write (CostModel fields)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU dry run)")
    ap.add_argument("--seconds", type=float, default=0.5,
                    help="warm-up and measuring time of each kernel figure (sustained rates; default 0.5)")
    ap.add_argument("--gpus-per-node", type=int, default=None, help="for multi-node runs (default: world)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
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
    fields = _kernel(args, device, work)
    if distributed:
        intra, inter, lat = _links(args, device)
        fields["latency_us"] = lat
        if intra is not None:
            fields["intra_gbps"] = intra
        if inter is not None:
            fields["inter_gbps"] = inter
        fields["call_fwd_us"], fields["call_bwd_us"] = _call(args, device, work, fields)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    world = dist.get_world_size() if distributed else 1
    fields["source"] = (f"tools/calibrate.py on {world} x {name}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
                        f"command: {' '.join(sys.argv)}")
    model = CostModel(**{**base.__dict__, **{k: v if isinstance(v, (str, int)) else float(v) for k, v in fields.items()}})
    if not distributed or dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        model.save(args.out)
        print(json.dumps(model.__dict__, indent=2))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
