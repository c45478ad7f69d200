"""Byte counts as ``Plan.describe`` and ``Plan.draw`` print them."""

from __future__ import annotations


def fmt_bytes(n) -> str:
    """Bytes in binary units with three significant figures (``4.00 MiB``, ``78.6 MiB``, ``1016 KiB``)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    if unit == "B":
        return f"{n:.0f} B"
    return f"{n:.{2 if abs(n) < 10 else 1 if abs(n) < 100 else 0}f} {unit}"
