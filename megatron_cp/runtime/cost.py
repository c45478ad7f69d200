"""A small cost model: kernel time per tile shape and collective time per link, from calibrated numbers.

Every figure is per GPU. ``tools/sim/calibrate.py`` measures them on a machine and writes JSON that
``CostModel.load`` reads; the defaults are one such calibration of a single NVLink node (docs/cost-model.md).

The rates are nested by what they price, each group with its prediction beside it:

- ``triton`` (``TritonRates``): the Triton kernels, one ``RowRates`` per row class (``long``, ``short``,
  ``blocky``: the kernels' own classes, ``kernels.pieces.row_class``). A tile list costs ``n_tiles * tile_us +
  (cells + half_keys * rows) / peak`` (in FLOPs), i.e. a tile runs at ``peak * keys / (keys + half_keys)`` with
  ``keys`` the mean kept keys of its rows (the kernel merges tiles sharing rows, so a row's cost follows the keys
  it keeps over the whole list); ``cells`` are the kept cells in the long class and the cells of every block the
  kernel visits in the others (a partly kept block costs a whole one); a blocky list mostly of band cells runs at
  its class's band peaks. A blocky forward list with a few very long rows among short ones (global rows) lasts at
  least as long as those rows' programs (``TritonRates.long_rows``; calibrated).
- ``dense`` (``DenseRates``): the cuDNN pieces the kernel backend cuts from a list (full rectangles, square causal
  pieces, forward band squares; the split is the kernels' own, ``kernels.pieces``: the cost model calls it, it
  never restates it); a piece of ``rows`` x ``keys`` costs ``flops(cells + half_keys * rows + half_rows * keys) /
  peak`` (or a measured grid's rate) over its wave efficiency on ``num_sms`` multiprocessors, plus ``piece_us``
  and one LSE merge at ``memory.hbm_gbps``.
- ``links`` (``LinkRates``): ``latency_us + intra_bytes / intra_gbps + inter_bytes / inter_gbps`` per collective
  (the busiest GPU's bytes; link kinds run concurrently, so it is the max); one neighbour's point-to-point
  transfer (the ring baseline's step, ``p2p_time``) measured at two sizes.
- ``memory`` (``MemoryRates``): the runtime's passes per stage and around an exchange; ``call``
  (``CallRates``): a call's exposed host time.

``CostModel.tile_time`` prices one kernel call: ``launch_us``, the dense pieces, the Triton rest. Calibration
files name the rates flat (``short_fwd_tflops`` for ``triton.short.fwd_tflops``: ``flat_names``), as
tools/sim/calibrate.py measures them; ``save`` writes the nested form and ``load`` reads both.

A whole step's prediction from a plan (the staged pipeline, the single exchange, guest rows) is
``runtime.predict``'s: it prices its parts with these methods.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, fields, is_dataclass

import numpy as np

from ..planner import Workload
from .rates import (RATES, CallRates, DenseGrid, DenseRates, LinkRates, MemoryRates, TritonRates, block_counts,
                    memo, row_block_entries, tile_areas, tile_digest)

__all__ = ["CostModel", "flat_names", "tile_areas", "block_counts", "row_block_entries"]

# fields of older calibration files that no longer mean anything (the options they described were
# removed, or the rule is now the kernels' own): dropped on load
_RETIRED = frozenset({"band_chunk", "band_min_keys", "long_row_keys", "blocky_full_fraction"})


_FLAT_PREFIX = {("triton", "long"): "", ("triton", "short"): "short_", ("triton", "blocky"): "blocky_",
                ("triton",): "", ("dense",): "dense_", ("dense", "grid"): "dense_grid_", ("links",): "",
                ("memory",): "", ("call",): "call_", (): ""}
_FLAT_RENAMED = {"dense_band_squares": "band_squares"}


@dataclass(frozen=True)
class CostModel:
    """Every figure is per GPU; the defaults are one run of tools/sim/calibrate.py on a single NVLink node
    (docs/cost-model.md names it). ``launch_us``: fixed cost per kernel call (one per stage), whichever backend
    runs it; ``num_sms``: the GPU's multiprocessors (0: waves and the long-row bound not modelled)."""

    triton: TritonRates = TritonRates()
    dense: DenseRates = DenseRates()
    links: LinkRates = LinkRates()
    memory: MemoryRates = MemoryRates()
    call: CallRates = CallRates()
    launch_us: float = 90.0
    num_sms: int = 0
    source: str = "default"  # where the numbers came from (calibration file, device)

    def __hash__(self) -> int:
        # hashed on every attention call (the runtime's state cache keys on it) and every priced tile list
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:  # a string's hash differs between processes: the cached one stays here
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    # -- files and variants ------------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)

    @classmethod
    def load(cls, path: str) -> "CostModel":
        """A file ``save`` wrote (nested), or a calibration file of flat fields (``from_flat``)."""
        with open(path) as f:
            raw = json.load(f)
        try:
            if any(isinstance(v, dict) for v in raw.values()):
                return _replace(cls(), raw)
            raw = {k: v for k, v in raw.items() if k not in _RETIRED}
            raw.setdefault("band_squares", 0)  # calibrated before the backend had band squares
            return cls.from_flat(raw)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def from_flat(cls, flat: dict) -> "CostModel":
        """The model of flat fields (``flat_names``: ``short_fwd_tflops`` for ``triton.short.fwd_tflops``, ...);
        the fields not given keep their defaults."""
        names = flat_names()
        unknown = sorted(set(flat) - set(names))
        if unknown:
            raise ValueError(f"unknown cost-model fields {unknown}; known: {sorted(names)}")
        nested: dict = {}
        for k, v in flat.items():
            *groups, leaf = names[k]
            d = nested
            for g in groups:
                d = d.setdefault(g, {})
            d[leaf] = v
        return _replace(cls(), nested)

    def flat(self) -> dict:
        """``{flat name: value}`` of every rate (``from_flat``'s inverse)."""
        out = {}
        for name, path in flat_names().items():
            v = self
            for p in path:
                v = getattr(v, p)
            out[name] = v
        return out

    def replace(self, **parts) -> "CostModel":
        """A copy with ``parts`` replaced: a group by a rates object, or by a dict of its fields to change
        (nested for nested groups), e.g. ``replace(links={"intra_gbps": 2.0}, triton={"blocky": {"fwd_tflops": 0.0}})``."""
        return _replace(self, parts)

    # -- predictions -------------------------------------------------------------------------------------------
    def tile_time(self, tiles: np.ndarray, work: Workload, backward: bool = False, key_split: int = 1,
                  accumulate: bool = False) -> float:
        """Seconds to run one kernel call over ``tiles`` (int [n, 5] rows q0, q1, k0, k1, kind): the call's
        launch, its dense pieces (``DenseRates``) and its Triton rest (``TritonRates``).

        ``key_split`` > 1: one of ``key_split`` calls over equal key pieces of ``tiles`` (a stage of a
        split), i.e. every tile with 1 / key_split of its keys and cells. ``accumulate``: a forward that
        adds into a running output (a stage), which never writes band-square pairs directly.

        Remembered by the tile list's content (``memo``): choosing a fresh plan's schedule prices the same
        own-key and remote tile lists once per candidate stage count and rank."""
        if len(tiles) == 0:
            return 0.0
        tiles = np.ascontiguousarray(np.asarray(tiles, dtype=np.int64).reshape(-1, 5))
        key = ("tile_time", self, tile_digest(tiles), work, bool(backward), int(key_split), bool(accumulate))
        return memo.get(key, lambda: self._tile_time(tiles, work, backward, key_split, accumulate))

    def _tile_time(self, tiles: np.ndarray, work: Workload, backward: bool, key_split: int, accumulate: bool) -> float:
        split = float(key_split)
        t = self.launch_us * 1e-6
        rest = tiles
        if self.dense.fwd_tflops > 0:
            dense, rest, direct = self.dense.pieces(tiles, backward, key_split, accumulate)
            if dense is not None:
                t += self.dense.time(dense, direct, work, backward, split, self.num_sms, self.memory.hbm_gbps)
        if len(rest) == 0:
            return t
        t_tiles, t_list = self.triton.list_time(rest, work, backward, split, self.num_sms)
        return t + t_tiles + t_list

    def rest_tiles(self, tiles: np.ndarray, backward: bool = False) -> np.ndarray:
        """The part of ``tiles`` the kernel backend runs in its own kernels (all of it without a dense path): the
        rest after the dense (cuDNN) pieces ``tile_time`` costs separately (forward: after band squares too)."""
        tiles = np.asarray(tiles, dtype=np.int64).reshape(-1, 5)
        if self.dense.fwd_tflops <= 0 or not len(tiles):
            return tiles
        return self.dense.pieces(tiles, backward, 1)[1]

    def row_class(self, tiles: np.ndarray) -> str:
        return self.triton.row_class(tiles)

    def wave_efficiency(self, extent, heads: int):
        return self.dense.wave_efficiency(extent, heads, self.num_sms)

    def comm_time(self, intra_bytes: float, inter_bytes: float) -> float:
        return self.links.comm_time(intra_bytes, inter_bytes)

    def p2p_time(self, nbytes: float) -> float:
        return self.links.p2p_time(nbytes)

    def stage_overhead(self, rows: int, work: Workload, backward: bool = False) -> float:
        return self.memory.stage_overhead(rows, work, backward)

    def exchange_passes(self, s_local: int, n_recv: int, n_send: int, work: Workload,
                        backward: bool = False, delta: bool = True) -> float:
        return self.memory.exchange_passes(s_local, n_recv, n_send, work, backward, delta)

    def call_time(self, backward: bool = False) -> float:
        return self.call.time(backward)


