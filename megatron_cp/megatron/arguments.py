"""Command-line arguments: ``--context-parallel-impl`` (``te`` or a name of ``baselines.STRATEGY_NAMES``) and the
mask/plan options; every choice list is read from its registry (strategies, ``kernels.BACKEND_CHOICES``,
``masks.BUILDERS``, ``sparse.SELECTORS``, ``gating.METHODS``).

Megatron has no CP plugin registry; its entry point for extra flags is ``extra_args_provider``
(``megatron.training.arguments.parse_and_validate_args(extra_args_provider=...)``). ``te`` (the
default) leaves Megatron untouched; ``ring``, ``ulysses``, ``usp`` and ``allgather`` run megatron-cp's
baseline strategies (``megatron_cp.baselines``) through the same spec, batch hook, RoPE and loss;
``head_context`` runs Ulysses over heads inside each node x megatron-cp across nodes (groups of
GPUs-per-node ranks from ``--cp-topology``; without it the CP group is one node, i.e. plain Ulysses).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

from megatron_cp.baselines import STRATEGY_NAMES

from .gating import DEFAULT_SINK, DEFAULT_WINDOW, GatingSpec
from .gating import METHODS as GATING_METHODS
from .options import BOUNDARY_MASKS, IMPLS, MaskSpec, PlanOptions  # noqa: F401 (IMPLS: the flag's choices)
from .sparse_spec import METHOD_FLAGS, SparseSpec, spec_from_args

OURS = STRATEGY_NAMES  # every impl that uses megatron-cp's adapter


def add_megatron_cp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the megatron-cp flags to ``parser`` (an ``extra_args_provider``): one per option field that carries a flag
    (``options.flag``: ``MaskSpec`` and ``PlanOptions``, ``SparseSpec`` with the selectors' ``METHOD_FLAGS``,
    ``GatingSpec``), help and choices from there and the registries."""
    g = parser.add_argument_group("megatron-cp")
    _add_fields(g, PlanOptions, only=("strategy",))  # the switch, first in --help
    _add_fields(g, MaskSpec)
    _add_fields(g, PlanOptions, skip=("strategy",))
    s = parser.add_argument_group("megatron-cp dynamic sparse attention (docs/sparse.md)")
    _add_fields(s, SparseSpec)
    for name, _, _, kwargs in METHOD_FLAGS:
        s.add_argument(name, default=None, **kwargs)
    h = parser.add_argument_group("megatron-cp head-gated hybrid attention (DuoAttention / PruLong)")
    _add_fields(h, GatingSpec)
    _escape_bare_percent(parser)
    return parser


def _add_fields(group, cls, only=None, skip=()) -> None:
    """A flag per field of the dataclass ``cls`` whose metadata names one (``options.flag``), in field order: its
    help and ``add_argument`` arguments, the field's default unless the flag gives its own."""
    for f in dataclasses.fields(cls):
        if "flag" not in f.metadata or (only is not None and f.name not in only) or f.name in skip:
            continue
        name, help, kwargs = f.metadata["flag"]
        kwargs = dict(kwargs)
        if "default" not in kwargs:
            kwargs["default"] = f.default
        group.add_argument(name, help=help, **kwargs)


def from_flags(cls, args, **derived) -> dict:
    """Keyword arguments of the option dataclass ``cls``: each field with a flag takes the flag's parsed value from
    ``args`` as it is, unless ``derived`` gives it (a value parsed or checked from the flag, e.g. the topology)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in derived:
            out[f.name] = derived[f.name]
        elif "flag" in f.metadata:
            out[f.name] = getattr(args, f.metadata["flag"][0].lstrip("-").replace("-", "_"))
    return out


def _escape_bare_percent(parser: argparse.ArgumentParser) -> None:
    """argparse formats every help string with ``%``: a bare one (megatron-core 0.19.2's
    ``--moe-paged-stash-buffer-size-factor-cuda`` says "10%).") makes ``--help`` raise "unsupported format
    character". Escaped here, in the parser our flags join, so that Megatron's scripts print their help."""
    for action in parser._actions:
        if isinstance(action.help, str) and action.help is not argparse.SUPPRESS:
            action.help = re.sub(r"%%|%\(|%", lambda m: "%%" if m.group() == "%" else m.group(), action.help)


