"""Learn which KV heads of the tiny Llama need the whole context (DuoAttention or PruLong) under CP.

    PYTHONPATH=examples python -m tiny_llama.train_gates --method duo --cp 2          (gloo on CPU)
    PYTHONPATH=examples python -m tiny_llama.train_gates --method prulong --cp 2 --sparsity 0.5
    PYTHONPATH=examples python -m tiny_llama.train_gates --method both --cp 2   (one pretraining, both; ~40 s)

At long context on one GPU (bf16 on FA4, a curriculum of pretraining lengths, gates learned and evaluated at 64k,
and the model's forward + backward time of each discretised pattern against full attention; ~2 minutes on an
H100, benchmarks/2026-11-24_1xH100_gates64k): ``python examples/llama/recipes/run.py gates --gpus 1`` runs

    PYTHONPATH=examples python -m tiny_llama.train_gates --method both --cp 1 --device cuda --dtype bf16 \
        --seq-length 65536 --digits 2 --hidden 256 --heads 4 --kv-heads 4 --sink 64 --window 256 \
        --rotary-base 100000000 --pretrain-lr 1e-2 --schedule 64:1500:64,1024:400:16,8192:400:4,65536:600:2 \
        --gate-batch 1 --gate-steps 40 --eval-samples 64 --sparsities 0.5,0.75 --time-steps 5

Four stages, all through the Megatron adapter (``prepare_batch`` -> ``GPTModel`` with ``CPCoreAttention``):

a. pretrain the tiny Llama on synthetic passkeys (``passkey.py``; loss only on the answer), so that some
   heads learn to retrieve the key from far back;
b. train the gates with the model frozen:
   * duo: ``DuoGates`` alpha per (layer, KV head), loss = MSE between the gated model's and the full model's
     final hidden states on the answer positions + ``l1_weight`` * mean |alpha|, alpha clamped to [0, 1];
   * prulong: ``HardConcreteGates`` sampled per step (the same draw on every CP rank), loss = the LM loss on
     the answer + the ``LagrangianSparsity`` term (target warmed up linearly; multipliers maximised);
c. discretise at ``--sparsity`` (top ``1 - sparsity`` of heads by gate stay full) and save the pattern JSON;
d. held-out passkey accuracy of the full model, the discretised model, two controls (the inverse pattern at
   the same budget: the lowest-gated heads full; every head streaming) and one table.

The model weights stay frozen in both objectives here (PruLong can also train them; not in this recipe).

Streaming heads keep ``--sink`` first keys and a ``--window`` of recent keys; the key sits at depth 10-80 %
of the filler, so beyond the window of the answer: a head that must find it cannot be streaming.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatron_cp.gating import METHODS

from .model import LlamaShape
from .passkey import PasskeyTask


@dataclass(frozen=True)
class GateConfig:
    method: str = "duo"
    cp: int = 2
    sparsity: float = 0.5
    sink: int = 2
    window: int = 8
    seq_length: int = 64
    digits: int = 2
    pretrain_steps: int = 400
    pretrain_lr: float = 1e-2
    gate_steps: int = 40
    gate_lr: float | None = None  # duo: 0.05; prulong: 0.2 (log_alpha starts at 4.5 and must travel)
    l1_weight: float = 0.05  # DuoAttention's reg weight
    warmup_steps: int = 20  # PruLong: steps to reach the target sparsity
    batch: int = 16
    eval_samples: int = 64
    layers: int = 2
    hidden: int = 64
    heads: int = 8
    kv_heads: int = 4
    seed: int = 1234
    rotary_base: int = 10000  # long context: a large base keeps low RoPE frequencies for content matching
    out: str = "out/head_pattern.json"  # /out/ is git-ignored
    device: str = "cpu"  # cuda: one GPU per CP rank (NCCL)
    # bf16: Megatron's --bf16 arithmetic (fp32 master weights, tiny_llama.convergence.MainParams); the GPU's
    # attention then runs on FA4 where it is installed (fp32 runs on Triton, ~40x slower at 64k)
    dtype: str = "fp32"
    # pretraining stages "LEN:STEPS:BATCH,...", shortest first (retrieval learned short, then lengthened);
    # empty: seq_length x pretrain_steps x batch. Gates are learned and evaluated at seq_length.
    schedule: str = ""
    gate_batch: int | None = None  # samples per gate step and per evaluation chunk (default: batch)
    sparsities: str = ""  # extra discretisation levels to evaluate, e.g. "0.5,0.75" (default: sparsity only)
    time_steps: int = 0  # > 0: time the model's forward + backward at seq_length, full vs each pattern

    def stages(self) -> list[tuple[int, int, int]]:
        """The pretraining stages as (length, steps, batch)."""
        if not self.schedule:
            return [(self.seq_length, self.pretrain_steps, self.batch)]
        out = []
        for part in self.schedule.split(","):
            try:
                length, steps, batch = (int(x) for x in part.split(":"))
            except ValueError:
                raise ValueError(f"--schedule entries are LEN:STEPS:BATCH, got {part!r}") from None
            if length < 1 or steps < 0 or batch < 1:
                raise ValueError(f"--schedule entry {part!r}: need LEN >= 1, STEPS >= 0, BATCH >= 1")
            out.append((length, steps, batch))
        return out

    def levels(self) -> list[float]:
        """The sparsity levels discretised and evaluated: ``sparsity`` first, then ``sparsities``."""
        extra = [float(x) for x in self.sparsities.split(",") if x.strip()]
        for x in extra:
            if not 0.0 <= x < 1.0:
                raise ValueError(f"--sparsities values must be in [0, 1), got {x}")
        return list(dict.fromkeys([self.sparsity] + extra))


def shape_of(cfg: GateConfig) -> LlamaShape:
    return LlamaShape(num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
                      num_query_groups=cfg.kv_heads, ffn_hidden_size=2 * cfg.hidden, vocab_size=256,
                      seq_length=max([cfg.seq_length] + [length for length, _, _ in cfg.stages()]),
                      rotary_base=cfg.rotary_base)


def _cp():
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


def _allreduce_grads(params, group) -> None:
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)


def _global_count(mask: torch.Tensor, group) -> float:
    import torch.distributed as dist

    n = mask.sum().to(torch.float64).reshape(1)
    dist.all_reduce(n, group=group)
    return max(float(n), 1.0)


@torch.no_grad()
def evaluate(model, task: PasskeyTask, n: int, seed: int, spec, options, gating=None, chunk: int | None = None,
             device="cpu"):
    """(digit accuracy, whole-key accuracy) of argmax predictions on ``n`` held-out samples, ``chunk`` samples
    per forward (default all)."""
    import torch.distributed as dist

    from megatron_cp.megatron import prepare_batch

    group = _cp()
    tokens, labels, mask = (t.to(device) for t in task.batch(n, seed))
    per_sample = torch.zeros(n, dtype=torch.float64, device=device)
    chunk = chunk or n
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        bt = prepare_batch(tokens[lo:hi], labels[lo:hi], mask[lo:hi], spec, group, options, gating=gating)
        logits = model(bt.tokens, bt.position_ids, None, packed_seq_params=bt.params)  # [1, s_local, V]
        pred = logits.argmax(-1).reshape(-1)
        hit = ((pred == bt.labels.reshape(-1)) & (bt.loss_mask.reshape(-1) > 0)).to(torch.float64)
        ids = torch.from_numpy(bt.params.plan.local_ids(bt.params.cp_rank).astype("int64")).to(device)
        per_sample.index_add_(0, lo + ids // task.seq_length, hit)
    dist.all_reduce(per_sample, group=group)
    return float(per_sample.sum()) / (n * task.digits), float((per_sample == task.digits).double().mean())


def _pretrain(model, task, cfg, spec, options, log=lambda what: None):
    from . import trainer
    from .convergence import MainParams

    main = MainParams([model])
    opt = torch.optim.AdamW(main.param_groups(0.0), lr=cfg.pretrain_lr, betas=(0.9, 0.95))
    losses, step = [], 0
    for length, steps, batch in cfg.stages():
        stage = PasskeyTask(length, task.digits)
        for _ in range(steps):
            s, n = trainer.forward_backward(model, [stage.batch(batch, cfg.seed + step)], spec, options,
                                            device=cfg.device)
            res = trainer.reduce_and_scale(model, s, n, group=_cp(), params=main.main)
            opt.step()
            main.publish()
            main.zero_grad()
            losses.append(res.loss)
            step += 1
        if steps:
            log(f"pretraining stage {length} tokens x {steps} steps: loss {losses[-1]:.3f}")
    return losses


def _final_hidden(model, bt, store):
    """Run ``model`` on the dispatched batch; returns the decoder's output (after the final norm) [s, 1, H]."""
    h = model.decoder.register_forward_hook(lambda m, a, out: store.__setitem__("h", out))
    try:
        model(bt.tokens, bt.position_ids, None, packed_seq_params=bt.params)
    finally:
        h.remove()
    return store.pop("h")


