"""The two general builders: a mask given block by block (``from_block_table`` with ``Block`` entries) and
the exact slices of any FlexAttention-style predicate (``from_mask_mod``).

Pictures in the docstrings: rows are queries (top = 0), columns are keys, ``#`` kept, ``.`` masked.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

from .slices import AttnMask, AttnSlice
from .trapezoids import as_numpy, causal_slices, check_int, trapezoid

__all__ = ["Block", "from_block_table", "from_mask_mod"]


class Block(IntEnum):
    """Entries of a block table (``from_block_table``): what a block keeps. Not the cell kinds of
    slices and tiles (``megatron_cp.kinds.Kind``), which code a whole trapezoid's shape."""

    EMPTY = 0
    FULL = 1
    CAUSAL = 2


EMPTY, FULL, CAUSAL = Block.EMPTY, Block.FULL, Block.CAUSAL  # this module's own shorthand


def from_block_table(table, block_size: int, seqlen_q: int | None = None, seqlen_k: int | None = None) -> AttnMask:
    """A mask given block by block: ``table[qb, kb]`` in {EMPTY=0, FULL=1, CAUSAL=2}.

    ``table``: 2-D int (or bool) list / numpy array / torch tensor ``[nqb, nkb]``. Block ``(qb, kb)``
    covers rows ``[qb*block_size, (qb+1)*block_size)`` and keys ``[kb*block_size, (kb+1)*block_size)``,
    truncated to ``seqlen_q`` / ``seqlen_k`` (default ``nqb*block_size`` / ``nkb*block_size``; a
    smaller value must still reach into the last block). FULL keeps the whole block; CAUSAL keeps
    ``j <= i + (sk - sq)`` in the block's local indices (bottom-right aligned on a truncated edge
    block). Horizontally adjacent FULL blocks become one slice, and a FULL run directly left of a
    CAUSAL block joins its causal slice. Table ``[[2, 0, 0], [1, 2, 0], [1, 0, 2]]``, block 3,
    seqlen 8 (the last block row and column hold 2 tokens)::

        #.......
        ##......
        ###.....
        ####....
        #####...
        ######..
        ###...#.
        ###...##
    """
    t = as_numpy(table)
    if t.ndim != 2 or t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"table must be a non-empty 2-D array [nqb, nkb], got shape {tuple(t.shape)}")
    if t.dtype == np.bool_:
        t = t.astype(np.int64)
    if not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"table must hold integers EMPTY=0, FULL=1, CAUSAL=2, got dtype {t.dtype}")
    bad = np.argwhere((t != EMPTY) & (t != FULL) & (t != CAUSAL))
    if len(bad):
        qb, kb = (int(x) for x in bad[0])
        raise ValueError(f"table[{qb}, {kb}] = {int(t[qb, kb])} is not EMPTY=0, FULL=1 or CAUSAL=2")
    bs = check_int("block_size", block_size, 1)
    nqb, nkb = t.shape
    sq = nqb * bs if seqlen_q is None else check_int("seqlen_q", seqlen_q, (nqb - 1) * bs + 1, nqb * bs)
    sk = nkb * bs if seqlen_k is None else check_int("seqlen_k", seqlen_k, (nkb - 1) * bs + 1, nkb * bs)

    # FULL runs per block row, found at once: rise / fall of the FULL indicator along each row
    isfull = np.zeros((nqb, nkb + 2), dtype=np.int8)
    isfull[:, 1:-1] = t == FULL
    edges = np.diff(isfull, axis=1)
    rs, cs = np.nonzero(edges == 1)
    _, ce = np.nonzero(edges == -1)  # same row order as the starts, exclusive end block
    runs = {(int(r), int(e)): int(s) for r, s, e in zip(rs, cs, ce)}  # (row, end block) -> start block

    slices = []
    for qb, kb in np.argwhere(t == CAUSAL).tolist():
        q0, q1 = qb * bs, min((qb + 1) * bs, sq)
        k0, k1 = kb * bs, min((kb + 1) * bs, sk)
        s = runs.get((qb, kb))
        # merging a FULL run [s, kb) into the causal slice keeps it exact iff the causal block's
        # first row keeps local key -1, i.e. (k1 - k0) - (q1 - q0) >= -1
        if s is not None and (k1 - k0) - (q1 - q0) >= -1:
            del runs[(qb, kb)]
            slices.append(AttnSlice((q0, q1), (s * bs, k1), "causal"))
        else:
            slices += causal_slices(q0, q1, k0, k1)
    for (qb, e), s in runs.items():
        slices.append(AttnSlice((qb * bs, min((qb + 1) * bs, sq)), (s * bs, min(e * bs, sk)), "full"))
    slices.sort(key=lambda x: (x.q_range, x.k_range))
    return AttnMask(slices, sq, sk)


# --------------------------------------------------------------------------------------------------
# arbitrary predicates


class _Open:
    """A trapezoid being grown row by row in ``from_mask_mod``."""

    __slots__ = ("q0", "rows", "lo", "hi", "lo_s", "hi_s", "last_lo", "last_hi")

    def __init__(self, q0, lo, hi):
        self.q0, self.rows, self.lo, self.hi = q0, 1, lo, hi
        self.lo_s = self.hi_s = None  # fixed by the second row
        self.last_lo, self.last_hi = lo, hi

    def slice(self) -> AttnSlice:
        return trapezoid(self.q0, self.q0 + self.rows, self.lo, self.hi, self.lo_s or 0, self.hi_s or 0)


