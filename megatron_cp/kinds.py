"""The four cell patterns of a slice, tile or trapezoid: one code shared by masks, planner and kernels.

For local query index ``i`` in ``[0, sq)`` and key index ``j`` in ``[0, sk)`` (MagiAttention's semantics)::

    FULL       (0): always
    CAUSAL     (1): j <= i + (sk - sq)          (bottom-right aligned)
    INV_CAUSAL (2): j >= i                      (top-left aligned)
    BI_CAUSAL  (3): i <= j <= i + (sk - sq)     (a band: a sliding window)

A leaf module: it imports nothing of megatron_cp, so every layer may use it.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["Kind"]
__shared__ = ["KIND_NAMES"]  # for the layers above (the kernels' and masks' name tables), not users


class Kind(IntEnum):
    FULL = 0
    CAUSAL = 1
    INV_CAUSAL = 2
    BI_CAUSAL = 3

    @classmethod
    def parse(cls, kind: "Kind | str | int") -> "Kind":
        """A ``Kind`` from a member, its lower-case name (``"causal"``) or its code; ValueError otherwise."""
        if isinstance(kind, str):
            try:
                return cls[kind.upper()]
            except KeyError:
                raise ValueError(f"unknown mask kind {kind!r}; choose from {', '.join(KIND_NAMES)}") from None
        try:
            return cls(int(kind))
        except (ValueError, TypeError):
            raise ValueError(f"unknown mask kind {kind!r}; choose from {', '.join(KIND_NAMES)}") from None


KIND_NAMES = tuple(k.name.lower() for k in Kind)  # ("full", "causal", "inv_causal", "bi_causal")
