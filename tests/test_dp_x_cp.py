"""One plan over DP x CP with DP's own layout among its candidates: ``planner.plan_groups`` (every DP group's
micro-batch on its own CP ranks, as one plan of the world), ``runtime.plan_over_dp`` (that or the plan balanced over
every rank, whichever predicts the shorter layer) and the whole-step simulator that weighs them
(tools/sim/train_step.py): its documents are the recipes' own, and its one plan over DP x CP is never predicted
slower than the fixed layout at the same configuration. No test here asserts a timing."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import megatron_cp as mcp
from megatron_cp.masks import geometry
from megatron_cp.planner import Workload, plan_groups
from scripts import ROOT, load_script


def _docs(L, median, hi, seed):
    """Causal documents of log-normal lengths (sigma 1) filling ``L`` tokens."""
    rng, cu = np.random.default_rng(seed), [0]
    while cu[-1] < L:
        cu.append(min(L, cu[-1] + int(np.clip(rng.lognormal(np.log(median), 1.0), 16, hi))))
    return mcp.masks.varlen(cu, causal=True)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_plan_groups_is_each_groups_own_plan_side_by_side(cp):
    """Group d's ranks hold exactly what plan(masks[d], cp) gives its ranks (tiles in their local and buffer
    coordinates, received K/V), shifted by the groups before it; every cell of the block-diagonal mask is computed
    once; nothing moves at CP 1."""
    masks = [_docs(2048, 300, 1500, s) for s in range(3)]
    p = plan_groups(masks, cp)
    assert p.cp_size == 3 * cp and p.seqlen == 3 * 2048
    for d, m in enumerate(masks):
        for r in mcp.plan(m, cp).ranks:
            mine = p.ranks[d * cp + r.rank]
            assert np.array_equal(mine.tiles, r.tiles) and mine.num_remote == r.num_remote
            assert np.array_equal(mine.local_ids(), r.local_ids() + d * 2048)
            assert all(not len(x) for src, x in enumerate(mine.recv_runs) if src // cp != d)  # nothing across groups
    whole = mcp.masks.block_diagonal(masks)
    assert np.array_equal(p.computed_traps(), geometry.union([tuple(t) for t in whole.traps.tolist()]))
    assert (cp == 1) == all(r.num_remote == 0 for r in p.ranks)
    assert mcp.runtime.global_batch.exchange_span(p) <= cp


def test_plan_over_dp_keeps_short_documents_whole_and_splits_long_ones():
    """Short documents: every DP group's work is about even and the global plan only adds exchange and host time,
    so the DP layout is taken (nothing moves); one group drawing a whole-sequence document: the global plan's balance
    wins and it is taken (documents split across the groups)."""
    work = Workload(32, 8, 128, 2)
    short = [_docs(4096, 300, 2048, s) for s in range(2)]
    plan, pred = mcp.runtime.plan_over_dp(short, 1, work=work)
    assert plan.solver.startswith("groups:") and pred["dp_whole"] < pred["global"], pred
    assert all(r.num_remote == 0 for r in plan.ranks)
    long = [mcp.masks.varlen([0, 4096], causal=True), _docs(4096, 300, 2048, 5)]
    plan, pred = mcp.runtime.plan_over_dp(long, 1, work=work)
    assert not plan.solver.startswith("groups:") and pred["global"] < pred["dp_whole"], pred
    assert any(r.num_remote for r in plan.ranks)
    with pytest.raises(ValueError, match="block_diagonal needs at least one mask"):
        mcp.runtime.plan_over_dp([], 2, work=work)


@pytest.fixture(scope="module")
def sim():
    """tools/sim/train_step.py as a module, registered (its dataclasses look their module up by name)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("train_step_script", ROOT / "tools" / "sim" / "train_step.py")
    mod = sys.modules["train_step_script"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_step_draws_the_recipes_documents(sim):
    """The simulator's sequences are the recipes' loader's (examples/tiny_llama/demo.stdlib_stream with a median:
    the 2026-11-28 runs' documents, EOD ending each, the stream cut every L tokens)."""
    from tiny_llama.demo import EOD, stdlib_stream

    st = sim.Setting("12l", 4, 4096, 4, (128, 8192, 621, 1.0), 4096, steps=(1,))
    tok = stdlib_stream(2 * 4 * 4096 + 1, sim.SEED, (128, 8192), True, 621, 1.0)
    for j, cu in enumerate(sim.sequences(st, 1)):
        row = tok[(4 + j) * 4096:(5 + j) * 4096]
        assert np.array_equal(cu, np.unique(np.concatenate([[0], np.nonzero(row == EOD)[0] + 1, [4096]])))


def test_train_step_over_dp_never_predicted_slower_than_the_fixed_layout(sim, tmp_path, capsys):
    """One plan over DP x CP has DP's layout (the fixed layout's micro-batches) among its candidates: at each
    configuration its predicted step is at most the fixed layout's; a host-bound and a GPU-bound case; the dry run
    writes its JSON and ends with one table."""
    cal = sim.calibrate()
    for st in (sim.Setting("12l", 4, 4096, 8, (128, 4096, 300, 1.0), 4096, steps=(0,)),
               sim.Setting("300m", 4, 32768, 4, (1024, 32768, 4096, 1.5), 32768, steps=(0,))):
        cus = sim.sequences(st, 0)
        for cp in (1, 2):
            fixed = sim.step_time(st, cus, "fixed", cp, cal)["step_s"]
            over = sim.step_time(st, cus, "over_dp", cp, cal)
            assert over["step_s"] <= fixed * (1 + 1e-9) and set(over["chosen"]) <= {"global", "dp_whole"}
    out = sim.main(["--dry-run", "--out", str(tmp_path)])
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-3].startswith("| setting | GPUs |") and table[-1].startswith("| megatron W4 t2048 | 4 |")
    assert len(out["rows"]) == 1
    rec = json.loads((tmp_path / "dp_x_cp_steps.json").read_text())
    assert rec["device"] == "CPU (simulation)" and {"vs_best_fixed", "vs_dp_balanced", "bound_s", "bound_cells_s",
                                                    "bound_vs_dp_balanced"} <= set(rec["rows"][0])
    r = rec["rows"][0]
    assert r["bound_cells_s"] <= r["bound_s"] <= r["over_dp_s"] and r["bound_vs_dp_balanced"] >= r["vs_dp_balanced"]


