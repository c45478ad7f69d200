"""Guest rows: query rows computed where their keys live (Q travels instead of K/V).

A row that keeps most of the sequence (a Longformer / BigBird global token) needs nearly every key.
Under "queries never move" its owner receives almost all K/V of every other rank (global + local at
cp 4: 75% of the sequence's K/V on every rank that holds such a row). Shipping the row instead moves
``Hq*D`` numbers a row and destination rather than ``2*Hkv*D`` a key: each rank computes the guest
rows' cells over its *own* keys and sends back a partial output with its LSE, which the owner merges
(as stages are merged); in backward the owner sends dout, lse and delta, the key owner accumulates
dK/dV into its own keys' gradients and returns the partial dQ.

So a guest cell counts towards its key owner's load (``load_prefix``), guest rows need no remote key
(``split`` removes them from the traps that decide K/V traffic), and their traffic is counted in key
tokens' units (``traffic_units``) when the planner compares a plan with guests against one without.
Pure numpy.
"""

from __future__ import annotations

import numpy as np

from ..masks import geometry
from .topology import LINKS
from .workload import Workload

# The guest path's fixed time is one more kernel call each way (this launch cost: runtime.cost.CostModel's
# default launch_us, a test checks they agree) and five more collectives (LINKS.latency_us each).
GUEST_LAUNCH_US = 90.0


def candidate_rows(row_prefix: np.ndarray, seqlen: int, cp: int) -> np.ndarray:
    """Rows keeping at least half of all keys, as merged runs (int64 [n, 2]); empty when there are none
    or more than half a rank's share of them (then shipping them is no cheaper than their keys)."""
    keep = np.diff(row_prefix)
    rows = np.nonzero(2 * keep >= seqlen)[0]
    if len(rows) == 0 or len(rows) > seqlen // (2 * cp):
        return np.zeros((0, 2), dtype=np.int64)
    return ids_to_runs(rows)


def widest_row(traps: np.ndarray, row_prefix: np.ndarray) -> int:
    """Most keys any row keeps (0 for no cells), read off ``row_prefix`` at the rows next to the
    trapezoids' ends (int64 [n, 6]): between them every row's width is linear. O(traps): a cheap
    test that ``candidate_rows`` has none (for most masks no row keeps half of all keys)."""
    s = len(row_prefix) - 1
    if len(traps) == 0 or s < 1:
        return 0
    rows = np.clip(np.concatenate([traps[:, 0], traps[:, 1]])[:, None] + np.array([-1, 0]), 0, s - 1).ravel()
    return int((row_prefix[rows + 1] - row_prefix[rows]).max())


def ids_to_runs(ids: np.ndarray) -> np.ndarray:
    """Sorted unique ids -> merged half-open runs (int64 [n, 2])."""
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    brk = np.nonzero(np.diff(ids) != 1)[0]
    starts = np.concatenate([[ids[0]], ids[brk + 1]])
    ends = np.concatenate([ids[brk], [ids[-1]]]) + 1
    return np.stack([starts, ends], axis=1)


def check_runs(runs, seqlen: int) -> np.ndarray:
    """Validated guest row runs (sorted, disjoint, non-empty, inside [0, seqlen)); raises naming the
    offending run."""
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    for i, (a, b) in enumerate(r.tolist()):
        if not 0 <= a < b <= seqlen:
            raise ValueError(f"guest row run {i} = ({a}, {b}) is empty or outside [0, {seqlen})")
        if i and a < r[i - 1, 1]:
            raise ValueError(f"guest row runs must be sorted and disjoint: run {i} = ({a}, {b}) "
                             f"starts before run {i - 1} ends ({int(r[i - 1, 1])})")
    return r


def split(traps: np.ndarray, runs: np.ndarray, seqlen: int) -> tuple[np.ndarray, np.ndarray]:
    """(main, guest): the cells of ``traps`` outside and inside the row runs, as trapezoids."""
    inside, outside, pos = [], [], 0
    for a, b in runs.tolist():
        if pos < a:
            outside.append((pos, a))
        inside.append((a, b))
        pos = b
    if pos < seqlen:
        outside.append((pos, seqlen))

    def cut(rr):
        out = []
        for a, b in rr:
            sel = traps[(traps[:, 0] < b) & (traps[:, 1] > a)]
            out += geometry.clip(sel, a, b, 0, 1 << 62)
        return np.asarray(out, dtype=np.int64).reshape(-1, 6)

    return cut(outside), cut(inside)


