"""Convergence runs (examples/llama/recipes): one Llama trained under several parallel layouts (TP x CP x PP,
sequence parallelism) or attention variants (dense, ``--cp-sparse``), all from the same weights on the same
global batches, on CPU (gloo) or GPUs (NCCL, one process per GPU).

Every run reports its loss and gradient norm per step and its wall time per step (tokens/s per GPU). The
runs of one call share the world: a layout of ``tp * cp * pp`` ranks has ``world / (tp * cp * pp)``
data-parallel replicas, so CP = 1 on 4 GPUs is DP = 4 and CP = 4 is DP = 1, with the same global batch.

``dtype="bf16"`` is Megatron's ``--bf16``: bf16 parameters and activations, each micro-batch's gradients added
into an fp32 main gradient, AdamW on fp32 master weights, clipping by the fp32 global gradient norm
(weight decay on matrices only, as Megatron's default). ``"fp32"`` trains the parameters themselves.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import textwrap
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_cp.comm import shared_gpu
from megatron_cp.megatron import MaskSpec, PlanOptions

from .demo import EOD, stdlib_stream
from .model import LlamaShape

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Layout:
    """Megatron's parallel sizes of one run; ``sp``: sequence parallelism (needs ``tp > 1``); ``over_dp``: one plan
    per micro-batch over the whole DP x CP world (--cp-balance-over-dp; TP 1, PP 1)."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    sp: bool = False
    over_dp: bool = False

    def __post_init__(self):
        for k in ("tp", "cp", "pp"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Layout.{k} must be an int >= 1, got {v!r}")
        if self.sp and self.tp < 2:
            raise ValueError(f"sequence parallelism needs tp >= 2, got tp={self.tp}")
        if self.over_dp and (self.tp > 1 or self.pp > 1):
            raise ValueError(f"one plan over DP x CP runs at TP 1 and PP 1, got tp={self.tp}, pp={self.pp}")

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.pp

    @property
    def name(self) -> str:
        parts = [f"{k}{getattr(self, k)}" for k in ("tp", "cp", "pp") if getattr(self, k) > 1] or ["cp1"]
        return "x".join(parts) + ("+sp" if self.sp else "") + ("+over_dp" if self.over_dp else "")


@dataclass(frozen=True)
class Run:
    """One training run: a layout and an attention variant. ``sparse``: ``(method, {param: value})`` of
    ``--cp-sparse`` (None: dense). ``start``: ``"init"`` (the shared initial weights) or ``"pretrained"`` (the
    weights after the job's dense ``pretrain_steps`` on this same layout: fine-tuning branches). ``strategy``:
    ``--context-parallel-impl`` (megatron_cp, or a baseline of megatron_cp.baselines through the same adapter)."""

    name: str
    layout: Layout = Layout()
    sparse: tuple | None = None
    start: str = "init"
    strategy: str = "megatron_cp"
    data_seed: int = 0  # the order of the training files (Train.split_data): 0 keeps theirs, another a shuffle
    dp: int | None = None  # the data-parallel size the run needs (its micro-batch arrangement), None: the world's

    def __post_init__(self):
        if self.start not in ("init", "pretrained"):
            raise ValueError(f"Run.start must be 'init' or 'pretrained', got {self.start!r}")
        if self.sparse is not None:  # hashable: equal runs of several jobs train once (``worker``)
            method, params = self.sparse
            object.__setattr__(self, "sparse", (method, tuple(sorted(dict(params).items()))))

    def options(self, train: "Train") -> PlanOptions:
        from megatron_cp.megatron.sparse_spec import SparseSpec
        from megatron_cp.planner import Workload

        sparse = None
        if self.sparse is not None:
            sparse = SparseSpec(*self.sparse)
        sh, tp = train.shape, self.layout.tp
        # each rank's attention inputs (heads per TP rank): planning ahead then also chooses the exchange
        work = Workload(sh.num_attention_heads // tp, sh.num_query_groups // tp,
                        sh.hidden_size // sh.num_attention_heads, 4 if train.dtype == "fp32" else 2)
        return PlanOptions(kernel_backend=train.kernel_backend, sparse=sparse, strategy=self.strategy,
                           token_multiple=tp if self.layout.sp else 1, workload=work, over_dp=self.layout.over_dp)


@dataclass(frozen=True)
class Train:
    """What every run of a job shares: model, data, optimiser, schedule, precision."""

    shape: LlamaShape
    steps: int
    global_batch: int
    micro_batch: int = 1
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup: int = 0
    clip: float = 1.0
    weight_decay: float = 0.1
    seed: int = 1234
    dtype: str = "bf16"
    doc_lengths: tuple[int, int] = (32, 480)  # bytes per document, uniform (stdlib sources; EOD after each)
    doc_median: int | None = None  # lengths log-normal around this (doc_sigma) within doc_lengths instead
    doc_sigma: float = 1.0
    # windowed layers among full ones (Megatron's --window-size W,0 with --window-attn-skip-freq as a list):
    # layer i (from 1) is windowed where window_pattern[(i - 1) % len(window_pattern)] is 1
    layer_window: int | None = None
    window_pattern: tuple[int, ...] = ()
    recursive: bool = True  # the whole standard library (32 MB of text), not only its top folder
    kernel_backend: str = "auto"
    recompute: bool = False  # Megatron's full activation recompute, one layer at a time
    pretrain_steps: int = 0  # dense steps (on the schedule above) on the pretrained runs' layout before they branch
    finetune_lr: float | None = None  # the branches' constant learning rate (None: the schedule above)
    speed_lengths: tuple[int, ...] = ()  # after training: time each run at these sequence lengths
    speed_steps: int = 3
    mask: str = "packed"
    profile: bool = False  # after training: one more step under torch.profiler, GPU time by kind (profile_summary)
    # train on the files not held out, each document once (a ValueError where the run needs more), and every
    # ``held_out_every`` steps (0: never) the loss of ``held_out_samples`` sequences of the held-out files
    split_data: bool = False
    held_out_every: int = 0
    held_out_samples: int = 8

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"Train.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.steps < 1 or self.global_batch < 1 or self.micro_batch < 1:
            raise ValueError(f"need steps, global_batch, micro_batch >= 1, got {self.steps}, "
                             f"{self.global_batch}, {self.micro_batch}")
        if (self.layer_window is None) != (not self.window_pattern) or \
                (self.layer_window is not None and (self.layer_window < 0 or set(self.window_pattern) - {0, 1})):
            raise ValueError(f"layer_window (>= 0) and window_pattern (0s and 1s) go together, got "
                             f"{self.layer_window} and {self.window_pattern}")

    def mask_spec(self) -> MaskSpec:
        """The micro-batches' mask (EOD ends a document under the packed masks)."""
        return MaskSpec(self.mask, eod=EOD if self.mask.startswith("packed") else None, layer_window=self.layer_window)

    def windowed_layers(self) -> list[int]:
        """Megatron's window_attn_skip_freq as a list: 1 for each windowed layer, ``window_pattern`` repeated."""
        p = self.window_pattern
        return [int(p[i % len(p)]) for i in range(self.shape.num_layers)]

    def lr_at(self, step: int, steps: int, finetune: bool = False) -> float:
        """Linear warm-up, then cosine decay to ``min_lr`` at ``steps`` (Megatron's cosine schedule); fine-tuning
        branches: ``finetune_lr`` when set."""
        if finetune and self.finetune_lr is not None:
            return self.finetune_lr
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        frac = min(1.0, (step - self.warmup) / max(1, steps - self.warmup))
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))


