"""The benchmark and simulator tools' own rules on CPU: tools/common.py (bench_dist's step timer),
tools/bench_dist.py, the research instruments tools/sim/simulate.py and tools/sim/calibrate.py, and the
parts of the single-GPU tools tools/bench_kernels.py and tools/gpu_kernel_check.py that run without a GPU
(the FA4 peer's calls against FA4's documented semantics, the peer ratios and table, the backend choice,
the CPU dry run). No test here asserts a timing."""

from __future__ import annotations

import pathlib
import time

import pytest

from megatron_cp.masks import catalog
from megatron_cp.planner import Workload
from megatron_cp.runtime import CostModel
from scripts import load_script


TOOLS = pathlib.Path(__file__).resolve().parents[1] / "tools"


def _tool(name):
    """tools/NAME.py or tools/sim/NAME.py (the research instruments), loaded as a module (each tool finds
    the tools/ modules it uses itself)."""
    return load_script(next(p for p in (TOOLS / f"{name}.py", TOOLS / "sim" / f"{name}.py") if p.exists()))


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
    fast_link = CostModel.from_flat(dict(**base, p2p_gbps=1e9))
    slow_link = CostModel.from_flat(dict(**base, p2p_gbps=1.0))  # transfers far longer than any kernel
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

    timing = _tool("common")
    assert timing.Timer(torch.device("cpu")).back_to_back(lambda: None, lambda out: None, 2, None) == (None, None)


def test_ulysses_model_pays_layouts_at_the_head_split_rate():
    """Ulysses' send and receive layouts are head-splitting copies: with ``split_gbps`` they cost their
    bytes at that rate (q|k|v and out forward, dout and dq|dk|dv backward: 2 x (q|k|v + q) bytes each
    way), the rest of the step unchanged; without it, at ``hbm_gbps``."""
    sim = _tool("simulate")
    w = Workload(8, 4, 64, 2)  # 4 K/V heads over cp 4: no head repeat
    mask = catalog.build("causal", 4096)
    base = dict(launch_us=0.0, tile_us=0.0, latency_us=0.0, hbm_gbps=1000.0, dense_fwd_tflops=0.0, dense_bwd_tflops=0.0)
    same = sim.ulysses(mask, 4, 8, CostModel.from_flat(dict(**base)), w)
    assert sim.ulysses(mask, 4, 8, CostModel.from_flat(dict(**base, split_gbps=1000.0)), w) == same
    slow = sim.ulysses(mask, 4, 8, CostModel.from_flat(dict(**base, split_gbps=100.0)), w)
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


def test_tools_read_both_spellings_of_our_label(tmp_path, capsys):
    """The tools write our own attention as the registry spells it (``megatron_cp``); records and commands written
    before say ``megatron-cp``: every reader takes both, as the same implementation."""
    import json

    common, sim, bench = _tool("common"), _tool("simulate"), _tool("bench_dist")
    assert common.OURS == "megatron_cp"
    assert common.impl_list("megatron-cp,megatron-cp+moba,megatron_cp,ring,torch-native") == [
        "megatron_cp", "megatron_cp+moba", "megatron_cp", "ring", "torch-native"]
    assert bench.IMPLS.split(",")[:3] == ["megatron_cp", "megatron_cp+xattention", "megatron_cp+moba"]
    res = [dict(mask="causal", seqlen=1024, cp=2, impl=impl, fwd_ms=1.0, bwd_ms=2.0)
           for impl in ("megatron-cp", "megatron_cp")]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(dict(heads=8, kv_heads=2, head_dim=64, results=res)))
    rows = sim.compare(str(path), CostModel(), Workload(8, 2, 64, 2), 8, "gpu", show=False)
    assert [r["impl"] for r in rows] == ["megatron_cp", "megatron_cp"]
    assert rows[0]["fwd_pred_ms"] == rows[1]["fwd_pred_ms"] > 0
    old = [dict(mask="causal", seqlen=1024, impl="megatron-cp", fwd_tflops_per_gpu=600.0, bwd_tflops_per_gpu=500.0),
           dict(mask="causal", seqlen=1024, impl="kernel-only", fwd_tflops_per_gpu=650.0, bwd_tflops_per_gpu=520.0)]
    assert [c["fwd_scaling"] for c in bench.summarize(old, show=False)] == [pytest.approx(600 / 650)]


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


# --------------------------------------------------------------------------------------------------
# tools/bench_kernels.py and tools/gpu_kernel_check.py: the parts that run without a GPU


