"""Research instrument's model of whole training steps over DP x CP (tools/sim/train_step.py runs it; not needed to use
megatron-cp).

A step is every rank's micro-batches, each ``layers`` x (forward, recomputed forward, backward) layer passes. A
pass costs the rank GPU time (the linear layers' ``rest`` per token, FA4 attention on the rank's tiles, the K/V
exchange) and host time (Megatron's layer and megatron-cp's call); the host runs ahead of its GPU, a pass ends when
both are done, and ranks whose plan exchanges K/V wait for each other at every pass. Every constant is read from a
committed record (``calibrate``; docs/cost-model.md "Whole training steps over DP x CP" cites each):

- FA4 kernels: rates fitted to one H100's kernel benchmark (``kernel_fit``, benchmarks/2026-11-24_1xH100_fa4);
- host per attention call (forward, backward node, a new plan's first call; cp 4 and 8): one rank alone on one H200
  (benchmarks/2026-11-29_1xH200_host-path, sitting 1);
- Megatron's own host per layer: the host-bound step of the 300M model at CP 4, 8k tokens per GPU, from the same
  4 x H100 session as the measured cases (throughput_packed.json runs[12]; not one of the predicted cases);
- the linear layers' GPU time per token and the step's gradient reduction: each model's DP 4 profiled step;
- the exchange: the cost model's 4 x H200 link calibration.

Layouts: ``fixed`` DP dp x CP cp (each DP group's sequences one micro-batch each over its CP ranks); ``dp_balanced``
(Megatron's ``dp_balanced``: whole document pieces re-packed over the DP groups by attention work, then as fixed);
``over_dp`` at a Megatron configuration cp (micro-batch i of every DP group planned together over all ranks) choosing
for each global micro-batch ``global`` (one plan over every rank) or ``dp_whole`` (each DP group's micro-batch
on its own CP ranks: DP's layout), per global batch the assignment whose slowest rank is predicted to end first
(every micro-batch one way, or each its better one in turn), so never behind the fixed layout at its
configuration.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

import numpy as np

import megatron_cp as mcp
from megatron_cp.planner import Workload
from megatron_cp.runtime import CostModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/sim
from kernel_fit import Kernels, fit_kernels  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")
THROUGHPUT = os.path.join(BENCH, "2026-11-27_4xH100_train-throughput", "throughput_packed.json")
SEED = 1234  # the recipes' Train.seed: the measured runs' documents are drawn again exactly


@dataclass(frozen=True)
class Model:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int = 128


MODELS = {"300m": Model(26, 8, 2), "12l": Model(12, 16, 4)}  # recipes' LLAMA_300M; LLAMA_1_5B at 12 layers


@dataclass(frozen=True)
class Setting:
    """``G`` sequences of ``L`` tokens a step on ``world`` GPUs; documents log-normal (lo, hi, median, sigma) cut
    where the stream is cut into sequences, as the recipes' loader does; a rank holds at most ``budget`` tokens a
    micro-batch (memory); ``window``: (W, pattern) windowed layers; ``steps``: which steps of the stream."""

    model: str
    world: int
    L: int
    G: int
    docs: tuple
    budget: int
    window: tuple | None = None
    steps: tuple = (3, 4, 5)


# the measured settings (benchmarks/2026-11-27_4xH100_train-throughput, runs[5]-[11]; timed steps 3-5 of 6)
MEASURED = {
    "a": Setting("12l", 4, 16384, 8, (128, 8192, 621, 1.0), 16384),
    "b": Setting("300m", 4, 131072, 4, (1024, 131072, 4096, 1.5), 131072),
    "c": Setting("300m", 4, 131072, 4, (1024, 131072, 4096, 1.5), 131072, window=(4096, (1, 0, 0, 0))),
}
# ------------------------------------------------------------------------------------------------ calibration

@dataclass(frozen=True)
class Calibration:
    kernels: Kernels
    attn_host: dict  # {"fwd" | "bwd" | "first": (seconds at one rank, + seconds per further rank of the call)}
    layer_host_s: float  # Megatron's own host time of one layer of one micro-batch (forward, recompute, backward)
    rest_s: dict  # model -> GPU seconds of the linear layers (and the rest) per token and layer
    fixed_s: dict  # model -> the step's gradient reduction (NCCL) seconds
    link: CostModel  # intra-node bandwidth and latency per collective
    sources: dict


def _host_path(path: str) -> dict:
    """Host seconds per attention call at one rank + per further rank, from the packed 8k 32:8 rows at cp 4 and cp
    8 of the host-path record (a line through the two: the only spans measured)."""
    with open(path) as f:
        rows = [r for r in json.load(f)["sitting_1"]["runs"]["packed_8k"]["rows"] if r["heads"] == "32:8"]
    by = {r["cp"]: r for r in rows}
    out = {}
    for name, key in (("fwd", "host_ms_per_call"), ("bwd", "host_ms_per_call_bwd"), ("first", "first_call_ms")):
        slope = (by[8][key] - by[4][key]) / 4 * 1e-3
        out[name] = (by[4][key] * 1e-3 - 3 * slope, slope)
    return out


def attn_host(cal: Calibration, kind: str, span: int) -> float:
    """Host seconds of one attention call of ``kind`` over ``span`` ranks (spans beyond 8 extrapolated)."""
    a, b = cal.attn_host[kind]
    return a + b * (max(span, 1) - 1)


def calibrate() -> Calibration:
    """Every constant from its committed record (see the module doc)."""
    kernels, fit = fit_kernels(os.path.join(BENCH, "2026-11-24_1xH100_fa4", "bench_kernels.json"))
    host = _host_path(os.path.join(BENCH, "2026-11-29_1xH200_host-path", "host_path.json"))
    with open(THROUGHPUT) as f:
        thr = json.load(f)
    rest, fixed = {}, {}
    # each model's DP 4 profiled step (step 0's documents; DP 4 has no CP, so its "rest" is the model's own work)
    for model, row, L, G in (("12l", next(r for r in thr["runs"][7]["rows"] if r["impl"] == "dp"), 16384, 8),
                             ("300m", next(r for r in thr["per_rank_busy_2026_11_28"]["dp_x_cp"]["rows"]
                                           if r["impl"] == "dp"), 131072, 4)):
        tokens = L * G // 4
        rest[model] = row["profile"]["rest_ms"] * 1e-3 / (tokens * MODELS[model].layers)
        fixed[model] = row["profile"]["communication_ms"] * 1e-3
    # Megatron's own host per layer: runs[12]'s megatron_cp (300M, CP 4, 4 micro-batches of 32768 a step, 8k tokens
    # per GPU: host-bound, its GPU work a fifth of the step) less what the model above counts apart: megatron-cp's
    # calls at cp 4, each micro-batch's first call, the gradient reduction
    r32 = next(r for r in thr["runs"][12]["rows"] if r["impl"] == "megatron_cp")
    step = float(np.mean(r32["step_seconds"][3:]))
    mbs, layers = 4, MODELS["300m"].layers
    per_layer = (step - fixed["300m"] - mbs * (host["first"][0] + 3 * host["first"][1])) / (mbs * layers)
    attn = 2 * (host["fwd"][0] + 3 * host["fwd"][1]) + host["bwd"][0] + 3 * host["bwd"][1]
    sources = dict(kernel_fit=kernels.fit, kernel_fit_ratios=fit, r32_step_s=step, r32_host_per_layer_s=per_layer,
                   attn_host_cp4_per_layer_s=attn)
    return Calibration(kernels, host, per_layer - attn, rest, fixed, CostModel(), sources)


# ------------------------------------------------------------------------------------------------ documents

def sequences(setting: Setting, step: int) -> list[np.ndarray]:
    """cu_seqlens of step ``step``'s ``G`` sequences: the recipes' stream (examples/tiny_llama/demo.stdlib_stream
    with a median: lengths drawn with the seed, each document followed by EOD, which ends it) cut every L tokens."""
    lo, hi, median, sigma = setting.docs
    rng = np.random.default_rng(SEED)
    need = (step + 1) * setting.G * setting.L + 1
    ends, total = [], 0
    while total < need:
        total += int(np.clip(rng.lognormal(np.log(median), sigma), lo, hi)) + 1
        ends.append(total)
    ends = np.array(ends)
    out = []
    for j in range(step * setting.G, (step + 1) * setting.G):
        a, b = j * setting.L, (j + 1) * setting.L
        out.append(np.unique(np.concatenate([[0], ends[(ends > a) & (ends < b)] - a, [setting.L]])))
    return out


def _mask(cus, window=None):
    """One micro-batch's mask: causal documents (within ``window`` keys back), sequences side by side."""
    m = [mcp.masks.varlen(np.asarray(c).tolist(), causal=True, **({} if window is None else {"window": window}))
         for c in cus]
    return m[0] if len(m) == 1 else mcp.masks.block_diagonal(m)


