"""Learned per-(layer, KV head) gates choosing full or streaming attention, and the head pattern file.

Two ways to learn which KV heads need the whole context (``gating.attention`` runs the mixture):

* ``DuoGates`` (DuoAttention, Xiao et al. 2024): one real gate ``alpha`` per (layer, KV head), initialised
  at 1 (all heads full). The model's weights are frozen; only alpha trains, on a distillation loss (the
  gated model's final hidden states against the full model's) plus ``l1()``. After every optimiser step
  ``clamp_()`` keeps alpha in [0, 1], as the paper does.
* ``HardConcreteGates`` (PruLong, "Cache me if you can", after Louizos et al. 2018's L0 gates): a
  stretched, clamped hard-concrete variable per (layer, KV head) sampled during training (``sample``),
  deterministic at evaluation (``expected``), and ``expected_sparsity()`` from the L0 probability. A
  ``LagrangianSparsity`` term pushes the expected sparsity toward a target warmed up linearly; its two
  multipliers are *maximised* (optimise them with ``maximize=True``) while the gates minimise.

``discretize`` turns gate values into a pattern (top ``1 - sparsity`` fraction of heads stay full);
``save_pattern`` / ``load_pattern`` read and write it as JSON::

    {"layers": [[true, false, ...] per layer, one bool per KV head], "sparsity": 0.5, "sink": 128, "window": 256}

Pure torch: nothing here is distributed (gates are small and replicated; callers all-reduce their grads).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

# PruLong / Louizos et al. defaults: stretch interval (l, r), temperature beta, log_alpha ~ N(4.5, 0.01)
LIMIT_L, LIMIT_R = -0.1, 1.1
TEMPERATURE = 2.0 / 3.0
LOG_ALPHA_MEAN, LOG_ALPHA_STD = 4.5, 0.01
_EPS = 1e-6


def _check_shape(num_layers: int, num_kv_heads: int) -> None:
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


class DuoGates(nn.Module):
    """DuoAttention's gates: ``alpha`` float32 ``[num_layers, num_kv_heads]`` (a Parameter), 1 = full head.

    ``values()`` is alpha itself (differentiable); ``gate(layer)`` one layer's ``[Hkv]`` row (0-based
    layer index); ``l1()`` the mean |alpha| (the sparsity regulariser; mean, so its weight does not
    depend on the model's head count); ``clamp_()`` projects alpha back into [0, 1]."""

    def __init__(self, num_layers: int, num_kv_heads: int, init: float = 1.0):
        super().__init__()
        _check_shape(num_layers, num_kv_heads)
        if not 0.0 <= float(init) <= 1.0:
            raise ValueError(f"init must be in [0, 1], got {init}")
        self.alpha = nn.Parameter(torch.full((num_layers, num_kv_heads), float(init)))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.alpha.shape)

    def values(self) -> torch.Tensor:
        return self.alpha

    def gate(self, layer: int) -> torch.Tensor:
        return self.alpha[layer]

    def l1(self) -> torch.Tensor:
        return self.alpha.abs().mean()

    @torch.no_grad()
    def clamp_(self) -> DuoGates:
        self.alpha.clamp_(0.0, 1.0)
        return self

    def forward(self) -> torch.Tensor:
        return self.alpha


