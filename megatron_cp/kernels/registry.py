"""Backend lookup by name. ``auto`` picks the fastest backend for the given device."""

from __future__ import annotations

import torch

from .fa4.backend import FA4Backend, fa4_unavailable
from .reference import ReferenceBackend
from .triton.backend import TritonBackend


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Names of the backends ``auto`` considers for ``device``, fastest first: FA4 where flash-attn-4
    imports and the GPU is sm90 / sm100, Triton on CUDA devices, the reference everywhere."""
    names = []
    if torch.device(device).type == "cuda":
        names += (["fa4"] if fa4_unavailable(device) is None else []) + ["triton"]
    return names + ["reference"]


def get_backend(name: str = "auto", device: torch.device | str = "cpu"):
    """A new backend object called ``name`` (``auto``, ``fa4``, ``triton``, ``reference``)."""
    if name == "auto":
        name = available_backends(device)[0]
    if name == "reference":
        return ReferenceBackend()
    if name == "triton":
        return TritonBackend()
    if name == "fa4":
        return FA4Backend()
    raise ValueError(f"unknown attention backend {name!r}; choose from auto, fa4, triton, reference")
