"""A small cost model: kernel time per tile shape and collective time per link, from calibrated numbers.

Every figure is per GPU. ``tools/sim/calibrate.py`` measures them on a machine and writes JSON that
``CostModel.load`` reads; the defaults are one such calibration of a single NVLink node (docs/cost-model.md).

Kernel time of a tile list (the kernel merges tiles sharing rows, so a row's cost follows the keys it
keeps over the whole list): ``launch_us + n_tiles * tile_us + (cells + half_keys * rows) / peak`` (in
FLOPs), i.e. a tile runs at ``peak * keys / (keys + half_keys)`` with ``keys`` the mean kept keys of its
rows: short rows run below peak because per-row work weighs more. The backend runs a list in one of
three classes, each with its own block shapes and, when calibrated, its own fitted numbers:

- "long" (mean kept keys per covered row >= the kernels' ``LONG_ROW_KEYS``): ``fwd_tflops`` / ``bwd_tflops`` /
  ``half_keys``, ``cells`` = kept cells;
- "blocky" (short rows whose forward blocks are mostly full (the kernels' ``BLOCKY_FULL_FRACTION``):
  documents, strided blocks, banded blocks, windows of 1024 to 4096 keys) and "short" (the other short
  lists: narrow sliding windows): ``blocky_*`` / ``short_*``, ``cells`` = the cells of every block the
  kernel visits, since a partly kept block costs a whole one (forward blocks of the class, ``bwd_block``
  backward); a blocky list mostly of band cells runs at ``blocky_band_*`` peaks.

A "blocky" forward list with a few very long rows among short ones (global rows) lasts at least as long
as those rows' programs (one per q block and head), which start first, run at ``row_share`` of their
multiprocessor's share of the list's rate while other programs run, and at ``row_alone_tflops`` after
(``long_rows``; calibrated).

Dense pieces (``dense_fwd_tflops > 0``): the kernel backend runs full rectangles and square causal
pieces of at least ``dense_min_rows`` x ``dense_min_keys`` on cuDNN, and in the forward bands cut into
squares (``band_squares``); the rest stays on Triton and is classed as above. The split is the kernels'
own (``kernels.pieces``: the cost model calls it, it never restates it); a piece of ``rows`` x
``keys`` costs
``flops(cells + dense_half_keys * rows + dense_half_rows * keys) / dense peak`` (short and narrow pieces
run below peak: per-row and per-key-column work), over the piece's wave efficiency (``num_sms``), plus ``dense_piece_us`` and one LSE merge (``merge_bytes_per_row`` per
query row and head at ``hbm_gbps``) per piece. The row class and the count of visited blocks are the kernels'
too (``kernels.pieces.row_class`` / ``block_counts``).
Collective time: ``latency_us + intra_bytes / intra_gbps + inter_bytes / inter_gbps`` (per GPU, the
busiest GPU's bytes of one collective; links of different kinds run concurrently, so it is the max).
One neighbour's point-to-point transfer (the ring baseline's step): ``p2p_time``, measured at two sizes.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch

from ..kernels import pieces
from ..kinds import Kind
from ..planner import LINKS, Workload

# fields of older calibration files that no longer mean anything (the options they described were
# removed, or the rule is now the kernels' own): dropped on load
_RETIRED = frozenset({"band_chunk", "band_min_keys", "long_row_keys", "blocky_full_fraction"})


@dataclass(frozen=True)
class CostModel:
    # defaults: one run of tools/sim/calibrate.py on a single NVLink node (docs/cost-model.md names it)
    fwd_tflops: float = 420.0  # Triton attention forward on long rows (mask-area FLOPs), per GPU
    bwd_tflops: float = 370.0  # backward, counted as 2.5x the forward FLOPs
    half_keys: float = 216.0  # mean kept keys per row at which a tile runs at half of peak
    tile_us: float = 1.0  # fixed cost per tile
    launch_us: float = 90.0  # fixed cost per kernel call (one per stage)
    # links: planner.LINKS until a calibration measures them (the planner weighs bytes with the same)
    intra_gbps: float = LINKS.intra_gbps  # achieved all-to-all bandwidth per GPU inside a node (GB/s)
    inter_gbps: float = LINKS.inter_gbps  # achieved per GPU between nodes (400 Gb/s NIC per GPU)
    p2p_gbps: float = 250.0  # one neighbour's send|receive pair inside a node (the ring baseline's steps)
    # the same transfer measured at twice p2p_bytes: NCCL's point-to-point time is not proportional to
    # the bytes (half the bytes took most of the time: docs/cost-model.md);
    # p2p_time interpolates between the two (0: p2p_gbps at any size)
    p2p_big_gbps: float = 0.0
    p2p_bytes: float = 128 * 2**20
    latency_us: float = LINKS.latency_us  # fixed cost per collective
    dense_fwd_tflops: float = 680.0  # cuDNN full pieces (0: no dense path modelled)
    dense_bwd_tflops: float = 565.0
    dense_causal_fwd_tflops: float = 680.0  # cuDNN square causal pieces (0: as full ones)
    dense_causal_bwd_tflops: float = 565.0
    dense_min_rows: int = 512  # TritonConfig.dense_min_rows / dense_min_keys
    dense_min_keys: int = 8192
    # TritonConfig.band_squares: forward only, bands of at least this window and rows run as batched
    # cuDNN squares (a reversed one on flipped copies, merged with its causal partner in one pass); a
    # calibration file without the field predates band squares (its backend ran bands on Triton): 0
    band_squares: int = 4096
    dense_piece_us: float = 30.0  # fixed cost per cuDNN piece (launches, slicing)
    hbm_gbps: float = 3000.0  # memory bandwidth of the LSE merge of a piece
    split_gbps: float = 0.0  # head-splitting copies (Ulysses' send and receive layouts); 0: hbm_gbps
    # staged runtime: each stage's call also streams the running output (fwd: fp32 out read + written)
    # and the gradient sums (bwd: dQ fp32 accumulate, delta, dK/dV concat), bytes per element of
    # [s_local, Hq, D]; the single-exchange path (stages=0) has none of these
    stage_fwd_bytes: float = 8.0
    stage_bwd_bytes: float = 16.0
    # fixed time of one attention call from the caller to its first GPU work and back (host-side
    # dispatch, autograd, launches, a tiny collective), not overlapped when each call is timed alone:
    # tools/sim/calibrate.py times a tiny distributed call; the defaults are a profile's host lead before
    # the first kernel (docs/cost-model.md)
    call_fwd_us: float = 200.0
    call_bwd_us: float = 400.0
    # short-row class: the kernel backend runs lists whose mean kept keys per covered row is below
    # its LONG_ROW_KEYS with other block shapes (``kernels.pieces.row_class``), whose rate is
    # fitted separately (peak and half-efficiency keys from two row lengths); 0: the long-row numbers
    short_fwd_tflops: float = 0.0
    short_bwd_tflops: float = 0.0
    short_half_keys: float = 0.0
    short_bwd_half_keys: float = 0.0  # 0: short_half_keys
    short_block_m: int = 64  # forward block of the short class (the backend's config for the head dim)
    short_block_n: int = 64
    # "blocky" class: short lists whose blocky_block forward blocks are mostly full (the backend's
    # BLOCKY_FULL_FRACTION); 0: the short class's numbers
    blocky_fwd_tflops: float = 0.0
    blocky_bwd_tflops: float = 0.0
    blocky_half_keys: float = 0.0
    blocky_bwd_half_keys: float = 0.0
    blocky_block_m: int = 128
    blocky_block_n: int = 64
    # blocky lists that are mostly band cells (BI_CAUSAL tiles: sliding windows of 1024 to 4096 keys) run
    # at their own peaks, with the blocky half terms and blocks: a 2048-key band's backward measured
    # faster in the runtime than the blocky fit, made on documents, predicted;
    # 0: the blocky numbers. Calibrated it narrows that gap
    # only a little (kernel alone 1.14x): docs/cost-model.md
    blocky_band_fwd_tflops: float = 0.0
    blocky_band_bwd_tflops: float = 0.0
    bwd_block_m: int = 64  # backward blocks (dQ and dK/dV kernels) of the short and blocky classes
    bwd_block_n: int = 64
    # dense pieces with few keys or few rows run below the dense peak: a piece costs
    # cells + dense_half_keys * rows + dense_half_rows * keys cells at the peak
    dense_half_keys: float = 0.0
    dense_bwd_half_keys: float = 0.0
    dense_half_rows: float = 0.0
    dense_bwd_half_rows: float = 0.0
    # a dense piece runs ceil(rows / dense_block) x Hq programs forward (ceil(keys / dense_block) x Hq
    # backward) in waves over num_sms multiprocessors: a last partial wave idles the rest (few heads
    # and rows, as Ulysses' head groups have); 0: not modelled
    num_sms: int = 0
    dense_block: int = 128
    # measured full pieces (tools/sim/calibrate.py): TFLOP/s of a rows x keys piece on a grid of rows x keys
    # (row-major, ``dense_grid_heads`` query heads); when present, a full piece's rate is read off it
    # (bilinear in log2 rows and keys, clamped to the grid's edges) instead of the peak and half terms
    # above, which square causal pieces keep using
    dense_grid_rows: tuple = ()
    dense_grid_keys: tuple = ()
    dense_grid_fwd_tflops: tuple = ()
    dense_grid_bwd_tflops: tuple = ()
    dense_grid_heads: int = 0
    # a forward program (one q block, one head) walks every k block of its row: a list with a few very
    # long rows among short ones (global rows) lasts at least as long as those programs. A long program
    # runs at row_share of its multiprocessor's share of the list's rate while other programs run beside
    # it, at row_alone_tflops once they are done (tools/sim/calibrate.py measures both in the "blocky" class,
    # and the model applies them to that class's lists; 0, or num_sms 0: not modelled)
    row_alone_tflops: float = 0.0
    row_share: float = 0.0
    source: str = "default"  # where the numbers came from (calibration file, device)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)

    @classmethod
    def load(cls, path: str) -> "CostModel":
        with open(path) as f:
            raw = json.load(f)
        known = {f.name for f in fields(cls)}
        raw = {k: v for k, v in raw.items() if k not in _RETIRED}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{path}: unknown cost-model fields {unknown}; known: {sorted(known)}")
        raw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
        raw.setdefault("band_squares", 0)  # calibrated before the backend had band squares
        m = cls(**raw)
        g = (len(m.dense_grid_rows), len(m.dense_grid_keys))
        if g[0] * g[1] and (len(m.dense_grid_fwd_tflops) != g[0] * g[1] or len(m.dense_grid_bwd_tflops) != g[0] * g[1]):
            raise ValueError(f"{path}: dense grid of {g[0]} x {g[1]} shapes needs {g[0] * g[1]} rates per phase, got "
                             f"{len(m.dense_grid_fwd_tflops)} / {len(m.dense_grid_bwd_tflops)}")
        return m

    def rest_tiles(self, tiles: np.ndarray, backward: bool = False) -> np.ndarray:
        """The part of ``tiles`` the kernel backend runs in its own kernels (all of it without a dense path): the
        rest after the dense (cuDNN) pieces ``tile_time`` costs separately (forward: after band squares too)."""
        tiles = np.asarray(tiles, dtype=np.int64).reshape(-1, 5)
        if self.dense_fwd_tflops <= 0 or not len(tiles):
            return tiles
        return self._pieces(tiles, backward, 1)[1]

    def _pieces(self, tiles: np.ndarray, backward: bool, key_split: int, accumulate: bool = False):
        """(dense pieces as arrays (rows, keys, cells, causal, batch, reverse) over calls, the rest, direct) of
        one call, as the kernels split it (``kernels.pieces.split_pieces``); (None, tiles, False) when nothing
        runs on cuDNN. ``reverse``: a band square run on flipped copies; ``direct``: the forward writes its
        band-square pairs straight into its output (an accumulating forward never does). ``key_split`` > 1
        stands for one of that many calls over equal key pieces: a piece must then be that much wider."""
        p = pieces.split_pieces(_torch_tiles(tiles), min_rows=self.dense_min_rows,
                         min_keys=self.dense_min_keys * key_split,
                         band_squares=self.band_squares if key_split == 1 else 0, forward=not backward)
        rest = p.rest.numpy().astype(np.int64)
        if not p.cudnn:
            return None, rest, False
        a = np.asarray(p.cudnn, dtype=np.int64).reshape(-1, 6)
        batch = a[:, 5].astype(np.float64)
        rows = ((a[:, 1] - a[:, 0]) // a[:, 5]).astype(np.float64)
        keys = (a[:, 3] - a[:, 2]).astype(np.float64)
        causal = a[:, 4] != Kind.FULL
        rev = a[:, 4] == Kind.INV_CAUSAL
        cells = batch * np.where(causal, rows * (rows + 1) / 2, rows * keys)
        return (rows, keys, cells, causal, batch, rev), rest, bool(p.direct and not accumulate)

    def tile_time(self, tiles: np.ndarray, work: Workload, backward: bool = False, key_split: int = 1,
                  accumulate: bool = False) -> float:
        """Seconds to run one kernel call over ``tiles`` (int [n, 5] rows q0, q1, k0, k1, kind).

        ``key_split`` > 1: one of ``key_split`` calls over equal key pieces of ``tiles`` (a stage of a
        split), i.e. every tile with 1 / key_split of its keys and cells. ``accumulate``: a forward that
        adds into a running output (a stage), which never writes band-square pairs directly.

        Remembered by the tile list's content (``_MEMO``): choosing a fresh plan's schedule prices the same
        own-key and remote tile lists once per candidate stage count and rank."""
        if len(tiles) == 0:
            return 0.0
        tiles = np.ascontiguousarray(np.asarray(tiles, dtype=np.int64).reshape(-1, 5))
        key = ("tile_time", self, _content(tiles), work, bool(backward), int(key_split), bool(accumulate))
        return _MEMO.get(key, lambda: self._tile_time(tiles, work, backward, key_split, accumulate))

    def _tile_time(self, tiles: np.ndarray, work: Workload, backward: bool, key_split: int, accumulate: bool) -> float:
        split = float(key_split)
        per_flop = 4.0 * work.num_heads * work.head_dim
        t = self.launch_us * 1e-6
        rest = tiles
        if self.dense_fwd_tflops > 0:
            dense, rest, direct = self._pieces(tiles, backward, key_split, accumulate)
            if dense is not None:
                # the pieces (calls), each with a fixed cost and one LSE merge of its rows (per stage, not
                # split): 10 bytes per [row, head, dim] element (fp32 running output read and written, the
                # piece's bf16 output read); a reversed band square is merged in its partner's pass (2
                # bytes) and first flips its rows of q (4 bytes) and its keys' K/V; written directly, a
                # pair's merge reads the causal square's bf16 output and writes the call's (4 bytes)
                rows, keys, cells, causal, batch, rev = dense
                elems = rows * batch * work.num_heads * work.head_dim
                span = (batch - 1) * rows + keys
                moved = np.where(rev, 6.0 * elems + 8.0 * span * work.num_kv_heads * work.head_dim,
                                 (4.0 if direct else 10.0) * elems)
                t += (self._dense_time(dense[:5], work, backward, split) + len(rows) * self.dense_piece_us * 1e-6
                      + float(moved.sum()) / (self.hbm_gbps * 1e9))
        if len(rest) == 0:
            return t
        cells, _ = tile_areas(rest)
        cells = cells / split
        # a kernel program walks every block of its q rows across all tiles, so a row's cost follows
        # the keys it keeps over the whole list, not per tile: each tile's share of rows is its cells
        # over the mean kept keys of its rows
        row_cells = _row_keys(rest, cells)
        share = np.divide(cells * (rest[:, 1] - rest[:, 0]), row_cells, out=np.zeros_like(cells), where=row_cells > 0)
        cls = self.row_class(rest)
        if cls == "long":
            peak = (self.bwd_tflops / 2.5 if backward else self.fwd_tflops) * 1e12
            half, work_cells = self.half_keys, cells
        else:
            fwd_t, bwd_t, half_f, half_b, bm, bn = (
                (self.blocky_fwd_tflops, self.blocky_bwd_tflops, self.blocky_half_keys, self.blocky_bwd_half_keys,
                 self.blocky_block_m, self.blocky_block_n) if cls == "blocky" else
                (self.short_fwd_tflops, self.short_bwd_tflops, self.short_half_keys, self.short_bwd_half_keys,
                 self.short_block_m, self.short_block_n))
            if cls == "blocky" and self.blocky_band_fwd_tflops > 0 and band_cells(rest, cells) >= 0.5 * cells.sum():
                fwd_t, bwd_t = self.blocky_band_fwd_tflops, self.blocky_band_bwd_tflops or bwd_t
            peak = (bwd_t / 2.5 if backward else fwd_t) * 1e12
            half = (half_b or half_f) if backward else half_f
            if backward:
                bm, bn = self.bwd_block_m, self.bwd_block_n
            visited, _ = block_counts(rest, int(bm), int(bn))
            work_cells = visited * float(bm * bn) / split
        n_tiles = float((cells > 0).sum())
        t_list = float((work_cells + half * share).sum()) * per_flop / peak
        if not backward and split == 1.0 and cls == "blocky":
            # the class the long-row rates are calibrated in (and the one lists with global rows run in);
            # a program of the long class's blocks (128 x 128, 8 warps) runs ~2.5x faster alone: a 256 x
            # 32768 guest call measured at its throughput time, not at this bound's
            t_list = self.long_rows(rest, t_list, int(self.blocky_block_m), int(self.blocky_block_n), work)
        return t + n_tiles * self.tile_us * 1e-6 + t_list

    def row_class(self, tiles: np.ndarray) -> str:
        """The kernel backend's class of a Triton tile list (``kernels.pieces.row_class``), falling back for
        classes this model has no numbers for ("blocky" -> "short" -> "long")."""
        t = np.ascontiguousarray(np.asarray(tiles, dtype=np.int64).reshape(-1, 5))
        cls = _MEMO.get(("row_class", _content(t)), lambda: pieces.row_class(t))
        if cls == "blocky" and self.blocky_fwd_tflops <= 0:
            cls = "short"
        if cls == "short" and self.short_fwd_tflops <= 0:
            cls = "long"
        return cls

    def _dense_time(self, dense, work: Workload, backward: bool, split: float) -> float:
        """Seconds of the dense (cuDNN) pieces ``dense`` (``dense_pieces``' arrays), each with 1 / ``split`` of its
        keys."""
        dpeak = (self.dense_bwd_tflops / 2.5 if backward else self.dense_fwd_tflops) * 1e12
        cpeak = (self.dense_causal_bwd_tflops / 2.5 if backward else self.dense_causal_fwd_tflops) * 1e12
        cpeak = cpeak if cpeak > 0 else dpeak
        hk = self.dense_bwd_half_keys if backward else self.dense_half_keys
        hr = self.dense_bwd_half_rows if backward else self.dense_half_rows
        rows, keys, cells, causal, batch = dense
        extent = (keys / split) if backward else rows
        eff = self.wave_efficiency(extent, work.num_heads * batch)
        eq = ((cells + hr * keys * batch) / split + hk * rows * batch) / eff
        per_flop = 4.0 * work.num_heads * work.head_dim
        full = eq / dpeak
        if len(self.dense_grid_rows) and len(self.dense_grid_keys):
            # measured rate of the shape (at the grid's heads), moved to this piece's heads by wave efficiency
            rate = self.grid_tflops(rows, keys / split, backward) * 1e12 / (2.5 if backward else 1.0)
            full = cells / split / rate * self.wave_efficiency(extent, self.dense_grid_heads or work.num_heads) / eff
        return float(np.where(causal, eq / cpeak, full).sum()) * per_flop

    def grid_tflops(self, rows, keys, backward: bool = False) -> np.ndarray:
        """Full pieces' TFLOP/s from the calibrated grid: bilinear in log2(rows), log2(keys), clamped."""
        gr = np.log2(np.asarray(self.dense_grid_rows, dtype=np.float64))
        gk = np.log2(np.asarray(self.dense_grid_keys, dtype=np.float64))
        z = np.asarray(self.dense_grid_bwd_tflops if backward else self.dense_grid_fwd_tflops,
                       dtype=np.float64).reshape(len(gr), len(gk))
        r = np.clip(np.log2(np.maximum(np.asarray(rows, dtype=np.float64), 1.0)), gr[0], gr[-1])
        k = np.clip(np.log2(np.maximum(np.asarray(keys, dtype=np.float64), 1.0)), gk[0], gk[-1])
        i = np.clip(np.searchsorted(gr, r, side="right") - 1, 0, max(len(gr) - 2, 0))
        j = np.clip(np.searchsorted(gk, k, side="right") - 1, 0, max(len(gk) - 2, 0))
        i1, j1 = np.minimum(i + 1, len(gr) - 1), np.minimum(j + 1, len(gk) - 1)
        a = np.where(i1 > i, (r - gr[i]) / np.where(i1 > i, gr[i1] - gr[i], 1.0), 0.0)
        b = np.where(j1 > j, (k - gk[j]) / np.where(j1 > j, gk[j1] - gk[j], 1.0), 0.0)
        return ((1 - a) * (1 - b) * z[i, j] + a * (1 - b) * z[i1, j] + (1 - a) * b * z[i, j1] + a * b * z[i1, j1])

    def wave_efficiency(self, extent, heads: int):
        """Fraction of the multiprocessors' time a dense piece uses: ``ceil(extent / dense_block) x heads``
        programs in whole waves of ``num_sms`` (1 when ``num_sms`` is 0)."""
        if self.num_sms <= 0:
            return 1.0
        progs = np.ceil(np.asarray(extent, dtype=np.float64) / self.dense_block) * heads
        return progs / (np.ceil(progs / self.num_sms) * self.num_sms)

    def stage_overhead(self, rows: int, work: Workload, backward: bool = False) -> float:
        """Seconds of one stage's passes over the running output / gradient sums of ``rows`` queries."""
        b = self.stage_bwd_bytes if backward else self.stage_fwd_bytes
        return rows * work.num_heads * work.head_dim * b / (self.hbm_gbps * 1e9)

    def exchange_passes(self, s_local: int, n_recv: int, n_send: int, work: Workload,
                        backward: bool = False, delta: bool = True) -> float:
        """Memory passes around one exchange (seconds): forward places the own and received K/V rows in
        the key buffer and gathers the rows to send (read + write each); backward gathers the received
        rows' partial dK/dV, adds the returned partials into their owners and, with ``delta``, reads
        out and dout for delta = rowsum(dout * out)."""
        kv = work.kv_bytes_per_token
        if backward:
            b = 2.0 * kv * (n_recv + n_send)
            if delta:
                b += 2.0 * s_local * work.num_heads * work.head_dim * work.dtype_bytes
        else:
            b = 2.0 * kv * (s_local + n_recv + n_send)
        return b / (self.hbm_gbps * 1e9)

    def p2p_time(self, nbytes: float) -> float:
        """Seconds of one neighbour send|receive of ``nbytes`` (each GPU sends and receives that many):
        latency plus the transfer, linear in the bytes between the calibrated sizes (0, ``p2p_bytes``,
        2 x ``p2p_bytes``) and extrapolated beyond with the last segment's slope."""
        b1 = float(self.p2p_bytes)
        t1 = b1 / (self.p2p_gbps * 1e9)
        if nbytes <= b1 or self.p2p_big_gbps <= 0:
            t = nbytes / (self.p2p_gbps * 1e9)
        else:
            t2 = 2 * b1 / (self.p2p_big_gbps * 1e9)
            t = t1 + (nbytes - b1) * max(t2 - t1, 0.0) / b1
        return self.latency_us * 1e-6 + t

    def long_rows(self, tiles: np.ndarray, t_list: float, block_m: int, block_n: int, work: Workload) -> float:
        """Forward seconds of a Triton list whose throughput model gives ``t_list``, bounded below by its
        longest programs (a q block's walk over every k block it keeps, one per head; blocks
        ``block_m`` x ``block_n``): they start first (the schedule's heaviest-first order), run at
        ``row_share`` of a multiprocessor's share of the list's rate while the other programs run, and
        at ``row_alone_tflops`` after. ``t_list`` when that bound does not apply or is not calibrated."""
        if self.row_alone_tflops <= 0 or self.row_share <= 0 or self.num_sms <= 0 or t_list <= 0:
            return t_list
        ent = row_block_entries(tiles, block_m, block_n)
        if not len(ent) or ent.max() <= 0:
            return t_list
        e_max = float(ent.max())
        n_long = int((ent >= 0.9 * e_max).sum()) * work.num_heads  # programs within 10% of the longest
        if n_long >= self.num_sms:  # as many long programs as multiprocessors: the throughput model's case
            return t_list
        per_entry = 4.0 * work.head_dim * block_m * block_n
        total = float((ent * per_entry).sum()) * work.num_heads  # the list's work, as its programs walk it
        rate = total / t_list  # the list's rate, spread over the multiprocessors
        per_sm = rate / self.num_sms
        long_w = e_max * per_entry
        shared = self.row_share * per_sm
        background = total - n_long * long_w
        alone = self.row_alone_tflops * 1e12
        if background <= 0:
            return max(t_list, long_w / alone)
        t_bg = background / max(rate - n_long * shared, 1e-9 * rate)
        if long_w <= shared * t_bg:
            return t_list
        return max(t_list, t_bg + (long_w - shared * t_bg) / alone)

    def call_time(self, backward: bool = False) -> float:
        return (self.call_bwd_us if backward else self.call_fwd_us) * 1e-6

    def comm_time(self, intra_bytes: float, inter_bytes: float) -> float:
        """Seconds for one collective whose busiest GPU moves these bytes (0 bytes: no collective)."""
        if intra_bytes <= 0 and inter_bytes <= 0:
            return 0.0
        return self.latency_us * 1e-6 + max(intra_bytes / (self.intra_gbps * 1e9), inter_bytes / (self.inter_gbps * 1e9))


def link_bytes(M: np.ndarray, node: np.ndarray) -> tuple[float, float]:
    """(intra, inter): the busiest GPU's bytes (max of sent and received) inside its node and across
    nodes in one collective with byte matrix ``M[src, dst]`` ([cp, cp], diagonal ignored)."""
    M = np.array(M, dtype=np.float64)
    np.fill_diagonal(M, 0.0)
    same = node[:, None] == node[None, :]
    a, b = np.where(same, M, 0.0), np.where(same, 0.0, M)
    intra = float(np.maximum(a.sum(1), a.sum(0)).max(initial=0.0))
    inter = float(np.maximum(b.sum(1), b.sum(0)).max(initial=0.0))
    return intra, inter


tile_areas = pieces.tile_areas  # (kept cells, rows) per tile: the kernels' own count, read here by the cost model's users


def band_cells(tiles: np.ndarray, cells: np.ndarray) -> float:
    """Kept cells of the band (BI_CAUSAL) tiles among ``tiles`` (``cells``: each tile's kept cells)."""
    return float(cells[np.asarray(tiles).reshape(-1, 5)[:, 4] == 3].sum())


def block_counts(tiles: np.ndarray, block_m: int, block_n: int) -> tuple[np.ndarray, np.ndarray]:
    """(visited, full) per tile, float64: the kernels' own count (``kernels.pieces.block_counts``) of the
    block_m x block_n blocks the kernel visits and of those whose every cell is kept."""
    t = np.ascontiguousarray(np.asarray(tiles, dtype=np.int64).reshape(-1, 5))

    def count():
        v, f = pieces.block_counts(t, block_m, block_n)
        v, f = v.astype(np.float64), f.astype(np.float64)
        v.flags.writeable = f.flags.writeable = False  # shared through _MEMO
        return v, f

    return _MEMO.get(("block_counts", _content(t), int(block_m), int(block_n)), count)


def row_block_entries(tiles: np.ndarray, block_m: int, block_n: int) -> np.ndarray:
    """Entries of each q block's row in the forward schedule: the k blocks a program of that q block
    visits over all tiles (a block met by two tiles counts twice, as the schedule lists it); from the first
    q block with an entry."""
    _, m, vis, _ = pieces.block_rows(tiles, block_m, block_n)
    if len(m) == 0:
        return np.zeros(0)
    return np.bincount(m - m.min(), vis).astype(np.float64)


class _Memo:
    """A bounded map (least recently used out) for the cost model's pure functions of a tile list, keyed by a
    digest of its content; thread-safe (plans may be made and priced off the training thread). Not
    functools.lru_cache: keyed by the arrays themselves it would keep every tile list alive (hundreds of KB
    each at 128k tokens); a 24-byte digest keeps only the results."""

    def __init__(self, size: int):
        self.size, self._d, self._lock = size, OrderedDict(), threading.Lock()

    def get(self, key, make):
        with self._lock:
            if key in self._d:
                self._d.move_to_end(key)
                return self._d[key]
        value = make()
        with self._lock:
            self._d[key] = value
            while len(self._d) > self.size:
                self._d.popitem(last=False)
        return value


_MEMO = _Memo(8192)


def _content(tiles: np.ndarray) -> bytes:
    """A 16-byte digest of an int64 [n, 5] tile list (its rows and every value)."""
    return hashlib.blake2b(tiles.tobytes(), digest_size=16).digest() + len(tiles).to_bytes(8, "little")


def _torch_tiles(tiles) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(np.asarray(tiles, dtype=np.int64).reshape(-1, 5)))


