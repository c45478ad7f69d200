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
from .topology import Topology
from .units import fmt_bytes

_VERSION = b"megatron-cp-plan-1"


def _merge_runs(runs: np.ndarray) -> np.ndarray:
    """Sort and merge touching/overlapping half-open runs; int64 [n, 2]."""
    if len(runs) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    runs = runs[np.argsort(runs[:, 0], kind="stable")]  # the order of equal starts changes no merged run
    start, end = runs[:, 0], np.maximum.accumulate(runs[:, 1])
    new = np.empty(len(runs), dtype=bool)
    new[0] = True
    np.greater(start[1:], end[:-1], out=new[1:])
    idx = np.flatnonzero(new)
    ends = np.empty_like(idx)
    ends[:-1], ends[-1] = idx[1:] - 1, len(runs) - 1
    return np.stack([start[idx], end[ends]], axis=1).astype(np.int64, copy=False)


def _subtract_runs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Runs of ``a`` minus runs of ``b`` (both merged and sorted)."""
    out = []
    j = 0
    for s, e in a.tolist():
        while j < len(b) and b[j, 1] <= s:
            j += 1
        k = j
        while s < e and k < len(b) and b[k, 0] < e:
            if b[k, 0] > s:
                out.append((s, int(b[k, 0])))
            s = max(s, int(b[k, 1]))
            k += 1
        if s < e:
            out.append((s, e))
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def _positions(runs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Index of global token ``x`` in the concatenation of sorted ``runs`` (x must be covered)."""
    off = np.concatenate([[0], np.cumsum(runs[:, 1] - runs[:, 0])])
    i = np.searchsorted(runs[:, 0], x, side="right") - 1
    return off[i] + x - runs[i, 0]


def _run_tokens(runs: np.ndarray) -> int:
    return int((runs[:, 1] - runs[:, 0]).sum())


def _runs_to_ids(runs: np.ndarray) -> np.ndarray:
    if len(runs) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in runs.tolist()])


# Run algebra over many groups at once (ranks or nodes): run [s, e) of group g is encoded as
# [g * W + s, g * W + e) with W = seqlen + 1, so one sort or merge serves every group and no run of one
# group touches another's.


def _encode(runs: np.ndarray, group, W: int) -> np.ndarray:
    return runs + (np.asarray(group, dtype=np.int64) * W)[:, None]


def _decode(enc: np.ndarray, W: int) -> tuple[np.ndarray, np.ndarray]:
    """(runs, group) of encoded runs."""
    g = enc[:, 0] // W
    return enc - (g * W)[:, None], g