def _fake_fa4_interface():
    """flash_attn.cute.interface's two entry points as FA4 documents them, in plain PyTorch: causal is a
    window's right edge 0; window (left, right) keeps key j for query i iff i + sk - sq - left <= j <=
    i + sk - sq + right (bottom-right aligned, None: unbounded); varlen takes int32 cu_seqlens; GQA native.
    flash_attn_func returns (out, lse), flash_attn_varlen_func out alone (FA4's return differs by version)."""
    import types

    import torch

    def attend(q, k, v, scale, causal, window):  # one sequence: q [sq, H, D], k/v [sk, Hkv, D]
        sq, sk = q.shape[0], k.shape[0]
        left, right = window
        right = 0 if causal else right
        i, j = torch.arange(sq)[:, None] + (sk - sq), torch.arange(sk)[None]
        keep = torch.ones(sq, sk, dtype=torch.bool)
        if right is not None:
            keep &= j <= i + right
        if left is not None:
            keep &= j >= i - left
        g = q.shape[1] // k.shape[1]
        s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(g, 1)) * (scale or q.shape[-1] ** -0.5)
        s = s.masked_fill(~keep, float("-inf"))
        return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v.repeat_interleave(g, 1)), s.logsumexp(-1)

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), **kw):
        assert q.dim() == 4 and not kw, kw
        res = [attend(q[b], k[b], v[b], softmax_scale, causal, window_size) for b in range(q.shape[0])]
        return torch.stack([o for o, _ in res]), torch.stack([lse for _, lse in res])

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, softmax_scale=None, causal=False, window_size=(None, None), **kw):
        assert q.dim() == 3 and not kw and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32, kw
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert max(b - a for a, b in zip(cq, cq[1:])) <= max_seqlen_q and cq[-1] == q.shape[0]
        assert max(b - a for a, b in zip(ck, ck[1:])) <= max_seqlen_k and ck[-1] == k.shape[0]
        return torch.cat([attend(q[a:b], k[c:d], v[c:d], softmax_scale, causal, window_size)[0]
                          for a, b, c, d in zip(cq, cq[1:], ck, ck[1:])])

    return types.SimpleNamespace(flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func)


def test_bench_kernels_fa4_peer_keeps_each_masks_cells(monkeypatch):
    """The FA4-direct column runs FA4 only on masks it expresses natively, and there each call (causal,
    the window (1024, 0), varlen over the documents) keeps exactly the catalog mask's cells: its output
    equals dense attention under catalog.dense; its timing runs end to end (forward, retained-graph grad)."""
    import torch

    bk = _tool("bench_kernels")
    fake = _fake_fa4_interface()
    monkeypatch.setattr(bk, "fa4_interface", lambda: fake)
    monkeypatch.setattr(bk, "DEVICE", "cpu")
    s, g = 1536, torch.Generator().manual_seed(0)  # past the window of 1024: it cuts rows
    q, do = torch.randn(s, 4, 16, generator=g), torch.randn(s, 4, 16, generator=g)
    k, v = torch.randn(s, 2, 16, generator=g), torch.randn(s, 2, 16, generator=g)
    for name in bk.FA4_MASKS:
        keep = catalog.dense(name, s)
        sc = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, 1)) / 4.0
        want = torch.einsum("hqk,khd->qhd", torch.softmax(sc.masked_fill(~keep, float("-inf")), -1),
                            v.repeat_interleave(2, 1))
        f, batched = bk.fa4_call(name, s)
        got = f(q[None], k[None], v[None])[0] if batched else f(q, k, v)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
        tf, tb = bk.time_fa4(name, s, q, k, v, do)
        assert tf > 0 and tb > 0


def test_bench_kernels_fa4_peers_say_when_flash_attn_4_is_missing():
    """Without flash-attn-4 both FA4 peers (FA4 direct, Flex's FLASH backend) stop with the error the row
    records as it is, before compiling anything."""
    bk = _tool("bench_kernels")
    if bk.fa4_version() is not None:
        pytest.skip("flash-attn-4 is installed here")
    for fn in (lambda: bk.time_fa4("causal", 256, None, None, None, None),
               lambda: bk.time_flex("causal", 256, None, None, None, None, backend="FLASH")):
        with pytest.raises(bk.PeerMissing, match="^flash-attn-4 not installed$"):
            fn()


