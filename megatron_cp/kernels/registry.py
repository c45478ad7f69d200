"""The kernel backends by name, and their lookup. ``auto`` picks the fastest backend for the given device.

``BACKENDS`` is the one list of backend names: the Megatron flag ``--cp-kernel-backend``, the tools' ``--backend``
and every docstring that names the backends read it (``BACKEND_CHOICES`` adds ``auto``). A new backend is a
subpackage implementing ``protocol.Backend`` and one line here.
"""

from __future__ import annotations

import torch

from .fa4.backend import FA4Backend, fa4_unavailable
from .reference import ReferenceBackend
from .triton.backend import TritonBackend

BACKENDS = {"fa4": FA4Backend, "triton": TritonBackend, "reference": ReferenceBackend}  # fastest first
BACKEND_CHOICES = ("auto", *BACKENDS)


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Names of the backends ``auto`` considers for ``device``, fastest first: FA4 where flash-attn-4
    imports and the GPU is sm90 / sm100, Triton on CUDA devices, the reference everywhere."""
    names = []
    if torch.device(device).type == "cuda":
        names += (["fa4"] if fa4_unavailable(device) is None else []) + ["triton"]
    return names + ["reference"]


def get_backend(name: str = "auto", device: torch.device | str = "cpu"):
    """A new backend object called ``name`` (one of ``BACKEND_CHOICES``: auto, fa4, triton, reference)."""
    if name == "auto":
        name = available_backends(device)[0]
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(BACKEND_CHOICES)}")
    return BACKENDS[name]()
