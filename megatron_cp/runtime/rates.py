"""The cost model's rates, nested by what they price, each with its prediction beside it (``runtime.cost``
composes them into ``CostModel``): the Triton kernels per row class (``RowRates``, ``TritonRates``), the cuDNN
pieces (``DenseRates``, ``DenseGrid``), the links (``LinkRates``), the memory passes (``MemoryRates``) and a call's
host time (``CallRates``). Every figure is per GPU; the defaults are one calibration of a single NVLink node
(docs/cost-model.md).

The tile-list counts the predictions need are the kernels' own (``kernels.pieces``), remembered by the list's
content (``memo``, ``tile_digest``): choosing a fresh plan's schedule prices the same lists many times.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels import pieces
from ..kinds import Kind
from ..planner import LINKS, Workload

__all__ = ["RowRates", "TritonRates", "DenseGrid", "DenseRates", "LinkRates", "MemoryRates", "CallRates", "RATES",
           "tile_areas", "band_cells", "block_counts", "row_block_entries", "memo", "tile_digest"]


@dataclass(frozen=True)
class RowRates:
    """One row class of the Triton kernels (``kernels.pieces.row_class``). A list of the class runs at
    ``peak * keys / (keys + half_keys)``, ``keys`` the mean kept keys of its rows: short rows run below peak
    because per-row work weighs more. Peaks are TFLOP/s of mask-area FLOPs per GPU, the backward counted as 2.5x
    the forward's FLOPs; a peak of 0: the class is not calibrated (``TritonRates.row_class`` falls back)."""

    fwd_tflops: float = 0.0
    bwd_tflops: float = 0.0
    half_keys: float = 0.0  # mean kept keys per row at which a list runs at half of peak
    bwd_half_keys: float = 0.0  # 0: half_keys
    # the class's forward blocks (the backend's config for the head dim): the cells priced are those of every
    # block the kernel visits, since a partly kept block costs a whole one; 0 (the long class): the kept cells
    block_m: int = 0
    block_n: int = 0
    # lists mostly of band cells (BI_CAUSAL tiles: sliding windows of 1024 to 4096 keys) run at their own peaks,
    # with the class's half terms and blocks: a 2048-key band's backward measured faster in the runtime than the
    # fit made on documents predicted; 0: the class's peaks. Calibrated it narrows that gap only a little
    # (kernel alone 1.14x): docs/cost-model.md
    band_fwd_tflops: float = 0.0
    band_bwd_tflops: float = 0.0

    def peak(self, backward: bool, band: bool = False) -> float:
        """FLOP/s of the phase (``band``: a list mostly of band cells, at the band peaks where calibrated)."""
        fwd_t, bwd_t = self.fwd_tflops, self.bwd_tflops
        if band and self.band_fwd_tflops > 0:
            fwd_t, bwd_t = self.band_fwd_tflops, self.band_bwd_tflops or bwd_t
        return (bwd_t / 2.5 if backward else fwd_t) * 1e12

    def half(self, backward: bool) -> float:
        return (self.bwd_half_keys or self.half_keys) if backward else self.half_keys


