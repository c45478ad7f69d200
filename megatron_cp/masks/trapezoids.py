"""The arithmetic the builders share: argument checks, and a row trapezoid or a clipped band as slices.

On each query row a slice keeps one interval of keys whose two ends move with slope 0 or 1 as the row advances;
the four slice kinds are exactly the four slope pairs (``SLOPES_TO_KIND``), so a row trapezoid converts into
exactly one slice (``trapezoid``) and a band clipped to a key range into at most three (``band``).
"""

from __future__ import annotations

import operator

import numpy as np

from .slices import AttnSlice

__all__ = ["SLOPES_TO_KIND", "check_int", "as_numpy", "trapezoid", "causal_slices", "band"]

SLOPES_TO_KIND = {(0, 0): "full", (0, 1): "causal", (1, 0): "inv_causal", (1, 1): "bi_causal"}


# --------------------------------------------------------------------------------------------------
# argument checks


def check_int(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as a Python int in ``[lo, hi]``; ValueError naming ``name`` and ``value`` otherwise."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        v = operator.index(value)  # ints, numpy ints, 0-d integer tensors; rejects floats
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return int(v)


def as_numpy(x) -> np.ndarray:
    """A list, numpy array or torch tensor (any device) as a numpy array."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, without importing torch here
        x = x.detach().cpu().numpy()
    return np.asarray(x)


# --------------------------------------------------------------------------------------------------
# geometry helpers


def trapezoid(q0: int, q1: int, lo: int, hi: int, lo_s: int, hi_s: int) -> AttnSlice:
    """The slice keeping, on row ``q0 + t`` (t in [0, q1 - q0)), keys ``[lo + lo_s*t, hi + hi_s*t]``.

    ``lo``/``hi`` are the inclusive ends on the first row; every row must be non-empty. The kind
    follows from the slopes; the key range is chosen so the kind's formula gives exactly these cells:
    the lower line starts at ``k0`` on the first row, the upper line ends at ``k1 - 1`` on the last.
    """
    n = q1 - q0
    if n == 1:
        lo_s = hi_s = 0  # one row: all kinds coincide, use the simplest
    assert n >= 1 and lo <= hi and lo + lo_s * (n - 1) <= hi + hi_s * (n - 1), (q0, q1, lo, hi, lo_s, hi_s)
    return AttnSlice((q0, q1), (lo, hi + hi_s * (n - 1) + 1), SLOPES_TO_KIND[(lo_s, hi_s)])


def causal_slices(q0: int, q1: int, k0: int, k1: int) -> list[AttnSlice]:
    """A bottom-right aligned causal slice, with its leading rows that keep no key trimmed off."""
    sq, sk = q1 - q0, k1 - k0
    if sq > sk:  # local rows i < sq - sk keep nothing (j <= i + sk - sq < 0)
        q0 += sq - sk
    return [AttnSlice((q0, q1), (k0, k1), "causal")]


def band(q0: int, q1: int, k0: int, k1: int, left: int | None, right: int | None) -> list[AttnSlice]:
    """Rows ``[q0, q1)`` x keys ``[k0, k1)`` keeping ``i - left <= j <= i + right`` (global indices).

    ``None`` means unbounded on that side. Needs ``left + right >= 0``. On row ``i`` the kept keys
    are ``[max(k0, i - left), min(k1 - 1, i + right)]``: the lower end has slope 0 until row
    ``k0 + left`` and slope 1 after, the upper end slope 1 until row ``k1 - right`` and slope 0
    after. Cutting the non-empty rows at those two rows gives at most three trapezoids.
    """
    if q0 >= q1 or k0 >= k1:
        return []
    r0 = q0 if right is None else max(q0, k0 - right)  # rows whose upper end reaches k0
    r1 = q1 if left is None else min(q1, k1 + left)  # rows whose lower end stays below k1
    if r0 >= r1:
        return []
    cuts = {r0, r1}
    if left is not None:
        cuts.add(k0 + left)
    if right is not None:
        cuts.add(k1 - right)
    cuts = sorted(c for c in cuts if r0 <= c <= r1)
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        lo_s = int(left is not None and a >= k0 + left)
        hi_s = int(right is not None and a < k1 - right)
        lo = k0 if left is None else max(k0, a - left)
        hi = k1 - 1 if right is None else min(k1 - 1, a + right)
        out.append(trapezoid(a, b, lo, hi, lo_s, hi_s))
    return out
