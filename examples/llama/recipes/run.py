#!/usr/bin/env python3
"""Convergence recipes: a ~300M Llama (GQA, RoPE, SwiGLU) on packed documents at 32k tokens, trained under
megatron-cp's context parallelism beside CP = 1 from the same weights on the same batches.

    python examples/llama/recipes/run.py dense                 # 4 GPUs: CP 4 vs CP 1 (DP 4), bf16 + fp32 check
    python examples/llama/recipes/run.py tp2cp2_sp pp2cp2      # TP 2 x CP 2 + SP; PP 2 x CP 2
    python examples/llama/recipes/run.py moba xattention       # sparse attention against the dense run
    python examples/llama/recipes/run.py gates                 # DuoAttention + PruLong gates at 64k, CP 4
    python examples/llama/recipes/run.py dense --gpus 1 --steps 20     # one GPU: the runs that fit (CP 1)
    python examples/llama/recipes/run.py all --size tiny --cpu         # every recipe, tiny, 4 CPU processes
    python examples/llama/recipes/run.py dense --size small --gpus 4 --share-gpu   # 4 ranks on one GPU (no timing)
    python examples/llama/recipes/run.py convergence --size small --gpus 1 --runs cp1_seed1,cp1_seed2,cp1_seed3
    python examples/llama/recipes/run.py convergence --size small --gpus 4 --share-gpu --runs cp4_seed1,cp4_seed2
    sbatch examples/llama/recipes/recipe.sbatch dense                  # the same on a SLURM node

Each recipe writes ``results.json`` (device, date, command, losses, throughput, the checks) and a PNG into
``--out``/NAME; ``--runs`` picks runs by name, merged into an existing ``results.json`` (to split one recipe
over several time-limited calls); ``--out``/progress.jsonl gets every step of every run as it ends (what a time
limit leaves of a run before its results.json). A run longer than one call: ``--checkpoint DIR --time-limit
SECONDS`` saves its state and stops before the limit, and the same command again continues it. The model code
is examples/tiny_llama (Megatron-Core's GPTModel with megatron-cp's core attention and batch hook); the data are the Python standard library's sources, bytes as
tokens, cut into documents that end with EOD (no download).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import shlex
import sys
from dataclasses import asdict, replace
from pathlib import Path
import numpy as np

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parents[1]
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

from tiny_llama.convergence import (SAVE_EVERY, Job, Layout, Run, Train, compare, run_record,  # noqa: E402
                                    sign_figure, spawn_jobs, tokens_per_s_per_gpu)
from tiny_llama.model import LlamaShape  # noqa: E402

from megatron_cp.comm import shared_gpu  # noqa: E402

# ~293M parameters: 26 layers x (attention 2.6M + SwiGLU MLP 8.7M), byte vocabulary; head dim 128, GQA 8:2
LLAMA_300M = LlamaShape(num_layers=26, hidden_size=1024, num_attention_heads=8, num_query_groups=2,
                        ffn_hidden_size=2816, vocab_size=320, seq_length=32768, rotary_base=500000)
# ~1.45B: 32 layers x (attention 10.5M + SwiGLU MLP 34.6M), head dim 128, GQA 16:4 (the throughput runs' larger model)
LLAMA_1_5B = LlamaShape(num_layers=32, hidden_size=2048, num_attention_heads=16, num_query_groups=4,
                        ffn_hidden_size=5632, vocab_size=320, seq_length=32768, rotary_base=500000)
# ~14M: 4 layers, head dim 128, GQA 4:2, 8k tokens: the parity recipes with ranks sharing one GPU (--share-gpu)
SMALL = LlamaShape(num_layers=4, hidden_size=512, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=1408,
                   vocab_size=320, seq_length=8192, rotary_base=500000)
TINY = LlamaShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=176,
                  vocab_size=320, seq_length=128)

# Done-when thresholds of the parity recipes (bf16 every logged step, bf16 mean of the last 100, fp32 first 20)
BF16_STEP, BF16_MEAN, FP32_STEP, FP32_STEPS = 1e-2, 5e-3, 1e-5, 20
MEAN_WINDOW = 20  # steps the figure's signed difference is averaged over
NOISE_FLOOR = "cp1_again"


def _base(size: str, **kw) -> Train:
    if size == "tiny":
        t = Train(shape=TINY, steps=2, global_batch=4, lr=3e-3, min_lr=3e-3, doc_lengths=(16, 96), recursive=False)
    elif size == "small":
        t = Train(shape=SMALL, steps=100, global_batch=4, lr=1e-3, min_lr=1e-4, warmup=10, doc_lengths=(128, 4096))
    else:
        # activation recompute: 32k tokens of this model without it need more than an 80 GB GPU holds (fp32)
        t = Train(shape=LLAMA_300M, steps=300, global_batch=8, lr=3e-4, min_lr=3e-5, warmup=30,
                  doc_lengths=(256, 16384), recompute=True)
    return replace(t, **kw)


def _parity(layout: Layout):
    def jobs(size: str, gpus: int, steps: int | None, pretrain_steps: int | None) -> list[Job]:
        runs = [Run("cp1", Layout()), Run(layout.name, layout)]
        bf16 = _base(size, **({"steps": steps} if steps else {}))
        # the bf16 noise floor: CP 1 trained again (its non-deterministic kernels, e.g. the attention backward's
        # atomic dQ sums, reduce in another order), compared with cp1 like the layout is; and the layout trained
        # again: whether a drift of the layout from CP 1 beyond CP 1's own spread repeats (one run of each side
        # cannot tell a systematic difference from bf16 chaos)
        floor = [Run(NOISE_FLOOR, Layout()), Run(f"{layout.name}_again", layout)]
        # fp32 runs our Triton kernels in IEEE fp32 (no tensor cores): ~10 s per 32k sequence on an H100, so
        # this check trains one sequence per data-parallel rank
        fp32 = replace(bf16, dtype="fp32", steps=min(bf16.steps, 2 if size == "tiny" else FP32_STEPS), warmup=0,
                       global_batch=bf16.global_batch if size == "tiny" else 4)
        return [Job(bf16, runs + floor), Job(fp32, runs)]
    return jobs


def _sparse(method: str, params: dict, finetune: bool):
    def jobs(size: str, gpus: int, steps: int | None, pretrain_steps: int | None) -> list[Job]:
        layout = Layout(cp=gpus)
        start = "pretrained" if finetune else "init"
        runs = [Run("dense", layout, start=start), Run(method, layout, (method, params), start)]
        if size == "tiny":
            t = _base(size, shape=replace(TINY, seq_length=256), speed_lengths=(256,), speed_steps=1)
        else:
            t = _base(size, speed_lengths=(32768, 65536))
        if finetune:  # dense pretraining, then the two branches continue from the same weights and optimiser
            t = replace(t, pretrain_steps=2 if size == "tiny" else 200, steps=2 if size == "tiny" else 100,
                        finetune_lr=t.min_lr)
        if steps:
            t = replace(t, steps=steps)
        if finetune and pretrain_steps:
            t = replace(t, pretrain_steps=pretrain_steps)
        return [Job(t, runs)]
    return jobs


SEEDS = {"cp1": 3, "cp4": 2}  # data orders (Run.data_seed) of the convergence recipe's reference and CP layout
DP_RUN = "cp1_dp4"  # the convergence recipe's CP 1 at DP 4 (another arrangement of the same micro-batches)
HELD_OUT_BAND = 2.0  # standard deviations of CP 1's held-out losses over its seeds: the spread a layout must stay in


def _convergence(size: str, gpus: int, steps: int | None, pretrain_steps: int | None) -> list[Job]:
    """CP 4 against CP 1 in the same arrangement (DP 1: every micro-batch of the global batch on one CP group), each
    over several data orders of the training files (no document twice), with a held-out loss along the way."""
    t = _base(size, split_data=True, held_out_every=1 if size == "tiny" else 10,
              held_out_samples=4, **({"steps": 150} if size == "small" else {}))
    if steps:
        t = replace(t, steps=steps)
    layouts = (("cp1", Layout()), ("cp4", Layout(cp=4)))
    runs = [Run(f"{name}_seed{s}", layout, data_seed=s, dp=1) for name, layout in layouts for s in range(1, SEEDS[name] + 1)]
    # CP 1 in DP 4's arrangement (one micro-batch per rank, gradients summed over ranks instead of accumulated on
    # one) on seed 1's data: how far the micro-batch arrangement alone moves a bf16 run, beside how far CP 4 does
    return [Job(t, runs + [Run(f"{DP_RUN}_seed1", Layout(), data_seed=1, dp=4)])]


RECIPES = {
    "dense": ("CP 4 (megatron-cp) vs CP 1 (DP 4), packed documents at 32k", _parity(Layout(cp=4))),
    "tp2cp2_sp": ("TP 2 x CP 2 with sequence parallelism vs CP 1", _parity(Layout(tp=2, cp=2, sp=True))),
    "pp2cp2": ("PP 2 x CP 2 (Megatron's 1F1B schedule) vs CP 1", _parity(Layout(cp=2, pp=2))),
    "moba": ("--cp-sparse moba from scratch vs dense, CP = all GPUs", _sparse("moba", {"block": 512, "top_k": 3},
                                                                             False)),
    "xattention": ("XAttention fine-tuning of a dense-pretrained model vs dense fine-tuning",
                   _sparse("xattention", {"block": 128, "stride": 8, "threshold": 0.9}, True)),
    "gates": ("DuoAttention + PruLong head gates at 64k (examples/tiny_llama/train_gates.py)", None),
    "convergence": ("CP 4 vs CP 1 at DP 1, over data orders of never-repeated files, with a held-out loss",
                    _convergence),
}
TINY_SPARSE = {"moba": {"block": 32, "top_k": 2}, "xattention": {"block": 32, "stride": 8, "threshold": 0.9}}


def gates_argv(size: str, gpus: int, cpu: bool) -> list[str]:
    """The gate recipe's train_gates flags: tiny = its CPU test's (seq 64, CP 2); full = 64k tokens, CP = gpus, bf16:
    a curriculum from 64 to 65536 tokens, RoPE base 1e8 (content lookups across 64k tokens need rotary pairs that
    barely turn over that distance), 2 key digits. On one H100 at CP 1 this model retrieves at 64k (digit accuracy
    0.42, chance 0.1; benchmarks/2026-11-24_1xH100_gates64k); with RoPE base 1e6 (on a shorter curriculum) it did
    not."""
    if size == "tiny":
        return ["--method", "both", "--cp", "2"]
    return ["--method", "both", "--cp", str(gpus), "--device", "cpu" if cpu else "cuda", "--dtype", "bf16",
            "--seq-length", "65536", "--digits", "2", "--layers", "2", "--hidden", "256", "--heads", "4",
            "--kv-heads", "4", "--sink", "64", "--window", "256", "--rotary-base", "100000000", "--pretrain-lr", "1e-2",
            "--schedule", "64:1500:64,1024:400:16,8192:400:4,65536:600:2", "--gate-batch", "1", "--gate-steps", "40",
            "--eval-samples", "64", "--sparsities", "0.5,0.75", "--time-steps", "5"]


def jobs_for(name: str, size: str, gpus: int, steps: int | None = None, pretrain_steps: int | None = None
             ) -> list[Job]:
    jobs = RECIPES[name][1](size, gpus, steps, pretrain_steps)
    if size == "tiny" and name in TINY_SPARSE:
        for j in jobs:
            j.runs = [replace(r, sparse=(r.sparse[0], TINY_SPARSE[name])) if r.sparse else r for r in j.runs]
    return jobs


# ------------------------------------------------------------------------------------------ reports

def summarize(name: str, jobs: list[Job], results: list[dict]) -> dict:
    """The recipe's figures and checks from its jobs' raw results."""
    out = {"jobs": []}
    for job, res in zip(jobs, results):
        runs = res["runs"]
        entry = {"train": _train_json(job.train), "runs": runs,
                 "pretrain_losses": res.get("pretrain_losses")}
        for r in runs.values():
            r["tokens_per_s_per_gpu"] = tokens_per_s_per_gpu(r)
        out["jobs"].append(entry)
    checks = {}
    kind = "parity" if name in ("dense", "tp2cp2_sp", "pp2cp2") else name if name == "convergence" else "sparse"
    if kind == "convergence":
        out.update(convergence_checks(out["jobs"][0]["runs"]))
        checks = out.pop("checks")
    elif kind == "parity":
        for j, entry in enumerate(out["jobs"]):
            runs = entry["runs"]
            if "cp1" not in runs:
                continue
            for rn, r in runs.items():
                if rn == "cp1":
                    continue
                c = compare(runs["cp1"]["losses"], r["losses"])
                if entry["train"]["dtype"] == "bf16":
                    checks[f"{rn} bf16 max rel diff <= {BF16_STEP:g}"] = [c["max_rel_diff"], c["max_rel_diff"] <= BF16_STEP]
                    checks[f"{rn} bf16 mean of last {c['last']} within {BF16_MEAN:g}"] = [
                        c["mean_last_rel_diff"], c["mean_last_rel_diff"] <= BF16_MEAN]
                    if r["tokens_per_s_per_gpu"] is not None:  # None: ranks shared a GPU
                        checks[f"{rn} tokens/s per GPU (cp1: {runs['cp1']['tokens_per_s_per_gpu']:.0f})"] = [
                            r["tokens_per_s_per_gpu"], None]
                else:
                    checks[f"{rn} fp32 max rel diff over {len(r['losses'])} steps <= {FP32_STEP:g}"] = [
                        c["max_rel_diff"], c["max_rel_diff"] <= FP32_STEP]
    else:
        runs = out["jobs"][0]["runs"]
        sparse = [k for k in runs if k != "dense"]
        if "dense" in runs:
            for rn in sparse:
                c = compare(runs["dense"]["losses"], runs[rn]["losses"])
                gap = [(b - a) / a for a, b in zip(runs["dense"]["losses"], runs[rn]["losses"])]
                checks[f"{rn} loss gap at the last step (relative)"] = [gap[-1], None]
                k = c["last"]
                a, b = runs["dense"]["losses"][-k:], runs[rn]["losses"][-k:]
                checks[f"{rn} loss gap, mean of the last {k} steps (relative)"] = [(sum(b) - sum(a)) / sum(a), None]
                for length, sec in runs[rn]["speed_seconds"].items():
                    checks[f"{rn} step speed-up over dense at {length} tokens (timed apart, after a warm-up step)"] = [
                        runs["dense"]["speed_seconds"][length] / sec, None]
    out["checks"] = checks
    return out


def convergence_checks(runs: dict) -> dict:
    """The convergence recipe's evidence: ``seeds`` (each layout's runs), ``held_out`` (CP 1's mean and standard
    deviation over its seeds at every evaluation, and each run's values) and the checks: every CP 4 held-out loss
    (and CP 1 at DP 4's) inside CP 1's mean +- HELD_OUT_BAND sd; its train loss at each step no farther from CP 1's on the same data
    order (seeds pair up) than CP 1's seeds ever are from each other; CP 1's held-out loss falling by >= 30% (enough
    training for the comparison to mean something)."""
    seeds = {k: sorted(n for n in runs if n.startswith(k + "_seed")) for k in SEEDS}
    out = {"seeds": seeds, "held_out": {}, "checks": {}}
    ref = [runs[n] for n in seeds["cp1"]]
    if len(ref) < 2:
        return out
    steps = [s for s, _ in ref[0]["held_out"]]
    ho = np.array([[v for _, v in r["held_out"]] for r in ref])
    mean, sd = ho.mean(0), ho.std(0, ddof=1)
    out["held_out"] = {"steps": steps, "cp1_mean": mean.tolist(), "cp1_sd": sd.tolist(),
                       "runs": {n: [v for _, v in runs[n]["held_out"]] for n in runs}}
    train = np.array([r["losses"] for r in ref])
    floor = float((train.max(0) - train.min(0)).max())  # the widest spread of CP 1's seeds at any step
    checks = out["checks"]
    checks[f"cp1 held-out loss falls >= 30% (step {steps[0]} -> {steps[-1]})"] = [
        float(1 - mean[-1] / mean[0]), bool(mean[-1] <= 0.7 * mean[0])]
    for n in seeds["cp4"] + sorted(n for n in runs if n.startswith(DP_RUN + "_seed")):
        v = np.array(out["held_out"]["runs"][n])
        z = float(np.max(np.abs(v - mean) / np.maximum(sd, 1e-12)))
        checks[f"{n} held-out loss within cp1 mean +- {HELD_OUT_BAND:g} sd at every evaluation (max |z|)"] = [
            z, bool(z <= HELD_OUT_BAND)]
        pair = "cp1_seed" + n.rsplit("_seed", 1)[1]
        if pair in runs:
            dev = float(np.abs(np.array(runs[n]["losses"]) - np.array(runs[pair]["losses"])).max())
            checks[f"{n} train loss: max |{n} - {pair}| over steps within cp1 seeds' widest spread ({floor:.4f})"] = [
                dev, bool(dev <= floor)]
    return out


def plot_convergence(summary: dict, path: Path) -> None:
    """Train losses of every run (CP 1's seeds grey) and held-out losses against CP 1's spread band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(20, 4.4))
    runs = summary["jobs"][0]["runs"]
    for n, r in runs.items():
        ax0.plot(range(1, len(r["losses"]) + 1), r["losses"], lw=0.8, label=n,
                 color="0.6" if n.startswith("cp1_seed") else None)
    ax0.set(xlabel="step", ylabel="train loss (nats / byte)", title="train loss (no document twice)")
    ho = summary.get("held_out") or {}
    if ho:
        s, m, sd = np.array(ho["steps"]), np.array(ho["cp1_mean"]), np.array(ho["cp1_sd"])
        ax1.fill_between(s, m - HELD_OUT_BAND * sd, m + HELD_OUT_BAND * sd, color="0.85",
                         label=f"cp1 mean +- {HELD_OUT_BAND:g} sd ({len(summary['seeds']['cp1'])} seeds)")
        ax1.plot(s, m, color="0.4", lw=1, label="cp1 mean")
        for n in [n for n in ho["runs"] if not n.startswith("cp1_seed")]:
            ax1.plot(s, ho["runs"][n], marker=".", lw=1, label=n)
    ax1.set(xlabel="step", ylabel="held-out loss", title="held-out files, never trained on")
    ref = [runs[n]["losses"] for n in summary["seeds"]["cp1"]]
    if len(ref) > 1:  # each run's distance to CP 1 on the same data order, against the widest spread of CP 1's seeds
        width = min(map(len, ref))
        spread = np.ptp(np.array([r[:width] for r in ref]), axis=0)
        ax2.semilogy(range(1, width + 1), np.maximum(spread, 1e-7), color="0.6", lw=0.8, label="cp1 seeds: max - min")
        for n, r in runs.items():
            pair = "cp1_seed" + n.rsplit("_seed", 1)[-1]
            if not n.startswith("cp1_seed") and pair in runs:
                d = np.abs(np.array(r["losses"]) - np.array(runs[pair]["losses"][:len(r["losses"])]))
                ax2.semilogy(range(1, len(d) + 1), np.maximum(d, 1e-7), lw=0.8, label=f"|{n} - {pair}|")
        ax2.set(xlabel="step", ylabel="train loss difference", title="same data order: distance to CP 1 (floor 1e-7)")
    for ax in (ax0, ax1, ax2):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    sign_figure(fig, summary)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(name: str, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.2))
    main = next((e for e in summary["jobs"] if e["runs"]), summary["jobs"][0])  # --precision may leave the first empty
    for rn, r in main["runs"].items():
        axes[0].plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{rn} ({r['layout']})", lw=1)
    if main.get("pretrain_losses"):
        p = main["pretrain_losses"]
        axes[0].plot(range(-len(p) + 1, 1), p, color="gray", lw=1, label="dense pretraining")
    axes[0].set(xlabel="step", ylabel="loss (nats / byte)", title=f"{name}: {main['train']['dtype']} loss")
    ref = "cp1" if any("cp1" in e["runs"] for e in summary["jobs"]) else "dense"  # --runs may train it apart
    for entry in summary["jobs"]:
        runs = entry["runs"]
        if ref not in runs:
            continue
        for rn, r in runs.items():
            if rn == ref:
                continue
            a, b = runs[ref]["losses"], r["losses"]
            diff = [abs(x - y) / abs(x) for x, y in zip(a, b)]
            axes[1].semilogy(range(1, len(diff) + 1), [max(d, 1e-12) for d in diff], lw=1,
                             label=f"|{rn} - {ref}| / {ref}, {entry['train']['dtype']}")
    if ref == "cp1":
        axes[1].axhline(BF16_STEP, color="red", ls="--", lw=0.8, label=f"bf16 bound {BF16_STEP:g}")
        axes[1].axhline(FP32_STEP, color="purple", ls=":", lw=0.8, label=f"fp32 bound {FP32_STEP:g}")
    axes[1].set(xlabel="step", ylabel="relative loss difference", title="difference to " + ref)
    # the signed difference averaged over a window: a drift above what the noise floor shows, step noise averaged out
    if ref in main["runs"]:
        a = np.asarray(main["runs"][ref]["losses"], dtype=np.float64)
        w = min(MEAN_WINDOW, len(a))
        for rn, r in main["runs"].items():
            n = min(len(a), len(r["losses"]))
            if rn != ref and 0 < w <= n:
                d = np.asarray(r["losses"][:n], dtype=np.float64) / a[:n] - 1
                axes[2].plot(range(w, n + 1), 100 * np.convolve(d, np.ones(w) / w, "valid"), lw=1,
                             label=f"({rn} - {ref}) / {ref}")
        if ref == "cp1":
            axes[2].axhspan(-100 * BF16_MEAN, 100 * BF16_MEAN, color="gray", alpha=0.15,
                            label=f"mean bound {100 * BF16_MEAN:g}%")
        axes[2].axhline(0, color="black", lw=0.5)
        axes[2].set(xlabel="step", ylabel="% (mean of the last steps)",
                    title=f"{main['train']['dtype']}: signed difference, mean of {w} steps")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:  # a subset of runs (--runs) may draw nothing here
            ax.legend(fontsize=8)
    fig.tight_layout()
    sign_figure(fig, summary)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _train_json(train: Train):
    return json.loads(json.dumps({**asdict(train), "shape": asdict(train.shape)}))


def _with_earlier(path: Path, jobs: list[Job], res: list[dict]) -> tuple[list[dict], str | None]:
    """``res`` with the runs an earlier ``--runs`` call wrote to ``path`` for the same training settings
    added (runs trained now replace theirs); and that call's command."""
    if not path.exists():
        return res, None
    old = json.loads(path.read_text())
    if len(old.get("jobs", [])) != len(jobs) or any(o["train"] != _train_json(j.train)
                                                    for o, j in zip(old["jobs"], jobs)):
        return res, None
    merged = [{"runs": {**o["runs"], **r["runs"]}, "pretrain_losses": r["pretrain_losses"] or o["pretrain_losses"]}
              for o, r in zip(old["jobs"], res)]
    return merged, old.get("command")


def leak_check(plan, a, meta) -> dict:
    """--leak-check: every selected run of each recipe on the same split samples, fp32 runs first (the first run
    is the gradients' reference); the plans of every row the recipe trains on (each CP layout's, on the host); and
    every token row's count of kept keys through the kernels the runs use, at each CP size (leak.count_worker);
    results to <out>/<recipe>/leak.json."""
    import torch
    from tiny_llama import leak
    from tiny_llama.convergence import Corpus
    from tiny_llama.trainer import spawn

    report, leaked = {}, []
    for n, jobs in plan:
        pairs = sorted(((j.train, r) for j in jobs for r in j.runs), key=lambda p: p[0].dtype != "fp32")
        if not pairs:
            continue
        leak.check_runs(pairs)
        train = pairs[0][0]
        length = train.shape.seq_length
        samples = max((j.train.pretrain_steps + j.train.steps) * j.train.global_batch for j in jobs)
        corpus = Corpus(train, length, samples)
        # the rows of every data order the selected runs train on (a data seed reorders the training files)
        orders = sorted({r.data_seed for _, r in pairs})
        trained = torch.cat([(corpus if s == 0 else Corpus(train, length, samples, data_seed=s)).batch(
            0, samples)[0] for s in orders])
        layouts = {r.layout.name: (r.layout.cp, r.options(t)) for t, r in pairs if r.layout.cp > 1}
        wrong = leak.plan_errors(list(trained), train.mask_spec(), layouts)
        backend = "gloo" if a.cpu else shared_gpu.BACKEND if a.share_gpu else "nccl"
        res = spawn(leak.worker, a.gpus, pairs, corpus.batch(0, a.leak_check)[:2], "cpu" if a.cpu else "cuda",
                    backend=backend, timeout_s=1800) if a.leak_check else []
        # every trained row's kept-key count through the kernels, at each CP size (one CP group of that many
        # ranks; the lowest-precision dtype the recipe trains in)
        sh, dtype = train.shape, min((t.dtype for t, _ in pairs), key=lambda d: d != "bf16")
        counts = {}
        for t, r in pairs:
            cp, tp = r.layout.cp, r.layout.tp
            if cp > 1 and cp not in counts and cp <= a.gpus:
                heads = (sh.num_attention_heads // tp, sh.num_query_groups // tp,
                         sh.hidden_size // sh.num_attention_heads)
                counts[cp] = spawn(leak.count_worker, cp, list(trained), t.mask_spec(), r.options(t), heads,
                                   "cpu" if a.cpu else "cuda", dtype, backend=backend, timeout_s=1800)
        print(f"\n== {n} --leak-check ({meta['device']}, world {a.gpus}, {a.leak_check} samples of {length})")
        print("\n".join("  " + line for line in leak.report(res)) if res else "  (no model runs: 0 samples)")
        for name, k in wrong.items():
            print(f"  plans of the {len(trained)} training rows at {name}: {k} cover other keys than the mask")
        for cp, c in counts.items():
            print(f"  kept keys of every token row ({c['token_rows']} rows of {c['rows']} training rows) at cp {cp}, "
                  f"{c['dtype']} on {c['kernels']}: {c['wrong_token_rows']} wrong" +
                  (f" (row, local row, counted, mask's: {c['wrong']})" if c["wrong"] else ""))
        folder = Path(a.out) / n
        folder.mkdir(parents=True, exist_ok=True)
        report[n] = {**meta, "recipe": n, "samples": a.leak_check, "runs": res,
                     "plans": {"rows": len(trained), "wrong_rows": wrong},
                     "kept_key_counts": {str(cp): c for cp, c in counts.items()}}
        (folder / "leak.json").write_text(json.dumps(report[n], indent=1) + "\n")
        leaked += [f"{n} {r['dtype']} {r['run']}" for r in res if r["high_max"] != 0]
        leaked += [f"{n} plans at {name}" for name, k in wrong.items() if k]
        leaked += [f"{n} kept-key counts at cp {cp}" for cp, c in counts.items() if c["wrong_token_rows"]]
    if leaked:
        print(f"\nLEAK: {', '.join(leaked)}")
        raise SystemExit(1)
    return report


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipes", nargs="+", help=f"names ({', '.join(RECIPES)}) or 'all'")
    ap.add_argument("--size", choices=("full", "small", "tiny"), default="full",
                    help="full: ~293M at 32k tokens; small: ~14M at 8k (fits ranks sharing one GPU); tiny: CPU tests")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU processes (default: NCCL, one process per GPU)")
    ap.add_argument("--gpus", type=int, default=None, help="world size (default: every visible GPU; 4 with --cpu)")
    ap.add_argument("--share-gpu", action="store_true",
                    help="--gpus ranks spread over the visible GPUs (e.g. 4 on one), gloo through host copies: to check "
                         "layouts where GPUs are few; correctness only (no tokens/s, no step times)")
    ap.add_argument("--steps", type=int, default=None, help="override the recipe's training steps")
    ap.add_argument("--pretrain-steps", type=int, default=None, help="override a fine-tuning recipe's dense "
                                                                      "pretraining steps")
    ap.add_argument("--precision", choices=("both", "bf16", "fp32"), default="both",
                    help="the parity recipes' bf16 training, their fp32 check, or both")
    ap.add_argument("--runs", default=None, help="comma-separated run names to train (default: all of the recipe's "
                                                 "that fit the world)")
    ap.add_argument("--out", default="out/recipes", help="one folder per recipe under this (default out/recipes)")
    ap.add_argument("--checkpoint", default=None, metavar="DIR",
                    help="save each run's state here (every rank's, every --checkpoint-every steps and where it "
                         "stops; a fine-tuning recipe's pretraining too); a run found here continues from it, one "
                         "found complete is not trained again")
    ap.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                    help="steps between --checkpoint saves (default 50; ~3.5 GB a rank for the 300M model)")
    ap.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                    help="with --checkpoint: stop before a step that would end past this many seconds after the "
                         "start (a job's time limit); the same command again continues")
    ap.add_argument("--leak-check", type=int, nargs="?", const=2, default=None, metavar="SAMPLES",
                    help="instead of training: one forward-backward of each run on SAMPLES corpus rows (default 2, "
                         "each its own plan; 0: none) where a leak past the mask shows as a nonzero gradient "
                         "(tiny_llama/leak.py), gradients against the first run's; and the plan of every row the "
                         "recipe trains on checked against its mask (host only); exit 1 on a leak")
    a = ap.parse_args(argv)
    if a.checkpoint_every is not None and (a.checkpoint is None or a.checkpoint_every < 1):
        ap.error(f"--checkpoint-every needs --checkpoint and a positive step count, got {a.checkpoint_every}")
    if a.leak_check is not None and a.leak_check < 0:
        ap.error(f"--leak-check takes a number of samples >= 0, got {a.leak_check}")
    if a.time_limit is not None and (a.checkpoint is None or not a.time_limit > 0):
        ap.error(f"--time-limit needs --checkpoint (where a stopped run continues from) and a positive number of "
                 f"seconds, got --time-limit {a.time_limit} --checkpoint {a.checkpoint}")
    names = list(RECIPES) if a.recipes == ["all"] else a.recipes
    for n in names:
        if n not in RECIPES:
            ap.error(f"unknown recipe {n!r}; choose from {', '.join(RECIPES)} or all")
    import torch

    if a.gpus is None:
        a.gpus = 4 if a.cpu else torch.cuda.device_count()
    if a.gpus < 1:
        ap.error(f"--gpus must be >= 1 (found {a.gpus} GPUs; use --cpu for CPU processes)")
    if a.share_gpu and (a.cpu or not torch.cuda.is_available()):
        ap.error("--share-gpu spreads ranks over GPUs and none is visible" + (" (--cpu: gloo on CPU ranks already)"
                                                                               if a.cpu else ""))
    if not a.cpu and not a.share_gpu and torch.cuda.device_count() < a.gpus:
        ap.error(f"--gpus {a.gpus} but {torch.cuda.device_count()} GPU(s) visible (--share-gpu: ranks sharing GPUs, "
                 "correctness only)")
    command = "python examples/llama/recipes/run.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    meta = dict(run_record(command), size=a.size, world=a.gpus, ranks_share_gpu=a.share_gpu)

    # every training job of every recipe in one spawned world (each process starts once)
    plan = []
    for n in names:
        if n == "gates":
            continue
        jobs = jobs_for(n, a.size, a.gpus, a.steps, a.pretrain_steps)
        for j in jobs:
            fits = [r for r in j.runs if a.gpus % r.layout.size == 0 and j.train.global_batch % (
                a.gpus // r.layout.size * j.train.micro_batch) == 0 and r.dp in (None, a.gpus // r.layout.size)]
            if a.runs:
                fits = [r for r in fits if r.name in a.runs.split(",")]
            if a.precision not in ("both", j.train.dtype):
                fits = []
            j.runs = fits
        plan.append((n, jobs))
    if a.leak_check is not None:
        return leak_check(plan, a, meta)
    todo = [j for _, jobs in plan for j in jobs if j.runs]
    Path(a.out).mkdir(parents=True, exist_ok=True)
    # every step of every run as it ends (a JSON line each): what a time limit leaves before results.json
    progress = Path(a.out) / "progress.jsonl"
    got = spawn_jobs(todo, a.gpus, "cpu" if a.cpu else "cuda", progress=str(progress), checkpoint=a.checkpoint,
                     time_limit_s=a.time_limit, checkpoint_every=a.checkpoint_every or SAVE_EVERY,
                     share_gpu=a.share_gpu) if todo else []
    stop = next((r["stopped"] for r in got if "stopped" in r), None)
    if stop is not None:
        # no results.json: the runs' steps are in progress.jsonl, their state in --checkpoint
        print(f"\n-- stopped by --time-limit {a.time_limit:g} s: {stop['dtype']} {stop['run']} after step "
              f"{stop['step']} of {stop['steps']} (state in {a.checkpoint}); run the same command again to continue")
        return {"stopped": stop}
    results = iter(got)
    report = {}
    for n, jobs in plan:
        res = [next(results) if j.runs else {"runs": {}, "pretrain_losses": None} for j in jobs]
        folder = Path(a.out) / n
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "results.json"
        cmd = command
        # calls with --runs may train at the same time (e.g. CP 1 on --gpus 1 beside CP 4 on ranks sharing the
        # GPU): each adds its runs to what the folder holds under a lock, so none overwrites another's
        with open(folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if a.runs:
                res, earlier = _with_earlier(path, jobs, res)
                cmd = command if earlier is None else earlier + " ; " + command
            summary = {**meta, "command": cmd, "recipe": n, "about": RECIPES[n][0], **summarize(n, jobs, res)}
            # (job dtype, run) pairs of the recipe with no result: a layout the world does not fit, --runs,
            # --precision
            summary["not_run"] = [f"{j.train.dtype} {r.name}" for j, e in zip(
                jobs_for(n, a.size, a.gpus, a.steps, a.pretrain_steps), summary["jobs"])
                for r in j.runs if r.name not in e["runs"]]
            path.write_text(json.dumps(summary, indent=1) + "\n")
            if any(e["runs"] for e in summary["jobs"]):
                (plot_convergence(summary, folder / f"{n}.png") if n == "convergence"
                 else plot(n, summary, folder / f"{n}.png"))
        report[n] = summary
        print(f"\n== {n}: {RECIPES[n][0]}  ({meta['device']}, world {a.gpus})")
        for e in summary["jobs"]:
            for rn, r in e["runs"].items():
                n = len(r["step_seconds"])
                first = (max(1, n // 10) if n > 2 else 0) + 1  # tokens_per_s_per_gpu's default skip
                speed = "not timed (ranks shared a GPU)" if r["tokens_per_s_per_gpu"] is None else (
                    f"{r['tokens_per_s_per_gpu']:.0f} tokens/s per GPU (training steps {first}-{n}"
                    + (", the first included: compilation and planning" if first == 1 else "") + ")")
                print(f"  {e['train']['dtype']:>4} {rn:>14} ({r['layout']}, dp {r['dp']}): final loss "
                      f"{r['losses'][-1]:.4f}, {speed}")
        for k, (v, ok) in summary["checks"].items():
            print(f"  {k}: {v:.3e}" + ("" if ok is None else ("  PASS" if ok else "  FAIL")))
        if summary["not_run"]:
            print(f"  not run (world {a.gpus} does not fit them, or --runs / --precision): "
                  f"{', '.join(summary['not_run'])}")
        print(f"  -> {path}")
    if "gates" in names:
        from tiny_llama import train_gates

        folder = Path(a.out) / "gates"
        folder.mkdir(parents=True, exist_ok=True)
        argv_g = gates_argv(a.size, a.gpus, a.cpu) + ["--out", str(folder / "head_pattern.json"),
                                                      "--json", str(folder / "results.json"),
                                                      "--png", str(folder / "gates.png")]
        print(f"\n== gates: {RECIPES['gates'][0]}\n  train_gates {shlex.join(argv_g)}", flush=True)
        report["gates"] = train_gates.main(argv_g)
    return report


if __name__ == "__main__":
    main()