def _train_duo(model, task, cfg, spec, full_opts, gated_opts):
    from megatron_cp.megatron import prepare_batch
    from megatron_cp.megatron.gating import GateSource
    from megatron_cp.gating.gates import DuoGates

    group, cp = _cp(), cfg.cp
    gates = DuoGates(cfg.layers, cfg.kv_heads).to(cfg.device)
    opt = torch.optim.AdamW(gates.parameters(), lr=cfg.gate_lr or 0.05, weight_decay=0.0)
    source = GateSource(gates.values)
    log = []
    for step in range(cfg.gate_steps):
        opt.zero_grad(set_to_none=True)
        tokens, labels, mask = (t.to(cfg.device) for t in task.batch(cfg.gate_batch or cfg.batch,
                                                                      cfg.seed + 10_000 + step))
        with torch.no_grad():
            ref = _final_hidden(model, prepare_batch(tokens, labels, mask, spec, group, full_opts), {})
        bt = prepare_batch(tokens, labels, mask, spec, group, gated_opts, gating=source)
        out = _final_hidden(model, bt, {})
        sel = bt.loss_mask.reshape(-1) > 0
        diff = (out.reshape(-1, out.shape[-1])[sel].float() - ref.reshape(-1, ref.shape[-1])[sel].float())
        distill = diff.pow(2).mean(-1).sum() / _global_count(bt.loss_mask, group)
        # the regulariser is replicated: each CP rank adds 1/cp of it, the all-reduce sums it back to one
        loss = distill + cfg.l1_weight * gates.l1() / cp
        loss.backward()
        _allreduce_grads(gates.parameters(), group)
        opt.step()
        gates.clamp_()
        log.append(float(distill))
    return gates.values().detach().clone(), log


