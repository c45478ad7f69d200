"""The convergence recipes (examples/llama/recipes/run.py) end to end at tiny size on CPU (gloo, 4 processes):
every recipe but ``gates`` in one call of the runner, as a user types it (a process of its own); ``gates`` is train_gates with the
recipe's tiny flags, run by tests/test_head_gates.py. The parity recipes must agree with CP 1 within the
recipes' own bounds (bf16 1e-2 per step, fp32 1e-5); the sparse recipes must train and time both runs."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import megatron_helpers  # noqa: F401  (puts examples/ on sys.path)
from scripts import load_script

RUN_PY = Path(__file__).resolve().parents[1] / "examples" / "llama" / "recipes" / "run.py"
PARITY = {"dense": "cp4", "tp2cp2_sp": "tp2xcp2+sp", "pp2cp2": "cp2xpp2"}
SPARSE = ("moba", "xattention")


def load_runner():
    return load_script(RUN_PY)


@pytest.fixture(scope="module")
def runner():
    return load_runner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(each recipe's results.json, the output folder, the finished process) of one call as a user types it: no
    PYTHONPATH (run.py puts examples/ on its own path, which the rank processes' fork server must see too, or
    Megatron's start-up warnings come back unfiltered)."""
    out = tmp_path_factory.mktemp("recipes")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(RUN_PY), *PARITY, *SPARSE, "--size", "tiny", "--cpu", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=540, cwd=str(RUN_PY.parents[3]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {n: json.loads((out / n / "results.json").read_text()) for n in (*PARITY, *SPARSE)}, out, proc


@pytest.mark.parametrize("name", list(PARITY))
def test_parity_recipe_tiny(tiny, runner, name):
    report, out, _ = tiny
    rec = report[name]
    assert (out / name / f"{name}.png").stat().st_size > 10_000
    assert rec["command"].startswith("python examples/llama/recipes/run.py") and rec["world"] == 4
    other = PARITY[name]
    bf16, fp32 = rec["jobs"]
    assert bf16["train"]["dtype"] == "bf16" and fp32["train"]["dtype"] == "fp32"
    # bf16 adds the noise floor: CP 1 and the layout trained again, each compared with cp1 like the layout
    assert set(bf16["runs"]) == {"cp1", other, runner.NOISE_FLOOR, other + "_again"}
    assert set(fp32["runs"]) == {"cp1", other}
    assert bf16["runs"][runner.NOISE_FLOOR]["dp"] == 4 and bf16["runs"][other + "_again"]["dp"] == 1
    for job in (bf16, fp32):
        assert job["runs"]["cp1"]["dp"] == 4 and job["runs"][other]["dp"] == 1
        for r in job["runs"].values():
            assert len(r["losses"]) == job["train"]["steps"] and r["tokens_per_s_per_gpu"] > 0
            assert r["losses"][-1] < r["losses"][0], r["losses"]  # it learns
    # the same model and batches: fp32 within 1e-5 at every step, bf16 within 1e-2 (measured ~1e-7 / ~4e-5)
    checks = rec["checks"]
    assert len([k for k in checks if k.startswith(other)]) == 7, checks
    assert all(ok for v, ok in checks.values() if ok is not None), checks
    fp32_diff = max(abs(a - b) / a for a, b in zip(fp32["runs"]["cp1"]["losses"], fp32["runs"][other]["losses"]))
    assert fp32_diff <= 1e-5
    assert rec["not_run"] == []
    # every step of every run was also appended to progress.jsonl as it ended
    lines = [json.loads(x) for x in (out / "progress.jsonl").read_text().splitlines()]
    for job in (bf16, fp32):
        for rn, r in job["runs"].items():
            logged = [x["loss"] for x in lines if x["run"] == rn and x["dtype"] == job["train"]["dtype"]]
            assert logged[:len(r["losses"])] == r["losses"], (rn, logged, r["losses"])
    # cp1 and the noise floor are the same runs for every parity recipe of one call: trained once, shared
    for job, ref in zip(rec["jobs"], report["dense"]["jobs"]):
        assert job["runs"]["cp1"] == ref["runs"]["cp1"]
        for rn in ("cp1", runner.NOISE_FLOOR):
            once = [x for x in lines if x["run"] == rn and x["dtype"] == job["train"]["dtype"]]
            assert len(once) == (job["train"]["steps"] if rn in job["runs"] else 0), (rn, once)


def test_a_stopped_recipe_continues_where_it_stopped(tiny, runner, tmp_path):
    """--checkpoint with --time-limit: the first call stops the fine-tuning recipe's dense pretraining after its
    first step (a limit no second step fits in), writes no results and says so; the same command without the
    limit continues from the saved state, saving after every step (--checkpoint-every 1: the learning-rate
    schedule must not follow the save interval), through the pretraining and both runs to the losses the
    uninterrupted recipe (the module's call) logged."""
    argv = ["xattention", "--size", "tiny", "--cpu", "--out", str(tmp_path / "o"), "--checkpoint",
            str(tmp_path / "ck"), "--checkpoint-every", "1"]
    first = runner.main(argv + ["--time-limit", "0.001"])
    assert first == {"stopped": {"dtype": "bf16", "run": "dense pretraining", "step": 1, "steps": 2}}, first
    assert not (tmp_path / "o" / "xattention" / "results.json").exists()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [f"bf16_pretrain_rank{r}.pt" for r in range(4)]
    second = runner.main(argv)
    (job,), (whole,) = second["xattention"]["jobs"], tiny[0]["xattention"]["jobs"]
    assert job["pretrain_losses"] == whole["pretrain_losses"] and len(job["pretrain_losses"]) == 2
    for name in ("dense", "xattention"):
        got, ref = job["runs"][name], whole["runs"][name]
        assert got["losses"] == ref["losses"] and got["grad_norms"] == ref["grad_norms"], (name, got, ref)
    with pytest.raises(SystemExit):  # a limit without a folder to continue from
        runner.main(["dense", "--size", "tiny", "--cpu", "--time-limit", "10"])


@pytest.mark.parametrize("name", SPARSE)
def test_sparse_recipe_tiny(tiny, name):
    report, out, _ = tiny
    rec = report[name]
    (job,) = rec["jobs"]
    runs = job["runs"]
    assert set(runs) == {"dense", name} and (out / name / f"{name}.png").exists()
    for r in runs.values():
        assert r["layout"] == "cp4" and all(math.isfinite(x) for x in r["losses"])
        assert set(r["speed_seconds"]) == {"256"} and r["speed_seconds"]["256"] > 0
    # sparse attention changes the losses (the selectors dropped blocks), from the same start
    assert runs["dense"]["losses"] != runs[name]["losses"]
    assert abs(runs["dense"]["losses"][0] - runs[name]["losses"][0]) < 0.05 * runs["dense"]["losses"][0]
    keys = list(rec["checks"])
    assert any("speed-up over dense at 256" in k for k in keys) and any("loss gap" in k for k in keys)
    if name == "xattention":  # fine-tuning: both branches start where the dense pretraining ended
        pre = job["pretrain_losses"]
        assert len(pre) == job["train"]["pretrain_steps"] == 2
        assert runs["dense"]["losses"][0] < pre[0]


def test_gates_recipe_flags(runner):
    """The gates recipe's tiny flags are what tests/test_head_gates.py trains end to end; its full flags parse
    into a 64k, CP = GPUs configuration on CUDA with the two timed sparsities."""
    from tiny_llama.train_gates import parse

    cfg, _, _ = parse(runner.gates_argv("full", 4, False))
    assert (cfg.seq_length, cfg.cp, cfg.device, cfg.method, cfg.dtype) == (65536, 4, "cuda", "both", "bf16")
    assert cfg.levels() == [0.5, 0.75] and cfg.stages()[-1][0] == 65536


def test_runs_merge_into_earlier_results(runner, tmp_path):
    """Splitting a recipe over calls (``--runs``): a later call's runs join an earlier results.json with the same
    training settings; different settings start afresh."""
    jobs = runner.jobs_for("dense", "tiny", 4)
    path = tmp_path / "results.json"
    first = [{"runs": {"cp1": {"losses": [2.0, 1.0]}}, "pretrain_losses": None}, {"runs": {}, "pretrain_losses": None}]
    path.write_text(json.dumps({"command": "first", "jobs": [{"train": runner._train_json(j.train), **r}
                                                             for j, r in zip(jobs, first)]}))
    later = [{"runs": {"cp4": {"losses": [2.0, 1.01]}}, "pretrain_losses": None}, {"runs": {}, "pretrain_losses": None}]
    merged, cmd = runner._with_earlier(path, jobs, later)
    assert cmd == "first" and set(merged[0]["runs"]) == {"cp1", "cp4"}
    other = runner.jobs_for("dense", "tiny", 4, steps=5)
    again, cmd = runner._with_earlier(path, other, later)
    assert cmd is None and again is later


def test_bad_recipe_inputs_fail_before_spawning(runner):
    from tiny_llama.convergence import Job, Layout, Run

    with pytest.raises(SystemExit):
        runner.main(["nonsense", "--cpu"])
    with pytest.raises(SystemExit):  # ranks sharing GPUs, and there is none (or --cpu)
        runner.main(["dense", "--size", "small", "--gpus", "4", "--share-gpu"])
    with pytest.raises(SystemExit):
        runner.main(["dense", "--cpu", "--share-gpu"])
    with pytest.raises(ValueError, match="sequence parallelism needs tp >= 2"):
        Layout(cp=2, sp=True)
    with pytest.raises(ValueError, match="Layout.cp must be an int >= 1"):
        Layout(cp=0)
    train = runner.jobs_for("dense", "tiny", 4)[0].train
    with pytest.raises(ValueError, match="world size 6 is not divisible by tp\\*cp\\*pp = 4"):
        Job(train, [Run("x", Layout(cp=4))]).check(6)
    with pytest.raises(ValueError, match="3 layers do not split into pp = 2"):
        Job(type(train)(**{**train.__dict__, "shape": type(train.shape)(**{**train.shape.__dict__, "num_layers": 3})}),
            [Run("x", Layout(pp=2))]).check(2)
    with pytest.raises(ValueError, match="start 'pretrained' but pretrain_steps is 0"):
        Job(train, [Run("x", start="pretrained")]).check(1)
    # the leak check reads whole gradients: TP or PP layouts are refused by name, before any process starts
    with pytest.raises(ValueError, match="run 'tp2xcp2\\+sp': the leak check reads whole gradients"):
        runner.main(["tp2cp2_sp", "--size", "tiny", "--cpu", "--leak-check", "--precision", "fp32"])
    with pytest.raises(SystemExit):
        runner.main(["dense", "--size", "tiny", "--cpu", "--leak-check", "-1"])


def test_sbatch_dry_run_launches_the_runner():

    sbatch = RUN_PY.parent / "recipe.sbatch"
    out = subprocess.run(["bash", str(sbatch), "--dry-run", "dense", "--out", "x y"], capture_output=True, text=True,
                         check=True).stdout
    line = out.splitlines()[-1]
    assert line.startswith("srun --nodes 1 --ntasks 1") and "NCCL_NVLS_ENABLE=0" in line
    assert line.rstrip().endswith(f"{RUN_PY} dense --out x\\ y"), line


def test_throughput_tiny_on_cpu(tmp_path):
    """examples/llama/recipes/throughput.py: the same model under megatron_cp and a baseline, CP 2 on gloo; every
    run trains (finite losses), is timed and profiled, and the FLOPs count the documents' attention area."""
    thr = load_script(RUN_PY.parent / "throughput.py")
    out = tmp_path / "thr"
    s = thr.main(["--size", "tiny", "--cpu", "--gpus", "2", "--lengths", "128", "--masks", "packed,causal",
                  "--impls", "megatron_cp,ring", "--warmup", "0", "--steps", "1", "--out", str(out)])
    assert json.loads((out / "throughput.json").read_text())["rows"] == s["rows"]
    assert (out / "throughput.png").stat().st_size > 10_000
    assert [(r["mask"], r["impl"]) for r in s["rows"]] == [("packed", "megatron_cp"), ("packed", "ring"),
                                                            ("causal", "megatron_cp"), ("causal", "ring")]
    for r in s["rows"]:
        assert math.isfinite(r["loss_last"]) and r["tokens_per_s_per_gpu"] > 0 and len(r["step_seconds"]) == 1
        # CPU: the profiled step is timed; its GPU kernels by kind are none (0 ms each)
        assert r["profile"]["step_ms"] > 0 and r["profile"]["attention_ms"] == r["profile"]["communication_ms"] == 0
        # every rank's busy time gathered (none on CPU: no imbalance to speak of)
        assert r["profile"]["rank_busy_ms"] == [0.0, 0.0] and r["profile"]["busy_imbalance"] is None
    by = {(r["mask"], r["impl"]): r for r in s["rows"]}
    # the same tokens: causal over whole sequences does more attention work than within documents
    assert by["causal", "ring"]["model_tflops_per_gpu"] * by["causal", "ring"]["step_s"] > \
        by["packed", "ring"]["model_tflops_per_gpu"] * by["packed", "ring"]["step_s"]
    assert {b["best_baseline"] for b in s["vs_best_baseline"]} == {"ring"}
    with pytest.raises(SystemExit):
        thr.main(["--size", "tiny", "--cpu", "--impls", "megatron_cp,te", "--out", str(out)])


def test_throughput_dp_x_cp_layouts_train_the_same_step(tmp_path):
    """throughput.py --cp 2 on 4 gloo ranks: megatron_cp on DP 2 x CP 2 (each DP group plans its micro-batches),
    megatron_cp+over_dp (one plan per micro-batch over all four ranks) and plain DP 4 train the same first step from
    the same weights on the same global batch: equal losses within the recipes' bf16 bound."""
    thr = load_script(RUN_PY.parent / "throughput.py")
    runner = load_runner()
    s = thr.main(["--size", "tiny", "--cpu", "--gpus", "4", "--cp", "2", "--lengths", "128", "--tokens", "512",
                  "--masks", "packed", "--impls", "megatron_cp,megatron_cp+over_dp,dp", "--warmup", "0", "--steps", "1",
                  "--profile-lengths", "none", "--out", str(tmp_path)])
    losses = {r["impl"]: r["loss_last"] for r in s["rows"]}
    assert set(losses) == {"megatron_cp", "megatron_cp+over_dp", "dp"} and s["layout"].startswith("CP 2 (DP 2)")
    for impl, loss in losses.items():
        assert math.isfinite(loss) and abs(loss - losses["dp"]) <= runner.BF16_STEP * losses["dp"], losses
    # megatron_cp is compared with the other CP implementations (here: plain DP), the global plan with every layout
    assert {(b["impl"], b["best_baseline"]) for b in s["vs_best_baseline"]} == {
        ("megatron_cp", "dp"), ("megatron_cp+over_dp", max(("megatron_cp", "dp"), key=lambda i: next(
            r["tokens_per_s_per_gpu"] for r in s["rows"] if r["impl"] == i)))}
    with pytest.raises(SystemExit):  # CP must divide the GPUs
        thr.main(["--size", "tiny", "--cpu", "--gpus", "4", "--cp", "3", "--out", str(tmp_path)])


def test_profile_summary_sorts_device_work_by_kind():
    """The profiled step's GPU time by kind from torch.profiler's events: NCCL kernels are communication, FA4 /
    Triton / cuDNN attention kernels attention, every other device event the rest; host events are left out."""
    from types import SimpleNamespace as NS

    import torch

    from tiny_llama.convergence import profile_summary

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, us, dev=cuda):
        return NS(name=name, device_type=dev, time_range=NS(elapsed_us=lambda us=us: us))

    events = [ev("ncclDevKernel_AllToAll", 3000), ev("flash_fwd_sm90_kernel", 5000), ev("_attn_bwd", 2000),
              ev("ampere_bf16_gemm", 4000), ev("Memcpy HtoD (Pageable -> Device)", 500), ev("aten::mm", 9999, cpu)]
    got = profile_summary(NS(events=lambda: events), 0.02)
    assert got == dict(step_ms=20.0, attention_ms=7.0, communication_ms=3.0, rest_ms=4.5)


