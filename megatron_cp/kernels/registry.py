"""Backend lookup by name. ``auto`` picks the fastest backend for the given device."""

from __future__ import annotations

import torch

from .reference import ReferenceBackend
from .triton_backend import TritonBackend


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Names of the backends ``auto`` considers for ``device``, fastest first: Triton on CUDA devices,
    the reference everywhere."""
    return (["triton"] if torch.device(device).type == "cuda" else []) + ["reference"]


def get_backend(name: str = "auto", device: torch.device | str = "cpu"):
    """A new backend object called ``name`` (``auto``, ``reference``, ``triton``)."""
    if name == "auto":
        name = available_backends(device)[0]
    if name == "reference":
        return ReferenceBackend()
    if name == "triton":
        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose from auto, reference, triton")
