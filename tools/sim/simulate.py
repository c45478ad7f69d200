"""Research instrument (the cost model's simulator; not needed to use megatron-cp).

Predicts context-parallel steps' GPU time (host ahead, as in training) from plans and a cost model (``--cost``:
calibrate.py's cost.json) at cp 8 .. 1024, 8 GPUs a node, 50 GB/s per GPU between nodes, for ``megatron-cp``,
``greedy`` (area-balanced, flat routes: MagiAttention-like), ``ring`` / ``zigzag`` (cp <= 64) and ``ulysses``
(cp <= Hq), in TFLOP/s per GPU of mask-area FLOPs. ``--compare``: against a tools/bench_dist.py JSON (TARGETS).
Writes OUT/simulate<tag>.json and one table. Reads documented internals: ``runtime.predict.guest_predict`` /
``guest_traffic``, the plan's ``traps`` / ``recv_runs`` / ``send_runs``, ``masks.geometry.traps_to_tiles``.

    python tools/sim/simulate.py --masks packed,causal --cps 8,16,32,64 --cost cost.json --out out
    python tools/sim/simulate.py --compare out/bench/bench_....json --cost cost.json --tag _predict
    python tools/sim/simulate.py --dry-run                             # cp 2, 4 at 256 tokens/GPU
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys
import time

import numpy as np

import megatron_cp as mcp
from megatron_cp.baselines import mask_tiles, plan_for, rank_tiles, ring_tiles
from megatron_cp.masks import catalog
from megatron_cp.masks.geometry import traps_to_tiles
from megatron_cp.planner import Workload
from megatron_cp.planner.layout import kv_head_repeat
from megatron_cp.runtime import CostModel
from megatron_cp.runtime.predict import guest_predict, guest_traffic

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/common.py
from common import (OURS, Progress, impl_list, impl_name, markdown_table, out_dir, parser, run_record,  # noqa: E402
                    write_json)

GPUS_PER_NODE, INTER_GBPS = 8, 50.0
MAX_RING_CP = 64  # the ring needs cp^2 block areas


def _block_areas(mask, segs) -> np.ndarray:
    """cells[r, src]: ``mask`` in rank r's rows x rank src's keys (``segs``), from row intervals (fast at cp 64)."""
    t = mask.traps
    rows = np.concatenate([np.arange(a, b) for a, b in t[:, :2]] + [np.zeros(0, np.int64)])
    ti = np.repeat(np.arange(len(t)), t[:, 1] - t[:, 0])
    lo, hi = t[ti, 2] + t[ti, 3] * rows, t[ti, 4] + t[ti, 5] * rows
    out = np.zeros((len(segs), len(segs)))
    for r, q_runs in enumerate(segs):
        sel = np.zeros(len(rows), bool)
        for a, b in np.reshape(q_runs, (-1, 2)):
            sel |= (rows >= a) & (rows < b)
        lo_r, hi_r = lo[sel], hi[sel]
        for src, k_runs in enumerate(segs):
            out[r, src] = sum(int(np.clip(np.minimum(hi_r, d) - np.maximum(lo_r, c), 0, None).sum())
                              for c, d in np.reshape(k_runs, (-1, 2)))
    return out


def _kernel_time(cost: CostModel, work: Workload, area: float, rows: float, backward=False) -> float:
    """Cost-model kernel time of ``area`` cells spread over ``rows`` rows in one tile (no tile list: cp > 16)."""
    if area <= 0:
        return 0.0
    long = cost.triton.long
    peak = (long.bwd_tflops / 2.5 if backward else long.fwd_tflops) * 1e12
    keys = area / max(rows, 1)
    return (cost.launch_us + cost.triton.tile_us) * 1e-6 + work.fwd_flops(area) / (peak * keys / (keys + long.half_keys))


def _union_len(runs) -> int:
    """Length of the union of half-open runs (int [n, 2])."""
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    r = r[np.argsort(r[:, 0], kind="stable")]
    reached = np.maximum.accumulate(np.r_[r[:1, 0], r[:-1, 1]])  # the furthest end before each run
    return int(np.clip(r[:, 1] - np.maximum(r[:, 0], reached), 0, None).sum())


def _pipeline(local_c, remote_c, comm, n, latency):
    """Forward time: own keys, then n remote stages, each starting when its cast and the previous stage are done."""
    c, k = comm / n + latency, remote_c / n
    return max(local_c, c) + (n - 1) * max(k, c) + k


def ours(mask, cp, g, cost, work, hierarchical=True, solver=None, guest_rows="auto", plan=None):
    """megatron-cp's predicted step on ``mask`` over ``cp`` GPUs, ``g`` a node (``plan``: made already)."""
    nodes = max(1, cp // g)
    topo = mcp.Topology(nodes, min(g, cp), intra_node_gbps=cost.links.intra_gbps, inter_node_gbps=cost.links.inter_gbps)
    if plan is None:
        plan = mcp.plan(mask, cp, topology=topo, solver=solver or ("hierarchical" if nodes > 1 else "auto"),
                        guest_rows=guest_rows)
    per_tok = work.kv_bytes_per_token
    node_inter = [0] * nodes
    if nodes > 1:  # each K/V row a node needs from other nodes crosses into it once
        seen = [[] for _ in range(nodes)]
        for r in plan.ranks:
            seen[r.rank // g] += [x for src, x in enumerate(r.recv_runs) if src // g != r.rank // g and len(x)]
        node_inter = [_union_len(np.concatenate(x)) if x else 0 for x in seen]
    times, comms, inter_b, intra_b = [], [], [], []
    for r in plan.ranks:
        local = traps_to_tiles(r.traps, None, r.segments)  # the rank's cells: rows local, keys global
        runs = [x for x in r.recv_runs if len(x)]
        remote = traps_to_tiles(r.traps, None, np.sort(np.concatenate(runs), axis=0)) if runs else local[:0]
        ov = (cost.stage_overhead(r.num_tokens, work), cost.stage_overhead(r.num_tokens, work, True))
        n_send = sum(int((x[:, 1] - x[:, 0]).sum()) for x in r.send_runs if len(x))
        # the exchange's row gathers / placements (single path: plus the delta pass) and the call's fixed time
        px = [cost.exchange_passes(r.num_tokens, r.num_remote, n_send, work, *a) + cost.call_time(bool(a))
              for a in ((), (True,), (True, False))]
        # the kernel model on the rank's tiles. t[0]: one exchange, one call (fwd, bwd); t[n]: ((own, remote) fwd,
        # (own, remote) bwd), remote split n ways (smaller stage pieces can drop off the dense path)
        t = {0: (cost.tile_time(r.tiles, work) + px[0], cost.tile_time(r.tiles, work, True) + px[1])}
        own = (cost.tile_time(local, work, accumulate=True) + ov[0] + px[0],
               cost.tile_time(local, work, True) + ov[1] + px[2])
        for n in (1, 2, 4, 8):
            t[n] = ((own[0], n * (cost.tile_time(remote, work, key_split=n) + ov[0])),
                    (own[1], n * (cost.tile_time(remote, work, True, key_split=n) + ov[1])))
        same = sum(int((x[:, 1] - x[:, 0]).sum()) for src, x in enumerate(r.recv_runs) if src // g == r.rank // g)
        if hierarchical and nodes > 1:  # the node's inter-node rows spread over its rail-aligned GPUs
            inter, intra = node_inter[r.rank // g] / g * per_tok, r.num_remote * per_tok
        else:
            inter, intra = (r.num_remote - same) * per_tok, same * per_tok
        times.append(t)
        inter_b.append(inter)
        intra_b.append(intra)
        comms.append(max(intra / (cost.links.intra_gbps * 1e9), inter / (cost.links.inter_gbps * 1e9)))
    comm = max(comms)  # the collectives synchronise: every transfer takes the busiest GPU's time
    lat = cost.links.latency_us * 1e-6 * (2 if hierarchical and nodes > 1 else 1)
    cands = [[max(t[0][i] + (comm + lat if comm > 0 else 0.0) if n == 0 else _pipeline(*t[n][i], comm, n, lat)
                  for t in times) for i in (0, 1)] + [n]
             for n in ((0, 1, 2, 4, 8) if nodes == 1 else (1, 2, 4, 8))]  # 0: one exchange (flat, one node only)
    best = min(cands, key=lambda c: c[0] + c[1])
    gt = guest_predict(plan, cost, work)  # guest rows: their exchanges and kernel call after the main path
    if plan.has_guests:  # and their forward bytes (q out, partials back: flat all-to-alls) received per GPU
        gb = sum(m for name, m in guest_traffic(plan, work) if name in ("guest_q", "guest_out"))
        np.fill_diagonal(gb, 0.0)
        same = (np.arange(cp)[:, None] // g) == (np.arange(cp)[None, :] // g)
        intra_b = [b + x for b, x in zip(intra_b, np.where(same, gb, 0).sum(0))]
        inter_b = [b + x for b, x in zip(inter_b, np.where(~same, gb, 0).sum(0))]
    return dict(fwd_s=best[0] + gt["fwd_s"], bwd_s=best[1] + gt["bwd_s"], stages=best[2],
                imbalance=plan.stats()["imbalance"], solver=plan.solver + ("+guests" if plan.has_guests else ""),
                inter_node_bytes_per_gpu=float(max(inter_b)), intra_node_bytes_per_gpu=float(max(intra_b)))


def ring(mask, cp, g, cost, work, layout="contiguous"):
    """``baselines.ring`` on a default-priority NCCL stream. Forward: the next block's transfer gets no multiprocessor
    while a kernel fills them (profiled on H200), so a step takes its slowest kernel plus the transfer. Backward:
    step i's fp32 dK|dV sums leave after its kernel, overlapping step i + 1's; the last comes home."""
    plan = mcp.plan(mask, cp, solver=layout, guest_rows="none")
    per_tok, nodes = work.kv_bytes_per_token, max(1, cp // g)
    segs = [r.segments for r in plan.ranks]
    areas = _block_areas(mask, segs)
    rows = np.array([p.num_tokens for p in plan.ranks], dtype=float)
    blk = rows.max() * per_tok
    # a neighbour's send|receive: across nodes at the NIC's rate, inside a node at calibrated point-to-point times
    hop = (lambda b: b / (cost.links.inter_gbps * 1e9) + cost.links.latency_us * 1e-6) if nodes > 1 else cost.p2p_time
    cb = hop(2 * blk)
    # backward's dK|dV per step: concatenated (2+2 bytes), made fp32 (2+4), added to the arriving sums (4+4+4)
    kv_pass = rows.max() * 2 * work.num_kv_heads * work.head_dim * 22 / (cost.memory.hbm_gbps * 1e9)
    tf = tb = 0.0
    for i in range(cp):
        src = (np.arange(cp) - i) % cp
        if cp <= 16:  # the kernel model on each step's real tiles (cp^2 clips); areas beyond
            step = [traps_to_tiles(mask.traps, segs[r], segs[src[r]]) for r in range(cp)]
            # forward_accumulate reads and writes the fp32 running output of the rows it visits
            kf = max(cost.tile_time(t, work, accumulate=True)
                     + cost.stage_overhead(_union_len(cost.rest_tiles(t)[:, :2]), work) if len(t) else 0.0
                     for t in step)
            kb = max(cost.tile_time(t, work, True) if len(t) else 0.0 for t in step)
        else:
            a = areas[np.arange(cp), src]
            kf = max(_kernel_time(cost, work, x, n) + (cost.stage_overhead(n, work) if x > 0 else 0.0)
                     for x, n in zip(a, rows))
            kb = max(_kernel_time(cost, work, x, n, True) for x, n in zip(a, rows))
        tf += kf + (hop(blk) if i < cp - 1 else 0.0)
        busy = kb + cost.stage_overhead(rows.max(), work, True) + kv_pass if kb > 0 else 0.0
        tb += max(busy, cb if i > 0 else 0.0)
    if cp > 1:
        tb += cb
    area = areas.sum(1)
    return dict(fwd_s=tf + cost.call_time(), bwd_s=tb + cost.call_time(True),
                imbalance=float(area.max() / area.mean() - 1) if area.mean() > 0 else 0.0,
                inter_node_bytes_per_gpu=float((cp - 1) * blk) if nodes > 1 else 0.0)


def _a2a(cost, b, cp, g):
    """One all-to-all of ``b`` bytes per GPU; the share bound for other nodes at the NIC's rate."""
    inter = b * (cp - min(g, cp)) / max(cp - 1, 1)
    return cost.links.latency_us * 1e-6 + max((b - inter) / (cost.links.intra_gbps * 1e9),
                                              inter / (cost.links.inter_gbps * 1e9) if cp // g > 1 else 0)


def ulysses(mask, cp, g, cost, work):
    """``baselines.ulysses``: q|k|v laid out (one write), one exchange, the whole mask on Hq/cp heads, out|lse back
    and put in head order (one write); backward the mirror image plus the delta pass over out and dout."""
    hq, s = work.num_heads, mask.seqlen_q
    if cp > hq or hq % cp:
        return None
    f = next(f for f in range(1, cp + 1) if (work.num_kv_heads * f) % cp == 0)  # K/V heads repeated
    hkv = work.num_kv_heads * f
    w = Workload(hq // cp, hkv // cp, work.head_dim, work.dtype_bytes)
    tiles = traps_to_tiles(mask.traps, None, [[0, s]])  # the whole mask as one tile list
    n = s / cp
    tok = n * work.head_dim * work.dtype_bytes  # bytes of one head of this GPU's rows
    per = lambda heads: tok * heads * (cp - 1) / cp  # noqa: E731 bytes each GPU sends
    hbm, split = cost.memory.hbm_gbps * 1e9, (cost.memory.split_gbps or cost.memory.hbm_gbps) * 1e9  # split: the layouts' copies
    qkv, q = tok * (hq + 2 * hkv), tok * hq  # bytes of this GPU's q|k|v and q (or out) rows
    rep = 2 * tok * 2 * hkv if f > 1 else 0.0  # K/V head repeat (write hkv * f heads)
    lse = n * hq * 4 * (cp - 1) / cp
    own = 2 * (qkv + q) / cp  # each exchange's own share is copied into place (read + write)
    a2a = (_a2a(cost, per(hq + 2 * hkv), cp, g), _a2a(cost, per(hq) + lse, cp, g))
    fwd = (sum(a2a) + cost.tile_time(tiles, w) + cost.call_time() + (2 * qkv + 2 * q) / split
           + (own + rep) / hbm)  # pack, head-order out
    bwd = (sum(a2a) + cost.tile_time(tiles, w, True) + cost.call_time(True) + (2 * q + 2 * qkv) / split
           + (2 * q + own + rep) / hbm)  # dout to heads, unpack; delta
    return dict(fwd_s=fwd, bwd_s=bwd, imbalance=0.0,
                inter_node_bytes_per_gpu=per(2 * hq + 2 * hkv) * (cp - min(g, cp)) / max(cp - 1, 1))


def allgather(mask, cp, g, cost, work):
    """``baselines.allgather``: K|V packed, gathered (compacted when counts differ), this rank's tiles on all keys;
    backward: dK|dV of every rank's keys (one write), all-to-all back, summed over the cp copies (read cp, write 1)."""
    plan = mcp.plan(mask, cp, guest_rows="none")
    s, per_tok = mask.seqlen_q, work.kv_bytes_per_token
    counts = [plan.num_local(r) for r in range(cp)]
    b = (cp - 1) / cp * s * per_tok
    comm = _a2a(cost, b, cp, g)
    n, hbm = max(counts), cost.memory.hbm_gbps * 1e9
    q_b = n * work.num_heads * work.head_dim * work.dtype_bytes
    fwd_pass = 2 * n * per_tok + (2 * s * per_tok if len(set(counts)) > 1 else 0.0)
    bwd_pass = 2 * s * per_tok + s * per_tok + n * per_tok + 2 * q_b  # cat, sum over copies, delta
    return dict(fwd_s=comm + max(cost.tile_time(r.tiles, work) for r in plan.ranks) + cost.call_time() + fwd_pass / hbm,
                bwd_s=comm + max(cost.tile_time(r.tiles, work, True) for r in plan.ranks) + cost.call_time(True)
                + bwd_pass / hbm,
                imbalance=plan.stats()["imbalance"], inter_node_bytes_per_gpu=b * (cp - min(g, cp)) / max(cp - 1, 1))


STRATS = {OURS: ours, "greedy": functools.partial(ours, hierarchical=False, solver="greedy", guest_rows="none"),
          "ring": ring, "zigzag": functools.partial(ring, layout="zigzag"), "ulysses": ulysses}


def simulate(masks, cps, tokens_per_gpu, cost, work, strategies, verbose=False):
    """A row per (mask, cp, strategy) simulated: the strategy's prediction and TFLOP/s per GPU."""
    out = []
    with Progress(len(masks) * len(cps) * len(strategies), "simulate", verbose=verbose) as bar:
        for name, cp in itertools.product(masks, cps):
            mask = catalog.build(name, tokens_per_gpu * cp)
            flops = work.fwd_flops(mask.area())
            for strat in strategies:
                bar.running(f"{name} cp={cp} {strat}")
                t0 = time.perf_counter()
                res = None if strat in ("ring", "zigzag") and cp > MAX_RING_CP else \
                    STRATS[strat](mask, cp, GPUS_PER_NODE, cost, work)
                if res is not None:
                    out.append(dict(res, mask=name, cp=cp, seqlen=mask.seqlen_q, strategy=strat,
                                    fwd_tflops_per_gpu=flops / cp / res["fwd_s"] / 1e12,
                                    bwd_tflops_per_gpu=2.5 * flops / cp / res["bwd_s"] / 1e12,
                                    sim_seconds=time.perf_counter() - t0))
                bar.step(f"  simulated {name} cp={cp} {strat} in {time.perf_counter() - t0:.1f}s" if res else None)
    return out


def summary_table(rows, strategies):
    """Per mask and cp: each strategy's fwd / bwd TFLOP/s per GPU (imbalance), megatron-cp's solver, stages, bytes."""
    out = []
    for m, cp in sorted({(r["mask"], r["cp"]) for r in rows}):
        by = {x["strategy"]: x for x in rows if x["mask"] == m and x["cp"] == cp}
        cells = [f"{r['fwd_tflops_per_gpu']:.0f} / {r['bwd_tflops_per_gpu']:.0f} (i{r['imbalance']:.2f})"
                 if (r := by.get(s)) else "n/a" for s in strategies]
        o = by.get(OURS)
        cells += ["-"] * 4 if o is None else [o["solver"], o["stages"], f"{o['inter_node_bytes_per_gpu'] / 2**20:.1f}",
                                              f"{o['intra_node_bytes_per_gpu'] / 2**20:.1f}"]
        out.append([m, cp, *cells])
    return markdown_table(["mask", "cp", *(f"{s} fwd / bwd TFLOP/s" for s in strategies), f"{OURS} solver",
                           "stages", "inter-node MB/GPU", "intra-node MB/GPU"], out)


def bench_calls(mask, cp: int, work: Workload):
    """Every kernel call tools/bench_dist.py's implementations make on ``mask`` (dicts: impl, rank, step, tiles, sq, sk,
    heads, kv_heads as the kernel sees them, head_dim). ``megatron_cp-guest``: guest rows over the rank's own keys;
    ``ring``: step i against rank (r - i) % cp's block; ``ulysses``: K/V heads repeated as the baseline does."""
    s = mask.seqlen_q
    base = dict(seqlen=s, cp=cp, heads=work.num_heads, kv_heads=work.num_kv_heads, head_dim=work.head_dim)
    out = []
    for r in mcp.plan(mask, cp).ranks:
        out.append(dict(base, impl=OURS, rank=r.rank, step=0, tiles=r.tiles, sq=r.num_tokens,
                        sk=max(r.buffer_len, 1)))
        if len(r.guest_tiles) and sum(r.guest_recv_counts()):
            out.append(dict(base, impl=f"{OURS}-guest", rank=r.rank, step=0, tiles=r.guest_tiles,
                            sq=sum(r.guest_recv_counts()), sk=r.num_tokens))
    plan = plan_for("ring", mask, cp)
    for r in range(cp):
        for i, t in enumerate(ring_tiles(plan, 1, r)):
            out.append(dict(base, impl="ring", rank=r, step=i, tiles=t, sq=plan.num_local(r),
                            sk=plan.num_local((r - i) % cp), layout=plan.solver))
    if work.num_heads % cp == 0:
        f = kv_head_repeat(work.num_heads, work.num_kv_heads, cp)
        out.append(dict(base, impl="ulysses", rank=0, step=0, tiles=mask_tiles(plan_for("ulysses", mask, cp)),
                        sq=s, sk=s, heads=work.num_heads // cp, kv_heads=work.num_kv_heads * f // cp))
    plan = plan_for("allgather", mask, cp)
    out += [dict(base, impl="allgather", rank=r, step=0, tiles=rank_tiles(plan, r), sq=plan.num_local(r), sk=s)
            for r in range(cp)]
    return [c for c in out if len(c["tiles"])]


def kernel_only(mask, cp, g, cost, work):
    """bench_dist's kernel-only calls (``bench_calls``' megatron-cp ones) on its plan; the slowest rank."""
    calls = [c for c in bench_calls(mask, cp, work) if c["impl"].startswith(OURS)]
    return {f"{p}_s": max(sum(cost.tile_time(c["tiles"], work, p == "bwd") for c in calls if c["rank"] == r)
                          for r in range(cp)) for p in ("fwd", "bwd")}


TARGETS = {"gpu": "GPU time (stream held while the host issues)", "b2b": "GPU time of back-to-back steps",
           "wall": "wall time (isolated, synced step)",
           "kernel": "kernel time of megatron-cp's calls alone (kernel-only, slowest rank)"}


def show_compare(path, by_target):
    """Per target how many rows are within 15% (both phases), then one table of every row."""
    print(f"predicted vs measured: {path}")
    for t, rows in by_target.items():
        n = sum(abs(x["fwd_pred_ms"] / x["fwd_ms"] - 1) <= 0.15 and abs(x["bwd_pred_ms"] / x["bwd_ms"] - 1) <= 0.15
                for x in rows)
        print(f"{n}/{len(rows)} within 15% (fwd and bwd), {TARGETS[t]}")
    print("\n".join(markdown_table(
        ["target", "mask", "impl", "cp", "S", "fwd pred / meas ms (ratio)", "bwd pred / meas ms (ratio)"],
        [[t, x["mask"], x["impl"], x["cp"], x["seqlen"],
          f"{x['fwd_pred_ms']:.2f} / {x['fwd_ms']:.2f} ({x['fwd_pred_ms'] / x['fwd_ms']:.2f})",
          f"{x['bwd_pred_ms']:.2f} / {x['bwd_ms']:.2f} ({x['bwd_pred_ms'] / x['bwd_ms']:.2f})"]
         for t, rows in by_target.items() for x in rows])))


def compare(path, cost, work, g, target="gpu", show=True, bar=None):
    """Predicted vs measured rows of a tools/bench_dist.py JSON (its heads; ``work`` unused) for ``target``, "gpu" and
    "b2b" without the calls' exposed host time. ``show``: print them; ``bar``: a Progress stepped per row."""
    with open(path) as f:
        data = json.load(f)
    if target in ("gpu", "b2b"):
        cost = cost.replace(call={"fwd_us": 0.0, "bwd_us": 0.0})
    fn = {"kernel-only": kernel_only} if target == "kernel" else \
        {OURS: ours, "ring": ring, "ulysses": ulysses, "allgather": allgather}
    key = {"gpu": "_ms", "wall": "_wall_ms", "b2b": "_b2b_ms", "kernel": "_max_ms"}[target]
    w = Workload(data["heads"], data["kv_heads"], data["head_dim"], 2)
    bar, rows = bar or Progress(None, "", enabled=False), []
    for r in data["results"]:
        bar.step()
        r = dict(r, impl=impl_name(r.get("impl", "")))  # records before the registry's spelling: "megatron-cp"
        if r["impl"] not in fn or r.get("fwd_ms") is None or "fwd" + key not in r:
            continue
        bar.running(f"{target} {r['mask']} S={r['seqlen']} {r['impl']}")
        mask = catalog.build(r["mask"], r["seqlen"])
        # the ring's layout as the benchmark plans it (zigzag unless contiguous is as balanced)
        kw = {"layout": plan_for("ring", mask, r["cp"]).solver} if r["impl"] == "ring" else {}
        p = fn[r["impl"]](mask, r["cp"], g, cost, w, **kw)
        if p is not None:
            rows.append(dict(mask=r["mask"], impl=r["impl"], cp=r["cp"], seqlen=r["seqlen"],
                             fwd_pred_ms=p["fwd_s"] * 1e3, fwd_ms=r["fwd" + key], bwd_pred_ms=p["bwd_s"] * 1e3,
                             bwd_ms=r["bwd" + key]))
    if show and (rows or target not in ("b2b", "kernel")):  # benchmark runs before these timings have none
        show_compare(path, {target: rows})
    return rows


def main(argv=None):
    ap = parser(__doc__, "out")
    ap.add_argument("--masks", default="packed", help=f"comma list of {', '.join(catalog.DIST_MASKS)}")
    ap.add_argument("--cps", default=None, help="comma list (default 8,16,..,1024; a dry run: 2,4)")
    ap.add_argument("--tokens-per-gpu", type=int, default=None, help="default 8192 (a dry run: 256)")
    ap.add_argument("--strategies", default=",".join(STRATS))
    ap.add_argument("--cost", default=None, help="CostModel JSON (tools/sim/calibrate.py's cost.json)")
    ap.add_argument("--compare", default=None, help="a tools/bench_dist.py JSON: predicted vs measured")
    args = ap.parse_args(argv)
    path = os.path.join(out_dir(args), f"simulate{args.tag}.json")
    cost = CostModel.load(args.cost) if args.cost else CostModel()
    cost = cost.replace(links={"inter_gbps": INTER_GBPS})  # the NIC is part of the question asked
    if args.compare:
        with Progress(None, "compare", verbose=args.verbose) as bar:
            by_target = {t: compare(args.compare, cost, None, GPUS_PER_NODE, t, show=False, bar=bar) for t in TARGETS}
        by_target = {t: rows for t, rows in by_target.items() if rows or t not in ("b2b", "kernel")}
        write_json(path, run_record("cpu", compare=args.compare, cost_model=cost.flat(), by_target=by_target))
        show_compare(args.compare, by_target)
        return
    cost = cost.replace(call={"fwd_us": 0.0, "bwd_us": 0.0})  # host hidden, as in training
    work, masks, strategies = Workload(), args.masks.split(","), impl_list(args.strategies)
    cps = [int(c) for c in (args.cps or ("2,4" if args.dry_run else "8,16,32,64,128,256,512,1024")).split(",")]
    tpg = args.tokens_per_gpu or (256 if args.dry_run else 8192)
    rows = simulate(masks, cps, tpg, cost, work, strategies, args.verbose)
    write_json(path, run_record("cpu", cost_model=cost.flat(), results=rows))
    print(f"GPU time; cost model: {cost.source}; {tpg} tokens/GPU, {GPUS_PER_NODE} GPUs/node, {INTER_GBPS} GB/s/GPU "
          f"between nodes; Hq={work.num_heads} Hkv={work.num_kv_heads} D={work.head_dim}")
    for m in masks:
        pk = {r["cp"]: r for r in rows if r["mask"] == m and r["strategy"] == OURS}
        if 8 in pk and 64 in pk:
            print(f"{m}: megatron-cp predicted per-GPU fwd at cp 64 / cp 8 = "
                  f"{pk[64]['fwd_tflops_per_gpu'] / pk[8]['fwd_tflops_per_gpu']:.3f}, bwd "
                  f"{pk[64]['bwd_tflops_per_gpu'] / pk[8]['bwd_tflops_per_gpu']:.3f} (goal >= 0.90)")
    print("\n".join(summary_table(rows, strategies)))


if __name__ == "__main__":
    main()
