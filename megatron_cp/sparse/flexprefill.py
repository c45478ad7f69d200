"""FlexPrefill: per head, query-aware or vertical-slash block selection (Lai et al., "FlexPrefill: A
Context-Aware Sparse Attention Mechanism for Efficient Long-Sequence Inference", ICLR 2025;
github.com/bytedance/FlexPrefill).

Published defaults (README / ``flex_prefill_attention``): ``block_size=128``, ``gamma=0.9``,
``tau=0.1``, ``min_budget=512`` tokens, ``max_budget=None``. Same here.

Per query head ``h`` (GQA: q head ``h`` reads kv head ``h // (Hq // Hkv)``, Megatron's grouping):

1. Estimation queries: the rows of the last block of the sequence (global block ``nb - 1``; for packed
   documents that is the *last document's* last block, so the estimate describes that document's head
   behaviour and is applied to every document). Their attention over all keys, masked by the envelope
   of those rows, gives ``P [B, S]``.
2. "True" block distribution ``a[kb]`` = sum of ``P`` over the key block's columns, averaged over the
   rows; estimate ``e = softmax_kb(mean-pooled last-block query . mean-pooled keys)`` over the last
   row's envelope blocks (scaled by 1/sqrt(D)). Jensen-Shannon *distance* (natural log, the square root
   of the divergence, as published) ``js(e, a) < tau``: query-aware head, else vertical-slash head.
3. Query-aware: for every local q block, ``softmax`` over its envelope blocks of pooled q . pooled k;
   the candidates are the smallest set of blocks reaching ``gamma`` of the mass.
   Vertical-slash: from ``P``, column mass (vertical, per key token) and diagonal mass (slash, per offset
   ``o = i - j``); the smallest set of columns and of diagonals reaching ``gamma`` each; a block pair is
   a candidate when it contains a kept column or a cell of a kept diagonal (block granularity: the
   kernel intersects with the cell mask anyway).
4. Budget: the number of key blocks kept per (head, q block), *including the diagonal block*, is
   clamped to ``[ceil(min_budget / B), ceil(max_budget / B)]`` (budgets in tokens as published) and to
   the envelope blocks of the row. Blocks are ranked (diagonal block first, then candidates, then the
   other envelope blocks; inside each class by score: the query-aware probability, or the vertical
   mass of the key block plus the slash mass of the block diagonal; ties by block id) and the first
   ``n`` kept. The diagonal block is always kept.

Deviations from the published code, and why: (a) query-aware coverage is per q block (published: one
``gamma * nb`` cover over the whole flattened block matrix), which needs no global sort across ranks;
(b) the published method counts tokens of the vertical / slash cover and then keeps that many *blocks*
(``// 128 + 1``) of block-summed mass; here the covers are per token column / diagonal and converted to
block pairs exactly (what the paper describes); (c) query-aware heads do not also get ``min_budget``
vertical / slash blocks; instead the budget clamp fills any row up to ``min_budget`` with its best
blocks; (d) the envelope (packed documents, windows) masks the estimation rows and every softmax.

Context parallelism (docs/sparse.md). ``select = select_from(q, summaries(q, k, view), view)``:

- ``summaries`` is the owner-side step with the collectives, four rounds of small all-reduces:
  (1) ``combine``: the last-block queries (their owner writes them, other ranks zeros), the last row's
  envelope classes, the mean-pooled keys ``[nb, Hkv, D]`` (each block by its owner);
  (2) ``combine_max``: the global row max of the estimation scores (each rank scores its own key blocks
  against the broadcast queries); (3) ``combine``: per key block partial sums of ``exp(s - max)``
  ``[nb, Hq, L]``, summed over the global ``nb`` axis; (4) ``combine``: column masses ``[nb, Hq, B]``
  and per key block diagonal masses ``[nb, Hq, L + B - 1]``, folded over a global-length offset axis.
- ``select_from`` is local: it reads only the combined summaries and this rank's queries.

Every quantity reduced inside a block (pooling, scores, per-block sums) is computed block by block with
the same shapes on every layout (fixed chunks of ``CHUNK`` blocks, the last one padded: one GEMM / reduction launch
per chunk; those kernels are chosen by shape, so batching a layout-dependent number of blocks could change rounding);
every reduction across blocks runs over a global-length axis. The selection with CP = 2, 4, 8 therefore equals
the single-process one bit for bit. Only elementwise work (copies, masks, exp, divisions) runs over all chunks
at once: its values do not depend on how it is batched.

Host cost: what depends only on the view (the mask and this rank's blocks: index tensors, masks, budgets) is
made once per layout and kept in ``view.cache`` (``derived``), so that one selection launches only the work
that reads q and k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..kernels import accumulate_dtype, upload_all
from .moba import block_means
from .selector import check_block, check_fraction, check_heads
from .view import SelectionView

NEG = float("-inf")


# --------------------------------------------------------------------------------------------------
# shared helpers (also used by MInference)

def derived(view: SelectionView, key: tuple, make):
    """``make()``, made once per view and device and kept in ``view.cache`` under ``key``: what a selector derives
    from the view's static fields (the mask, this rank's blocks) is the same at every call, so building it again
    would only cost launches."""
    key = (*key, str(view.device))
    got = view.cache.get(key)
    if got is None:
        got = view.cache[key] = make()
    return got


def local_index(view: SelectionView) -> torch.Tensor:
    """long [nb]: local block index of each global block on this rank, -1 where another rank owns it."""
    def make():
        loc = torch.full((view.num_blocks,), -1, dtype=torch.long, device=view.device)
        loc[view.q_blocks] = torch.arange(view.q_blocks.shape[0], device=view.device)
        return loc
    return derived(view, ("local index",), make)


def block_masks(view: SelectionView) -> dict:
    """Static [nq, nb] masks of the view (``derived``): ``env`` bool, the envelope's blocks; ``off`` its complement;
    ``diag`` each local q block's own key block; ``diag_env`` those in the envelope; ``env_i32`` ``env`` as int32."""
    def make():
        env = view.envelope > 0
        diag = diagonal_blocks(view)
        return {"env": env, "off": ~env, "diag": diag, "diag_env": diag & env, "env_i32": env.to(torch.int32)}
    return derived(view, ("block masks",), make)


