"""XAttention: block-sparse attention with antidiagonal scoring (Xu et al. 2025, "XAttention: Block Sparse
Attention with Antidiagonal Scoring", arXiv:2503.16428). Published defaults: block 128, stride 8 (16 also
used), threshold 0.9 (per-head thresholds supported).

Estimate: inside each ``stride x stride`` sub-block of the score matrix only one antidiagonal is summed,
score(i', j') = sum_s q[i'S + S-1-s] . k[j'S + s] (S = stride), i.e. the dot product of the reversed
stacked queries of row group i' with the stacked keys of key group j'; times softmax_scale / S. A row
softmax over the reduced row (every key group of the row, masked to the envelope) gives each reduced
cell a probability; summed per block pair and over the q block's reduced rows it is the block's mass.
Per q block, the smallest set of key blocks (descending mass) whose normalised cumulative mass reaches
``threshold`` is kept, plus the first envelope block of the row (the attention sink of the paper's block
0) and the diagonal block.

Envelope: full block pairs keep every reduced cell, partial ones keep cell (i', j') iff the static mask
keeps (i'S + S - 1, j'S) (the antidiagonal's corner next to the diagonal), empty ones none.

Departures from the paper, and why: the mask is any static envelope (packed documents, windows), not
only causal, hence the sampled-corner rule above and "first envelope block" for the paper's block 0; a
reduced row with no kept cell (possible inside short documents) counts 0, and a q block with no mass at
all keeps every envelope block (the threshold is never reached: dense is the safe answer); the scores
are float32 (the paper's kernel keeps the input precision) so that the selection of bf16 inputs does not
hinge on the rounding of the scores. On CUDA the estimate is one Triton kernel (scores, envelope, softmax and
block sums of a q block in registers: ``kernels.antidiagonal_mass``), elsewhere PyTorch operations in chunks of
q blocks (the unfused scores cost more than dense attention's forward at 128k causal: docs/measurements.md).

Work (PyTorch path): a chunk of ``chunk_blocks`` global q blocks is scored only against the key blocks its rows' envelope
spans (``SelectionView.block_spans``, rounded up to ``GRANULE`` blocks): about half the key axis under a
causal mask, a document's keys under packed documents (scoring every chunk against the whole sequence
cost 43x dense attention's forward on packed documents at 256k: docs/measurements.md).

Context parallelism: the estimate reads every key of a row (``view.envelope_keys()``, a dense K exchange
done by the runtime). A chunk is fixed by the global q block ids (g * c ..), its key span by the mask, so
its shapes depend on the selector and the mask alone; a rank fills the rows of its own blocks (the others
zero, dropped). Every reduction (softmax max and normaliser, block sums, cumulative mass) therefore runs on
the same shapes and values whatever the layout: a q block's selection is bit-identical on every CP size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..kernels import accumulate_dtype, antidiagonal_mass, fused_mass_supported, upload
from .moba import tree_sum
from .selector import check_block, check_fraction, check_heads
from .view import SelectionView


def envelope_cells(view: SelectionView, rows: torch.Tensor, stride: int, col0: int = 0,
                   col1: int | None = None) -> torch.Tensor:
    """bool [R, col1 - col0]: the reduced cells (row group of sample row ``rows[r]``, key group j') the
    envelope keeps: ``view.keeps(rows[r], j' * stride)`` for every j' in [col0, col1) (default: every key
    group, nb * B / stride), evaluated from ``view.traps`` without a host synchronisation. rows: long [R]
    global positions (any value, e.g. -1, keeps nothing).

    Each trap keeps, in row i, the keys [lo, hi) = [lo_a + lo_s i, hi_a + hi_s i): key group j' is kept iff
    ceil(lo / S) <= j' < ceil(hi / S). The intervals are written as +1 / -1 into a difference array and
    summed along the row (integers: exact), O(traps x R + R x cells)."""
    col1 = view.seqlen // stride if col1 is None else col1
    ncols = col1 - col0
    t = view.traps.to(rows.device)
    q0, q1, lo_a, lo_s, hi_a, hi_s = (c[:, None] for c in t.unbind(1))
    i = rows[None, :]
    inr = (i >= q0) & (i < q1)  # [nt, R]
    c0 = (-torch.div(-(lo_a + lo_s * i), stride, rounding_mode="floor")).clamp(col0, col1) - col0
    c1 = (-torch.div(-(hi_a + hi_s * i), stride, rounding_mode="floor")).clamp(col0, col1) - col0
    w = (inr & (c1 > c0)).to(torch.int32)
    diff = torch.zeros(rows.numel(), ncols + 1, dtype=torch.int32, device=rows.device)
    diff.scatter_add_(1, c0.T.contiguous(), w.T.contiguous())
    diff.scatter_add_(1, c1.T.contiguous(), -w.T.contiguous())
    return diff.cumsum(1)[:, :ncols] > 0


def exclusive_prefix_sum(x: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum along the last dim by Hillis-Steele doubling (elementwise adds): the order of
    additions depends only on the length of the last dim, not on the other dims or the device."""
    n = x.shape[-1]
    y = torch.cat([torch.zeros_like(x[..., :1]), x[..., :-1]], -1)
    step = 1
    while step < n:
        y = torch.cat([y[..., :step], y[..., step:] + y[..., :-step]], -1)
        step *= 2
    return y


def scores(qm: torch.Tensor, kt: torch.Tensor, alpha: float, dtype: torch.dtype) -> torch.Tensor:
    """alpha * qm @ kt in ``dtype``: qm [b, m, k], kt [b, k, n]. Half-precision inputs on CUDA write float32
    straight from the GEMM (``out_dtype``, no rounding of the scores to half precision); elsewhere the
    product is in the inputs' dtype, then converted."""
    shape = (qm.shape[0], qm.shape[1], kt.shape[2])
    if qm.is_cuda and qm.dtype in (torch.float16, torch.bfloat16) and dtype == torch.float32:
        try:
            return torch.baddbmm(torch.empty(shape, dtype=dtype, device=qm.device), qm, kt, beta=0, alpha=alpha,
                                 out_dtype=dtype)
        except (RuntimeError, TypeError):  # a PyTorch without baddbmm(out_dtype=)
            pass
    out = torch.baddbmm(torch.empty(shape, dtype=qm.dtype, device=qm.device), qm, kt, beta=0, alpha=alpha)
    return out.to(dtype)


def partial_cells(traps: np.ndarray, q_blocks: np.ndarray, envelope: np.ndarray, block: int, stride: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The envelope per reduced cell for the fused masses (host, once per layout): slot int32 [nq, nb] (-1 full
    block pair, -2 empty, else the pair's index P) and bits int32 [P, NR, words] (bit c of word c // 32 of row r:
    the envelope keeps (sample row r, key group jb NR + c), the rule of ``envelope_cells``). q_blocks: global ids
    of the local q blocks; envelope int8 [nq, nb] (``SelectionView.envelope``). Each trap is checked only against
    the partial pairs of the q blocks its rows cross."""
    nr = block // stride
    env = np.asarray(envelope)
    pi, pj = np.nonzero(env == 1)
    slot = np.where(env == 2, -1, -2).astype(np.int32)
    slot[pi, pj] = np.arange(len(pi), dtype=np.int32)
    words = -(-nr // 32)
    kept = np.zeros((len(pi), nr, nr), dtype=bool)
    gq = np.asarray(q_blocks, dtype=np.int64)[pi]
    order = np.argsort(gq, kind="stable")
    sorted_q = gq[order]
    rows_in = np.arange(nr, dtype=np.int64) * stride + stride - 1
    cols_in = np.arange(nr, dtype=np.int64) * stride
    for q0, q1, lo_a, lo_s, hi_a, hi_s in np.asarray(traps, dtype=np.int64).reshape(-1, 6).tolist():
        if q1 <= q0:
            continue
        a, b = np.searchsorted(sorted_q, q0 // block), np.searchsorted(sorted_q, (q1 - 1) // block, side="right")
        if a >= b:
            continue
        idx = order[a:b]
        r = (gq[idx, None] * block + rows_in[None])[:, :, None]  # [n, NR, 1] sample rows
        k = (pj[idx, None] * block + cols_in[None])[:, None, :]  # [n, 1, NR] first key of each group
        kept[idx] |= (r >= q0) & (r < q1) & (k >= lo_a + lo_s * r) & (k < hi_a + hi_s * r)
    bits = np.zeros((max(len(pi), 1), nr, words), dtype=np.int64)
    for w in range(words):
        seg = kept[:, :, 32 * w:32 * (w + 1)].astype(np.int64)
        bits[:len(pi), :, w] = (seg << np.arange(seg.shape[-1], dtype=np.int64)).sum(-1)
    return slot, bits.astype(np.uint32).view(np.int32)


GRANULE = 16  # key blocks: a chunk's span is rounded up to a multiple (few distinct shapes, little waste)


@dataclass(frozen=True)
class XAttention:
    """XAttention selector (see the module doc).

    ``block``: tokens per block (default 128); ``stride``: antidiagonal stride S, a divisor of ``block``
    (default 8); ``threshold``: cumulative block mass to reach, a number in (0, 1] or one per query head
    (a sequence of Hq numbers; stored as a tuple); ``chunk_elements``: bound on the elements of one chunk's
    reduced score tensor [Hq, rows, S / stride] (memory only: the chunk size derived from it is the same
    on every rank, so it never breaks exactness).
    """

    block: int = 128
    stride: int = 8
    threshold: float | tuple[float, ...] = 0.9
    chunk_elements: int = 1 << 26
    name: ClassVar[str] = "xattention"

    def __post_init__(self):
        th = self.threshold
        if not isinstance(th, (int, float, str, bytes)) and hasattr(th, "__len__"):
            object.__setattr__(self, "threshold", tuple(th))  # hashable and immutable like the dataclass
        # what needs no shapes is refused when the selector is made, not at its first call
        check_block("XAttention", self.block, self.block if isinstance(self.block, int) else 1)
        s = self.stride
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"XAttention: stride must be a positive int, got {s!r}")
        if self.block % s:
            raise ValueError(f"XAttention: stride {s} must divide block {self.block}")
        for x in self.threshold if isinstance(self.threshold, tuple) else (self.threshold,):
            check_fraction("XAttention", "threshold", x)
        c = self.chunk_elements
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"XAttention: chunk_elements must be a positive int, got {c!r}")

    def check(self, num_q_heads: int, num_kv_heads: int, head_dim: int, seqlen: int) -> None:
        """ValueError naming the bad value (block, stride, threshold, chunk_elements, head counts)."""
        self.__post_init__()
        check_block("XAttention", self.block, seqlen)
        check_heads("XAttention", num_q_heads, num_kv_heads, head_dim)
        th = self.threshold
        if isinstance(th, tuple) and len(th) != num_q_heads:
            raise ValueError(f"XAttention: per-head threshold needs one value per query head ({num_q_heads}), "
                             f"got {len(th)}: {th!r}")

    def chunk_blocks(self, num_q_heads: int, width: int) -> int:
        """q blocks per chunk whose scores against ``width`` key blocks fit ``chunk_elements``, at most
        ``GRANULE`` (a chunk is scored against its rows' key span: short chunks follow documents closely).
        ``select`` passes the mask's widest span: the same on every rank."""
        nr = self.block // self.stride
        per_block = num_q_heads * nr * width * nr
        return max(1, min(width, GRANULE, self.chunk_elements // per_block))

    def thresholds(self, num_q_heads: int, dtype: torch.dtype, device) -> torch.Tensor:
        """[Hq] thresholds in ``dtype``."""
        th = self.threshold
        vals = list(th) if isinstance(th, tuple) else [th] * num_q_heads
        return upload(torch.tensor([float(x) for x in vals], dtype=dtype), device)  # no wait for the stream

    @staticmethod
    def _choose(mass: torch.Tensor, env: torch.Tensor, q_blocks: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
        """keep bool [Hq, n, w] from the block masses [Hq, n, w] of w key blocks, env bool [n, w], the column of
        each q block's own block [n] and the thresholds [Hq, 1, 1]: per (head, q block) the fewest envelope blocks, by descending
        normalised mass (ties: lower id), whose mass reaches the threshold (all of them if it is never
        reached, e.g. no mass at all), plus the row's first envelope block and the diagonal one."""
        nb = mass.shape[-1]
        tot = tree_sum(mass, -1)[..., None]
        frac = torch.where((tot > 0) & env[None], mass / torch.where(tot > 0, tot, 1), 0)
        order = torch.sort(torch.where(env[None], -frac, float("inf")), dim=-1, stable=True).indices
        before = exclusive_prefix_sum(frac.gather(-1, order))  # mass of the blocks before each, in that order
        keep = torch.zeros(mass.shape, dtype=torch.bool, device=mass.device).scatter_(-1, order, before < thr)
        col = torch.arange(nb, device=mass.device)[None]
        first = col == env.to(torch.int8).argmax(-1, keepdim=True)  # first envelope block of the row
        diag = col == q_blocks[:, None]
        return (keep | (first | diag)[None]) & env[None]

    def select(self, q: torch.Tensor, k: torch.Tensor, view: SelectionView) -> torch.Tensor:
        """q [nq*B, Hq, D], k [nq*B, Hkv, D] (this rank's blocks, local order) -> keep bool [Hq, nq, nb].

        K of the row comes from ``view.envelope_keys()`` (k itself is not needed beyond it). On CUDA the
        masses come from one Triton kernel (``masses_fused``), elsewhere from PyTorch operations in chunks
        (``masses``); the selection from them is the same code."""
        if view.envelope_keys is None:
            raise ValueError("XAttention: the view has no envelope_keys (K of the rows' envelope is needed)")
        if q.is_cuda and fused_mass_supported(q, self.block, self.stride):
            mass = self.masses_fused(q, view)
        else:
            mass = self.masses(q, view)
        return self.choose(mass, view)

    def masses_fused(self, q: torch.Tensor, view: SelectionView) -> torch.Tensor:
        """Block masses float32 [Hq, nq, nb] from the Triton kernel (``kernels.antidiagonal_mass``): scores,
        envelope, row softmax and block sums without materialising the scores. Each q block's masses are
        reduced in an order fixed by global positions: the same bits on every layout (not those of ``masses``:
        another order of additions). The envelope's partial cells are derived once per layout
        (``partial_cells``, kept in ``view.cache``)."""
        b, st = self.block, self.stride
        nb, d = view.num_blocks, q.shape[2]
        dev = q.device
        key = ("xattention cells", b, st, str(dev))
        cells = view.cache.get(key)
        if cells is None:
            q_host = view.q_blocks_host()
            slot, bits = partial_cells(view.host_traps(), q_host, view.host_envelope().numpy(), b, st)
            span = view.block_spans()[q_host].astype(np.int32)
            cells = view.cache[key] = tuple(upload(x, dev) for x in (slot, bits, span))
        ids, keys = view.envelope_keys()
        kg = torch.zeros(nb, b, *keys.shape[2:], dtype=q.dtype, device=dev)
        kg[ids] = keys.to(q.dtype)
        return antidiagonal_mass(q, kg.view(nb * b, *keys.shape[2:]), *cells, nb, b, st, 1.0 / (d ** 0.5) / st)

    def masses(self, q: torch.Tensor, view: SelectionView) -> torch.Tensor:
        """Block masses [Hq, nq, nb] (float32; float64 for float64 q) by PyTorch operations on chunks of q
        blocks (module doc: a chunk's shapes are fixed by the mask, so the values are the same on every layout).
        Peak extra memory: the reduced keys (a copy of K, S x Hkv x D) plus about 2 x ``chunk_elements``
        float32 (scores and probabilities of one chunk); about 0.8 GiB at Hq 32, Hkv 8, D 128, S 128k."""
        b, st = self.block, self.stride
        nr, nb = b // st, view.num_blocks
        ncols = nb * nr
        nq, hq, d = view.q_blocks.numel(), q.shape[1], q.shape[2]
        ids, keys = view.envelope_keys()
        hkv = keys.shape[2]
        g = hq // hkv
        dev, mdt, adt = q.device, q.dtype, accumulate_dtype(q.dtype)

        # reduced keys [Hkv, ncols, S*D] over the global key axis: zeros where no local row looks
        ks = torch.zeros(hkv, nb, nr, st, d, dtype=mdt, device=dev)
        ks[:, ids] = keys.reshape(-1, nr, st, hkv, d).permute(3, 0, 1, 2, 4).to(mdt)  # no staging copy of K
        kt = ks.view(hkv, ncols, st * d).transpose(1, 2)  # [Hkv, S*D, ncols]

        qr = q.reshape(nq, nr, st, hq, d)
        scale = 1.0 / (d ** 0.5) / st
        spans = view.block_spans()
        # chunk length from the widest span the mask has (a function of the mask: the same on every rank), so
        # short documents take long chunks and few kernel launches within the memory bound
        widest = int((spans[:, 1] - spans[:, 0]).max(initial=1))
        c = self.chunk_blocks(hq, min(nb, -(-widest // GRANULE) * GRANULE))
        sub = torch.arange(nr, device=dev) * st + st - 1  # sample row of each row group, within a block
        rev = torch.arange(st - 1, -1, -1, device=dev)
        mass = torch.zeros(hq, nq, nb, dtype=adt, device=dev)
        # chunks of c global q blocks (block ids g*c ..): each chunk's rows are scored against the key blocks its
        # envelope spans (rounded up to GRANULE blocks), so a chunk's shapes, and with them every value below, are
        # the same on every layout; a rank fills the rows of its own blocks and leaves the others zero (their
        # rows keep nothing and are dropped). Packed documents score a document's keys, not the sequence's.
        local = view.q_blocks_host()
        chunk = local // c
        order = np.argsort(chunk, kind="stable")  # local blocks grouped by chunk, one upload for every chunk
        ends = np.cumsum(np.bincount(chunk, minlength=-(-nb // c)))
        both = upload(np.concatenate([order, local[order] - chunk[order] * c]), dev)
        for gi in np.unique(chunk).tolist():
            g0 = gi * c
            sp = spans[g0:min(nb, g0 + c)]
            sp = sp[sp[:, 1] > sp[:, 0]]
            if not len(sp):
                continue  # no row of the chunk keeps a key: their masses stay 0
            lo, hi = int(sp[:, 0].min()), int(sp[:, 1].max())
            w = min(nb, -(-(hi - lo) // GRANULE) * GRANULE)
            start = min(lo, nb - w)
            a0, a1 = (int(ends[gi - 1]) if gi else 0), int(ends[gi])
            sel, pos = both[a0:a1], both[nq + a0:nq + a1]
            qc = torch.zeros(c, nr, st, hq, d, dtype=qr.dtype, device=dev)
            qc[pos] = qr.index_select(0, sel).index_select(2, rev)  # reversed in each row group: the antidiagonal
            qm = qc.permute(3, 0, 1, 2, 4).reshape(hkv, g * c * nr, st * d)
            sc = scores(qm, kt[:, :, start * nr:(start + w) * nr], scale, adt).view(hq, c * nr, w * nr)
            del qm, qc
            env = torch.zeros(c, w, dtype=view.envelope.dtype, device=dev)
            env[pos] = view.envelope.index_select(0, sel)[:, start:start + w]
            er = env.repeat_interleave(nr, 0)[:, :, None]  # [c*nr, w, 1]
            blocks = g0 + torch.arange(c, device=dev)
            rows = torch.where(blocks[:, None] < nb, blocks[:, None] * b + sub[None], -1).view(-1)
            cells = envelope_cells(view, rows, st, start * nr, (start + w) * nr).view(c * nr, w, nr)
            sc.masked_fill_(~((er == 2) | ((er == 1) & cells)).view(1, c * nr, w * nr), float("-inf"))
            # row softmax over the row's span; a row with no kept cell is all NaN there: nansum over the rows
            # gives it probability 0 (rows first: a coalesced reduction, then the small in-block one)
            p = torch.softmax(sc, -1)
            del sc
            part = torch.nansum(p.view(hq, c, nr, w, nr), 2).sum(-1)  # [Hq, c, w]
            del p
            mass[:, sel, start:start + w] = part[:, pos]

        return mass

    def choose(self, mass: torch.Tensor, view: SelectionView) -> torch.Tensor:
        """keep bool [Hq, nq, nb] from the block masses [Hq, nq, nb]: ``_choose`` on each q block's window of key
        blocks (``windows``), q blocks of one window width together. A window is a function of the global q
        block and the mask alone, so the sums and sorts over it, and the selection, are the same on every layout;
        it holds the block's whole envelope (masses outside it are 0), so the result is the whole row's."""
        hq, nq, nb = mass.shape
        thr = self.thresholds(hq, mass.dtype, mass.device)[:, None, None]
        keep = torch.zeros(hq, nq, nb, dtype=torch.bool, device=mass.device)
        for idx, cols, rel in self.windows(view, mass.device):
            n, w = cols.shape
            # groups of q blocks bound the memory; every operation of _choose is per q block
            cq = max(1, (1 << 22) // (hq * w))
            for s0 in range(0, n, cq):
                i, c = idx[s0:s0 + cq, None], cols[s0:s0 + cq]
                keep[:, i, c] = self._choose(mass[:, i, c], view.envelope[i, c] > 0, rel[s0:s0 + cq], thr)
        return keep

    def windows(self, view: SelectionView, device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per window width W: (local q blocks long [n], their windows' key blocks long [n, W], each block's own id
        within its window long [n]). A q block's window: the power of two W >= its envelope span's width (at most
        nb), starting at the span's first block (or nb - W); blocks with an empty envelope have none. Made once
        per layout (``view.cache``)."""
        key = ("xattention windows", view.block, str(device))
        if key not in view.cache:
            nb = view.num_blocks
            q_host = view.q_blocks_host()
            span = view.block_spans()[q_host]
            width = span[:, 1] - span[:, 0]
            full = np.minimum(nb, 1 << np.ceil(np.log2(np.maximum(width, 1))).astype(np.int64))
            start = np.minimum(span[:, 0], nb - full)
            out = []
            for w in np.unique(full[width > 0]).tolist():
                idx = np.flatnonzero((full == w) & (width > 0))
                packed = np.concatenate([idx, start[idx], q_host[idx] - start[idx]])
                t = upload(packed.astype(np.int64), device)
                i, s0, rel = t[:len(idx)], t[len(idx):2 * len(idx)], t[2 * len(idx):]
                out.append((i, s0[:, None] + torch.arange(w, device=device)[None], rel))
            view.cache[key] = out
        return view.cache[key]