def test_bench_kernels_compares_ours_with_the_fastest_peer():
    """Ratios are peer time / ours time per peer that ran (errors are not peers), and against the fastest
    peer of each direction, which is named; the table shows TFLOP/s as fwd / bwd and those ratios."""
    bk = _tool("bench_kernels")

    def rec(f, b):
        return {"fwd_ms": f, "bwd_ms": b, "fwd_tflops": 100.0 / f, "bwd_tflops": 250.0 / b}

    r = {"S": 16384, "mask": "causal", "ours": dict(rec(1.0, 2.0), path="fa4", fwd_path="fa4"),
         "triton": rec(1.5, 3.0), "flex": rec(2.0, 5.0), "flex_flash": rec(1.2, 1.8), "fa4": rec(0.9, 2.2),
         "cudnn": {"error": "RuntimeError: no"}}
    bk.compare_with_peers(r)
    assert r["best_fwd_peer"] == "fa4" and r["fwd_vs_best"] == pytest.approx(0.9)
    assert r["best_bwd_peer"] == "flex_flash" and r["bwd_vs_best"] == pytest.approx(0.9)
    assert r["fwd_vs_flex"] == pytest.approx(2.0) and r["bwd_vs_fa4"] == pytest.approx(1.1)
    assert "fwd_vs_cudnn" not in r and r["fwd_vs_triton"] == pytest.approx(1.5)  # our own Triton: a peer too
    row = bk.table([r], "fa4")[-1]
    assert row == ("| 16384 | causal | 100 / 125 [fa4] | 67 / 83 | 50 / 50 | 83 / 139 | 111 / 114 | err | "
                   "0.90 (fa4) | 0.90 (flex_flash) | 1.20 | 0.90 |")
    own = {"S": 16384, "mask": "global_local", "ours": dict(rec(1.0, 1.0), path="fa4"), "ours_triton": rec(0.3, 1.1),
           "flex_flash": rec(0.65, 2.0)}  # our Triton faster than our default: the best "peer", a 0.3 ratio
    bk.compare_with_peers(own)
    assert own["best_fwd_peer"] == "ours_triton" and own["fwd_vs_best"] == pytest.approx(0.3)
    lone = {"S": 256, "mask": "docs_causal", "ours": dict(rec(1.0, 1.0), path="triton")}  # the CPU dry run: no peers
    bk.compare_with_peers(lone)
    assert "fwd_vs_best" not in lone and bk.table([lone], "triton")[-1].endswith("| - | - | - | - |")


def test_gpu_kernel_check_rank_lists_are_the_runtimes_calls():
    """The rank lists the GPU check runs: every benchmark mask over CP 2 and 4, each rank's rows against its key
    buffer (the shapes the distributed runtime calls the backend with), rectangular where a rank reads keys it
    does not own, every tile inside its call and the lists together the plan's cells."""
    import megatron_cp as mcp
    from megatron_cp.masks import catalog

    gk = _tool("gpu_kernel_check")
    cases = gk.rank_list_cases(1024)
    names = {c[0].split("_cp")[0] for c in cases}
    assert names == set(catalog.DIST_MASKS)
    assert any(sq != sk for _, sq, sk, _ in cases)
    for name, sq, sk, tiles in cases:
        t = tiles.numpy()
        assert (t[:, 0] >= 0).all() and (t[:, 1] <= sq).all() and (t[:, 2] >= 0).all() and (t[:, 3] <= sk).all(), name
    for cp in (2, 4):
        plan = mcp.plan(catalog.build("causal", 1024), cp)
        kept = sum(int(catalog.tiles_to_dense(t, sq, sk).sum()) for n, sq, sk, t in cases if n.startswith(f"causal_cp{cp}_"))
        assert kept == int(catalog.dense("causal", 1024).sum()) == sum(
            int(catalog.tiles_to_dense(rp.tiles, rp.num_tokens, rp.buffer_len).sum()) for rp in plan.ranks if len(rp.tiles))


def test_gpu_kernel_check_builds_the_chosen_backend_with_its_config():
    """--backend triton builds TritonBackend with the run's TritonConfig (as before --backend); auto picks
    Triton where FA4 cannot run; fa4 there stops with the reason rather than checking Triton fallbacks."""
    import torch

    from megatron_cp.kernels import TritonBackend

    if torch.cuda.is_available():
        pytest.skip("the CPU suite's view: no FA4 here")
    gk = _tool("gpu_kernel_check")
    for name in ("triton", "auto"):
        be = gk.make_backend(name, {}, deterministic=True)
        assert type(be) is TritonBackend and be.config.deterministic
    with pytest.raises(SystemExit, match="--backend fa4: FA4 cannot run here"):
        gk.make_backend("fa4", {})