def _row_intervals(guest: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, lo, hi) of every (trapezoid, row) of ``guest`` (few rows: guest rows are rare)."""
    n = guest[:, 1] - guest[:, 0]
    ti = np.repeat(np.arange(len(guest)), n)
    rows = guest[ti, 0] + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    t = guest[ti]
    return rows, t[:, 2] + t[:, 3] * rows, t[:, 4] + t[:, 5] * rows


def load_prefix(main: np.ndarray, guest: np.ndarray, seqlen: int) -> np.ndarray:
    """Cumulative load by position when guest cells are computed by their key's owner: the main
    rows' cells by row plus the guest cells by key (int64 [seqlen + 1])."""
    out = geometry.row_area_prefix(main, seqlen)
    if len(guest):
        _, lo, hi = _row_intervals(guest)
        d = np.zeros(seqlen + 1, dtype=np.int64)
        np.add.at(d, lo, 1)
        np.add.at(d, hi, -1)
        out[1:] += np.cumsum(np.cumsum(d)[:seqlen])
    return out


def row_ranks(guest: np.ndarray, bounds: np.ndarray, owner: np.ndarray, cp: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, has): the guest rows (sorted, unique) and ``has[i, b]``: row ``i`` keeps a key rank ``b``
    owns (bool [rows, cp])."""
    if len(guest) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros((0, cp), dtype=bool)
    rows, lo, hi = _row_intervals(guest)
    owner = np.asarray(owner, dtype=np.int64)
    # cnt[b, c]: chunks before c that rank b owns
    cnt = np.zeros((cp, len(owner) + 1), dtype=np.int64)
    cnt[owner, np.arange(1, len(owner) + 1)] = 1
    cnt = np.cumsum(cnt, axis=1)
    c0 = np.searchsorted(bounds, lo, side="right") - 1
    c1 = np.searchsorted(bounds, hi - 1, side="right")
    has = (cnt[:, c1] - cnt[:, c0]).T > 0  # [intervals, cp]
    order = np.argsort(rows, kind="stable")
    rows, has = rows[order], has[order]
    first = np.concatenate([[0], np.nonzero(np.diff(rows))[0] + 1])
    return rows[first], np.logical_or.reduceat(has, first, axis=0)


def pair_rows(guest: np.ndarray, bounds: np.ndarray, owner: np.ndarray, cp: int) -> np.ndarray:
    """``M[a, b]``: guest rows owned by rank ``a`` with a cell on a key rank ``b`` owns (int64 [cp, cp])."""
    M = np.zeros((cp, cp), dtype=np.int64)
    rows, has = row_ranks(guest, bounds, owner, cp)
    if len(rows):
        a = np.asarray(owner, dtype=np.int64)[np.searchsorted(bounds, rows, side="right") - 1]
        np.add.at(M, a, has.astype(np.int64))
    return M


def row_bytes(work: Workload) -> tuple[int, int]:
    """Bytes a guest row costs (forward + backward) on (the key owner's receive side, the row owner's
    receive side): q and dout with lse and delta go out; the partial output with its lse (float32;
    float64 inputs: float64) and dq come back."""
    h, d, b = work.num_heads, work.head_dim, work.dtype_bytes
    acc = 8 if b == 8 else 4
    return 2 * h * d * b + 2 * h * acc, h * (d + 1) * acc + h * d * b


def traffic_units(M: np.ndarray, work: Workload | None = None, topology=None) -> np.ndarray:
    """Per rank, the bytes it receives for guest rows (``pair_rows`` matrix, self pairs free), in units
    of one remote key token's forward K/V plus backward dK/dV (float64 [cp]); with a multi-node
    ``topology`` pairs on different nodes count ``intra_node_gbps / inter_node_gbps`` times."""
    work = work or Workload()
    key = 2 * work.kv_bytes_per_token
    to_key, to_row = row_bytes(work)
    off = M.astype(np.float64).copy()
    np.fill_diagonal(off, 0)
    if topology is not None and topology.nodes > 1:
        node = np.arange(len(M)) // topology.gpus_per_node
        off *= np.where(node[:, None] != node[None, :], topology.intra_node_gbps / topology.inter_node_gbps, 1.0)
    return (off.sum(0) * to_key + off.sum(1) * to_row) / key


def fixed_units(work: Workload | None = None) -> float:
    """The guest path's fixed time (one more kernel call each way, five more collectives) in key
    tokens' units at the intra-node bandwidth (``LINKS``: about 15k tokens): a plan's guests must save
    more than this."""
    work = work or Workload()
    t = 2 * GUEST_LAUNCH_US * 1e-6 + 5 * LINKS.latency_us * 1e-6
    return t * LINKS.intra_gbps * 1e9 / (2 * work.kv_bytes_per_token)