def test_throughput_larger_model_is_the_1_5b_llama():
    """throughput.py --size 1.5b: a ~1.45B Llama (matmul parameters as model_flops counts them) trained like the
    300M one (recompute, the stdlib documents), every implementation on the same job settings."""
    thr = load_script(RUN_PY.parent / "throughput.py")
    sh = thr.LLAMA_1_5B
    h, kv, hd = sh.hidden_size, sh.num_query_groups, sh.hidden_size // sh.num_attention_heads
    params = sh.num_layers * (2 * h * h + 2 * h * kv * hd + 3 * h * sh.ffn_hidden_size)
    assert 1.40e9 < params < 1.50e9 and hd == 128, params
    (big,) = thr.jobs_for("1.5b", 4, [32768], ["packed"], ["megatron_cp", "ring"], 65536, 1, 2, [])
    (small,) = thr.jobs_for("full", 4, [32768], ["packed"], ["megatron_cp", "ring"], 65536, 1, 2, [])
    assert big.train.shape == sh and big.train.recompute and big.train.global_batch == 2
    assert big.train.doc_lengths == small.train.doc_lengths and [r.name for r in big.runs] == ["megatron_cp", "ring"]


def test_throughput_docs_log_normal_lengths():
    """throughput.py --docs LO,HI,MEDIAN[,SIGMA]: the jobs' documents log-normal around MEDIAN within LO..HI (the DP
    x CP issue's 4k-128k corpus), cut from the stdlib stream across file ends; a malformed value is refused."""
    thr = load_script(RUN_PY.parent / "throughput.py")
    from tiny_llama.convergence import Corpus
    from tiny_llama.demo import EOD

    (job,) = thr.jobs_for("full", 4, [131072], ["packed"], ["megatron_cp"], 524288, 0, 1, [], docs="1024,131072,4096,1.5")
    t = job.train
    assert (t.doc_lengths, t.doc_median, t.doc_sigma) == ((1024, 131072), 4096, 1.5)
    tok, _, _ = Corpus(t, 131072, 4).batch(0, 4)
    row = tok.reshape(-1).numpy()
    d = np.diff(np.nonzero(row == EOD)[0]) - 1
    assert 1024 <= d.min() and d.max() <= 131072 and 2500 < np.median(d) < 6500 and d.max() > 4 * 16384, \
        (np.median(d), d.max())
    (gpt,) = thr.jobs_for("12l", 4, [16384], ["packed"], ["dp"], 65536, 0, 1, [], docs="128,8192,621")
    assert gpt.train.shape.num_layers == 12 and gpt.train.shape.hidden_size == 2048 and gpt.train.doc_sigma == 1.0
    (plain,) = thr.jobs_for("full", 4, [32768], ["packed"], ["megatron_cp"], 32768 * 4, 0, 1, [])
    assert plain.train.doc_lengths == (256, 16384) and plain.train.doc_median is None
    for bad in ("4096", "100,50", "1024,8192,16384", "1024,8192,2048,0", "a,b"):
        with pytest.raises(ValueError, match="--docs"):
            thr.jobs_for("full", 4, [32768], ["packed"], ["megatron_cp"], 32768 * 4, 0, 1, [], docs=bad)