def gating_from_args(args) -> GatingSpec | None:
    """The ``GatingSpec`` of the head-gating flags (None when off). Raises ValueError naming the flag."""
    method = getattr(args, "cp_head_gating", "none") or "none"
    path = getattr(args, "cp_head_pattern", None)
    sink, window = getattr(args, "cp_sink_tokens", None), getattr(args, "cp_local_window", None)
    target = getattr(args, "cp_target_sparsity", None)
    if method == "none" and path is None:
        for flag, v in (("--cp-sink-tokens", sink), ("--cp-local-window", window), ("--cp-target-sparsity", target)):
            if v is not None:
                raise ValueError(f"{flag} needs --cp-head-gating duo|prulong or --cp-head-pattern FILE")
        return None
    if method not in GATING_METHODS:
        raise ValueError(f"--cp-head-gating must be one of {', '.join(GATING_METHODS)}, got {method!r}")
    if method != "none" and path is not None:
        raise ValueError(f"--cp-head-gating {method} learns the heads; --cp-head-pattern {path} fixes them: "
                         "give one of the two")
    if target is not None and not 0.0 <= target < 1.0:
        raise ValueError(f"--cp-target-sparsity must be in [0, 1), got {target}")
    if sink is not None and sink < 0:
        raise ValueError(f"--cp-sink-tokens must be >= 0, got {sink}")
    if window is not None and window < 1:
        raise ValueError(f"--cp-local-window must be >= 1, got {window}")
    if getattr(args, "cp_sparse", "none") not in (None, "none"):
        raise ValueError(f"--cp-head-gating / --cp-head-pattern do not combine with --cp-sparse {args.cp_sparse}")
    if args.context_parallel_impl != "megatron_cp":
        raise ValueError(f"--cp-head-gating / --cp-head-pattern run with --context-parallel-impl megatron_cp, not "
                         f"{args.context_parallel_impl}")
    if path is None:
        return GatingSpec(sink=DEFAULT_SINK if sink is None else sink,
                          window=DEFAULT_WINDOW if window is None else window, mode="train", method=method,
                          target_sparsity=0.5 if target is None else target)
    from .gating import pattern_source

    try:  # cached per path: forward_step re-reads the flags every micro-batch
        src = pattern_source(str(path))
    except ValueError as e:
        raise ValueError(f"--cp-head-pattern: {e}") from None
    obj = dict(src.meta, layers=src.layers)
    for flag, v, key in (("--cp-sink-tokens", sink, "sink"), ("--cp-local-window", window, "window")):
        if v is not None and obj[key] is not None and v != obj[key]:
            raise ValueError(f"{flag} {v} differs from the {key}={obj[key]} the pattern {path} was learned with")
    sink = sink if sink is not None else (obj["sink"] if obj["sink"] is not None else DEFAULT_SINK)
    window = window if window is not None else (obj["window"] if obj["window"] is not None else DEFAULT_WINDOW)
    layers, kv = getattr(args, "num_layers", None), getattr(args, "num_query_groups", None)
    kv = kv or getattr(args, "num_attention_heads", None)
    if layers and len(obj["layers"]) != layers:
        raise ValueError(f"--cp-head-pattern {path} has {len(obj['layers'])} layers, the model --num-layers {layers}")
    if kv and len(obj["layers"][0]) != kv:
        raise ValueError(f"--cp-head-pattern {path} has {len(obj['layers'][0])} KV heads per layer, the model "
                         f"{kv} (--num-query-groups)")
    return GatingSpec(sink=sink, window=window, mode="pattern", pattern=str(path))


def compose(*providers):
    """One ``extra_args_provider`` that applies ``providers`` in order (None entries are skipped)."""

    def provider(parser):
        for p in providers:
            if p is not None:
                parser = p(parser)
        return parser

    return provider