def dp_balanced(cus: list[np.ndarray], dp: int, L: int) -> list[list[np.ndarray]]:
    """Megatron's ``dp_balanced`` packing: the step's document pieces, largest attention work first, each into the
    least-loaded (DP group, micro-batch) bin with room for it (L tokens; a group's micro-batches G / dp);
    returns each DP group's micro-batches as cu_seqlens."""
    docs = sorted((int(x) for c in cus for x in np.diff(c)), reverse=True)
    per = len(cus) // dp
    work = np.zeros((dp, per))
    room = np.full((dp, per), L)
    bins = [[[] for _ in range(per)] for _ in range(dp)]
    for n in docs:
        ok = room >= n
        d, i = np.unravel_index(np.argmin(np.where(ok, work, np.inf)), work.shape) if ok.any() else \
            np.unravel_index(np.argmin(work), work.shape)  # no room anywhere: the lightest bin (a longer one)
        bins[d][i].append(n)
        work[d, i] += n * n
        room[d, i] -= n
    return [[np.concatenate([[0], np.cumsum(b)]) for b in group if b] for group in bins]


# ------------------------------------------------------------------------------------------------ the step model

def mb_costs(plan, wplan, setting: Setting, cal: Calibration, span: int) -> list[dict]:
    """Per rank of ``plan`` (and the windowed layers' ``wplan`` on its layout): GPU seconds of each pass kind (with
    the exchange; ``k_*``: the kernels alone) and host seconds. ``span``: ranks of the call's process group."""
    m = MODELS[setting.model]
    work = Workload(m.heads, m.kv_heads, m.head_dim, 2)
    kvb = 2 * m.kv_heads * m.head_dim * 2  # bf16 K and V per token
    link = cal.link
    out = []
    for p in (plan, wplan):
        if p is None:
            out.append(None)
            continue
        moves = any(r.num_remote for r in p.ranks)
        span_h = span if moves else 1  # no exchange: the call has no row moves (the runtime's ``identity``)
        recv = max(r.num_remote for r in p.ranks) * kvb
        # the collectives sync their ranks; dK|dV return as fp32 sums (twice the bytes); not overlapped (small here)
        ln = link.links
        ex_f = (ln.latency_us * 1e-6 + recv / (ln.intra_gbps * 1e9)) if moves else 0.0
        ex_b = (ln.latency_us * 1e-6 + 2 * recv / (ln.intra_gbps * 1e9)) if moves else 0.0
        ranks = []
        for r in p.ranks:
            kf = cal.kernels.time(r.tiles, r.num_tokens, r.buffer_len, work)
            kb = cal.kernels.time(r.tiles, r.num_tokens, r.buffer_len, work, True)
            ranks.append(dict(tokens=r.num_tokens, fwd=kf + ex_f, bwd=kb + ex_b, k_fwd=kf, k_bwd=kb,
                              h_fwd=attn_host(cal, "fwd", span_h), h_bwd=attn_host(cal, "bwd", span_h),
                              first=attn_host(cal, "first", span_h), sync=moves))
        out.append(ranks)
    return out