def test_throughput_layer_window_trains_windowed_layers(tmp_path):
    """throughput.py --layer-window W,PATTERN (one layer in two windowed here, #41's mixed layers): the model's
    windowed layers run the window plan (the step trains, its loss differs from the all-full model's), and the
    FLOPs count each layer type's own area."""
    thr = load_script(RUN_PY.parent / "throughput.py")
    argv = ["--size", "tiny", "--cpu", "--gpus", "2", "--lengths", "128", "--masks", "causal", "--impls", "megatron_cp",
            "--warmup", "0", "--steps", "1", "--profile-lengths", "none"]
    win = thr.main(argv + ["--layer-window", "8,10", "--out", str(tmp_path / "w")])["rows"][0]
    full = thr.main(argv + ["--out", str(tmp_path / "f")])["rows"][0]
    assert math.isfinite(win["loss_last"]) and abs(win["loss_last"] - full["loss_last"]) > 1e-6
    (job,) = thr.jobs_for("tiny", 2, [128], ["causal"], ["megatron_cp"], 128, 0, 1, [], layer_window="8,10")
    t = job.train
    assert (t.layer_window, t.windowed_layers()) == (8, [1, 0])
    (plain,) = thr.jobs_for("tiny", 2, [128], ["causal"], ["megatron_cp"], 128, 0, 1, [])
    sh = t.shape
    hd = sh.hidden_size // sh.num_attention_heads
    # attention FLOPs: one full layer (128 x 129 / 2 cells) and one windowed (9 x 10 / 2 + 119 x 9) instead of two full
    diff = thr.model_flops(plain.train, 0) - thr.model_flops(t, 0)
    assert diff == 12.0 * sh.num_attention_heads * hd * (128 * 129 / 2 - (45 + 119 * 9)), diff
    for bad in ("8", "x,10", "8,12", "8,00"):
        with pytest.raises(ValueError, match="--layer-window"):
            thr.jobs_for("tiny", 2, [128], ["causal"], ["megatron_cp"], 128, 0, 1, [], layer_window=bad)


