"""Per-head block schedules for dynamic sparse attention (``BlockKeep``), built on the device per call.

The static schedules of a tile list (``triton_blocks.build_schedules``) are built on the host once per
block shape. A ``BlockKeep`` narrows them per query head: an entry (kernel q block, kernel k block) of
head ``h`` stays iff ``mask[h, q_block // r_q, k_block // r_k]`` (the kernel blocks divide the keep block,
so a kernel block lies inside one keep block and is either wholly selected or not; a full entry stays
full). Filtering keeps each block's entries in their static order (full ones first), so the CSR layout
of ``BlockSchedule`` carries over with a head axis of size Hq:

* every head's entry list is padded to the static entry count ``E`` (one extra column takes the dropped
  entries' scatter writes), so all shapes depend on the static list only, never on the selection;
* ``ptr``/``mid`` per head come from a cumulative sum of the kept flags, ``order`` from a per-head sort
  by the kept work (longest first).

Only torch ops on the device: nothing here reads a device value on the host (no synchronisation).
The host step, ``static_entries`` (which keep block each static entry lies in, and the static arrays in the
shapes the per-call step wants), is per (schedule, keep block, device) and cached by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .blocks import BlockSchedule, ColumnWork
from ..upload import upload


@dataclass
class StaticEntries:
    """What a per-head schedule needs of one single-head static schedule, on the device (built once per
    (schedule, keep block, device) by ``static_entries``; nothing in it depends on the selection).

    cells: int64 [E], each entry's flat keep-block index ``q_keep_block * nkb + k_keep_block``;
    bounds: int64 [2 * (nb + 1)], the static ptr then mid (padded by E): where each block's entries start;
    entries: int32 [2, E], each entry's token offset and tile id; nb: blocks along the major axis;
    work: the constant parts of one unsplit dK/dV work item per k block (seg 0, nseg 1, slot -1, and
    empty reduce lists), column-major schedules only, else None."""

    cells: torch.Tensor
    bounds: torch.Tensor
    entries: torch.Tensor
    nb: int
    work: tuple | None


def static_entries(sched: BlockSchedule, major_block: int, keep_block: int, n_keep_k: int, rows: bool,
                   device) -> StaticEntries:
    """StaticEntries of a single-head static schedule ``sched`` (any device; built on the host side once).

    rows: ``sched`` is row-major (major axis = q blocks of ``major_block`` rows, ``off`` = k token offsets);
    else column-major (major axis = k blocks of ``major_block`` keys, ``off`` = q token offsets)."""
    ptr = sched.ptr[0].long().cpu()
    mid = sched.mid[0].long().cpu()
    off = sched.off[0].cpu()
    counts = ptr[1:] - ptr[:-1]
    major = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    major_kb = (major * major_block) // keep_block
    minor_kb = off.long() // keep_block
    qb, kb = (major_kb, minor_kb) if rows else (minor_kb, major_kb)
    nb = mid.numel()
    bounds = torch.cat([ptr, mid, ptr[-1:]])
    entries = torch.stack([off, sched.tile[0].cpu()]).to(torch.int32)
    work = None
    if not rows:
        zero = torch.zeros(nb, dtype=torch.int32, device=device)
        none = torch.zeros(0, dtype=torch.int32, device=device)
        work = (zero, zero + 1, zero - 1, none)
    return StaticEntries(upload(qb * n_keep_k + kb, device), upload(bounds, device), upload(entries, device), nb, work)


def head_schedule(st: StaticEntries, mask: torch.Tensor, n_full: int = 0, n_partial: int = 0) -> BlockSchedule:
    """The static schedule of ``st`` narrowed per head by ``mask`` bool [Hq, nqb, nkb] (on st's device).

    Returns a BlockSchedule with a head axis of Hq: ptr int32 [Hq, nb + 1], mid and order int32 [Hq, nb],
    views of one [Hq, 3, nb + 1] buffer (one row stride for all three: the kernels take one
    ``sched_stride_b``); off and tile int32 [Hq, E + 1], views of one [Hq, 2, E + 1] buffer (entries past a
    head's count are padding, never read). Column-major schedules get one dK/dV work item per k block
    (``ColumnWork`` without splitting), heaviest first by the kept entries of all heads. n_full / n_partial
    (the static counts, upper bounds) are passed through; n_busy is left unknown (-1): it would need the
    host, and only accumulating launches use it."""
    hq = mask.shape[0]
    dev = mask.device
    e, nb = st.cells.numel(), st.nb
    kept = mask.reshape(hq, mask.shape[1] * mask.shape[2]).index_select(1, st.cells)  # [Hq, E]
    # csum[h, x]: kept entries of head h before static entry x (exclusive prefix sum, [Hq, E + 1])
    csum = torch.nn.functional.pad(kept.cumsum(1), (1, 0))
    pmo = torch.empty(hq, 3, nb + 1, dtype=torch.int32, device=dev)
    pmo[:, :2] = csum.gather(1, st.bounds.expand(hq, -1)).view(hq, 2, nb + 1)
    ptr, mid, order = pmo[:, 0], pmo[:, 1, :nb], pmo[:, 2, :nb]
    # heaviest first, as the static schedule: cost 4 per full entry, 5 per partial (mask arithmetic);
    # ascending 4 * p0 + mid - 5 * p1 = -(4 * fulls + 5 * partials)
    key = (ptr[:, :nb] * 4 + mid) - ptr[:, 1:] * 5
    order.copy_(torch.argsort(key, dim=1, stable=True))
    # kept entries move to their compacted positions, dropped ones all to the spare last column
    pos = torch.where(kept, csum[:, 1:] - 1, e)
    ot = torch.zeros(hq, 2, e + 1, dtype=torch.int32, device=dev)
    ot.scatter_(2, pos.unsqueeze(1).expand(hq, 2, e), st.entries.expand(hq, 2, e))
    work = None
    if st.work is not None:
        zero, one, minus, none = st.work
        n = torch.argsort(key.sum(0), stable=True).to(torch.int32)
        work = ColumnWork(n, zero, one, minus, none, none, none, 0)
    return BlockSchedule(ptr, mid, order, ot[:, 0], ot[:, 1], n_full, n_partial, work)


def kernel_blocks(block_m: int, block_n: int, keep_block: int) -> tuple[int, int]:
    """(block_m, block_n) reduced, where needed, to the largest power of two that divides ``keep_block``
    (a kernel block must lie inside one keep block); ValueError when that is below 16 (``tl.dot``'s
    smallest block)."""
    out = []
    for b in (block_m, block_n):
        while b >= 16 and keep_block % b:
            b //= 2
        if b < 16:
            raise ValueError(f"BlockKeep.block={keep_block} must be a multiple of 16 for the Triton kernels "
                             f"(their blocks {block_m}x{block_n} must divide it)")
        out.append(b)
    return out[0], out[1]
