"""The benchmark and simulator tools' own rules on CPU: tools/timing.py (bench_dist's step timer),
tools/bench_dist.py, and the research instruments tools/sim/simulate.py and tools/sim/calibrate.py."""

from __future__ import annotations

import importlib.util
import pathlib
import time

import pytest

from megatron_cp.masks import catalog
from megatron_cp.planner import Workload
from megatron_cp.runtime import CostModel

from _dist import run_ranks

TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"


def _tool(name):
    """tools/NAME.py or tools/sim/NAME.py (the research instruments), loaded as a module (each tool finds
    the tools/ modules it uses itself)."""
    path = next(p for p in (TOOLS / f"{name}.py", TOOLS / "sim" / f"{name}.py") if p.exists())
    spec = importlib.util.spec_from_file_location(f"{name}_tool", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _warm_counts(rank, world):
    import torch
    import torch.distributed as dist

    timing = _tool("timing")
    calls = []

    def step():  # rank 1's step outlasts the warm-up: alone it would run one; rank 0's are ~60x shorter
        calls.append(1)
        time.sleep(0.001 if rank == 0 else 0.06)

    timing.Timer(torch.device("cpu"), warm_seconds=0.05).warm(step, dist.group.WORLD)
    return len(calls)


def test_timer_warm_runs_the_same_number_of_steps_on_every_rank():
    """Warm-up steps contain collectives in a real run: every rank must run as many as the others (the
    most any rank needs), however fast its own steps are."""
    counts = run_ranks(_warm_counts, 2)
    # the most any rank needs (rank 0's: 50 unloaded; >= 3 while its steps take up to 25 ms on a busy
    # machine), not rank 1's one
    assert counts[0] == counts[1] >= 3, counts


def _ring_case(cost):
    sim = _tool("simulate")
    w = Workload(8, 2, 64, 2)
    mask = catalog.build("causal", 4096)
    return sim.ring(mask, 4, 8, cost, w, "zigzag"), w


def test_ring_model_pays_forward_transfers_after_kernels_and_overlaps_backward_ones():
    """The ring model (tools/sim/simulate.py): each forward transfer adds to its step (NCCL's kernel waits for
    the step's kernels to free the multiprocessors), each backward transfer but the last hides behind
    the next step's kernel."""
    base = dict(launch_us=0.0, tile_us=0.0, latency_us=0.0, hbm_gbps=1e9, dense_fwd_tflops=0.0, dense_bwd_tflops=0.0)
    fast_link = CostModel(**base, p2p_gbps=1e9)
    slow_link = CostModel(**base, p2p_gbps=1.0)  # transfers far longer than any kernel
    (fast, w), (slow, _) = _ring_case(fast_link), _ring_case(slow_link)
    blk = 4096 // 4 * w.kv_bytes_per_token  # one rank's K|V block (bf16)
    t = blk / 1e9  # its transfer at 1 GB/s
    # forward: 3 transfers on top of the kernels, which the fast link leaves alone
    assert slow["fwd_s"] == pytest.approx(fast["fwd_s"] + 3 * t, rel=1e-6)
    assert fast["fwd_s"] > 0
    # backward: the fp32 sums (2x the bytes) travel 4 times; the first step has none in flight, the
    # next three steps hide their kernels behind a transfer, the last transfer is exposed: 4 transfers
    # plus the first step's work, which is part of the fast link's time (every zigzag step has work)
    first_step = slow["bwd_s"] - 4 * 2 * t
    assert 0 < first_step < fast["bwd_s"]


def test_timer_back_to_back_is_a_gpu_measurement():
    """Back-to-back steps are timed with CUDA events; on CPU (gloo dry runs) there is nothing to report
    and the runner says so (None), rather than a host timing under the same name."""
    import torch

    timing = _tool("timing")
    assert timing.Timer(torch.device("cpu")).back_to_back(lambda: None, lambda out: None, 2, None) == (None, None)


def test_ulysses_model_pays_layouts_at_the_head_split_rate():
    """Ulysses' send and receive layouts are head-splitting copies: with ``split_gbps`` they cost their
    bytes at that rate (q|k|v and out forward, dout and dq|dk|dv backward: 2 x (q|k|v + q) bytes each
    way), the rest of the step unchanged; without it, at ``hbm_gbps``."""
    sim = _tool("simulate")
    w = Workload(8, 4, 64, 2)  # 4 K/V heads over cp 4: no head repeat
    mask = catalog.build("causal", 4096)
    base = dict(launch_us=0.0, tile_us=0.0, latency_us=0.0, hbm_gbps=1000.0, dense_fwd_tflops=0.0, dense_bwd_tflops=0.0)
    same = sim.ulysses(mask, 4, 8, CostModel(**base), w)
    assert sim.ulysses(mask, 4, 8, CostModel(**base, split_gbps=1000.0), w) == same
    slow = sim.ulysses(mask, 4, 8, CostModel(**base, split_gbps=100.0), w)
    tok = 4096 / 4 * 64 * 2  # bytes of one head of a GPU's rows
    layout = 2 * tok * (8 + 2 * 4) + 2 * tok * 8
    for phase in ("fwd_s", "bwd_s"):
        assert slow[phase] - same[phase] == pytest.approx(layout / 100e9 - layout / 1000e9, rel=1e-9)


def test_summary_reports_back_to_back_ratios_and_scaling(capsys):
    """The benchmark's check line: back-to-back throughput against the peer and against kernel-only
    (time ratios: same FLOPs), beside the GPU-time ones; absent timings are left out, not guessed."""
    bench = _tool("bench_dist")
    base = dict(mask="causal", seqlen=1024)
    res = [dict(base, impl="megatron-cp", fwd_tflops_per_gpu=600.0, bwd_tflops_per_gpu=500.0, fwd_b2b_ms=10.0,
                bwd_b2b_ms=20.0),
           dict(base, impl="torch-sdpa-ring", fwd_tflops_per_gpu=500.0, bwd_tflops_per_gpu=500.0, fwd_b2b_ms=12.0,
                bwd_b2b_ms=21.0),
           dict(base, impl="kernel-only", fwd_tflops_per_gpu=650.0, bwd_tflops_per_gpu=520.0, fwd_b2b_ms=9.0,
                bwd_b2b_ms=19.0)]
    (c,) = bench.summarize(res)
    assert c["fwd_ratio"] == pytest.approx(1.2) and c["fwd_b2b_ratio"] == pytest.approx(1.2)
    assert c["bwd_b2b_ratio"] == pytest.approx(1.05) and c["fwd_b2b_scaling"] == pytest.approx(0.9)
    assert c["bwd_b2b_scaling"] == pytest.approx(0.95)
    assert "back to back: 1.20x / 1.05x, scaling 0.90 / 0.95" in capsys.readouterr().out
    for r in res[1:]:  # a CPU run: nothing back to back
        del r["fwd_b2b_ms"], r["bwd_b2b_ms"]
    (c,) = bench.summarize(res)
    assert "fwd_b2b_ratio" not in c and "fwd_b2b_scaling" not in c and "fwd_ratio" in c


def test_compare_kernel_target_checks_kernel_only_rows(tmp_path, capsys):
    """simulate --compare --target kernel: each kernel-only row (slowest rank) against tile_time of the
    benchmark plan's calls, the rank's list and its guest call; rows without the slowest rank's times and
    other implementations are left out."""
    import json

    import megatron_cp as mcp

    sim = _tool("simulate")
    cost, w = CostModel(), Workload(8, 2, 64, 2)
    res, want = [], {}
    for name in ("sliding_window", "global_local"):
        plan = mcp.plan(catalog.build(name, 4096), 2)
        per_rank = []
        for rp in plan.ranks:
            calls = [rp.tiles] + ([rp.guest_tiles] if len(rp.guest_tiles) and sum(rp.guest_recv_counts()) else [])
            per_rank.append((sum(cost.tile_time(t, w) for t in calls), sum(cost.tile_time(t, w, True) for t in calls)))
        f, b = (max(x[i] for x in per_rank) * 1e3 for i in (0, 1))
        want[name] = (f, b)
        # measured: the prediction over 1.1 (fwd) and 1.3 (bwd)
        res.append(dict(mask=name, seqlen=4096, cp=2, impl="kernel-only", fwd_ms=f, bwd_ms=b,
                        fwd_max_ms=f / 1.1, bwd_max_ms=b / 1.3))
    res.append(dict(mask="causal", seqlen=4096, cp=2, impl="kernel-only", fwd_ms=1.0, bwd_ms=2.0))  # no max
    res.append(dict(mask="causal", seqlen=4096, cp=2, impl="megatron-cp", fwd_ms=1.0, bwd_ms=2.0, fwd_max_ms=1.0,
                    bwd_max_ms=1.0))
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(dict(heads=8, kv_heads=2, head_dim=64, results=res)))
    rows = sim.compare(str(path), cost, w, 8, "kernel")
    assert [r["mask"] for r in rows] == ["sliding_window", "global_local"]
    for r in rows:
        assert (r["fwd_pred_ms"], r["bwd_pred_ms"]) == pytest.approx(want[r["mask"]])
        assert r["fwd_pred_ms"] / r["fwd_ms"] == pytest.approx(1.1) and r["bwd_pred_ms"] / r["bwd_ms"] == pytest.approx(1.3)
    assert "0/2 within 15%" in capsys.readouterr().out


def test_calibrate_link_timing_ignores_one_stalled_group():
    """tools/sim/calibrate.py times each link as the median of groups of calls: one stall (a rank held up once,
    which holds every rank's collective) does not set the link's rate, as a mean over the calls did."""
    import torch

    cal = _tool("calibrate")
    calls = []

    def fn():  # the 15th call (one of the second group's timed calls) stalls 1 s; the others take ~1 ms
        calls.append(1)
        time.sleep(1.0 if len(calls) == 15 else 0.001)

    t = cal.median_time(fn, torch.device("cpu"), 10)
    assert len(calls) == 5 * 11  # five groups, each one warm-up call and ten timed ones
    assert 0.0009 < t < 0.01, t  # a mean over all the calls would be ~19 ms, over the stalled group ~100 ms