def test_a_recipe_prints_its_result_without_warnings(tiny):
    """The recipes' call (the module's, run as a user types it): its checks end the output and nothing warns."""
    r = tiny[2]
    assert r.stdout.strip().splitlines()[-1].strip().startswith("-> "), r.stdout[-500:]
    assert not re.search(r"Warning|IS DEPRECATED|No CUDA runtime", r.stdout + r.stderr), (r.stdout + r.stderr)[-2000:]


def test_leak_check_split_samples_keep_documents():
    from tiny_llama import leak
    from tiny_llama.demo import EOD

    row = torch.tensor([[5, 6, 7, 8, EOD, 9, 10, 11, EOD, 200, 201, 202]])
    tokens, labels, mask = leak.split_samples(row[:, :-1], row[:, 1:])
    assert tokens[0].tolist() == [5, 6, 135, 136, EOD, 9, 10, 139, EOD, 72, 201]
    assert labels[0, :-1].tolist() == tokens[0, 1:].tolist() and labels[0, -1] == 202
    # the first half of each document (an EOD ends one; the last runs to the sample's end) counts
    assert mask[0].tolist() == [1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 0]


def test_leak_check_tiny_finds_no_leak_and_cp4_gradients_match(runner, tmp_path):
    report = runner.main(["dense", "--size", "tiny", "--cpu", "--leak-check", "--out", str(tmp_path)])
    runs = {f"{r['dtype']} {r['run']}": r for r in report["dense"]["runs"]}
    assert set(runs) == {"fp32 cp1", "fp32 cp4", "bf16 cp1", "bf16 cp4", "bf16 cp1_again", "bf16 cp4_again"}
    assert list(runs)[0] == "fp32 cp1"  # the gradients' reference
    for r in runs.values():
        assert r["high_max"] == 0.0 and r["low_max"] > 1e-3, r
    assert max(runs["fp32 cp4"]["rel_diff"].values()) < 1e-5
    # bf16 at CP 4 lies as far from fp32 as bf16 at CP 1 does (measured 5.4e-3 vs 5.3e-3 median)
    med = {k: float(np.median(list(runs[k]["rel_diff"].values()))) for k in ("bf16 cp1", "bf16 cp4")}
    assert med["bf16 cp4"] < 1.5 * med["bf16 cp1"] < 3e-2, med
    # and the plan of every row the recipe trains on (2 steps x 4 rows) covers its mask exactly
    assert report["dense"]["plans"] == {"rows": 8, "wrong_rows": {"cp4": 0}}
    # and every token row's kept keys, counted through the kernels at cp 4 (lse of q = k = 0)
    c = report["dense"]["kept_key_counts"]["4"]
    assert (c["rows"], c["token_rows"], c["wrong_token_rows"], c["cp"], c["kernels"]) == (8, 8 * 128, 0, 4, "reference")
    assert json.loads((tmp_path / "dense" / "leak.json").read_text())["runs"] == report["dense"]["runs"]


