"""The backend another backend hands a call to where its own kernels cannot run: the Triton kernels, with the
caller's ``TritonConfig``. FA4Backend takes its fallback from here, so the FA4 package depends on the shared
config and this factory, never on the Triton package's modules."""

from __future__ import annotations

from .config import TritonConfig
from .triton.backend import TritonBackend

__all__ = ["fallback_backend"]


def fallback_backend(config: TritonConfig | None = None) -> TritonBackend:
    """A new TritonBackend running ``config`` (default: ``TritonConfig()``)."""
    return TritonBackend(config or TritonConfig())
