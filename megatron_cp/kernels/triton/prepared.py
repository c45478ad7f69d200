"""A Triton tile list prepared on the host: ``prepare_list`` checks a rank's tiles, classes its rows, builds the tile
descriptors and, where the backend may run cuDNN, splits each direction into cuDNN pieces and a Triton rest
(kernels/pieces.py); ``TritonPrepared`` keeps it with the block schedules built per block shape (on the host, once)
and copied per device on first use.

``prepare_list`` is host work only with a picklable result, so a new plan's lists can be prepared ahead in the
planning helper process (``runtime.plan_in_helper``): ``TritonBackend.prepare_host`` is a ``HostPrepare``, the
backend's configuration and split decision, which the helper calls with the calls' head dim so that the block
schedules - most of a list's preparation - are built there too.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import TritonConfig
from ..pieces import Pieces, row_class, split_pieces, uncovered_rows
from ..tiles import check_tiles
from ..upload import upload_all
from .blocks import BlockSchedule, build_schedules, tile_descriptors
from .sparse import head_schedule, static_entries

__all__ = ["CudnnSplit", "HostPrepare", "TritonPrepared", "prepare_list"]

_NEVER = 1 << 62  # a piece size no list reaches: no cuDNN pieces but the whole-call one


@dataclass
class CudnnSplit:
    """One direction's run of a prepared list with cuDNN (kernels/pieces.py): the ``pieces``, the Triton
    ``rest`` (prepared; None when the pieces cover the list), ``whole`` (one piece that is the whole call),
    ``direct`` (forward: band-square pairs written straight into the output) and, when direct with no
    rest, the ``gaps``: rows nothing covers, (start, end), filled empty."""

    pieces: tuple
    rest: "TritonPrepared | None"
    whole: bool = False
    direct: bool = False
    gaps: tuple = ()


@dataclass
class TritonPrepared:
    """Per-list state: the tile list, its descriptors and block schedules (built on the host once per
    block shape, copied per device once), and the cuDNN splits of each direction (None: Triton only)."""

    tiles: torch.Tensor
    seqlen_q: int
    seqlen_k: int
    desc: torch.Tensor  # int32 [n, 6] (qs, qe, ks, ke, lo, hi)
    row_class: str = "long"  # kernels/pieces.row_class
    split_min: int = 16
    cudnn_fwd: CudnnSplit | None = None
    cudnn_bwd: CudnnSplit | None = None
    _host: dict = field(default_factory=dict)  # (bm, bn) -> (rows, cols) on cpu
    _dev: dict = field(default_factory=dict)  # (bm, bn, device) -> (desc, rows, cols)
    _entries: dict = field(default_factory=dict)  # (bm, bn, keep block, device) -> (rows, cols) StaticEntries

    # pickled (the planning helper's answers) with the tiles and descriptors as arrays (a tensor unpickles an order
    # of magnitude slower, in the planning thread) and without what lives on a device
    def __getstate__(self) -> dict:
        return dict(self.__dict__, tiles=self.tiles.numpy(), desc=self.desc.numpy(), _dev={}, _entries={})

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d, tiles=torch.from_numpy(d["tiles"]), desc=torch.from_numpy(d["desc"]))

    def schedules(self, block_m: int, block_n: int, device) -> tuple[torch.Tensor, BlockSchedule, BlockSchedule]:
        key = (block_m, block_n, str(device))
        if key not in self._dev:
            rows, cols = self.host_schedules(block_m, block_n)
            r, c = rows.arrays(), cols.arrays()  # every array of the pair in one copy
            desc, *t = upload_all([self.desc] + r + c, device)
            self._dev[key] = (desc, rows.placed(t[:len(r)]), cols.placed(t[len(r):]))
        return self._dev[key]

    def host_schedules(self, block_m: int, block_n: int):
        """(rows, cols) schedules of this block shape on the host, built on first use."""
        if (block_m, block_n) not in self._host:
            self._host[(block_m, block_n)] = build_schedules(self.tiles, self.seqlen_q, self.seqlen_k, block_m,
                                                             block_n, self.split_min)
        return self._host[(block_m, block_n)]

    def keep_schedule(self, block_m: int, block_n: int, keep, rows: bool) -> tuple[torch.Tensor, BlockSchedule]:
        """(desc, per-head schedule) of the row-major (``rows``) or column-major schedule narrowed by
        ``keep`` (a BlockKeep whose block block_m and block_n divide), built on the mask's device by
        ``triton_sparse.head_schedule``; the static parts (schedules, ``static_entries``) are cached here."""
        dev = keep.mask.device
        desc, r, c = self.schedules(block_m, block_n, dev)
        key = (block_m, block_n, keep.block, str(dev))
        if key not in self._entries:
            hr, hc = self._host[(block_m, block_n)]
            nkk = -(-self.seqlen_k // keep.block)
            self._entries[key] = (static_entries(hr, block_m, keep.block, nkk, True, dev),
                                  static_entries(hc, block_n, keep.block, nkk, False, dev))
        s = r if rows else c
        return desc, head_schedule(self._entries[key][0 if rows else 1], keep.mask, s.n_full, s.n_partial)


def prepare_list(config: TritonConfig, tiles, seqlen_q: int, seqlen_k: int, head_dims=(),
                 split: bool = False) -> TritonPrepared:
    """tiles int [n, 5] (tensor or array, host) -> the list prepared for ``config``: the schedules of ``head_dims``'
    configs built now, and with ``split`` (the backend may run cuDNN here) each direction's cuDNN pieces and
    Triton rest. What ``TritonBackend.prepare`` returns, made anywhere."""
    tiles = torch.from_numpy(np.ascontiguousarray(tiles)) if isinstance(tiles, np.ndarray) else tiles
    prep = _prepare(config, tiles, seqlen_q, seqlen_k, head_dims)
    if not (split and prep.tiles.shape[0]):
        return prep
    c = config
    kw = dict(min_rows=c.dense_min_rows if c.dense_tiles else _NEVER,
              min_keys=c.dense_min_keys if c.dense_tiles else _NEVER, seqlen_q=prep.seqlen_q, seqlen_k=prep.seqlen_k)
    bwd = split_pieces(prep.tiles, band_squares=0, forward=False, **kw)
    fwd = split_pieces(prep.tiles, band_squares=c.band_squares if c.dense_tiles else 0, forward=True, **kw)
    prep.cudnn_bwd = _split(config, bwd, prep, head_dims)
    prep.cudnn_fwd = prep.cudnn_bwd if fwd.cudnn == bwd.cudnn else _split(config, fwd, prep, head_dims)
    return prep


def _split(config: TritonConfig, p: Pieces, prep: TritonPrepared, head_dims) -> CudnnSplit | None:
    if not p.cudnn:
        return None
    rest = _prepare(config, p.rest, prep.seqlen_q, prep.seqlen_k, head_dims) if p.rest.shape[0] else None
    gaps = tuple(uncovered_rows(p.cudnn, prep.seqlen_q)) if p.direct and rest is None else ()
    return CudnnSplit(p.cudnn, rest, p.whole, p.direct, gaps)


def _prepare(config: TritonConfig, tiles, seqlen_q, seqlen_k, head_dims) -> TritonPrepared:
    check_tiles(tiles, seqlen_q, seqlen_k)
    tiles = tiles.to("cpu", torch.int32).contiguous()
    cls = row_class(tiles)
    prep = TritonPrepared(tiles, int(seqlen_q), int(seqlen_k), tile_descriptors(tiles).to(torch.int32).contiguous(),
                          cls, config.dkdv_split_min)
    for d in head_dims:
        c = config.for_head_dim(d, cls)
        for kc in (c.fwd, c.dq, c.dkdv):
            prep.host_schedules(kc.block_m, kc.block_n)
    return prep


@dataclass(frozen=True)
class HostPrepare:
    """``TritonBackend.prepare_host``: ``prepare_list`` of the backend's ``config`` and cuDNN ``split`` decision, a
    picklable callable ``(tiles, seqlen_q, seqlen_k) -> TritonPrepared`` for the planning helper process.
    ``head_dims``: whose schedules it builds too (``with_head_dims``: the helper knows the calls' head dim). ``name``
    says which lists it makes - the config and the split, not the head dims (schedules built ahead are those a call
    would build on first use) - so a state takes lists only from the backend configuration it runs."""

    config: TritonConfig
    split: bool
    head_dims: tuple = ()

    @property
    def name(self) -> str:
        digest = hashlib.sha256(repr((self.config, self.split)).encode()).hexdigest()[:16]
        return f"{__name__}.HostPrepare:{digest}"

    def with_head_dims(self, head_dims) -> "HostPrepare":
        return dataclasses.replace(self, head_dims=tuple(int(d) for d in head_dims))

    def __call__(self, tiles, seqlen_q: int, seqlen_k: int) -> TritonPrepared:
        return prepare_list(self.config, tiles, seqlen_q, seqlen_k, self.head_dims, self.split)
