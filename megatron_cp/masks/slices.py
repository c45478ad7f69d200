"""The mask language: ``AttnSlice`` (q_range, k_range, kind) and ``AttnMask`` (union of slices).

Semantics (shared with MagiAttention): for a slice with local query index ``i`` in ``[0, sq)`` and
local key index ``j`` in ``[0, sk)``::

    full        always
    causal      j <= i + (sk - sq)        bottom-right aligned; rows with no key keep nothing
    inv_causal  j >= i                    top-left aligned
    bi_causal   i <= j <= i + (sk - sq)

A mask is the union of its slices' cells: overlapping slices are legal and no cell counts twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from . import geometry
from .geometry import KIND_CODE, KINDS


@dataclass(frozen=True)
class AttnSlice:
    """One rectangle of the (query, key) plane with a kind: ``q_range``/``k_range`` are half-open."""

    q_range: tuple[int, int]
    k_range: tuple[int, int]
    kind: str = "full"

    def __post_init__(self):
        for name in ("q_range", "k_range"):
            r = getattr(self, name)
            try:
                r = (int(r[0]), int(r[1]))
            except (TypeError, ValueError, IndexError):
                raise ValueError(f"AttnSlice.{name} must be a pair of ints, got {r!r}") from None
            object.__setattr__(self, name, r)
            if r[0] < 0 or r[0] >= r[1]:
                raise ValueError(f"AttnSlice.{name}={r} is empty or negative (need 0 <= start < end)")
        if self.kind not in KIND_CODE:
            raise ValueError(f"AttnSlice.kind={self.kind!r} is unknown; choose from {', '.join(KINDS)}")

    @property
    def code(self) -> int:
        return KIND_CODE[self.kind]


class AttnMask:
    """A mask over ``[seqlen_q, seqlen_k]`` given as the union of ``slices``.

    ``area()`` is exact and never materialises the mask; ``to_dense()`` is for small sizes (tests).
    ``traps`` is the canonical disjoint form (int64 [n, 6], see ``geometry``) used by the planner.
    """

    def __init__(self, slices, seqlen_q: int, seqlen_k: int | None = None):
        seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
        self.seqlen_q, self.seqlen_k = int(seqlen_q), int(seqlen_k)
        if self.seqlen_q <= 0 or self.seqlen_k <= 0:
            raise ValueError(f"AttnMask needs positive lengths, got seqlen_q={seqlen_q}, seqlen_k={seqlen_k}")
        checked = []
        for n, s in enumerate(slices):
            if not isinstance(s, AttnSlice):
                raise TypeError(f"slice {n} is a {type(s).__name__}, expected AttnSlice")
            if s.q_range[1] > self.seqlen_q or s.k_range[1] > self.seqlen_k:
                raise ValueError(
                    f"slice {n} {s} lies outside the mask [seqlen_q={self.seqlen_q}, seqlen_k={self.seqlen_k}]"
                )
            checked.append(s)
        self.slices = tuple(checked)

    def __repr__(self):
        return f"AttnMask({len(self.slices)} slices, seqlen_q={self.seqlen_q}, seqlen_k={self.seqlen_k})"

    @cached_property
    def traps(self) -> np.ndarray:
        """Disjoint trapezoids whose union is the mask (int64 [n, 6]), canonical and sorted."""
        raw = [
            t
            for s in self.slices
            if (t := geometry.slice_to_trap(*s.q_range, *s.k_range, s.code)) is not None
        ]
        return geometry.union(raw)

    def normalized(self) -> "AttnMask":
        """The same mask as disjoint slices (no cell covered twice)."""
        out = []
        for t in self.traps:
            q0, q1, k0, k1, code = geometry.trap_to_slice(t)
            out.append(AttnSlice((q0, q1), (k0, k1), KINDS[code]))
        return AttnMask(out, self.seqlen_q, self.seqlen_k)

    @staticmethod
    def from_traps(traps: np.ndarray, seqlen_q: int, seqlen_k: int | None = None) -> "AttnMask":
        """The mask of trapezoids ``traps`` (int64 [n, 6], ``geometry``)."""
        out = [AttnSlice((q0, q1), (k0, k1), KINDS[code])
               for q0, q1, k0, k1, code in (geometry.trap_to_slice(t) for t in np.asarray(traps).reshape(-1, 6))]
        return AttnMask(out, seqlen_q, seqlen_k)

    def __and__(self, other: "AttnMask") -> "AttnMask":
        """The cells both masks keep (same shape)."""
        if not isinstance(other, AttnMask) or (other.seqlen_q, other.seqlen_k) != (self.seqlen_q, self.seqlen_k):
            raise ValueError(f"can only intersect masks of the same shape: {self!r} & {other!r}")
        return AttnMask.from_traps(geometry.intersect(self.traps, other.traps), self.seqlen_q, self.seqlen_k)

    def area(self) -> int:
        """Number of kept (query, key) cells, exact."""
        return geometry.traps_area(self.traps)

    def density(self) -> float:
        return self.area() / (self.seqlen_q * self.seqlen_k)

    def to_dense(self) -> np.ndarray:
        """Boolean numpy array [seqlen_q, seqlen_k], built slice by slice from the definition."""
        if self.seqlen_q * self.seqlen_k > 1 << 28:
            raise ValueError(f"to_dense() of a {self.seqlen_q}x{self.seqlen_k} mask is too large")
        d = np.zeros((self.seqlen_q, self.seqlen_k), dtype=bool)
        for s in self.slices:
            (q0, q1), (k0, k1) = s.q_range, s.k_range
            sq, sk = q1 - q0, k1 - k0
            i = np.arange(sq)[:, None]
            j = np.arange(sk)[None, :]
            if s.kind == "full":
                keep = np.ones((sq, sk), dtype=bool)
            elif s.kind == "causal":
                keep = j <= i + (sk - sq)
            elif s.kind == "inv_causal":
                keep = j >= i
            else:
                keep = (j >= i) & (j <= i + (sk - sq))
            d[q0:q1, k0:k1] |= keep
        return d

    def draw(self, path, **kwargs):
        """Save a picture of the mask to ``path`` (PNG, or any format matplotlib writes) and return the
        path: blocks shaded by the fraction of their cells kept, like FlexAttention's BlockMask picture
        (``masks.draw.draw_mask`` for the keywords: ``block``, ``max_blocks``, ``title``, ``dpi``).
        Needs matplotlib."""
        from .draw import draw_mask

        return draw_mask(self, path, **kwargs)

    def __eq__(self, other):
        if not isinstance(other, AttnMask):
            return NotImplemented
        return (self.seqlen_q, self.seqlen_k) == (other.seqlen_q, other.seqlen_k) and np.array_equal(
            self.traps, other.traps
        )

    def __hash__(self):
        return hash((self.seqlen_q, self.seqlen_k, self.traps.tobytes()))