def run_passes(state, costs, setting: Setting, cal: Calibration) -> None:
    """One micro-batch on the ranks of ``state`` (rank -> [host time, GPU time], updated): every layer's forward,
    then recomputed forward and backward from the last layer down; Megatron's host per layer split over the passes
    as megatron-cp's own calls split it (forward : backward node)."""
    full, win = costs
    m = MODELS[setting.model]
    pattern = setting.window[1] if setting.window else (0,)
    kinds = [win if pattern[i % len(pattern)] else full for i in range(m.layers)]
    rest = cal.rest_s[setting.model]
    hf, hb = cal.attn_host["fwd"][0], cal.attn_host["bwd"][0]
    share = hf / (2 * hf + hb) if hf + hb > 0 else 1 / 3
    xf, xb = cal.layer_host_s * share, cal.layer_host_s * (1 - 2 * share)
    order = [(i, "fwd") for i in range(m.layers)] + [(i, p) for i in reversed(range(m.layers)) for p in ("fwd", "bwd")]
    first = {id(full): True, id(win): True}
    for i, phase in order:
        ranks = kinds[i]
        new = first[id(ranks)]
        first[id(ranks)] = False
        ends = []
        for rank, c in zip(state, ranks):
            h, g, busy, ha, hn = state[rank]
            lin = rest * c["tokens"] * (0.25 if phase == "fwd" else 0.5)  # matmuls: forward 1, backward 2
            once = c["first"] if new else 0.0
            h += (xf if phase == "fwd" else xb) + c["h_" + phase] + once
            g = max(g + lin + c[phase], h)  # a pass ends when its GPU work and its host's issue are both done
            state[rank][:] = h, g, busy + lin + c["k_" + phase], ha + c["h_" + phase], hn + once
            ends.append(g)
        if ranks[0]["sync"]:  # the exchange's collective: every rank of the call waits for the slowest
            for rank in state:
                state[rank][1] = max(ends)


