"""Measure the cost model's numbers on this machine and write them as JSON (``CostModel.load`` reads it).

Kernel (Triton, dense path off): forward/backward time of full tiles with long rows (peak TFLOP/s), of
short-row tiles (the half-efficiency key length), of sliding windows of two widths (the short-row
class's own peak and half-efficiency keys), of one tiny tile (launch cost) and of many tiny tiles
(per-tile cost). Dense path (CUDA): cuDNN's forward/backward rate on the same full tile and the fixed
cost of one dense piece beside Triton tiles.
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


def _time(fn, device, reps):
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


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

    def run(tiles, sq, sk, backward=False, backend=be):
        q = torch.randn(sq, hq, d, device=device, dtype=dt)
        k = torch.randn(sk, hkv, d, device=device, dtype=dt)
        v = torch.randn(sk, hkv, d, device=device, dtype=dt)
        prep = backend.prepare(torch.tensor(tiles, dtype=torch.int32), sq, sk)
        out, lse = backend.forward(q, k, v, prep, None)
        if not backward:
            return _time(lambda: backend.forward(q, k, v, prep, None), device, reps)
        do = torch.randn_like(out)
        return _time(lambda: backend.backward(q, k, v, out, lse, do, prep, None, None), device, reps)

    flops = lambda area: work.fwd_flops(area)  # noqa: E731
    t_f = run([[0, rows, 0, keys_long, 0]], rows, keys_long)
    t_b = run([[0, rows, 0, keys_long, 0]], rows, keys_long, backward=True)
    fwd_tflops = flops(rows * keys_long) / t_f / 1e12
    bwd_tflops = 2.5 * flops(rows * keys_long) / t_b / 1e12
    # short rows: tiles of `short` keys along the diagonal (block-diagonal), same row count
    short = 64 if args.tiny else 256
    tiles = [[i, i + short, i, i + short, 0] for i in range(0, rows, short)]
    t_s = run(tiles, rows, rows)
    eff = flops(rows * short) / t_s / 1e12 / fwd_tflops
    half_keys = float(short * (1 / max(eff, 1e-3) - 1))
    t_launch = run([[0, 16, 0, 16, 0]], 16, 16)
    many = [[i, i + 16, i, i + 16, 0] for i in range(0, 16 * 64, 16)]
    t_many = run(many, 16 * 64, 16 * 64)
    tile_us = max(0.0, (t_many - t_launch) / 63 * 1e6)
    out = dict(fwd_tflops=fwd_tflops, bwd_tflops=bwd_tflops, half_keys=max(half_keys, 1.0),
               launch_us=t_launch * 1e6, tile_us=tile_us)
    # short-row lists (mean kept keys per row below the backend's long-row threshold) run other block
    # shapes: their peak and half-efficiency keys from sliding windows of two widths (the shapes the
    # short class meets: partly filled diagonal blocks), r(k) = peak * k / (k + half)
    from megatron_cp.masks import sliding_window
    from megatron_cp.planner.schedule import clip_tiles

    pts = []
    for w in ((16, 64) if args.tiny else (512, 2048)):
        win = clip_tiles(sliding_window(rows, w, 0).traps, None, [[0, rows]]).tolist()
        area = float(sum((min(i, w) + 1) for i in range(rows)))
        pts.append((area / rows, flops(area) / run(win, rows, rows) / 1e12,
                    2.5 * flops(area) / run(win, rows, rows, backward=True) / 1e12))
    (k2, f2, _), (k1, f1, b1) = pts
    h = (f2 - f1) / (f1 / k1 - f2 / k2) if f1 / k1 != f2 / k2 else 0.0
    if h > 0:
        e1 = k1 / (k1 + h)
        out.update(short_fwd_tflops=f1 / e1, short_bwd_tflops=b1 / e1, short_half_keys=h)
    if dense_be is not None:
        full = [[0, rows, 0, keys_long, 0]]
        t_df = run(full, rows, keys_long, backend=dense_be)
        t_db = run(full, rows, keys_long, backward=True, backend=dense_be)
        out["dense_fwd_tflops"] = flops(rows * keys_long) / t_df / 1e12
        out["dense_bwd_tflops"] = 2.5 * flops(rows * keys_long) / t_db / 1e12
        sq = 2 * rows  # a square causal piece of the same cell count as the full tile
        causal = [[0, sq, 0, sq, 1]]
        t_cf = run(causal, sq, sq, backend=dense_be)
        t_cb = run(causal, sq, sq, backward=True, backend=dense_be)
        c_area = sq * (sq + 1) / 2
        out["dense_causal_fwd_tflops"] = flops(c_area) / t_cf / 1e12
        out["dense_causal_bwd_tflops"] = 2.5 * flops(c_area) / t_cb / 1e12
        # fixed cost of one piece beside Triton tiles: a minimum-size dense piece next to one tiny tile,
        # less its FLOPs at the dense rate and the tiny tile's own call
        c = dense_be.config
        mr, mk = int(c.dense_min_rows), int(c.dense_min_keys)
        t_piece = run([[0, mr, 0, mk, 0], [mr, mr + 16, 0, 16, 0]], mr + 16, mk, backend=dense_be)
        out["dense_piece_us"] = max(0.0, (t_piece - t_launch - flops(mr * mk) / (out["dense_fwd_tflops"] * 1e12)) * 1e6)
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
    model = CostModel(**{**base.__dict__, **{k: float(v) if k != "source" else v for k, v in fields.items()}})
    if not distributed or dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        model.save(args.out)
        print(json.dumps(model.__dict__, indent=2))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