def _train_prulong(model, task, cfg, spec, gated_opts):
    from megatron_cp.megatron import loss_func, prepare_batch
    from megatron_cp.megatron.gating import GateSource
    from megatron_cp.gating.gates import HardConcreteGates, LagrangianSparsity

    group, cp = _cp(), cfg.cp
    gates = HardConcreteGates(cfg.layers, cfg.kv_heads, generator=torch.Generator().manual_seed(cfg.seed))
    lag = LagrangianSparsity(cfg.sparsity, cfg.warmup_steps)
    gates.to(cfg.device)
    lag.to(cfg.device)
    lr = cfg.gate_lr or 0.2
    opt = torch.optim.AdamW(gates.parameters(), lr=lr, weight_decay=0.0)
    opt_lag = torch.optim.AdamW(lag.parameters(), lr=lr, weight_decay=0.0, maximize=True)
    log = []
    for step in range(cfg.gate_steps):
        opt.zero_grad(set_to_none=True)
        opt_lag.zero_grad(set_to_none=True)
        # one draw for the whole CP group: the same seed on every rank
        z = gates.sample(torch.Generator().manual_seed(cfg.seed * 7919 + step))
        tokens, labels, mask = (t.to(cfg.device) for t in task.batch(cfg.gate_batch or cfg.batch,
                                                                      cfg.seed + 10_000 + step))
        bt = prepare_batch(tokens, labels, mask, spec, group, gated_opts, gating=GateSource(lambda: z))
        out = model(bt.tokens, bt.position_ids, None, labels=bt.labels, packed_seq_params=bt.params)
        lm_sum, _n, _ = loss_func(bt.loss_mask, out)
        lm = lm_sum / _global_count(bt.loss_mask, group)
        loss = lm + lag(gates.expected_sparsity(), step) / cp
        loss.backward()
        _allreduce_grads(list(gates.parameters()) + list(lag.parameters()), group)
        opt.step()
        opt_lag.step()
        log.append(float(lm))
    # rank by log_alpha: the expected gates clamp to exactly 1 (or 0) and would tie
    return gates.log_alpha.detach().clone(), log, float(gates.expected_sparsity())


def pattern_path(cfg: GateConfig, method: str, sparsity: float | None = None) -> str:
    """Where ``method``'s pattern goes: ``--out`` itself, or with both methods ``NAME.METHOD.json``; a level
    other than ``--sparsity`` adds ``.sLEVEL``."""
    p = Path(cfg.out)
    tag = "" if cfg.method != "both" else f".{method}"
    if sparsity is not None and sparsity != cfg.sparsity:
        tag += f".s{sparsity:g}"
    return str(p.with_name(f"{p.stem}{tag}{p.suffix or '.json'}")) if tag else cfg.out