class HardConcreteGates(nn.Module):
    """L0 gates (PruLong): ``log_alpha`` float32 ``[num_layers, num_kv_heads]`` (a Parameter).

    A gate is ``z = clamp(sigmoid((log u - log(1 - u) + log_alpha) / beta) * (r - l) + l, 0, 1)`` with
    ``u ~ U(0, 1)``: exactly 0 or 1 with positive probability, differentiable in log_alpha in between.
    ``sample(generator)`` draws one z per gate (pass the same seeded generator on every rank that must
    agree, e.g. the CP group); ``expected()`` is the deterministic test-time value
    ``clamp(sigmoid(log_alpha) * (r - l) + l, 0, 1)``; ``prob_nonzero()`` = P(z > 0) =
    ``sigmoid(log_alpha - beta * log(-l / r))`` and ``expected_sparsity()`` = 1 - its mean: the expected
    fraction of streaming heads, differentiable."""

    def __init__(self, num_layers: int, num_kv_heads: int, temperature: float = TEMPERATURE,
                 limit_l: float = LIMIT_L, limit_r: float = LIMIT_R, init_mean: float = LOG_ALPHA_MEAN,
                 init_std: float = LOG_ALPHA_STD, generator: torch.Generator | None = None):
        super().__init__()
        _check_shape(num_layers, num_kv_heads)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not (limit_l < 0.0 and limit_r > 1.0):
            raise ValueError(f"the stretch limits must satisfy l < 0 < 1 < r, got ({limit_l}, {limit_r})")
        self.temperature, self.limit_l, self.limit_r = float(temperature), float(limit_l), float(limit_r)
        init = torch.empty(num_layers, num_kv_heads).normal_(init_mean, init_std, generator=generator)
        self.log_alpha = nn.Parameter(init)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.log_alpha.shape)

    def _stretch(self, s: torch.Tensor) -> torch.Tensor:
        return (s * (self.limit_r - self.limit_l) + self.limit_l).clamp(0.0, 1.0)

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """One hard-concrete draw ``[layers, Hkv]`` in [0, 1], differentiable in log_alpha."""
        u = torch.rand(self.log_alpha.shape, generator=generator, dtype=self.log_alpha.dtype)
        u = u.to(self.log_alpha.device).clamp(_EPS, 1 - _EPS)
        s = torch.sigmoid((u.log() - (1 - u).log() + self.log_alpha) / self.temperature)
        return self._stretch(s)

    def expected(self) -> torch.Tensor:
        """Deterministic gate values ``[layers, Hkv]`` in [0, 1] (evaluation, discretisation)."""
        return self._stretch(torch.sigmoid(self.log_alpha))

    def prob_nonzero(self) -> torch.Tensor:
        """P(z > 0) per gate ``[layers, Hkv]`` (the L0 norm's expectation)."""
        return torch.sigmoid(self.log_alpha - self.temperature * math.log(-self.limit_l / self.limit_r))

    def expected_sparsity(self) -> torch.Tensor:
        """Scalar: 1 - the expected fraction of full (non-zero) heads."""
        return 1.0 - self.prob_nonzero().mean()

    def forward(self, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.sample(generator) if self.training else self.expected()


class LagrangianSparsity(nn.Module):
    """PruLong's constraint ``sparsity = target(step)`` as a Lagrangian term.

    ``forward(s, step)`` = ``lambda_1 * (s - t) + lambda_2 * (s - t) ** 2`` with ``t = target_at(step)``
    (linear from 0 at step 0 to ``target`` at ``warmup_steps``, then constant). lambda_1 and lambda_2
    (scalar Parameters, init 0) are maximised: step them with an optimiser made with ``maximize=True``
    (or negate their gradients) while the gates minimise the same loss."""

    def __init__(self, target: float, warmup_steps: int = 0):
        super().__init__()
        if not 0.0 <= float(target) < 1.0:
            raise ValueError(f"target sparsity must be in [0, 1), got {target}")
        if int(warmup_steps) < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.target, self.warmup_steps = float(target), int(warmup_steps)
        self.lambda_1 = nn.Parameter(torch.zeros(()))
        self.lambda_2 = nn.Parameter(torch.zeros(()))

    def target_at(self, step: int) -> float:
        if self.warmup_steps == 0:
            return self.target
        return self.target * min(1.0, max(0, int(step)) / self.warmup_steps)

    def forward(self, expected_sparsity: torch.Tensor, step: int) -> torch.Tensor:
        d = expected_sparsity - self.target_at(step)
        return self.lambda_1 * d + self.lambda_2 * d * d


def discretize(values, sparsity: float) -> list[list[bool]]:
    """Gate values ``[layers, Hkv]`` (tensor or nested lists) -> pattern ``[layers][Hkv]`` of bools.

    The ``round((1 - sparsity) * layers * Hkv)`` heads with the largest values, ranked over all layers
    together (as DuoAttention deploys), stay full (True); ties go to the lower (layer, head) index."""
    v = torch.as_tensor(values, dtype=torch.float64).detach().cpu()
    if v.dim() != 2 or v.numel() == 0:
        raise ValueError(f"gate values must be [layers, kv_heads], got shape {tuple(v.shape)}")
    if not 0.0 <= float(sparsity) <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity}")
    L, H = v.shape
    n_full = int(round((1.0 - float(sparsity)) * L * H))
    flat = v.reshape(-1).tolist()
    order = sorted(range(L * H), key=lambda i: (-flat[i], i))  # stable: ties by index
    keep = set(order[:n_full])
    return [[(l * H + h) in keep for h in range(H)] for l in range(L)]


def _validate(obj, where: str) -> dict:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a head pattern must be a JSON object, got {type(obj).__name__}")
    if "layers" not in obj:
        raise ValueError(f"{where}: missing 'layers' (a list of per-layer lists of true/false per KV head)")
    layers = obj["layers"]
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"{where}: 'layers' must be a non-empty list, got {layers!r}")
    width = None
    for i, row in enumerate(layers):
        if not isinstance(row, list) or not row:
            raise ValueError(f"{where}: layers[{i}] must be a non-empty list of true/false, got {row!r}")
        for j, x in enumerate(row):
            if not isinstance(x, bool):
                raise ValueError(f"{where}: layers[{i}][{j}] must be true or false, got {x!r}")
        if width is None:
            width = len(row)
        elif len(row) != width:
            raise ValueError(f"{where}: layers[{i}] has {len(row)} KV heads but layers[0] has {width}")
    sp = obj.get("sparsity")
    if sp is not None and (isinstance(sp, bool) or not isinstance(sp, (int, float)) or not 0 <= sp <= 1):
        raise ValueError(f"{where}: 'sparsity' must be a number in [0, 1], got {sp!r}")
    for key, lo in (("sink", 0), ("window", 1)):
        x = obj.get(key)
        if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < lo):
            raise ValueError(f"{where}: '{key}' must be an int >= {lo}, got {x!r}")
    return obj


def save_pattern(path, pattern, meta: dict | None = None) -> dict:
    """Write ``pattern`` ([layers][Hkv] bools) with ``meta`` (sparsity, sink, window, anything else
    JSON-able) to ``path``; returns the written object (validated first)."""
    obj = {"layers": [[bool(x) for x in row] for row in pattern]}
    for k, v in (meta or {}).items():
        if k == "layers":
            raise ValueError("meta must not contain 'layers'")
        obj[k] = v
    _validate(obj, str(path))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1) + "\n")
    return obj


def load_pattern(path) -> dict:
    """Read and validate a head pattern JSON: returns ``{"layers": [[bool]], "sparsity", "sink",
    "window", ...}`` (missing optional keys are None). Raises ValueError naming the bad entry."""
    try:
        obj = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read head pattern {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    _validate(obj, str(path))
    for k in ("sparsity", "sink", "window"):
        obj.setdefault(k, None)
    return obj


def pattern_sparsity(pattern) -> float:
    """The fraction of streaming (False) heads in a pattern."""
    flat = [bool(x) for row in pattern for x in row]
    return 1.0 - sum(flat) / max(1, len(flat))
