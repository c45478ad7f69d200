"""A small cost model: kernel time per tile shape and collective time per link, from calibrated numbers.

Every figure is per GPU. ``tools/calibrate.py`` measures them on a machine and writes JSON that
``CostModel.load`` reads; the defaults are H100/H200-class guesses used until then.

Kernel time of a tile list: ``launch_us + sum(tile_us + flops / (peak * eff))`` where
``eff = keys / (keys + half_keys)`` and ``keys`` is the tile's mean kept keys per row: short rows
(sliding windows, short documents) run below peak because partly filled key blocks waste work.
Collective time: ``latency_us + intra_bytes / intra_gbps + inter_bytes / inter_gbps`` (per GPU, the
busiest GPU's bytes of one collective; links of different kinds run concurrently, so it is the max).
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
    fwd_tflops: float = 420.0  # attention forward on long rows (mask-area FLOPs), per GPU
    bwd_tflops: float = 330.0  # backward, counted as 2.5x the forward FLOPs
    half_keys: float = 192.0  # mean kept keys per row at which a tile runs at half of peak
    tile_us: float = 1.0  # fixed cost per tile
    launch_us: float = 20.0  # fixed cost per kernel call (one per stage)
    intra_gbps: float = 150.0  # achieved all-to-all bandwidth per GPU inside a node (GB/s)
    inter_gbps: float = 45.0  # achieved per GPU between nodes (400 Gb/s NIC per GPU)
    latency_us: float = 25.0  # fixed cost per collective
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
        return cls(**raw)

    def tile_time(self, tiles: np.ndarray, work: Workload, backward: bool = False) -> float:
        """Seconds to run one kernel call over ``tiles`` (int [n, 5] rows q0, q1, k0, k1, kind)."""
        if len(tiles) == 0:
            return 0.0
        peak = (self.bwd_tflops / 2.5 if backward else self.fwd_tflops) * 1e12
        area, rows = tile_areas(tiles)
        keys = area / np.maximum(rows, 1)
        eff = np.maximum(keys / (keys + self.half_keys), 1e-3)
        return float(self.launch_us * 1e-6 + len(area) * self.tile_us * 1e-6
                     + (4.0 * area * work.num_heads * work.head_dim / (peak * eff)).sum())

    def comm_time(self, intra_bytes: float, inter_bytes: float) -> float:
        """Seconds for one collective whose busiest GPU moves these bytes (0 bytes: no collective)."""
        if intra_bytes <= 0 and inter_bytes <= 0:
            return 0.0
        return self.latency_us * 1e-6 + max(intra_bytes / (self.intra_gbps * 1e9), inter_bytes / (self.inter_gbps * 1e9))


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