def test_gpu_kernel_check_forces_a_route_where_the_list_has_its_form(monkeypatch):
    """--route: FA4's lists run the forced route where they have its form - a strided list of 16-token blocks (its
    backward's prior: Triton) runs both directions as FA4's block-sparse call, exact against the fp64 reference
    (emulated FA4); forced onto Triton, Triton with the reason; onto "varlen", FA4's varlen calls where there are
    few enough to be timed, else as chosen; "measured" leaves the chooser as it is."""
    import fa4_semantics
    import torch

    from megatron_cp.kernels import FA4Backend
    from megatron_cp.kernels.fa4 import measured
    from megatron_cp.kernels.fa4.backend import Fa4Functions
    from megatron_cp.masks import builders
    from megatron_cp.testing import reference_attention

    gk = _tool("gpu_kernel_check")
    chosen = measured.list_route
    monkeypatch.setattr(measured, "list_route", chosen)  # restored after the test
    gk.force_route("measured")
    assert measured.list_route is chosen
    s = 512
    tiles = catalog.tiles(builders.strided(s, 16, 4))
    fns = Fa4Functions(fa4_semantics.fwd, fa4_semantics.bwd, "reference", (torch.float64,), fa4_semantics.block_sparse,
                       fa4_semantics.interval_masks(), fa4_semantics.band_mask)
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(s, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(s, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    be = FA4Backend(functions=fns)
    prep = be.prepare(tiles, s, s, head_dims=(8,))
    args = (be.routes, "bwd", q, k, v, prep, False, None)
    assert chosen(*args)[0] == "triton"  # the prior: 100% partial blocks
    few = len(prep.calls.bwd) <= measured.MAX_TIMED_VARLEN_CALLS
    for route, want in (("triton", ("triton", "forced by --route")), ("varlen", ("varlen", None) if few else chosen(*args)),
                        ("blocks", ("blocks", None))):
        monkeypatch.setattr(measured, "list_route", chosen)
        gk.force_route(route)
        prep._routes.clear()
        assert measured.list_route(*args) == want, route
    out, lse = be.forward(q, k, v, prep, 0.3)
    assert be.last_path == "fa4"
    dq, dk, dv = be.backward(q, k, v, out, lse, do, prep, 0.3)
    assert be.last_path == "fa4"
    ref = reference_attention(q, k, v, catalog.tiles_to_dense(tiles, s, s), 0.3, dout=do)
    for a, b in zip((out, lse, dq, dk, dv), ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_bench_kernels_cpu_dry_run(tmp_path):
    """The documented CPU dry run (Triton's interpreter, one mask to keep it short) runs end to end and
    writes its JSON: ours is the Triton backend on the CPU, no peer runs, meta names the backend."""
    import json
    import subprocess
    import sys

    p = subprocess.run([sys.executable, str(TOOLS / "bench_kernels.py"), "--dry-run", "--masks", "causal",
                        "--out", str(tmp_path)], check=True, capture_output=True, text=True, timeout=300)
    out = json.loads((tmp_path / "bench_kernels.json").read_text())
    assert out["meta"]["ours_backend"] == {"name": "triton"} and "flash_attn_4" in out["meta"]
    (r,) = out["results"]
    assert r["mask"] == "causal" and r["ours"]["path"] == "triton" and "ours_triton" in r
    assert not any(p in r for p in ("triton", "flex", "flex_flash", "fa4", "cudnn"))
    # stdout: the files written, then the summary table, a row for the one case; the case's own line
    # (S=   256 causal ...) is not printed without --verbose, the progress bar is on stderr
    table = _ends_with_one_table(p.stdout, 1)
    assert table[2].startswith("| 256 | causal | ")
    assert "dens=" not in p.stdout + p.stderr and "bench_kernels: 100%" in p.stderr


# --------------------------------------------------------------------------------------------------
# progress and the closing table (tools/common.py): per-case lines off stdout, one table at its end


def _ends_with_one_table(out: str, rows: int) -> list[str]:
    """The table at the end of ``out`` (its lines), checked: a markdown table of a header, a rule and
    ``rows`` rows, and the only table in ``out``."""
    lines = out.rstrip("\n").splitlines()
    n = len(lines)
    while n and lines[n - 1].startswith("|"):
        n -= 1
    table = lines[n:]
    assert len(table) == 2 + rows, out
    assert set(table[1]) == set("|-") and all(line.count("|") == table[0].count("|") for line in table), out
    assert not any(line.startswith("|") for line in lines[:n]), out
    return table


def test_simulate_prints_one_table_and_keeps_per_case_lines_off_stdout(capsys):
    """tools/sim/simulate.py: stdout is a caption line and one table, a row per (mask, cp) with each
    strategy's prediction and megatron-cp's details; the per-case timings go to stderr with --verbose only."""
    sim = _tool("simulate")
    argv = ["--masks", "causal", "--cps", "2,4", "--tokens-per-gpu", "256", "--strategies", "megatron-cp,ulysses",
            "--dry-run"]
    sim.main(argv)
    out, err = capsys.readouterr()
    table = _ends_with_one_table(out, 2)
    assert len(out.splitlines()) == 1 + len(table)  # the caption, then the table: no per-case lines
    # --strategies in the spelling of records and commands before the registry's: read as megatron_cp
    assert table[0].startswith("| mask | cp | megatron_cp fwd / bwd TFLOP/s | ulysses fwd / bwd TFLOP/s |")
    assert table[2].startswith("| causal | 2 |") and table[3].startswith("| causal | 4 |")
    assert "simulated" not in out + err
    sim.main(argv + ["--verbose"])
    out_v, err_v = capsys.readouterr()
    assert "simulated causal cp=4 ulysses" in err_v and "simulated" not in out_v
    assert len(_ends_with_one_table(out_v, 2)) == len(table)


def test_dp_x_cp_simulation_balances_what_the_fixed_layout_cannot(tmp_path, capsys):
    """tools/sim/dp_x_cp.py: per world size, the fixed layout (each DP group on its CP ranks) and one plan over
    every rank, predicted by simulate's model: a caption and one table on stdout, the JSON rows; the global plan's
    work imbalance is a fraction of the fixed layout's on heavy-tailed documents."""
    import json

    sim = _tool("dp_x_cp")
    rows = sim.main(["--worlds", "8,16", "--cp", "4", "--tokens-per-gpu", "1024", "--docs", "512,64,4096,1.0",
                     "--out", str(tmp_path)])
    out, _ = capsys.readouterr()
    table = _ends_with_one_table(out, 2)
    assert table[0].startswith("| GPUs | DP x CP | fixed ms | global ms |") and table[2].startswith("| 8 | 2 x 4 |")
    assert json.loads((tmp_path / "dp_x_cp.json").read_text())["rows"] == rows
    for r in rows:
        assert r["tokens"] == 1024 * r["world"] and r["fixed_ms"] > 0 and r["global_ms"] > 0 and r["plan_s"] > 0
        assert r["global_imbalance"] < 0.5 * r["fixed_imbalance"], r
    with pytest.raises(SystemExit):
        sim.main(["--worlds", "6", "--cp", "4"])


def test_dp_x_cp_plans_ahead_beside_a_step(capsys):
    """--step-s: the global plans made ahead by PlanAhead from helper processes beside a loop of that step; a
    second table with each way's plan time, the plans allowed at once and the step's wait per micro-batch."""
    sim = _tool("dp_x_cp")
    rows = sim.main(["--worlds", "16", "--cp", "4", "--tokens-per-gpu", "256", "--docs", "256,64,1024,1.0",
                     "--step-s", "0.01", "--ahead-batches", "4", "--max-workers", "2", "--dry-run"])
    out, _ = capsys.readouterr()
    table = _ends_with_one_table(out.split("\n\n")[-1], 1)  # the second of two tables
    assert table[0].startswith("| GPUs | plan s, one at a time | waited s, one at a time | plans at once |")
    r = rows[0]
    assert r["workers_one"] == 1 and 1 <= r["workers_several"] <= 2
    assert r["plan_one_s"] > 0 and r["plan_several_s"] > 0 and r["wait_one_s"] >= 0 and r["wait_several_s"] >= 0


def test_bench_plan_prints_one_table(tmp_path):
    """tools/bench_plan.py (a subprocess: it pins itself to one core): the setup and candidates lines,
    then one table of one row; the progress bar is on stderr."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, str(TOOLS / "bench_plan.py"), "--seqlen", "4096", "--docs", "5", "--cp", "2",
                        "--repeat", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    table = _ends_with_one_table(p.stdout, 1)
    assert len(p.stdout.splitlines()) == 2 + len(table)
    assert table[0].startswith("| mask build ms (min) | plan() s: first |")
    assert "plan(): 100%" in p.stderr and "2/2" in p.stderr


def test_bench_dist_summary_table_has_a_row_per_case():
    """bench_dist's closing table: per S and mask, each implementation's fwd / bwd TFLOP/s (err where it
    failed, - where it did not run, kernel-only last) and the checks' text."""
    bench = _tool("bench_dist")
    res = [dict(mask="causal", seqlen=1024, impl="kernel-only", fwd_tflops_per_gpu=650.0, bwd_tflops_per_gpu=520.0),
           dict(mask="causal", seqlen=1024, impl="megatron-cp", fwd_tflops_per_gpu=600.0, bwd_tflops_per_gpu=500.0),
           dict(mask="causal", seqlen=1024, impl="ring", error="RuntimeError: no"),
           dict(mask="packed", seqlen=1024, impl="ring", fwd_tflops_per_gpu=0.0123, bwd_tflops_per_gpu=0.5)]
    checks = bench.summarize(res, show=False)
    lines = bench.summary_table(res, checks)
    assert lines[1] == "| S | mask | megatron-cp | ring | kernel-only | checks |"
    assert lines[3] == "| 1024 | causal | 600.0 / 500.0 | err | 650.0 / 520.0 | scaling vs kernel-only: fwd 0.92 bwd 0.96 |"
    assert lines[4] == "| 1024 | packed | - | 0.012 / 0.5 | - |  |"


def test_gpu_tools_summary_tables_group_the_cases():
    """The closing tables of the GPU-only tools, from records as they write them: gpu_kernel_check a row
    per (mask, S) with passes, deterministic runs, worst error ratio and paths, then one per extra check;
    gpu_dist_check a row per (mask, variant) over the ranks; calibrate --check a row per (mask, impl) with sums and
    the worst call."""
    gk, gd, cc = _tool("gpu_kernel_check"), _tool("gpu_dist_check"), _tool("calibrate")

    def case(ratio, ok, det=True):
        errs = {n: {"err": 1.0, "lowp_err": 1.0, "ratio": 1.0} for n in gk.ERR_KEYS}
        errs["dq"]["ratio"] = ratio
        return {"mask": "causal", "S": 1024, "pass": ok, "deterministic": det, "paths": ["triton"], "triton": errs,
                "last_path": {"triton": ["triton", "triton"]}}

    extra = {"check": "accumulate+bfloat16", "last_path": "triton", "pass": True,
             "out": {"err": 3.0, "lowp_err": 2.0}, "dq": {"err": 1.0, "lowp_err": 2.0}}
    lines = gk.summary_table([case(0.5, True), case(1.5, False, False)], [extra])
    assert lines[2:] == ["| causal | 1024 | 1/2 | 1/2 | 1.500 | triton/triton |",
                         "| accumulate+bfloat16 | 2048 | 1/1 | - | 1.500 | triton |"]

    def rank(r, ok, e):
        return {"mask": "packed", "backend": "triton", "variant": "-", "impl": "ring", "stages": "auto", "rank": r,
                "ok": ok, "guest_rows": 0,
                "rms_err_vs_bf16_ref": {"out": [e, 1.0], "dq": [0.1, 1.0]}, "cudnn_calls": {"fwd": 2, "bwd": 1}}

    assert gd.summary_table([rank(0, True, 0.4), rank(1, False, 2.5)])[2:] == [
        "| packed | triton | ring | - | 0 | 1/2 | 2.500 | 4 / 2 |"]

    def call(r, f, fp):
        return {"mask": "causal", "impl": "ring", "rank": r, "step": 1, "fwd_ms": f, "fwd_pred_ms": fp, "bwd_ms": 1.0,
                "bwd_pred_ms": 1.0}

    assert cc.check_table([call(0, 1.0, 1.1), call(1, 2.0, 1.0)])[2:] == [
        "| causal | ring | 2 | 3.000 / 2.100 (0.70) | 0.50 (rank 1 step 1) | 2.000 / 2.000 (1.00) | 1.00 (rank 0 step 1) |"]


def test_bench_train_runs_fresh_plans_per_micro_batch(tmp_path, capsys):
    """tools/bench_train.py (training-like: a new packed mask per micro-batch, planned ahead, layers forward then
    backward) on 2 gloo ranks: a row per implementation with the step, per-call and planning figures, the JSON
    written, with the same steps' time when their plans were all made before them."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(TOOLS / "bench_train.py"), "--dry-run", "--tokens-per-gpu", "64",
                          "--impls", "megatron-cp,ring", "--warmup", "1", "--iters", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "bench_train.json").read_text())["rows"]
    assert [r["impl"] for r in rows] == ["megatron_cp", "ring"]  # --impls megatron-cp: the registry's spelling
    for r in rows:
        assert r["seqlen"] == 128 and r["layers"] == 2 and r["gpu_ms"] is None
        assert r["step_ms"] > 0 and r["first_call_ms"] > 0 and r["call_ms"] > 0 and r["plan_ms"] > 0
        # the one timed step, and no route timed nor FA4 kernel compiled on the CPU (the rules of calls.py hold there)
        assert len(r["steps_ms"]) == 1 and r["steps_ms"][0] > 0
        assert r["warmup_steps"] == 1  # --warmup 1, and nothing met on the CPU that would warm up longer
        assert r["routes_timed_in_steps"] == 0 and r["fa4_compiles_in_steps"] == 0
        assert r["planned_before_ms"] > 0 and r["wait_ms"] >= 0
    assert "tokens/GPU  megatron_cp: step" in out.stdout
    # rank 0's host profile of one more megatron-cp step: the attention's forward among its functions
    prof = (tmp_path / "host_profile_megatron_cp_64.txt").read_text()
    assert "function calls" in prof and "runtime/attention.py" in prof
    assert not list(tmp_path.glob("host_profile_ring_*"))
    with pytest.raises(SystemExit) as bad:  # refused by argument parsing, before any process starts
        _tool("bench_train").main(["--dry-run", "--impls", "te"])
    assert bad.value.code == 2 and "--impls: 'te' is not one of megatron_cp, ring" in capsys.readouterr().err


def test_bench_train_gpu_time_keeps_nccl_apart():
    """bench_train's device time of a profiled step: intervals merged across streams, NCCL kernels (which also
    spin while a peer is still issuing) counted apart from the compute and copies."""
    from types import SimpleNamespace as NS

    import torch

    _busy_ms = _tool("bench_train")._busy_ms
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, a, b, dev=cuda):
        return NS(name=name, device_type=dev, time_range=NS(start=a, end=b))

    prof = NS(events=lambda: [ev("attn_fwd", 0, 1000), ev("copy", 500, 1500), ev("attn_bwd", 3000, 4000),
                              ev("ncclDevKernel_SendRecv", 0, 9000), ev("cpu_op", 0, 99000, cpu)])
    assert _busy_ms(prof) == (2.5, 9.0)


def test_gpu_dist_check_dry_run_covers_every_case_family(tmp_path):
    """tools/gpu_dist_check.py's CPU dry run on 2 gloo ranks (torchrun; --share-gpu is ignored on the CPU): every
    benchmark mask (megatron-cp and the baselines), sparse selections, sinks, MLA head dims and the rank mismatches
    run on the reference backend, every rank's record ok (a mismatch: every rank raised), one closing table."""
    import json
    import os
    import subprocess
    import sys

    from megatron_cp.testing import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(TOOLS / "gpu_dist_check.py"), "--dry-run", "--share-gpu", "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    rec = json.loads((tmp_path / "gpu_dist_check.json").read_text())
    res = rec["results"]
    assert rec["all_ok"] and rec["backends"] == ["reference"] and rec["num_devices"] == 2
    assert [r for r in res if not r["ok"]] == []
    fams = {f: {(r["mask"], r["impl"], r["variant"]) for r in res if r["family"] == f}
            for f in ("dense", "sparse", "sink", "mla", "mismatch")}
    assert {m for m, *_ in fams["dense"]} == set(catalog.DIST_MASKS)
    assert {(m, i) for m, i, _ in fams["dense"]} >= {(m, i) for m in catalog.DIST_MASKS
                                                      for i in ("megatron_cp", "ring", "ulysses", "allgather")}
    assert {(m, v) for m, _, v in fams["sparse"]} == {(m, v) for m in ("causal", "packed")
                                                      for v in ("moba", "xattention")}
    assert {m for m, *_ in fams["sink"]} == {m for m, *_ in fams["mla"]} == {"causal", "packed"}
    # later rows: NCCL only (on gloo its peer waits in the check until the raising process exits)
    assert {v for *_, v in fams["mismatch"]} == {"mismatch plan", "mismatch heads", "mismatch later heads"}
    for r in res:
        assert r["backend"] == "reference" and "ok" in r
        if r["family"] == "mismatch":  # every rank raised, naming what differs
            assert r["raised"] and r["ranks_raised"] == 2 and "CP ranks disagree" in r["error"], r
        else:
            assert set(r["rms_err_vs_bf16_ref"]) >= {"out", "lse", "dq", "dk", "dv"}
    assert all("dsink" in r["rms_err_vs_bf16_ref"] for r in res if r["family"] == "sink")
    assert all(r["sparse"]["blocks_selected"] <= r["sparse"]["blocks_envelope"] for r in res if r["family"] == "sparse")
    # the selection narrows the causal envelope (the reference applies the same gathered selection)
    assert any(r["sparse"]["blocks_selected"] < r["sparse"]["blocks_envelope"] for r in res
               if r["family"] == "sparse" and r["mask"] == "causal")
    # stdout: one table, a row per (mask, backend, impl, variant)
    rows = {(r["mask"], r["backend"], r["impl"], r["variant"]) for r in res}
    table = _ends_with_one_table(p.stdout, len(rows))
    assert table[0].startswith("| mask | backend | impl | variant |")
    # a part of the cases: the dense family of megatron-cp alone (its exchange paths on every mask)
    gd, ours = _tool("gpu_dist_check"), "megatron_cp"
    out = tmp_path / "part"
    p = subprocess.run(cmd[:-1] + [str(out), "--families", "dense", "--impls", ours], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    part = json.loads((out / "gpu_dist_check.json").read_text())["results"]
    assert part and {(r["family"], r["impl"]) for r in part} == {("dense", ours)}
    assert {(r["mask"], r["variant"]) for r in part} == {(m, v) for m, i, v in fams["dense"] if i == ours}
    with pytest.raises(SystemExit):
        gd.main(["--dry-run", "--families", "dense,nope"])


def test_bench_first_call_times_both_ways_of_building_a_new_plans_state(tmp_path):
    """tools/bench_first_call.py --dry-run: a row per (cp, mask) with both state timings, the helper's time and what
    its answer grows by (no timing asserted); a mask outside the catalog is refused."""
    import json

    fc = _tool("bench_first_call")
    rows = fc.main(["--dry-run", "--out", str(tmp_path), "--cps", "2", "--masks", "packed,causal"])
    assert [(r["cp"], r["mask"]) for r in rows] == [(2, "packed"), (2, "causal")]
    for r in rows:
        assert r["in_call_ms"] > 0 and r["with_ahead_ms"] > 0 and r["helper_ms"] > 0 and r["answer_bytes"] > 0
    assert len(json.loads((tmp_path / "first_call.json").read_text())["rows"]) == 2
    # the Triton backend's lists, their block schedules built ahead (a first forward and backward build them here)
    rows = fc.main(["--dry-run", "--out", str(tmp_path), "--cps", "2", "--masks", "packed", "--backend", "triton"])
    assert rows[0]["backend"] == "triton" and rows[0]["answer_bytes"] > 0 and rows[0]["with_ahead_ms"] > 0
    with pytest.raises(SystemExit):
        fc.main(["--dry-run", "--out", str(tmp_path), "--masks", "nope"])


def test_host_path_runs_one_rank_alone_on_a_loopback_group(tmp_path):
    """tools/host_path.py --dry-run: rank 0 of cp 4 and cp 8 plans in one process whose collectives move nothing
    (comm.loopback), a row per case with the back-to-back and host figures (no GPU time on CPU), the JSON written
    with the rows the issue names."""
    import json

    hp = _tool("host_path")
    rows = hp.main(["--dry-run", "--out", str(tmp_path), "--cps", "4,8"])
    assert [(r["cp"], r["mask"], r["tokens_per_rank"]) for r in rows] == [(4, "packed", 64), (8, "packed", 64)]
    for r in rows:
        assert r["fwd_b2b_ms"] > 0 and r["bwd_b2b_ms"] > 0 and r["host_ms_per_call"] > 0 and r["step_ms_per_mb"] > 0
        assert r["gpu_ms"] is None and r["b2b_over_gpu"] is None  # no device time on a CPU
        assert r["step_gpu_ms_per_mb"] is None and r["step_over_gpu"] is None
        assert r["not_replayed"] == {}  # no FA4 launch on a CPU
        # a later call's pieces inside the loop: the whole call holds its kernels' call and its exchange's
        fwd, bwd = r["pieces_us"]["forward"], r["pieces_us"]["backward"]
        assert fwd["attention (the whole call)"][0] >= fwd["ReferenceBackend.forward"][0] > 0
        assert fwd["attention.all_to_all_v"][1] == 1 and bwd["ReferenceBackend.backward"][1] == 1
    saved = json.loads((tmp_path / "host_path.json").read_text())
    assert saved["process_group"] == "loopback" and len(saved["rows"]) == 2
    for key in ("tokens_per_rank", "cp", "mask", "heads", "b2b_ms", "gpu_ms", "host_ms_per_call", "b2b_over_gpu"):
        assert key in saved["rows"][0]
    assert "Self CPU" in (tmp_path / "host_path_profile.txt").read_text()
    with pytest.raises(SystemExit):
        hp.main(["--dry-run", "--out", str(tmp_path), "--cps", "1"])


def test_host_glue_counts_a_later_calls_ops_and_launches_with_no_kernels(tmp_path):
    """tools/host_glue.py --dry-run: rank 0 of cp 2 plans alone on the CPU, kernels made no-ops and row-kernel launches
    counted: a row per case with host times, aten ops and launches; the library's kernels are restored after."""
    import json

    from triton.runtime.jit import JITFunction

    from megatron_cp.kernels import merge
    from megatron_cp.runtime import rowmap

    before = rowmap.copy_pairs, rowmap.copy_row_pairs, merge.merge_sources, JITFunction.__getitem__
    hg = _tool("host_glue")
    got = hg.main(["--dry-run", "--out", str(tmp_path), "--cps", "2", "--masks", "packed,global_local"])
    assert [(r["cp"], r["mask"]) for r in got] == [(2, "packed"), (2, "global_local")]
    for r in got:
        assert r["fwd_host_us"] > 0 and r["bwd_host_us"] > 0 and r["fwd_aten_ops"] > 0 and r["bwd_aten_ops"] > 0
    # launches counted, not made: the forward's send gather, and global + local's guest rows merged in one launch
    assert got[0]["fwd_launches"] >= 1 and got[1]["fwd_launches"] >= 2, got
    assert (rowmap.copy_pairs, rowmap.copy_row_pairs, merge.merge_sources, JITFunction.__getitem__) == before
    assert len(json.loads((tmp_path / "host_glue.json").read_text())["rows"]) == 2
    with pytest.raises(SystemExit):
        hg.main(["--dry-run", "--out", str(tmp_path), "--cps", "1"])
