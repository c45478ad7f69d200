"""Row moves between the runtime's tensors: a slice copy (or a view) for one contiguous run, one
indexed row-copy kernel otherwise.

The single-exchange runtime places a rank's own K/V rows and the received ones into the key buffers,
gathers the rows to send and takes the own rows' gradients back out. The index sets come from the
plan and are fixed per (plan, rank). Measured (docs/design.md): ``index_put_``
of wide bf16 rows moves ~0.8 TB/s (318 us for a 32k x 16 x 128 buffer), and one slice copy per run
is launch-bound at ~14 us a run (a rank of packed documents owns ~15 chunk runs: 30 copies for K
and V), so more than one run goes through ``kernels.rows.copy_rows`` (whole rows, vector loads; torch
index ops on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..kernels import copy_row_pair_moves, copy_row_pairs, copy_rows, upload_all

MAX_RUNS = 1  # more runs than this: one indexed row-copy kernel instead of slice copies


def runs_of(dst_idx: np.ndarray, src_idx: np.ndarray) -> list[tuple[int, int, int]]:
    """(dst start, src start, length) of the maximal runs where both indices step by one."""
    dst_idx = np.asarray(dst_idx, dtype=np.int64)
    src_idx = np.asarray(src_idx, dtype=np.int64)
    if dst_idx.shape != src_idx.shape or dst_idx.ndim != 1:
        raise ValueError(f"index shapes differ or are not 1-D: {dst_idx.shape} vs {src_idx.shape}")
    n = len(dst_idx)
    if n == 0:
        return []
    brk = np.nonzero((np.diff(dst_idx) != 1) | (np.diff(src_idx) != 1))[0] + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [n]])
    return [(int(dst_idx[a]), int(src_idx[a]), int(b - a)) for a, b in zip(starts, ends)]


@dataclass(frozen=True)
class RowIndex:
    """A ``RowMap``'s host part, made anywhere (the planning helper process makes a new plan's ahead): its
    size, runs and whether it copies by index (then the index arrays the device needs)."""

    n: int
    gatherable: bool
    runs: list
    indexed: bool
    dst: np.ndarray | None
    src: np.ndarray | None

    @classmethod
    def of(cls, dst_idx, src_idx, max_runs: int | None = None) -> "RowIndex":
        if dst_idx is None and src_idx is None:
            raise ValueError("RowMap needs at least one index")
        n = len(dst_idx if dst_idx is not None else src_idx)
        ar = np.arange(n, dtype=np.int64)
        d = ar if dst_idx is None else np.asarray(dst_idx, dtype=np.int64)
        s = ar if src_idx is None else np.asarray(src_idx, dtype=np.int64)
        runs = runs_of(d, s)
        indexed = len(runs) > (MAX_RUNS if max_runs is None else max_runs)
        return cls(n, dst_idx is None, runs, indexed, d if dst_idx is not None and indexed else None,
                   s if src_idx is not None and indexed else None)


def grouped(dest: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The positions i of ``dest`` (ints in [0, n)) grouped by ``dest[i]``, each group in position order: (the rows
    with any, int64; ptr [len + 1]; the positions, group after group) - what ``kernels.reduce_rows`` sums in a fixed
    order."""
    order = np.argsort(dest, kind="stable")
    counts = np.bincount(dest, minlength=n)
    rows = np.flatnonzero(counts)
    ptr = np.concatenate([[0], np.cumsum(counts[rows])])
    return rows.astype(np.int64), ptr.astype(np.int64), order.astype(np.int64)


