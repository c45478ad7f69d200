"""Which layout: the candidate solvers' layouts for a mask, scored, and the one ``plan`` takes.

``choose`` runs the solvers ``solver`` names (``auto``: every layout of ``solvers`` that applies, the
hierarchical ones on several nodes), scores each by balance (the busiest rank's mask area over the mean)
and traffic (remote key tokens, most on a rank and in all; across nodes first on several nodes), and takes
the least traffic among those within the balance tolerance, else the best balanced.
"""

from __future__ import annotations

import numpy as np

from . import solvers
from .keys import decode, remote_all, remote_counts, split_at_chunks
from .topology import Topology


def auto_chunk(seqlen: int, cp: int) -> int:
    """About 16 chunks per rank, a power of two between 1 and 4096."""
    c = max(1, seqlen // (16 * cp))
    return int(min(4096, 1 << (c.bit_length() - 1)))


def evaluate(traps, spans, bounds, owner, cp, prefix):
    """Area and remote-key tokens per rank of an assignment (cheap: no tiles)."""
    area = np.bincount(owner, weights=prefix[bounds[1:]] - prefix[bounds[:-1]], minlength=cp).astype(np.int64)
    remote = remote_counts(*spans.spans(bounds), bounds, owner, cp)
    mean = area.mean()
    imb = float(area.max() / mean - 1.0) if mean > 0 else 0.0
    return imb, remote


def remote_tokens(spans, bounds, owner, cp) -> np.ndarray:
    """``M[r, s]``: key tokens rank ``r`` receives from rank ``s`` (int64 [cp, cp])."""
    ci, k0, k1 = spans.spans(bounds)
    rem = remote_all(ci, k0, k1, bounds, owner)[1]
    pieces, dst, src = split_at_chunks(*decode(rem, int(bounds[-1]) + 1), bounds, owner)
    M = np.zeros((cp, cp), dtype=np.int64)
    np.add.at(M, (dst, src), pieces[:, 1] - pieces[:, 0])
    return M


def link_units(spans, bounds, owner, cp, topology) -> np.ndarray:
    """Per rank, the remote K/V tokens it receives, those from another node weighted by the topology's
    intra / inter-node bandwidth ratio (float64 [cp]; the guest rows' comparison)."""
    multi = topology is not None and topology.nodes > 1
    ratio = topology.intra_node_gbps / topology.inter_node_gbps if multi else 1.0
    g = topology.gpus_per_node if multi else cp
    M = remote_tokens(spans, bounds, owner, cp).astype(np.float64)
    node = np.arange(cp) // g
    out = np.zeros(cp)
    for src in range(cp):  # sources in order, as the sum per rank always ran
        out += M[:, src] * np.where(node != src // g, ratio, 1.0)
    return out


def score(traps, spans, bounds, owner, cp, prefix):
    imb, remote = evaluate(traps, spans, bounds, owner, cp, prefix)
    return (imb, int(remote.max()), int(remote.sum()))


def snap(bounds: np.ndarray, owner: np.ndarray, block: int, rounding=np.round) -> tuple[np.ndarray, np.ndarray]:
    """Move every cut to a multiple of ``block`` (``rounding``: np.round to the nearest, np.ceil up); a chunk
    keeps the owner of the original chunk holding its first token (chunks that vanish are dropped)."""
    bounds = np.asarray(bounds, dtype=np.int64)
    return _layout(bounds, owner, rounding(bounds / block).astype(np.int64) * block)


def _layout(bounds: np.ndarray, owner, cuts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bounds, owner) of the layout whose cuts are ``cuts`` (one per cut of ``bounds``, moved): each new chunk
    keeps the owner of the original chunk holding its first token."""
    b = np.unique(cuts)
    return b, np.asarray(owner)[np.searchsorted(bounds, b[:-1], side="right") - 1]


def _rank(sc, tol):
    """Sort key of a score (imbalance, most received, total received): balanced within ``tol`` first, then least
    traffic; else least imbalance."""
    imb, most, total = sc[:3]
    return (False, most, total, imb) if imb <= tol else (True, imb, most, total)


def snap_best(bounds, owner, block, traps, spans, cp, prefix, tol):
    """(bounds, owner, score) of the block-aligned layout of (bounds, owner) that moves less: cuts rounded to the
    nearest block or all up, scored like the candidates, then refined cut by cut (below). Up pays where a cut sits
    at a causal document's start: the next document's first rows go to the rank before, which holds their keys
    already, while rounding down would hand the previous document's last rows to the rank after, which must then
    receive that whole document's keys. (All down almost never won on packed, causal and sliding-window masks at blocks 64-512,
    cp 4 and 8, so it is not tried.)"""
    bounds = np.asarray(bounds, dtype=np.int64)
    up, down = -(-bounds // block) * block, bounds // block * block
    best = None
    for cuts in (np.round(bounds / block).astype(np.int64) * block, up):  # nearest, then all up
        b, o = _layout(bounds, owner, cuts)
        if best is not None and np.array_equal(b, best[1][0]) and np.array_equal(o, best[1][1]):
            continue
        sc = score(traps, spans, b, o, cp, prefix)
        if best is None or _rank(sc, tol) < _rank(best[2], tol):
            best = (cuts, (b, o), sc)
    # then each owner change flipped between up and down, in order, wherever that scores better: which way a cut
    # should go depends on its own documents (up hands the next document's first rows back, down the previous
    # one's last rows on), so no one rule for all cuts wins; layouts with more owner changes keep the better rule
    change = np.flatnonzero(np.asarray(owner)[1:] != np.asarray(owner)[:-1]) + 1
    cuts, _, _ = best
    if len(change) <= MAX_REFINED_CUTS:
        for i in change.tolist():
            if up[i] == down[i]:
                continue
            trial = cuts.copy()
            trial[i] = down[i] if cuts[i] == up[i] else up[i]
            b, o = _layout(bounds, owner, trial)
            sc = score(traps, spans, b, o, cp, prefix)
            if _rank(sc, tol) < _rank(best[2], tol):
                cuts, best = trial, (trial, (b, o), sc)
    return (*best[1], best[2])


MAX_REFINED_CUTS = 256  # owner changes a block-aligned layout refines cut by cut (one score each)


# block-aligned plans: documents packed only at starts within block / N rows before a block boundary, N of these
BLOCK_DOCUMENT_LIMITS = (8, 4, 2)


def choose(traps, prefix, spans, seqlen, cp, chunk, topology, solver, tol, cuts, block=1):
    """The candidate layouts of ``solver`` for ``traps`` (loads by ``prefix``), scored; returns (name,
    bounds, owner, scores) of the one with least traffic among those within ``tol`` (else the best
    balanced)."""
    candidates = {}
    if solver in ("contiguous", "auto"):
        candidates["contiguous"] = solvers.contiguous(seqlen, cp)
    if solver in ("zigzag", "auto"):
        candidates["zigzag"] = solvers.zigzag(seqlen, cp)
    if solver == "auto":
        for m in (4, 8):
            if m * cp * 4 <= seqlen:
                candidates[f"zigzag{m}"] = solvers.zigzag(seqlen, cp, rounds=m)
    inputs = solvers.Chunking(prefix, chunk, spans, tol)
    if solver in ("greedy", "auto"):
        candidates["greedy"] = solvers.greedy(seqlen, cp, inputs)
    if solver in ("swap", "auto"):
        candidates["swap"] = solvers.swap_balanced(seqlen, cp, inputs)
    if solver == "documents" or (solver == "auto" and len(cuts) - 1 > cp):
        candidates["documents"] = solvers.documents(seqlen, cp, prefix=prefix, traps=traps, tol=tol, cuts=cuts)
        if block > 1:
            # A block-aligned plan rounds each owner change at a document start up to the next block, handing
            # the rank before up to a block of the next document, whose rest then needs those rows' keys. Packed
            # only at the document starts that lie close before a block boundary, the documents change owner
            # where that costs few rows: tried at three closeness limits, kept where it balances and moves less.
            for frac in BLOCK_DOCUMENT_LIMITS:
                near = cuts[(cuts == 0) | (cuts == seqlen) | ((-cuts) % block <= block // frac)]
                if cp < len(near) - 1 < len(cuts) - 1:
                    candidates[f"documents/{frac}"] = solvers.documents(seqlen, cp, prefix=prefix, traps=traps,
                                                                        tol=tol, cuts=near)
    multi_node = topology is not None and topology.nodes > 1
    if (multi_node and solver == "auto") or solver == "hierarchical":
        topo = topology if topology is not None else Topology(1, cp)
        candidates.update(hierarchical_candidates(traps, inputs, seqlen, topo, cuts))
    scores = {}
    for name, (b, o) in list(candidates.items()):
        if block > 1:  # the aligned layout comes scored
            b, o, scores[name] = snap_best(b, o, block, traps, spans, cp, prefix, tol)
            candidates[name] = (b, o)
        else:
            scores[name] = score(traps, spans, b, o, cp, prefix)
        if multi_node:  # least inter-node traffic first (deduplicated per destination node)
            scores[name] = (scores[name][0], inter_node_max(spans, b, o, topology), *scores[name][1:])
    if solver == "auto" and not any(sc[0] <= tol for sc in scores.values()):
        # nothing balances whole chunks: deal the heaviest chunks out in pieces (dense rows)
        b, o = solvers.greedy(seqlen, cp, inputs, split_heavy=True)
        b, o, sc = snap_best(b, o, block, traps, spans, cp, prefix, tol) if block > 1 else (
            b, o, score(traps, spans, b, o, cp, prefix))
        candidates["greedy_split"], scores["greedy_split"] = (b, o), sc
    # least traffic among balanced candidates; otherwise the best balanced one
    ok = [n for n in candidates if scores[n][0] <= tol]
    key = (lambda n: (scores[n][1], scores[n][2], scores[n][0])) if ok else (lambda n: scores[n][0])
    best = min(ok or list(candidates), key=key)
    return best.split("/")[0], *candidates[best], scores


def inter_node_max(spans, bounds, owner, topology) -> int:
    """Most key tokens any node receives from other nodes (each token once per node)."""
    node = np.asarray(owner, dtype=np.int64) // topology.gpus_per_node
    return int(remote_counts(*spans.spans(bounds), bounds, node, topology.nodes).max())


def hierarchical_candidates(traps, inputs, seqlen, topology, cuts):
    nodes = topology.nodes
    prefix, spans, tol = inputs.prefix, inputs.key_spans, inputs.tol
    flat = Topology(nodes, 1)

    def key(bo):
        imb = score(traps, spans, bo[0], bo[1], nodes, prefix)[0]
        return (imb > tol / 2, inter_node_max(spans, bo[0], bo[1], flat), imb)

    node_cands = [solvers.contiguous(seqlen, nodes)]
    if nodes > 1:
        node_cands.append(solvers.zigzag(seqlen, nodes))
        if len(cuts) - 1 > nodes:
            node_cands.append(solvers.documents(seqlen, nodes, prefix=prefix, traps=traps, tol=tol, cuts=cuts))
    keys = [key(bo) for bo in node_cands]
    # whole documents per node move between nodes only the documents they split; where that balances the chunk
    # solvers, which cut every long document at node boundaries, are not tried (on packed documents at 256-1024
    # GPUs they moved 5-10x its keys between nodes, and took a fifth of the planning time)
    if nodes > 1 and (len(node_cands) == 2 or keys[2][0]):
        for bo in (solvers.greedy(seqlen, nodes, inputs), solvers.swap_balanced(seqlen, nodes, inputs)):
            node_cands.append(bo)
            keys.append(key(bo))
    best = node_cands[keys.index(min(keys))]  # the first of equal keys, as min(node_cands, key=key)
    g = topology.gpus_per_node
    out = {"hierarchical": solvers.hierarchical(seqlen, topology.world_size, inputs, gpus_per_node=g, node_layout=best)}
    if len(cuts) - 1 > topology.world_size:  # and whole documents per GPU inside each node
        out["hierarchical_documents"] = solvers.node_documents(
            seqlen, topology.world_size, prefix=prefix, tol=tol, gpus_per_node=g, node_layout=best, cuts=cuts)
    return out
