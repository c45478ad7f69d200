"""Hooks for Megatron-LM's ``pretrain_gpt.py`` (megatron.training.pretrain), no fork needed.

``patches/pretrain_gpt.patch`` adds two lines before ``if __name__ == "__main__":``::

    import megatron_cp.megatron.plugin as _megatron_cp  # megatron-cp
    _megatron_cp.install_into(globals())                 # megatron-cp

``install_into`` rebinds, in that script's namespace only, the names its main block and data set-up read:

* ``parse_and_validate_args``: adds ``--context-parallel-impl`` and the ``--cp-*`` flags to whatever
  ``extra_args_provider`` the script passes, runs the parse-time checks (``validate_args``) and with
  ``megatron_cp`` selects our layer spec (``--spec megatron_cp.megatron.specs megatron_cp_layer_spec``:
  Megatron's spec for the model's config with core attention swapped; another ``--spec`` is refused);
* ``forward_step``: with ``--context-parallel-impl te`` the script's own function runs unchanged; with
  ``megatron_cp`` our ``forward_step`` runs (batch hook, RoPE, per-token loss);
* ``is_dataset_built_on_rank`` (where the script has it): with ``megatron_cp`` every pipeline stage's TP
  rank 0 reads the data, as Megatron does for packed sequences: each stage plans the micro-batch itself.

``uninstall_from(namespace)`` restores the originals. Nothing in Megatron's packages is patched.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import torch

from megatron_cp.planner import Workload
from megatron_cp.runtime import start_planning_helpers

from . import rope
from .arguments import OURS, add_megatron_cp_args, check_megatron_args, compose, dry_run, specs_from_args
from .batch import prepare_step_batch
from .planning import step_planner
from .loss import loss_func, record_documents
from .plan_ahead import PlanAhead, default_workers
from .step_log import STEP_LOG

_SAVED = "_megatron_cp_saved"
SPEC = ["megatron_cp.megatron.specs", "megatron_cp_layer_spec"]


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def ensure_installed(model) -> None:
    """Install plan RoPE on the (wrapped) model once; a no-op on later calls."""
    inner = _unwrap(model)
    if getattr(inner, "_megatron_cp_rope", None) is None:
        inner._megatron_cp_rope = rope.install(inner)


def plan_specs(args, eod: int | None = None):
    """``specs_from_args`` plus what Megatron's own flags imply for the plan: under ``--sequence-parallel``
    every rank's token count is a multiple of ``--tensor-model-parallel-size`` (``PlanOptions.token_multiple``)."""
    spec, options = specs_from_args(args, eod=eod)
    if getattr(args, "sequence_parallel", False):
        options = dataclasses.replace(options, token_multiple=int(args.tensor_model_parallel_size))
    work = attention_workload(args)
    if work is not None:
        options = dataclasses.replace(options, workload=work)
    return spec, options