class RowMap:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for every i (dim 0), fixed once, applied many times.

    ``src_idx`` None means ``arange(n)`` (scatter), ``dst_idx`` None means ``arange(n)`` (gather)."""

    def __init__(self, dst_idx, src_idx, device, max_runs: int | None = None):
        h = RowIndex.of(dst_idx, src_idx, max_runs)
        self._set(h, *upload_all([h.dst, h.src], device))

    @classmethod
    def placed(cls, host: RowIndex, dst_t: torch.Tensor | None, src_t: torch.Tensor | None) -> "RowMap":
        """The map of ``host`` (a ``RowIndex`` made elsewhere) with its index arrays already on the device
        (``host.dst`` / ``host.src`` uploaded, e.g. with others in one ``upload_all``)."""
        m = cls.__new__(cls)
        m._set(host, dst_t, src_t)
        return m

    def _set(self, h: RowIndex, dst_t, src_t) -> None:
        if (dst_t is None) != (h.dst is None) or (src_t is None) != (h.src is None):
            raise ValueError("a RowMap's device indices must be its RowIndex's arrays, uploaded")
        self.n, self.gatherable, self.runs, self.indexed = h.n, h.gatherable, h.runs, h.indexed
        self.dst_t, self.src_t = dst_t, src_t
        self._run_idx: dict = {}  # (first row, device index) -> run_index's tensor

    def run_index(self, start: int, like: torch.Tensor) -> torch.Tensor:
        """``arange(start, start + n)`` (int64) on ``like``'s device, made on first use and kept: a one-run map's rows
        as an index, for a launch it shares with an indexed map (``copy_pairs``), where views of its four tensors
        would cost the host microseconds every call."""
        key = (start, like.get_device())
        t = self._run_idx.get(key)
        if t is None:
            t = self._run_idx[key] = torch.arange(start, start + self.n, dtype=torch.int64, device=like.device)
        return t

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Apply in place (dtype conversion included)."""
        if not self.indexed:
            for d0, s0, m in self.runs:  # narrow: a slice through __getitem__ costs the host more; none for a whole
                # tensor (a gather's send buffer, the local rows): each view costs the host microseconds
                (dst if d0 == 0 and m == dst.shape[0] else dst.narrow(0, d0, m)).copy_(
                    src if s0 == 0 and m == src.shape[0] else src.narrow(0, s0, m))
            return
        copy_rows(dst, src, self.dst_t, self.src_t)

    def copy_pair(self, dst_a: torch.Tensor, src_a: torch.Tensor, dst_b: torch.Tensor, src_b: torch.Tensor) -> None:
        """``copy`` of two pairs (K and V) through this map, in one kernel launch where it is indexed."""
        if not self.indexed:
            self.copy(dst_a, src_a)
            self.copy(dst_b, src_b)
            return
        copy_row_pairs(dst_a, src_a, dst_b, src_b, self.dst_t, self.src_t)

    def gather(self, src: torch.Tensor) -> torch.Tensor:
        """The rows ``src[src_idx]`` as a new tensor, or as a view of ``src`` when they are one run (``src`` itself
        when that run is all of it; requires ``dst_idx`` None). Contiguous whenever ``src`` is."""
        if not self.gatherable:
            raise ValueError("gather needs a RowMap built with dst_idx None")
        if self.indexed:
            out = src.new_empty((self.n,) + tuple(src.shape[1:]))
            copy_rows(out, src, None, self.src_t)
            return out
        if len(self.runs) == 1:
            s0, m = self.runs[0][1], self.runs[0][2]
            return src if s0 == 0 and m == src.shape[0] else src.narrow(0, s0, m)  # a view op costs microseconds
        if not self.runs:
            return src[:0]
        return torch.cat([src[s0:s0 + m] for _, s0, m in self.runs])


def copy_pairs(moves, use_triton=None) -> None:
    """Each ``(map, dst_a, src_a, dst_b, src_b)`` of ``moves`` applied as ``map.copy_pair``; indexed maps go two
    to a kernel launch (``kernels.copy_row_pair_moves``), a one-run map joining an indexed one's launch on a GPU
    (alone it stays two slice copies): each launch costs the host tens of microseconds. ``use_triton``: as the
    kernels' (None: on CUDA tensors; True: the Triton kernels on the CPU too, under TRITON_INTERPRET in tests)."""
    launch, one, rest = [], [], []
    for m, da, sa, db, sb in moves:
        if m.n == 0:
            continue
        if m.indexed:
            launch.append((da, sa, db, sb, m.dst_t, m.src_t))
        elif len(m.runs) == 1 and (da.is_cuda if use_triton is None else use_triton):
            one.append((m, da, sa, db, sb))
        else:
            rest.append((m, da, sa, db, sb))
    while len(launch) % 2 and one:
        m, da, sa, db, sb = one.pop()
        d0, s0, c = m.runs[0]
        # its run through kept index tensors where it starts past row 0 (or covers part of its sources), not through
        # views of its four tensors: each view costs the host microseconds, the index's reads nothing to speak of
        di = m.run_index(d0, da) if d0 else None
        si = m.run_index(s0, sa) if s0 or (di is None and (c != sa.shape[0] or c != sb.shape[0])) else None
        launch.append((da, sa, db, sb, di, si))
    if launch:
        copy_row_pair_moves(launch, use_triton)
    for m, da, sa, db, sb in one + rest:
        m.copy_pair(da, sa, db, sb)

