"""Command-line arguments: ``--context-parallel-impl {te,megatron_cp,ring,ulysses,usp,allgather,head_context}``
and the mask/plan options.

Megatron has no CP plugin registry; its entry point for extra flags is ``extra_args_provider``
(``megatron.training.arguments.parse_and_validate_args(extra_args_provider=...)``). ``te`` (the
default) leaves Megatron untouched; ``ring``, ``ulysses``, ``usp`` and ``allgather`` run megatron-cp's
baseline strategies (``megatron_cp.baselines``) through the same spec, batch hook, RoPE and loss;
``head_context`` runs Ulysses over heads inside each node x megatron-cp across nodes (groups of
GPUs-per-node ranks from ``--cp-topology``; without it the CP group is one node, i.e. plain Ulysses).
"""

from __future__ import annotations

import argparse
import json

from .batch import MASKS, MaskSpec, PlanOptions
from .gating import DEFAULT_SINK, DEFAULT_WINDOW, GatingSpec
from .sparse_spec import METHODS, spec_from_args

IMPLS = ("te", "megatron_cp", "ring", "ulysses", "usp", "allgather", "head_context")
OURS = IMPLS[1:]  # every impl that uses megatron-cp's adapter
GATING_METHODS = ("none", "duo", "prulong")


def add_megatron_cp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the megatron-cp flags to ``parser`` (an ``extra_args_provider``)."""
    g = parser.add_argument_group("megatron-cp")
    g.add_argument("--context-parallel-impl", choices=IMPLS, default="te",
                   help="te: Megatron's own CP (Transformer Engine). megatron_cp: megatron-cp attention "
                        "for any mask, with its batch hook, RoPE and loss. ring / ulysses / usp / allgather: "
                        "megatron-cp's baseline strategies through the same adapter. head_context: Ulysses "
                        "all-to-all over heads inside each node x megatron-cp across nodes (node size from "
                        "--cp-topology; without it one node).")
    g.add_argument("--cp-mask", choices=MASKS, default="causal",
                   help="causal per sample; packed: causal per EOD-separated document; sliding_window / "
                        "packed_sliding_window with --cp-window; or a megatron_cp.masks builder by name "
                        "(per sample, arguments in --cp-mask-kwargs)")
    g.add_argument("--cp-window", type=int, default=None, help="left window W of the sliding masks")
    g.add_argument("--cp-mask-kwargs", type=str, default="{}",
                   help='JSON keyword arguments of a builder mask, e.g. \'{"block": 64}\'')
    g.add_argument("--cp-eod-token", type=int, default=None,
                   help="EOD token id for the packed masks (default: the tokenizer's eod)")
    g.add_argument("--cp-chunk-size", type=int, default=None, help="planner chunk size (default: auto)")
    g.add_argument("--cp-solver", type=str, default="auto", help="planner solver (default: auto)")
    g.add_argument("--cp-topology", type=str, default=None,
                   help="NODESxGPUS_PER_NODE of the CP group, e.g. 2x8 (default: none)")
    g.add_argument("--cp-kernel-backend", choices=("auto", "fa4", "triton", "reference"), default="auto",
                   help="attention kernels: auto (FlashAttention-4 where flash-attn-4 is installed on sm90 / "
                        "sm100, else Triton on GPUs, PyTorch reference otherwise)")
    s = parser.add_argument_group("megatron-cp dynamic sparse attention (docs/sparse.md)")
    s.add_argument("--cp-sparse", choices=METHODS, default="none",
                   help="per head and q block, compute only the key blocks a selector chooses at run time, "
                        "inside the --cp-mask envelope: moba (top-k blocks by q . mean(K); trainable from "
                        "scratch), xattention (antidiagonal scoring, threshold), flexprefill (query-aware or "
                        "vertical-slash per head), minference (per-head patterns from --cp-minference-config)")
    s.add_argument("--cp-sparse-block", type=int, default=None,
                   help="selection block in tokens (default: moba 512, others 128); divides --seq-length")
    s.add_argument("--cp-sparse-layers", type=str, default="all",
                   help="1-based layers that run sparse, e.g. '3-24' or '1,5,9' (default all; others dense)")
    s.add_argument("--cp-moba-top-k", type=int, default=3, help="MoBA: key blocks per q block besides its own")
    s.add_argument("--cp-xattn-stride", type=int, default=8, help="XAttention: antidiagonal stride (8 or 16)")
    s.add_argument("--cp-xattn-threshold", type=str, default="0.9",
                   help="XAttention: cumulative block mass to keep, or one value per query head (comma list)")
    s.add_argument("--cp-flexprefill-gamma", type=float, default=0.9, help="FlexPrefill: coverage gamma")
    s.add_argument("--cp-flexprefill-tau", type=float, default=0.1,
                   help="FlexPrefill: Jensen-Shannon threshold between query-aware and vertical-slash")
    s.add_argument("--cp-flexprefill-min-budget", type=int, default=None, help="FlexPrefill: min budget")
    s.add_argument("--cp-flexprefill-max-budget", type=int, default=None, help="FlexPrefill: max budget")
    s.add_argument("--cp-minference-config", type=str, default=None,
                   help="MInference: per-layer, per-head pattern JSON (tools/minference_search.py)")
    h = parser.add_argument_group("megatron-cp head-gated hybrid attention (DuoAttention / PruLong)")
    h.add_argument("--cp-head-gating", choices=GATING_METHODS, default="none",
                   help="learn per (layer, KV head) whether attention is full or streaming (sink + recent window): "
                        "duo (DuoAttention: frozen weights, gates alpha in [0, 1] by distillation + L1) or prulong "
                        "(hard-concrete L0 gates + Lagrangian sparsity target). Gate training runs in a loop that "
                        "owns the gates (examples/tiny_llama/train_gates.py)")
    h.add_argument("--cp-sink-tokens", type=int, default=None,
                   help=f"streaming heads keep each document's first N keys (default {DEFAULT_SINK}, "
                        "DuoAttention's training setting; or the pattern file's)")
    h.add_argument("--cp-local-window", type=int, default=None,
                   help=f"streaming heads keep the N most recent keys (default {DEFAULT_WINDOW}; or the pattern "
                        "file's)")
    h.add_argument("--cp-target-sparsity", type=float, default=None,
                   help="fraction of KV heads that end streaming: PruLong's Lagrangian target and the "
                        "discretisation level (default 0.5)")
    h.add_argument("--cp-head-pattern", type=str, default=None,
                   help="a learned head pattern JSON ({\"layers\": [[true/false per KV head], ...], \"sink\", "
                        "\"window\"}): full heads run the full plan, the others only sink + window "
                        "(inference / continued training with fixed heads)")
    return parser


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
    from .gating import _pattern_source

    try:  # cached per path: forward_step re-reads the flags every micro-batch
        src = _pattern_source(str(path))
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
    except ValueError:
        raise ValueError(f"--cp-topology must look like NODESxGPUS (e.g. 2x8), got {text!r}") from None
    return Topology(nodes=nodes, gpus_per_node=gpus)


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
    if getattr(args, "sequence_parallel", False):
        raise ValueError("--sequence-parallel is not supported with --context-parallel-impl megatron_cp yet")
    try:
        kwargs = json.loads(args.cp_mask_kwargs or "{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"--cp-mask-kwargs is not JSON: {args.cp_mask_kwargs!r} ({e})") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"--cp-mask-kwargs must be a JSON object, got {args.cp_mask_kwargs!r}")
    eod = args.cp_eod_token if args.cp_eod_token is not None else eod
    spec = MaskSpec(args.cp_mask, window=args.cp_window, eod=eod, kwargs=tuple(sorted(kwargs.items())))
    if args.cp_chunk_size is not None and args.cp_chunk_size < 1:
        raise ValueError(f"--cp-chunk-size must be >= 1, got {args.cp_chunk_size}")
    sparse = spec_from_args(args)
    if sparse is not None and args.context_parallel_impl != "megatron_cp":
        raise ValueError(f"--cp-sparse {sparse.method} runs with --context-parallel-impl megatron_cp, not "
                         f"{args.context_parallel_impl}")
    gating = gating_from_args(args)
    return spec, PlanOptions(chunk_size=args.cp_chunk_size, topology=_topology(args.cp_topology),
                             solver=args.cp_solver, kernel_backend=args.cp_kernel_backend,
                             strategy=args.context_parallel_impl, sparse=sparse, gating=gating)