def _topology(text):
    if text is None:
        return None
    from megatron_cp import Topology

    try:
        nodes, gpus = (int(x) for x in text.lower().split("x"))
        return Topology(nodes=nodes, gpus_per_node=gpus)
    except ValueError:
        raise ValueError(f"--cp-topology must look like NODESxGPUS with both >= 1 (e.g. 2x8), got {text!r}") from None


def specs_from_args(args, eod: int | None = None) -> tuple[MaskSpec, PlanOptions]:
    """Validate the megatron-cp flags and return (MaskSpec, PlanOptions). Raises ValueError naming
    the offending flag; call it before anything distributed happens."""
    if args.context_parallel_impl not in OURS:
        raise ValueError(
            f"specs_from_args needs --context-parallel-impl in {', '.join(OURS)}, got {args.context_parallel_impl!r}"
        )
    if not getattr(args, "calculate_per_token_loss", False):
        raise ValueError(
            "--context-parallel-impl megatron_cp needs --calculate-per-token-loss: CP ranks hold different "
            "token counts, and only the per-token path normalises by the global count"
        )
    try:
        kwargs = json.loads(args.cp_mask_kwargs or "{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"--cp-mask-kwargs is not JSON: {args.cp_mask_kwargs!r} ({e})") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"--cp-mask-kwargs must be a JSON object, got {args.cp_mask_kwargs!r}")
    if args.cp_eod_token is not None and args.cp_eod_token < 0:
        raise ValueError(f"--cp-eod-token must be a token id >= 0, got {args.cp_eod_token}")
    vocab = getattr(args, "vocab_size", None)
    # ids 0 .. vocab_size: Megatron's NullTokenizer adds its EOD as id vocab_size (a real tokenizer's range is checked
    # once it is built: plugin.check_eod)
    if args.cp_eod_token is not None and isinstance(vocab, int) and args.cp_eod_token > vocab:
        raise ValueError(f"--cp-eod-token {args.cp_eod_token} is outside the vocabulary (--vocab-size {vocab}): no "
                         "token of the data can be it, so no document would ever end; give the id that separates "
                         "your documents, or leave the flag out to take the tokenizer's EOD")
    if "sliding" in args.cp_mask and (args.cp_window is None or args.cp_window < 0):
        got = "no --cp-window" if args.cp_window is None else f"--cp-window {args.cp_window}"
        raise ValueError(f"--cp-mask {args.cp_mask} needs --cp-window W >= 0 (query i keeps keys i - W .. i), "
                         f"got {got}")
    eod = args.cp_eod_token if args.cp_eod_token is not None else eod
    layer_window = None
    if getattr(args, "window_attn_skip_freq", None) is not None and getattr(args, "window_size", None) is not None:
        layer_window = int(tuple(args.window_size)[0])  # windowed layers among full ones (_map_documents_and_window)
    spec = MaskSpec(**from_flags(MaskSpec, args, eod=eod, kwargs=tuple(sorted(kwargs.items())),
                                 layer_window=layer_window))
    if args.cp_chunk_size is not None and args.cp_chunk_size < 1:
        raise ValueError(f"--cp-chunk-size must be >= 1, got {args.cp_chunk_size}")
    sparse = spec_from_args(args)
    if sparse is not None and args.context_parallel_impl != "megatron_cp":
        raise ValueError(f"--cp-sparse {sparse.method} runs with --context-parallel-impl megatron_cp, not "
                         f"{args.context_parallel_impl}")
    gating = gating_from_args(args)
    if layer_window is not None and (sparse is not None or gating is not None):
        raise ValueError(f"--window-attn-skip-freq (windowed layers) does not combine with "
                         f"{'--cp-sparse' if sparse is not None else '--cp-head-gating / --cp-head-pattern'}")
    if getattr(args, "cp_balance_over_dp", False):
        _check_balance_over_dp(args, sparse, gating)
    return spec, PlanOptions(**from_flags(PlanOptions, args, topology=_topology(args.cp_topology), sparse=sparse,
                                          gating=gating, over_dp=bool(getattr(args, "cp_balance_over_dp", False))))


def _check_balance_over_dp(args, sparse, gating) -> None:
    """--cp-balance-over-dp's limits, each refused by name (what this first version plans and gathers)."""
    if args.context_parallel_impl != "megatron_cp":
        raise ValueError(f"--cp-balance-over-dp runs with --context-parallel-impl megatron_cp, not "
                         f"{args.context_parallel_impl}")
    for flag, attr in (("--tensor-model-parallel-size", "tensor_model_parallel_size"),
                       ("--pipeline-model-parallel-size", "pipeline_model_parallel_size")):
        if int(getattr(args, attr, 1) or 1) > 1:
            raise ValueError(f"--cp-balance-over-dp does not combine with {flag} {getattr(args, attr)} yet (the "
                             "global batch is gathered and planned per tensor- and pipeline-parallel rank set as one)")
    if sparse is not None or gating is not None:
        raise ValueError("--cp-balance-over-dp runs dense attention: drop --cp-sparse / --cp-head-gating / "
                         "--cp-head-pattern")


# Megatron options that megatron-cp attention does not honour: attribute -> message. Each is refused when the
# arguments are parsed and it is set: truthy, or what ``SET_WHEN`` says for an option whose unset value is not
# falsy; a feature that gains support is lifted by deleting its row.
_CUDA_GRAPH = ("megatron-cp's attention follows each micro-batch's plan, which a captured CUDA graph would replay "
               "unchanged")
_OWN_ATTENTION = "brings its own attention module; megatron-cp replaces only Megatron's dot-product core attention"
UNSUPPORTED = {
    "attention_dropout": "--attention-dropout {v}: megatron-cp attention has no attention dropout; pass "
    "--attention-dropout 0 (Megatron's default is 0.1)",
    "cp_comm_type": "--cp-comm-type {v} selects Transformer Engine's CP communication; megatron-cp plans its own. Drop "
    "the flag, or pick a baseline with --context-parallel-impl ring|ulysses|usp|allgather|head_context",
    "hierarchical_context_parallel_sizes": "--hierarchical-context-parallel-sizes {v} is Transformer Engine's a2a+p2p "
    "CP; megatron-cp takes the CP group's shape from --cp-topology NODESxGPUS",
    "hybrid_context_parallel": "--hybrid-context-parallel is Megatron's own packing-aware CP; it does not combine "
    "with --context-parallel-impl",
    "mtp_num_layers": "--mtp-num-layers {v}: Megatron's multi-token prediction shifts tokens across CP ranks with "
    "roll_tensor, which assumes its own 2 x cp zigzag split, and builds its layers' attention from Megatron's spec; "
    "it does not run under megatron-cp's token layout",
    "multi_latent_attention": "--multi-latent-attention: megatron-cp runs Megatron's MLASelfAttention from Python "
    "(CPCoreAttention in its core_attention slot, megatron_cp.megatron.mla.install_mla for RoPE / YaRN at the plan's "
    "positions; CP 2 equals CP 1 in tests/test_mla.py), but this plugin does not install MLA's plan RoPE in "
    "pretrain_gpt.py yet",
    "experimental_attention_variant": "--experimental-attention-variant {v} " + _OWN_ATTENTION,
    "use_kitchen_attention": "--use-kitchen-attention " + _OWN_ATTENTION,
    "transformer_impl": "--transformer-impl inference_optimized has its own attention; use transformer_engine or local",
    "cuda_graph_impl": "--cuda-graph-impl {v}: " + _CUDA_GRAPH + "; use --cuda-graph-impl none",
    "enable_cuda_graph": "--enable-cuda-graph: " + _CUDA_GRAPH,
    "external_cuda_graph": "--external-cuda-graph: " + _CUDA_GRAPH,
    "overlap_moe_expert_parallel_comm": "--overlap-moe-expert-parallel-comm builds schedule plans that bypass "
    "megatron-cp's batch hook",
    "dataloader_inter_document_masking": "--dataloader-inter-document-masking sends Megatron's THD cu_seqlens; with "
    "megatron-cp pass --reset-attention-mask (or --cp-mask packed): documents are cut at EOD tokens",
    "sft": "--sft packs and pads sequences in Megatron's THD format, which megatron-cp's batch hook does not read",
}
SET_WHEN = {
    "cp_comm_type": lambda v: list(v or ["p2p"]) != ["p2p"],
    "experimental_attention_variant": lambda v: v is not None,
    "transformer_impl": lambda v: v == "inference_optimized",
    "cuda_graph_impl": lambda v: v != "none",
}


def _refuse_unsupported(args) -> None:
    for attr, message in UNSUPPORTED.items():
        v = getattr(args, attr, None)
        if v is not None and SET_WHEN.get(attr, bool)(v):
            raise ValueError(message.format(v=v))


def _map_documents_and_window(args) -> None:
    """Megatron's document and window flags onto ``--cp-mask`` / ``--cp-window`` (edits ``args``).

    ``--reset-attention-mask`` (attention stops at EOD) makes ``causal`` ``packed`` and
    ``sliding_window`` ``packed_sliding_window``. ``--window-size L,R`` (Transformer Engine: query i
    attends keys i-L..i+R; R must be 0 for causal attention, L = -1 means no window) becomes
    ``--cp-window L`` (keys i-L..i) on the sliding variant of the mask; ``args.window_size`` is then
    cleared, since the mask carries the window. Positions: a packed mask restarts them at every document
    (``--reset-position-ids`` semantics), so ``--reset-position-ids`` without a packed mask is refused
    (Megatron would restart positions where attention does not stop). A builder mask
    (``--cp-mask block_causal`` etc.) conflicts with both flags.
    """
    mask, builder = args.cp_mask, args.cp_mask not in BOUNDARY_MASKS
    if getattr(args, "reset_attention_mask", False):
        if builder:
            raise ValueError(f"--reset-attention-mask conflicts with --cp-mask {mask} (a per-sample builder mask): "
                             "give one of the two")
        mask = {"causal": "packed", "sliding_window": "packed_sliding_window"}.get(mask, mask)
    window = getattr(args, "window_size", None)
    skip = getattr(args, "window_attn_skip_freq", None)
    if skip is not None:  # windowed and full layers mixed: the windowed layers get a plan of their own
        if window is None or len(tuple(window)) != 2 or tuple(window)[1] != 0 or tuple(window)[0] < 0:
            raise ValueError(f"--window-attn-skip-freq {skip} needs --window-size W,0 with W >= 0 (the windowed "
                             f"layers' causal window), got --window-size {window}")
        if mask not in ("causal", "packed") or args.cp_window is not None:
            raise ValueError(f"--window-attn-skip-freq {skip} windows some layers of the causal or packed mask; "
                             f"got --cp-mask {mask}" + (f" --cp-window {args.cp_window}" if args.cp_window else ""))
        if args.context_parallel_impl != "megatron_cp":
            raise ValueError(f"--window-attn-skip-freq {skip} runs with --context-parallel-impl megatron_cp, not "
                             f"{args.context_parallel_impl}")
        window = None  # kept in args.window_size: each layer's core attention reads it with the skip frequency
    if window is not None:
        window = tuple(window)
        if len(window) != 2 or window[1] != 0:
            raise ValueError(f"--window-size {window}: megatron-cp masks are causal, so the right reach must be 0 "
                             "(--window-size L,0)")
        if builder:
            raise ValueError(f"--window-size {window} conflicts with --cp-mask {mask} (a builder mask): give one "
                             "of the two")
        if window[0] >= 0:
            if args.cp_window is not None and args.cp_window != window[0]:
                raise ValueError(f"--window-size {window} and --cp-window {args.cp_window} differ: give one of the two")
            mask = {"causal": "sliding_window", "packed": "packed_sliding_window"}.get(mask, mask)
            args.cp_window = window[0]
        args.window_size = None  # the mask carries it (CPCoreAttention refuses Megatron's own window)
    if getattr(args, "reset_position_ids", False) and not mask.startswith("packed"):
        raise ValueError(f"--reset-position-ids with --cp-mask {mask}: megatron-cp restarts positions exactly where "
                         "its mask separates documents; add --reset-attention-mask (or --cp-mask packed)")
    if args.cp_window is not None and "sliding" not in mask:
        raise ValueError(f"--cp-window {args.cp_window} acts only with --cp-mask sliding_window / packed_sliding_window "
                         f"(or --window-size), got --cp-mask {mask}")
    if not builder and (args.cp_mask_kwargs or "{}").strip() not in ("{}", ""):
        raise ValueError(f"--cp-mask-kwargs {args.cp_mask_kwargs} acts only with a builder mask, got --cp-mask {mask}")
    args.cp_mask = mask


def _unused_flags(args) -> list[str]:
    """Our flags set away from their defaults (they only act with --context-parallel-impl megatron_cp)."""
    defaults = vars(add_megatron_cp_args(argparse.ArgumentParser()).parse_args([]))
    return ["--" + k.replace("_", "-") for k, d in defaults.items()
            if k != "context_parallel_impl" and hasattr(args, k) and getattr(args, k) != d]


def check_megatron_args(args) -> None:
    """Parse-time checks of Megatron's own flags against megatron-cp (ValueError naming the flag); maps
    the document and window flags onto ours (``_map_documents_and_window``). With ``--context-parallel-impl
    te`` it only refuses our flags, which would be ignored."""
    if args.context_parallel_impl not in OURS:
        unused = _unused_flags(args)
        if unused:
            raise ValueError(f"{', '.join(unused)} act only with --context-parallel-impl megatron_cp (or a "
                             f"baseline), got --context-parallel-impl {args.context_parallel_impl}")
        return
    _refuse_unsupported(args)
    if args.cp_window is not None and args.cp_window < 0:
        raise ValueError(f"--cp-window must be >= 0 (query i keeps keys i - W .. i), got --cp-window {args.cp_window}")
    if args.cp_solver not in _solvers():
        raise ValueError(f"--cp-solver {args.cp_solver!r} is unknown; choose from {', '.join(_solvers())}")
    topo = _topology(args.cp_topology)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    if topo is not None and topo.world_size != cp:
        raise ValueError(f"--cp-topology {args.cp_topology} has {topo.world_size} GPUs; --context-parallel-size is {cp}")
    if args.cp_kernel_backend == "fa4":
        from megatron_cp.kernels import fa4_unavailable

        why = fa4_unavailable("cuda")  # on the rank's GPU kind: every GPU of a job is the same model
        if why:
            raise ValueError(f"--cp-kernel-backend fa4: {why}; use auto (FA4 where it runs, else Triton on GPUs and "
                             "the PyTorch reference on CPU)")
    _map_documents_and_window(args)


def _solvers():
    from megatron_cp.planner import SOLVERS

    return SOLVERS


def dry_run(args, spec: MaskSpec, options: PlanOptions) -> None:
    """Build the mask and plan of one ``[micro-batch-size, seq-length]`` micro-batch (one document per
    sample) at ``--context-parallel-size`` on this process, so a builder's keyword arguments, the chunk
    size, the solver and the topology fail when the arguments are parsed, not at the first step."""
    import dataclasses

    import numpy as np

    from .planning import build_mask, make_plan

    S = int(getattr(args, "seq_length", 0) or 0)
    if S < 1:
        return
    b = int(getattr(args, "micro_batch_size", 1) or 1)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    if spec.packed and spec.eod is None:
        spec = dataclasses.replace(spec, eod=0)  # the tokenizer's EOD is known only later; any id plans the same
    try:
        mask = build_mask(spec, np.arange(b + 1, dtype=np.int64) * S, b, S)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--cp-mask {spec.name} --cp-mask-kwargs {args.cp_mask_kwargs}: {e}") from None
    try:
        make_plan(mask, cp, options)
    except ValueError as e:
        raise ValueError(f"the megatron-cp flags do not plan a {b} x {S} micro-batch at --context-parallel-size {cp} "
                         f"(--cp-chunk-size {args.cp_chunk_size}, --cp-solver {args.cp_solver}, --cp-topology "
                         f"{args.cp_topology}): {e}") from None
