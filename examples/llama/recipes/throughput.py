#!/usr/bin/env python3
"""End-to-end training throughput: the recipes' ~300M Llama under each CP implementation of the adapter.

    python examples/llama/recipes/throughput.py --out results/throughput              # 4 GPUs, CP 4
    python examples/llama/recipes/throughput.py --size tiny --cpu --gpus 2 --out DIR  # CPU check (gloo)

For every sequence length and mask (``packed``: causal within EOD-separated documents of the stdlib corpus, as
the recipes train, or with ``--docs`` of other lengths, e.g. log-normal around 4k up to 128k; ``causal``: one causal sequence), the same model, data and optimiser step run under
``--context-parallel-impl`` megatron_cp and each baseline (``ring``, ``ulysses``, ``usp``, ``allgather``:
stand-ins for Transformer Engine's p2p, a2a, a2a+p2p and all-gather CP, on the same kernels), CP = every GPU
(DP 1). Each run trains ``--warmup`` steps (plans, kernel compilation) and ``--steps`` timed steps; a step is
``--tokens`` tokens (sequences of the length), every micro-batch planned afresh as in training, activation
recompute on (bf16, Megatron's arithmetic). Reported per run: tokens/s per GPU (median step), model TFLOP/s
per GPU (Megatron's convention: 6 x matmul parameters x tokens + 12 x attention area x query heads x head dim
x layers, recompute not counted), and at ``--profile-lengths`` one profiled step's GPU time by kind
(attention kernels, NCCL, the rest) and every rank's busy time outside NCCL (``rank_busy_ms``; the table shows
their max over mean - 1: the layout's work imbalance as measured, not as planned). Writes ``throughput.json``
and ``throughput.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parents[1]
for p in (EXAMPLES, HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from run import LLAMA_1_5B, LLAMA_300M, TINY  # noqa: E402
from tiny_llama.convergence import (Corpus, Job, Layout, Run, Train, run_record, sign_figure,  # noqa: E402
                                    spawn_jobs)
from tiny_llama.demo import EOD  # noqa: E402

IMPLS = ("megatron_cp", "ring", "ulysses", "usp", "allgather")
# beside the CP implementations (each over DP = GPUs / --cp groups): megatron-cp with one plan per micro-batch over
# the whole DP x CP world (--cp-balance-over-dp), and plain data parallelism (every GPU its own sequences, CP 1)
EXTRA = {"megatron_cp+over_dp": lambda cp: (Layout(cp=cp, over_dp=True), "megatron_cp"),
         "dp": lambda cp: (Layout(cp=1), "megatron_cp")}


def parse_docs(text: str | None, real: bool) -> dict:
    """``--docs``: ``LO,HI`` (bytes per document, uniform; the default 256,16384, tiny 16,96) or
    ``LO,HI,MEDIAN[,SIGMA]`` (log-normal around MEDIAN, sigma 1 unless given, within LO..HI) -> Train fields."""
    if text is None:
        return dict(doc_lengths=(256, 16384) if real else (16, 96))
    try:
        v = [float(x) for x in text.split(",")]
    except ValueError:
        v = []
    if len(v) not in (2, 3, 4) or not 1 <= v[0] < v[1] or (len(v) > 2 and not v[0] <= v[2] <= v[1]) or \
            (len(v) == 4 and v[3] <= 0):
        raise ValueError(f"--docs {text!r}: LO,HI or LO,HI,MEDIAN[,SIGMA] with 1 <= LO < HI, MEDIAN within "
                         "them and SIGMA > 0")
    out = dict(doc_lengths=(int(v[0]), int(v[1])))
    if len(v) > 2:
        out.update(doc_median=int(v[2]), doc_sigma=v[3] if len(v) == 4 else 1.0)
    return out


def parse_window(text: str | None) -> dict:
    """``--layer-window W,PATTERN``: windowed layers among full ones, PATTERN a string of 0/1 repeated over the
    layers (``1000``: the first of every four windowed, keys i-W..i in its documents) -> Train fields."""
    if text is None:
        return {}
    w, _, pattern = text.partition(",")
    if not w.isdigit() or not pattern or set(pattern) - {"0", "1"} or "1" not in pattern:
        raise ValueError(f"--layer-window {text!r}: W,PATTERN with W >= 0 and PATTERN of 0s and 1s with a 1 "
                         "(e.g. 4096,1000)")
    return dict(layer_window=int(w), window_pattern=tuple(int(c) for c in pattern))


def jobs_for(size: str, gpus: int, lengths, masks, impls, tokens: int, warmup: int, steps: int,
             profile_lengths, cp: int | None = None, docs: str | None = None,
             layer_window: str | None = None) -> list[Job]:
    # 12l: the 1.5b model's width at 12 layers, the size of Megatron's dynamic-CP measurement (a 12-layer GPT,
    # hidden 2048; here with the recipes' Llama blocks, GQA 16:4)
    base = {"full": LLAMA_300M, "1.5b": LLAMA_1_5B, "12l": replace(LLAMA_1_5B, num_layers=12), "tiny": TINY}[size]
    real = size != "tiny"
    cp = gpus if cp is None else cp
    doc = parse_docs(docs, real) | parse_window(layer_window)
    if cp < 1 or gpus % cp:
        raise ValueError(f"--cp {cp} must divide --gpus {gpus} (DP = GPUs / CP)")
    jobs = []
    for length in lengths:
        if tokens % length:
            raise ValueError(f"--tokens {tokens} is not a multiple of the sequence length {length}")
        n_dp = max(gpus // cp, gpus if "dp" in impls else 1)
        if (tokens // length) % n_dp:
            raise ValueError(f"--tokens {tokens} gives {tokens // length} sequences of {length}, not a multiple of the "
                             f"{n_dp} data-parallel ranks")
        for mask in masks:
            train = Train(shape=replace(base, seq_length=length), steps=warmup + steps,
                          global_batch=tokens // length, warmup=0, recompute=real, mask=mask,
                          recursive=real, profile=length in profile_lengths, **doc)
            runs = []
            for impl in impls:
                layout, strategy = EXTRA[impl](cp) if impl in EXTRA else (Layout(cp=cp), impl)
                runs.append(Run(impl, layout, strategy=strategy))
            jobs.append(Job(train, runs))
    return jobs


def model_flops(train: Train, first_step: int) -> float:
    """Model FLOPs of a step (Megatron's convention, module doc), the mean over the steps from ``first_step`` on:
    their sequences read again from the corpus the runs trained on, the attention area from their documents
    (packed) or whole sequences (causal)."""
    sh = train.shape
    h, f, layers, kv = sh.hidden_size, sh.ffn_hidden_size, sh.num_layers, sh.num_query_groups
    hd = h // sh.num_attention_heads
    # per layer: Q and output projections (h x h each), K and V (h x kv*hd each), SwiGLU (3 x h x f); logits
    matmul = layers * (2 * h * h + 2 * h * kv * hd + 3 * h * f) + h * sh.vocab_size
    corpus = Corpus(train, sh.seq_length, train.steps * train.global_batch)
    steps = train.steps - first_step
    tokens, _, _ = corpus.batch(first_step * train.global_batch, steps * train.global_batch)
    windowed = sum(train.windowed_layers()) if train.layer_window is not None else 0
    area = 0.0  # summed over the layers: a windowed layer keeps keys i-W..i of each document
    for row in tokens.numpy():
        if train.mask == "packed":
            cuts = np.concatenate([[0], np.nonzero(row == EOD)[0] + 1, [len(row)]])
            d = np.diff(np.unique(cuts)).astype(np.float64)
        else:
            d = np.array([len(row)], dtype=np.float64)
        full = d * (d + 1) / 2
        area += (layers - windowed) * float(full.sum()) / steps
        if windowed:
            w = float(train.layer_window) + 1  # keys per row once past the window
            band = np.where(d <= w, full, w * (w + 1) / 2 + (d - w) * w)
            area += windowed * float(band.sum()) / steps
    n = train.global_batch * sh.seq_length
    return 6.0 * matmul * n + 12.0 * area * sh.num_attention_heads * hd


def summarize(jobs: list[Job], results: list[dict], warmup: int, world: int) -> dict:
    rows = []
    for job, res in zip(jobs, results):
        t = job.train
        flops = model_flops(t, warmup)
        for name, r in res["runs"].items():
            sec = float(np.median(r["step_seconds"][warmup:]))
            rows.append(dict(impl=name, seqlen=t.shape.seq_length, mask=t.mask, sequences_per_step=t.global_batch,
                             step_s=sec, step_seconds=r["step_seconds"],
                             tokens_per_s_per_gpu=t.global_batch * t.shape.seq_length / sec / world,
                             model_tflops_per_gpu=flops / sec / world / 1e12, loss_last=r["losses"][-1],
                             profile=r.get("profile"), kernels=r["kernels"]))
    best = []
    for (s, m) in dict.fromkeys((r["seqlen"], r["mask"]) for r in rows):
        case = [r for r in rows if r["seqlen"] == s and r["mask"] == m]
        # megatron_cp against the other CP implementations; one plan over DP x CP against every fixed layout
        for name, rivals in (("megatron_cp", lambda i: i not in ("megatron_cp", "megatron_cp+over_dp")),
                             ("megatron_cp+over_dp", lambda i: i != "megatron_cp+over_dp")):
            ours = next((r for r in case if r["impl"] == name), None)
            base = [r for r in case if rivals(r["impl"])]
            if ours and base:
                top = max(base, key=lambda r: r["tokens_per_s_per_gpu"])
                best.append(dict(seqlen=s, mask=m, impl=name, best_baseline=top["impl"],
                                 speedup=ours["tokens_per_s_per_gpu"] / top["tokens_per_s_per_gpu"]))
    return dict(rows=rows, vs_best_baseline=best)


def table(summary: dict) -> list[str]:
    lines = ["| S | mask | impl | tokens/s per GPU | model TFLOP/s per GPU | step s | profiled step ms: attention / "
             "NCCL / rest (GPU); ranks' busy time imbalance |", "|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        p = r["profile"]
        imb = "" if not p or p.get("busy_imbalance") is None else f"; {100 * p['busy_imbalance']:.1f}%"
        prof = "-" if not p else f"{p['step_ms']:.0f}: {p['attention_ms']:.0f} / {p['communication_ms']:.0f} / " \
                                 f"{p['rest_ms']:.0f}{imb}"
        lines.append(f"| {r['seqlen']} | {r['mask']} | {r['impl']} | {r['tokens_per_s_per_gpu']:.0f} | "
                     f"{r['model_tflops_per_gpu']:.1f} | {r['step_s']:.3f} | {prof} |")
    for b in summary["vs_best_baseline"]:
        lines.append(f"{b['impl']} vs the best baseline ({b['best_baseline']}) at {b['seqlen']} {b['mask']}: "
                     f"{b['speedup']:.2f}x")
    return lines


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    masks = list(dict.fromkeys(r["mask"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    lengths = sorted({r["seqlen"] for r in rows})
    fig, axes = plt.subplots(1, len(masks), figsize=(6 * len(masks), 4.2), squeeze=False)
    w = 0.8 / len(impls)
    for ax, m in zip(axes[0], masks):
        for i, impl in enumerate(impls):
            ys = [next((r["tokens_per_s_per_gpu"] for r in rows if r["mask"] == m and r["impl"] == impl
                        and r["seqlen"] == s), 0) for s in lengths]
            ax.bar([x + i * w for x in range(len(lengths))], ys, w, label=impl)
        ax.set_xticks([x + 0.4 - w / 2 for x in range(len(lengths))], [f"{s // 1024}k" for s in lengths])
        ax.set(xlabel="tokens per sequence", ylabel="tokens/s per GPU", title=f"{m}: whole training step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    sign_figure(fig, summary)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("full", "1.5b", "12l", "tiny"), default="full",
                    help="full: the recipes' ~293M Llama; 1.5b: a ~1.45B one (hidden 2048, 32 layers, GQA 16:4); "
                         "12l: that one at 12 layers (Megatron's dynamic-CP setting); tiny: the CPU check's")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU processes (default: NCCL, one process per GPU)")
    ap.add_argument("--gpus", type=int, default=None, help="world size (default: every visible GPU)")
    ap.add_argument("--cp", type=int, default=None, help="CP size (default: --gpus); DP = GPUs / CP")
    ap.add_argument("--lengths", default=None, help="comma list of tokens per sequence (default 32768,65536,131072; "
                                                    "tiny 128,256)")
    ap.add_argument("--masks", default="packed,causal")
    ap.add_argument("--layer-window", default=None, help="W,PATTERN: windowed layers (keys i-W..i) where PATTERN "
                                                         "(0/1, repeated over the layers) has a 1, e.g. 4096,1000")
    ap.add_argument("--docs", default=None, help="packed documents' lengths in tokens: LO,HI uniform (default "
                                                 "256,16384; tiny 16,96) or LO,HI,MEDIAN[,SIGMA] log-normal")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step (default: the largest length)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--profile-lengths", default=None, help="lengths whose runs get one profiled step (default: "
                                                            "the largest; 'none': no profile)")
    ap.add_argument("--out", default="out/throughput")
    a = ap.parse_args(argv)
    import torch

    lengths = [int(x) for x in (a.lengths or ("128,256" if a.size == "tiny" else "32768,65536,131072")).split(",")]
    masks, impls = a.masks.split(","), a.impls.split(",")
    for m in masks:
        if m not in ("packed", "causal"):
            ap.error(f"--masks: {m!r} is not packed or causal")
    for i in impls:
        if i not in IMPLS and i not in EXTRA:
            ap.error(f"--impls: {i!r} is not one of {', '.join((*IMPLS, *EXTRA))}")
    if a.gpus is None:
        a.gpus = 2 if a.cpu else torch.cuda.device_count()
    if a.gpus < 1 or (not a.cpu and torch.cuda.device_count() < a.gpus):
        ap.error(f"--gpus {a.gpus}: {torch.cuda.device_count()} GPU(s) visible (use --cpu for CPU processes)")
    if a.warmup < 0 or a.steps < 1:
        ap.error(f"--warmup must be >= 0 and --steps >= 1, got {a.warmup} and {a.steps}")
    tokens = a.tokens or max(lengths)
    prof = [] if a.profile_lengths == "none" else \
        [max(lengths)] if a.profile_lengths is None else [int(x) for x in a.profile_lengths.split(",")]
    try:
        jobs = jobs_for(a.size, a.gpus, lengths, masks, impls, tokens, a.warmup, a.steps, prof, a.cp, a.docs,
                        a.layer_window)
    except ValueError as e:
        ap.error(str(e))
    command = "python examples/llama/recipes/throughput.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    results = spawn_jobs(jobs, a.gpus, "cpu" if a.cpu else "cuda")
    cp = a.cp or a.gpus
    summary = dict(run_record(command), world=a.gpus, layout=f"CP {cp} (DP {a.gpus // cp}); dp: CP 1 (DP {a.gpus})",
                   tokens_per_step=tokens,
                   warmup_steps=a.warmup, timed_steps=a.steps,
                   flops="6 x matmul parameters x tokens + 12 x attention area x query heads x head dim x layers "
                         "(Megatron's convention; recompute not counted)",
                   **summarize(jobs, results, a.warmup, a.gpus))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "throughput.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, out / "throughput.png")
    print("\n".join(table(summary)))
    print(f"-> {out / 'throughput.json'}")
    return summary


if __name__ == "__main__":
    main()
