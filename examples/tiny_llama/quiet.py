"""Third-party start-up notices, silenced in the examples' processes and said once by the parent.

Every spawned rank imports Megatron-Core, which warns once per module that Transformer Engine, Apex or absl is
missing (it then runs its local fallbacks, which is what these examples use on CPU), that GPTModel is deprecated,
and torch logs that no CUDA runtime is found; under sequence parallelism every step advises
CUDA_DEVICE_MAX_CONNECTIONS=1 (for Megatron's TP communication overlap; the GPU launch scripts set it) and calls
an all-gather and a reduce-scatter newer torch deprecates: dozens of lines per run that bury the result. ``quiet()``
filters exactly those (by message, nothing else) in the calling process; ``note()`` is the one line the entry
points print instead.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings

MESSAGES = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"absl\.logging is not installed",
    r"Only transformer-engine>=1\.7\.0 supports MoE experts",  # megatron.training's import, without Transformer Engine
    r"full scope is deprecated",
    r"When using sequence parallelism it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
)
LOGGERS = ("torch.utils.cpp_extension", "megatron.core.models.gpt.gpt_model")


def note() -> str | None:
    """The line said instead of the silenced warnings, or None when Transformer Engine and Apex are there."""
    missing = [n for m, n in (("transformer_engine", "Transformer Engine"), ("apex", "Apex"))
               if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"(no {' or '.join(missing)} here: Megatron-Core runs its local fallbacks; its start-up warnings are "
            "silenced in every rank)")


def quiet() -> None:
    """Filter the start-up notices above in this process (call before importing megatron)."""
    for pattern in MESSAGES:
        warnings.filterwarnings("ignore", message=pattern)
    for name in LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
