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
the same shapes on every layout (``per_block``: fixed chunks of ``CHUNK`` blocks; GEMM / reduction kernels are
chosen by shape, so batching a layout-dependent number of blocks could change rounding); every reduction across
blocks runs over a global-length axis. The selection with CP = 2, 4, 8 therefore equals the
single-process one bit for bit.
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

def local_index(view: SelectionView) -> torch.Tensor:
    """long [nb]: local block index of each global block on this rank, -1 where another rank owns it."""
    nq = view.q_blocks.shape[0]
    loc = torch.full((view.num_blocks,), -1, dtype=torch.long, device=view.device)
    loc[view.q_blocks] = torch.arange(nq, device=view.device)
    return loc


def combine_parts(fn, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Apply one collective ``fn`` (``view.combine``) to several tensors of one dtype at once."""
    flat = torch.cat([p.reshape(-1) for p in parts])
    out = fn(flat)
    res, o = [], 0
    for p in parts:
        res.append(out[o:o + p.numel()].view(p.shape))
        o += p.numel()
    return res


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


# blocks per chunk: each chunk costs the host ~10 launches whatever its size (at 128k tokens, blocks of 128, 16 a chunk
# made the selection host-bound); 64 keeps a chunk's scores of 128 estimation rows ~134 MB in float32
CHUNK = 64


def per_block(fn, *xs: torch.Tensor) -> torch.Tensor:
    """``fn`` over fixed chunks of ``CHUNK`` blocks (leading axis of every ``x``; the last chunk is
    zero-padded, its padding dropped). Every call of ``fn`` sees the same shapes on every layout, so the
    kernels (GEMM algorithm, reduction order) and hence each block's rounding do not depend on how many
    blocks a rank holds; a block's result depends only on its own inputs."""
    n = xs[0].shape[0]
    outs = []
    for a in range(0, max(n, 1), CHUNK):
        part = [x[a:a + CHUNK] for x in xs]
        m = part[0].shape[0]
        if m < CHUNK:
            part = [torch.cat([t, t.new_zeros(CHUNK - m, *t.shape[1:])]) for t in part]
        outs.append(fn(*part)[:m])
    return torch.cat(outs)


def pooled_keys(k: torch.Tensor, view: SelectionView, dt: torch.dtype) -> torch.Tensor:
    """Partial [nb, Hkv, D]: this rank's blocks' mean keys at their global ids, zeros elsewhere (to be
    ``combine``d: each block written by its owner)."""
    out = torch.zeros(view.num_blocks, *k.shape[1:], dtype=dt, device=k.device)
    out[view.q_blocks] = block_means(k, view.block, dt)
    return out


def pooled_scores(qv: torch.Tensor, kp: torch.Tensor) -> torch.Tensor:
    """[Hq, nq, nb]: ``qv`` [nq, Hq, D] (pooled queries per block and head) . ``kp`` [nb, Hkv, D] (GQA
    grouping), ``per_block`` over the q blocks."""
    nq, hq, d = qv.shape
    hkv = kp.shape[1]
    g = hq // hkv
    kt = kp.permute(1, 2, 0)  # [Hkv, D, nb], a view

    def chunk(t: torch.Tensor) -> torch.Tensor:
        # one GEMM per kv head over the chunk's G x CHUNK pooled queries: a broadcast matmul of [C, Hkv, G, D] by
        # [Hkv, D, nb] copies the keys once per chunk (most of the scores' GPU time)
        a = t.view(-1, hkv, g, d).transpose(0, 1).reshape(hkv, -1, d)
        return torch.bmm(a, kt).view(hkv, -1, g, kt.shape[-1]).transpose(0, 1).reshape(t.shape[0], hq, -1)
    return per_block(chunk, qv).transpose(0, 1)


def cover(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """bool like ``x`` [..., n] (non-negative): the smallest set of entries of the last axis whose mass
    reaches ``gamma`` of the row's total (descending; ties by index; zero entries never kept)."""
    v, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    cs = torch.cumsum(v, -1)
    excl = torch.cat([torch.zeros_like(cs[..., :1]), cs[..., :-1]], -1)
    keep = (excl < gamma * cs[..., -1:]) & (v > 0)
    return torch.zeros_like(keep).scatter(-1, idx, keep)


def top_n(score: torch.Tensor, prio: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """bool like ``score`` [..., nb]: the first ``n`` [...] entries ranked by ``prio`` (int, descending),
    then ``score`` (descending), then index (ascending)."""
    o1 = torch.sort(score, dim=-1, descending=True, stable=True).indices
    o2 = torch.sort(prio.gather(-1, o1), dim=-1, descending=True, stable=True).indices
    order = o1.gather(-1, o2)
    rank_ok = torch.arange(score.shape[-1], device=score.device) < n[..., None]
    return torch.zeros_like(rank_ok).scatter(-1, order, rank_ok)


def diag_sums(x: torch.Tensor) -> torch.Tensor:
    """[..., L + B - 1]: sums of ``x`` [..., L, B] along its diagonals, entry ``d = r - c + B - 1``."""
    *lead, l, b = x.shape
    y = torch.nn.functional.pad(x.flip(-1), (0, l))  # row r shifted right by r after the re-view below
    y = y.reshape(*lead, l * (b + l))[..., : l * (b + l - 1)].reshape(*lead, l, b + l - 1)
    return y.sum(-2)


def estimation_blocks(view: SelectionView, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(local index, global id), long on the device, of this rank's key blocks that the last ``rows`` rows of the
    sequence may attend (``view.block_spans``: a superset of the blocks their cells touch), in local order; made
    on the host once per layout (no wait for the device), kept in ``view.cache``."""
    key = ("estimation blocks", rows, str(view.device))
    got = view.cache.get(key)
    if got is None:
        b, nb = view.block, view.num_blocks
        spans = view.block_spans()[(view.seqlen - rows) // b: nb]
        spans = spans[spans[:, 1] > spans[:, 0]]
        q_host = view.q_blocks_host()
        lo, hi = (int(spans[:, 0].min()), int(spans[:, 1].max())) if len(spans) else (0, 0)
        local = np.nonzero((q_host >= lo) & (q_host < hi))[0].astype(np.int64)
        got = view.cache[key] = tuple(upload_all([local, q_host[local]], view.device))
    return got


def last_rows_summaries(q: torch.Tensor, k: torch.Tensor, view: SelectionView, rows: int, dt: torch.dtype,
                        extra: list[torch.Tensor] = ()) -> dict:
    """Owner-side attention statistics of the last ``rows`` queries of the sequence over all keys.

    q [nq*B, Hq, D], k [nq*B, Hkv, D] (this rank). Returns (all combined, identical on every rank):
    ``qe`` [L, Hq, D] the queries; ``vertical`` [Hq, S] column mass (mean over the rows of the
    envelope-masked softmax); ``slash`` [Hq, S + L - 1] diagonal mass, entry ``o + L - 1`` for offset
    ``o = i - j``; ``extra``: the given partial tensors (dtype ``dt``), combined in round 1.
    Four collectives: combine, combine_max, combine, combine.
    """
    b, nb, s = view.block, view.num_blocks, view.seqlen
    nq = q.shape[0] // b
    hq, d = q.shape[1:]
    hkv = k.shape[1]
    g = hq // hkv
    L = rows
    dev = q.device
    scale = 1.0 / math.sqrt(d)
    # round 1: the estimation rows' queries from their owners (zeros elsewhere), plus the extras
    loc = local_index(view)
    pos = s - L + torch.arange(L, device=dev)
    li = loc[pos // b]
    qrow = q.view(nq, b, hq, d)[li.clamp(min=0), pos % b] if nq else \
        torch.zeros(L, hq, d, dtype=q.dtype, device=dev)
    qe_part = torch.where((li >= 0)[:, None, None], qrow.to(dt), torch.zeros((), dtype=dt, device=dev))
    qe, *ext = combine_parts(view.combine, [qe_part, *extra])
    # round 2: each rank scores its own key blocks (block by block: same GEMM shapes on every layout), those the
    # rows' envelope may touch: elsewhere every score is masked and adds exactly 0 below (packed documents: the
    # last document's blocks, not the sequence)
    sel, ids = estimation_blocks(view, L)
    ns = sel.shape[0]
    qs = (qe * scale).view(L, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * L, d)
    kb = k.view(nq, b, hkv, d)[sel]
    kpos = (ids[:, None] * b + torch.arange(b, device=dev)).reshape(-1)
    keep = cells(view.traps, pos, kpos).view(L, ns, b).permute(1, 0, 2)  # [ns, L, B]

    def scores(t: torch.Tensor) -> torch.Tensor:  # [C, B, Hkv, D] keys -> [C, Hq, L, B]: one GEMM per kv head (a
        # broadcast matmul copies qs once per chunk)
        kt = t.permute(2, 3, 0, 1).reshape(hkv, d, -1).to(dt)
        return torch.bmm(qs, kt).view(hkv, g * L, -1, b).permute(2, 0, 1, 3).reshape(-1, hq, L, b)
    sc = per_block(scores, kb)
    sc = sc.masked_fill(~keep[:, None], NEG)
    mloc = sc.amax(dim=(0, 3)) if ns else torch.full((hq, L), NEG, dtype=dt, device=dev)
    m = view.combine_max(mloc)  # exact in any order
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=dt, device=dev))  # rows with no key
    # round 3: per key block partial sums of exp(s - max), summed over the global block axis
    p = torch.exp(sc - m[None, :, :, None])
    zpart = torch.zeros(nb, hq, L, dtype=dt, device=dev)
    if ns:
        zpart[ids] = per_block(lambda t: t.sum(-1), p)
    z = view.combine(zpart).sum(0)
    z = torch.where(z > 0, z, torch.ones((), dtype=dt, device=dev))
    # round 4: column masses and per (key block, local diagonal) masses of the normalised rows
    p = p / z[None, :, :, None]
    cpart = torch.zeros(nb, hq, b, dtype=dt, device=dev)
    dpart = torch.zeros(nb, hq, L + b - 1, dtype=dt, device=dev)
    if ns:
        cpart[ids] = per_block(lambda t: t.sum(2), p) / L
        dpart[ids] = per_block(diag_sums, p) / L
    col, dia = combine_parts(view.combine, [cpart, dpart])
    vertical = col.permute(1, 0, 2).reshape(hq, s)
    # fold: block kb's local diagonal dd sits at offset index (nb-1-kb)*B + dd; chunks of B entries of
    # the flipped blocks tile the axis without overlap, summed chunk by chunk in a fixed order
    w = L + b - 1
    mm = -(-w // b)
    rev = torch.nn.functional.pad(dia.flip(0), (0, mm * b - w)).view(nb, hq, mm, b)
    slash = torch.zeros(nb + mm - 1, hq, b, dtype=dt, device=dev)
    for t in range(mm):
        slash = slash + torch.nn.functional.pad(rev[:, :, t], (0, 0, 0, 0, t, mm - 1 - t))
    slash = slash.permute(1, 0, 2).reshape(hq, -1)[:, : s + L - 1]
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

    def windows(x):  # x [Hq, S + L - 1] on offsets -> [Hq, 2nb - 1] per block diagonal delta = qb - kb
        full = torch.zeros(hq, 2 * s + 2 * b, dtype=x.dtype, device=x.device)
        full[:, s + b - (L - 1): s + b + s] = x  # index o + S + B
        return full[:, b + 1:].unfold(-1, 2 * b - 1, b)[:, : 2 * nb - 1].sum(-1)

    delta = view.q_blocks[:, None] - torch.arange(nb, device=view.device)[None, :] + nb - 1  # [nq, nb]
    sd = windows(slashkeep.to(torch.int32)) > 0
    blk = colblk[:, None, :] | sd[:, delta]
    if slash_mass is None:
        return blk
    return blk, windows(slash_mass)[:, delta]


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
        loc = local_index(view)
        li = loc[view.num_blocks - 1]
        env_row = view.envelope[li.clamp(min=0)].to(dt) if view.envelope.shape[0] else \
            torch.zeros(view.num_blocks, dtype=dt, device=q.device)
        env_last = torch.where(li >= 0, env_row, torch.zeros((), dtype=dt, device=q.device))
        r = last_rows_summaries(q, k, view, self.block, dt, [env_last, pooled_keys(k, view, dt)])
        return {"qe": r["qe"], "env_last": r["extra"][0], "kp": r["extra"][1], "vertical": r["vertical"],
                "slash": r["slash"]}

    def head_kinds(self, sm: dict, view: SelectionView) -> tuple[torch.Tensor, torch.Tensor]:
        """(query_aware bool [Hq], js distance [Hq]) from the summaries (identical on every rank)."""
        hq, d = sm["qe"].shape[1:]
        nb, b = view.num_blocks, view.block
        est = pooled_scores((sm["qe"].mean(0) / math.sqrt(d))[None], sm["kp"])[:, 0]
        est = torch.softmax(est.masked_fill(~(sm["env_last"] > 0)[None], NEG), -1).nan_to_num(0.0)
        true = sm["vertical"].view(hq, nb, b).sum(-1)
        mid = (est + true) / 2

        def kl(p):
            return torch.where(p > 0, p * torch.log(p / mid), torch.zeros((), dtype=p.dtype, device=p.device)).sum(-1)

        js = torch.sqrt((0.5 * kl(est) + 0.5 * kl(true)).clamp(min=0))
        return js < self.tau, js

    def select_from(self, q: torch.Tensor, sm: dict, view: SelectionView) -> torch.Tensor:
        """Local step: keep bool [Hq, nq, nb] from this rank's q [nq*B, Hq, D] and ``summaries``."""
        b, nb = view.block, view.num_blocks
        nq = q.shape[0] // b
        hq, d = q.shape[1:]
        dt = sm["kp"].dtype
        env = view.envelope > 0
        qa_head, _ = self.head_kinds(sm, view)
        # query-aware: pooled q . pooled k per local q block, softmax over the envelope blocks
        qp = block_means(q, b, dt) / math.sqrt(d)
        lg = pooled_scores(qp, sm["kp"])
        pa = torch.softmax(lg.masked_fill(~env[None], NEG), -1).nan_to_num(0.0)
        cand_qa = cover(pa, self.gamma)
        # vertical-slash: covers of columns and diagonals of the last block's attention
        L = b
        colkeep = cover(sm["vertical"], self.gamma)
        slashkeep = cover(sm["slash"], self.gamma)
        cand_vs, smass = vertical_slash_blocks(colkeep, slashkeep, view, L, sm["slash"])
        vmass = sm["vertical"].view(hq, nb, b).sum(-1)
        score_vs = vmass[:, None, :] + smass
        qa = qa_head[:, None, None]
        cand = torch.where(qa, cand_qa, cand_vs)
        score = torch.where(qa, pa, score_vs)
        # budget: diagonal block, then candidates, then the other envelope blocks
        diag = diagonal_blocks(view)[None] & env[None]
        envh = env[None].expand(hq, nq, nb)
        prio = envh.to(torch.int32) + (cand & envh).to(torch.int32) + 2 * diag.to(torch.int32)
        count = ((cand & envh) | diag).sum(-1)
        lo, hi = self._budget_blocks(nb)
        n = torch.minimum(count.clamp(min=lo, max=hi), envh.sum(-1))
        n = torch.maximum(n, diag.sum(-1))
        return top_n(score, prio, n) & envh

    def select(self, q: torch.Tensor, k: torch.Tensor, view: SelectionView) -> torch.Tensor:
        """keep bool [Hq, nq, nb] (docs/sparse.md); ``select_from(q, summaries(q, k, view), view)``."""
        return self.select_from(q, self.summaries(q, k, view), view)