def test_train_step_no_layout_is_predicted_below_the_bound(sim):
    """The floors of a step (step_model.step_bound: perfect balance of whole documents; every cell at the fastest
    fitted rate) are floors of the model: every layout at every configuration, host-bound and GPU-bound, with and
    without host time, is predicted at or above them; the cells floor is the lower one; a step of one document per
    rank, placed whole by DP's layout, reaches perfect balance exactly (nothing split, moved or waited for)."""
    from dataclasses import replace

    cal = sim.calibrate()
    free = replace(cal, attn_host={k: (0.0, 0.0) for k in cal.attn_host}, layer_host_s=0.0)
    for st in (sim.Setting("12l", 4, 4096, 8, (128, 4096, 300, 1.0), 4096, steps=(0,)),
               sim.Setting("300m", 4, 32768, 4, (1024, 32768, 4096, 1.5), 32768, steps=(0,)),
               sim.Setting("300m", 4, 32768, 4, (1024, 32768, 4096, 1.5), 32768, window=(1024, (1, 0)), steps=(0,))):
        cus = sim.sequences(st, 0)
        for c in (cal, free):
            b = sim.step_bound(st, cus, c)
            assert b["cells_s"] <= b["balanced_s"] and b["gpu_cells_s"] <= b["gpu_balanced_s"]
            assert (b["host_s"] == 0.0) == (c is free)
            for layout, cp in sim.layouts(st) + [("global", 1)]:
                got = sim.step_time(st, cus, layout, cp, c, with_library=False)["step_s"]
                assert got >= b["cells_s"] * (1 - 1e-9), (st, layout, cp, got, b)
                if not st.window:  # a floor on the varlen route; windowed pieces may run block-sparse, cheaper
                    assert got >= b["balanced_s"] * (1 - 1e-9), (st, layout, cp, got, b)
    st = sim.Setting("300m", 4, 8192, 4, (1024, 8192, 4096, 1.5), 8192, steps=(0,))
    cus = [np.array([0, 8192])] * 4
    assert sim.step_time(st, cus, "fixed", 1, free)["step_s"] == pytest.approx(sim.step_bound(st, cus, free)
                                                                              ["balanced_s"], rel=1e-12)


def test_rank_shares_dry_run_runs_every_rank_of_every_micro_batch(tmp_path, capsys):
    """tools/sim/rank_shares.py (the one-GPU check of the per-rank prediction) on the CPU: every rank of every global
    micro-batch runs alone on a loopback group; its JSON and one table (times mean nothing here)."""
    tool = load_script("tools/sim/rank_shares.py")
    rows = tool.main(["--dry-run", "--out", str(tmp_path)])
    assert len(rows) == 2 * 4 and sorted({(x["micro_batch"], x["rank"]) for x in rows}) == \
        [(i, r) for i in range(2) for r in range(4)]
    assert json.loads((tmp_path / "rank_shares.json").read_text())["rows"] == rows
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| 1 | 3 |")


def test_train_step_check_reads_the_confirmation_runs(sim, tmp_path):
    """--check DIR: every throughput.json under DIR (tools/sim/confirm_dp_x_cp.sh's runs) predicted as it ran; on
    the 2026-11-28 record of setting (a)'s DP 2 x CP 2 runs it gives what the comparison with that record gives."""
    rec = json.loads(pathlib.Path(sim.THROUGHPUT).read_text())["runs"][5]
    (tmp_path / "a2").mkdir()
    (tmp_path / "a2" / "throughput.json").write_text(json.dumps(rec))
    cal = sim.calibrate()
    rows = {r["impl"]: r for r in sim.check(str(tmp_path), cal)}
    assert set(rows) == {"megatron_cp", "megatron_cp+over_dp", "dp"} and all(r["cp"] == 2 for r in rows.values())
    st = sim.MEASURED["a"]
    for impl, (layout, cp) in (("megatron_cp", ("fixed", 2)), ("megatron_cp+over_dp", ("global", 2)),
                               ("dp", ("fixed", 1))):
        want = [sim.step_time(st, sim.sequences(st, k), layout, cp, cal)["step_s"] for k in st.steps]
        assert rows[impl]["pred_steps_s"] == pytest.approx(want) and rows[impl]["meas_steps_s"] == \
            next(r for r in rec["rows"] if r["impl"] == impl)["step_seconds"][3:]
