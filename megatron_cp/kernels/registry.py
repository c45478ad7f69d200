"""Backend lookup by name. ``auto`` picks the fastest backend usable for the given device."""

from __future__ import annotations

import torch


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Names of the backends that can run on ``device``, fastest first."""
    device = torch.device(device)
    names = []
    if device.type == "cuda":
        try:
            from . import triton_backend  # noqa: F401

            names.append("triton")
        except ImportError:
            pass
    names.append("reference")
    return names


def get_backend(name: str = "auto", device: torch.device | str = "cpu"):
    """Return the backend object called ``name`` (``auto``, ``reference``, ``triton``)."""
    if name == "auto":
        name = available_backends(device)[0]
    if name == "reference":
        from .reference import ReferenceBackend

        return ReferenceBackend()
    if name == "triton":
        from .triton_backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose from auto, reference, triton")