@dataclass(frozen=True)
class TritonRates:
    """The Triton kernels: a rate per row class (``long``: mean kept keys per covered row >= the kernels'
    ``LONG_ROW_KEYS``; ``blocky``: short rows whose forward blocks are mostly full, the kernels'
    ``BLOCKY_FULL_FRACTION`` (documents, strided and banded blocks, windows of 1024 to 4096 keys); ``short``: the
    other short lists, narrow sliding windows), a fixed cost per tile, and the bound of a list with a few very
    long rows among short ones (``long_rows``)."""

    long: RowRates = RowRates(fwd_tflops=420.0, bwd_tflops=370.0, half_keys=216.0)
    short: RowRates = RowRates(block_m=64, block_n=64)
    blocky: RowRates = RowRates(block_m=128, block_n=64)
    bwd_block_m: int = 64  # backward blocks (dQ and dK/dV kernels) of the short and blocky classes
    bwd_block_n: int = 64
    tile_us: float = 1.0  # fixed cost per tile
    # a forward program (one q block, one head) walks every k block of its row: a list with a few very long rows
    # among short ones (global rows) lasts at least as long as those programs. A long program runs at row_share of
    # its multiprocessor's share of the list's rate while other programs run beside it, at row_alone_tflops once
    # they are done (tools/sim/calibrate.py measures both in the "blocky" class, and the model applies them to
    # that class's lists; 0, or num_sms 0: not modelled)
    row_alone_tflops: float = 0.0
    row_share: float = 0.0

    def row_class(self, tiles: np.ndarray) -> str:
        """The kernel backend's class of a Triton tile list (``kernels.pieces.row_class``), falling back for
        classes without rates ("blocky" -> "short" -> "long")."""
        t = np.ascontiguousarray(np.asarray(tiles, dtype=np.int64).reshape(-1, 5))
        cls = memo.get(("row_class", tile_digest(t)), lambda: pieces.row_class(t))
        if cls == "blocky" and self.blocky.fwd_tflops <= 0:
            cls = "short"
        if cls == "short" and self.short.fwd_tflops <= 0:
            cls = "long"
        return cls

    def list_time(self, rest: np.ndarray, work: Workload, backward: bool, split: float,
                  num_sms: int) -> tuple[float, float]:
        """(seconds of the tiles' fixed costs, seconds of the list's work) of the Triton list ``rest``, each
        tile with 1 / ``split`` of its keys."""
        per_flop = 4.0 * work.num_heads * work.head_dim
        cells, _ = tile_areas(rest)
        cells = cells / split
        # a kernel program walks every block of its q rows across all tiles, so a row's cost follows
        # the keys it keeps over the whole list, not per tile: each tile's share of rows is its cells
        # over the mean kept keys of its rows
        row_cells = _row_keys(rest, cells)
        share = np.divide(cells * (rest[:, 1] - rest[:, 0]), row_cells, out=np.zeros_like(cells), where=row_cells > 0)
        cls = self.row_class(rest)
        rates = getattr(self, cls)
        band = cls == "blocky" and rates.band_fwd_tflops > 0 and band_cells(rest, cells) >= 0.5 * cells.sum()
        peak, half = rates.peak(backward, band), rates.half(backward)
        if rates.block_m <= 0:
            work_cells = cells
        else:
            bm, bn = (self.bwd_block_m, self.bwd_block_n) if backward else (rates.block_m, rates.block_n)
            visited, _ = block_counts(rest, int(bm), int(bn))
            work_cells = visited * float(bm * bn) / split
        n_tiles = float((cells > 0).sum())
        t_list = float((work_cells + half * share).sum()) * per_flop / peak
        if not backward and split == 1.0 and cls == "blocky":
            # the class the long-row rates are calibrated in (and the one lists with global rows run in);
            # a program of the long class's blocks (128 x 128, 8 warps) runs ~2.5x faster alone: a 256 x
            # 32768 guest call measured at its throughput time, not at this bound's
            t_list = self.long_rows(rest, t_list, int(rates.block_m), int(rates.block_n), work, num_sms)
        return n_tiles * self.tile_us * 1e-6, t_list

    def long_rows(self, tiles: np.ndarray, t_list: float, block_m: int, block_n: int, work: Workload,
                  num_sms: int) -> float:
        """Forward seconds of a Triton list whose throughput model gives ``t_list``, bounded below by its
        longest programs (a q block's walk over every k block it keeps, one per head; blocks
        ``block_m`` x ``block_n``): they start first (the schedule's heaviest-first order), run at
        ``row_share`` of a multiprocessor's share of the list's rate while the other programs run, and
        at ``row_alone_tflops`` after. ``t_list`` when that bound does not apply or is not calibrated."""
        if self.row_alone_tflops <= 0 or self.row_share <= 0 or num_sms <= 0 or t_list <= 0:
            return t_list
        ent = row_block_entries(tiles, block_m, block_n)
        if not len(ent) or ent.max() <= 0:
            return t_list
        e_max = float(ent.max())
        n_long = int((ent >= 0.9 * e_max).sum()) * work.num_heads  # programs within 10% of the longest
        if n_long >= num_sms:  # as many long programs as multiprocessors: the throughput model's case
            return t_list
        per_entry = 4.0 * work.head_dim * block_m * block_n
        total = float((ent * per_entry).sum()) * work.num_heads  # the list's work, as its programs walk it
        rate = total / t_list  # the list's rate, spread over the multiprocessors
        per_sm = rate / num_sms
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


