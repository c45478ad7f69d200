"""``--cp-sparse``: which dynamic sparse method runs in which layers, with its hyperparameters.

A ``SparseSpec`` is hashable (it is part of the plan cache key: sparse plans lay tokens out in whole
blocks) and builds each layer's selector once (``selector(layer_number)``; None for a dense layer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property

from megatron_cp.sparse import SELECTORS

from .options import flag

METHODS = ("none", *SELECTORS)
# what each selector does, for --cp-sparse's help (a selector missing here is listed by name alone)
SUMMARY = {"moba": "top-k blocks by q . mean(K); trainable from scratch",
           "xattention": "antidiagonal scoring, threshold", "flexprefill": "query-aware or vertical-slash per head",
           "minference": "per-head patterns from --cp-minference-config"}
DEFAULT_BLOCK = {name: cls.block for name, cls in SELECTORS.items()}  # each selector's own default


def _parse_layers(text: str | None) -> frozenset | None:
    """'all' / None -> None (every layer); '1-4,7' -> {1, 2, 3, 4, 7} (Megatron's 1-based numbers)."""
    if text is None or text == "all":
        return None
    out = set()
    try:
        for part in text.split(","):
            a, _, b = part.partition("-")
            lo, hi = int(a), int(b or a)
            if lo < 1 or hi < lo:
                raise ValueError
            out.update(range(lo, hi + 1))
    except ValueError:
        raise ValueError(f"--cp-sparse-layers must be 'all' or 1-based layer numbers and ranges like '1-4,7', "
                         f"got {text!r}") from None
    return frozenset(out)


@dataclass(frozen=True)
class SparseSpec:
    """method: a name of ``megatron_cp.sparse.SELECTORS``; params: the selector's keyword arguments as
    sorted (name, value) pairs; layers: 1-based layer numbers that run sparse (None: all);
    config: MInference's per-layer pattern JSON."""

    method: str = field(metadata=flag(
        "--cp-sparse", "per head and q block, compute only the key blocks a selector chooses at run time, inside the "
        "--cp-mask envelope: " + ", ".join(f"{m} ({SUMMARY[m]})" if m in SUMMARY else m for m in SELECTORS),
        choices=METHODS, default="none"))
    params: tuple = ()
    layers: frozenset | None = None
    config: str | None = None

    @property
    def block(self) -> int:
        return dict(self.params).get("block", DEFAULT_BLOCK[self.method])

    @cached_property
    def _selectors(self) -> dict:
        return {}

    def selector(self, layer_number: int):
        """The selector of Megatron layer ``layer_number`` (1-based), or None when it runs dense."""
        if self.layers is not None and layer_number not in self.layers:
            return None
        sel = self._selectors.get(layer_number)
        if sel is None:
            sel = self._selectors[layer_number] = build_selector(self, layer_number)
        return sel


def build_selector(spec: SparseSpec, layer_number: int):
    cls = SELECTORS[spec.method]
    if spec.method == "minference":  # per-layer head patterns from its JSON
        return cls.from_json(spec.config, layer_number - 1, block=spec.block)
    return cls(**dict(spec.params))


def _threshold(text: str):
    vals = [float(x) for x in text.split(",")]
    return vals[0] if len(vals) == 1 else tuple(vals)


# the method flags of --cp-sparse, per method ("any": every method) with the label their help starts with:
# (flag, type, help). They default to None (the values spec_from_args applies then): a flag given for another
# method, or without --cp-sparse, is refused instead of ignored
_FLAGS_BY_METHOD = {
    "any": ("", (
        ("--cp-sparse-block", int, "selection block in tokens (default: "
         + ", ".join(f"{m} {b}" for m, b in DEFAULT_BLOCK.items()) + "); divides --seq-length"),
        ("--cp-sparse-layers", str, "1-based layers that run sparse, e.g. '3-24' or '1,5,9' (default all; others "
         "dense)"))),
    "moba": ("MoBA", (("--cp-moba-top-k", int, "key blocks per q block besides its own (default 3)"),)),
    "xattention": ("XAttention", (
        ("--cp-xattn-stride", int, "antidiagonal stride (8 or 16; default 8)"),
        ("--cp-xattn-threshold", str, "cumulative block mass to keep, or one value per query head (comma list; "
         "default 0.9)"))),
    "flexprefill": ("FlexPrefill", (
        ("--cp-flexprefill-gamma", float, "coverage gamma (default 0.9)"),
        ("--cp-flexprefill-tau", float, "Jensen-Shannon threshold between query-aware and vertical-slash "
         "(default 0.1)"),
        ("--cp-flexprefill-min-budget", int, "min budget"),
        ("--cp-flexprefill-max-budget", int, "max budget"))),
    "minference": ("MInference", (
        ("--cp-minference-config", str, "per-layer, per-head pattern JSON (tools/minference_search.py)"),)),
}
# (flag, attribute, the method it belongs to, add_argument's arguments)
METHOD_FLAGS = tuple(
    (flag, flag[2:].replace("-", "_"), method, dict(type=type_, help=f"{label}: {help}" if label else help))
    for method, (label, rows) in _FLAGS_BY_METHOD.items() for flag, type_, help in rows)


def _or(value, default):
    return default if value is None else value


def spec_from_args(args) -> SparseSpec | None:
    """The ``SparseSpec`` of the parsed flags (None for ``--cp-sparse none``); builds every selector once
    and runs its ``check`` so a bad hyperparameter fails at start-up, naming the flag's value."""
    method = getattr(args, "cp_sparse", "none") or "none"
    takes = {method, "any"} if method != "none" else set()
    for name, attr, owner, _ in METHOD_FLAGS:
        if getattr(args, attr, None) is not None and owner not in takes:
            need = "--cp-sparse (any method)" if owner == "any" else f"--cp-sparse {owner}"
            raise ValueError(f"{name} {getattr(args, attr)} acts only with {need}, got --cp-sparse {method}")
    if method == "none":
        return None
    params = {}
    if args.cp_sparse_block is not None:
        params["block"] = args.cp_sparse_block
    if method == "moba":
        params["top_k"] = _or(args.cp_moba_top_k, 3)
    elif method == "xattention":
        params["stride"] = _or(args.cp_xattn_stride, 8)
        try:
            params["threshold"] = _threshold(_or(args.cp_xattn_threshold, "0.9"))
        except ValueError:
            raise ValueError(f"--cp-xattn-threshold must be a number or comma-separated numbers (one per "
                             f"query head), got {args.cp_xattn_threshold!r}") from None
    elif method == "flexprefill":
        params.update(gamma=_or(args.cp_flexprefill_gamma, 0.9), tau=_or(args.cp_flexprefill_tau, 0.1))
        if args.cp_flexprefill_min_budget is not None:
            params["min_budget"] = args.cp_flexprefill_min_budget
        if args.cp_flexprefill_max_budget is not None:
            params["max_budget"] = args.cp_flexprefill_max_budget
    elif method == "minference":
        if not args.cp_minference_config:
            raise ValueError("--cp-sparse minference needs --cp-minference-config FILE (a pattern JSON from "
                             "tools/minference_search.py)")
        try:
            json.load(open(args.cp_minference_config))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--cp-minference-config {args.cp_minference_config!r} is not a readable JSON "
                             f"file ({e})") from None
    spec = SparseSpec(method, tuple(sorted(params.items())), _parse_layers(args.cp_sparse_layers),
                      args.cp_minference_config if method == "minference" else None)
    n_layers = getattr(args, "num_layers", None)
    if spec.layers and n_layers and max(spec.layers) > n_layers:
        raise ValueError(f"--cp-sparse-layers {args.cp_sparse_layers} names layer {max(spec.layers)}; the model has "
                         f"{n_layers} (--num-layers)")
    heads, kv = getattr(args, "num_attention_heads", None), getattr(args, "num_query_groups", None)
    seq = getattr(args, "seq_length", None)
    if seq and seq % spec.block:
        raise ValueError(f"--seq-length {seq} must be a multiple of the sparse block {spec.block} "
                         f"(--cp-sparse-block)")
    if heads:
        kv = kv or heads
        tp = getattr(args, "tensor_model_parallel_size", 1) or 1
        hd = getattr(args, "kv_channels", None) or (args.hidden_size // heads if getattr(args, "hidden_size", None)
                                                     else 128)
        layers = spec.layers or range(1, (getattr(args, "num_layers", 1) or 1) + 1)
        for n in layers:
            sel = spec.selector(n)
            sel.check(heads // tp, max(1, kv // tp), hd, seq or spec.block)
    return spec
