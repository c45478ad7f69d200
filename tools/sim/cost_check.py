"""Research instrument (the cost model's check; not needed to use megatron-cp).

The cost model's kernel time against the kernel, call by call, on the benchmark's real tile lists.

For each benchmark mask (megatron_cp.masks.catalog) at ``--seqlen`` planned for ``--cp`` ranks, every kernel
call that tools/bench_dist.py's implementations make, with its own tile list and shapes:

- ``megatron-cp``: rank r's tiles over its K/V buffer (``mcp.plan(mask, cp)``, as the benchmark), and
  its guest rows' tiles over its own keys when the plan has guest rows (``megatron-cp-guest``);
- ``ring``: step i of rank r, its rows against the block of rank (r - i) % cp (``plan_for("ring")``'s
  layout, ``baselines.ring_tiles``; forward through ``forward_accumulate``, as the ring runs it);
- ``ulysses``: the whole mask on Hq / cp query heads (``baselines.mask_tiles``; K/V heads repeated as
  the baseline does, ``planner.layout.kv_head_repeat``);
- ``allgather``: rank r's rows against every key, in rank order (``baselines.rank_tiles``).

Each call runs forward and backward (delta computed by the kernel, as the runtime asks) with the
default backend (Triton with cuDNN dense pieces), queued: calls back to back for ``--seconds`` after as
long a warm-up, one sync at the end (how a training step runs them; bench_dist's GPU time). Printed and
written (``--out``): measured and predicted (``CostModel.tile_time`` with ``--cost``) milliseconds.

Under torchrun the calls are shared round-robin over the processes (one GPU each, no communication
but the final gather), so a 4-GPU machine checks 4 x faster. bf16, Hq 32, Hkv 8, D 128.

    torchrun --nproc-per-node 4 tools/sim/cost_check.py --cost cost.json --out out/check.json
    python tools/sim/cost_check.py --device cpu --tiny --out /tmp/cc.json      # CPU dry run

While it runs, rank 0 shows a progress bar on stderr over its share of the calls, naming the call being
timed (redrawn at most every 30 s where stderr is not a terminal: tools/common.py). It ends with one
table on stdout: per mask and implementation, the calls' measured and predicted totals and the worst
call; every call's line goes to stdout before it with --verbose (all of them are in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp import kernels
from megatron_cp.baselines import mask_tiles, plan_for, rank_tiles, ring_tiles
from megatron_cp.masks import catalog
from megatron_cp.planner import Workload
from megatron_cp.planner.layout import kv_head_repeat
from megatron_cp.runtime import CostModel
from megatron_cp.runtime.cost import tile_areas

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/: progress bar, table
from common import Progress, Timer, device_name, markdown_table, run_record  # noqa: E402

IMPLS = ["megatron-cp", "ring", "ulysses", "allgather"]


def calls(name: str, s: int, cp: int, impls, work: Workload):
    """Every kernel call of the benchmark's implementations on mask ``name``: dicts with the call's
    impl, rank, step, tiles, sq, sk, heads, kv_heads (the K/V heads the kernel sees)."""
    mask = catalog.build(name, s)
    out = []
    base = dict(mask=name, seqlen=s, cp=cp, heads=work.num_heads, kv_heads=work.num_kv_heads, head_dim=work.head_dim)
    if "megatron-cp" in impls:
        plan = mcp.plan(mask, cp)
        for r in plan.ranks:
            out.append(dict(base, impl="megatron-cp", rank=r.rank, step=0, tiles=r.tiles, sq=r.num_tokens,
                            sk=max(r.buffer_len, 1)))
            n_guest = sum(r.guest_recv_counts())
            if len(r.guest_tiles) and n_guest:
                out.append(dict(base, impl="megatron-cp-guest", rank=r.rank, step=0, tiles=r.guest_tiles,
                                sq=n_guest, sk=r.num_tokens))
    if "ring" in impls:
        plan = plan_for("ring", mask, cp)
        n = [r.num_tokens for r in plan.ranks]
        for r in range(cp):
            for i, t in enumerate(ring_tiles(plan, 1, r)):  # step i: rank r's rows x rank (r - i) % cp's keys
                src = (r - i) % cp
                if len(t):
                    out.append(dict(base, impl="ring", rank=r, step=i, tiles=t, sq=n[r], sk=n[src],
                                    layout=plan.solver))
    if "ulysses" in impls and work.num_heads % cp == 0:
        f = kv_head_repeat(work.num_heads, work.num_kv_heads, cp)
        out.append(dict(base, impl="ulysses", rank=0, step=0, tiles=mask_tiles(plan_for("ulysses", mask, cp)),
                        sq=s, sk=s, heads=work.num_heads // cp, kv_heads=work.num_kv_heads * f // cp))
    if "allgather" in impls:
        plan = plan_for("allgather", mask, cp)
        for r in range(cp):
            out.append(dict(base, impl="allgather", rank=r, step=0, tiles=rank_tiles(plan, r),
                            sq=plan.num_local(r), sk=s))
    return [c for c in out if len(c["tiles"])]


def measure(c: dict, be, device, dtype, seconds: float) -> tuple[float, float]:
    """(forward, backward) seconds of one call."""
    g = torch.Generator(device="cpu").manual_seed(c["rank"] * 131 + c["step"])
    d = c["head_dim"]
    q = (torch.randn(c["sq"], c["heads"], d, generator=g) * 0.5).to(device, dtype)
    k, v = ((torch.randn(c["sk"], c["kv_heads"], d, generator=g) * 0.5).to(device, dtype) for _ in range(2))
    prep = be.prepare(torch.from_numpy(np.asarray(c["tiles"]).astype("int32")), c["sq"], c["sk"])
    out, lse = be.forward(q, k, v, prep, None)
    do = torch.randn_like(out)
    if c["impl"] == "ring":  # the ring adds every step into a running output (kernels.Backend protocol)
        acc = torch.zeros(out.shape, dtype=kernels.accumulate_dtype(dtype), device=device)
        lacc = torch.full(out.shape[:2], float("-inf"), dtype=kernels.accumulate_dtype(dtype), device=device)
        fwd = lambda: be.forward_accumulate(q, k, v, prep, None, acc, lacc)  # noqa: E731
    else:
        fwd = lambda: be.forward(q, k, v, prep, None)  # noqa: E731
    timer = Timer(device)  # calls back to back, one sync at the end, after a warm-up of ``seconds``
    tf = timer.sustained(fwd, 3, seconds)
    tb = timer.sustained(lambda: be.backward(q, k, v, out, lse, do, prep, None, None), 3, seconds)
    return tf, tb


def summary_table(rows):
    """The closing table (lines): per mask and implementation, the number of calls, their summed measured
    and predicted ms (predicted / measured) per phase, and the call whose prediction is furthest off."""
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
    return markdown_table(["mask", "impl", "calls", "fwd meas / pred ms (ratio)", "fwd worst call", "bwd meas / pred ms (ratio)",
                           "bwd worst call"], out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--masks", default=",".join(catalog.DIST_MASKS))
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--cost", default=None, help="CostModel JSON (tools/sim/calibrate.py); default CostModel()")
    ap.add_argument("--seconds", type=float, default=0.2, help="warm-up and measuring time of each figure")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny sequence, fp32, no warm-up")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--verbose", action="store_true", help="every call's line before the summary table")
    args = ap.parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world, me = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    s = 1024 if args.tiny else args.seqlen
    seconds = 0.0 if args.tiny else args.seconds
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cost = CostModel.load(args.cost) if args.cost else CostModel()
    work = Workload()
    be = kernels.get_backend(args.backend, device)
    jobs = [c for m in args.masks.split(",") for c in calls(m, s, args.cp, args.impls.split(","), work)]
    mine = []
    # each process also appends its rows as they come (<out>.rank<N>.jsonl): a run cut short keeps them
    part = open(f"{args.out}.rank{me}.jsonl", "w") if args.out else None
    t0 = time.perf_counter()
    bar = Progress(len(jobs[me::world]), "cost_check", enabled=me == 0)
    for c in jobs[me::world]:
        bar.running(f"{c['mask']} {c['impl']} rank {c['rank']} step {c['step']}")
        tf, tb = measure(c, be, device, dtype, seconds)
        w = Workload(c["heads"], c["kv_heads"], c["head_dim"], 2)
        tiles = np.asarray(c["tiles"])
        mine.append({k: v for k, v in c.items() if k != "tiles"} | dict(
            n_tiles=len(tiles), area=float(tile_areas(tiles)[0].sum()), fwd_ms=tf * 1e3, bwd_ms=tb * 1e3,
            fwd_pred_ms=cost.tile_time(tiles, w) * 1e3, bwd_pred_ms=cost.tile_time(tiles, w, True) * 1e3,
            at_s=time.perf_counter() - t0))
        if part:
            part.write(json.dumps(mine[-1]) + "\n")
            part.flush()
        bar.step()
    bar.close()
    if part:
        part.close()
    rows = mine
    if distributed:
        parts = [None] * world
        dist.all_gather_object(parts, mine)
        rows = [r for p in parts for r in p]
        dist.destroy_process_group()
    if me:
        return
    rows.sort(key=lambda r: (r["mask"], r["impl"], r["step"], r["rank"]))
    if args.verbose:
        print(f"{'mask':<15}{'impl':<18}{'rank':>4}{'step':>5}{'tiles':>6}  fwd meas/pred (ratio)    bwd meas/pred (ratio)")
        for r in rows:
            print(f"{r['mask']:<15}{r['impl']:<18}{r['rank']:>4}{r['step']:>5}{r['n_tiles']:>6}  "
                  f"{r['fwd_ms']:7.3f}/{r['fwd_pred_ms']:<7.3f}({r['fwd_pred_ms'] / r['fwd_ms']:4.2f})   "
                  f"{r['bwd_ms']:7.3f}/{r['bwd_pred_ms']:<7.3f}({r['bwd_pred_ms'] / r['bwd_ms']:4.2f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(run_record(f"{world} x {device_name(device)}", " ".join(sys.argv), cost=cost.source,
                                 results=rows), f, indent=1)
        print("wrote", args.out)
    print("\n".join(summary_table(rows)))


if __name__ == "__main__":
    main()
