"""Planning a micro-batch: its document bounds and positions, its mask (``MaskSpec``), its plan (cached: plans are
pure), one plan over DP x CP (``plan_global_batch``) and the planning thread's work on Megatron's groups
(``step_planner``). Pure host work but for the gathers and checks of the DP x CP and planning-thread paths.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

import megatron_cp as mcp

from megatron_cp.planner import Workload, plan_like

from .options import MaskSpec, PlanOptions
from .plan_ahead import in_turn


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


PLANS = PlanCache()  # every micro-batch's plans, made once


def make_plan(mask, cp_size: int, options: PlanOptions, work: Workload | None = None):
    """(plan, strategy) of one micro-batch's mask (the strategy is ``options.strategy``). With
    ``options.helper_process`` megatron-cp's plan and, given ``work``, its exchange choice (and with
    ``options.plan_rank`` that rank's first-call host work, its lists for ``options.kernel_backend``) are made in the
    planning helper process (``runtime.plan_in_helper``: the step's host loop keeps the GIL)."""
    from megatron_cp.baselines import plan_for

    strategy = options.strategy
    if strategy == "megatron_cp":
        # dynamic sparse attention needs whole blocks per rank and every row on its own rank
        sparse = {} if options.sparse is None else {"guest_rows": "none"}
        kw = dict(chunk_size=options.chunk_size, topology=options.topology, solver=options.solver,
                  block=options.block, **sparse)
        if not options.helper_process:
            return mcp.plan(mask, cp_size, **kw), strategy
        if work is not None and options.plan_rank is not None:  # the rank's first-call host work made there too
            kw.update(rank=options.plan_rank, backend=options.kernel_backend, device=torch.device(
                "cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        plan = mcp.runtime.plan_in_helper(mask, cp_size, work=work, **kw)
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
    plan, strategy, _, _ = batch_plan(tok, spec, cp_size, options)
    return plan, strategy


def batch_plan(tok: np.ndarray, spec: MaskSpec, cp_size: int, options: PlanOptions):
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
    plan, strategy = PLANS.get(plan_key, lambda: make_plan(build_mask(spec, cu, b, S), cp_size, options, work))
    if work is not None and strategy == "megatron_cp":  # (made already where the helper process planned)
        mcp.runtime.prebuild(plan, work)
    return plan, strategy, cu, plan_key


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
    plan, strategy = PLANS.get(key, lambda: make_plan(
        mcp.masks.block_diagonal([build_mask(spec, c, b, S) for c in cus]), world, options))
    window_plan = None if spec.layer_window is None else PLANS.get(key + ("layer window", spec.layer_window), lambda:
                                                                    plan_like(mcp.masks.block_diagonal(
                                                                        [build_window_mask(spec, c) for c in cus]), plan))
    return GlobalPlan(tok, cus, plan, strategy, window_plan)


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