def _step_ms(model, task, cfg, spec, options, gating=None) -> float:
    """Median wall time (ms) of one forward + backward of the model on one sample of ``task`` (weights given
    gradients for the measurement only), after one warm-up; CUDA-synchronised on GPU."""
    from megatron_cp.megatron import loss_func, prepare_batch

    tokens, labels, mask = (t.to(cfg.device) for t in task.batch(1, cfg.seed + 77_777))
    model.requires_grad_(True)
    times = []
    try:
        for i in range(cfg.time_steps + 1):
            if cfg.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            bt = prepare_batch(tokens, labels, mask, spec, _cp(), options, gating=gating)
            out = model(bt.tokens, bt.position_ids, None, labels=bt.labels, packed_seq_params=bt.params)
            loss_func(bt.loss_mask, out)[0].backward()
            if cfg.device == "cuda":
                torch.cuda.synchronize()
            if i:
                times.append(1e3 * (time.perf_counter() - t0))
            model.zero_grad(set_to_none=True)
    finally:
        model.requires_grad_(False)
    return sorted(times)[len(times) // 2]


def _progress(rank: int, t0: float, what: str) -> None:
    """One line per finished phase on rank 0's stderr (long runs show where they are)."""
    if rank == 0:
        print(f"[train_gates {time.perf_counter() - t0:7.1f} s] {what}", file=sys.stderr, flush=True)


def _worker(rank, world, cfg: GateConfig):
    import torch.distributed as dist

    from megatron_cp.megatron import MaskSpec, PlanOptions
    from megatron_cp.megatron.gating import GatingSpec, PatternSource
    from megatron_cp.gating.gates import LOG_ALPHA_MEAN, discretize, save_pattern

    from . import trainer
    from .convergence import DTYPES
    from .model import build_llama, transformer_config

    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    trainer.init_parallel(1, cfg.cp)
    t0 = time.perf_counter()
    task = PasskeyTask(cfg.seq_length, cfg.digits)
    spec = MaskSpec("causal")
    full_opts = PlanOptions()
    torch.manual_seed(cfg.seed)
    shape = shape_of(cfg)
    model = build_llama(shape, transformer_config(shape, dtype=DTYPES[cfg.dtype])).to(cfg.device)
    pre = _pretrain(model, task, cfg, spec, full_opts, log=lambda what: _progress(rank, t0, what))
    t_pre = time.perf_counter() - t0
    _progress(rank, t0, f"pretrained: loss {pre[0]:.3f} -> {pre[-1]:.3f}")
    model.requires_grad_(False)  # both objectives here train the gates only
    L, H = cfg.layers, cfg.kv_heads
    es, ev = cfg.eval_samples, cfg.seed + 99_999
    ekw = dict(chunk=cfg.gate_batch, device=cfg.device)
    ends, n = [], 0
    for _, steps, _ in cfg.stages():
        n += steps
        if steps:
            ends.append(round(pre[n - 1], 4))
    res = dict(config=asdict(cfg), pretrain_loss=[pre[0], pre[-1]], stage_end_loss=ends, pretrain_s=round(t_pre, 1),
               total_heads=L * H, methods={},
               rows=[("full (every head full)", L * H, *evaluate(model, task, es, ev, spec, full_opts, **ekw))])
    _progress(rank, t0, f"full model: digit / key accuracy {res['rows'][0][2]:.3f} / {res['rows'][0][3]:.3f}")
    timing = {"full (every head full)": _step_ms(model, task, cfg, spec, full_opts)} if cfg.time_steps else {}
    pat_opts = None
    for method in (tuple(METHODS) if cfg.method == "both" else (cfg.method,)):
        gated_opts = PlanOptions(gating=GatingSpec(cfg.sink, cfg.window, "train", method=method,
                                                   target_sparsity=cfg.sparsity))
        if method == "duo":
            values, glog = _train_duo(model, task, cfg, spec, full_opts, gated_opts)
            init, exp_sparsity = 1.0, None
        else:
            values, glog, exp_sparsity = _train_prulong(model, task, cfg, spec, gated_opts)
            init = LOG_ALPHA_MEAN
        values = values.cpu()
        _progress(rank, t0, f"{method} gates learned: {[[round(float(x), 3) for x in row] for row in values]}")
        res["methods"][method] = dict(gates=values.tolist(), gate_init=init, patterns={},
                                      gate_name="alpha" if method == "duo" else "log_alpha",
                                      expected_sparsity=exp_sparsity, gate_log=[glog[0], glog[-1]])
        for level in cfg.levels():
            pattern = discretize(values, level)
            path = pattern_path(cfg, method, level)
            meta = dict(sparsity=level, sink=cfg.sink, window=cfg.window, method=method,
                        gates=[[round(float(x), 4) for x in row] for row in values])
            if rank == 0:
                save_pattern(path, pattern, meta)
            dist.barrier()
            # the learned pattern runs from its file, as --cp-head-pattern would
            pat_opts = PlanOptions(gating=GatingSpec(cfg.sink, cfg.window, "pattern", pattern=path))
            # control at the same budget: the heads the gates ranked lowest kept full instead
            inverse = discretize(-values, level)
            name = method if len(cfg.levels()) == 1 else f"{method} @{level:g}"
            res["rows"].append((f"{name}: discretised", sum(map(sum, pattern)),
                                *evaluate(model, task, es, ev, spec, pat_opts, **ekw)))
            res["rows"].append((f"{name}: inverse control", sum(map(sum, inverse)),
                                *evaluate(model, task, es, ev, spec, pat_opts, gating=PatternSource(inverse), **ekw)))
            _progress(rank, t0, f"{name}: discretised {res['rows'][-2][2]:.3f} / {res['rows'][-2][3]:.3f}, inverse "
                                f"{res['rows'][-1][2]:.3f} / {res['rows'][-1][3]:.3f}")
            res["methods"][method]["patterns"][f"{level:g}"] = dict(pattern=pattern, path=path)
            if level == cfg.sparsity:
                res["methods"][method].update(pattern=pattern, path=path)
            if cfg.time_steps:
                timing[f"{name}: discretised"] = _step_ms(model, task, cfg, spec, pat_opts)
    res["rows"].append(("streaming only", 0, *evaluate(model, task, es, ev, spec, pat_opts,
                                                       gating=PatternSource([[False] * H for _ in range(L)]), **ekw)))
    if cfg.time_steps:
        timing["streaming only"] = _step_ms(model, task, cfg, spec, pat_opts,
                                            gating=PatternSource([[False] * H for _ in range(L)]))
        res["step_ms"] = {k: round(v, 2) for k, v in timing.items()}
    res["total_s"] = round(time.perf_counter() - t0, 1)
    return res


def table(res: dict) -> str:
    c = res["config"]
    n = res["total_heads"]
    lines = [f"head gating: method {c['method']}  cp {c['cp']}  sparsity {c['sparsity']}  sink {c['sink']}  "
             f"window {c['window']}  seq {c['seq_length']}  key digits {c['digits']}  "
             f"({c['layers']} layers x {c['kv_heads']} KV heads)",
             f"pretrain loss {res['pretrain_loss'][0]:.3f} -> {res['pretrain_loss'][1]:.3f}  "
             f"(chance: digit acc 0.1, key acc {0.1 ** c['digits']:g})",
             f"{'model':<30}{'full heads':>12}{'digit acc':>11}{'key acc':>9}"]
    step = res.get("step_ms", {})
    lines[-1] += f"{'fwd+bwd ms':>12}{'speedup':>9}" if step else ""
    for name, full, dacc, kacc in res["rows"]:
        row = f"{name:<30}{f'{full}/{n}':>12}{dacc:>11.3f}{kacc:>9.3f}"
        if name in step:
            row += f"{step[name]:>12.1f}{step['full (every head full)'] / step[name]:>9.2f}"
        lines.append(row)
    for method, m in res["methods"].items():
        es = m["expected_sparsity"]
        lines.append(f"{method} gates ({m['gate_name']}, init {m['gate_init']}; * = kept full; objective "
                     f"{m['gate_log'][0]:.4f} -> {m['gate_log'][1]:.4f}"
                     + ("" if es is None else f"; expected sparsity {es:.3f}") + f") -> {m['path']}")
        for i, (g, p) in enumerate(zip(m["gates"], m["pattern"])):
            lines.append(f"  layer {i + 1}: " + "  ".join(f"{x:7.3f}{'*' if f else ' '}" for x, f in zip(g, p)))
    lines.append(f"({res['total_s']:.1f} s, pretraining {res['pretrain_s']:.1f} s)")
    return "\n".join(lines)


def parse(argv=None) -> GateConfig:
    d = GateConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=(*METHODS, "both"), default=d.method,
                   help="both: one pretraining, then each objective from the same frozen model")
    for name in ("cp", "sink", "window", "seq_length", "digits", "pretrain_steps", "gate_steps", "warmup_steps",
                 "batch", "eval_samples", "layers", "hidden", "heads", "kv_heads", "seed", "rotary_base"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("gate_batch", "time_steps"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--device", choices=("cpu", "cuda"), default=d.device, help="cuda: one GPU per CP rank (NCCL)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=d.dtype,
                   help="bf16: bf16 model with fp32 master weights (FA4 attention on GPUs)")
    p.add_argument("--schedule", default=d.schedule,
                   help="pretraining stages LEN:STEPS:BATCH,... shortest first (default: --seq-length x "
                        "--pretrain-steps x --batch); gates are learned and evaluated at --seq-length")
    p.add_argument("--sparsities", default=d.sparsities,
                   help="further discretisation levels to evaluate (and time), e.g. 0.5,0.75")
    for name in ("sparsity", "pretrain_lr", "gate_lr", "l1_weight"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name),
                       help="default: duo 0.05, prulong 0.2" if name == "gate_lr" else None)
    p.add_argument("--out", default=d.out, help="the pattern JSON to write")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--png", default=None, help="also draw accuracy (and time, with --time-steps) per model here")
    a = p.parse_args(argv)
    if a.cp < 1:
        p.error(f"--cp must be >= 1, got {a.cp}")
    if not 0.0 <= a.sparsity < 1.0:
        p.error(f"--sparsity must be in [0, 1), got {a.sparsity}")
    kw = {k: v for k, v in vars(a).items() if k not in ("json", "png")}
    cfg = GateConfig(**kw)
    try:
        cfg.stages(), cfg.levels()
    except ValueError as e:
        p.error(str(e))
    return cfg, a.json, a.png