def attention_workload(args):
    """The shape of one sequence's core attention inputs on a rank (a planner ``Workload``: query heads and
    key/value heads per TP rank, head_dim, bytes per element), from Megatron's flags; None under
    ``--multi-latent-attention`` (its head dims are its own) or when the flags do not say."""
    heads = getattr(args, "num_attention_heads", None)
    hidden = getattr(args, "hidden_size", None)
    if getattr(args, "multi_latent_attention", False) or not isinstance(heads, int) or not isinstance(hidden, int):
        return None
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    kv = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    head_dim = getattr(args, "kv_channels", None) or hidden // heads
    if not isinstance(kv, int) or heads % tp or kv % tp:
        return None
    wide = getattr(args, "bf16", False) or getattr(args, "fp16", False)
    return Workload(heads // tp, kv // tp, int(head_dim), 2 if wide else 4)


def validate_args(args) -> None:
    """Parse-time checks for ``--context-parallel-impl`` megatron_cp (or a baseline), raising ValueError naming
    the flag: Megatron options we do not honour (``arguments.UNSUPPORTED``), Megatron's document and window
    flags mapped onto ``--cp-mask`` (``arguments.check_megatron_args``), every ``--cp-*`` flag, and a dry run
    that builds the mask and plan of one micro-batch (``arguments.dry_run``). Under ``te`` our flags are refused."""
    check_megatron_args(args)
    if args.context_parallel_impl not in OURS:
        return
    if getattr(args, "pipeline_model_parallel_size", 1) > 1:
        # a rank's token count depends on the micro-batch's plan, so stages exchange activation shapes
        # with every send (Megatron's mechanism for data with variable sequence lengths; no CLI flag).
        # Megatron refuses that beside the allgather MoE dispatcher, its default even for dense models.
        dispatcher = getattr(args, "moe_token_dispatcher_type", "allgather")
        if dispatcher == "allgather":
            if getattr(args, "num_experts", None):
                raise ValueError("--pipeline-model-parallel-size > 1 with megatron_cp exchanges variable activation "
                                 "shapes, which Megatron's --moe-token-dispatcher-type allgather does not support: "
                                 "use --moe-token-dispatcher-type alltoall (or flex)")
            args.moe_token_dispatcher_type = "alltoall"  # no MoE layer: the dispatcher is never built
        args.variable_seq_lengths = True
    backend = str(getattr(args, "attention_backend", "auto"))
    if backend.endswith("local"):
        raise ValueError(f"--attention-backend {backend} makes Megatron swap in DotProductAttention; use auto")
    if getattr(args, "position_embedding_type", "rope") != "rope":
        raise ValueError(f"megatron_cp needs --position-embedding-type rope, got {args.position_embedding_type!r}")
    if args.spec is None:
        args.spec = list(SPEC)
    elif not str(args.spec[0]).startswith("megatron_cp."):
        raise ValueError(f"--spec {' '.join(args.spec)} builds Megatron's own core attention, which would run on "
                         "megatron-cp's token layout; leave --spec out (megatron-cp then takes Megatron's spec for the "
                         f"model's config and swaps only core attention: --spec {' '.join(SPEC)})")
    spec, options = plan_specs(args, eod=0)  # any EOD id plans alike; the real one comes from the tokenizer later
    if options.gating is not None and options.gating.mode == "train":
        raise ValueError(f"--cp-head-gating {options.gating.method} trains gates in a loop that owns them "
                         "(examples/tiny_llama/train_gates.py); pretrain_gpt.py runs a learned pattern with "
                         "--cp-head-pattern FILE")
    dry_run(args, spec, options)


def check_eod(args) -> None:
    """A packed mask needs an EOD id: ``--cp-eod-token`` (inside the tokenizer's vocabulary) or the tokenizer's,
    which Megatron's ``parse_and_validate_args`` has built by now. Raises ValueError naming the flag."""
    if args.context_parallel_impl not in OURS or not args.cp_mask.startswith("packed"):
        return
    from megatron.training import get_tokenizer

    if args.cp_eod_token is not None:
        try:
            vocab = int(get_tokenizer().vocab_size)
        except Exception:  # no tokenizer to check against: the parse-time check read --vocab-size
            return
        if not 0 <= args.cp_eod_token < vocab:
            raise ValueError(f"--cp-eod-token {args.cp_eod_token} is outside the tokenizer's vocabulary (ids 0 .. "
                             f"{vocab - 1}): no token of the data can be it, so no document would ever end; give the "
                             "id that separates your documents, or leave the flag out to take the tokenizer's EOD")
        return
    try:
        eod = get_tokenizer().eod
    except Exception as e:  # no tokenizer, or one without an EOD token
        raise ValueError(f"--cp-mask {args.cp_mask} cuts documents at the EOD token, and the tokenizer gives none "
                         f"({type(e).__name__}: {e}); pass --cp-eod-token ID") from None
    if eod is None:
        raise ValueError(f"--cp-mask {args.cp_mask} cuts documents at the EOD token, and the tokenizer has none; pass "
                         "--cp-eod-token ID")


def wrap_parse(parse_and_validate_args):
    def parse(*a, extra_args_provider=None, **kw):
        args = parse_and_validate_args(*a, extra_args_provider=compose(extra_args_provider, add_megatron_cp_args), **kw)
        validate_args(args)
        check_eod(args)
        if torch.cuda.is_available() and getattr(args, "context_parallel_impl", None) == "megatron_cp":
            # forward_step's plans come from planning helpers (a few seconds of imports each): started here, they
            # import while the model is built, and the first micro-batches do not wait for them
            start_planning_helpers(2)
        return args

    parse._megatron_cp_original = parse_and_validate_args
    return parse


def _broadcast_batch(data_iterator, args):
    """tokens / labels / loss_mask ``[mbs, S]`` on every TP rank (the loader lives on TP rank 0), and the
    loader's host copy of tokens where there is no TP broadcast (else None).

    Runs on every pipeline stage (and virtual chunk): each builds the micro-batch's plan from the
    tokens of its own data iterator, so no stage waits on another for it. A TP rank 0 without an
    iterator sends tokens starting with -1 (no extra collective), and every TP rank raises together.
    """
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    src = ps.get_tensor_model_parallel_src_rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    shape = (args.micro_batch_size, args.seq_length)
    missing = False
    host = None
    if ps.get_tensor_model_parallel_rank() == 0 and data_iterator is not None:
        data = next(data_iterator)
        if ps.get_tensor_model_parallel_world_size() == 1 and data["tokens"].device.type == "cpu":
            host = data["tokens"].numpy()  # plans read these: no copy back from the GPU, no wait for it
        tokens = data["tokens"].to(dev, torch.int64)
        labels = data["labels"].to(dev, torch.int64)
        loss_mask = data["loss_mask"].to(dev, torch.float32)
    else:
        missing = ps.get_tensor_model_parallel_rank() == 0
        tokens = torch.full(shape, -1, dtype=torch.int64, device=dev)
        labels = torch.empty(shape, dtype=torch.int64, device=dev)
        loss_mask = torch.empty(shape, dtype=torch.float32, device=dev)
    if ps.get_tensor_model_parallel_world_size() > 1:
        for t in (tokens, labels, loss_mask):
            torch.distributed.broadcast(t, src, group=tp_group)
    if missing or (host is None and int(tokens[0, 0]) == -1):
        raise ValueError(
            f"pipeline stage {ps.get_pipeline_model_parallel_rank()} has no data iterator on its tensor-parallel "
            "rank 0: megatron_cp builds each micro-batch's plan from its tokens on every pipeline stage, so every "
            "stage (and virtual chunk) needs the data set (install_into makes pretrain_gpt.py build it there; a "
            "dataset provider with is_distributed=True builds it on every rank)")
    return tokens, labels, loss_mask, host


def plan_ahead_of(data_iterator, make_plan_fn, max_workers: int = 1):
    """The iterator ``forward_step`` reads, with the next micro-batches planned in a background thread by the
    function ``make_plan_fn()`` returns, called once, when the iterator is first wrapped (``plan_ahead.PlanAhead``;
    ``planning.plan_for_batch`` leaves each plan where ``prepare_batch`` finds it, ``planning.step_planner``'s results
    come back as the PlanAhead's ``last``).

    Megatron's ``RerunDataIterator`` keeps the micro-batches of an iteration to replay them (its rerun state
    machine, on by default): reading ahead above it would mix the next iteration's micro-batches into a
    replay, so the planner goes below it, around the loader's iterator (``.iterable``), which it reads in
    order. Any other iterator is wrapped itself (once); one that cannot be weakly referenced (a built-in
    iterator such as ``iter(list)``, which a schedule may be handed) is returned as is and planned inline.
    ``max_workers``: plans made at once at most when planning falls behind (``PlanAhead``)."""
    from .plan_ahead import plan_ahead, wrapped_by

    inner = getattr(data_iterator, "iterable", None)
    if inner is not None and callable(getattr(data_iterator, "rewind", None)):
        if not isinstance(inner, PlanAhead):
            data_iterator.iterable = PlanAhead(inner, make_plan_fn(), max_workers=max_workers)
        return data_iterator
    try:
        ahead = wrapped_by(data_iterator)
    except TypeError:
        return data_iterator
    return ahead if ahead is not None else plan_ahead(data_iterator, make_plan_fn(), max_workers=max_workers)


_ITERATORS = {"wrapped": 0}  # iterators given a planning thread so far: each thread's gloo group is its own


def _planner(spec, options):
    """``planning.step_planner`` for an iterator being wrapped, with a planning group of its own (training's,
    evaluation's and each virtual stage's threads run beside each other)."""
    _ITERATORS["wrapped"] += 1
    return step_planner(spec, options, f"iterator {_ITERATORS['wrapped']}")


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """``forward_step_func`` for ``megatron.training.pretrain`` with megatron-cp context parallelism.

    Every pipeline stage plans the micro-batch itself (the plan is a pure function of its tokens) and
    passes it in ``packed_seq_params``: the first stage embeds the dispatched tokens, every stage applies
    RoPE at the dispatched positions and runs attention by the plan, the last computes the per-token loss.
    No collective spans pipeline stages (the schedules call this at different times on each stage).
    """
    from megatron.core import parallel_state as ps
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    if return_schedule_plan:
        raise ValueError("megatron_cp does not support --overlap-moe-expert-parallel-comm schedule plans")
    ensure_installed(model)
    eod = None
    try:
        eod = get_tokenizer().eod
    except Exception:  # no tokenizer built (e.g. mock data without one): --cp-eod-token is then needed
        pass
    spec, options = plan_specs(args, eod=eod)
    over_dp, training = options.over_dp, getattr(model, "training", True)
    if torch.cuda.is_available():  # plans, exchange choices and this rank's tile lists from the planning helper
        # (one plan over DP x CP is planned over the world: its lists are prepared by the first call)
        options = dataclasses.replace(options, helper_process=True,
                                      plan_rank=None if over_dp else ps.get_context_parallel_rank())
    if data_iterator is not None and ps.get_tensor_model_parallel_rank() == 0 and (training or not over_dp):
        # each stage's reader plans ahead (one plan over DP x CP: the training iterator only; evaluation's
        # micro-batches plan in the step)
        # one training process per GPU of the node: their planners share its cores
        workers = default_workers(torch.cuda.device_count()) if torch.cuda.is_available() else 1
        data_iterator = plan_ahead_of(data_iterator, lambda: _planner(spec, options), max_workers=workers)
    tokens, labels, loss_mask, host_tokens = _broadcast_batch(data_iterator, args)
    ahead = data_iterator if isinstance(data_iterator, PlanAhead) else getattr(data_iterator, "iterable", None)
    ahead = ahead if isinstance(ahead, PlanAhead) else None
    planning = (ahead.plan_times[-1] * 1e3, ahead.waits[-1] * 1e3) if ahead is not None and ahead.waits else None
    t0 = time.perf_counter()
    bt = prepare_step_batch(tokens, labels, loss_mask, spec, options, host_tokens,
                            planned=ahead.last if ahead is not None else None)
    if training:  # evaluation's micro-batches are not the step's
        STEP_LOG.record(args, bt.params.plan, (time.perf_counter() - t0) * 1e3, planning)
    if spec.packed:  # Megatron's FLOPs count attention per document, as for its own packed (THD) batches
        record_documents(bt.cu_seqlens, model)
    output = model(bt.tokens, bt.position_ids, None, labels=bt.labels, loss_mask=bt.loss_mask,
                   packed_seq_params=bt.params)
    return output, partial(loss_func, bt.loss_mask, check_nan=args.check_for_nan_in_loss_and_grad,
                           check_spiky=args.check_for_spiky_loss)


def install_into(namespace: dict) -> None:
    """Rebind ``parse_and_validate_args`` and ``forward_step`` in a pretrain script's globals."""
    if _SAVED in namespace:
        return
    missing = [n for n in ("parse_and_validate_args", "forward_step") if n not in namespace]
    if missing:
        raise ValueError(f"install_into: the script defines no {', '.join(missing)}; is it pretrain_gpt.py?")
    original_forward = namespace["forward_step"]
    namespace[_SAVED] = {k: namespace[k] for k in ("parse_and_validate_args", "forward_step")}

    def dispatch_forward_step(data_iterator, model, *a, **kw):
        from megatron.training import get_args

        if get_args().context_parallel_impl in OURS:
            return forward_step(data_iterator, model, *a, **kw)
        return original_forward(data_iterator, model, *a, **kw)

    namespace["parse_and_validate_args"] = wrap_parse(namespace["parse_and_validate_args"])
    namespace["forward_step"] = dispatch_forward_step
    original_built = namespace.get("is_dataset_built_on_rank")
    if original_built is not None:
        namespace[_SAVED]["is_dataset_built_on_rank"] = original_built

        def built_on_rank(*a, **kw):
            """Every pipeline stage reads the micro-batches (TP rank 0): each plans them itself."""
            from megatron.core import parallel_state as ps
            from megatron.training import get_args

            if get_args().context_parallel_impl in OURS:
                return ps.get_tensor_model_parallel_rank() == 0
            return original_built(*a, **kw)

        namespace["is_dataset_built_on_rank"] = built_on_rank


def uninstall_from(namespace: dict) -> None:
    """Undo ``install_into``."""
    saved = namespace.pop(_SAVED, None)
    if saved:
        namespace.update(saved)
