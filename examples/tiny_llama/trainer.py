"""A small explicit training loop on megatron.core, for CPU (gloo) and GPU (NCCL).

``megatron.training.pretrain`` needs CUDA throughout; this loop runs the same model, batch hook
and loss arithmetic anywhere, so the parity tests and the CPU demo exercise the real adapter:

  per micro-batch: prepare_batch (plan + dispatch) -> GPTModel(..., packed_seq_params=CPParams)
                   -> per-token loss -> loss_func (sum, count) -> backward of the sum
  per step:        all-reduce (loss sum, token count) and every gradient over DP x CP,
                   divide gradients by the global token count, optimizer step.

That is what Megatron's schedule does with ``calculate_per_token_loss=True`` (finalize_model_grads
all-reduces the token count over DP x CP and scales the gradients by its inverse).
"""

from __future__ import annotations

import gc
import queue
from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.distributed as dist

from megatron_cp.comm import shared_gpu
from megatron_cp.megatron import MaskSpec, PlanAhead, PlanOptions, loss_func, prepare_step_batch, step_planner
from megatron_cp.testing import free_port

from . import forkserver


def init_parallel(tp: int, cp: int, pp: int = 1, vpp: int | None = None, seed: int = 1234) -> None:
    """Megatron process groups on an initialised default group (sizes checked before any collective);
    ``vpp``: virtual pipeline stages (model chunks) per pipeline rank, or None; ``seed``: Megatron's CUDA RNG
    tracker's (GPU runs)."""
    from megatron.core import parallel_state

    world = dist.get_world_size()
    for name, v in (("tp", tp), ("cp", cp), ("pp", pp)):
        if v < 1:
            raise ValueError(f"{name} size must be >= 1, got {v}")
    if world % (tp * cp * pp):
        raise ValueError(f"world size {world} is not divisible by tp*cp*pp = {tp}*{cp}*{pp}")
    if vpp is not None and (pp < 2 or vpp < 1):
        raise ValueError(f"virtual pipeline stages need pp >= 2 and vpp >= 1, got pp={pp}, vpp={vpp}")
    release_groups()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=vpp, create_gloo_process_groups=False,
    )
    if dist.get_backend() != "gloo" and torch.cuda.is_available():  # GPU ranks: NCCL, or sharing GPUs
        # Megatron's layers fork the model-parallel CUDA RNG under SP (embedding dropout) and TP (weight init);
        # pretrain_gpt.py registers it in initialize_megatron, so a model built without that entry must too
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def release_groups() -> None:
    """Destroy the process groups of Megatron's current layout, then its state. ``destroy_model_parallel`` only
    drops Megatron's references: a process that changes layout many times (the tests) would keep every earlier
    layout's groups alive, each gloo group with its own threads (1,400 threads a process, most of two CPU cores
    spent polling, in one test's 30 layouts)."""
    from megatron.core import parallel_state

    seen, groups = set(), []

    def collect(v):
        if isinstance(v, dist.ProcessGroup):
            if id(v) not in seen and v is not dist.GroupMember.WORLD:
                seen.add(id(v))
                groups.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                collect(x)
        elif isinstance(v, dict):
            for x in v.values():
                collect(x)

    for v in list(vars(parallel_state).values()):
        collect(v)
    parallel_state.destroy_model_parallel()
    for g in groups:
        # destroy_model_parallel leaves a few references of a layout behind; a later call finds those groups
        # already destroyed
        if g in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(g)
    groups.clear()
    gc.collect()  # the groups sit in reference cycles (Megatron's objects): their threads end when collected


def dp_cp_group():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


@dataclass
class StepResult:
    loss: float  # global token-mean loss of the step
    tokens: int  # global number of loss tokens


def forward_step(model, batch, spec: MaskSpec, options: PlanOptions = PlanOptions(), device=None, planned=None):
    """One micro-batch through ``model`` (a whole model or one pipeline stage's chunk): plan, dispatch,
    forward. batch: (tokens, labels, loss_mask) ``[b, S]``, replicated in the CP group; every stage passes
    it (each builds the same plan from the tokens). Returns (output, loss function) as Megatron's
    ``forward_step_func`` does: per-token losses ``[1, s_local]`` on the last stage, else hidden states."""
    tokens, labels, loss_mask = batch
    host = tokens.numpy() if tokens.device.type == "cpu" else None  # plans read these, not a GPU copy
    if device is not None:
        tokens, labels, loss_mask = tokens.to(device), labels.to(device), loss_mask.to(device)
    bt = prepare_step_batch(tokens, labels, loss_mask, spec, options, host, planned)
    out = model(bt.tokens, bt.position_ids, None, labels=bt.labels, packed_seq_params=bt.params)
    return out, partial(loss_func, bt.loss_mask)