def plot(res: dict, path: str) -> None:
    """Held-out passkey accuracy of every model row (digit and whole key, chance marked) and, when timed, the
    model's forward + backward time of each discretised pattern against full attention."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, rows, step = res["config"], res["rows"], res.get("step_ms", {})
    fig, axes = plt.subplots(1, 2 if step else 1, figsize=(13 if step else 7, 4.6), squeeze=False)
    ax = axes[0][0]
    names = [f"{r[0]} ({r[1]}/{res['total_heads']})" for r in rows]
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [r[2] for r in rows], 0.4, label="digit accuracy")
    ax.barh([i - 0.2 for i in y], [r[3] for r in rows], 0.4, label="whole-key accuracy")
    ax.axvline(0.1, color="gray", ls=":", lw=1, label="digit chance 0.1")
    ax.set_yticks(list(y), names, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="held-out passkey accuracy", xlim=(0, 1),
           title=f"{c['seq_length']} tokens, CP {c['cp']}, {c['layers']} layers x {c['kv_heads']} KV heads")
    ax.legend(fontsize=8, loc="lower right")
    if step:
        ax = axes[0][1]
        keys = list(step)
        ax.barh(range(len(keys)), [step[k] for k in keys], color="tab:green")
        for i, k in enumerate(keys):
            ax.text(step[k], i, f" {step[k]:.1f} ms ({step[keys[0]] / step[k]:.2f}x)", va="center", fontsize=8)
        ax.set_yticks(range(len(keys)), keys, fontsize=8)
        ax.invert_yaxis()
        ax.set(xlabel="model forward + backward, ms (one sample)", xlim=(0, 1.35 * max(step.values())),
               title=f"sink {c['sink']} + window {c['window']} for streaming heads")
    fig.tight_layout()
    if "device" in res:
        from .convergence import sign_figure

        sign_figure(fig, res)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    from .trainer import spawn

    cfg, json_out, png = parse(argv)
    cfg = GateConfig(**{**asdict(cfg), "out": str(Path(cfg.out).resolve())})
    res = spawn(_worker, cfg.cp, cfg, backend="nccl" if cfg.device == "cuda" else "gloo")
    from .convergence import run_record

    res.update(run_record("python -m tiny_llama.train_gates " + shlex.join(sys.argv[1:] if argv is None else argv)))
    print(table(res), flush=True)
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1) + "\n")
    if png:
        plot(res, png)
    return res


if __name__ == "__main__":
    main()