def from_mask_mod(mask_mod, seqlen_q: int, seqlen_k: int | None = None, block: int = 128) -> AttnMask:
    """Exact slices of a FlexAttention-style predicate ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    ``mask_mod`` is called with torch tensors: ``b = h = torch.tensor(0)``, ``q_idx`` int64 ``[n, 1]``
    (one block of at most ``block`` rows), ``kv_idx`` int64 ``[1, seqlen_k]``; it returns a bool
    tensor broadcastable to ``[n, seqlen_k]`` (any device). The predicate must not depend on
    ``b``/``h`` (one row per block is evaluated again at ``b = h = 1``: a difference raises). Cost: ``seqlen_q * seqlen_k`` predicate evaluations (use a builder where one
    exists for long sequences), memory ``O(block * seqlen_k)``.

    Recovery, exact for any predicate: each row's kept keys split into maximal runs ``[lo, hi]``;
    a run continues the trapezoid of the previous row's run when its ends moved by 0 or 1 with the
    same slopes as before (the slopes are fixed by a trapezoid's second row), else it starts a new
    one. Trapezoids grow across row blocks, so the result does not depend on ``block``: fully kept
    or empty key blocks cost nothing extra, a causal predicate gives one slice, a sliding window
    three, a document mask one per document, and a row with several runs feeds several trapezoids.
    Each trapezoid becomes one slice of the kind of its slopes ((0,0) full, (0,1) causal,
    (1,0) inv_causal, (1,1) bi_causal). The mask ``(q*7 + kv*3) % 5 < 2`` on 8x8::

        #.#..#.#
        .#.#..#.
        ..#.#..#
        #..#.#..
        .#..#.#.
        #.#..#.#
        .#.#..#.
        ..#.#..#

    (six slices: each diagonal stripe is one bi_causal slice.)
    """
    import torch  # only this builder needs torch

    if not callable(mask_mod):
        raise ValueError(f"mask_mod must be callable, got {mask_mod!r}")
    sq = check_int("seqlen_q", seqlen_q, 1)
    sk = sq if seqlen_k is None else check_int("seqlen_k", seqlen_k, 1)
    bs = check_int("block", block, 1)

    zero, one = torch.tensor(0), torch.tensor(1)
    kv_idx = torch.arange(sk).view(1, sk)
    done: list[AttnSlice] = []
    open_: dict[int, _Open] = {}  # start key of the previous row's run -> its trapezoid
    for r0 in range(0, sq, bs):
        r1 = min(r0 + bs, sq)
        m = mask_mod(zero, zero, torch.arange(r0, r1).view(-1, 1), kv_idx)
        m = torch.as_tensor(m)
        if m.dtype != torch.bool:
            raise ValueError(f"mask_mod must return a bool tensor, got dtype {m.dtype}")
        try:
            m = torch.broadcast_to(m, (r1 - r0, sk))
        except RuntimeError:
            raise ValueError(
                f"mask_mod returned shape {tuple(m.shape)}, not broadcastable to {(r1 - r0, sk)}"
            ) from None
        # one row of each block again at b = h = 1: a predicate that reads b or h would otherwise be taken at
        # b = h = 0 for every head without a word (one extra row per block: a 1 / block share of the cost)
        alt = torch.as_tensor(mask_mod(one, one, torch.arange(r0, r0 + 1).view(1, 1), kv_idx))
        if not torch.equal(torch.broadcast_to(alt, (1, sk)).to(m.device), m[:1]):
            raise ValueError(f"mask_mod depends on b or h (row {r0} differs between b = h = 0 and b = h = 1): a mask "
                             "is the same for every batch entry and head; per-head selections are megatron_cp.sparse's "
                             "(selectors) and head gating's")
        dense = np.zeros((r1 - r0, sk + 2), dtype=np.int8)
        dense[:, 1:-1] = m.cpu().numpy()
        edges = np.diff(dense, axis=1)
        run_r, run_lo = np.nonzero(edges == 1)  # row-major, so the k-th start pairs with the k-th end
        run_hi = np.nonzero(edges == -1)[1] - 1  # inclusive
        row_ptr = np.searchsorted(run_r, np.arange(r1 - r0 + 1))
        run_lo, run_hi = run_lo.tolist(), run_hi.tolist()
        for t in range(r1 - r0):
            row = r0 + t
            nxt: dict[int, _Open] = {}
            for k in range(row_ptr[t], row_ptr[t + 1]):
                lo, hi = run_lo[k], run_hi[k]
                # previous-row runs are separated by a gap, so at most one starts at lo or lo - 1
                tr, dl = open_.pop(lo, None), 0
                if tr is None:
                    tr, dl = open_.pop(lo - 1, None), 1
                if tr is not None:
                    dh = hi - tr.last_hi
                    if dh in (0, 1) and (tr.lo_s is None or (tr.lo_s, tr.hi_s) == (dl, dh)):
                        tr.lo_s, tr.hi_s = dl, dh
                        tr.rows += 1
                        tr.last_lo, tr.last_hi = lo, hi
                        nxt[lo] = tr
                        continue
                    done.append(tr.slice())  # no other run of this row can continue it
                nxt[lo] = _Open(row, lo, hi)
            done.extend(tr.slice() for tr in open_.values())
            open_ = nxt
    done.extend(tr.slice() for tr in open_.values())
    done.sort(key=lambda x: (x.q_range, x.k_range))
    return AttnMask(done, sq, sk)