def forward_backward(model, micro_batches, spec: MaskSpec, options: PlanOptions = PlanOptions(),
                     device=None):
    """Run forward+backward on this rank's micro-batches; gradients are *sums* (not yet scaled).

    micro_batches: iterable of (tokens, labels, loss_mask), each ``[b, S]``, replicated in the CP
    group. Returns (local loss sum tensor, local token count tensor).
    """
    total = None
    count = None
    # the next micro-batches are planned (and their exchanges chosen) in a thread while this one trains, on a GPU
    # in the planning helper process, as the Megatron plugin's forward_step does (a plan over DP x CP gathers
    # every DP group's tokens in the thread)
    if device is not None and torch.device(device).type == "cuda":
        options = replace(options, helper_process=True)
    ahead = PlanAhead(iter(micro_batches), step_planner(spec, options, "trainer"))  # one such thread at a time
    try:
        for batch in ahead:
            out, loss_fn = forward_step(model, batch, spec, options, device, planned=ahead.last)
            loss, n, _ = loss_fn(out)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
            count = n.to(torch.float64) if count is None else count + n.to(torch.float64)
    finally:
        ahead.close()
    return total.to(torch.float64), count


def pipeline_forward_backward(chunks, micro_batches, spec: MaskSpec, options: PlanOptions = PlanOptions(),
                              device=None):
    """Forward+backward of this pipeline stage with Megatron's own schedule
    (``get_forward_backward_func``: 1F1B, or interleaved 1F1B with one chunk per virtual stage).

    chunks: this stage's model chunks (``build_llama(pre_process=..., post_process=..., vp_stage=i)``);
    micro_batches: list of (tokens, labels, loss_mask) ``[b, S]``, the same list on every stage: each
    stage (and virtual chunk) reads them from its own iterator and plans them itself, so no collective
    spans stages besides the schedule's own sends. Gradients are sums (not yet scaled). Returns
    (loss sum, token count) float64 tensors: this rank's share on the last stage, zeros elsewhere.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro_batches = list(micro_batches)
    b, S = micro_batches[0][0].shape
    iters = [iter(micro_batches) for _ in chunks]
    reports = get_forward_backward_func()(
        forward_step_func=lambda it, model: forward_step(model, next(it), spec, options, device),
        data_iterator=iters if len(chunks) > 1 else iters[0], model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches), seq_length=S, micro_batch_size=b, forward_only=False)
    total = torch.zeros(2, dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for r in reports:
            total += r["lm loss"].detach().to("cpu", torch.float64)
    return total[0], total[1]


def reduce_and_scale(model, loss_sum, count, group=None, params=None) -> StepResult:
    """Sum loss, count and gradients over DP x CP, then divide the gradients by the token count.

    ``model``: a module or a pipeline stage's list of chunks. As Megatron's ``finalize_model_grads``:
    gradients of ``sequence_parallel`` parameters (norms, under --sequence-parallel) are first summed over
    the TP group (each TP rank saw only its shard of the tokens), and the token count comes from the last
    pipeline stage (the other stages contribute zeros). ``params``: the parameters whose ``.grad`` to reduce
    (default: the model's; under mixed precision its fp32 master parameters, which carry the model
    parameters' ``sequence_parallel`` marks)."""
    from megatron.core import parallel_state

    group = group or dp_cp_group()
    if params is None:
        params = [p for m in (model if isinstance(model, (list, tuple)) else [model]) for p in m.parameters()]
    stats = torch.stack([loss_sum.to(torch.float64), count.to(torch.float64)])
    if params:
        stats = stats.to(params[0].device)
    dist.all_reduce(stats, group=group)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(stats, group=parallel_state.get_pipeline_model_parallel_group())
    n = max(float(stats[1]), 1.0)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if getattr(p, "sequence_parallel", False) and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(p.grad, group=tp_group)
        dist.all_reduce(p.grad, group=group)
        p.grad.div_(n)
    return StepResult(float(stats[0]) / n, int(stats[1]))


def dp_shard(global_batch, dp_rank: int, dp_size: int, micro_batch_size: int):
    """Split a global batch (tokens, labels, loss_mask ``[G, S]``) into this DP rank's micro-batches."""
    tokens, labels, loss_mask = global_batch
    G = tokens.shape[0]
    if G % (dp_size * micro_batch_size):
        raise ValueError(f"global batch {G} not divisible by dp_size*micro_batch_size = {dp_size}*{micro_batch_size}")
    per = G // dp_size
    lo = dp_rank * per
    return [
        (tokens[i:i + micro_batch_size], labels[i:i + micro_batch_size], loss_mask[i:i + micro_batch_size])
        for i in range(lo, lo + per, micro_batch_size)
    ]


@dataclass
class TrainConfig:
    steps: int = 30
    global_batch: int = 4
    micro_batch: int = 1
    lr: float = 3e-3
    seed: int = 1234
    spec: MaskSpec = field(default_factory=lambda: MaskSpec("causal"))
    options: PlanOptions = field(default_factory=PlanOptions)


def train(model, batches, cfg: TrainConfig, device=None, log=None) -> list[float]:
    """Train ``model`` on ``batches`` (a function step -> global batch) with AdamW; return the losses."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    for step in range(cfg.steps):
        opt.zero_grad(set_to_none=True)
        mbs = dp_shard(batches(step), dp_rank, dp_size, cfg.micro_batch)
        s, n = forward_backward(model, mbs, cfg.spec, cfg.options, device=device)
        res = reduce_and_scale(model, s, n)
        opt.step()
        losses.append(res.loss)
        if log is not None:
            log(step, res)
    return losses


# what CPU rank processes import before they start (forkserver.start): Megatron and the model.
# Not a module that imports tiny_llama.demo: run as ``python -m tiny_llama.demo``, each rank runs the demo as its
# main module again, which must not be imported already
PRELOAD = ("tiny_llama", "tiny_llama.trainer", "tiny_llama.model", "megatron.core.models.gpt",
           "megatron.core.pipeline_parallel")


def spawn(fn, world_size: int, *args, backend: str = "gloo", timeout_s: int = 600):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes with a fresh TCP rendezvous.

    ``fn`` must be a picklable top-level function; its return value on rank 0 is returned. ``backend``: "gloo"
    (CPU ranks), "nccl" (a GPU per rank) or ``shared_gpu.BACKEND`` (ranks spread over the visible GPUs, gloo
    through host copies: correctness only; without a GPU, CPU ranks on that process group).
    """
    import torch.multiprocessing as mp

    port = free_port()
    # CPU ranks fork from a server that imported torch, Megatron and this package once (~8 s of CPU a rank
    # otherwise; tiny_llama first: its quiet() filters Megatron's start-up warnings there too). GPU ranks are
    # spawned, so no process touches CUDA before its own fork or spawn
    gpu = backend == "nccl" or (backend == shared_gpu.BACKEND and torch.cuda.is_available())
    ctx = mp.get_context("spawn") if gpu else forkserver.start(PRELOAD)
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, backend, fn, args, q)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    # After the first failure the other ranks may wait forever in a collective: give them a short
    # grace period to report, then end them (only the processes started here).
    deadline = timeout_s
    while len(results) + len(errors) < world_size:
        try:
            rank, ok, val = q.get(timeout=deadline)
        except queue.Empty:
            break
        (results.__setitem__(rank, val) if ok else errors.append((rank, val)))
        if errors:
            deadline = 15
    for p in procs:
        p.join(5 if errors else timeout_s)
        if p.is_alive():
            p.terminate()
            p.join(5)
    missing = sorted(set(range(world_size)) - set(results) - {r for r, _ in errors})
    if errors or missing:
        msg = "\n".join(f"[rank {r}] {e}" for r, e in errors)
        if missing:
            msg += f"\nranks {missing} did not report (ended)"
        raise RuntimeError("worker failed:\n" + msg)
    return results.get(0)


def _entry(rank, world_size, port, backend, fn, args, q):
    import traceback
    from datetime import timedelta

    gc.freeze()  # what the fork server imported is never garbage: release_groups' collections skip it
    try:
        if backend == "nccl" or (backend == shared_gpu.BACKEND and torch.cuda.is_available()):
            torch.cuda.set_device(shared_gpu.rank_device(rank, world_size, backend == shared_gpu.BACKEND))
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=300))
        val = fn(rank, world_size, *args)
        q.put((rank, True, val))
    except BaseException:  # report every failure to the parent instead of hanging it
        q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                release_groups()
            except Exception:
                pass
            dist.destroy_process_group()