@dataclass(frozen=True)
class DenseGrid:
    """Measured full cuDNN pieces (tools/sim/calibrate.py): TFLOP/s of a rows x keys piece on a grid of rows x keys
    (row-major, ``heads`` query heads); empty: not measured."""

    rows: tuple = ()
    keys: tuple = ()
    fwd_tflops: tuple = ()
    bwd_tflops: tuple = ()
    heads: int = 0

    def measured(self) -> bool:
        return bool(len(self.rows) and len(self.keys))

    def tflops(self, rows, keys, backward: bool = False) -> np.ndarray:
        """Full pieces' TFLOP/s: bilinear in log2(rows), log2(keys), clamped to the grid's edges."""
        gr = np.log2(np.asarray(self.rows, dtype=np.float64))
        gk = np.log2(np.asarray(self.keys, dtype=np.float64))
        z = np.asarray(self.bwd_tflops if backward else self.fwd_tflops, dtype=np.float64).reshape(len(gr), len(gk))
        r = np.clip(np.log2(np.maximum(np.asarray(rows, dtype=np.float64), 1.0)), gr[0], gr[-1])
        k = np.clip(np.log2(np.maximum(np.asarray(keys, dtype=np.float64), 1.0)), gk[0], gk[-1])
        i = np.clip(np.searchsorted(gr, r, side="right") - 1, 0, max(len(gr) - 2, 0))
        j = np.clip(np.searchsorted(gk, k, side="right") - 1, 0, max(len(gk) - 2, 0))
        i1, j1 = np.minimum(i + 1, len(gr) - 1), np.minimum(j + 1, len(gk) - 1)
        a = np.where(i1 > i, (r - gr[i]) / np.where(i1 > i, gr[i1] - gr[i], 1.0), 0.0)
        b = np.where(j1 > j, (k - gk[j]) / np.where(j1 > j, gk[j1] - gk[j], 1.0), 0.0)
        return ((1 - a) * (1 - b) * z[i, j] + a * (1 - b) * z[i1, j] + (1 - a) * b * z[i, j1] + a * b * z[i1, j1])