@dataclass
class Job:
    train: Train
    runs: list = field(default_factory=list)

    def check(self, world: int) -> None:
        """Every layout fits the world and the batch: raised before any process starts."""
        pre = [r for r in self.runs if r.start == "pretrained"]
        if pre and self.train.pretrain_steps < 1:
            raise ValueError(f"runs {[r.name for r in pre]} start 'pretrained' but pretrain_steps is 0")
        if len({r.layout for r in pre}) > 1:
            raise ValueError("every 'pretrained' run must share one layout (the pretraining's)")
        for r in self.runs:
            L = r.layout
            if world % L.size:
                raise ValueError(f"run {r.name!r}: world size {world} is not divisible by tp*cp*pp = {L.size}")
            dp = world // L.size
            if self.train.global_batch % (dp * self.train.micro_batch):
                raise ValueError(f"run {r.name!r}: global batch {self.train.global_batch} is not divisible by "
                                 f"dp * micro_batch = {dp} * {self.train.micro_batch}")
            if L.pp > 1 and self.train.shape.num_layers % L.pp:
                raise ValueError(f"run {r.name!r}: {self.train.shape.num_layers} layers do not split into "
                                 f"pp = {L.pp} stages")
            if self.train.shape.num_query_groups % L.tp:
                raise ValueError(f"run {r.name!r}: {self.train.shape.num_query_groups} KV heads do not split "
                                 f"over tp = {L.tp}")


