"""tools/run_dist_suite.py, the multi-GPU run's one command, as its CPU dry run (2 gloo processes, tiny sizes):
bench_dist with the dynamic sparse rows, the simulator's prediction of the measured cases and its packed
scaling table, all under one output folder with suite.json. The calibration step is given the default cost
model (CostModel().save) so the run stays small; the GPU-only self-checks are named as skipped."""

import argparse
import json
import math
import os
import subprocess
import sys

import pytest

from megatron_cp.runtime import CostModel
from megatron_cp.testing import free_port
from scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITE = os.path.join(ROOT, "tools", "run_dist_suite.py")
IMPLS = ["megatron_cp", "megatron_cp+xattention", "megatron_cp+moba", "ring", "ulysses", "allgather"]


def _suite_module():
    return load_script(SUITE)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("suite"))
    CostModel().save(os.path.join(out, "cost.json"))  # what the calibrate step writes
    cmd = [sys.executable, SUITE, "--out", out, "--dry-run", "--steps", "kernel_check,bench,predict,scaling",
           "--seqlens", "256", "--masks", "causal,packed", "--impls", ",".join(IMPLS), "--master-port", str(free_port()),
           "--", "--profile"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    logs = {f: open(os.path.join(out, "logs", f)).read()[-3000:] for f in os.listdir(os.path.join(out, "logs"))}
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:], logs)
    with open(os.path.join(out, "suite.json")) as f:
        suite = json.load(f)
    return out, suite


def test_dry_run_records_every_step_and_names_the_skipped_gpu_checks(dry_run):
    out, suite = dry_run
    run = suite["runs"][-1]
    assert run["device"] == "cpu" and run["num_devices"] == 2 and run["date"] and "--dry-run" in run["command"]
    assert run["skipped_gpu_only"] == ["kernel_check"]
    steps = {st["name"]: st for st in suite["steps"]}
    assert [st["name"] for st in suite["steps"]] == ["bench", "predict", "scaling"]
    for name, st in steps.items():
        assert st["rc"] == 0 and st["outputs"] and all(p.startswith(out) for p in st["outputs"]), (name, st)
        assert os.path.exists(st["log"])
    assert "--nproc-per-node 2" in steps["bench"]["command"]
    assert steps["bench"]["row_errors"] == []
    assert steps["predict"]["command"].split("--compare ")[1].split()[0] == steps["bench"]["outputs"][0]


def test_bench_profile_writes_a_timeline_per_case(dry_run):
    """bench_dist --profile (passed after "--"): megatron-cp's profiled step per mask, host time per phase."""
    out, _ = dry_run
    with open(os.path.join(out, "bench_dist_s256_profile.txt")) as f:
        text = f.read()
    for m in ("causal", "packed"):
        assert f"== megatron_cp {m} S=256 rank 0 of 2 (cpu), right after another step (back to back)" in text, text
    assert text.count("-- fwd: host ") == 2 and text.count("-- bwd: host ") == 2, text


def test_bench_has_every_row_with_finite_times_and_sparse_bytes_within_the_envelope(dry_run):
    out, suite = dry_run
    with open(suite["steps"][0]["outputs"][0]) as f:
        bench = json.load(f)
    rows = bench["results"]
    assert all("error" not in r for r in rows), [r["error"] for r in rows if "error" in r]
    for mask in ("causal", "packed"):
        got = {r["impl"]: r for r in rows if r["mask"] == mask}
        assert sorted(got) == sorted(IMPLS + ["kernel-only"]), (mask, sorted(got))
        for r in got.values():
            for key in ("fwd_ms", "bwd_ms", "fwd_tflops_per_gpu", "bwd_tflops_per_gpu"):
                assert math.isfinite(r[key]) and r[key] > 0, (mask, r["impl"], key, r[key])
        dense = got["megatron_cp"]
        assert dense["kv_bytes"] > 0  # cp 2: the causal and packed plans move K/V
        for impl in ("megatron_cp+xattention", "megatron_cp+moba"):
            sp = got[impl]
            assert 0 < sp["kept_fraction"] <= 1
            for key in ("kv_bytes", "envelope_kv_bytes", "selector_bytes", "bytes_moved", "max_kv_bytes_received"):
                assert isinstance(sp[key], int) and sp[key] >= 0, (impl, key, sp[key])
            # the selected blocks' K/V never exceed the dense exchange of the same block layout
            assert 0 < sp["kv_bytes"] <= sp["envelope_kv_bytes"], (mask, impl, sp)
            assert sp["bytes_moved"] == sp["kv_bytes"] + sp["selector_bytes"] and sp["selector_bytes"] > 0
        check = next(c for c in bench["checks"] if c["mask"] == mask)
        vs = {x["impl"]: x for x in check["sparse_vs_dense"]}
        assert sorted(vs) == ["megatron_cp+moba", "megatron_cp+xattention"]
        for impl, x in vs.items():
            assert x["fwd_time_ratio"] == pytest.approx(got[impl]["fwd_ms"] / dense["fwd_ms"])
            assert x["kv_bytes_ratio"] == pytest.approx(got[impl]["kv_bytes"] / dense["kv_bytes"])
            assert x["layout_kv_bytes_ratio"] <= 1
    # XAttention's selection reads whole envelope blocks of keys held elsewhere
    xa = next(r for r in rows if r["mask"] == "causal" and r["impl"] == "megatron_cp+xattention")
    assert xa["selector"] == "xattention" and xa["selector_params"]["threshold"] == 0.9
    assert next(r for r in rows if r["impl"] == "megatron_cp+moba")["selector_params"]["top_k"] == 3