def test_kept_key_count_sees_another_mask():
    """The count check can fail: rows planned under the packed mask and counted against the causal one (every row
    past a document's start keeps more keys) are wrong; against their own mask, none is."""
    from tiny_llama import leak
    from tiny_llama.convergence import Corpus, Run
    from tiny_llama.trainer import spawn

    t = load_runner()._base("tiny", dtype="fp32")
    rows = list(Corpus(t, t.shape.seq_length, 2).batch(0, 2)[0])
    opts = Run("cp2").options(t)
    args = (rows, t.mask_spec(), opts, (4, 2, 16), "cpu", "fp32")
    own = spawn(leak.count_worker, 2, *args)
    other = spawn(leak.count_worker, 2, *args, replace(t, mask="causal").mask_spec())
    assert own["wrong_token_rows"] == 0 and own["token_rows"] == 2 * t.shape.seq_length
    assert other["wrong_token_rows"] > 0 and other["wrong"][0][2] != other["wrong"][0][3]


def test_leak_check_sees_a_mask_that_leaks():
    """The check can fail: the causal mask over packed documents lets a document's rows read the previous
    document's second half, so the high bytes get gradients (the packed mask: exactly none)."""
    from dataclasses import replace

    from tiny_llama import leak
    from tiny_llama.convergence import Corpus, Run
    from tiny_llama.trainer import spawn

    t = load_runner()._base("tiny", dtype="fp32")
    batch = Corpus(t, t.shape.seq_length, 2).batch(0, 2)[:2]
    res = spawn(leak.worker, 1, [(t, Run("packed")), (replace(t, mask="causal"), Run("causal"))], batch, "cpu")
    assert res[0]["high_max"] == 0.0 and res[1]["high_max"] > 1e-3, res


