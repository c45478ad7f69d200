"""Batch preparation replacing Megatron's ``get_batch_on_this_cp_rank``.

Megatron's split assumes the zigzag layout and equal token counts on every CP rank. Here a plan is
made per micro-batch and every per-token tensor is dispatched by it:

1. The ``b`` samples of the micro-batch are concatenated into one sequence of ``b * S`` tokens
   (one plan, one attention call per layer for the whole micro-batch). Sample boundaries are always
   document boundaries; with a packed mask, each EOD token also ends a document (the EOD belongs
   to the document it closes, as in Megatron's ``reset_attention_mask``).
2. Positions restart at 0 at every document (``reset_position_ids`` semantics), or at every sample.
3. The mask is built from these documents (``MaskSpec``) and planned with ``megatron_cp.plan``.
4. tokens, labels, loss_mask and position_ids are dispatched: each becomes ``[1, s_local]``.

Labels are already shifted by the data set (``labels[i]`` is the token after ``tokens[i]`` within
the sample), so shifting happens before dispatch and stays exact.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

import megatron_cp as mcp

from megatron_cp.kernels import upload
from megatron_cp.planner import Workload, plan_like

from .params import CPParams
from .plan_ahead import in_turn

# masks built from each micro-batch's sample and document boundaries; the others are the builders of
# megatron_cp.masks that take (seqlen, sizes), called per sample (sliding_window is the boundary mask's)
BOUNDARY_MASKS = ("causal", "packed", "sliding_window", "packed_sliding_window")
BUILDER_MASKS = tuple(n for n in mcp.masks.builders_taking("sizes") if n not in BOUNDARY_MASKS)
MASKS = BOUNDARY_MASKS + BUILDER_MASKS


@dataclass(frozen=True)
class MaskSpec:
    """Which mask each micro-batch gets.

    name:    causal (per sample) | packed (causal per EOD-separated document) |
             sliding_window (causal, ``window`` keys back, per sample) |
             packed_sliding_window (the same per document) | a builder of ``megatron_cp.masks``
             called as ``builder(S, **kwargs)`` per sample
    window:  left window for the sliding variants (keys ``j`` with ``i - window <= j <= i``)
    eod:     EOD token id (needed by the packed variants)
    kwargs:  keyword arguments of a builder, as sorted (name, value) pairs
    layer_window: the windowed layers' left window (Megatron's ``--window-size W,0`` with
             ``--window-attn-skip-freq``: those layers keep keys ``i - W .. i`` inside the mask's samples or
             documents, the others the whole mask); ``causal`` and ``packed`` only
    """

    name: str = "causal"
    window: int | None = None
    eod: int | None = None
    kwargs: tuple = ()
    layer_window: int | None = None

    def __post_init__(self):
        if self.name not in MASKS:
            raise ValueError(f"unknown mask {self.name!r}; choose from {', '.join(MASKS)}")
        if "sliding" in self.name and (self.window is None or int(self.window) < 0):
            raise ValueError(f"mask {self.name!r} needs window >= 0, got window={self.window}")
        if self.layer_window is not None and (self.name not in ("causal", "packed") or int(self.layer_window) < 0):
            raise ValueError(f"layer_window={self.layer_window} (windowed layers) needs the causal or packed mask and "
                             f"a window >= 0, got mask {self.name!r}")
        if self.name.startswith("packed") and self.eod is None:
            raise ValueError(f"mask {self.name!r} needs the EOD token id, got eod=None")

    @property
    def packed(self) -> bool:
        return self.name.startswith("packed")


@dataclass(frozen=True)
class PlanOptions:
    """Arguments passed through to ``megatron_cp.plan`` (chunk_size, topology, solver) and to
    ``megatron_cp.attention`` (kernel_backend: a name of ``kernels.BACKEND_CHOICES``). ``strategy``: a name of
    ``baselines.STRATEGY_NAMES``: ``megatron_cp``, or a baseline, which then also chooses the plan's layout
    (``baselines.plan_for``; ``solver`` is not used)."""

    chunk_size: int | None = None
    topology: object = None
    solver: str = "auto"
    kernel_backend: str = "auto"
    strategy: str = "megatron_cp"
    sparse: object = None  # a SparseSpec (--cp-sparse): plans in whole blocks, selectors per layer
    gating: object = None  # a gating.GatingSpec (--cp-head-gating / --cp-head-pattern): adds a streaming plan
    # every rank's token count a multiple of this: the TP size under --sequence-parallel, whose regions
    # (norms, residual, dropout) split a rank's local tokens evenly over its TP ranks
    token_multiple: int = 1
    # the attention inputs' shape per sequence (query heads, key/value heads, head_dim, bytes per element: a
    # planner Workload): where known, planning ahead also chooses each plan's exchange (runtime.prebuild)
    workload: object = None
    # megatron-cp's plans (and exchange choices) made in the planning helper process (runtime.plan_in_helper),
    # not beside the step in this interpreter: what the plugin sets where the step runs on a GPU
    helper_process: bool = False
    # one plan per micro-batch over the whole DP x CP world (--cp-balance-over-dp, prepare_global_batch)
    over_dp: bool = False

    @property
    def block(self) -> int:
        """Every chunk cut of the plan a multiple of this: lcm of the sparse block and ``token_multiple``."""
        return math.lcm(1 if self.sparse is None else int(self.sparse.block), int(self.token_multiple))

    def __post_init__(self):
        if isinstance(self.token_multiple, bool) or not isinstance(self.token_multiple, int) or self.token_multiple < 1:
            raise ValueError(f"token_multiple must be a positive int (the TP size under --sequence-parallel), "
                             f"got {self.token_multiple!r}")
        if self.token_multiple > 1 and self.strategy == "head_context":
            raise ValueError("--sequence-parallel does not combine with --context-parallel-impl head_context: its "
                             "Ulysses pieces split a group's tokens in equal parts that need not divide by the TP "
                             "size; use megatron_cp, ring, ulysses, usp or allgather")
        if self.gating is not None:
            if self.strategy != "megatron_cp":
                raise ValueError(f"head gating runs with strategy megatron_cp, not {self.strategy!r}")
            if self.sparse is not None:
                raise ValueError("head gating and dynamic sparse attention (--cp-sparse) do not combine")
        if self.over_dp and (self.strategy != "megatron_cp" or self.sparse is not None or self.gating is not None
                             or self.token_multiple != 1):
            raise ValueError("one plan over DP x CP (--cp-balance-over-dp) runs megatron_cp's dense attention: no "
                             "baseline strategy, --cp-sparse, head gating or --sequence-parallel")
        if self.strategy != "megatron_cp":
            from megatron_cp.baselines import STRATEGIES

            if self.strategy not in STRATEGIES:
                raise ValueError(f"strategy={self.strategy!r} is unknown; choose megatron_cp or one of "
                                 f"{', '.join(STRATEGIES)}")


def document_bounds(tokens: np.ndarray, spec: MaskSpec) -> np.ndarray:
    """tokens int ``[b, S]`` -> cu_seqlens int64 over the ``b * S`` concatenated tokens."""
    b, S = tokens.shape
    cuts = {i * S for i in range(b + 1)}
    if spec.packed:
        flat = tokens.reshape(-1)
        cuts.update((np.nonzero(flat == spec.eod)[0] + 1).tolist())
    return np.array(sorted(c for c in cuts if 0 <= c <= b * S), dtype=np.int64)


def positions_from_bounds(cu: np.ndarray) -> np.ndarray:
    """cu_seqlens -> position of every token inside its document (int64 ``[cu[-1]]``)."""
    n = int(cu[-1])
    starts = np.repeat(cu[:-1], np.diff(cu))
    return np.arange(n, dtype=np.int64) - starts


def build_mask(spec: MaskSpec, cu: np.ndarray, b: int, S: int):
    """The ``AttnMask`` of one micro-batch over ``b * S`` tokens."""
    if spec.name in ("causal", "packed"):
        return mcp.masks.varlen(cu, causal=True)
    if spec.name in ("sliding_window", "packed_sliding_window"):
        return mcp.masks.varlen(cu, causal=True, window=int(spec.window))
    builder = getattr(mcp.masks, spec.name, None)
    if builder is None:
        raise ValueError(f"megatron_cp.masks has no builder {spec.name!r}")
    one = builder(S, **dict(spec.kwargs))
    return one if b == 1 else mcp.masks.block_diagonal([one] * b)


def build_window_mask(spec: MaskSpec, cu: np.ndarray):
    """The windowed layers' mask (``spec.layer_window``): causal within the same samples or documents as
    ``build_mask``, keeping keys ``i - layer_window .. i``."""
    return mcp.masks.varlen(cu, causal=True, window=int(spec.layer_window))


class PlanCache:
    """LRU cache of plans keyed by (mask spec, document bounds, cp size); plans are pure.

    Thread-safe: a background thread may plan ahead (``plan_ahead.PlanAhead``) while the step asks for
    the same key; a key being made is made once, and a second asker waits for that result (an error
    of ``make`` reaches every asker). ``made``: how many values ``make`` built."""

    def __init__(self, size: int = 64):
        self.size, self._d = size, OrderedDict()
        self._lock = threading.Lock()
        self._making: dict = {}  # key -> Future of a value being made
        self.made = 0

    def get(self, key, make):
        with self._lock:
            if key in self._d:
                self._d.move_to_end(key)
                return self._d[key]
            fut = self._making.get(key)
            mine = fut is None
            if mine:
                fut = self._making[key] = Future()
        if not mine:
            return fut.result()
        try:
            val = make()
        except BaseException as e:
            with self._lock:
                del self._making[key]
            fut.set_exception(e)
            raise
        with self._lock:
            self._d[key] = val
            self.made += 1
            if len(self._d) > self.size:
                self._d.popitem(last=False)
            del self._making[key]
        fut.set_result(val)
        return val


_PLANS = PlanCache()


@dataclass
class CPBatch:
    tokens: torch.Tensor
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    position_ids: torch.Tensor
    params: CPParams
    cu_seqlens: np.ndarray = field(repr=False, default=None)


def make_plan(mask, cp_size: int, options: PlanOptions, work: Workload | None = None):
    """(plan, strategy) of one micro-batch's mask (the strategy is ``options.strategy``). With
    ``options.helper_process`` megatron-cp's plan and, given ``work``, its exchange choice are made in the
    planning helper process (``runtime.plan_in_helper``: the step's host loop keeps the GIL)."""
    from megatron_cp.baselines import plan_for

    strategy = options.strategy
    if strategy == "megatron_cp":
        # dynamic sparse attention needs whole blocks per rank and every row on its own rank
        sparse = {} if options.sparse is None else {"guest_rows": "none"}
        kw = dict(chunk_size=options.chunk_size, topology=options.topology, solver=options.solver,
                  block=options.block, **sparse)
        plan = mcp.runtime.plan_in_helper(mask, cp_size, work=work, **kw) if options.helper_process \
            else mcp.plan(mask, cp_size, **kw)
        return plan, strategy
    block = {} if options.block == 1 else {"block": options.block}  # head_context takes no block (refused)
    return plan_for(strategy, mask, cp_size, chunk_size=options.chunk_size, topology=options.topology,
                    **block), strategy


def plan_for_batch(tokens, spec: MaskSpec, cp_size: int, options: PlanOptions = PlanOptions()):
    """(plan, strategy) of the micro-batch ``tokens`` (int ``[b, S]``, tensor or array), made and cached
    under the key ``prepare_batch`` uses, so ``prepare_batch`` of the same tokens (same spec, CP size and
    options) then finds it without planning: what ``plan_ahead.PlanAhead`` runs ahead of the step.
    Pure host work (no collective); thread-safe."""
    tok = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    plan, strategy, _, _ = _batch_plan(tok, spec, cp_size, options)
    return plan, strategy


def _batch_plan(tok: np.ndarray, spec: MaskSpec, cp_size: int, options: PlanOptions):
    """(plan, strategy, document bounds, cache key) of host tokens ``tok`` [b, S]: the checks, the cached plan and,
    given ``options.workload``, the exchange of the attention's first call on it (``runtime.prebuild``)."""
    if tok.ndim != 2:
        raise ValueError(f"tokens must be [b, S], got shape {tuple(tok.shape)}")
    b, S = tok.shape
    if b * S < cp_size:
        raise ValueError(f"micro-batch of {b}x{S} tokens is smaller than cp_size={cp_size}")
    if (b * S) % options.token_multiple:
        raise ValueError(f"--sequence-parallel needs the micro-batch's {b}x{S} tokens divisible by the TP size "
                         f"{options.token_multiple}")
    cu = document_bounds(tok, spec)
    plan_key = (spec, b, S, cp_size, options.chunk_size, options.topology, options.solver, options.strategy,
                options.block, cu.tobytes() if spec.packed else b"")
    w = options.workload
    # core attention folds the micro-batch's b sequences into heads
    work = Workload(b * w.num_heads, b * w.num_kv_heads, w.head_dim, w.dtype_bytes) \
        if w is not None and options.sparse is None and options.gating is None else None
    plan, strategy = _PLANS.get(plan_key, lambda: make_plan(build_mask(spec, cu, b, S), cp_size, options, work))
    if work is not None and strategy == "megatron_cp":  # (made already where the helper process planned)
        mcp.runtime.prebuild(plan, work)
    return plan, strategy, cu, plan_key


def prepare_batch(
    tokens: torch.Tensor,
    labels: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    spec: MaskSpec,
    cp_group,
    options: PlanOptions = PlanOptions(),
    gating=None,
    host_tokens: np.ndarray | None = None,
    planned=None,
) -> CPBatch:
    """Plan and dispatch one micro-batch.

    tokens / labels / loss_mask: ``[b, S]`` (int64, int64, float), the full micro-batch, identical on
    every rank of ``cp_group`` (as Megatron's data loader gives them). Returns ``[1, s_local]`` tensors
    on the same device plus ``params`` to pass as ``packed_seq_params``. ``cp_group=None`` means CP=1.
    No collective: that the CP ranks hold the same plan is checked by the attention's first call of it
    (``runtime.verify_plan``), before any exchange.

    With ``options.gating`` (a ``GatingSpec``) the params also carry the streaming plan
    (``plan_like(streaming_within(mask, sink, window), plan)``) and a gating object: ``gating`` if given
    (train mode needs one: a ``gating.GateSource`` over the training loop's gates), else the spec's own
    (pattern mode: the ``--cp-head-pattern`` file). ``host_tokens``: the same tokens on the host where the
    caller has them (the loader's copy): the plan is then found without copying ``tokens`` back from the
    GPU, a copy that would make the host wait for the previous micro-batch's kernels. ``planned``: the plan a
    planning thread made and checked across the CP ranks for this micro-batch (``checked_planner``): its first
    attention call then runs no check of its own.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [b, S], got shape {tuple(tokens.shape)}")
    for name, t in (("labels", labels), ("loss_mask", loss_mask)):
        if t is not None and t.shape != tokens.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} differs from tokens {tuple(tokens.shape)}")
    b, S = tokens.shape
    cp_size = 1 if cp_group is None else cp_group.size()
    cp_rank = 0 if cp_group is None else cp_group.rank()
    if host_tokens is None:
        tok_np = tokens.detach().cpu().numpy()
    else:
        tok_np = np.asarray(host_tokens)
        if tok_np.shape != tuple(tokens.shape):
            raise ValueError(f"host_tokens shape {tok_np.shape} differs from tokens {tuple(tokens.shape)}")
    plan, strategy, cu, plan_key = _batch_plan(tok_np, spec, cp_size, options)
    if planned is not None:  # taken now, at the same point of every rank's step (runtime.accept_plan_check)
        mcp.runtime.accept_plan_check(planned, cp_group)
    stream_plan = None
    if options.gating is not None:
        g = options.gating
        gating = gating if gating is not None else g.source()
        if gating is None:
            raise ValueError("head gating in train mode needs prepare_batch(..., gating=GateSource(...)): the "
                             "gates are the training loop's parameters")
        # the same token layout as the full plan: one dispatch serves both kinds of heads
        stream_plan = _PLANS.get(plan_key + ("stream", g.sink, g.window), lambda: plan_like(
            mcp.masks.streaming_within(build_mask(spec, cu, b, S), g.sink, g.window), plan))
    elif gating is not None:
        raise ValueError("prepare_batch(gating=...) needs PlanOptions.gating (sink, window) for the streaming plan")
    window_plan = None
    if spec.layer_window is not None:
        if strategy != "megatron_cp" or options.sparse is not None or options.gating is not None:
            raise ValueError(f"windowed layers (layer_window={spec.layer_window}) run with megatron_cp's own plan, "
                             f"without sparse attention or head gating (got strategy {strategy!r})")
        # the same token layout: the windowed layers' work follows the tokens, balanced with them
        window_plan = _PLANS.get(plan_key + ("layer window", spec.layer_window),
                                 lambda: plan_like(build_window_mask(spec, cu), plan))
    ids = upload(plan.local_ids(cp_rank), tokens.device)
    pos = upload(positions_from_bounds(cu), tokens.device)

    def take(x):
        return None if x is None else x.reshape(-1).index_select(0, ids).unsqueeze(0)

    local_pos = take(pos)
    params = CPParams(plan=plan, position_ids=local_pos, cp_rank=cp_rank, cp_group=cp_group,
                      kernel_backend=options.kernel_backend, strategy=strategy, sparse=options.sparse,
                      gating=gating, stream_plan=stream_plan, layer_window=spec.layer_window,
                      window_plan=window_plan, qkv_format="sbhd")
    return CPBatch(take(tokens), take(labels), take(loss_mask), local_pos, params, cu)


@dataclass(frozen=True)
class GlobalPlan:
    """One micro-batch's plan over the DP x CP world: every DP group's host tokens ``[dp, b, S]`` (in DP rank
    order), their document bounds and the plan of their block-diagonal mask over every rank."""

    tokens: np.ndarray
    cu_seqlens: list
    plan: object
    strategy: str
    window_plan: object = None  # the windowed layers' plan (MaskSpec.layer_window) on the same layout


def plan_global_batch(host_tokens: np.ndarray, spec: MaskSpec, host_group, *, dp_rank: int, cp_rank: int,
                      cp_size: int, options: PlanOptions = PlanOptions()) -> GlobalPlan:
    """Gather every DP group's micro-batch tokens on the host over ``host_group`` (a gloo group of the DP x CP
    world: every rank calls this for the same micro-batch, in the same order) and plan them over all its ranks
    (cached as ``prepare_batch``'s plans are; on a GPU in the planning helper process with
    ``options.helper_process``). What ``prepare_global_batch`` runs, or a planning thread ahead of the step on a
    gloo group of its own (``runtime.planning_group``): the step then gathers only the device fields."""
    host = np.ascontiguousarray(host_tokens, dtype=np.int64)
    if host.ndim != 2:
        raise ValueError(f"tokens must be [b, S], got shape {tuple(host.shape)}")
    b, S = host.shape
    world = host_group.size()
    dp = world // cp_size
    with in_turn():  # several plans made at once by PlanAhead gather in micro-batch order on every rank
        tok = mcp.runtime.all_micro_batches({"tokens": torch.from_numpy(host.reshape(-1))}, host_group,
                                            dp_rank=dp_rank, cp_rank=cp_rank, cp_size=cp_size)["tokens"]
    tok = tok.numpy().reshape(dp, b, S)
    cus = [document_bounds(tok[d], spec) for d in range(dp)]
    key = (spec, "dp x cp", dp, b, S, world, options.chunk_size, options.topology, options.solver, options.block,
           tuple(c.tobytes() for c in cus) if spec.packed else b"")
    plan, strategy = _PLANS.get(key, lambda: make_plan(
        mcp.masks.block_diagonal([build_mask(spec, c, b, S) for c in cus]), world, options))
    window_plan = None if spec.layer_window is None else _PLANS.get(key + ("layer window", spec.layer_window), lambda:
                                                                    plan_like(mcp.masks.block_diagonal(
                                                                        [build_window_mask(spec, c) for c in cus]), plan))
    return GlobalPlan(tok, cus, plan, strategy, window_plan)


def prepare_global_batch(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    spec: MaskSpec,
    group,
    *,
    dp_rank: int,
    cp_rank: int,
    cp_size: int,
    options: PlanOptions = PlanOptions(),
    host_tokens: np.ndarray | None = None,
    planned: "GlobalPlan | None" = None,
) -> CPBatch:
    """``prepare_batch`` with one plan over the whole DP x CP world (``--cp-balance-over-dp``).

    tokens / labels / loss_mask: ``[b, S]``, this DP group's micro-batch (the same on its CP ranks). Every DP
    group's micro-batch is gathered (``runtime.all_micro_batches``), their masks put side by side
    (``masks.block_diagonal``) and planned over ``group`` (every rank of the DP x CP world), and this rank keeps
    the tokens the plan gives it: ``[1, s_local]`` tensors and ``params`` whose ``cp_group`` is ``group``, which
    core attention then runs over. The per-token loss summed over the global batch and Megatron's gradient
    reduction over DP x CP make loss and gradients those of the fixed layout. ``planned``: this micro-batch's
    ``plan_global_batch``, made ahead by a planning thread (not used if made for other tokens); else it is made
    here from tokens gathered on the host over a gloo twin of ``group`` (``host_tokens``: the loader's host copy
    where there is one, else one copy back from the device), so the GPU queue is not waited for. The device
    fields are gathered on their own devices."""
    if not options.over_dp:
        raise ValueError("prepare_global_batch needs PlanOptions(over_dp=True) (--cp-balance-over-dp)")
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [b, S], got shape {tuple(tokens.shape)}")
    for name, t in (("labels", labels), ("loss_mask", loss_mask)):
        if t.shape != tokens.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} differs from tokens {tuple(tokens.shape)}")
    place = dict(dp_rank=dp_rank, cp_rank=cp_rank, cp_size=cp_size)
    if host_tokens is None:
        host = tokens.detach().cpu().numpy()
    else:
        host = np.ascontiguousarray(host_tokens, dtype=np.int64)
        if tuple(host.shape) != tuple(tokens.shape):
            raise ValueError(f"host_tokens shape {tuple(host.shape)} differs from tokens {tuple(tokens.shape)}")
    # a plan made ahead for other tokens (a micro-batch read again without its planning thread, as Megatron's
    # rerun of a step does on every rank) is not used: planned here instead
    if planned is None or not np.array_equal(planned.tokens[dp_rank], host):
        planned = plan_global_batch(host, spec, mcp.runtime.host_group(group), options=options, **place)
    plan, strategy, cus = planned.plan, planned.strategy, planned.cu_seqlens
    full = mcp.runtime.all_micro_batches(
        {"tokens": tokens.reshape(-1), "labels": labels.reshape(-1), "loss_mask": loss_mask.reshape(-1)}, group,
        **place)
    rank = group.rank()
    ids = upload(plan.local_ids(rank), tokens.device)
    pos = upload(np.concatenate([positions_from_bounds(c) for c in cus]), tokens.device)

    def take(x):
        return x.index_select(0, ids).unsqueeze(0)

    local_pos = take(pos)
    params = CPParams(plan=plan, position_ids=local_pos, cp_rank=rank, cp_group=group,
                      kernel_backend=options.kernel_backend, strategy=strategy, layer_window=spec.layer_window,
                      window_plan=planned.window_plan, qkv_format="sbhd")
    return CPBatch(take(full["tokens"]), take(full["labels"]), take(full["loss_mask"]), local_pos, params,
                   cus[dp_rank])


def prepare_step_batch(tokens, labels, loss_mask, spec: MaskSpec, options: PlanOptions = PlanOptions(),
                       host_tokens: np.ndarray | None = None, planned: GlobalPlan | None = None) -> CPBatch:
    """A training step's micro-batch on Megatron's groups: ``prepare_batch`` over the CP group, or with
    ``options.over_dp`` ``prepare_global_batch`` over the DP x CP group. ``planned``: what the planning thread
    returned for this micro-batch (``step_planner``'s function), or None."""
    from megatron.core import parallel_state as ps

    if options.over_dp:
        world = ps.get_data_parallel_group(with_context_parallel=True)
        return prepare_global_batch(tokens, labels, loss_mask, spec, world, dp_rank=ps.get_data_parallel_rank(),
                                    cp_rank=ps.get_context_parallel_rank(),
                                    cp_size=ps.get_context_parallel_world_size(), options=options,
                                    host_tokens=host_tokens, planned=planned)
    return prepare_batch(tokens, labels, loss_mask, spec, ps.get_context_parallel_group(), options,
                         host_tokens=host_tokens, planned=planned)


def step_planner(spec: MaskSpec, options: PlanOptions, purpose: str):
    """The planning thread's function on Megatron's groups: a micro-batch (a dict with ``tokens``, or a (tokens,
    labels, loss_mask) tuple) -> what ``prepare_step_batch(..., planned=)`` takes for it. With ``options.over_dp``
    its ``GlobalPlan`` (the DP groups' tokens gathered in the thread); else its plan (``plan_for_batch``), checked
    across the CP ranks (``runtime.check_plan_ahead``) when megatron_cp's, or None. The thread's collectives run on
    a gloo group of its own (``runtime.planning_group(group, purpose)``, made here: call this on every rank at the
    same point, and give each planning thread that may run beside another its own ``purpose``)."""
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    if options.over_dp:
        group = mcp.runtime.planning_group(ps.get_data_parallel_group(with_context_parallel=True), purpose)
        place = dict(dp_rank=ps.get_data_parallel_rank(), cp_rank=ps.get_context_parallel_rank(), cp_size=cp)
    else:
        cp_group = ps.get_context_parallel_group()
        group = mcp.runtime.planning_group(cp_group, purpose) if cp > 1 else None

    def plan_fn(batch):
        tok = batch["tokens"] if isinstance(batch, dict) else batch[0]
        if options.over_dp:
            tok = tok.detach().cpu().numpy() if isinstance(tok, torch.Tensor) else np.asarray(tok)
            return plan_global_batch(tok, spec, group, options=options, **place)
        plan, strategy = plan_for_batch(tok, spec, cp, options)
        if group is None or strategy != "megatron_cp":
            return None
        with in_turn():
            mcp.runtime.check_plan_ahead(plan, cp_group, group)
        return plan

    return plan_fn