def test_prediction_and_scaling_table_are_written(dry_run):
    out, suite = dry_run
    predict = next(st for st in suite["steps"] if st["name"] == "predict")
    with open(predict["outputs"][0]) as f:
        pred = json.load(f)
    gpu = pred["by_target"]["gpu"]
    impls = {r["impl"] for r in gpu}
    assert {"megatron_cp", "ring", "ulysses", "allgather"} <= impls
    assert not impls & {"megatron_cp+xattention", "megatron_cp+moba"}  # the simulator has no sparse model
    assert all(math.isfinite(r["fwd_pred_ms"]) and r["fwd_pred_ms"] > 0 and r["fwd_ms"] > 0 for r in gpu)
    with open(os.path.join(out, "simulate_packed_scaling.json")) as f:
        scal = json.load(f)
    cps = {r["cp"] for r in scal["results"] if r["strategy"] == "megatron_cp" and r["mask"] == "packed"}
    assert cps == {2, 4}


def test_commands_for_one_gpu_and_bad_steps():
    """One GPU: every step, torchrun with one process (CP = 1), the benchmark at S = 128k and 256k; the
    CPU dry run leaves the GPU-only checks out. A bad step name is refused."""
    mod = _suite_module()
    ns = argparse.Namespace(out="o", dry_run=False, nproc=1, steps=list(mod.STEPS), seqlens=None, masks=None,
                            impls=None, master_port=1, bench_args=[], tag="")
    cmds = mod.step_commands(ns)
    assert list(cmds) == list(mod.STEPS)
    for name in ("dist_check", "calibrate", "bench", "train"):
        assert cmds[name][cmds[name].index("--nproc-per-node") + 1] == "1"
    assert cmds["train"][-2:] == ["--tokens-per-gpu", "8192,16384,32768"] and cmds["host"][1].endswith("host_path.py")
    bench = cmds["bench"]
    assert bench[bench.index("--seqlens") + 1] == "131072,262144" and "--device" not in bench
    assert cmds["scaling"][cmds["scaling"].index("--cps") + 1] == "8,16,32,64"
    # arguments after "--" reach bench_dist as they are; other head counts get a file tag of their own
    ns.bench_args, ns.seqlens = ["--heads", "64", "--kv-heads", "8"], "32768"
    bench = mod.step_commands(ns)["bench"]
    assert bench[-4:] == ["--heads", "64", "--kv-heads", "8"] and bench[bench.index("--tag") + 1] == "_s32768_hq64"
    ns.bench_args, ns.seqlens = [], None
    ns.dry_run, ns.nproc = True, 2
    assert list(mod.step_commands(ns)) == [s for s in mod.STEPS if s not in mod.GPU_ONLY]
    with pytest.raises(ValueError, match="unknown step"):
        mod.main(["--out", "o", "--dry-run", "--steps", "bench,nope"])


def test_bench_nodes_emulates_a_topology_and_counts_bytes_across_it(tmp_path, monkeypatch):
    """bench_dist --nodes 2 on 4 processes: megatron-cp planned for 2 nodes of 2 with hierarchical routes; its
    rows record the K/V bytes crossing the node boundary beside the flat routes' and the flat plan's, and the
    topology-aware plan moves no more across it than the flat plan (causal: less)."""
    bench = os.path.join(ROOT, "tools", "bench_dist.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
           bench, "--dry-run", "--nodes", "2", "--seqlens", "256", "--masks", "causal,packed",
           "--impls", "megatron-cp", "--out", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    [path] = [p for p in os.listdir(tmp_path) if p.endswith(".json")]
    with open(tmp_path / path) as f:
        record = json.load(f)
    assert record["nodes"] == 2
    rows = {r["mask"]: r for r in record["results"] if r["impl"] == "megatron_cp"}  # --impls megatron-cp: read as it
    assert set(rows) == {"causal", "packed"} and all("error" not in r for r in rows.values())
    for r in rows.values():
        assert 0 < r["inter_node_bytes"] <= r["inter_node_bytes_flat_routes"] <= r["kv_bytes"], r
        assert r["inter_node_bytes"] <= r["flat_plan_inter_node_bytes"], r
    assert rows["causal"]["inter_node_bytes"] < rows["causal"]["flat_plan_inter_node_bytes"]
    monkeypatch.setenv("WORLD_SIZE", "4")  # refused before any process group is made
    with pytest.raises(SystemExit, match="--nodes 3 must be >= 1 and divide the 4 processes"):
        load_script(bench).main(["--dry-run", "--nodes", "3"])
