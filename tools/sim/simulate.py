"""Research instrument (the cost model's simulator; not needed to use megatron-cp).

Predicts context-parallel attention time, bytes per link and imbalance from plans and a cost model.

For cp = 8 .. 1024 GPUs (``--gpus-per-node`` 8, ``--inter-gbps`` 50 GB/s = 400 Gb/s per GPU between
nodes) and a fixed number of tokens per GPU, compares:

- ``megatron-cp``: our planner (node-first placement on multi-node topologies), hierarchical routes,
  K/V stages overlapped with compute or one exchange (chosen by the cost model as the runtime does),
  kernel times from the cost model on each rank's real tiles (dense pieces on cuDNN, row efficiency);
- ``greedy``: area-balanced greedy dispatch with flat all-to-all routes and one remote stage
  (a MagiAttention-like dispatch: balance by area, every needed K/V row sent to every GPU);
- ``ring``: contiguous layout, K/V ring as ``baselines.ring`` runs it over a default-priority NCCL
  stream: a forward step takes its slowest GPU's kernel and then the next block's transfer (NCCL's
  kernel gets no multiprocessor before the step's kernels free them; profiled), a backward step
  max(kernel and passes, the previous step's fp32 sums in flight), plus the last transfer home;
- ``zigzag``: the same ring over the zigzag layout (2*cp chunks);
- ``ulysses``: all-to-all over heads (cp <= query heads), full-sequence attention per head group.

The kernel rates (per row class, dense pieces), memory-pass and link bandwidths come from ``--cost``
(``tools/sim/calibrate.py`` output; defaults otherwise). Predictions are GPU times of a step with the host
ahead, as in training (``--compare`` checks them against the benchmark's GPU time, and adds each call's
calibrated exposed host time to check wall times). Predicted per-GPU TFLOP/s counts mask-area FLOPs
(4 * area * Hq * D forward, 2.5x backward) divided by cp and by the predicted time.

    python tools/sim/simulate.py                               # packed docs, cp 8..1024, 8k tokens/GPU
    python tools/sim/simulate.py --masks packed,causal --cps 8,16,32,64 --json out.json
    python tools/sim/simulate.py --compare out/bench_4x....json --cost cost.json   # predicted vs measured

While it runs a progress bar on stderr names the case being simulated or compared (redrawn at most every
30 s where stderr is not a terminal: tools/common.py); each case's time goes to stderr with --verbose.
It ends with one table on stdout: per mask and cp, each strategy's predicted per-GPU TFLOP/s and
megatron-cp's solver, stages and bytes; with --compare, per target and benchmark row, predicted vs
measured.

It reads the library through public names and these documented internals of the runtime's cost model:
``megatron_cp.runtime.cost`` (``guest_predict``, ``guest_traffic``) and the plan's fields (``Plan.traps``,
``RankPlan.traps`` / ``recv_runs`` / ``send_runs``); mask geometry through ``masks.geometry.traps_to_tiles``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import megatron_cp as mcp
from megatron_cp.baselines import plan_for
from megatron_cp.masks import catalog
from megatron_cp.masks.geometry import traps_to_tiles
from megatron_cp.planner import Workload
from megatron_cp.runtime import CostModel
from megatron_cp.runtime.cost import guest_predict, guest_traffic

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/: progress bar, table
from common import Progress, markdown_table  # noqa: E402


# ------------------------------------------------------------------------------- mask geometry


class RowIntervals:
    """Every (row, [lo, hi)) interval of a mask, sorted by row: areas of row-run x key-run blocks."""

    def __init__(self, mask):
        t = mask.traps
        n = t[:, 1] - t[:, 0]
        rows = np.concatenate([np.arange(a, b) for a, b in t[:, :2]]) if len(t) else np.zeros(0, np.int64)
        ti = np.repeat(np.arange(len(t)), n)
        lo = t[ti, 2] + t[ti, 3] * rows
        hi = t[ti, 4] + t[ti, 5] * rows
        o = np.argsort(rows, kind="stable")
        self.rows, self.lo, self.hi = rows[o], lo[o], hi[o]

    def area(self, q_runs, k_runs) -> int:
        tot = 0
        for a, b in np.asarray(q_runs).reshape(-1, 2):
            i, j = np.searchsorted(self.rows, [a, b])
            lo, hi = self.lo[i:j], self.hi[i:j]
            for c, d in np.asarray(k_runs).reshape(-1, 2):
                tot += int(np.clip(np.minimum(hi, d) - np.maximum(lo, c), 0, None).sum())
        return tot


def _kernel_time(cost: CostModel, work: Workload, area: float, rows: float, backward=False, tiles=1) -> float:
    """Cost-model kernel time of ``area`` cells spread over ``rows`` rows in ``tiles`` tiles."""
    if area <= 0:
        return 0.0
    peak = (cost.bwd_tflops / 2.5 if backward else cost.fwd_tflops) * 1e12
    keys = area / max(rows, 1)
    eff = keys / (keys + cost.half_keys)
    return cost.launch_us * 1e-6 + tiles * cost.tile_us * 1e-6 + work.fwd_flops(area) / (peak * eff)


def _union_len(runs) -> int:
    """Length of the union of half-open runs (int [n, 2])."""
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    if not len(r):
        return 0
    r = r[np.argsort(r[:, 0], kind="stable")]
    tot, lo, hi = 0, int(r[0, 0]), int(r[0, 1])
    for a, b in r[1:].tolist():
        if a > hi:
            tot, lo = tot + hi - lo, a
        hi = max(hi, b)
    return tot + hi - lo


def _covered_rows(tiles) -> int:
    """Query rows that a tile list touches (the union of its row ranges)."""
    return _union_len(np.asarray(tiles).reshape(-1, 5)[:, :2])


def _pipeline(local_c, remote_c, comm, n, latency):
    """Forward time: own-key compute first; n remote stages, stage i+1's cast in flight during i."""
    c = [comm / n + latency] * n
    k = [remote_c / n] * n
    end, comm_end = local_c, c[0]
    for s in range(n):
        start = max(end, comm_end)
        if s + 1 < n:
            comm_end = max(start, comm_end) + c[s + 1]
        end = start + k[s]
    return end


