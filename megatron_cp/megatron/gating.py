"""Head gating in the Megatron adapter (``--cp-head-gating``, ``--cp-head-pattern``): which KV heads run full
attention and which run streaming (sink + window) attention, per layer.

``GatingSpec`` (frozen, hashable; in ``PlanOptions.gating``) says how the micro-batch's streaming plan is
made (``streaming_within(mask, sink, window)`` on the full plan's token layout) and which mode runs:

* ``train``: every layer mixes ``alpha * full + (1 - alpha) * streaming`` per KV head
  (``gating.gated_attention``); alpha comes from a ``GateSource`` handed to ``prepare_batch(gating=...)``
  (the gates are parameters of the training loop, e.g. ``gating.DuoGates``);
* ``pattern``: each KV head runs either full or streaming (``gating.pattern_attention``) by a fixed pattern
  (``PatternSource``, loaded from the JSON of ``--cp-head-pattern``).

A runtime gating object (``CPParams.gating``) has ``mode`` and ``gate(layer_number)`` -> float tensor
``[Hkv]`` or None, ``pattern(layer_number)`` -> list of Hkv bools or None (None: the layer runs plain full
attention). ``layer_number`` is Megatron's 1-based number; Hkv counts all KV heads of the model (the core
attention takes its tensor-parallel slice).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from megatron_cp.gating import METHODS as GATE_METHODS

from .options import flag

MODES = ("train", "pattern")
METHODS = ("none", *GATE_METHODS)  # --cp-head-gating
DEFAULT_SINK, DEFAULT_WINDOW = 128, 256  # DuoAttention's training setting (scripts/train.sh)


@dataclass(frozen=True)
class GatingSpec:
    """sink: first keys of each document every streaming head keeps; window: recent keys (``i - window <
    j``); mode: train | pattern; pattern: the pattern JSON path (pattern mode); method: duo | prulong |
    None (which objective trains the gates); target_sparsity: PruLong's target and the discretisation
    level (fraction of KV heads that end streaming)."""

    # the flags default to None: given, they are checked against the pattern file's values (arguments.py)
    sink: int = field(default=DEFAULT_SINK, metadata=flag(
        "--cp-sink-tokens", f"streaming heads keep each document's first N keys (default {DEFAULT_SINK}, "
        "DuoAttention's training setting; or the pattern file's)", type=int, default=None))
    window: int = field(default=DEFAULT_WINDOW, metadata=flag(
        "--cp-local-window", f"streaming heads keep the N most recent keys (default {DEFAULT_WINDOW}; or the pattern "
        "file's)", type=int, default=None))
    mode: str = "train"  # from the flags: train with --cp-head-gating, pattern with --cp-head-pattern
    pattern: str | None = field(default=None, metadata=flag(
        "--cp-head-pattern", "a learned head pattern JSON ({\"layers\": [[true/false per KV head], ...], \"sink\", "
        "\"window\"}): full heads run the full plan, the others only sink + window (inference / continued training "
        "with fixed heads)", type=str))
    method: str | None = field(default=None, metadata=flag(
        "--cp-head-gating", "learn per (layer, KV head) whether attention is full or streaming (sink + recent "
        "window): duo (DuoAttention: frozen weights, gates alpha in [0, 1] by distillation + L1) or prulong "
        "(hard-concrete L0 gates + Lagrangian sparsity target). Gate training runs in a loop that owns the gates "
        "(examples/tiny_llama/train_gates.py)", choices=METHODS, default="none"))
    target_sparsity: float = field(default=0.5, metadata=flag(
        "--cp-target-sparsity", "fraction of KV heads that end streaming: PruLong's Lagrangian target and the "
        "discretisation level (default 0.5)", type=float, default=None))

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"gating mode must be one of {MODES}, got {self.mode!r}")
        if isinstance(self.sink, bool) or not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"sink tokens must be an int >= 0, got {self.sink!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"local window must be an int >= 1, got {self.window!r}")
        if not 0.0 <= float(self.target_sparsity) < 1.0:
            raise ValueError(f"target sparsity must be in [0, 1), got {self.target_sparsity}")
        if self.mode == "pattern" and not self.pattern:
            raise ValueError("gating mode 'pattern' needs a pattern file")

    def source(self):
        """The runtime gating object of pattern mode (cached per file); train mode has none here."""
        if self.mode != "pattern":
            return None
        return pattern_source(self.pattern)


class GateSource:
    """Train mode: ``gate(layer_number)`` is row ``layer_number - 1`` of ``values()``.

    values: a callable returning float ``[layers, Hkv]`` (e.g. ``DuoGates.values`` or a closure over a
    hard-concrete sample), called once per layer call so a fresh sample is the caller's choice;
    layers: optional set of 1-based layer numbers that are gated (others run plain full attention)."""

    mode = "train"

    def __init__(self, values, layers=None):
        self._values = values
        self.layers = None if layers is None else frozenset(layers)

    def gate(self, layer_number: int):
        if self.layers is not None and layer_number not in self.layers:
            return None
        v = self._values()
        if not 1 <= layer_number <= v.shape[0]:
            raise ValueError(f"gates cover {v.shape[0]} layers, asked for layer {layer_number}")
        return v[layer_number - 1]

    def pattern(self, layer_number: int):
        return None


class PatternSource:
    """Pattern mode: ``pattern(layer_number)`` is the JSON's ``layers[layer_number - 1]``."""

    mode = "pattern"

    def __init__(self, layers, meta: dict | None = None):
        self.layers = [[bool(x) for x in row] for row in layers]
        self.meta = dict(meta or {})

    def gate(self, layer_number: int):
        return None

    def pattern(self, layer_number: int):
        if not 1 <= layer_number <= len(self.layers):
            raise ValueError(f"the head pattern has {len(self.layers)} layers, asked for layer {layer_number}")
        return self.layers[layer_number - 1]


@lru_cache(maxsize=8)
def pattern_source(path: str) -> PatternSource:
    from megatron_cp.gating import load_pattern

    obj = load_pattern(path)
    return PatternSource(obj["layers"], {k: v for k, v in obj.items() if k != "layers"})