@dataclass(frozen=True)
class DenseRates:
    """The dense pieces the kernel backend runs on cuDNN (``fwd_tflops`` 0: no dense path modelled): full rectangles
    and square causal pieces of at least ``min_rows`` x ``min_keys``, and in the forward bands cut into squares
    (``band_squares``); the split is the kernels' own (``kernels.pieces``). A piece of ``rows`` x ``keys`` costs
    ``flops(cells + half_keys * rows + half_rows * keys) / peak`` (short and narrow pieces run below peak: per-row
    and per-key-column work), over its wave efficiency, plus ``piece_us`` and one LSE merge per piece."""

    fwd_tflops: float = 680.0  # full pieces
    bwd_tflops: float = 565.0
    causal_fwd_tflops: float = 680.0  # square causal pieces (0: as full ones)
    causal_bwd_tflops: float = 565.0
    half_keys: float = 0.0
    bwd_half_keys: float = 0.0
    half_rows: float = 0.0
    bwd_half_rows: float = 0.0
    min_rows: int = 512  # TritonConfig.dense_min_rows / dense_min_keys
    min_keys: int = 8192
    # TritonConfig.band_squares: forward only, bands of at least this window and rows run as batched cuDNN squares
    # (a reversed one on flipped copies, merged with its causal partner in one pass); a calibration file without
    # the field predates band squares (its backend ran bands on Triton): 0
    band_squares: int = 4096
    piece_us: float = 30.0  # fixed cost per piece (launches, slicing)
    # a piece runs ceil(rows / block) x Hq programs forward (ceil(keys / block) x Hq backward) in waves over the
    # GPU's multiprocessors: a last partial wave idles the rest (few heads and rows, as Ulysses' head groups have)
    block: int = 128
    # when measured, a full piece's rate is read off the grid (at the grid's heads) instead of the peak and half
    # terms above, which square causal pieces keep using
    grid: DenseGrid = DenseGrid()

    def pieces(self, tiles: np.ndarray, backward: bool, key_split: int, accumulate: bool = False):
        """(dense pieces as arrays (rows, keys, cells, causal, batch, reverse) over calls, the rest, direct) of
        one call, as the kernels split it (``kernels.pieces.split_pieces``); (None, tiles, False) when nothing
        runs on cuDNN. ``reverse``: a band square run on flipped copies; ``direct``: the forward writes its
        band-square pairs straight into its output (an accumulating forward never does). ``key_split`` > 1
        stands for one of that many calls over equal key pieces: a piece must then be that much wider."""
        p = pieces.split_pieces(_torch_tiles(tiles), min_rows=self.min_rows, min_keys=self.min_keys * key_split,
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

    def time(self, dense, direct: bool, work: Workload, backward: bool, split: float, num_sms: int,
             hbm_gbps: float) -> float:
        """Seconds of the pieces ``dense`` (``pieces``' arrays) of one call, each with 1 / ``split`` of its keys:
        their kernels, a fixed cost each and one LSE merge of their rows (per stage, not split) at ``hbm_gbps``:
        10 bytes per [row, head, dim] element (fp32 running output read and written, the piece's bf16 output
        read); a reversed band square is merged in its partner's pass (2 bytes) and first flips its rows of q (4
        bytes) and its keys' K/V; written directly, a pair's merge reads the causal square's bf16 output and
        writes the call's (4 bytes)."""
        rows, keys, cells, causal, batch, rev = dense
        elems = rows * batch * work.num_heads * work.head_dim
        span = (batch - 1) * rows + keys
        moved = np.where(rev, 6.0 * elems + 8.0 * span * work.num_kv_heads * work.head_dim,
                         (4.0 if direct else 10.0) * elems)
        return (self._kernels_time(dense[:5], work, backward, split, num_sms) + len(rows) * self.piece_us * 1e-6
                + float(moved.sum()) / (hbm_gbps * 1e9))

    def _kernels_time(self, dense, work: Workload, backward: bool, split: float, num_sms: int) -> float:
        dpeak = (self.bwd_tflops / 2.5 if backward else self.fwd_tflops) * 1e12
        cpeak = (self.causal_bwd_tflops / 2.5 if backward else self.causal_fwd_tflops) * 1e12
        cpeak = cpeak if cpeak > 0 else dpeak
        hk = self.bwd_half_keys if backward else self.half_keys
        hr = self.bwd_half_rows if backward else self.half_rows
        rows, keys, cells, causal, batch = dense
        extent = (keys / split) if backward else rows
        eff = self.wave_efficiency(extent, work.num_heads * batch, num_sms)
        eq = ((cells + hr * keys * batch) / split + hk * rows * batch) / eff
        per_flop = 4.0 * work.num_heads * work.head_dim
        full = eq / dpeak
        if self.grid.measured():
            # measured rate of the shape (at the grid's heads), moved to this piece's heads by wave efficiency
            rate = self.grid.tflops(rows, keys / split, backward) * 1e12 / (2.5 if backward else 1.0)
            full = cells / split / rate * self.wave_efficiency(extent, self.grid.heads or work.num_heads, num_sms) / eff
        return float(np.where(causal, eq / cpeak, full).sum()) * per_flop

    def wave_efficiency(self, extent, heads: int, num_sms: int):
        """Fraction of the multiprocessors' time a piece uses: ``ceil(extent / block) x heads`` programs in whole
        waves of ``num_sms`` (1 when ``num_sms`` is 0)."""
        if num_sms <= 0:
            return 1.0
        progs = np.ceil(np.asarray(extent, dtype=np.float64) / self.block) * heads
        return progs / (np.ceil(progs / num_sms) * num_sms)


@dataclass(frozen=True)
class LinkRates:
    """Collectives: ``latency_us + intra_bytes / intra_gbps + inter_bytes / inter_gbps`` per GPU (the busiest
    GPU's bytes of one collective; links of different kinds run concurrently, so it is the max); one neighbour's
    point-to-point transfer (the ring baseline's step) measured at two sizes. Until a calibration measures them,
    planner.LINKS (the planner weighs bytes with the same)."""

    intra_gbps: float = LINKS.intra_gbps  # achieved all-to-all bandwidth per GPU inside a node (GB/s)
    inter_gbps: float = LINKS.inter_gbps  # achieved per GPU between nodes (400 Gb/s NIC per GPU)
    latency_us: float = LINKS.latency_us  # fixed cost per collective
    p2p_gbps: float = 250.0  # one neighbour's send|receive pair inside a node
    # the same transfer measured at twice p2p_bytes: NCCL's point-to-point time is not proportional to the bytes
    # (half the bytes took most of the time: docs/cost-model.md); 0: p2p_gbps at any size
    p2p_big_gbps: float = 0.0
    p2p_bytes: float = 128 * 2**20

    def comm_time(self, intra_bytes: float, inter_bytes: float) -> float:
        """Seconds for one collective whose busiest GPU moves these bytes (0 bytes: no collective)."""
        if intra_bytes <= 0 and inter_bytes <= 0:
            return 0.0
        return self.latency_us * 1e-6 + max(intra_bytes / (self.intra_gbps * 1e9), inter_bytes / (self.inter_gbps * 1e9))

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


@dataclass(frozen=True)
class MemoryRates:
    """Memory passes: the runtime's elementwise passes per stage and around exchanges, the cuDNN pieces' merges."""

    hbm_gbps: float = 3000.0  # memory bandwidth of plain passes
    split_gbps: float = 0.0  # head-splitting copies (Ulysses' send and receive layouts); 0: hbm_gbps
    # staged runtime: each stage's call also streams the running output (fwd: fp32 out read + written)
    # and the gradient sums (bwd: dQ fp32 accumulate, delta, dK/dV concat), bytes per element of
    # [s_local, Hq, D]; the single-exchange path (stages=0) has none of these
    stage_fwd_bytes: float = 8.0
    stage_bwd_bytes: float = 16.0

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


@dataclass(frozen=True)
class CallRates:
    """Fixed time of one attention call from the caller to its first GPU work and back (host-side dispatch,
    autograd, launches, a tiny collective), not overlapped when each call is timed alone: tools/sim/calibrate.py
    times a tiny distributed call; the defaults are a profile's host lead before the first kernel
    (docs/cost-model.md)."""

    fwd_us: float = 200.0
    bwd_us: float = 400.0

    def time(self, backward: bool = False) -> float:
        return (self.bwd_us if backward else self.fwd_us) * 1e-6


# flat names of the rates (calibration files before the rates were nested, tools/sim/calibrate.py's fields):
# each nested field's name behind its group's prefix

RATES = (RowRates, TritonRates, DenseGrid, DenseRates, LinkRates, MemoryRates, CallRates)  # the groups


# -- the kernels' counts of a tile list, remembered by its content ------------------------------------------

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
        v.flags.writeable = f.flags.writeable = False  # shared through memo
        return v, f

    return memo.get(("block_counts", tile_digest(t), int(block_m), int(block_n)), count)


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


memo = _Memo(8192)


def tile_digest(tiles: np.ndarray) -> bytes:
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
