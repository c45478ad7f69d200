"""Every rank's plan for a chosen layout: the runs it owns, the key runs it receives from each owner, and its
compute tiles in local coordinates (``RankPlan``), built for all ranks at once with the run algebra of
``keys`` (and the guest rows' sends and tiles where the plan has them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..masks import geometry
from . import guests
from .keys import decode, encode, merge_runs, positions, remote_all, runs_to_ids, split_at_chunks

_KIND = np.array([[geometry.trap_to_slice((0, 1, 0, lo, 1, hi))[4] for hi in (0, 1)] for lo in (0, 1)])
_LO_S, _HI_S = np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.int64)
_LO_S[_KIND], _HI_S[_KIND] = np.array([[0, 0], [1, 1]]), np.array([[0, 1], [0, 1]])


@dataclass(frozen=True)
class RankPlan:
    """What one rank does. Runs are int64 [n, 2] half-open global ranges, sorted."""

    rank: int
    segments: np.ndarray  # owned runs = local order
    recv_runs: tuple  # recv_runs[src]: runs received from rank src
    send_runs: tuple  # send_runs[dst]: own runs sent to rank dst
    buffer_runs: np.ndarray  # merged owned + received runs = key/value buffer order
    tiles: np.ndarray  # int32 [n, 5] (q local, k buffer, kind)
    traps: np.ndarray  # int64 [n, 6]: the same cells as trapezoids, rows local, keys global (masks.geometry)
    area: int  # cells this rank computes (its rows' cells, and guest cells on its own keys)
    # guest rows (planner.guests): guest_send_runs[dst] = own rows whose cells on dst's keys dst computes
    # (dst == rank: computed here, with the same call); guest_recv_runs[src] = src's rows computed here;
    # guest_tiles: q in the guest buffer (received rows by source, then global order), k in local order
    guest_send_runs: tuple = ()
    guest_recv_runs: tuple = ()
    guest_tiles: np.ndarray = field(default_factory=lambda: np.zeros((0, 5), dtype=np.int32))

    @property
    def num_tokens(self) -> int:
        return int((self.segments[:, 1] - self.segments[:, 0]).sum())

    @property
    def num_remote(self) -> int:
        return int(sum((r[:, 1] - r[:, 0]).sum() for r in self.recv_runs))

    def local_ids(self) -> np.ndarray:
        return runs_to_ids(self.segments)

    def remote_ids(self) -> np.ndarray:
        """Global ids of every key/value token this rank receives, sorted (int64)."""
        runs = [r for r in self.recv_runs if len(r)]
        return runs_to_ids(merge_runs(np.concatenate(runs))) if runs else np.zeros(0, dtype=np.int64)

    def send_index(self) -> tuple[np.ndarray, list[int]]:
        """Local positions to send, concatenated in destination order, and per-destination counts."""
        idx = [positions(self.segments, runs_to_ids(r)) for r in self.send_runs]
        return np.concatenate(idx).astype(np.int64), [len(i) for i in idx]

    def recv_counts(self) -> list[int]:
        return [int((r[:, 1] - r[:, 0]).sum()) for r in self.recv_runs]

    def buffer_index(self) -> tuple[np.ndarray, np.ndarray]:
        """Positions in the key/value buffer of (own tokens in local order, received tokens in
        receive order: by source rank, then global order)."""
        own = positions(self.buffer_runs, self.local_ids())
        recv = [runs_to_ids(r) for r in self.recv_runs]
        rid = np.concatenate(recv) if recv else np.zeros(0, dtype=np.int64)
        return own.astype(np.int64), positions(self.buffer_runs, rid).astype(np.int64)

    @property
    def buffer_len(self) -> int:
        return int((self.buffer_runs[:, 1] - self.buffer_runs[:, 0]).sum())

    def guest_send_index(self) -> tuple[np.ndarray, list[int]]:
        """Local positions of the guest rows to send, in destination order, and per-destination counts
        (all zero without guest rows)."""
        if not self.guest_send_runs:
            return np.zeros(0, dtype=np.int64), []
        idx = [positions(self.segments, runs_to_ids(r)) for r in self.guest_send_runs]
        return np.concatenate(idx).astype(np.int64), [len(i) for i in idx]

    def guest_recv_counts(self) -> list[int]:
        return [int((r[:, 1] - r[:, 0]).sum()) for r in self.guest_recv_runs]


def rank_plans(traps, prefix, spans, bounds, owner, cp, guest_traps=None) -> tuple:
    """Every rank's ``RankPlan`` for the layout (``bounds``, ``owner``) of ``traps`` (canonical, as
    ``AttnMask.traps``: every row non-empty, keys in [0, seqlen]). All ranks are built together with the
    run algebra over groups below (no loop over ranks or trapezoids in Python)."""
    bounds, owner = np.asarray(bounds, dtype=np.int64), np.asarray(owner)
    W = int(bounds[-1]) + 1
    ci, k0, k1 = spans.spans(bounds)
    own, rem = remote_all(ci, k0, k1, bounds, owner)
    seg, seg_g = decode(own, W)
    seg_at = np.searchsorted(seg_g, np.arange(cp + 1))
    # received runs by (destination, source): remote runs cut at chunk bounds, merged per pair
    pieces, dst, src = split_at_chunks(*decode(rem, W), bounds, owner)
    recv, pair = decode(merge_runs(encode(pieces, dst * cp + src, W)), W)
    recv_at = np.searchsorted(pair, np.arange(cp * cp + 1))
    # by (destination, source), one shared empty array where a pair moves nothing: at 1024 ranks a slice per
    # pair was a million slices, half the planning time
    by_pair = [[recv[:0]] * cp for _ in range(cp)]
    for p in np.flatnonzero(np.diff(recv_at)).tolist():
        by_pair[p // cp][p % cp] = recv[recv_at[p]:recv_at[p + 1]]
    recv_runs = [tuple(row) for row in by_pair]
    send_runs = list(zip(*by_pair))  # send_runs[r][dst] = recv_runs[dst][r]
    buf = merge_runs(np.concatenate([own, rem]))  # each rank's key/value buffer, encoded
    buf_at = np.searchsorted(buf[:, 0] // W, np.arange(cp + 1))
    local, local_g = local_traps(traps, seg, seg_g, seg_at)
    tiles = tiles_of(local, local_g, buf, buf_at, W, cp)
    local_at = np.searchsorted(local_g, np.arange(cp + 1))
    seg_area = np.concatenate([[0], np.cumsum(prefix[seg[:, 1]] - prefix[seg[:, 0]])])
    g_send = guest_send(guest_traps, bounds, owner, cp)
    out = []
    for r in range(cp):
        segs = seg[seg_at[r]:seg_at[r + 1]]
        g_recv = tuple(g_send[src][r] for src in range(cp)) if g_send else ()
        out.append(
            RankPlan(
                rank=r,
                segments=segs,
                recv_runs=recv_runs[r],
                send_runs=send_runs[r],
                buffer_runs=decode(buf[buf_at[r]:buf_at[r + 1]], W)[0],
                tiles=tiles[r],
                traps=local[local_at[r]:local_at[r + 1]],
                area=int(seg_area[seg_at[r + 1]] - seg_area[seg_at[r]]),
                guest_send_runs=tuple(g_send[r]) if g_send else (),
                guest_recv_runs=g_recv,
                guest_tiles=guest_tiles(guest_traps, g_recv, segs) if g_send else np.zeros((0, 5), np.int32),
            )
        )
    return tuple(out)


def guest_send(guest_traps, bounds, owner, cp) -> list | None:
    """``send[a][b]``: runs of rank a's guest rows with a cell on rank b's keys; None without guests."""
    if guest_traps is None or len(guest_traps) == 0:
        return None
    rows, has = guests.row_ranks(guest_traps, bounds, owner, cp)
    row_owner = np.asarray(owner)[np.searchsorted(bounds, rows, side="right") - 1]
    return [[guests.ids_to_runs(rows[(row_owner == a) & has[:, b]]) for b in range(cp)] for a in range(cp)]


def guest_tiles(guest_traps, recv_runs, segs) -> np.ndarray:
    """Guest cells on the rank's own keys: q in the guest buffer (received rows by source, then
    global order), k in local order."""
    k_off = np.concatenate([[0], np.cumsum(segs[:, 1] - segs[:, 0])])
    tiles, q_off = [], 0
    for runs in recv_runs:
        for a, b in runs.tolist():
            rows = guest_traps[(guest_traps[:, 0] < b) & (guest_traps[:, 1] > a)]
            for j, (s, e) in enumerate(segs.tolist()):
                for t in geometry.clip(rows, a, b, s, e):
                    q0, q1, k0, k1, kind = geometry.trap_to_slice(t)
                    kl = int(k_off[j]) + k0 - s
                    tiles.append((q0 - a + q_off, q1 - a + q_off, kl, kl + k1 - k0, kind))
            q_off += b - a
    return geometry.merge_tiles(tiles)


def local_traps(traps, seg, seg_g, seg_at) -> tuple[np.ndarray, np.ndarray]:
    """The cells of ``traps`` on every rank's owned rows, rows in the rank's local order, keys global:
    (int64 [n, 6], their rank [n]), by rank, then owned run, then trapezoid. Owned runs ``seg`` (int64
    [m, 2], sorted by (rank ``seg_g``, start); ``seg_at``: each rank's first run) cover [0, seqlen)."""
    if len(traps) == 0:
        return np.zeros((0, 6), dtype=np.int64), np.zeros(0, dtype=np.int64)
    size = seg[:, 1] - seg[:, 0]
    start = np.cumsum(size) - size
    q_off = start - start[seg_at[:-1]][seg_g]  # each run's first local row
    by_pos = np.argsort(seg[:, 0], kind="stable")
    # each trapezoid meets the runs first..last in sequence order
    first = np.searchsorted(seg[by_pos, 1], traps[:, 0], side="right")
    last = np.searchsorted(seg[by_pos, 0], traps[:, 1], side="left") - 1
    n = last - first + 1
    ti = np.repeat(np.arange(len(traps)), n)
    si = by_pos[np.repeat(first, n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)]
    order = np.lexsort((ti, si))
    ti, si = ti[order], si[order]
    t = traps[ti].copy()
    # a row range of a trapezoid is the same two lines on fewer rows (every row is non-empty)
    t[:, 0] = np.maximum(t[:, 0], seg[si, 0])
    t[:, 1] = np.minimum(t[:, 1], seg[si, 1])
    d = q_off[si] - seg[si, 0]
    t[:, 0] += d
    t[:, 1] += d
    t[:, 2] -= t[:, 3] * d
    t[:, 4] -= t[:, 5] * d
    return t, seg_g[si]


def tiles_of(local, local_g, buf, buf_at, W, cp) -> list[np.ndarray]:
    """Each rank's tiles (int32 [n, 5], as ``geometry.merge_tiles`` gives them): each of its trapezoids
    ``local`` (rank ``local_g``) is one tile (q local, k in the rank's buffer ``buf``, encoded runs:
    its keys are a contiguous range there, since the buffer holds every key the rank needs in global
    order); then the tiles that became neighbours in the buffer join."""
    q0, q1 = local[:, 0], local[:, 1]
    k0 = local[:, 2] + local[:, 3] * q0
    k1 = local[:, 4] + local[:, 5] * (q1 - 1)
    size = buf[:, 1] - buf[:, 0]
    start = np.cumsum(size) - size
    ek = k0 + local_g * W
    i = np.searchsorted(buf[:, 0], ek, side="right") - 1
    kb = start[i] - start[buf_at[:-1]][local_g] + ek - buf[i, 0]
    tiles = np.stack([q0, q1, kb, kb + k1 - k0, _KIND[local[:, 3], local[:, 5]]], axis=1)
    return merge_tiles(tiles, local_g, cp)


def merge_tiles(tiles, g, cp) -> list[np.ndarray]:
    """``geometry.merge_tiles`` of each rank's tiles (int64 [n, 5] of non-empty tiles, ``g`` their
    sorted rank): where no two tiles of a rank would join, that is the rank's tiles sorted by
    (q0, k0), found without Python loops; a rank with a join goes through ``merge_tiles`` itself."""
    at = np.searchsorted(g, np.arange(cp + 1))
    q0, q1, k0, k1, kind = (tiles[:, j] for j in range(5))
    lo_s, hi_s = _LO_S[kind], _HI_S[kind]
    lo_a, hi_a = k0 - q0 * lo_s, k1 - (q1 - 1) * hi_s  # the tile as a trapezoid (geometry.slice_to_trap)
    joins = np.zeros(cp, dtype=bool)
    if len(tiles) > 1:
        # merge_tiles' two joins pair neighbours in these orders: same rows, one's upper line the next
        # one's lower line (geometry._join_rows); the same two lines on adjacent rows (geometry._coalesce)
        o = np.lexsort((k0, q1, q0, g))
        a, b = o[:-1], o[1:]
        hit = (g[a] == g[b]) & (q0[a] == q0[b]) & (q1[a] == q1[b]) & (hi_a[a] == lo_a[b]) & (hi_s[a] == lo_s[b])
        joins[g[a][hit]] = True
        o = np.lexsort((q0, hi_s, hi_a, lo_s, lo_a, g))
        a, b = o[:-1], o[1:]
        hit = ((g[a] == g[b]) & (lo_a[a] == lo_a[b]) & (lo_s[a] == lo_s[b]) & (hi_a[a] == hi_a[b])
               & (hi_s[a] == hi_s[b]) & (q1[a] == q0[b]))
        joins[g[a][hit]] = True
    o = np.lexsort((k0, q0, g))
    out = tiles[o].astype(np.int32)
    return [geometry.merge_tiles(tiles[at[r]:at[r + 1]]) if joins[r] and at[r + 1] - at[r] > 1
            else out[at[r]:at[r + 1]] for r in range(cp)]