def combine_parts(fn, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Apply one collective ``fn`` (``view.combine``) to several tensors of one dtype at once."""
    out = fn(torch.cat([p.reshape(-1) for p in parts]))
    return [o.view(p.shape) for o, p in zip(out.split([p.numel() for p in parts]), parts)]


def cells(traps: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """bool [R, C]: does the mask (``traps`` long [n, 6], ``AttnMask.traps``) keep cell (rows[r], cols[c])
    (global positions). On the device, no host synchronisation (the loop runs over trap chunks, a
    shape)."""
    i, j = rows[:, None], cols[None, :]
    out = torch.zeros(rows.shape[0], cols.shape[0], dtype=torch.bool, device=rows.device)
    n = traps.shape[0]
    step = max(1, (1 << 24) // max(1, rows.shape[0] * cols.shape[0]))
    for a in range(0, n, step):
        t = traps[a:a + step, :, None, None]
        q0, q1, la, ls, ha, hs = t.unbind(1)
        out |= ((i >= q0) & (i < q1) & (j >= la + ls * i) & (j < ha + hs * i)).any(0)
    return out


# blocks per chunk: each chunk costs the host a launch per GEMM / reduction whatever its size (at 128k tokens, blocks
# of 128, 16 a chunk made the selection host-bound); 64 keeps a chunk's scores of 128 estimation rows ~134 MB in
# float32
CHUNK = 64
# elements of one batch of the diagonal layouts (``diag_sums``): batching chunks saves launches, this bounds the
# extra memory (~256 MB in float32; a single chunk may exceed it)
DIAG_BATCH = 1 << 26


def chunk_count(n: int) -> int:
    """Chunks of ``CHUNK`` blocks covering ``n`` blocks (at least one)."""
    return max(1, -(-n // CHUNK))


def chunk_views(x: torch.Tensor, first: torch.Tensor) -> list[torch.Tensor]:
    """For each chunk of ``CHUNK`` blocks of ``x`` (leading axis), the view of it that ``first`` (a view of the first
    chunk) is of that one: the same shape and strides, one op per chunk."""
    return [x.as_strided(first.shape, first.stride(), first.storage_offset() + a * x.stride(0))
            for a in range(0, x.shape[0], CHUNK)]


def chunked_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x.sum(dim)`` for ``x`` [n * CHUNK, ...], one reduction per chunk of ``CHUNK`` blocks (each sees the same
    shape on every layout) written into one buffer (no concatenation)."""
    if x.shape[0] == CHUNK:
        return x.sum(dim)
    shape = list(x.shape)
    del shape[dim % x.dim()]
    out = x.new_empty(shape)
    for xc, oc in zip(x.split(CHUNK), out.split(CHUNK)):
        torch.sum(xc, dim, out=oc)
    return out


def pooled_keys(k: torch.Tensor, view: SelectionView, dt: torch.dtype) -> torch.Tensor:
    """Partial [nb, Hkv, D]: this rank's blocks' mean keys at their global ids, zeros elsewhere (to be
    ``combine``d: each block written by its owner)."""
    means = block_means(k, view.block, dt)
    if derived(view, ("all blocks in order",), lambda: bool(np.array_equal(view.q_blocks_host(),
                                                                            np.arange(view.num_blocks)))):
        return means  # every block here, in global order: the scatter below would copy them as they are
    out = torch.zeros(view.num_blocks, *k.shape[1:], dtype=dt, device=k.device)
    out[view.q_blocks] = means
    return out


def pooled_scores(qv: torch.Tensor, kp: torch.Tensor, div: float = 1.0) -> torch.Tensor:
    """[Hq, nq, nb]: ``qv / div`` ([nq, Hq, D], pooled queries per block and head) . ``kp`` [nb, Hkv, D] (GQA
    grouping): one GEMM per kv head and chunk of ``CHUNK`` q blocks (the last chunk padded with whatever the
    buffer held: the same shapes on every layout; a GEMM's output row reads only its own input row, and the
    padding's rows are dropped)."""
    nq, hq, d = qv.shape
    nb, hkv = kp.shape[:2]
    g = hq // hkv
    n, full = chunk_count(nq), nq // CHUNK
    # a chunk's GEMM operand [Hkv, CHUNK * G, D] (its layout too selects the kernel): with one kv head or one q head
    # per kv head a view of its pooled queries [CHUNK, Hq, D], else a contiguous copy, made for every chunk by one
    # elementwise pass (the division folded in: the same values). A broadcast matmul of [C, Hkv, G, D] by
    # [Hkv, D, nb] would copy the keys once per chunk (most of the scores' GPU time)
    if hkv == 1 or g == 1:
        a = qv.new_empty(n * CHUNK, hq, d)
        torch.div(qv, div, out=a[:nq])
        ops = chunk_views(a, a[:CHUNK].view(-1, hkv, g, d).transpose(0, 1).reshape(hkv, -1, d))
    else:
        a = qv.new_empty(n, hkv, CHUNK, g, d)
        if full:
            torch.div(qv[:full * CHUNK].view(full, CHUNK, hkv, g, d).transpose(1, 2), div, out=a[:full])
        if n > full:
            m = nq - full * CHUNK
            torch.div(qv[full * CHUNK:].view(m, hkv, g, d).transpose(0, 1), div, out=a[full, :, :m])
        ops = a.view(n, hkv, CHUNK * g, d).unbind()
    kt = kp.permute(1, 2, 0)  # [Hkv, D, nb], a view
    out = qv.new_empty(n, hkv, CHUNK * g, nb)
    for ac, oc in zip(ops, out.unbind()):
        torch.bmm(ac, kt, out=oc)
    return out.view(n, hkv, CHUNK, g, nb).transpose(1, 2).reshape(n * CHUNK, hq, nb)[:nq].transpose(0, 1)


def sort_desc(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of ``x`` sorted along its last axis, descending, ties by index (``cover``, ``top_n``)."""
    return torch.sort(x, dim=-1, descending=True, stable=True)


def cover(x: torch.Tensor, gamma: float, sorted_x: tuple | None = None) -> torch.Tensor:
    """bool like ``x`` [..., n] (non-negative): the smallest set of entries of the last axis whose mass
    reaches ``gamma`` of the row's total (descending; ties by index; zero entries never kept). ``sorted_x``:
    ``sort_desc(x)`` when the caller has it."""
    v, idx = sort_desc(x) if sorted_x is None else sorted_x
    cs = torch.cumsum(v, -1)
    thr = gamma * cs[..., -1:]
    # kept while the mass before the entry (0, then cs[i - 1]) is short of thr: compared in place, no shifted copy
    keep = torch.empty_like(v, dtype=torch.bool)
    torch.gt(thr, 0, out=keep[..., :1])
    torch.lt(cs[..., :-1], thr, out=keep[..., 1:])
    keep &= v > 0
    return torch.empty_like(keep).scatter_(-1, idx, keep)  # idx is a permutation: every entry written


def top_n(score: torch.Tensor, prio: torch.Tensor | None, n: torch.Tensor, order: torch.Tensor | None = None
          ) -> torch.Tensor:
    """bool like ``score`` [..., nb]: the first ``n`` [...] entries ranked by ``prio`` (int, descending; None:
    all equal), then ``score`` (descending), then index (ascending). ``order``: ``sort_desc(score)``'s indices when
    the caller has them."""
    order = sort_desc(score).indices if order is None else order
    if prio is not None:  # (equal priorities: the stable sort by prio would keep ``order`` as it is)
        order = order.gather(-1, torch.sort(prio.gather(-1, order), dim=-1, descending=True, stable=True).indices)
    rank_ok = torch.arange(score.shape[-1], device=score.device) < n[..., None]
    return torch.empty_like(rank_ok).scatter_(-1, order, rank_ok)  # order is a permutation: every entry written


def diag_sums(x: torch.Tensor) -> torch.Tensor:
    """[n, ..., L + B - 1]: sums of ``x`` [n, ..., L, B] (n a multiple of ``CHUNK``) along its diagonals, entry
    ``d = r - c + B - 1``: one reduction per chunk, the rows of its flipped blocks zero-padded to B + L and
    re-viewed with one entry fewer each (row r shifted right by r), the padded rows made for several chunks at once
    (copies: the same values)."""
    n, *mid, l, b = x.shape
    w = l + b - 1
    out = x.new_empty(n, *mid, w)
    step = CHUNK * max(1, DIAG_BATCH // (CHUNK * math.prod(mid) * l * (b + l)))
    for a in range(0, n, step):
        part = x[a:a + step]
        y = x.new_zeros(*part.shape[:-1], b + l)
        y[..., :b] = part.flip(-1)
        first = y[:CHUNK].reshape(CHUNK, *mid, l * (b + l))[..., : l * w].reshape(CHUNK, *mid, l, w)  # a view
        for yc, oc in zip(chunk_views(y, first), out[a:a + step].split(CHUNK)):
            torch.sum(yc, -2, out=oc)
    return out


def _estimation_host(view: SelectionView, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``estimation_blocks`` on the host (int64 arrays)."""
    b, nb = view.block, view.num_blocks
    spans = view.block_spans()[(view.seqlen - rows) // b: nb]
    spans = spans[spans[:, 1] > spans[:, 0]]
    q_host = view.q_blocks_host()
    lo, hi = (int(spans[:, 0].min()), int(spans[:, 1].max())) if len(spans) else (0, 0)
    local = np.nonzero((q_host >= lo) & (q_host < hi))[0].astype(np.int64)
    return local, q_host[local]


def estimation_blocks(view: SelectionView, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(local index, global id), long on the device, of this rank's key blocks that the last ``rows`` rows of the
    sequence may attend (``view.block_spans``: a superset of the blocks their cells touch), in local order; made
    on the host once per layout (no wait for the device), kept in ``view.cache``."""
    return derived(view, ("estimation blocks", rows),
                   lambda: tuple(upload_all(list(_estimation_host(view, rows)), view.device)))


def estimation_statics(view: SelectionView, rows: int) -> dict:
    """What ``last_rows_summaries`` reads of the view, made once per layout (``derived``): ``rows`` the local rows
    of the estimation rows (a slice when consecutive, else long [L]; another rank's rows read row 0), ``own`` bool
    [L, 1, 1] which of them this rank owns (None: all or ``none``), ``sel`` / ``ids`` (``estimation_blocks``),
    ``rids`` nb - 1 - ``ids``, ``span`` (the local range ``sel`` covers when it is one), ``all`` (``ids`` is every
    block in order), ``ns``, ``masked`` bool [chunks * CHUNK, 1, L, B] the cells outside the rows' envelope (all
    of a padding block's), ``neg`` a -inf scalar."""
    def make():
        b, nb, s = view.block, view.num_blocks, view.seqlen
        dev = view.device
        q_host = view.q_blocks_host()
        loc = np.full(nb, -1, dtype=np.int64)
        loc[q_host] = np.arange(len(q_host))
        pos = s - rows + np.arange(rows)
        li = loc[pos // b]
        ridx = np.maximum(li, 0) * b + pos % b
        local, ids = _estimation_host(view, rows)
        ns = len(local)
        sel, ids_dev = estimation_blocks(view, rows)
        own, rids = upload_all([(li >= 0).astype(np.int64), nb - 1 - ids], dev)
        own = own > 0
        masked = torch.ones(chunk_count(ns) * CHUNK, 1, rows, b, dtype=torch.bool, device=dev)
        if ns:
            kpos = (ids_dev[:, None] * b + torch.arange(b, device=dev)).reshape(-1)
            keep = cells(view.traps, s - rows + torch.arange(rows, device=dev), kpos)
            masked[:ns, 0] = ~keep.view(rows, ns, b).permute(1, 0, 2)

        def run(x):  # a slice when x is consecutive
            return slice(int(x[0]), int(x[0]) + len(x)) if len(x) and np.array_equal(x, x[0] + np.arange(len(x))) \
                else None
        return {"rows": run(ridx) or upload_all([ridx], dev)[0], "none": bool((li < 0).all()),
                "own": None if (li >= 0).all() or (li < 0).all() else own[:, None, None],
                "sel": sel, "ids": ids_dev, "rids": rids, "ns": ns, "span": run(local), "masked": masked,
                "all": bool(np.array_equal(ids, np.arange(nb))), "neg": torch.full((), NEG, device=dev)}
    return derived(view, ("estimation statics", rows), make)


def last_rows_summaries(q: torch.Tensor, k: torch.Tensor, view: SelectionView, rows: int, dt: torch.dtype,
                        extra: list[torch.Tensor] = ()) -> dict:
    """Owner-side attention statistics of the last ``rows`` queries of the sequence over all keys.

    q [nq*B, Hq, D], k [nq*B, Hkv, D] (this rank). Returns (all combined, identical on every rank):
    ``qe`` [L, Hq, D] the queries; ``vertical`` [Hq, S] column mass (mean over the rows of the
    envelope-masked softmax); ``slash`` [Hq, S + L - 1] diagonal mass, entry ``o + L - 1`` for offset
    ``o = i - j``; ``extra``: the given partial tensors (dtype ``dt``), combined in round 1.
    Four collectives: combine, combine_max, combine, combine.

    Padding blocks (the last chunk's) hold whatever the buffers held: every result of theirs is dropped or
    masked, and no GEMM / reduction output of a real block reads them.
    """
    b, nb, s = view.block, view.num_blocks, view.seqlen
    nq = q.shape[0] // b
    hq, d = q.shape[1:]
    hkv = k.shape[1]
    g = hq // hkv
    L = rows
    w = L + b - 1
    dev = q.device
    st = estimation_statics(view, L)
    # round 1: the estimation rows' queries from their owners (zeros elsewhere), plus the extras
    if st["none"] or not nq:
        qe_part = torch.zeros(L, hq, d, dtype=dt, device=dev)
    else:
        qe_part = q.view(nq * b, hq, d)[st["rows"]].to(dt)
        if st["own"] is not None:
            qe_part = torch.where(st["own"], qe_part, 0.0)
    qe, *ext = combine_parts(view.combine, [qe_part, *extra])
    # round 2: each rank scores its own key blocks (in fixed chunks: the same GEMM shapes on every layout), those
    # the rows' envelope may touch: elsewhere every score is masked and adds exactly 0 below (packed documents: the
    # last document's blocks, not the sequence)
    ns = st["ns"]
    if ns:
        n, m = chunk_count(ns), ns % CHUNK
        qs = (qe * (1.0 / math.sqrt(d))).view(L, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * L, d)
        kv = k.view(nq, b, hkv, d)
        kb = kv[st["span"]] if st["span"] else kv[st["sel"]]
        if m or kb.dtype != dt:  # whole chunks in dt, by one copy
            buf = torch.empty(n * CHUNK, b, hkv, d, dtype=dt, device=dev)
            buf[:ns] = kb
            kb = buf
        res = torch.empty(n, hkv, g * L, CHUNK * b, dtype=dt, device=dev)
        # one GEMM per kv head (a broadcast matmul would copy qs once per chunk), the keys [Hkv, D, CHUNK * B] a view
        # of their rows (the operand layout the kernel is chosen for)
        for kc, rc in zip(chunk_views(kb, kb[:CHUNK].view(CHUNK * b, hkv, d).permute(1, 2, 0)), res.unbind()):
            torch.bmm(qs, kc, out=rc)
        # scores [chunks * CHUNK, Hq, L, B], the masked cells (and the padding blocks) at -inf, in one pass
        sc = torch.empty(n * CHUNK, hq, L, b, dtype=dt, device=dev)
        torch.where(st["masked"].view(n, CHUNK, 1, 1, L, b), st["neg"],
                    res.view(n, hkv, g, L, CHUNK, b).permute(0, 4, 1, 2, 3, 5), out=sc.view(n, CHUNK, hkv, g, L, b))
        mloc = sc.amax(dim=(0, 3))
    else:
        mloc = torch.full((hq, L), NEG, dtype=dt, device=dev)
    m = view.combine_max(mloc).nan_to_num(0.0, 0.0, 0.0)  # exact in any order; rows with no key: 0
    # round 3: per key block partial sums of exp(s - max), summed over the global block axis; exp over exactly
    # the scored blocks (the extent it always had: the same values)
    if ns:
        sc.sub_(m.view(1, hq, L, 1))
        sc[:ns].exp_()
        zs = chunked_sum(sc, -1)[:ns]
    if ns and st["all"]:
        zpart = zs
    else:
        zpart = torch.zeros(nb, hq, L, dtype=dt, device=dev)
        if ns:
            zpart[st["ids"]] = zs
    z = view.combine(zpart).sum(0)
    z = torch.where(z > 0, z, 1.0)
    # round 4: column masses [Hq, nb, B] and per (key block, local diagonal) masses [Hq, nb, L + B - 1] of the
    # normalised rows, in one buffer (one collective, no concatenation; head-major: the vertical mass is a view;
    # the diagonal masses in reversed block order, as the fold below reads them)
    cd = torch.zeros(hq * nb * (b + w), dtype=dt, device=dev)
    cpart, dpart = cd[:hq * nb * b].view(hq, nb, b), cd[hq * nb * b:].view(hq, nb, w)
    if ns:
        sc.div_(z.view(1, hq, L, 1))
        cpart[:, st["ids"]] = chunked_sum(sc, 2)[:ns].transpose(0, 1)
        dpart[:, st["rids"]] = diag_sums(sc)[:ns].transpose(0, 1)
        cd /= L  # (the mean over the rows; zeros stay zeros)
    cd = view.combine(cd)
    vertical = cd[:hq * nb * b].view(hq, s)
    # fold: block kb's local diagonal dd sits at offset index (nb-1-kb)*B + dd; chunks of B entries of the flipped
    # blocks tile the axis without overlap, added chunk by chunk in a fixed order (in place: the same sums as
    # adding zero-padded copies, every mass being >= +0)
    rev = cd[hq * nb * b:].view(hq, nb, w)
    mm = -(-w // b)
    acc = torch.zeros(hq, nb + mm - 1, b, dtype=dt, device=dev)
    for t in range(mm):
        acc[:, t:t + nb, :min(b, w - t * b)].add_(rev[:, :, t * b:(t + 1) * b])
    slash = acc.view(hq, -1)[:, : s + L - 1]
    return {"qe": qe, "vertical": vertical, "slash": slash, "extra": ext}


def vertical_slash_blocks(colkeep: torch.Tensor, slashkeep: torch.Tensor, view: SelectionView, rows: int,
                          slash_mass: torch.Tensor | None = None):
    """Block pairs holding a kept column / a cell of a kept diagonal.

    colkeep bool [Hq, S]; slashkeep bool [Hq, S + L - 1] (entry ``o + L - 1``). Returns bool
    [Hq, nq, nb] and, when ``slash_mass`` [Hq, S + L - 1] is given, float [Hq, nq, nb]: the slash mass
    of the block pair's offsets ``(qb - kb) * B +- (B - 1)``.
    """
    b, nb, s = view.block, view.num_blocks, view.seqlen
    hq = colkeep.shape[0]
    L = rows
    colblk = colkeep.view(hq, nb, b).any(-1)

    def windows(x):  # x [Hq, S + L - 1] on offsets -> [Hq, 2nb - 1, 2B - 1] per block diagonal delta = qb - kb
        full = x.new_zeros(hq, 2 * s + 2 * b)
        full[:, s + b - (L - 1): s + b + s] = x  # index o + S + B
        return full[:, b + 1:].unfold(-1, 2 * b - 1, b)[:, : 2 * nb - 1]

    def deltas():  # [nq, nb]
        return view.q_blocks[:, None] - torch.arange(nb, device=view.device)[None, :] + nb - 1
    delta = derived(view, ("block deltas",), deltas)
    blk = colblk[:, None, :] | windows(slashkeep).any(-1)[:, delta]
    if slash_mass is None:
        return blk
    return blk, windows(slash_mass).sum(-1)[:, delta]


def diagonal_blocks(view: SelectionView) -> torch.Tensor:
    """bool [nq, nb]: each local q block's own key block."""
    return view.q_blocks[:, None] == torch.arange(view.num_blocks, device=view.device)[None, :]


# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FlexPrefill:
    """FlexPrefill selector (see the module doc).

    block: tokens per block (128); gamma: attention coverage in (0, 1] (0.9); tau: Jensen-Shannon
    distance threshold in [0, 1] below which a head is query-aware (0.1); min_budget / max_budget:
    tokens (None: no bound; 512 / None as published), converted to ``ceil(budget / block)`` key blocks
    per (head, q block), the diagonal block included.
    """

    name: ClassVar[str] = "flexprefill"
    block: int = 128
    gamma: float = 0.9
    tau: float = 0.1
    min_budget: int | None = 512
    max_budget: int | None = None

    def __post_init__(self):
        self._check_params()

    def _check_params(self) -> None:
        n = self.name
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"{n}: block must be a positive int, got {self.block!r}")
        check_fraction(n, "gamma", self.gamma)
        check_fraction(n, "tau", self.tau, closed_low=True)
        for what, v, low in (("min_budget", self.min_budget, 0), ("max_budget", self.max_budget, 1)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ValueError(f"{n}: {what} must be None or an int >= {low} (tokens), got {v!r}")
        if self.min_budget is not None and self.max_budget is not None and self.max_budget < self.min_budget:
            raise ValueError(f"{n}: max_budget {self.max_budget} is below min_budget {self.min_budget}")

    def check(self, num_q_heads: int, num_kv_heads: int, head_dim: int, seqlen: int) -> None:
        """ValueError naming the bad hyperparameter / value (no collective)."""
        self._check_params()
        check_block(self.name, self.block, seqlen)
        check_heads(self.name, num_q_heads, num_kv_heads, head_dim)

    def _budget_blocks(self, nb: int) -> tuple[int, int]:
        b = self.block
        lo = 0 if self.min_budget is None else -(-self.min_budget // b)
        hi = nb if self.max_budget is None else max(1, -(-self.max_budget // b))
        return lo, hi

    def summaries(self, q: torch.Tensor, k: torch.Tensor, view: SelectionView) -> dict:
        """Owner-side step (collectives: combine, combine_max, combine, combine). q [nq*B, Hq, D],
        k [nq*B, Hkv, D]. Returns, identical on every rank: ``qe`` [B, Hq, D] last-block queries,
        ``env_last`` [nb] the last q block's envelope classes, ``kp`` [nb, Hkv, D] pooled keys,
        ``vertical`` [Hq, S], ``slash`` [Hq, S + B - 1] (float32, float64 for float64 inputs)."""
        dt = accumulate_dtype(q.dtype)

        def last_row():  # the last q block's envelope row where this rank owns it, else zeros (static)
            li = local_index(view)[view.num_blocks - 1]
            env_row = view.envelope[li.clamp(min=0)].to(dt) if view.envelope.shape[0] else \
                torch.zeros(view.num_blocks, dtype=dt, device=q.device)
            return torch.where(li >= 0, env_row, torch.zeros((), dtype=dt, device=q.device))
        env_last = derived(view, ("flexprefill last envelope row", dt), last_row)
        r = last_rows_summaries(q, k, view, self.block, dt, [env_last, pooled_keys(k, view, dt)])
        return {"qe": r["qe"], "env_last": r["extra"][0], "kp": r["extra"][1], "vertical": r["vertical"],
                "slash": r["slash"]}

    def head_kinds(self, sm: dict, view: SelectionView) -> tuple[torch.Tensor, torch.Tensor]:
        """(query_aware bool [Hq], js distance [Hq]) from the summaries (identical on every rank)."""
        return self._head_kinds(sm, view)[:2]

    def _head_kinds(self, sm: dict, view: SelectionView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``head_kinds`` and the block distribution of the estimation rows [Hq, nb] (the vertical mass per key
        block)."""
        hq, d = sm["qe"].shape[1:]
        nb, b = view.num_blocks, view.block
        est = pooled_scores(sm["qe"].mean(0)[None], sm["kp"], math.sqrt(d))[:, 0]
        est = torch.softmax(est.masked_fill((sm["env_last"] <= 0)[None], NEG), -1).nan_to_num(0.0)  # classes 0-2
        true = sm["vertical"].view(hq, nb, b).sum(-1)
        mid = (est + true) / 2

        def kl(p):
            return torch.where(p > 0, p * torch.log(p / mid), 0.0).sum(-1)

        js = torch.sqrt((0.5 * kl(est) + 0.5 * kl(true)).clamp(min=0))
        return js < self.tau, js, true

    def _budget(self, view: SelectionView) -> dict:
        """Static per (layout, budget): ``prio`` int32 [nq, nb] before the candidates add 1 (3 the diagonal block,
        1 the other envelope blocks, -1 outside the envelope), ``lo`` / ``hi`` long [nq] the bounds of the blocks
        kept per q block."""
        lo, hi = self._budget_blocks(view.num_blocks)

        def make():
            m = block_masks(view)
            env_n, diag_n = m["env"].sum(-1), m["diag_env"].sum(-1)
            # clamp(count, lo, hi), then at most the envelope's blocks, then at least the diagonal block: as one
            # clamp, since the diagonal block (0 or 1) never exceeds min(hi, envelope blocks) (hi >= 1)
            return {"prio": 2 * m["env_i32"] + 2 * m["diag_env"].to(torch.int32) - 1,
                    "lo": diag_n.clamp(min=lo), "hi": env_n.clamp(max=hi)}
        return derived(view, ("flexprefill budget", lo, hi), make)

    def select_from(self, q: torch.Tensor, sm: dict, view: SelectionView) -> torch.Tensor:
        """Local step: keep bool [Hq, nq, nb] from this rank's q [nq*B, Hq, D] and ``summaries``."""
        b = view.block
        d = q.shape[2]
        dt = sm["kp"].dtype
        masks = block_masks(view)
        qa_head, _, vmass = self._head_kinds(sm, view)
        qa = qa_head.view(-1, 1, 1)
        # query-aware: pooled q . pooled k per local q block, softmax over the envelope blocks
        lg = pooled_scores(block_means(q, b, dt), sm["kp"], math.sqrt(d))
        pa = torch.softmax(lg.masked_fill(masks["off"], NEG), -1).nan_to_num(0.0)
        # vertical-slash: covers of columns and diagonals of the last block's attention
        colkeep = cover(sm["vertical"], self.gamma)
        slashkeep = cover(sm["slash"], self.gamma)
        cand_vs, smass = vertical_slash_blocks(colkeep, slashkeep, view, b, sm["slash"])
        score = torch.where(qa, pa, vmass[:, None, :] + smass)
        # one sort serves the budget's ranking and the query-aware cover (a query-aware head's score is pa; the
        # other heads' query-aware candidates are not used)
        ranked = sort_desc(score)
        cand = torch.where(qa, cover(score, self.gamma, ranked), cand_vs)
        # budget: diagonal block, then candidates, then the other envelope blocks. prio: 3 / 4 the diagonal block,
        # 2 / 1 the envelope's (non-)candidates, <= 0 outside the envelope; n never exceeds the row's envelope
        # blocks, which rank first, so every kept block is in the envelope (as are the query-aware candidates)
        bud = self._budget(view)
        prio = bud["prio"] + cand
        n = torch.clamp((prio >= 2).sum(-1), bud["lo"], bud["hi"])
        return top_n(score, prio, n, ranked.indices)

    def select(self, q: torch.Tensor, k: torch.Tensor, view: SelectionView) -> torch.Tensor:
        """keep bool [Hq, nq, nb] (docs/sparse.md); ``select_from(q, summaries(q, k, view), view)``."""
        return self.select_from(q, self.summaries(q, k, view), view)
