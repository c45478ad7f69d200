"""Block schedules for the Triton kernels: which (q block, k block, tile) triples to visit.

Built once per tile list on the host (``TritonBackend.prepare``), kept as int32 tensors on the device.

Every tile ``(q_start, q_end, k_start, k_end, kind)`` is a rectangle intersected with a diagonal band
on ``d = k - q`` (global indices)::

    FULL       : -inf <= d <= +inf
    CAUSAL     : d <= k_end - q_end                  (j <= i + sk - sq, bottom-right aligned)
    INV_CAUSAL : d >= k_start - q_start              (j >= i, top-left aligned)
    BI_CAUSAL  : k_start - q_start <= d <= k_end - q_end

so one descriptor ``(qs, qe, ks, ke, lo, hi)`` per tile lets the kernels mask any kind with the same
six comparisons. A (q block, k block) pair met by a tile is

* *full*    when the block lies inside the tile's rectangle and band: no mask arithmetic at all;
* *partial* when the tile keeps some but not all of its cells: the kernel applies the descriptor;
* *empty*   when the tile keeps none of its cells: it is not listed, so never visited.

Because tiles are cell-disjoint, a block that is full for one tile meets no other tile; a partial
block may be listed once per tile meeting it (the kernels merge them by online softmax).

Row-major schedule (forward and dQ), per q block ``m``: entries ``ptr[m] : ptr[m+1]``, the full ones
first (``ptr[m] : mid[m]``), each entry holding the k token offset of its block and its tile id.
Column-major schedule (dK/dV), per k block ``n``: the transpose, holding q token offsets.
``order`` lists blocks heaviest first so that long rows start early (longest-processing-time first);
blocks with no entry come last (``n_busy`` of them are not), so a launch that must leave untouched
rows as they are (an accumulating forward) runs over ``order[:n_busy]`` only.

Every array has a leading head axis (size 1 here: all heads share one schedule); the kernels take its
stride, so per-head block lists (dynamic sparse attention, ``triton_sparse.head_schedule``) run on the same
kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..tiles import BI_CAUSAL, CAUSAL, INV_CAUSAL

_BIG = 1 << 30  # "no band limit"; |k - q| < 2^30 for every supported length


class _HostArrays:
    """Pickled (the planning helper's answers) with their host tensors as arrays: a tensor unpickles an order of
    magnitude slower, in the planning thread, holding the GIL the step needs."""

    def __getstate__(self) -> dict:
        return {k: v.numpy() if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v
                for k, v in self.__dict__.items()}

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update({k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in d.items()})


@dataclass
class BlockSchedule(_HostArrays):
    """One direction's block lists for a fixed (block_m, block_n).

    ptr [H, nb+1], mid [H, nb], order [H, nb]: int32 (nb = number of blocks along the major axis);
    off [H, E] int32 token offset of the minor block; tile [H, E] int32 descriptor row. H is 1 here (Hq in
    ``triton_sparse.head_schedule``).
    """

    ptr: torch.Tensor
    mid: torch.Tensor
    order: torch.Tensor
    off: torch.Tensor
    tile: torch.Tensor
    n_full: int
    n_partial: int
    work: "ColumnWork | None" = None  # column-major schedules only
    n_busy: int = -1  # blocks with at least one entry: ``order[:n_busy]`` (empty blocks sort last)

    def arrays(self) -> list:
        """Its tensors in ``placed``'s order (the work items' after the schedule's)."""
        return [self.ptr, self.mid, self.order, self.off, self.tile] + ([] if self.work is None else self.work.arrays())

    def placed(self, t: list) -> "BlockSchedule":
        """This schedule with the tensors ``t`` (``arrays()`` moved, e.g. by ``upload_all``) in place of its own."""
        work = None if self.work is None else self.work.placed(t[5:])
        return BlockSchedule(*t[:5], self.n_full, self.n_partial, work, self.n_busy)


@dataclass
class ColumnWork(_HostArrays):
    """dK/dV work items: k block ``n[i]``, segment ``seg[i]`` of ``nseg[i]`` equal parts of its entry list.

    A k block met by many more q blocks than average (global keys, attention sinks) would make one program
    run far longer than the rest; it is cut into segments whose programs write fp32 partials to workspace
    slot ``slot[i]`` (-1: unsplit, written directly), summed afterwards in a fixed order by
    ``red_*`` (k block, first slot, number of slots): still deterministic. Items are heaviest first.
    """

    n: torch.Tensor
    seg: torch.Tensor
    nseg: torch.Tensor
    slot: torch.Tensor
    red_n: torch.Tensor
    red_slot0: torch.Tensor
    red_nseg: torch.Tensor
    n_slots: int

    def arrays(self) -> list:
        return [self.n, self.seg, self.nseg, self.slot, self.red_n, self.red_slot0, self.red_nseg]

    def placed(self, t: list) -> "ColumnWork":
        return ColumnWork(*t[:7], self.n_slots)


def column_work(ptr: np.ndarray, min_segment: int = 16, imbalance: float = 2.0) -> ColumnWork:
    """Split k blocks with more than ``imbalance`` x the mean entries (and > min_segment) into segments."""
    counts = (ptr[1:] - ptr[:-1]).astype(np.int64)
    nn = counts.size
    mean = float(counts.sum()) / max(nn, 1)
    seg_len = max(min_segment, int(imbalance * mean) + 1)
    nseg = np.maximum((counts + seg_len - 1) // seg_len, 1)
    n = np.repeat(np.arange(nn), nseg)
    first = np.repeat(np.cumsum(nseg) - nseg, nseg)
    seg = np.arange(n.size) - first
    ns = nseg[n]
    split = ns > 1
    slot = np.full_like(n, -1)
    slot[split] = np.arange(int(split.sum()))
    red_n = np.flatnonzero(nseg > 1)
    red_nseg = nseg[red_n]
    red_slot0 = np.cumsum(red_nseg) - red_nseg
    per_item = counts[n].astype(np.float32) / ns.astype(np.float32)  # float32: the order ties break as before
    order = np.argsort(-per_item, kind="stable")
    return ColumnWork(_i32(n[order]), _i32(seg[order]), _i32(ns[order]), _i32(slot[order]), _i32(red_n),
                      _i32(red_slot0), _i32(red_nseg), int(split.sum()))


def _np(x) -> np.ndarray:
    return (x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)).astype(np.int64, copy=False)


def _i32(x: np.ndarray, lead: bool = False) -> torch.Tensor:
    x = np.ascontiguousarray(x, dtype=np.int32)
    return torch.from_numpy(x[None] if lead else x)


def _descriptors(tiles) -> np.ndarray:
    t = _np(tiles).reshape(-1, 5)
    qs, qe, ks, ke, kind = t.T
    upper = (kind == CAUSAL) | (kind == BI_CAUSAL)
    lower = (kind == INV_CAUSAL) | (kind == BI_CAUSAL)
    hi = np.where(upper, ke - qe, _BIG)
    lo = np.where(lower, ks - qs, -_BIG)
    return np.stack([qs, qe, ks, ke, lo, hi], 1)


def tile_descriptors(tiles) -> torch.Tensor:
    """tiles int [n, 5] -> descriptors int64 [n, 6] = (qs, qe, ks, ke, lo, hi) with lo <= k - q <= hi."""
    return torch.from_numpy(_descriptors(tiles))


def _block_pairs(desc: np.ndarray, block_m: int, block_n: int):
    if desc.shape[0] == 0:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e, np.zeros(0, dtype=bool)
    qs, qe, ks, ke, lo, hi = desc.T
    # 1) (tile, m) pairs over each tile's q blocks
    m0, m1 = qs // block_m, (qe - 1) // block_m + 1
    cnt = m1 - m0
    tid = np.repeat(np.arange(desc.shape[0]), cnt)
    first = np.repeat(np.cumsum(cnt) - cnt, cnt)
    m = np.repeat(m0, cnt) + np.arange(tid.size) - first
    # rows of this block inside the tile
    r0 = np.maximum(qs[tid], m * block_m)
    r1 = np.minimum(qe[tid], (m + 1) * block_m) - 1
    # keys a kept cell can have for these rows: ks..ke-1 and r0+lo..r1+hi
    c0 = np.maximum(ks[tid], r0 + np.maximum(lo[tid], -_BIG))
    c1 = np.minimum(ke[tid] - 1, r1 + hi[tid])
    keep = c1 >= c0
    tid, m, c0, c1 = tid[keep], m[keep], c0[keep], c1[keep]
    # 2) expand to (tile, m, n) over those key blocks
    n0, n1 = c0 // block_n, c1 // block_n + 1
    cnt = n1 - n0
    idx = np.repeat(np.arange(tid.size), cnt)
    first = np.repeat(np.cumsum(cnt) - cnt, cnt)
    n = n0[idx] + np.arange(idx.size) - first
    tid, m = tid[idx], m[idx]
    qs, qe, ks, ke, lo, hi = desc[tid].T
    bq0, bq1 = m * block_m, (m + 1) * block_m - 1  # inclusive block bounds
    bk0, bk1 = n * block_n, (n + 1) * block_n - 1
    # exact emptiness on the clipped rectangle: some q in [a0,a1], k in [b0,b1] with lo <= k-q <= hi
    a0, a1 = np.maximum(qs, bq0), np.minimum(qe - 1, bq1)
    b0, b1 = np.maximum(ks, bk0), np.minimum(ke - 1, bk1)
    nonempty = (a1 >= a0) & (b1 >= b0) & (b1 - a0 >= lo) & (b0 - a1 <= hi)
    full = (qs <= bq0) & (qe - 1 >= bq1) & (ks <= bk0) & (ke - 1 >= bk1) & (bk0 - bq1 >= lo) & (bk1 - bq0 <= hi)
    s = nonempty
    return tid[s], m[s], n[s], full[s]


def block_pairs(desc, block_m: int, block_n: int):
    """All non-empty (tile, m, n) triples with a full flag; int64 1-D tensors (bool for the flag)."""
    return tuple(torch.from_numpy(np.ascontiguousarray(x)) for x in _block_pairs(_np(desc).reshape(-1, 6),
                                                                                  block_m, block_n))


def _csr(major, minor_off, tid, full, n_major) -> BlockSchedule:
    """Sort entries by (major, partial, minor) and build the CSR arrays with a leading head axis."""
    key = (major * 2 + (~full).astype(np.int64)) * (1 << 32) + minor_off  # full entries first within a block
    perm = np.argsort(key, kind="stable")
    major, minor_off, tid, full = major[perm], minor_off[perm], tid[perm], full[perm]
    counts = np.bincount(major, minlength=n_major)
    fulls = np.bincount(major[full], minlength=n_major)
    ptr = np.zeros(n_major + 1, dtype=np.int64)
    ptr[1:] = np.cumsum(counts)
    mid = ptr[:-1] + fulls
    # heaviest first; partial blocks cost a little more (mask arithmetic)
    cost = fulls * 4 + (counts - fulls) * 5
    order = np.argsort(-cost, kind="stable")
    return BlockSchedule(_i32(ptr, True), _i32(mid, True), _i32(order, True), _i32(minor_off, True),
                         _i32(tid, True), int(full.sum()), int((~full).sum()), n_busy=int((counts > 0).sum()))


def build_schedules(tiles, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
                    split_min_segment: int = 16):
    """Row-major (per q block) and column-major (per k block) schedules for blocks (block_m, block_n);
    the column schedule's dK/dV work items split long columns (``column_work``). Built with numpy (small
    arrays: a torch op's dispatch cost more than its work).

    Returns (rows: BlockSchedule, cols: BlockSchedule) on the CPU.
    """
    tid, m, n, full = _block_pairs(_descriptors(tiles), block_m, block_n)
    nm = (seqlen_q + block_m - 1) // block_m
    nn = (seqlen_k + block_n - 1) // block_n
    rows = _csr(m, n * block_n, tid, full, nm)
    cols = _csr(n, m * block_m, tid, full, nn)
    cols.work = column_work(cols.ptr[0].numpy(), split_min_segment)
    return rows, cols