def _row_keys(tiles: np.ndarray, cells: np.ndarray) -> np.ndarray:
    """For each tile, rows x (mean keys kept per row over the whole list) on its rows, with ``cells``
    [n] the cells of each tile counted (spread evenly over the tile's rows)."""
    t = np.asarray(tiles, dtype=np.int64).reshape(-1, 5)
    if len(t) == 0:
        return np.zeros(0)
    q0, q1 = t[:, 0], t[:, 1]
    base = int(q0.min())
    n = int(q1.max()) - base
    per_row = cells / np.maximum(q1 - q0, 1)
    diff = np.zeros(n + 1)
    np.add.at(diff, q0 - base, per_row)
    np.add.at(diff, q1 - base, -per_row)
    row = np.cumsum(diff[:-1])  # keys kept by each row over all tiles
    pre = np.concatenate([[0.0], np.cumsum(row)])
    return pre[q1 - base] - pre[q0 - base]


# -- guest rows (planner.guests): what their exchanges and calls cost


def guest_pairs(plan) -> np.ndarray:
    """``M[a, b]`` of a built plan: guest rows rank ``a`` sends to rank ``b`` (self included)."""
    cp = plan.cp_size
    M = np.zeros((cp, cp), dtype=np.int64)
    for rp in plan.ranks:
        for b, runs in enumerate(rp.guest_send_runs):
            M[rp.rank, b] = int((runs[:, 1] - runs[:, 0]).sum()) if len(runs) else 0
    return M