def test_convergence_data_never_repeats_and_holds_files_out(runner):
    """The convergence recipe's data: training files and held-out files are disjoint (one in HELD_OUT_EVERY held
    out), a data seed only reorders the training files, and a run that needs more than the training files hold is
    refused (no document twice) rather than fed repeats."""
    from tiny_llama import convergence as cv

    t = runner.jobs_for("convergence", "tiny", 1)[0].train
    assert t.split_data and t.held_out_every == 1
    train, held = cv.corpus_files(t, "train"), cv.corpus_files(t, "held_out")
    assert not set(train) & set(held) and len(held) == -(-(len(train) + len(held)) // cv.HELD_OUT_EVERY)
    shuffled = cv.corpus_files(t, "train", data_seed=2)
    assert sorted(shuffled) == sorted(train) and shuffled != train
    a, b = cv.Corpus(t, 128, 4, data_seed=1), cv.Corpus(t, 128, 4, data_seed=2)
    assert not torch.equal(a.batch(0, 4)[0], b.batch(0, 4)[0])
    with pytest.raises(ValueError, match="no document may come twice"):
        cv.Corpus(t, 4096, 10_000)  # 41 M tokens: more than the top folder's training files hold


def test_convergence_checks_read_the_seed_spread(runner):
    """convergence_checks: CP 4's held-out losses against CP 1's mean +- 2 sd over its seeds, its train losses
    against the paired CP 1 seed within the seeds' widest spread; a layout off the band fails."""
    def run(losses, held):
        return {"losses": losses, "held_out": [[s, v] for s, v in zip((1, 10, 20), held)]}

    runs = {"cp1_seed1": run([5.0, 3.0, 2.0], [5.0, 3.0, 2.00]), "cp1_seed2": run([5.1, 3.1, 2.1], [5.1, 3.1, 2.10]),
            "cp1_seed3": run([4.9, 2.9, 1.9], [4.9, 2.9, 1.90]), "cp4_seed1": run([5.0, 3.01, 2.0], [5.02, 3.0, 2.01]),
            "cp4_seed2": run([5.1, 3.5, 2.1], [5.1, 3.6, 2.10])}
    out = runner.convergence_checks(runs)
    assert out["seeds"] == {"cp1": ["cp1_seed1", "cp1_seed2", "cp1_seed3"], "cp4": ["cp4_seed1", "cp4_seed2"]}
    assert out["held_out"]["steps"] == [1, 10, 20] and out["held_out"]["cp1_mean"] == pytest.approx([5.0, 3.0, 2.0])
    ok = {k.split(" ")[0] + (" held" if "held-out loss within" in k else " train" if "train" in k else ""): v[1]
          for k, v in out["checks"].items()}
    assert ok == {"cp1": True, "cp4_seed1 held": True, "cp4_seed1 train": True, "cp4_seed2 held": False,
                  "cp4_seed2 train": False}