def _subtract_merged(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Maximal runs of ``a`` minus ``b`` (each merged: disjoint, sorted), by a sweep: between event
    positions, coverage ``in_a + 2 * in_b`` is 1 exactly where ``a`` is kept."""
    pos = np.concatenate([a[:, 0], a[:, 1], b[:, 0], b[:, 1]])
    step = np.repeat(np.array([1, -1, 2, -2], dtype=np.int64), [len(a), len(a), len(b), len(b)])
    o = np.argsort(pos, kind="stable")
    pos, cover = pos[o], np.cumsum(step[o])
    keep = (cover[:-1] == 1) & (pos[1:] > pos[:-1])
    return _merge_runs(np.stack([pos[:-1][keep], pos[1:][keep]], axis=1))


def _remote_all(ci, k0, k1, bounds, group) -> tuple[np.ndarray, np.ndarray]:
    """(own runs, remote key runs), encoded by group: per group (``group[c]`` of chunk ``c``: a rank or
    a node), its chunks' merged runs and the merged keys its chunks' rows need (key spans ``(ci, k0,
    k1)`` of ``KeySpans.spans(bounds)``) that it does not own."""
    W = int(bounds[-1]) + 1
    group = np.asarray(group, dtype=np.int64)
    own = _merge_runs(_encode(np.stack([bounds[:-1], bounds[1:]], axis=1), group, W))
    need = _merge_runs(_encode(np.stack([k0, k1], axis=1), group[ci], W))
    return own, _subtract_merged(need, own)


def _remote_counts(ci, k0, k1, bounds, group, n: int) -> np.ndarray:
    """Per group (``group[c]`` of chunk ``c``, ``n`` groups), the key tokens its chunks' rows need (key
    spans ``(ci, k0, k1)``) that it does not own (int64 [n]), by one sweep over the encoded spans (+1
    each) and chunks (+m each, m = spans + 1): a stretch is remote where the count lies in (0, m)."""
    W = int(bounds[-1]) + 1
    off = np.asarray(group, dtype=np.int64) * W
    m = len(k0) + 1
    pos = np.concatenate([k0 + off[ci], k1 + off[ci], bounds[:-1] + off, bounds[1:] + off])
    step = np.repeat(np.array([1, -1, m, -m], dtype=np.int64), [len(k0), len(k0), len(off), len(off)])
    o = np.argsort(pos, kind="stable")
    pos, cover = pos[o], np.cumsum(step[o])[:-1]
    keep = (cover > 0) & (cover < m)
    return np.bincount(pos[:-1][keep] // W, weights=np.diff(pos)[keep], minlength=n).astype(np.int64)


def _split_at_chunks(runs, group, bounds, owner) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Non-empty runs cut at the chunk bounds: (pieces [n, 2], each piece's run's group, the rank owning
    its chunk)."""
    c0 = np.searchsorted(bounds, runs[:, 0], side="right") - 1
    n = np.searchsorted(bounds, runs[:, 1], side="left") - c0
    ri = np.repeat(np.arange(len(runs)), n)
    c = np.repeat(c0, n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    pieces = np.stack([np.maximum(runs[ri, 0], bounds[c]), np.minimum(runs[ri, 1], bounds[c + 1])], axis=1)
    return pieces, group[ri], np.asarray(owner, dtype=np.int64)[c]


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
        return _runs_to_ids(self.segments)

    def remote_ids(self) -> np.ndarray:
        """Global ids of every key/value token this rank receives, sorted (int64)."""
        runs = [r for r in self.recv_runs if len(r)]
        return _runs_to_ids(_merge_runs(np.concatenate(runs))) if runs else np.zeros(0, dtype=np.int64)

    def send_index(self) -> tuple[np.ndarray, list[int]]:
        """Local positions to send, concatenated in destination order, and per-destination counts."""
        idx = [_positions(self.segments, _runs_to_ids(r)) for r in self.send_runs]
        return np.concatenate(idx).astype(np.int64), [len(i) for i in idx]

    def recv_counts(self) -> list[int]:
        return [int((r[:, 1] - r[:, 0]).sum()) for r in self.recv_runs]

    def buffer_index(self) -> tuple[np.ndarray, np.ndarray]:
        """Positions in the key/value buffer of (own tokens in local order, received tokens in
        receive order: by source rank, then global order)."""
        own = _positions(self.buffer_runs, self.local_ids())
        recv = [_runs_to_ids(r) for r in self.recv_runs]
        rid = np.concatenate(recv) if recv else np.zeros(0, dtype=np.int64)
        return own.astype(np.int64), _positions(self.buffer_runs, rid).astype(np.int64)

    @property
    def buffer_len(self) -> int:
        return int((self.buffer_runs[:, 1] - self.buffer_runs[:, 0]).sum())

    def guest_send_index(self) -> tuple[np.ndarray, list[int]]:
        """Local positions of the guest rows to send, in destination order, and per-destination counts
        (all zero without guest rows)."""
        if not self.guest_send_runs:
            return np.zeros(0, dtype=np.int64), []
        idx = [_positions(self.segments, _runs_to_ids(r)) for r in self.guest_send_runs]
        return np.concatenate(idx).astype(np.int64), [len(i) for i in idx]

    def guest_recv_counts(self) -> list[int]:
        return [int((r[:, 1] - r[:, 0]).sum()) for r in self.guest_recv_runs]


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
                    _runs_to_ids(runs) for r in self.ranks if r.rank // g == n
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
        g_out = [_run_tokens(_merge_runs(np.concatenate([np.zeros((0, 2), np.int64)] + [
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


def _auto_chunk(seqlen: int, cp: int) -> int:
    """About 16 chunks per rank, a power of two between 1 and 4096."""
    c = max(1, seqlen // (16 * cp))
    return int(min(4096, 1 << (c.bit_length() - 1)))


def _evaluate(traps, spans, bounds, owner, cp, prefix):
    """Area and remote-key tokens per rank of an assignment (cheap: no tiles)."""
    area = np.bincount(owner, weights=prefix[bounds[1:]] - prefix[bounds[:-1]], minlength=cp).astype(np.int64)
    remote = _remote_counts(*spans.spans(bounds), bounds, owner, cp)
    mean = area.mean()
    imb = float(area.max() / mean - 1.0) if mean > 0 else 0.0
    return imb, remote


def _remote_tokens(spans, bounds, owner, cp) -> np.ndarray:
    """``M[r, s]``: key tokens rank ``r`` receives from rank ``s`` (int64 [cp, cp])."""
    ci, k0, k1 = spans.spans(bounds)
    rem = _remote_all(ci, k0, k1, bounds, owner)[1]
    pieces, dst, src = _split_at_chunks(*_decode(rem, int(bounds[-1]) + 1), bounds, owner)
    M = np.zeros((cp, cp), dtype=np.int64)
    np.add.at(M, (dst, src), pieces[:, 1] - pieces[:, 0])
    return M


def _link_units(spans, bounds, owner, cp, topology) -> np.ndarray:
    """Per rank, the remote K/V tokens it receives, those from another node weighted by the topology's
    intra / inter-node bandwidth ratio (float64 [cp]; the guest rows' comparison)."""
    multi = topology is not None and topology.nodes > 1
    ratio = topology.intra_node_gbps / topology.inter_node_gbps if multi else 1.0
    g = topology.gpus_per_node if multi else cp
    M = _remote_tokens(spans, bounds, owner, cp).astype(np.float64)
    node = np.arange(cp) // g
    out = np.zeros(cp)
    for src in range(cp):  # sources in order, as the sum per rank always ran
        out += M[:, src] * np.where(node != src // g, ratio, 1.0)
    return out


def _score(traps, spans, bounds, owner, cp, prefix):
    imb, remote = _evaluate(traps, spans, bounds, owner, cp, prefix)
    return (imb, int(remote.max()), int(remote.sum()))


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
    chunk = int(chunk_size) if chunk_size is not None else _auto_chunk(seqlen, cp)
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

    best, bounds, owner, scores = _choose(traps, row_prefix, solvers.KeySpans(traps, seqlen), *args)
    main, g_traps, prefix = traps, np.zeros((0, 6), dtype=np.int64), row_prefix
    if len(g_runs):
        # the same solvers with guest rows computed by their keys' owners; kept when given explicitly
        # or when it balances and moves fewer bytes (guest traffic and fixed cost in key tokens' units,
        # bytes crossing nodes weighted by the bandwidth ratio: guest traffic is not routed by node)
        m, g = guests.split(traps, g_runs, seqlen)
        gp = guests.load_prefix(m, g, seqlen)
        g_spans = solvers.KeySpans(m, seqlen)
        g_best, g_bounds, g_owner, g_scores = _choose(m, gp, g_spans, *args)
        imb = _evaluate(m, g_spans, g_bounds, g_owner, cp, gp)[0]
        units = (_link_units(g_spans, g_bounds, g_owner, cp, topology) + guests.fixed_units()
                 + guests.traffic_units(guests.pair_rows(g, g_bounds, g_owner, cp), topology=topology))
        with_g = (imb, float(units.max()), float(units.sum()))
        plain = _link_units(solvers.KeySpans(traps, seqlen), bounds, owner, cp, topology)
        without = (scores[best][0], float(plain.max()), float(plain.sum()))
        scores[f"{g_best}+guests"] = with_g
        ok, g_ok = without[0] <= imbalance_target, imb <= imbalance_target
        better = (g_ok and (not ok or with_g[1:] < without[1:])) or (not ok and not g_ok and imb < without[0])
        if not isinstance(guest_rows, str) or better:
            best, bounds, owner, main, g_traps, prefix = g_best, g_bounds, g_owner, m, g, gp
        else:
            g_runs = np.zeros((0, 2), dtype=np.int64)
    ranks = _rank_plans(main, prefix, solvers.KeySpans(main, seqlen), bounds, owner, cp, g_traps)

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


def _snap(bounds: np.ndarray, owner: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Move every cut to the nearest multiple of ``block``; a chunk keeps the owner of the original chunk
    holding its first token (chunks that vanish are dropped)."""
    snapped = np.unique(np.round(np.asarray(bounds, dtype=np.float64) / block).astype(np.int64) * block)
    starts = snapped[:-1]
    o = np.asarray(owner)[np.searchsorted(bounds, starts, side="right") - 1]
    return snapped, o


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
    ranks = _rank_plans(traps, prefix, solvers.KeySpans(traps, like.seqlen), like.bounds, like.owner, like.cp_size)
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


def _choose(traps, prefix, spans, seqlen, cp, chunk, topology, solver, tol, cuts, block=1):
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
    kw = dict(prefix=prefix, chunk_size=chunk, key_spans=spans, tol=tol)
    if solver in ("greedy", "auto"):
        candidates["greedy"] = solvers.greedy(seqlen, cp, **kw)
    if solver in ("swap", "auto"):
        candidates["swap"] = solvers.swap_balanced(seqlen, cp, **kw)
    if solver == "documents" or (solver == "auto" and len(cuts) - 1 > cp):
        candidates["documents"] = solvers.documents(seqlen, cp, prefix=prefix, traps=traps, tol=tol, cuts=cuts)
    multi_node = topology is not None and topology.nodes > 1
    if (multi_node and solver == "auto") or solver == "hierarchical":
        topo = topology if topology is not None else Topology(1, cp)
        candidates.update(_hierarchical(traps, spans, prefix, seqlen, topo, chunk, tol, cuts))
    if block > 1:
        candidates = {n: _snap(b, o, block) for n, (b, o) in candidates.items()}
    scores = {}
    for name, (b, o) in candidates.items():
        scores[name] = _score(traps, spans, b, o, cp, prefix)
        if multi_node:  # least inter-node traffic first (deduplicated per destination node)
            scores[name] = (scores[name][0], _inter_node_max(spans, b, o, topology), *scores[name][1:])
    if solver == "auto" and not any(sc[0] <= tol for sc in scores.values()):
        # nothing balances whole chunks: deal the heaviest chunks out in pieces (dense rows)
        candidates["greedy_split"] = solvers.greedy(seqlen, cp, split_heavy=True, **kw)
        if block > 1:
            candidates["greedy_split"] = _snap(*candidates["greedy_split"], block)
        scores["greedy_split"] = _score(traps, spans, *candidates["greedy_split"], cp, prefix)
    # least traffic among balanced candidates; otherwise the best balanced one
    ok = [n for n in candidates if scores[n][0] <= tol]
    key = (lambda n: (scores[n][1], scores[n][2], scores[n][0])) if ok else (lambda n: scores[n][0])
    best = min(ok or list(candidates), key=key)
    return best, *candidates[best], scores


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


def _inter_node_max(spans, bounds, owner, topology) -> int:
    """Most key tokens any node receives from other nodes (each token once per node)."""
    node = np.asarray(owner, dtype=np.int64) // topology.gpus_per_node
    return int(_remote_counts(*spans.spans(bounds), bounds, node, topology.nodes).max())


def _hierarchical(traps, spans, prefix, seqlen, topology, chunk, tol, cuts):
    nodes = topology.nodes
    kw = dict(prefix=prefix, chunk_size=chunk, key_spans=spans, tol=tol)
    node_cands = [solvers.contiguous(seqlen, nodes)]
    if nodes > 1:
        node_cands.append(solvers.zigzag(seqlen, nodes))
        node_cands.append(solvers.greedy(seqlen, nodes, **kw))
        node_cands.append(solvers.swap_balanced(seqlen, nodes, **kw))
        if len(cuts) - 1 > nodes:
            node_cands.append(solvers.documents(seqlen, nodes, prefix=prefix, traps=traps, tol=tol, cuts=cuts))
    flat = Topology(nodes, 1)

    def key(bo):
        imb = _score(traps, spans, bo[0], bo[1], nodes, prefix)[0]
        return (imb > tol / 2, _inter_node_max(spans, bo[0], bo[1], flat), imb)

    best = min(node_cands, key=key)
    g = topology.gpus_per_node
    out = {"hierarchical": solvers.hierarchical(seqlen, topology.world_size, gpus_per_node=g, node_layout=best, **kw)}
    if len(cuts) - 1 > topology.world_size:  # and whole documents per GPU inside each node
        out["hierarchical_documents"] = solvers.node_documents(
            seqlen, topology.world_size, prefix=prefix, tol=tol, gpus_per_node=g, node_layout=best, cuts=cuts)
    return out


def _rank_plans(traps, prefix, spans, bounds, owner, cp, guest_traps=None) -> tuple:
    """Every rank's ``RankPlan`` for the layout (``bounds``, ``owner``) of ``traps`` (canonical, as
    ``AttnMask.traps``: every row non-empty, keys in [0, seqlen]). All ranks are built together with the
    run algebra over groups below (no loop over ranks or trapezoids in Python)."""
    bounds, owner = np.asarray(bounds, dtype=np.int64), np.asarray(owner)
    W = int(bounds[-1]) + 1
    ci, k0, k1 = spans.spans(bounds)
    own, rem = _remote_all(ci, k0, k1, bounds, owner)
    seg, seg_g = _decode(own, W)
    seg_at = np.searchsorted(seg_g, np.arange(cp + 1))
    # received runs by (destination, source): remote runs cut at chunk bounds, merged per pair
    pieces, dst, src = _split_at_chunks(*_decode(rem, W), bounds, owner)
    recv, pair = _decode(_merge_runs(_encode(pieces, dst * cp + src, W)), W)
    recv_at = np.searchsorted(pair, np.arange(cp * cp + 1))
    recv_runs = [tuple(recv[recv_at[d * cp + s]:recv_at[d * cp + s + 1]] for s in range(cp)) for d in range(cp)]
    buf = _merge_runs(np.concatenate([own, rem]))  # each rank's key/value buffer, encoded
    buf_at = np.searchsorted(buf[:, 0] // W, np.arange(cp + 1))
    local, local_g = _local_traps(traps, seg, seg_g, seg_at)
    tiles = _tiles(local, local_g, buf, buf_at, W, cp)
    local_at = np.searchsorted(local_g, np.arange(cp + 1))
    seg_area = np.concatenate([[0], np.cumsum(prefix[seg[:, 1]] - prefix[seg[:, 0]])])
    g_send = _guest_send(guest_traps, bounds, owner, cp)
    out = []
    for r in range(cp):
        segs = seg[seg_at[r]:seg_at[r + 1]]
        g_recv = tuple(g_send[src][r] for src in range(cp)) if g_send else ()
        out.append(
            RankPlan(
                rank=r,
                segments=segs,
                recv_runs=recv_runs[r],
                send_runs=tuple(recv_runs[dst][r] for dst in range(cp)),
                buffer_runs=_decode(buf[buf_at[r]:buf_at[r + 1]], W)[0],
                tiles=tiles[r],
                traps=local[local_at[r]:local_at[r + 1]],
                area=int(seg_area[seg_at[r + 1]] - seg_area[seg_at[r]]),
                guest_send_runs=tuple(g_send[r]) if g_send else (),
                guest_recv_runs=g_recv,
                guest_tiles=_guest_tiles(guest_traps, g_recv, segs) if g_send else np.zeros((0, 5), np.int32),
            )
        )
    return tuple(out)


def _guest_send(guest_traps, bounds, owner, cp) -> list | None:
    """``send[a][b]``: runs of rank a's guest rows with a cell on rank b's keys; None without guests."""
    if guest_traps is None or len(guest_traps) == 0:
        return None
    rows, has = guests.row_ranks(guest_traps, bounds, owner, cp)
    row_owner = np.asarray(owner)[np.searchsorted(bounds, rows, side="right") - 1]
    return [[guests.ids_to_runs(rows[(row_owner == a) & has[:, b]]) for b in range(cp)] for a in range(cp)]


def _guest_tiles(guest_traps, recv_runs, segs) -> np.ndarray:
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


def _local_traps(traps, seg, seg_g, seg_at) -> tuple[np.ndarray, np.ndarray]:
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


# kind of a trapezoid by its (lo slope, hi slope), and the slopes of a kind
_KIND = np.array([[geometry.trap_to_slice((0, 1, 0, lo, 1, hi))[4] for hi in (0, 1)] for lo in (0, 1)])
_LO_S, _HI_S = np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.int64)
_LO_S[_KIND], _HI_S[_KIND] = np.array([[0, 0], [1, 1]]), np.array([[0, 1], [0, 1]])


def _tiles(local, local_g, buf, buf_at, W, cp) -> list[np.ndarray]:
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
    return _merge_tiles(tiles, local_g, cp)


def _merge_tiles(tiles, g, cp) -> list[np.ndarray]:
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