_PLANS: dict = {}


def plan_of(cus, n_ranks: int):
    """mcp.plan of the micro-batch of sequences ``cus`` over ``n_ranks`` (remembered: layouts, candidates and the
    host-free pass plan the same micro-batches again)."""
    key = (tuple(np.asarray(c).tobytes() for c in cus), n_ranks)
    if key not in _PLANS:
        if len(_PLANS) > 4096:
            _PLANS.clear()
        _PLANS[key] = mcp.plan(_mask(cus), n_ranks)
    return _PLANS[key]


def plan_costs(cus, n_ranks, setting, cal, plan=None):
    """(costs, plan) of the micro-batch of sequences ``cus`` planned over ``n_ranks`` (``plan``: made already)."""
    if plan is None:
        plan = plan_of(cus, n_ranks)
    wplan = mcp.planner.plan_like(_mask(cus, setting.window[0]), plan) if setting.window else None
    return mb_costs(plan, wplan, setting, cal, n_ranks), plan


def step_time(setting: Setting, cus: list, layout: str, cp: int, cal: Calibration, with_library: bool = True) -> dict:
    """Predicted seconds of one step of ``layout`` ("fixed", "dp_balanced", "over_dp"; "global": over_dp with its
    global candidate only, what ``--cp-balance-over-dp`` ran on 2026-11-28) at Megatron CP ``cp`` on the
    step's sequences ``cus``; every rank's GPU busy seconds (kernels and linear layers: what a profile counts outside
    NCCL); over_dp: the candidate taken for each global micro-batch, and (``with_library``) the library's pick
    (``runtime.plan_over_dp``'s rule on the same two plans, the default cost model and host figures)."""
    W = setting.world
    dp = W // cp
    # per rank: host clock, GPU clock, GPU busy (kernels, linear layers), host in megatron-cp's calls, in first calls
    state = {r: [0.0] * 5 for r in range(W)}
    chosen, library = [], []
    if layout in ("fixed", "dp_balanced"):
        groups = dp_balanced(cus, dp, setting.L) if layout == "dp_balanced" else \
            [cus[d * (len(cus) // dp):(d + 1) * (len(cus) // dp)] for d in range(dp)]
        for d, mbs in enumerate(groups):
            sub = {r: state[r] for r in range(d * cp, (d + 1) * cp)}
            for cu in mbs:
                run_passes(sub, plan_costs([cu], cp, setting, cal)[0], setting, cal)
    else:
        m = MODELS[setting.model]
        work = Workload(m.heads, m.kv_heads, m.head_dim, 2)
        per = len(cus) // dp
        mbs = []  # per global micro-batch: each candidate's (ranks, costs) parts
        for i in range(per):
            mb = [cus[d * per + i] for d in range(dp)]
            costs, glob = plan_costs(mb, W, setting, cal)
            parts = {"global": [(range(W), costs)]}
            if layout == "over_dp":
                # DP's layout: each group's micro-batch on its own CP ranks, run as the fixed layout runs it (its CP
                # group's call and exchange: the adapter's path for a group's own plan)
                parts["dp_whole"] = [(range(d * cp, (d + 1) * cp), plan_costs([c], cp, setting, cal)[0])
                                     for d, c in enumerate(mb)]
                if with_library:  # the library's rule (runtime.plan_over_dp) on the same plans
                    pred = {"global": mcp.runtime.predict_layer(glob, work), "dp_whole": mcp.runtime.predict_layer(
                        mcp.planner.plan_groups([_mask([c]) for c in mb], cp), work)}
                    library.append(min(pred, key=lambda k: (pred[k], k != "dp_whole")))
            mbs.append(parts)
        # per global batch the assignment whose slowest rank ends first, among: every micro-batch global, every one
        # DP's layout (the fixed layout's step: never worse than it), and each micro-batch's better one in turn
        best = None
        for policy in ("dp_whole", "global", "each") if layout == "over_dp" else ("global",):
            trial, picks = {r: list(v) for r, v in state.items()}, []
            for parts in mbs:
                names = [policy] if policy != "each" else list(parts)
                pick = None
                for name in names:
                    t = {r: list(v) for r, v in trial.items()}
                    for ranks, costs in parts[name]:
                        run_passes({r: t[r] for r in ranks}, costs, setting, cal)
                    end = max(max(v[:2]) for v in t.values())
                    if pick is None or end < pick[0]:
                        pick = (end, name, t)
                picks.append(pick[1])
                trial = pick[2]
            end = max(max(v[:2]) for v in trial.values())
            if best is None or end < best[0]:
                best = (end, picks, trial)
        chosen = best[1]
        for r, v in best[2].items():
            state[r][:] = v
    end = max(max(v[:2]) for v in state.values())
    return dict(step_s=end + cal.fixed_s[setting.model], chosen=chosen, library=library,
                host_s=max(v[0] for v in state.values()), busy_s=[v[2] for v in state.values()],
                attn_host_s=max(v[3] for v in state.values()), first_call_s=max(v[4] for v in state.values()))


# ------------------------------------------------------------------------------------------------ the bound

_DOCS: dict = {}


def doc_alone(n: int, window, setting: Setting, cal: Calibration) -> tuple[float, float, int]:
    """(forward, backward) FA4 seconds of one causal document of ``n`` tokens (within ``window`` keys back) alone on
    one rank, by the route the backend takes for it, and its mask's cells (remembered: lengths repeat)."""
    key = (n, window, setting.model)
    if key not in _DOCS:
        m = MODELS[setting.model]
        work = Workload(m.heads, m.kv_heads, m.head_dim, 2)
        r = mcp.plan(_mask([np.array([0, n])], window), 1).ranks[0]
        _DOCS[key] = (cal.kernels.time(r.tiles, r.num_tokens, r.buffer_len, work),
                      cal.kernels.time(r.tiles, r.num_tokens, r.buffer_len, work, True), int(r.area))
    return _DOCS[key]


def step_bound(setting: Setting, cus: list, cal: Calibration) -> dict:
    """Floors of one step's predicted seconds under ``step_time``'s model over placements of the step's documents on
    the world's ranks (any layout, CP sizes, splits); each + the gradient reduction:

    - ``balanced_s``: perfect balance of whole documents: every rank busy for 1/W of (each document's kernels as it
      runs alone on one rank + the linear layers of every token), nothing moved, no wait; or the host's floor where
      that is higher. What a placement reaches with no split cost, no exchange and equal work per rank; a floor
      wherever the kernels take the varlen route (splitting a document by rows keeps its cells and rows, and only
      adds merges), not strictly where a split piece would run block-sparse at a lower price.
    - ``cells_s``: a floor of every placement: each mask cell at the fastest rate any FA4 route was fitted to (a
      plan computes every cell exactly once; the per-row and merge terms dropped, never negative), the linear
      layers, over W ranks; or the host's floor. A step's end is at least its busiest rank's GPU busy time (the
      exchange and waits only add), which is at least the ranks' mean.
    - ``host_s``: the host's floor: a rank's micro-batch holds at most ``budget`` tokens on it, so some rank runs
      at least ceil(G L / (W budget)) micro-batches, each every layer's Megatron host time and megatron-cp's calls
      at their cheapest (nothing exchanged), and its plans' first calls.

    Also ``gpu_balanced_s`` and ``gpu_cells_s``: the GPU floors alone (no host, no gradient reduction)."""
    m = MODELS[setting.model]
    pattern = setting.window[1] if setting.window else (0,)
    n_win = sum(bool(pattern[i % len(pattern)]) for i in range(m.layers))
    kinds = [(None, m.layers - n_win)] + ([(setting.window[0], n_win)] if n_win else [])
    fit = cal.kernels.fit
    per_cell = 4.0 * m.heads * m.head_dim
    fastest = {d: max(f[d][0] for f in fit.values()) for d in ("fwd", "bwd")}
    whole = cells = 0.0
    for n in (int(x) for c in cus for x in np.diff(c)):
        for window, layers in kinds:
            if layers == 0:
                continue
            f, b, area = doc_alone(n, window, setting, cal)
            # forward twice (the pass and its recomputation before the backward), backward once
            whole += layers * (2 * f + b)
            cells += layers * area * per_cell * (2 / fastest["fwd"] + 2.5 / fastest["bwd"]) * 1e-12
    lin = cal.rest_s[setting.model] * setting.L * setting.G * m.layers
    mbs = -(-setting.G * setting.L // (setting.world * setting.budget))
    call = 2 * attn_host(cal, "fwd", 1) + attn_host(cal, "bwd", 1)
    host = mbs * (m.layers * (cal.layer_host_s + call) + len(kinds) * attn_host(cal, "first", 1))
    W, red = setting.world, cal.fixed_s[setting.model]
    gb, gc = (whole + lin) / W, (cells + lin) / W
    return dict(balanced_s=max(gb, host) + red, cells_s=max(gc, host) + red, host_s=host, gpu_balanced_s=gb,
                gpu_cells_s=gc)