def flat_names() -> dict:
    """``{flat name: path of nested fields}`` of every rate of ``CostModel``."""
    return _FLAT_NAMES


def _flat_paths(cls, path: tuple) -> dict:
    out = {}
    for f in fields(cls):
        sub = path + (f.name,)
        group = _RATES.get(f.type)  # annotations are strings here (``from __future__ import annotations``)
        if group is not None:
            out.update(_flat_paths(group, sub))
        else:
            name = _FLAT_PREFIX[path] + f.name
            out[_FLAT_RENAMED.get(name, name)] = sub
    return out


def _replace(obj, parts: dict, path: tuple = ()):
    """``obj`` (a rates object) with ``parts`` replaced: a group by a rates object or by a dict of its fields to
    change (recursively, the rest keeping ``obj``'s values), lists as tuples; unknown fields refused."""
    known = {f.name for f in fields(obj)}
    unknown = sorted(set(parts) - known)
    if unknown:
        where = ".".join(path) or "the model"
        raise ValueError(f"unknown cost-model fields {unknown} in {where}; known: {sorted(known)}")
    kw = {}
    for k, v in parts.items():
        cur = getattr(obj, k)
        kw[k] = (_replace(cur, v, path + (k,)) if isinstance(v, dict) and is_dataclass(cur)
                 else tuple(v) if isinstance(v, list) else v)
    m = dataclasses.replace(obj, **kw)
    if isinstance(m, DenseGrid):
        g = (len(m.rows), len(m.keys))
        if g[0] * g[1] and (len(m.fwd_tflops) != g[0] * g[1] or len(m.bwd_tflops) != g[0] * g[1]):
            raise ValueError(f"dense grid of {g[0]} x {g[1]} shapes needs {g[0] * g[1]} rates per phase, got "
                             f"{len(m.fwd_tflops)} / {len(m.bwd_tflops)}")
    return m


_RATES = {c.__name__: c for c in RATES}
_FLAT_NAMES = _flat_paths(CostModel, ())