# ----------------------------------------------------------------------------------------------- data

HELD_OUT_EVERY = 16  # with Train.split_data one standard-library file in 16 is held out of training


def corpus_files(train: Train, split: str, data_seed: int = 0) -> list:
    """The files of ``split``: "train" (every file but each HELD_OUT_EVERY-th, shuffled by ``data_seed`` unless it is
    0) or "held_out" (those, in order)."""
    from .demo import stdlib_files

    files = stdlib_files(train.recursive)
    if split == "held_out":
        return files[::HELD_OUT_EVERY]
    if split != "train":
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    rest = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY]
    order = np.random.default_rng(data_seed).permutation(len(rest)) if data_seed else range(len(rest))
    return [rest[i] for i in order]


class Corpus:
    """Samples of ``length + 1`` tokens cut one after another from the packed stdlib stream; with
    ``train.split_data`` from ``split``'s files only, no document twice (``corpus_files``)."""

    def __init__(self, train: Train, length: int, samples: int, data_seed: int = 0, split: str = "train"):
        self.length = length
        files = corpus_files(train, split, data_seed) if train.split_data else None
        self.stream = torch.from_numpy(stdlib_stream(samples * length + 1, train.seed, train.doc_lengths,
                                                     train.recursive, train.doc_median,
                                                     train.doc_sigma, files=files, repeat=not train.split_data))
        self.samples = samples

    def batch(self, first: int, n: int):
        """(tokens, labels, loss_mask) ``[n, length]`` of samples first .. first + n - 1."""
        if first + n > self.samples:
            raise IndexError(f"samples {first}..{first + n - 1} beyond the {self.samples} prepared")
        L = self.length
        rows = torch.stack([self.stream[i * L: i * L + L + 1] for i in range(first, first + n)])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), torch.ones(n, L)


# ------------------------------------------------------------------------------------ mixed precision