def guest_traffic(plan, work: Workload) -> list[tuple[str, np.ndarray]]:
    """The guest rows' exchanges as the runtime issues them, forward then backward: ``(phase,
    bytes[src, dst])`` (float64 [cp, cp], self pairs included: callers ignore the diagonal)."""
    if not plan.has_guests:
        return []
    M = guest_pairs(plan).astype(np.float64)
    h, d, b = work.num_heads, work.head_dim, work.dtype_bytes
    acc = 8 if b == 8 else 4
    return [("guest_q", M * h * d * b), ("guest_out", M.T * h * (d + 1) * acc),
            ("guest_dout", M * 2 * h * d * b), ("guest_lse", M * 2 * h * acc), ("guest_dq", M.T * h * d * b)]


def guest_predict(plan, cost: "CostModel", work: Workload) -> dict:
    """Time the guest rows add to a step (seconds): their exchanges (each a collective; the busiest
    GPU's bytes per link class) and the kernel calls over the guest tiles, the busiest rank's."""
    if not plan.has_guests:
        return {"fwd_s": 0.0, "bwd_s": 0.0}
    cp = plan.cp_size
    g = plan.topology.gpus_per_node if plan.topology is not None else cp
    node = np.arange(cp) // g
    t = {}
    for name, B in guest_traffic(plan, work):
        intra, inter = link_bytes(B, node)
        t[name] = cost.comm_time(intra, inter) if intra + inter > 0 else cost.latency_us * 1e-6
    kf = max(cost.tile_time(rp.guest_tiles, work) for rp in plan.ranks)
    kb = max(cost.tile_time(rp.guest_tiles, work, backward=True) for rp in plan.ranks)
    # the partials / dq travel back while the own tiles compute: only their latency is exposed
    lat = cost.latency_us * 1e-6
    return {"fwd_s": t["guest_q"] + kf + min(t["guest_out"], lat),
            "bwd_s": t["guest_dout"] + t["guest_lse"] + kb + min(t["guest_dq"], lat)}
