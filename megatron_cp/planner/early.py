"""Early rows: the part of a rank's work that needs no received key, computed while the exchange flies.

In the single-exchange path (``stages=0``) a rank waits for its one GroupCast before its one kernel
call. Many of its query rows, though, attend only to keys it owns (documents it holds whole, the
inside of a sliding-window run): those rows can run before the exchange lands. ``early_split`` cuts a
rank's tiles by rows into

* *early* tiles: rows none of whose kept keys is a received one (computed during the exchange), and
* *late* tiles: every other row, all its tiles (computed once the received rows are placed),

so the two sets are row-disjoint: each row's output comes from one kernel call, no LSE merge of
partial rows, nothing rounded twice. Late rows are whole ``align``-row blocks (any block with one
late row is late), so the kernels' q blocks (at most ``align`` rows) never straddle the two calls.

Used by ``mcp.attention(..., early=True)`` (opt-in: see the runtime's module doc for the measurement
that keeps it off by default). Pure numpy, deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..masks import geometry
from .plan import Plan

EARLY_ALIGN = 128  # rows; a multiple of every kernel q block (smaller values are exact too, only slower)
KEY_BLOCK = 128  # the largest kernel key block: received rows sharing one with own rows are zeroed


@dataclass(frozen=True)
class EarlySplit:
    early: np.ndarray  # int32 [n, 5] tiles of the early rows (q local, k in the K/V buffer)
    late: np.ndarray  # int32 [m, 5] tiles of the late rows
    late_rows: np.ndarray  # int64 [r, 2] sorted half-open runs of late rows (local)
    pad_rows: np.ndarray  # int64 buffer positions of received rows sharing a KEY_BLOCK with own rows

    @property
    def useful(self) -> bool:
        """Is there early work to overlap (and late work that waits)?"""
        return len(self.early) > 0


def _block_runs(flags: np.ndarray, align: int, n: int) -> np.ndarray:
    """Half-open row runs of the flagged ``align``-row blocks, clipped to ``n`` rows."""
    if not flags.any():
        return np.zeros((0, 2), dtype=np.int64)
    f = np.concatenate([[False], flags, [False]]).astype(np.int8)
    d = np.diff(f)
    starts, ends = np.nonzero(d == 1)[0], np.nonzero(d == -1)[0]
    return np.stack([starts * align, np.minimum(ends * align, n)], axis=1).astype(np.int64)


def _clip_rows(traps: np.ndarray, runs: np.ndarray, buffer_len: int) -> np.ndarray:
    out = []
    for a, b in runs.tolist():
        for t in geometry.clip(traps, a, b, 0, buffer_len):
            out.append(geometry.trap_to_slice(t))
    return np.asarray(out, dtype=np.int32).reshape(-1, 5)


def early_split(plan: Plan, rank: int, align: int | None = None) -> EarlySplit:
    """Split rank ``rank``'s tiles into early and late rows of ``align``-row blocks (``EARLY_ALIGN`` when
    None; see module doc). Cached in ``plan.cache``."""
    align = EARLY_ALIGN if align is None else int(align)
    if align <= 0:
        raise ValueError(f"align must be positive, got {align}")
    key = ("early_split", rank, align)
    if key in plan.cache:
        return plan.cache[key]
    rp = plan.ranks[rank]
    n, blen = rp.num_tokens, rp.buffer_len
    tiles = np.asarray(rp.tiles, dtype=np.int64).reshape(-1, 5)
    own_pos, recv_pos = rp.buffer_index()
    recv_sorted = np.sort(recv_pos)
    nblk = -(-n // align) if n else 0
    late_blk = np.zeros(nblk, dtype=bool)
    traps = []
    for q0, q1, k0, k1, kind in tiles.tolist():
        t = geometry.slice_to_trap(q0, q1, k0, k1, kind)
        if t is None:
            continue
        traps.append(t)
        if not len(recv_sorted):
            continue
        lo_a, lo_s, hi_a, hi_s = t[2:]
        # per aligned block of the tile's rows: its keys are [lo(first row), hi(last row)) (lines of
        # slope 0/1 and non-empty rows make the union of the rows' intervals one interval)
        b0, b1 = t[0] // align, (t[1] - 1) // align + 1
        r_first = np.maximum(np.arange(b0, b1, dtype=np.int64) * align, t[0])
        r_last = np.minimum(np.arange(b0 + 1, b1 + 1, dtype=np.int64) * align, t[1]) - 1
        lo = lo_a + lo_s * r_first
        hi = hi_a + hi_s * r_last  # exclusive end of the last row's keys
        late_blk[b0:b1] |= np.searchsorted(recv_sorted, lo) < np.searchsorted(recv_sorted, hi)
    traps = np.asarray(traps, dtype=np.int64).reshape(-1, 6)
    late_runs = _block_runs(late_blk, align, n)
    early_flags = np.zeros(nblk, dtype=bool)
    if len(traps):  # blocks holding at least one tile row and no late row
        covered = np.zeros(nblk + 1, dtype=np.int64)
        np.add.at(covered, traps[:, 0] // align, 1)
        np.add.at(covered, (traps[:, 1] - 1) // align + 1, -1)
        early_flags = (np.cumsum(covered)[:nblk] > 0) & ~late_blk
    early_runs = _block_runs(early_flags, align, n)
    early = _clip_rows(traps, early_runs, blen)
    late = _clip_rows(traps, late_runs, blen)
    # received rows that share an aligned key block with own rows: early kernels may load them (masked
    # off, but 0 * NaN of uninitialised memory would poison the row), so they are zeroed first
    pad = np.zeros(0, dtype=np.int64)
    if len(early) and len(recv_pos) and len(own_pos):
        has_own = np.zeros(-(-blen // KEY_BLOCK), dtype=bool)
        has_own[own_pos // KEY_BLOCK] = True
        pad = np.sort(recv_pos[has_own[recv_pos // KEY_BLOCK]])
    res = EarlySplit(early, late, late_runs, pad)
    plan.cache[key] = res
    return res