# ------------------------------------------------------------------------------------ strategies


def ours(mask, cp, g, cost, work, hierarchical=True, solver=None, guest_rows="auto", plan=None):
    """megatron-cp's predicted step on ``mask`` over ``cp`` GPUs (``plan``: made already, on this topology)."""
    nodes = max(1, cp // g)
    topo = mcp.Topology(nodes, min(g, cp), intra_node_gbps=cost.intra_gbps, inter_node_gbps=cost.inter_gbps)
    if solver is None:
        solver = "hierarchical" if nodes > 1 else "auto"
    if plan is None:
        plan = mcp.plan(mask, cp, topology=topo, solver=solver, guest_rows=guest_rows)
    per_tok = work.kv_bytes_per_token
    gpn = topo.gpus_per_node
    node_inter = np.zeros(nodes)
    if nodes > 1:
        seen = [[] for _ in range(nodes)]
        for r in plan.ranks:
            for src, runs in enumerate(r.recv_runs):
                if src // gpn != r.rank // gpn and len(runs):
                    seen[r.rank // gpn].append(runs)
        for n in range(nodes):  # each K/V row a node needs from other nodes crosses into it once
            if seen[n]:
                node_inter[n] = _union_len(np.concatenate(seen[n]))
    fwd, inter_b, intra_b = [], [], []
    for r in plan.ranks:
        traps = r.traps  # the rank's cells: rows local, keys global
        local = traps_to_tiles(traps, None, r.segments)
        runs = [x for x in r.recv_runs if len(x)]
        remote = traps_to_tiles(traps, None, np.sort(np.concatenate(runs), axis=0)) if runs else local[:0]
        rows = r.num_tokens
        # the runtime's kernel model (dense pieces on cuDNN, row efficiency) on the rank's real tiles;
        # remote tiles once per split (stage pieces shrink, which can drop them off the dense path)
        kern = {"own": (cost.tile_time(local, work, accumulate=True), cost.tile_time(local, work, True)),
                "all": (cost.tile_time(r.tiles, work), cost.tile_time(r.tiles, work, True))}
        for n in (1, 2, 4, 8):
            kern[n] = (cost.tile_time(remote, work, key_split=n), cost.tile_time(remote, work, True, key_split=n))
        ov = (cost.stage_overhead(rows, work), cost.stage_overhead(rows, work, True))
        n_send = sum(int((x[:, 1] - x[:, 0]).sum()) for x in r.send_runs if len(x))
        # the exchange's row gathers / placements (single path: plus the delta pass) and the call's fixed time
        px = (cost.exchange_passes(rows, r.num_remote, n_send, work) + cost.call_time(),
              cost.exchange_passes(rows, r.num_remote, n_send, work, True) + cost.call_time(True),
              cost.exchange_passes(rows, r.num_remote, n_send, work, True, False) + cost.call_time(True))
        same = sum(int((runs[:, 1] - runs[:, 0]).sum()) for src, runs in enumerate(r.recv_runs) if src // gpn == r.rank // gpn)
        far = r.num_remote - same
        if hierarchical and nodes > 1:
            inter = node_inter[r.rank // gpn] / gpn * per_tok  # spread over the node's rail-aligned GPUs
            intra = (same + far) * per_tok
        else:
            inter, intra = far * per_tok, same * per_tok
        comm = max(intra / (cost.intra_gbps * 1e9), inter / (cost.inter_gbps * 1e9))
        inter_b.append(inter)
        intra_b.append(intra)
        fwd.append((kern, ov, comm, px))
    # the collectives synchronise: every stage's transfer takes the busiest GPU's time
    comm = max(c for _, _, c, _ in fwd)
    best = None
    lat = cost.latency_us * 1e-6 * (2 if hierarchical and nodes > 1 else 1)
    # n = 0: the single exchange (flat; the runtime offers it on one node only): comm, then one call
    cands = (0, 1, 2, 4, 8) if nodes == 1 else (1, 2, 4, 8)
    for n in cands:
        if n == 0:
            c0 = comm + lat if comm > 0 else 0.0
            tf = max(k["all"][0] + p[0] for k, _, _, p in fwd) + c0
            tb = max(k["all"][1] + p[1] for k, _, _, p in fwd) + c0
        else:
            tf = max(_pipeline(k["own"][0] + o[0] + p[0], n * (k[n][0] + o[0]), comm, n, lat) for k, o, _, p in fwd)
            tb = max(_pipeline(k["own"][1] + o[1] + p[2], n * (k[n][1] + o[1]), comm, n, lat) for k, o, _, p in fwd)
        if best is None or tf + tb < best[0] + best[1]:
            best = (tf, tb, n)
    st = plan.stats()
    gt = guest_predict(plan, cost, work)  # guest rows: their exchanges and kernel call after the main path
    if plan.has_guests:  # and their forward bytes (q out, partials back: flat all-to-alls) received per GPU
        gb = sum(m for name, m in guest_traffic(plan, work) if name in ("guest_q", "guest_out"))
        np.fill_diagonal(gb, 0.0)
        same = (np.arange(cp)[:, None] // gpn) == (np.arange(cp)[None, :] // gpn)
        intra_b = [b + x for b, x in zip(intra_b, np.where(same, gb, 0).sum(0))]
        inter_b = [b + x for b, x in zip(inter_b, np.where(~same, gb, 0).sum(0))]
    return dict(fwd_s=best[0] + gt["fwd_s"], bwd_s=best[1] + gt["bwd_s"], stages=best[2], imbalance=st["imbalance"],
                solver=plan.solver + ("+guests" if plan.has_guests else ""),
                inter_node_bytes_per_gpu=float(max(inter_b)), intra_node_bytes_per_gpu=float(max(intra_b)))


def ring(mask, cp, g, cost, work, layout="contiguous", ri=None):
    plan = mcp.plan(mask, cp, solver=layout, guest_rows="none")
    ri = ri or RowIntervals(mask)
    per_tok = work.kv_bytes_per_token
    nodes = max(1, cp // g)
    bw = cost.inter_gbps * 1e9  # one neighbour's send|receive across nodes
    segs = [r.segments for r in plan.ranks]
    tf = tb = 0.0
    step_max = []
    areas = np.zeros((cp, cp))
    for r in range(cp):
        for src in range(cp):
            areas[r, src] = ri.area(segs[r], segs[src])
    rows = np.array([p.num_tokens for p in plan.ranks], dtype=float)
    exact = cp <= 16  # the kernel model on each step's real tiles (cp^2 clips); areas beyond that
    traps = mask.traps if exact else None
    for i in range(cp):
        src = (np.arange(cp) - i) % cp
        a = areas[np.arange(cp), src]
        if exact:
            step = [traps_to_tiles(traps, segs[r], segs[src[r]]) for r in range(cp)]
            # the accumulating Triton forward reads and writes the fp32 running output of the rows it
            # visits (dense pieces are merged into it by rows, which tile_time counts)
            kf = max(cost.tile_time(t, work, accumulate=True) + cost.stage_overhead(_covered_rows(cost.rest_tiles(t)), work)
                     if len(t) else 0.0 for t in step)
            kb = max(cost.tile_time(t, work, True) if len(t) else 0.0 for t in step)
        else:
            kf = max(_kernel_time(cost, work, x, n) + (cost.stage_overhead(n, work) if x > 0 else 0.0)
                     for x, n in zip(a, rows))
            kb = max(_kernel_time(cost, work, x, n, True) for x, n in zip(a, rows))
        blk = rows.max() * per_tok
        # one neighbour's send|receive: bf16 K|V forward, the block's fp32 dK|dV sums backward (K/V kept
        # from forward); inside a node at the calibrated point-to-point times of those sizes
        hop = (lambda b: b / bw + cost.latency_us * 1e-6) if nodes > 1 else cost.p2p_time  # noqa: E731
        cf = hop(blk) if i < cp - 1 else 0.0
        cb = hop(2 * blk)
        # each step streams the running output (fwd) and the gradient sums (bwd), like a staged stage
        # backward also moves each step's dK|dV: concatenated (2+2 bytes an element), made float32 (2+4)
        # and added to the arriving sums (4+4+4): 22 bytes per K|V element
        kv_pass = rows.max() * 2 * work.num_kv_heads * work.head_dim * 22 / (cost.hbm_gbps * 1e9)
        # forward: the next block's transfer, issued before the step's kernel on NCCL's (default-priority)
        # stream, gets no multiprocessor while a kernel fills them all, on either end: it completes after
        # the step's slowest kernel (profiled on 4 x H200, benchmarks/dist/README.md, 00:13), so the
        # step takes kernel + transfer. The kernel accumulates the running output itself
        # (forward_accumulate: fp32 out read and written on the rows it visits, 8 bytes an element); a
        # step where no rank has tiles runs no kernel.
        tf += kf + cf
        # backward: step i's sums leave after its kernel, their transfer issued before step i + 1's kernel
        # (NCCL's kernel starts first and overlaps it); the last step's transfer brings the sums home. A
        # step with tiles also streams the gradient sums and the block's dK|dV passes
        busy = kb + cost.stage_overhead(rows.max(), work, True) + kv_pass if kb > 0 else 0.0
        tb += max(busy, cb if i > 0 else 0.0)
        step_max.append(float(a.max()))
    if cp > 1:
        tb += cb
    area = areas.sum(1)
    imb = float(area.max() / area.mean() - 1) if area.mean() > 0 else 0.0
    return dict(fwd_s=tf + cost.call_time(), bwd_s=tb + cost.call_time(True), imbalance=imb, inter_node_bytes_per_gpu=float((cp - 1) * rows.max() * per_tok) if nodes > 1 else 0.0)


def ulysses(mask, cp, g, cost, work):
    """Ulysses as ``baselines.ulysses`` runs it: q, k and v laid out for sending (one write) and sent in
    one exchange, the whole mask on Hq/cp heads, out|lse back in one exchange and put in head order
    (one write); backward the mirror image, plus the kernel's delta pass over out and dout."""
    hq = work.num_heads
    if cp > hq or hq % cp:
        return None
    s = mask.seqlen_q
    f = 1
    while (work.num_kv_heads * f) % cp:
        f += 1
    hkv = work.num_kv_heads * f
    w = Workload(hq // cp, hkv // cp, work.head_dim, work.dtype_bytes)
    tiles = traps_to_tiles(mask.traps, None, [[0, s]])  # the whole mask as one tile list
    kf = cost.tile_time(tiles, w)
    kb = cost.tile_time(tiles, w, True)
    n = s / cp
    tok = n * work.head_dim * work.dtype_bytes  # bytes of one head of this GPU's rows
    nodes = max(1, cp // g)
    per = lambda heads: tok * heads * (cp - 1) / cp  # noqa: E731 bytes each GPU sends
    frac_inter = (cp - min(g, cp)) / max(cp - 1, 1)

    def a2a(b):
        inter = b * frac_inter
        return cost.latency_us * 1e-6 + max((b - inter) / (cost.intra_gbps * 1e9), inter / (cost.inter_gbps * 1e9) if nodes > 1 else 0)

    hbm = cost.hbm_gbps * 1e9
    split = (cost.split_gbps or cost.hbm_gbps) * 1e9  # head-splitting copies: the layouts
    qkv, q = tok * (hq + 2 * hkv), tok * hq  # bytes of this GPU's q|k|v and q (or out) rows
    rep = 2 * tok * 2 * hkv if f > 1 else 0.0  # K/V head repeat (write hkv * f heads)
    lse = n * hq * 4 * (cp - 1) / cp
    own = 2 * (qkv + q) / cp  # each exchange's own share is copied into place (read + write)
    fwd = (a2a(per(hq + 2 * hkv)) + kf + a2a(per(hq) + lse) + cost.call_time()
           + (2 * qkv + 2 * q) / split + (own + rep) / hbm)  # pack, head-order out
    bwd = (a2a(per(hq) + lse) + kb + a2a(per(hq + 2 * hkv)) + cost.call_time(True)
           + (2 * q + 2 * qkv) / split + (2 * q + own + rep) / hbm)  # dout to heads, unpack; delta
    return dict(fwd_s=fwd, bwd_s=bwd, imbalance=0.0, inter_node_bytes_per_gpu=per(2 * hq + 2 * hkv) * frac_inter)


def greedy(mask, cp, g, cost, work):
    r = ours(mask, cp, g, cost, work, hierarchical=False, solver="greedy", guest_rows="none")
    # one remote stage, flat routes (recomputed with n = 1 only)
    return r


def allgather(mask, cp, g, cost, work):
    """All-gather K|V as ``baselines.allgather`` runs it: K|V packed (one write), gathered into one buffer
    (compacted when ranks hold different counts), this rank's tiles on the keys in rank order; backward:
    dK|dV of every rank's keys (one write), all-to-all back, summed over the cp copies (read cp, write 1)."""
    plan = mcp.plan(mask, cp, guest_rows="none")
    s = mask.seqlen_q
    nodes = max(1, cp // g)
    per_tok = work.kv_bytes_per_token
    counts = [plan.num_local(r) for r in range(cp)]
    b = (cp - 1) / cp * s * per_tok
    frac_inter = (cp - min(g, cp)) / max(cp - 1, 1)
    comm = cost.latency_us * 1e-6 + max(b * (1 - frac_inter) / (cost.intra_gbps * 1e9),
                                        b * frac_inter / (cost.inter_gbps * 1e9) if nodes > 1 else 0)
    kf = max(cost.tile_time(r.tiles, work) for r in plan.ranks)
    kb = max(cost.tile_time(r.tiles, work, True) for r in plan.ranks)
    hbm = cost.hbm_gbps * 1e9
    n = max(counts)
    q_b = n * work.num_heads * work.head_dim * work.dtype_bytes
    fwd_pass = 2 * n * per_tok + (2 * s * per_tok if len(set(counts)) > 1 else 0.0)
    bwd_pass = 2 * s * per_tok + s * per_tok + n * per_tok + 2 * q_b  # cat, sum over copies, delta
    return dict(fwd_s=comm + kf + cost.call_time() + fwd_pass / hbm,
                bwd_s=comm + kb + cost.call_time(True) + bwd_pass / hbm,
                imbalance=plan.stats()["imbalance"],
                inter_node_bytes_per_gpu=b * frac_inter)


STRATS = {"megatron-cp": ours, "greedy": greedy, "ring": ring,
          "zigzag": lambda m, cp, g, c, w, ri=None: ring(m, cp, g, c, w, "zigzag", ri), "ulysses": ulysses}


def simulate(masks, cps, tokens_per_gpu, g, cost, work, max_ring_cp, strategies, verbose=False):
    out = []
    bar = Progress(len(masks) * len(cps) * len(strategies), "simulate", verbose=verbose)
    for name in masks:
        for cp in cps:
            s = tokens_per_gpu * cp
            mask = catalog.build(name, s)
            flops = work.fwd_flops(mask.area())
            ri = None
            for strat in strategies:
                t0 = time.perf_counter()
                bar.running(f"{name} cp={cp} {strat}")
                if strat in ("ring", "zigzag"):
                    if cp > max_ring_cp:
                        bar.step()
                        continue
                    ri = ri or RowIntervals(mask)
                    res = STRATS[strat](mask, cp, g, cost, work, ri=ri)
                else:
                    res = STRATS[strat](mask, cp, g, cost, work)
                if res is None:
                    bar.step()
                    continue
                bar.step(f"  simulated {name} cp={cp} {strat} in {time.perf_counter() - t0:.1f}s")
                res.update(mask=name, cp=cp, seqlen=s, strategy=strat,
                           fwd_tflops_per_gpu=flops / cp / res["fwd_s"] / 1e12,
                           bwd_tflops_per_gpu=2.5 * flops / cp / res["bwd_s"] / 1e12,
                           sim_seconds=time.perf_counter() - t0)
                out.append(res)
    bar.close()
    return out


def summary_table(rows, strategies):
    """The closing table (lines): per mask and cp, each strategy's predicted fwd / bwd TFLOP/s per GPU
    (imbalance; n/a: not simulated), then megatron-cp's solver, stages and bytes per GPU."""
    out = []
    for m, cp in sorted({(r["mask"], r["cp"]) for r in rows}):
        cells = []
        for s in strategies:
            r = next((x for x in rows if x["mask"] == m and x["cp"] == cp and x["strategy"] == s), None)
            cells.append("n/a" if r is None else
                         f"{r['fwd_tflops_per_gpu']:.0f} / {r['bwd_tflops_per_gpu']:.0f} (i{r['imbalance']:.2f})")
        ours = next((x for x in rows if x["mask"] == m and x["cp"] == cp and x["strategy"] == "megatron-cp"), None)
        cells += (["-"] * 4 if ours is None else
                  [ours["solver"], ours["stages"], f"{ours['inter_node_bytes_per_gpu'] / 2**20:.1f}",
                   f"{ours['intra_node_bytes_per_gpu'] / 2**20:.1f}"])
        out.append([m, cp, *cells])
    return markdown_table(["mask", "cp", *(f"{s} fwd / bwd TFLOP/s" for s in strategies), "megatron-cp solver",
                           "stages", "inter-node MB/GPU", "intra-node MB/GPU"], out)


def _kernel_only(mask, cp, cost, work):
    """(fwd s, bwd s) of bench_dist's kernel-only calls on the benchmark's plan (``mcp.plan(mask, cp)``):
    each rank's tiles over its K/V buffer, plus its guest tiles' call; the slowest rank."""
    plan = mcp.plan(mask, cp)
    f = b = 0.0
    for rp in plan.ranks:
        calls = [rp.tiles] + ([rp.guest_tiles] if len(rp.guest_tiles) and sum(rp.guest_recv_counts()) else [])
        f = max(f, sum(cost.tile_time(t, work) for t in calls))
        b = max(b, sum(cost.tile_time(t, work, True) for t in calls))
    return f, b


COMPARE_WHAT = {"gpu": "GPU time (stream held while the host issues)", "wall": "wall time (isolated, synced step)",
                "b2b": "GPU time of back-to-back steps",
                "kernel": "kernel time of megatron-cp's calls alone (kernel-only, slowest rank)"}


def within_line(rows, target):
    """How many rows' predictions are within 15% of the measurement, both phases."""
    n = sum(abs(x["fwd_pred_ms"] / x["fwd_ms"] - 1) <= 0.15 and abs(x["bwd_pred_ms"] / x["bwd_ms"] - 1) <= 0.15
            for x in rows)
    return f"{n}/{len(rows)} within 15% (fwd and bwd), {COMPARE_WHAT[target]}"


def compare_table(by_target):
    """The closing table (lines) of --compare: per target and benchmark row, predicted / measured ms."""
    return markdown_table(
        ["target", "mask", "impl", "cp", "S", "fwd pred / meas ms (ratio)", "bwd pred / meas ms (ratio)"],
        [[t, x["mask"], x["impl"], x["cp"], x["seqlen"],
          f"{x['fwd_pred_ms']:.2f} / {x['fwd_ms']:.2f} ({x['fwd_pred_ms'] / x['fwd_ms']:.2f})",
          f"{x['bwd_pred_ms']:.2f} / {x['bwd_ms']:.2f} ({x['bwd_pred_ms'] / x['bwd_ms']:.2f})"]
         for t, rows in by_target.items() for x in rows])


def compare(path, cost, work, g, target="gpu", show=True, bar=None):
    """Predicted vs measured times of a tools/bench_dist.py JSON (per mask, strategy and cp).

    ``target`` "gpu": the benchmark's GPU time (its headline: the step issued while the stream is held,
    as in training, where the host runs ahead), predicted without the calls' exposed host time
    (``call_fwd_us`` / ``call_bwd_us`` = 0); "b2b": the GPU time of steps run back to back (runs from
    2026-11-22 01:40 on; kernels at sustained clocks, as a training step runs them), predicted the same
    way; "wall": the wall time of an isolated, synced step, predicted with the host time; "kernel": the
    benchmark's kernel-only rows (megatron-cp's per-rank calls alone, held stream, slowest rank) against
    ``tile_time`` of the same calls: the kernel model without communication or passes. ``show``: prints
    how many are within 15% and the table; ``bar``: a Progress stepped per benchmark row."""
    with open(path) as f:
        data = json.load(f)
    if target in ("gpu", "b2b"):
        cost = CostModel(**{**cost.__dict__, "call_fwd_us": 0.0, "call_bwd_us": 0.0})
    rows = []
    fn = {"megatron-cp": ours, "ring": ring, "ulysses": ulysses, "allgather": allgather}
    if target == "kernel":
        fn = {"kernel-only": _kernel_only}
    w = Workload(data["heads"], data["kv_heads"], data["head_dim"], 2)
    bar = bar or Progress(None, "", enabled=False)
    for r in data["results"]:
        bar.step()
        if r.get("impl") not in fn or r.get("fwd_ms") is None:
            continue
        bar.running(f"{target} {r['mask']} S={r['seqlen']} {r['impl']}")
        if target == "kernel":
            if "fwd_max_ms" not in r:
                continue
            pf, pb = _kernel_only(catalog.build(r["mask"], r["seqlen"]), r["cp"], cost, w)
            rows.append(dict(mask=r["mask"], impl=r["impl"], cp=r["cp"], seqlen=r["seqlen"], fwd_pred_ms=pf * 1e3,
                             fwd_ms=r["fwd_max_ms"], bwd_pred_ms=pb * 1e3, bwd_ms=r["bwd_max_ms"]))
            continue
        key = {"gpu": "_ms", "wall": "_wall_ms", "b2b": "_b2b_ms"}[target]
        if "fwd" + key not in r:
            continue
        mask = catalog.build(r["mask"], r["seqlen"])
        # the ring's layout as the benchmark plans it (baselines.plan_for: zigzag unless contiguous is as
        # balanced)
        kw = {"layout": plan_for("ring", mask, r["cp"]).solver} if r["impl"] == "ring" else {}
        p = fn[r["impl"]](mask, r["cp"], g, cost, w, **kw)
        if p is None:
            continue
        rows.append(dict(mask=r["mask"], impl=r["impl"], cp=r["cp"], seqlen=r["seqlen"],
                         fwd_pred_ms=p["fwd_s"] * 1e3, fwd_ms=r["fwd" + key],
                         bwd_pred_ms=p["bwd_s"] * 1e3, bwd_ms=r["bwd" + key]))
    if show and (rows or target not in ("b2b", "kernel")):  # benchmark runs before these timings have none
        print(f"predicted vs measured: {path}")
        print(within_line(rows, target))
        print("\n".join(compare_table({target: rows})))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--masks", default="packed", help=f"comma list of {', '.join(catalog.DIST_MASKS)}")
    ap.add_argument("--cps", default="8,16,32,64,128,256,512,1024")
    ap.add_argument("--tokens-per-gpu", type=int, default=8192)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--inter-gbps", type=float, default=50.0, help="GB/s per GPU between nodes (400 Gb/s = 50)")
    ap.add_argument("--cost", default=None, help="CostModel JSON from tools/sim/calibrate.py")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--strategies", default=",".join(STRATS))
    ap.add_argument("--max-ring-cp", type=int, default=64, help="ring/zigzag need cp^2 block areas; skip above")
    ap.add_argument("--json", default=None, help="write results here (with --compare: the rows compared, per target)")
    ap.add_argument("--verbose", action="store_true", help="each simulated case's time on stderr")
    ap.add_argument("--compare", default=None, help="bench_dist.py JSON: print predicted vs measured")
    ap.add_argument("--target", default="all", choices=["gpu", "b2b", "wall", "kernel", "all"],
                    help="predict GPU time (host ahead, as in training) or wall time of isolated steps (plus "
                         "each call's calibrated exposed host time); --compare checks the benchmark's GPU time, "
                         "its back-to-back steps' GPU time (when measured), wall time and the kernel-only calls' "
                         "time ('kernel': the kernel model alone) by default; the scaling tables predict GPU time "
                         "unless 'wall'")
    args = ap.parse_args(argv)
    cost = CostModel.load(args.cost) if args.cost else CostModel()
    # the NIC figure is part of the question asked, the rest comes from calibration
    cost = CostModel(**{**cost.__dict__, "inter_gbps": args.inter_gbps})
    work = Workload(args.heads, args.kv_heads, args.head_dim, 2)
    if args.compare:
        targets = ("gpu", "b2b", "wall", "kernel") if args.target == "all" else (args.target,)
        with open(args.compare) as f:
            n = len(json.load(f)["results"])
        with Progress(n * len(targets), "compare", verbose=args.verbose) as bar:
            by_target = {t: compare(args.compare, cost, work, args.gpus_per_node, t, show=False, bar=bar)
                         for t in targets}
        # benchmark runs before the back-to-back and kernel-only timings have no rows for them
        by_target = {t: rows for t, rows in by_target.items() if rows or t not in ("b2b", "kernel")}
        if args.json:  # the prediction beside the measurement, per target and benchmark row
            with open(args.json, "w") as f:
                json.dump({"compare": args.compare, "cost_model": cost.__dict__, "by_target": by_target}, f, indent=1)
        print(f"predicted vs measured: {args.compare}")
        for t, rows in by_target.items():
            print(within_line(rows, t))
        print("\n".join(compare_table(by_target)))
        return
    if args.target != "wall":  # GPU time: the calls' exposed host time is hidden, as in training
        cost = CostModel(**{**cost.__dict__, "call_fwd_us": 0.0, "call_bwd_us": 0.0})
    strategies = args.strategies.split(",")
    rows = simulate(args.masks.split(","), [int(c) for c in args.cps.split(",")], args.tokens_per_gpu,
                    args.gpus_per_node, cost, work, args.max_ring_cp, strategies, args.verbose)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "verbose"}, "cost_model": cost.__dict__, "results": rows}, f, indent=1)
    print(f"{'wall' if args.target == 'wall' else 'GPU'} time; cost model: {cost.source}; "
          f"{args.tokens_per_gpu} tokens/GPU, {args.gpus_per_node} GPUs/node, "
          f"{args.inter_gbps} GB/s/GPU between nodes; Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim}")
    for m in args.masks.split(","):
        pk = {r["cp"]: r for r in rows if r["mask"] == m and r["strategy"] == "megatron-cp"}
        if 8 in pk and 64 in pk:
            print(f"{m}: megatron-cp predicted per-GPU fwd at cp 64 / cp 8 = "
                  f"{pk[64]['fwd_tflops_per_gpu'] / pk[8]['fwd_tflops_per_gpu']:.3f}, bwd "
                  f"{pk[64]['bwd_tflops_per_gpu'] / pk[8]['bwd_tflops_per_gpu']:.3f} (goal >= 0.90)")
    print("\n".join(summary_table(rows, strategies)))


if __name__ == "__main__":
    main()
