"""A small cost model: kernel time per tile shape and collective time per link, from calibrated numbers.

Every figure is per GPU. ``tools/calibrate.py`` measures them on a machine and writes JSON that
``CostModel.load`` reads; the defaults are one such calibration on 4 x H200 (NVLink).

Kernel time of a tile list (the kernel merges tiles sharing rows, so a row's cost follows the keys it
keeps over the whole list): ``launch_us + n_tiles * tile_us + (cells + half_keys * rows) / peak`` (in
FLOPs), i.e. a tile runs at ``peak * keys / (keys + half_keys)`` with ``keys`` the mean kept keys of its
rows: short rows run below peak because per-row work weighs more. The backend runs a list in one of
three classes, each with its own block shapes and, when calibrated, its own fitted numbers:

- "long" (mean kept keys per covered row >= ``long_row_keys``): ``fwd_tflops`` / ``bwd_tflops`` /
  ``half_keys``, ``cells`` = kept cells;
- "blocky" (short rows whose ``blocky_block`` forward blocks are at least ``blocky_full_fraction`` full:
  documents, strided blocks, banded blocks, windows of 1024 to 4096 keys) and "short" (the other short
  lists: narrow sliding windows): ``blocky_*`` / ``short_*``, ``cells`` = the cells of every block the
  kernel visits, since a partly kept block costs a whole one (forward blocks of the class, ``bwd_block``
  backward); a blocky list mostly of band cells runs at ``blocky_band_*`` peaks.

A "blocky" forward list with a few very long rows among short ones (global rows) lasts at least as long
as those rows' programs (one per q block and head), which start first, run at ``row_share`` of their
multiprocessor's share of the list's rate while other programs run, and at ``row_alone_tflops`` after
(``long_rows``; calibrated).

Dense pieces (``dense_fwd_tflops > 0``): the kernel backend runs full rectangles and square causal
pieces of at least ``dense_min_rows`` x ``dense_min_keys`` on cuDNN (kernels/dense_tiles.py splits a
bottom-right causal tile into a full rectangle and a square causal piece, and a band, a BI_CAUSAL tile,
into batched full rectangles and square causal pieces of ``band_chunk`` rows; the rest stays on Triton and
is classed as above; the forward also cuts bands into squares, ``band_squares``); a piece of ``rows`` x
``keys`` costs
``flops(cells + dense_half_keys * rows + dense_half_rows * keys) / dense peak`` (short and narrow pieces
run below peak: per-row and per-key-column work), over the piece's wave efficiency (``num_sms``), plus ``dense_piece_us`` and one LSE merge (``merge_bytes_per_row`` per
query row and head at ``hbm_gbps``) per piece. The rules (dense split, row class, visited blocks) are
restated here, since the planner may not import kernels: keep the two in step
(tests/test_cost_model.py checks them against the kernel code).
Collective time: ``latency_us + intra_bytes / intra_gbps + inter_bytes / inter_gbps`` (per GPU, the
busiest GPU's bytes of one collective; links of different kinds run concurrently, so it is the max).
One neighbour's point-to-point transfer (the ring baseline's step): ``p2p_time``, measured at two sizes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

import numpy as np


@dataclass(frozen=True)
class Workload:
    """Shapes that turn tokens into bytes and cells into FLOPs."""

    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def fwd_flops(self, area: float) -> float:
        return 4.0 * area * self.num_heads * self.head_dim


@dataclass(frozen=True)
class CostModel:
    # defaults: tools/calibrate.py on 4 x H200 (NVLink), 2026-11-21 (benchmarks/dist/cost_model_4xH200.json)
    fwd_tflops: float = 420.0  # Triton attention forward on long rows (mask-area FLOPs), per GPU
    bwd_tflops: float = 370.0  # backward, counted as 2.5x the forward FLOPs
    half_keys: float = 216.0  # mean kept keys per row at which a tile runs at half of peak
    tile_us: float = 1.0  # fixed cost per tile
    launch_us: float = 90.0  # fixed cost per kernel call (one per stage)
    intra_gbps: float = 335.0  # achieved all-to-all bandwidth per GPU inside a node (GB/s)
    inter_gbps: float = 45.0  # achieved per GPU between nodes (400 Gb/s NIC per GPU)
    p2p_gbps: float = 250.0  # one neighbour's send|receive pair inside a node (the ring baseline's steps)
    # the same transfer measured at twice p2p_bytes: NCCL's point-to-point time is not proportional to
    # the bytes (4 x H200: a 268 MB fp32 block took 1.0-1.2 ms, a 134 MB bf16 one 0.8-1.0 ms:
    # benchmarks/dist/run_0013_prof); p2p_time interpolates between the two (0: p2p_gbps at any size)
    p2p_big_gbps: float = 0.0
    p2p_bytes: float = 128 * 2**20
    latency_us: float = 40.0  # fixed cost per collective
    dense_fwd_tflops: float = 680.0  # cuDNN full pieces (0: no dense path modelled)
    dense_bwd_tflops: float = 565.0
    dense_causal_fwd_tflops: float = 680.0  # cuDNN square causal pieces (0: as full ones)
    dense_causal_bwd_tflops: float = 565.0
    dense_min_rows: int = 512  # TritonConfig.dense_min_rows / dense_min_keys
    dense_min_keys: int = 8192
    band_chunk: int = 0  # TritonConfig.band_chunk / band_min_keys: bands (sliding windows) on cuDNN
    band_min_keys: int = 1024
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
    # tools/calibrate.py times a tiny distributed call; defaults from the profile of 4 x H200 (host
    # lead before the first kernel 0.2 ms forward, 0.4 ms backward: benchmarks/dist/run_1021)
    call_fwd_us: float = 200.0
    call_bwd_us: float = 400.0
    # short-row class: the kernel backend runs lists whose mean kept keys per covered row is below
    # long_row_keys with other block shapes (the kernel backend's LONG_ROW_KEYS), whose rate is
    # fitted separately (peak and half-efficiency keys from two row lengths); 0: the long-row numbers
    short_fwd_tflops: float = 0.0
    short_bwd_tflops: float = 0.0
    short_half_keys: float = 0.0
    long_row_keys: int = 4096
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
    blocky_full_fraction: float = 0.8
    # blocky lists that are mostly band cells (BI_CAUSAL tiles: sliding windows of 1024 to 4096 keys) run
    # at their own peaks, with the blocky half terms and blocks: a 2048-key band's backward measured
    # 1.15-1.19x faster in the runtime than the blocky fit, made on documents, predicted (2 x H200,
    # benchmarks/dist/run_0501_final); 0: the blocky numbers. Calibrated (395 against the documents' 358 on
    # 2 x H200, run_0652_2gpu) it narrows that gap only a little (kernel alone 1.14x): see calibrate.py
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
    # measured full pieces (tools/calibrate.py): TFLOP/s of a rows x keys piece on a grid of rows x keys
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
    # it, at row_alone_tflops once they are done (tools/calibrate.py measures both in the "blocky" class,
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
        rule = (self.dense_min_rows, self.dense_min_keys, self.band_chunk, self.band_min_keys)
        rest = dense_rest(tiles, *rule) if len(dense_pieces(tiles, *rule)[0]) else tiles
        return rest if backward else band_square_rest(rest, self.band_squares)

    def _pieces(self, tiles: np.ndarray, backward: bool, key_split: int, accumulate: bool = False):
        """(dense pieces as ``dense_pieces``' arrays plus ``reverse`` (bool: a band square run on flipped
        copies), the rest, direct) of one call; (None, tiles, False) when nothing runs on cuDNN. ``direct``:
        the forward writes its band-square pairs straight into its output (``band_pairs_direct``)."""
        rule = (self.dense_min_rows, self.dense_min_keys * key_split, self.band_chunk, self.band_min_keys * key_split)
        pieces = dense_pieces(tiles, *rule)
        rest = dense_rest(tiles, *rule) if len(pieces[0]) else tiles
        pieces = pieces + (np.zeros(len(pieces[0]), bool),)
        direct = False
        if not backward and key_split == 1 and self.band_squares > 0:
            sq_p = band_square_pieces(rest, self.band_squares)
            if len(sq_p[0]):
                direct = not accumulate and not len(pieces[0]) and band_pairs_direct(rest, self.band_squares)
                pieces = tuple(np.concatenate([a, b]) for a, b in zip(pieces, sq_p))
                rest = band_square_rest(rest, self.band_squares)
        return (pieces if len(pieces[0]) else None), rest, direct

    def tile_time(self, tiles: np.ndarray, work: Workload, backward: bool = False, key_split: int = 1,
                  accumulate: bool = False) -> float:
        """Seconds to run one kernel call over ``tiles`` (int [n, 5] rows q0, q1, k0, k1, kind).

        ``key_split`` > 1: one of ``key_split`` calls over equal key pieces of ``tiles`` (a stage of a
        split), i.e. every tile with 1 / key_split of its keys and cells. ``accumulate``: a forward that
        adds into a running output (a stage), which never writes band-square pairs directly."""
        if len(tiles) == 0:
            return 0.0
        tiles = np.asarray(tiles, dtype=np.int64).reshape(-1, 5)
        split = float(key_split)
        per_flop = 4.0 * work.num_heads * work.head_dim
        t = self.launch_us * 1e-6
        rest = tiles
        if self.dense_fwd_tflops > 0:
            pieces, rest, direct = self._pieces(tiles, backward, key_split, accumulate)
            if pieces is not None:
                # the pieces (calls), each with a fixed cost and one LSE merge of its rows (per stage, not
                # split): 10 bytes per [row, head, dim] element (fp32 running output read and written, the
                # piece's bf16 output read); a reversed band square is merged in its partner's pass (2
                # bytes) and first flips its rows of q (4 bytes) and its keys' K/V; written directly, a
                # pair's merge reads the causal square's bf16 output and writes the call's (4 bytes)
                rows, keys, cells, causal, batch, rev = pieces
                elems = rows * batch * work.num_heads * work.head_dim
                span = (batch - 1) * rows + keys
                moved = np.where(rev, 6.0 * elems + 8.0 * span * work.num_kv_heads * work.head_dim,
                                 (4.0 if direct else 10.0) * elems)
                t += (self._dense_time(pieces[:5], work, backward, split) + len(rows) * self.dense_piece_us * 1e-6
                      + float(moved.sum()) / (self.hbm_gbps * 1e9))
        if len(rest) == 0:
            return t
        cells, _ = tile_areas(rest)
        cells = cells / split
        # a kernel program walks every block of its q rows across all tiles, so a row's cost follows
        # the keys it keeps over the whole list, not per tile: each tile's share of rows is its cells
        # over the mean kept keys of its rows
        row_cells, covered = _row_keys(rest, cells, covered=True)
        share = np.divide(cells * (rest[:, 1] - rest[:, 0]), row_cells, out=np.zeros_like(cells), where=row_cells > 0)
        cls = self.row_class(rest, cells.sum() * split, covered)
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
            # 32768 guest call measured at its throughput time (2 x H200, 02:48), not at this bound's
            t_list = self.long_rows(rest, t_list, int(self.blocky_block_m), int(self.blocky_block_n), work)
        return t + n_tiles * self.tile_us * 1e-6 + t_list

    def row_class(self, tiles: np.ndarray, area: float, covered: int) -> str:
        """The backend's class of a Triton tile list (kept ``area``, ``covered`` rows): "long" when its rows
        keep at least ``long_row_keys`` keys on average, else "blocky" when at least
        ``blocky_full_fraction`` of its visited ``blocky_block`` blocks are full, else "short"; classes
        that are not calibrated fall back ("blocky" -> "short" -> "long")."""
        if self.short_fwd_tflops <= 0 or area >= self.long_row_keys * max(covered, 1):
            return "long"
        if self.blocky_fwd_tflops > 0:
            visited, full = block_counts(tiles, int(self.blocky_block_m), int(self.blocky_block_n))
            if visited.sum() and full.sum() >= self.blocky_full_fraction * visited.sum():
                return "blocky"
        return "short"

    def _dense_time(self, pieces, work: Workload, backward: bool, split: float) -> float:
        """Seconds of the dense (cuDNN) ``pieces`` (``dense_pieces``' arrays), each with 1 / ``split`` of its
        keys."""
        dpeak = (self.dense_bwd_tflops / 2.5 if backward else self.dense_fwd_tflops) * 1e12
        cpeak = (self.dense_causal_bwd_tflops / 2.5 if backward else self.dense_causal_fwd_tflops) * 1e12
        cpeak = cpeak if cpeak > 0 else dpeak
        hk = self.dense_bwd_half_keys if backward else self.dense_half_keys
        hr = self.dense_bwd_half_rows if backward else self.dense_half_rows
        rows, keys, cells, causal, batch = pieces
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


def tile_areas(tiles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(kept cells, rows) of every tile, exact, vectorized (closed forms of the four kinds)."""
    t = np.asarray(tiles, dtype=np.int64).reshape(-1, 5)
    sq, sk, kind = t[:, 1] - t[:, 0], t[:, 3] - t[:, 2], t[:, 4]
    d = sk - sq
    # causal: row i keeps max(0, i + d + 1) keys (never more than sk for i < sq)
    a = np.maximum(0, -d)
    n = np.maximum(0, sq - a)
    causal = n * (d + 1) + (n * (a + sq - 1)) // 2
    # inv_causal: row i keeps max(0, sk - i)
    m = np.minimum(sq, sk)
    inv = m * sk - (m * (m - 1)) // 2
    bi = sq * np.maximum(0, d + 1)
    area = np.select([kind == 0, kind == 1, kind == 2], [sq * sk, causal, inv], bi)
    return area.astype(np.float64), sq.astype(np.float64)


def band_cells(tiles: np.ndarray, cells: np.ndarray) -> float:
    """Kept cells of the band (BI_CAUSAL) tiles among ``tiles`` (``cells``: each tile's kept cells)."""
    return float(cells[np.asarray(tiles).reshape(-1, 5)[:, 4] == 3].sum())


def _bands(t: np.ndarray, min_rows: int, band_chunk: int, band_min_keys: float):
    """(mask of BI_CAUSAL tiles the dense split cuts into band pieces, their chunk count n, band w)."""
    sq, sk, kind = t[:, 1] - t[:, 0], t[:, 3] - t[:, 2], t[:, 4]
    w = sk - sq
    band = ((kind == 3) & (band_chunk > 0) & (w >= band_chunk + band_min_keys)
            & (sq // max(band_chunk, 1) * band_chunk >= max(min_rows, 1)))
    return band, sq // max(band_chunk, 1), w


def dense_pieces(tiles: np.ndarray, min_rows: int, min_keys: float, band_chunk: int = 0,
                 band_min_keys: float = 1024):
    """The dense (cuDNN) calls of ``tiles`` as arrays over calls: (rows, keys, cells, causal, batch) (float,
    bool, float): rows and keys of one piece, ``batch`` pieces per call (band pieces: a full rectangle
    ``band_chunk x (w - band_chunk)`` and a square causal ``band_chunk`` per chunk), cells of the whole
    call. Restates kernels/dense_tiles.split_dense: a FULL tile of at least min_rows x min_keys; of a
    bottom-right CAUSAL tile (rows trimmed to at most sk), its full part (sq x (sk - sq)) and its square
    causal part (sq x sq) when each is that big; the band pieces of a BI_CAUSAL tile."""
    t = np.asarray(tiles, dtype=np.int64).reshape(-1, 5)
    sq, sk, kind = t[:, 1] - t[:, 0], t[:, 3] - t[:, 2], t[:, 4]
    full = (kind == 0) & (sq >= min_rows) & (sk >= min_keys)
    cq = np.minimum(sq, sk)
    d = sk - cq
    c_full = (kind == 1) & (d > 0) & (cq >= min_rows) & (d >= min_keys)
    c_sq = (kind == 1) & (cq >= min_rows) & (cq >= min_keys)
    band, n, w = _bands(t, min_rows, band_chunk, band_min_keys)
    nb = int(band.sum())
    c = np.full(nb, band_chunk, dtype=np.int64)
    rows = np.concatenate([sq[full], cq[c_full], cq[c_sq], c, c]).astype(np.float64)
    keys = np.concatenate([sk[full], d[c_full], cq[c_sq], w[band] - c, c]).astype(np.float64)
    causal = np.concatenate([np.zeros(int(full.sum()) + int(c_full.sum()), bool), np.ones(int(c_sq.sum()), bool),
                             np.zeros(nb, bool), np.ones(nb, bool)])
    batch = np.concatenate([np.ones(int(full.sum() + c_full.sum() + c_sq.sum())), n[band], n[band]]).astype(np.float64)
    cells = batch * np.where(causal, rows * (rows + 1) / 2, rows * keys)
    return rows, keys, cells, causal, batch


def dense_rest(tiles: np.ndarray, min_rows: int, min_keys: float, band_chunk: int = 0,
               band_min_keys: float = 1024) -> np.ndarray:
    """The tiles the dense split leaves to Triton (int [m, 5]), as kernels/dense_tiles.split_dense's rest
    list: tiles with no dense piece whole (a CAUSAL one without its rows that keep nothing); of a CAUSAL
    tile with one, the other piece (its full part as a FULL tile, its square part as a CAUSAL one) when
    that piece is not dense too; of a band, its INV_CAUSAL squares and the rows below its last chunk."""
    t = np.asarray(tiles, dtype=np.int64).reshape(-1, 5)
    qs, qe, ks, ke, kind = t.T
    sq, sk = qe - qs, ke - ks
    big = lambda r, k: (r >= min_rows) & (k >= min_keys)  # noqa: E731
    cq = np.minimum(sq, sk)
    q0 = qe - cq
    d = sk - cq
    causal = kind == 1
    full_ok = causal & (d > 0) & big(cq, d)
    sq_ok = causal & big(cq, cq)
    band, n, _ = _bands(t, min_rows, band_chunk, band_min_keys)
    whole = np.where(kind == 0, ~big(sq, sk), ~(full_ok | sq_ok)) & ~band
    kept = t[whole].copy()
    kept[:, 0] = np.where(kept[:, 4] == 1, q0[whole], kept[:, 0])  # causal rows keeping nothing dropped
    parts = [kept]
    split = ~whole & causal
    f = split & (d > 0) & ~full_ok
    parts.append(np.stack([q0, qe, ks, ks + d, np.zeros_like(kind)], 1)[f])
    c = split & ~sq_ok
    parts.append(np.stack([q0, qe, ks + d, ke, np.ones_like(kind)], 1)[c])
    for i in np.nonzero(band)[0].tolist():  # one row per chunk: the INV_CAUSAL squares, then the tail
        b = np.arange(n[i], dtype=np.int64) * band_chunk
        parts.append(np.stack([qs[i] + b, qs[i] + b + band_chunk, ks[i] + b, ks[i] + b + band_chunk,
                               np.full_like(b, 2)], 1))
        e = qs[i] + n[i] * band_chunk
        if e < qe[i]:
            parts.append(np.array([[e, qe[i], ks[i] + n[i] * band_chunk, ke[i], 3]], dtype=np.int64))
    out = np.concatenate(parts)
    return out[np.lexsort((out[:, 2], out[:, 0]))] if len(out) else out


def _band_squares(t: np.ndarray, min_window: int):
    """(mask of BI_CAUSAL tiles cut into band squares, chunk rows C, chunk count n, window w): restates
    kernels/dense_tiles.split_band_squares."""
    sq, sk, kind = t[:, 1] - t[:, 0], t[:, 3] - t[:, 2], t[:, 4]
    w = sk - sq
    c = np.minimum(w, sq)
    sel = (kind == 3) & (min_window > 0) & (c >= max(min_window, 1))
    return sel, c, sq // np.maximum(c, 1), w


def band_square_pieces(tiles: np.ndarray, min_window: int):
    """The forward's band squares of ``tiles`` as ``dense_pieces``' arrays plus ``reverse``: per band, a
    reversed (INV_CAUSAL) square of C rows, a full C x (w - C) rectangle when w > C, a causal square,
    each a batch of n chunks."""
    t = np.asarray(tiles, dtype=np.int64).reshape(-1, 5)
    sel, c, n, w = _band_squares(t, min_window)
    c, n, w = c[sel].astype(np.float64), n[sel].astype(np.float64), w[sel].astype(np.float64)
    wide = w > c
    nb, nw = len(c), int(wide.sum())
    rows = np.concatenate([c, c[wide], c])
    keys = np.concatenate([c, (w - c)[wide], c])
    causal = np.concatenate([np.ones(nb, bool), np.zeros(nw, bool), np.ones(nb, bool)])
    batch = np.concatenate([n, n[wide], n])
    rev = np.concatenate([np.ones(nb, bool), np.zeros(nw + nb, bool)])
    cells = batch * np.where(causal, rows * (rows + 1) / 2, rows * keys)
    return rows, keys, cells, causal, batch, rev


def band_pairs_direct(tiles: np.ndarray, min_window: int) -> bool:
    """Whether the forward writes the band squares of ``tiles`` (a list without other dense pieces)
    straight into its output: every cut band is a pair of squares (window = chunk rows, no rectangle) and
    the pairs' rows are theirs alone (restates the Triton backend's ``_direct_pairs``;
    tests/test_cost_model.py compares the two)."""
    t = np.asarray(tiles, dtype=np.int64).reshape(-1, 5)
    sel, c, n, w = _band_squares(t, min_window)
    if not sel.any() or (w[sel] > c[sel]).any():
        return False
    a = t[sel, 0]
    b = a + (n * c)[sel]
    order = np.argsort(a)
    a, b = a[order], b[order]
    if (a[1:] < b[:-1]).any():
        return False
    rest = band_square_rest(t, min_window)
    if not len(rest):
        return True
    i = np.searchsorted(a, rest[:, 1], side="left")  # pairs starting before each rest tile's end
    prev_end = np.where(i > 0, b[np.maximum(i - 1, 0)], np.iinfo(np.int64).min)
    return not (prev_end > rest[:, 0]).any()


def band_square_rest(tiles: np.ndarray, min_window: int) -> np.ndarray:
    """``tiles`` without the band squares' cells (as split_band_squares' rest): other tiles whole, each
    cut band's rows below its last chunk as a BI_CAUSAL tile."""
    t = np.asarray(tiles, dtype=np.int64).reshape(-1, 5)
    sel, c, n, _ = _band_squares(t, min_window)
    e = t[:, 0] + n * c
    tail = t[sel & (e < t[:, 1])].copy()
    cut = (n * c)[sel & (e < t[:, 1])]
    tail[:, 0] += cut
    tail[:, 2] += cut
    out = np.concatenate([t[~sel], tail])
    return out[np.lexsort((out[:, 2], out[:, 0]))] if len(out) else out


def _block_rows(t: np.ndarray, block_m: int, block_n: int):
    """Per (tile, q block) pair of ``t``: (tile id, q block, visited k blocks, full k blocks), as the
    kernels' block schedule (_block_pairs) counts them."""
    qs, qe, ks, ke, kind = t.T
    big = 1 << 40
    hi = np.where((kind == 1) | (kind == 3), ke - qe, big)  # lo <= k - q <= hi
    lo = np.where((kind == 2) | (kind == 3), ks - qs, -big)
    m0, m1 = qs // block_m, (qe - 1) // block_m + 1
    cnt = np.maximum(m1 - m0, 0)
    tid = np.repeat(np.arange(len(t)), cnt)
    m = np.repeat(m0, cnt) + np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    bq0, bq1 = m * block_m, (m + 1) * block_m - 1
    r0, r1 = np.maximum(qs[tid], bq0), np.minimum(qe[tid] - 1, bq1)
    # keys some row of the block keeps form one run (rows' ranges shift by one per row)
    c0, c1 = np.maximum(ks[tid], r0 + lo[tid]), np.minimum(ke[tid] - 1, r1 + hi[tid])
    vis = np.where(c1 >= c0, c1 // block_n - c0 // block_n + 1, 0)
    # a full block: all its rows in the tile and every key of it kept by every row
    a = np.maximum(ks[tid], lo[tid] + bq1)
    b = np.minimum(ke[tid] - 1, hi[tid] + bq0)
    inside = (qs[tid] <= bq0) & (qe[tid] - 1 >= bq1)
    full = np.where(inside, np.maximum((b + 1) // block_n - 1 - (-(-a // block_n)) + 1, 0), 0)
    return tid, m, vis, full


def block_counts(tiles: np.ndarray, block_m: int, block_n: int) -> tuple[np.ndarray, np.ndarray]:
    """(visited, full) per tile: its block_m x block_n blocks holding a kept cell (the kernel visits them)
    and those whose every cell is kept, as the kernels' block schedule (_block_pairs) counts them."""
    t = np.asarray(tiles, dtype=np.int64).reshape(-1, 5)
    if len(t) == 0:
        return np.zeros(0), np.zeros(0)
    tid, _, vis, full = _block_rows(t, block_m, block_n)
    n = len(t)
    return (np.bincount(tid, vis, minlength=n).astype(np.float64),
            np.bincount(tid, full, minlength=n).astype(np.float64))


def row_block_entries(tiles: np.ndarray, block_m: int, block_n: int) -> np.ndarray:
    """Entries of each q block's row in the forward schedule: the k blocks a program of that q block
    visits over all tiles (a block met by two tiles counts twice, as the schedule lists it)."""
    t = np.asarray(tiles, dtype=np.int64).reshape(-1, 5)
    if len(t) == 0:
        return np.zeros(0)
    _, m, vis, _ = _block_rows(t, block_m, block_n)
    return np.bincount(m - m.min(), vis).astype(np.float64) if len(m) else np.zeros(0)


def _row_keys(tiles: np.ndarray, cells: np.ndarray, covered: bool = False):
    """For each tile, rows x (mean keys kept per row over the whole list) on its rows, with ``cells``
    [n] the cells of each tile counted (spread evenly over the tile's rows). ``covered``: also the
    number of rows with any counted cell, as ``(per_tile, covered)``."""
    t = np.asarray(tiles, dtype=np.int64).reshape(-1, 5)
    if len(t) == 0:
        return (np.zeros(0), 0) if covered else np.zeros(0)
    q0, q1 = t[:, 0], t[:, 1]
    base = int(q0.min())
    n = int(q1.max()) - base
    per_row = cells / np.maximum(q1 - q0, 1)
    diff = np.zeros(n + 1)
    np.add.at(diff, q0 - base, per_row)
    np.add.at(diff, q1 - base, -per_row)
    row = np.cumsum(diff[:-1])  # keys kept by each row over all tiles
    pre = np.concatenate([[0.0], np.cumsum(row)])
    per_tile = pre[q1 - base] - pre[q0 - base]
    return (per_tile, int((row > 1e-9).sum())) if covered else per_tile
