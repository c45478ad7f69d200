"""``plan(mask, cp_size)``: a pure, deterministic per-rank plan for context-parallel attention.

For each rank the plan holds
- the global token runs it owns (``segments``) and so its local order (``local_ids``),
- the remote key/value runs it needs, grouped by owner (each token received at most once),
- its compute tiles ``(q_start, q_end, k_start, k_end, kind)``: q in local coordinates, k in the
  rank's key/value buffer, which is the sorted union of owned and received tokens (global order), so
  every mask trapezoid restricted to an owned run is one tile.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ..masks import AttnMask
from ..masks import geometry
from . import guests, solvers
from .choose import auto_chunk, choose, evaluate, link_units
from .keys import KeySpans, merge_runs, run_tokens, runs_to_ids
from .ranks import RankPlan, rank_plans
from .topology import Topology
from .units import fmt_bytes

_VERSION = b"megatron-cp-plan-1"


# Run algebra over many groups at once (ranks or nodes): run [s, e) of group g is encoded as
# [g * W + s, g * W + e) with W = seqlen + 1, so one sort or merge serves every group and no run of one
# group touches another's.


_ELEMENT_SIZE = {
    "float64": 8, "double": 8, "fp64": 8, "float32": 4, "float": 4, "fp32": 4, "tf32": 4,
    "float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "fp8": 1,
}


def element_size(dtype) -> int:
    """Bytes per element of ``dtype``: an int (bytes), a name (``"bfloat16"``, ``"torch.float32"``,
    ``"fp8"``, ...) or an object with ``itemsize`` (torch and numpy dtypes; the planner imports no torch)."""
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool):
        n = int(dtype)
    elif isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
        if name not in _ELEMENT_SIZE:
            raise ValueError(f"unknown dtype name {dtype!r}; give bytes per element or one of {', '.join(_ELEMENT_SIZE)}")
        n = _ELEMENT_SIZE[name]
    elif isinstance(getattr(dtype, "itemsize", None), (int, np.integer)):
        n = int(dtype.itemsize)
    else:
        raise ValueError(f"dtype must be bytes per element, a dtype name or a dtype, got {dtype!r}")
    if n < 1:
        raise ValueError(f"element size must be at least 1 byte, got {dtype!r}")
    return n


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, dtype_bytes=2) -> int:
    """Bytes of K and V for one token: ``2 * num_kv_heads * head_dim * element_size(dtype_bytes)``."""
    for name, v in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    return 2 * int(num_kv_heads) * int(head_dim) * element_size(dtype_bytes)


@dataclass(frozen=True, eq=False)
class Plan:
    """A context-parallel plan for one mask and ``cp_size`` ranks (see ``plan``)."""

    cp_size: int
    seqlen: int
    solver: str
    chunk_size: int
    bounds: np.ndarray  # int64 [n + 1] chunk cuts
    owner: np.ndarray  # int32 [n] rank of each chunk
    ranks: tuple  # RankPlan per rank
    mask_area: int
    topology: Topology | None
    digest: str
    candidates: dict = field(default_factory=dict, compare=False)  # solver name -> (imbalance, max remote)
    # guest rows (planner.guests): row runs computed by their keys' owners, and their cells
    guest_runs: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))
    guest_traps: np.ndarray = field(default_factory=lambda: np.zeros((0, 6), dtype=np.int64))
    # the mask's cells (int64 [n, 6] global trapezoids, ``AttnMask.traps``): the ranks' cells and the
    # guest cells together
    traps: np.ndarray = field(default_factory=lambda: np.zeros((0, 6), dtype=np.int64), repr=False)

    def local_ids(self, rank: int) -> np.ndarray:
        """Global token indices held by ``rank``, in its local order (int64 [s_local])."""
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank={rank} is outside this plan's cp_size={self.cp_size}")
        return self.ranks[rank].local_ids()

    def num_local(self, rank: int) -> int:
        return self.ranks[rank].num_tokens

    def computed_traps(self) -> np.ndarray:
        """The cells the ranks compute (their own rows, and guest cells), recovered from the ranks'
        trapezoids in global coordinates (int64 [n, 6], canonical): equals ``traps`` for a correct plan."""
        out = [self.guest_traps]
        for rp in self.ranks:
            segs = rp.segments
            off = np.concatenate([[0], np.cumsum(segs[:, 1] - segs[:, 0])])
            for i, (s, e) in enumerate(segs.tolist()):
                part = geometry.clip(rp.traps, int(off[i]), int(off[i + 1]), 0, 1 << 62)
                out.append(geometry.shift_rows(np.asarray(part, dtype=np.int64), s - int(off[i])))
        return geometry.union([tuple(t) for a in out for t in np.asarray(a).reshape(-1, 6).tolist()])

    @property
    def has_guests(self) -> bool:
        return len(self.guest_runs) > 0

    @cached_property
    def digest64(self) -> int:
        """The digest as a signed 63-bit int (for an all-reduce consistency check)."""
        return int(self.digest[:15], 16)

    def stats(self, *, num_kv_heads: int = 8, head_dim: int = 128, dtype_bytes: int | str = 2) -> dict:
        """Balance and traffic figures (a dict of ints, floats and per-rank lists).

        Bytes are priced for the shapes given, K and V of every received token:
        ``2 * num_kv_heads * head_dim * element size`` bytes per token. The defaults (8 K/V heads, head
        dim 128, 2-byte elements: bf16) are one common shape, not yours: pass your model's.
        ``dtype_bytes``: bytes per element, or a dtype name (``"bfloat16"``, ``"float32"``,
        ``"torch.float16"``, ...) or any object with ``itemsize`` (a torch or numpy dtype).
        """
        area = np.array([r.area for r in self.ranks], dtype=np.int64)
        remote = np.array([r.num_remote for r in self.ranks], dtype=np.int64)
        tokens = np.array([r.num_tokens for r in self.ranks], dtype=np.int64)
        per_token = kv_bytes_per_token(num_kv_heads, head_dim, dtype_bytes)
        mean = area.mean() if self.cp_size else 0.0
        out = {
            "solver": self.solver,
            "cp_size": self.cp_size,
            "seqlen": self.seqlen,
            "chunk_size": self.chunk_size,
            "num_chunks": len(self.owner),
            "mask_area": self.mask_area,
            "kv_bytes_per_token": per_token,
            "area_per_rank": area.tolist(),
            "imbalance": float(area.max() / mean - 1.0) if mean > 0 else 0.0,
            "tokens_per_rank": tokens.tolist(),
            "remote_kv_tokens_per_rank": remote.tolist(),
            "max_remote_kv_tokens": int(remote.max()),
            "bytes_moved": int(remote.sum() * per_token),
            "max_bytes_received": int(remote.max() * per_token),
            "tiles_per_rank": [len(r.tiles) for r in self.ranks],
            "guest_rows": int((self.guest_runs[:, 1] - self.guest_runs[:, 0]).sum()),
            # guest rows each rank computes for others (received q rows, self excluded)
            "guest_rows_in_per_rank": [sum(c for s, c in enumerate(r.guest_recv_counts()) if s != r.rank)
                                       for r in self.ranks],
        }
        if self.topology is not None:
            out["inter_node_bytes"] = int(self._inter_node_tokens() * per_token)
            g = self.topology.gpus_per_node
            nodes = [
                np.unique(np.concatenate([np.zeros(0, np.int64)] + [
                    runs_to_ids(runs) for r in self.ranks if r.rank // g == n
                    for src, runs in enumerate(r.recv_runs) if src // g != n
                ]))
                for n in range(self.topology.nodes)
            ]
            # what hierarchical routes move: each token once per destination node
            out["inter_node_bytes_hierarchical"] = int(sum(len(x) for x in nodes) * per_token)
        return out

    def describe(self, *, num_kv_heads: int = 8, head_dim: int = 128, dtype_bytes: int | str = 2) -> str:
        """What the planner did, as text: per rank its owned rows (tokens, runs), work (cells, and its
        share against the mean), received K/V (tokens and bytes), tiles and guest rows; then totals and
        the imbalance. Bytes are priced like ``stats`` (same arguments, same defaults: 8 K/V heads, head
        dim 128, 2-byte elements; pass your model's)."""
        st = self.stats(num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)
        per_tok = st["kv_bytes_per_token"]
        area = np.array(st["area_per_rank"], dtype=np.int64)
        mean = float(area.mean()) if len(area) else 0.0
        # own rows whose cells other ranks compute (guest rows sent out), per rank
        g_out = [run_tokens(merge_runs(np.concatenate([np.zeros((0, 2), np.int64)] + [
            runs for dst, runs in enumerate(r.guest_send_runs) if dst != r.rank]))) for r in self.ranks]
        topo = f", topology {self.topology.nodes} x {self.topology.gpus_per_node}" if self.topology else ""
        lines = [
            f"Plan: S = {self.seqlen:,} tokens over cp = {self.cp_size} ranks{topo}; solver {self.solver}, "
            f"chunk {self.chunk_size} (cut into {len(self.owner)} pieces, each one rank's); mask {self.mask_area:,} cells "
            f"({self.mask_area / float(self.seqlen) ** 2:.2%} dense)",
            f"K/V priced at {per_tok:,} bytes per token (2 x {num_kv_heads} heads x {head_dim} x "
            f"{element_size(dtype_bytes)} bytes)",
            "",
            f"{'rank':>4} {'tokens':>10} {'runs':>5} {'work (cells)':>16} {'vs mean':>8} "
            f"{'recv K/V tokens':>15} {'recv bytes':>12} {'tiles':>6} {'guest in':>8} {'guest out':>9}",
        ]
        for r in self.ranks:
            i = r.rank
            share = area[i] / mean - 1.0 if mean > 0 else 0.0
            lines.append(
                f"{i:>4} {st['tokens_per_rank'][i]:>10,} {len(r.segments):>5} {int(area[i]):>16,} {share:>+8.2%} "
                f"{st['remote_kv_tokens_per_rank'][i]:>15,} {fmt_bytes(st['remote_kv_tokens_per_rank'][i] * per_tok):>12} "
                f"{st['tiles_per_rank'][i]:>6} {st['guest_rows_in_per_rank'][i]:>8} {g_out[i]:>9}")
        lines.append(
            f"{'all':>4} {sum(st['tokens_per_rank']):>10,} {sum(len(r.segments) for r in self.ranks):>5} "
            f"{int(area.sum()):>16,} {'':>8} {sum(st['remote_kv_tokens_per_rank']):>15,} "
            f"{fmt_bytes(st['bytes_moved']):>12} {sum(st['tiles_per_rank']):>6} "
            f"{sum(st['guest_rows_in_per_rank']):>8} {sum(g_out):>9}")
        lines += [
            "",
            f"imbalance {st['imbalance']:.2%} (most work / mean work - 1: {int(area.max()):,} / {mean:,.0f} cells)",
            f"received K/V: at most {st['max_remote_kv_tokens']:,} tokens ({fmt_bytes(st['max_bytes_received'])}) "
            f"on one rank, {sum(st['remote_kv_tokens_per_rank']):,} tokens ({fmt_bytes(st['bytes_moved'])}) in all",
        ]
        if st["guest_rows"]:
            lines.append(f"guest rows: {st['guest_rows']:,} rows computed by their keys' owners "
                         "(guest in: rows of other ranks computed here; guest out: own rows computed elsewhere)")
        if "inter_node_bytes" in st:
            lines.append(f"between nodes: {fmt_bytes(st['inter_node_bytes'])} flat, "
                         f"{fmt_bytes(st['inter_node_bytes_hierarchical'])} routed once per node")
        return "\n".join(lines)

    def draw(self, path, **kwargs):
        """Save a picture of the plan to ``path`` (PNG, or any format matplotlib writes) and return the
        path: the mask's blocks coloured by the rank that computes them, each rank's owned rows, the
        K/V traffic matrix and per-rank work and received bytes (``planner.draw.draw_plan`` for the
        keywords). Needs matplotlib."""
        from .draw import draw_plan

        return draw_plan(self, path, **kwargs)

    def _inter_node_tokens(self) -> int:
        node = self.topology.node_of
        return sum(
            int((runs[:, 1] - runs[:, 0]).sum())
            for r in self.ranks
            for src, runs in enumerate(r.recv_runs)
            if node(src) != node(r.rank)
        )


def plan(
    mask: AttnMask,
    cp_size: int,
    *,
    chunk_size: int | None = None,
    topology: Topology | None = None,
    solver: str = "auto",
    imbalance_target: float = 0.03,
    guest_rows: str = "auto",
    block: int = 1,
) -> Plan:
    """Plan ``mask`` (self-attention, seqlen_q == seqlen_k) over ``cp_size`` ranks.

    Pure and deterministic: numpy only, the same inputs give the same plan (and ``digest``) on every
    rank. Any sequence length works; ranks' token counts differ by at most one chunk.
    ``solver``: ``auto`` | ``contiguous`` | ``zigzag`` | ``greedy`` | ``swap`` | ``documents`` |
    ``hierarchical`` (see ``planner.solvers``).
    ``imbalance_target``: ``auto`` prefers less traffic among candidates within this imbalance.
    ``guest_rows``: query rows computed by their keys' owners (``planner.guests``: the row travels
    instead of its keys). ``auto``: rows keeping at least half of all keys when they are few (at most
    half a rank's share) and the plan with them balances and moves fewer bytes; ``none``; or explicit
    sorted disjoint row runs ``[n, 2]`` (always used).
    ``block``: every chunk boundary a multiple of ``block`` (each rank holds whole blocks of ``block``
    tokens: what dynamic sparse attention needs, ``megatron_cp.sparse``); ``seqlen`` must be a multiple.
    """
    if not isinstance(mask, AttnMask):
        raise TypeError(f"plan() needs an AttnMask, got {type(mask).__name__}")
    if mask.seqlen_q != mask.seqlen_k:
        raise ValueError(
            f"plan() covers self-attention; mask has seqlen_q={mask.seqlen_q} != seqlen_k={mask.seqlen_k}"
        )
    if not isinstance(cp_size, (int, np.integer)) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    seqlen = mask.seqlen_q
    if cp_size > seqlen:
        raise ValueError(f"cp_size={cp_size} exceeds the sequence length {seqlen}")
    if solver not in solvers.SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose from {', '.join(solvers.SOLVERS)}")
    if chunk_size is not None and (int(chunk_size) < 1 or int(chunk_size) > seqlen):
        raise ValueError(f"chunk_size={chunk_size} must be in [1, {seqlen}]")
    if topology is not None and topology.world_size != cp_size:
        raise ValueError(f"topology {topology} has {topology.world_size} ranks, cp_size={cp_size}")
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1 or seqlen % block:
        raise ValueError(f"block={block!r} must be a positive int dividing the sequence length {seqlen}")
    if isinstance(imbalance_target, bool) or not isinstance(imbalance_target, (int, float, np.number)) \
            or not 0 <= imbalance_target < float("inf"):
        raise ValueError(f"imbalance_target must be a number >= 0 (the work imbalance auto accepts for less "
                         f"traffic, e.g. 0.03), got {imbalance_target!r}")
    cp = int(cp_size)
    chunk = int(chunk_size) if chunk_size is not None else auto_chunk(seqlen, cp)
    chunk = -(-chunk // block) * block
    traps = mask.traps
    row_prefix = geometry.row_area_prefix(traps, seqlen)
    cuts = solvers.independent_cuts(traps, seqlen)
    if isinstance(guest_rows, str):
        if guest_rows not in ("auto", "none"):
            raise ValueError(f"guest_rows must be 'auto', 'none' or row runs [n, 2], got {guest_rows!r}")
        wide = guest_rows == "auto" and 2 * guests.widest_row(traps, row_prefix) >= seqlen
        g_runs = guests.candidate_rows(row_prefix, seqlen, cp) if wide else np.zeros((0, 2), np.int64)
    else:
        g_runs = guests.check_runs(guest_rows, seqlen)
    args = (seqlen, cp, chunk, topology, solver, imbalance_target, cuts, int(block))

    best, bounds, owner, scores = choose(traps, row_prefix, KeySpans(traps, seqlen), *args)
    main, g_traps, prefix = traps, np.zeros((0, 6), dtype=np.int64), row_prefix
    if len(g_runs):
        # the same solvers with guest rows computed by their keys' owners; kept when given explicitly
        # or when it balances and moves fewer bytes (guest traffic and fixed cost in key tokens' units,
        # bytes crossing nodes weighted by the bandwidth ratio: guest traffic is not routed by node)
        m, g = guests.split(traps, g_runs, seqlen)
        gp = guests.load_prefix(m, g, seqlen)
        g_spans = KeySpans(m, seqlen)
        g_best, g_bounds, g_owner, g_scores = choose(m, gp, g_spans, *args)
        imb = evaluate(m, g_spans, g_bounds, g_owner, cp, gp)[0]
        units = (link_units(g_spans, g_bounds, g_owner, cp, topology) + guests.fixed_units()
                 + guests.traffic_units(guests.pair_rows(g, g_bounds, g_owner, cp), topology=topology))
        with_g = (imb, float(units.max()), float(units.sum()))
        plain = link_units(KeySpans(traps, seqlen), bounds, owner, cp, topology)
        without = (scores[best][0], float(plain.max()), float(plain.sum()))
        scores[f"{g_best}+guests"] = with_g
        ok, g_ok = without[0] <= imbalance_target, imb <= imbalance_target
        better = (g_ok and (not ok or with_g[1:] < without[1:])) or (not ok and not g_ok and imb < without[0])
        if not isinstance(guest_rows, str) or better:
            best, bounds, owner, main, g_traps, prefix = g_best, g_bounds, g_owner, m, g, gp
        else:
            g_runs = np.zeros((0, 2), dtype=np.int64)
    ranks = rank_plans(main, prefix, KeySpans(main, seqlen), bounds, owner, cp, g_traps)

    return Plan(
        cp_size=cp,
        seqlen=seqlen,
        solver=best if solver == "auto" else solver,
        chunk_size=chunk,
        bounds=bounds,
        owner=owner.astype(np.int32),
        ranks=ranks,
        mask_area=int(row_prefix[-1]),
        topology=topology,
        digest=plan_digest(cp, seqlen, chunk, bounds, owner, traps, g_runs),
        candidates=scores,
        guest_runs=g_runs,
        guest_traps=g_traps,
        traps=traps,
    )


def plan_like(mask: AttnMask, like: Plan) -> Plan:
    """A plan of ``mask`` with ``like``'s token layout (the same chunks on the same ranks, no guest
    rows): a second mask over tokens already dispatched by ``like``, e.g. the streaming heads'
    ``masks.streaming_within(mask, ...)`` beside the full heads' mask. Pure, like ``plan``."""
    if not isinstance(mask, AttnMask) or not isinstance(like, Plan):
        raise TypeError(f"plan_like(mask: AttnMask, like: Plan), got {type(mask).__name__}, {type(like).__name__}")
    if mask.seqlen_q != mask.seqlen_k or mask.seqlen_q != like.seqlen:
        raise ValueError(f"plan_like: mask [{mask.seqlen_q}, {mask.seqlen_k}] must be square with the layout's "
                         f"length {like.seqlen}")
    traps = mask.traps
    prefix = geometry.row_area_prefix(traps, like.seqlen)
    ranks = rank_plans(traps, prefix, KeySpans(traps, like.seqlen), like.bounds, like.owner, like.cp_size)
    return Plan(
        cp_size=like.cp_size,
        seqlen=like.seqlen,
        solver=f"like:{like.solver}",
        chunk_size=like.chunk_size,
        bounds=like.bounds,
        owner=like.owner,
        ranks=ranks,
        mask_area=int(prefix[-1]),
        topology=like.topology,
        digest=plan_digest(like.cp_size, like.seqlen, like.chunk_size, like.bounds, like.owner, traps),
        traps=traps,
    )


def plan_groups(masks, cp_size: int, **kwargs) -> Plan:
    """One plan over ``len(masks) * cp_size`` ranks of ``masks.block_diagonal(masks)`` with mask ``d`` (data-parallel
    group ``d``'s micro-batch) on ranks ``d * cp_size`` .. ``(d + 1) * cp_size - 1``, laid out there as
    ``plan(masks[d], cp_size, **kwargs)`` lays it: no token or key crosses groups, so each group keeps its own
    documents whole, as data parallelism does. The DP x CP world's plan with DP's layout: the candidate beside
    ``plan(block_diagonal(masks), len(masks) * cp_size)`` (balanced over every rank) that
    ``runtime.plan_over_dp`` weighs; with ``cp_size`` 1 nothing moves at all. ``kwargs``: ``plan``'s, for each
    group (a ``topology`` describes one group's ``cp_size`` ranks). Pure, like ``plan``."""
    from ..masks.builders import block_diagonal

    masks = list(masks)
    whole = block_diagonal(masks)  # refuses an empty list and non-square masks, naming the mask
    groups = [plan(m, cp_size, **kwargs) for m in masks]
    offs = np.concatenate([[0], np.cumsum([m.seqlen_q for m in masks])]).astype(np.int64)
    cp, seqlen = int(cp_size), int(offs[-1])
    bounds = np.concatenate([g.bounds[:-1] + o for g, o in zip(groups, offs)] + [offs[-1:]]).astype(np.int64)
    owner = np.concatenate([g.owner.astype(np.int64) + d * cp for d, g in enumerate(groups)])
    g_runs = np.concatenate([g.guest_runs + o for g, o in zip(groups, offs)]).reshape(-1, 2).astype(np.int64)
    traps = whole.traps
    if len(g_runs):  # the groups' guest rows, laid out as each group's plan chose them
        main, g_traps = guests.split(traps, g_runs, seqlen)
        prefix = guests.load_prefix(main, g_traps, seqlen)
    else:
        main, g_traps, prefix = traps, np.zeros((0, 6), dtype=np.int64), geometry.row_area_prefix(traps, seqlen)
    chunk = min(g.chunk_size for g in groups)
    ranks = rank_plans(main, prefix, KeySpans(main, seqlen), bounds, owner, cp * len(masks), g_traps)
    return Plan(
        cp_size=cp * len(masks),
        seqlen=seqlen,
        solver="groups:" + ",".join(sorted({g.solver for g in groups})),
        chunk_size=chunk,
        bounds=bounds,
        owner=owner.astype(np.int32),
        ranks=ranks,
        mask_area=int(geometry.row_area_prefix(traps, seqlen)[-1]),
        topology=None,
        digest=plan_digest(cp * len(masks), seqlen, chunk, bounds, owner, traps, g_runs),
        guest_runs=g_runs,
        guest_traps=g_traps,
        traps=traps,
    )


def plan_digest(cp_size: int, seqlen: int, chunk_size: int, bounds, owner, traps, guest_runs=None) -> str:
    """The digest every rank derives for the same layout of the same mask (checked across ranks
    before the first exchange); every Plan constructor uses this rule."""
    h = hashlib.sha256(_VERSION)
    parts = [np.array([cp_size, seqlen, chunk_size]), bounds, owner, traps]
    if guest_runs is not None and len(guest_runs):
        parts.append(np.asarray(guest_runs).reshape(-1))
    for a in parts:
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return h.hexdigest()