class MainParams:
    """The parameters the optimiser steps and whose gradients are reduced.

    fp32 models: the parameters themselves. bf16 models: fp32 master copies; a hook adds each micro-batch's
    bf16 gradient into the master's fp32 ``.grad`` as soon as autograd has it and frees the bf16 one (what
    Megatron's ``main_grad`` buffers do), and ``publish`` copies the stepped masters back into the model.
    """

    def __init__(self, chunks):
        self.model = [p for c in chunks for p in c.parameters()]
        self.names = [k for c in chunks for k, _ in c.named_parameters()]
        if all(p.dtype == torch.float32 for p in self.model):
            self.main = self.model
            return
        self.main = []
        for p in self.model:
            m = torch.nn.Parameter(p.detach().float().clone())
            for attr in ("sequence_parallel", "tensor_model_parallel", "partition_dim"):
                if hasattr(p, attr):
                    setattr(m, attr, getattr(p, attr))
            p.register_post_accumulate_grad_hook(self._accumulate(m))
            self.main.append(m)

    @staticmethod
    def _accumulate(m):
        def hook(p):
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad)
            p.grad = None
        return hook

    def publish(self) -> None:
        if self.main is self.model:
            return
        with torch.no_grad():
            for p, m in zip(self.model, self.main):
                p.copy_(m)

    def zero_grad(self) -> None:
        for m in self.main:
            m.grad = None

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Megatron's default: no weight decay on vectors (norm weights) and biases."""
        decay = [m for m, k in zip(self.main, self.names) if m.dim() > 1 and not k.endswith(".bias")]
        rest = [m for m, k in zip(self.main, self.names) if not (m.dim() > 1 and not k.endswith(".bias"))]
        return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def clip_grad_norm(main: list, max_norm: float) -> float:
    """The global L2 norm of the (reduced, scaled) gradients over the whole model, then scale them to at most
    ``max_norm`` (0: no clipping). TP shards add up over the TP group, pipeline stages over the PP group;
    parameters replicated over TP (norm weights) count once."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    grads = [m.grad for m in main if m.grad is not None and (getattr(m, "tensor_model_parallel", False)
                                                            or tp_rank == 0)]
    dev = main[0].device
    sq = torch.zeros((), dtype=torch.float64, device=dev)
    for g in grads:
        sq += g.double().pow(2).sum()
    dist.all_reduce(sq, group=ps.get_model_parallel_group())
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for m in main:
            if m.grad is not None:
                m.grad.mul_(coef)
    return norm


# ---------------------------------------------------------------------------------------- the worker

def _sync(device) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _full_init(train: Train, length: int) -> dict:
    """The whole model's initial weights (fp32, CPU): built once from the seed as a TP = PP = 1 model, so
    every layout starts from the same numbers."""
    from . import trainer
    from .model import build_llama, transformer_config

    trainer.init_parallel(1, 1)
    shape = replace(train.shape, seq_length=length)
    torch.manual_seed(train.seed)
    model = build_llama(shape, transformer_config(shape))
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def _build(train: Train, layout: Layout, length: int, full: dict, device, options: PlanOptions):
    from megatron.core import parallel_state as ps

    from . import trainer
    from .model import build_llama, build_pipeline_stage, load_full_state, transformer_config

    trainer.init_parallel(layout.tp, layout.cp, layout.pp)
    shape = replace(train.shape, seq_length=length)
    over = dict(sequence_parallel=layout.sp)
    if train.recompute:
        over.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if train.layer_window is not None:
        over.update(window_size=(train.layer_window, 0), window_attn_skip_freq=train.windowed_layers())
    config = transformer_config(shape, dtype=DTYPES[train.dtype], **over)
    chunks = (build_pipeline_stage(shape, config, options=options) if layout.pp > 1
              else [build_llama(shape, config, options=options)])
    load_full_state(chunks, full)
    if device is not None:
        chunks = [c.to(device) for c in chunks]
    dp = (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    return chunks, dp


def _held_out_loss(chunks, train: Train, run: Run, held: Corpus, dp, device) -> float:
    """The model's token-mean loss on the held-out sequences, forward only, under the run's layout (the DP ranks
    split them as a training batch); PP runs are not evaluated (their forward is the schedule's)."""
    from megatron.core import parallel_state as ps

    from . import trainer

    spec, options = train.mask_spec(), run.options(train)
    mbs = trainer.dp_shard(held.batch(0, train.held_out_samples), dp[0], dp[1], train.micro_batch)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for mb in mbs:
            out, loss_fn = trainer.forward_step(chunks[0], mb, spec, options, device)
            loss, n, _ = loss_fn(out)
            total += torch.stack([loss.detach().double(), n.double()]).to(total.device)
    dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
    return float(total[0] / total[1])


def _train_steps(chunks, main, opt, train: Train, run: Run, corpus: Corpus, dp, device, steps: int,
                 first_sample: int, log=None, start: int = 0, end: int | None = None, until=None,
                 held: Corpus | None = None):
    """Steps ``start`` .. ``end - 1`` (default ``steps - 1``) of a run of ``steps`` (the step index sets the
    batch, ``steps`` the learning-rate schedule, so a run resumed at ``start`` trains what the uninterrupted run
    would). ``until``: asked before each step; True stops there (every rank gets the same answer:
    ``_Deadline``). ``held``: the held-out sequences, evaluated after step 1 and every ``train.held_out_every``
    steps; returns (losses, grad norms, step seconds, [[step, held-out loss], ...])."""
    from megatron.core import parallel_state as ps

    from . import trainer

    spec = train.mask_spec()
    options = run.options(train)
    losses, norms, seconds, evals = [], [], [], []
    for step in range(start, steps if end is None else end):
        if until is not None and until():
            break
        for g in opt.param_groups:
            g["lr"] = train.lr_at(step, steps, finetune=run.start == "pretrained")
        _sync(device)
        t0 = time.perf_counter()
        batch = corpus.batch(first_sample + step * train.global_batch, train.global_batch)
        mbs = trainer.dp_shard(batch, dp[0], dp[1], train.micro_batch)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            s, n = trainer.pipeline_forward_backward(chunks, mbs, spec, options, device=device)
        else:
            s, n = trainer.forward_backward(chunks[0], mbs, spec, options, device=device)
        res = trainer.reduce_and_scale(chunks, s, n, params=main.main)
        norm = clip_grad_norm(main.main, train.clip)
        opt.step()
        main.publish()
        main.zero_grad()
        _sync(device)
        seconds.append(time.perf_counter() - t0)
        losses.append(res.loss)
        norms.append(norm)
        if log is not None:
            log(step, res.loss, norm, seconds[-1])
        every = train.held_out_every
        if held is not None and every and ps.get_pipeline_model_parallel_world_size() == 1 and (
                step == 0 or (step + 1) % every == 0 or step + 1 == steps):
            evals.append([step + 1, _held_out_loss(chunks, train, run, held, dp, device)])
    return losses, norms, seconds, evals


def _optimizer(main: MainParams, train: Train):
    return torch.optim.AdamW(main.param_groups(train.weight_decay), lr=train.lr, betas=(0.9, 0.95), eps=1e-8)


SAVE_EVERY = 50  # steps between a checkpointed run's saves (~3.5 GB a rank for the 300M model's fp32 state)


class _Deadline:
    """Whether training should stop before its next step: when that step (taken as long as the time since the
    previous question, save and set-up included) would end past ``limit_s`` seconds after ``t0``. The first
    question of a call says no (each call makes progress). The ranks' clocks differ, so the answer is a max
    over the world: every rank stops at the same step."""

    def __init__(self, t0: float, limit_s: float, device):
        self.t0, self.limit_s, self.device, self.prev = t0, limit_s, device, None

    def __call__(self) -> bool:
        now = time.perf_counter()
        prev, self.prev = self.prev, now
        if prev is None:
            return False
        late = now - self.t0 + 1.5 * (now - prev) > self.limit_s
        flag = torch.tensor([float(late)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _state_path(folder: str, train: Train, run: Run) -> Path:
    return Path(folder) / f"{train.dtype}_{run.name}_rank{dist.get_rank()}.pt"


def _save_state(path: Path, key: str, step: int, main: "MainParams", opt, hist: tuple) -> None:
    """This rank's master weights, optimiser state and the run's history after ``step`` steps (written whole,
    then renamed: a call killed while writing leaves the previous state)."""
    tmp = path.with_suffix(".tmp")
    torch.save(dict(key=key, step=step, main=[m.detach().cpu() for m in main.main], opt=opt.state_dict(),
                    history=hist), tmp)
    os.replace(tmp, path)


def _load(main: "MainParams", opt, weights, opt_state) -> None:
    """Master weights and optimiser state into a freshly built run (published to the model)."""
    with torch.no_grad():
        for m, w in zip(main.main, weights):
            m.copy_(w)
    main.publish()
    opt.load_state_dict(opt_state)


def _resumable(chunks, main, opt, train: Train, run: Run, corpus: Corpus, dp, device, steps: int, first: int, log,
               checkpoint: str | None, deadline: "_Deadline | None", every: int, held: Corpus | None = None):
    """``steps`` steps of ``run`` (its losses, grad norms, step seconds, held-out evaluations, and the steps done
    where ``deadline`` stopped it, else None): continued from its state in ``checkpoint`` when there, saved there
    every ``every`` steps and where it stops."""
    done, hist = 0, ([], [], [], [])
    path, key = None, repr((train, run))
    if checkpoint is not None:
        path = _state_path(checkpoint, train, run)
        if path.exists():
            st = torch.load(path, map_location="cpu", weights_only=False)
            if st["key"] != key:
                raise ValueError(f"{path} holds another run's state ({st['key'][:200]}...), not this one's: use "
                                 "another --checkpoint folder")
            _load(main, opt, st["main"], st["opt"])
            done, hist = st["step"], st["history"]
    losses, norms, seconds, evals = (list(h) for h in hist)
    while done < steps:
        upto = steps if path is None else min(steps, (done // every + 1) * every)
        more = _train_steps(chunks, main, opt, train, run, corpus, dp, device, steps, first, log, start=done,
                            end=upto, until=deadline, held=held)
        for acc, new in zip((losses, norms, seconds, evals), more):
            acc.extend(new)
        stopped = done + len(more[0]) < upto
        done += len(more[0])
        if path is not None:
            _save_state(path, key, done, main, opt, (losses, norms, seconds, evals))
        if stopped:
            return losses, norms, seconds, evals, done
    return losses, norms, seconds, evals, None


def _one_run(train: Train, run: Run, full: dict, corpus: Corpus, device, pretrained: dict | None, log,
             checkpoint: str | None = None, deadline: "_Deadline | None" = None, every: int = SAVE_EVERY):
    """One run's training (then its speed and profile steps). ``checkpoint``: a folder where the run's state is
    saved every ``every`` steps and where it stops; a run found there continues from it (one found
    complete is not trained again). ``deadline``: stop before a step that would pass it (the result then
    has ``stopped_at``, the steps done)."""
    chunks, dp = _build(train, run.layout, corpus.length, full, device, run.options(train))
    main = MainParams(chunks)
    opt = _optimizer(main, train)
    if run.start == "pretrained":
        _load(main, opt, pretrained["main"], pretrained["opt"])
    first = train.pretrain_steps * train.global_batch if run.start == "pretrained" else 0
    held = Corpus(train, corpus.length, train.held_out_samples, split="held_out") if train.held_out_every else None
    losses, norms, seconds, evals, stopped = _resumable(chunks, main, opt, train, run, corpus, dp, device,
                                                        train.steps, first, log, checkpoint, deadline, every, held)
    if stopped is not None:
        return dict(losses=losses, grad_norms=norms, step_seconds=seconds, held_out=evals, stopped_at=stopped)
    speed = {}
    for length in train.speed_lengths:
        sp_corpus = Corpus(train, length, train.global_batch * (train.speed_steps + 1))
        sec = _train_steps(chunks, main, opt, train, run, sp_corpus, dp, device, train.speed_steps + 1, 0)[2]
        speed[str(length)] = float(np.median(sec[1:]))  # the first step builds plans and compiles kernels
    prof = None
    if train.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            sec = _train_steps(chunks, main, opt, train, run, corpus, dp, device, 1, 0)[2]
        prof = profile_summary(p, sec[0])
        if dist.is_initialized():  # every rank's busy time outside NCCL: how evenly the layout spreads the work
            on = device if dist.get_backend() == "nccl" else "cpu"
            busy = torch.tensor([prof["attention_ms"] + prof["rest_ms"]], dtype=torch.float64, device=on)
            got = [torch.zeros_like(busy) for _ in range(dist.get_world_size())]
            dist.all_gather(got, busy)
            ranks = [float(t.item()) for t in got]
            mean = sum(ranks) / len(ranks)
            prof.update(rank_busy_ms=ranks, busy_imbalance=max(ranks) / mean - 1 if mean > 0 else None)
    return dict(losses=losses, grad_norms=norms, step_seconds=seconds, held_out=evals, speed_seconds=speed,
                profile=prof)



# kernel names by kind: NCCL's kernels; attention's (FA4's CuTe kernels, our Triton ones, cuDNN's SDPA)
_COMM, _ATTN = ("nccl",), ("flash", "attn", "fmha", "sdpa")


def profile_summary(prof, step_s: float) -> dict:
    """GPU time of one profiled step by kind, milliseconds: ``attention`` (attention kernels), ``communication``
    (NCCL kernels: the CP exchange and the gradient reductions), ``rest`` (every other kernel, copy and set),
    summed over this rank's streams (overlapping streams can sum past the step), beside the step's wall time."""
    kinds = dict(attention=0.0, communication=0.0, rest=0.0)
    for e in prof.events():  # the device's work: kernels, copies and sets, as torch.profiler records them
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        kind = "communication" if any(k in name for k in _COMM) else \
            "attention" if any(k in name for k in _ATTN) else "rest"
        kinds[kind] += e.time_range.elapsed_us() / 1e3
    return dict(step_ms=step_s * 1e3, **{f"{k}_ms": v for k, v in kinds.items()})


def _pretrain(train: Train, run: Run, full: dict, corpus: Corpus, device, log, checkpoint: str | None = None,
              deadline: "_Deadline | None" = None, every: int = SAVE_EVERY) -> dict:
    """Dense steps on ``run``'s layout; returns this rank's master weights and optimiser state (checkpointed and
    stopped as a run is, ``_resumable``: then ``stopped_at``)."""
    dense = Run("pretrain", run.layout)
    chunks, dp = _build(train, run.layout, corpus.length, full, device, dense.options(train))
    main = MainParams(chunks)
    opt = _optimizer(main, train)
    losses, _, _, _, stopped = _resumable(chunks, main, opt, train, dense, corpus, dp, device, train.pretrain_steps, 0,
                                       log, checkpoint, deadline, every)
    if stopped is not None:
        return dict(losses=losses, stopped_at=stopped)
    return dict(main=[m.detach().clone() for m in main.main], opt=opt.state_dict(), losses=losses)


def _kernels(train: Train, device) -> str:
    """The attention backend ``kernel_backend`` resolves to here (FA4 hands fp32 to Triton)."""
    from megatron_cp.kernels.registry import available_backends

    name = train.kernel_backend
    if name == "auto":
        name = available_backends(device or "cpu")[0]
    return name + (" (fp32 on triton)" if name == "fa4" and train.dtype == "fp32" else "")


def worker(rank: int, world: int, jobs: list[Job], device_kind: str, verbose: bool = True,
           progress: str | None = None, checkpoint: str | None = None, time_limit_s: float | None = None,
           checkpoint_every: int = SAVE_EVERY) -> list[dict]:
    """Every job's runs in this world, one after the other; rank 0 returns one result per job. ``progress``: a
    file rank 0 appends every step to as it ends (a JSON line: dtype, run, step, loss, grad norm, seconds), so a
    run stopped by a time limit still leaves each step it made. ``checkpoint`` / ``time_limit_s``: see
    ``_one_run``; with a limit, the first run that stops ends the call (the jobs after it are not started)."""
    t_call = time.perf_counter()
    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    device = None
    if device_kind == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        from .cpu import cuda_to_cpu_shim

        cuda_to_cpu_shim(schedules=any(r.layout.pp > 1 for j in jobs for r in j.runs))
    from .trainer import release_groups  # Megatron after the CPU shim

    out, done = [], {}
    deadline = None if time_limit_s is None else _Deadline(t_call, time_limit_s, device)
    shared = shared_gpu.ranks_share_gpu()  # times mean nothing: no speed or profile steps, no step times printed
    for job in jobs:
        train = replace(job.train, speed_lengths=(), profile=False) if shared else job.train
        length = train.shape.seq_length
        res = dict(runs={}, pretrain_losses=None)
        if all(r.start == "init" and (train, r) in done for r in job.runs):  # trained in an earlier job
            res["runs"] = {r.name: done[(train, r)] for r in job.runs}
            out.append(res)
            continue
        full = _full_init(train, max((length,) + tuple(train.speed_lengths)))
        samples = (train.pretrain_steps + train.steps) * train.global_batch
        corpus = Corpus(train, length, samples)
        pretrained = None
        t_start = time.perf_counter()
        for run in job.runs:
            def log(step, loss, norm, sec, name=run.name):
                if rank == 0 and progress:
                    with open(progress, "a") as f:
                        f.write(json.dumps({"dtype": train.dtype, "run": name, "step": step + 1, "loss": float(loss),
                                            "grad_norm": float(norm), "seconds": float(sec)}) + "\n")
                # short runs (timings) print every step: a run cut off by a time limit still leaves them all
                if rank == 0 and verbose and (train.steps <= 20 or step < 3 or step % 10 == 9
                                              or step == train.steps - 1):
                    print(f"  [{train.dtype} {name}] step {step + 1:4d} loss {loss:.6f} grad norm {norm:.3f}"
                          + ("" if shared else f" {sec * 1e3:.0f} ms  (+{time.perf_counter() - t_start:.0f} s)"),
                          flush=True)
            if run.start == "init" and (train, run) in done:  # the same run in an earlier job (e.g. CP 1)
                res["runs"][run.name] = done[(train, run)]
                continue
            stop = None  # (what stopped, steps done, steps in all)
            if run.start == "pretrained" and pretrained is None:
                pretrained = _pretrain(train, run, full, corpus, device, partial(log, name="dense pretraining"),
                                       checkpoint, deadline, checkpoint_every)
                res["pretrain_losses"] = pretrained["losses"]
                if "stopped_at" in pretrained:
                    stop = ("dense pretraining", pretrained["stopped_at"], train.pretrain_steps)
            if stop is None:
                rc = Corpus(train, length, samples, run.data_seed) if run.data_seed else corpus
                r = _one_run(train, run, full, rc, device, pretrained, log, checkpoint, deadline,
                             checkpoint_every)
                if "stopped_at" in r:
                    stop = (run.name, r["stopped_at"], train.steps)
            release_groups()  # this layout's groups, threads and all: the next run makes its own
            if stop is not None:
                res["stopped"] = dict(dtype=train.dtype, run=stop[0], step=stop[1], steps=stop[2])
                out.append(res)
                return out
            r.update(layout=run.layout.name, world=world, dp=world // run.layout.size,
                     ranks_share_gpu=shared_gpu.ranks_share_gpu(),
                     tokens_per_step=train.global_batch * length, kernels=_kernels(train, device))
            res["runs"][run.name] = done[(train, run)] = r
        out.append(res)
    return out


# ------------------------------------------------------------------------------------------ reading

def run_record(command: str) -> dict:
    """What every result file of a run carries: the device, the date (UTC), the command, torch's version."""
    if torch.cuda.is_available():
        device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        device = f"CPU ({platform.processor() or platform.machine()})"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return dict(device=device, date=date, command=command, torch=torch.__version__)


def sign_figure(fig, record: dict) -> None:
    """Device, date and command along the bottom of a matplotlib figure (room made below the axes)."""
    # ~16 characters of 7-point monospace per inch of figure width
    text = textwrap.fill(f"{record['device']}, {record['date']}: {record['command']}", int(fig.get_figwidth() * 16))
    lines = text.count("\n") + 1
    fig.subplots_adjust(bottom=0.12 + 0.035 * lines)
    fig.text(0.01, 0.01, text, fontsize=7, family="monospace", va="bottom")


def tokens_per_s_per_gpu(run: dict, skip: int | None = None) -> float:
    """Median step time over the steps after the first ``skip`` (default: a tenth, at least 1 when there are
    more than 2 steps: plan building and kernel compilation), as tokens per second per GPU; None where the ranks
    shared a GPU (their times mean nothing)."""
    if run.get("ranks_share_gpu"):
        return None
    sec = run["step_seconds"]
    skip = (max(1, len(sec) // 10) if len(sec) > 2 else 0) if skip is None else skip
    return run["tokens_per_step"] / float(np.median(sec[skip:])) / run["world"]


def compare(ref: list[float], other: list[float], last: int = 100) -> dict:
    """Relative loss differences of ``other`` against ``ref``: the largest at any step, and that of the means
    of the last ``last`` steps (fewer when the runs are shorter)."""
    a, b = np.asarray(ref, dtype=np.float64), np.asarray(other, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"the runs logged {len(a)} and {len(b)} steps")
    k = min(last, len(a))
    return dict(max_rel_diff=float(np.max(np.abs(a - b) / np.abs(a))),
                mean_last_rel_diff=float(abs(a[-k:].mean() - b[-k:].mean()) / abs(a[-k:].mean())), last=k)


def spawn_jobs(jobs: list[Job], world: int, device_kind: str, verbose: bool = True, timeout_s: int = 3600,
               progress: str | None = None, checkpoint: str | None = None, time_limit_s: float | None = None,
               checkpoint_every: int = SAVE_EVERY, share_gpu: bool = False):
    """Every job in one spawned world of ``world`` ranks on ``device_kind``; ``share_gpu``: the ranks spread over
    the visible GPUs on gloo through host copies (megatron_cp.comm.shared_gpu: correctness only, no timing)."""
    from .trainer import spawn

    for j in jobs:
        j.check(world)
    if time_limit_s is not None and checkpoint is None:
        raise ValueError("a time limit needs a checkpoint folder: a run it stops continues from there")
    if checkpoint is not None:
        Path(checkpoint).mkdir(parents=True, exist_ok=True)
    return spawn(worker, world, jobs, device_kind, verbose, progress, checkpoint, time_limit_s,
                 checkpoint_every, backend=shared_gpu.BACKEND if share_gpu else "nccl" if device_kind == "cuda"
                 else "gloo",
                 timeout_s=timeout_s)
