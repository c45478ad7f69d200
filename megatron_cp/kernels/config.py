"""The Triton kernels' configuration, shared by every backend that runs them (TritonBackend, and FA4Backend for
its Triton fallback): block shapes per phase (``KernelConfig``, ``PhaseConfigs``), their defaults by head dim and
row class (``DEFAULT_CONFIGS``) and the backend options (``TritonConfig``). Plain dataclasses: importing this
module loads no kernel."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["DEFAULT_CONFIGS", "FP32_CONFIGS", "KernelConfig", "PhaseConfigs", "TritonConfig", "configs_from_json"]


@dataclass(frozen=True)
class KernelConfig:
    """Block shape and launch parameters of one kernel: block_m q rows x block_n k rows."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    tma: bool = False  # load the streamed K/V (fwd, dQ) or Q/dO (dK/dV) blocks through tensor descriptors


@dataclass(frozen=True)
class PhaseConfigs:
    """The KernelConfig of each phase: the forward, the backward's dK/dV and its dQ kernels."""

    fwd: KernelConfig
    dkdv: KernelConfig
    dq: KernelConfig


# Defaults by (head_dim, row class, kernels/pieces.py). head_dim 128: the fastest of a sweep of candidate
# configs at S = 16k (tools/bench_kernels.py --tune; docs/measurements.md names the run; checked by
# tools/gpu_kernel_check.py with exactly these). tma=True loads the streamed blocks with the copy engine
# (Hopper+; ignored on older GPUs and on CPU). Other head dims: untuned, checked for correctness only; head
# dims without a "blocky" entry use their "short" configs.
DEFAULT_CONFIGS: dict[tuple[int, str], PhaseConfigs] = {
    (64, "long"): PhaseConfigs(KernelConfig(128, 64, 4, 3), KernelConfig(32, 64, 4, 3), KernelConfig(64, 64, 4, 3)),
    (64, "short"): PhaseConfigs(KernelConfig(64, 64, 4, 3), KernelConfig(32, 64, 4, 3), KernelConfig(64, 64, 4, 3)),
    (128, "long"): PhaseConfigs(KernelConfig(128, 128, 8, 3, True), KernelConfig(64, 64, 4, 3, True),
                                KernelConfig(64, 64, 4, 3, True)),
    (128, "short"): PhaseConfigs(KernelConfig(64, 64, 4, 3, True), KernelConfig(64, 64, 4, 3, True),
                                 KernelConfig(64, 64, 4, 3, True)),
    (128, "blocky"): PhaseConfigs(KernelConfig(128, 64, 4, 3, True), KernelConfig(64, 64, 4, 3, True),
                                  KernelConfig(64, 64, 4, 3, True)),
    (256, "long"): PhaseConfigs(KernelConfig(64, 32, 4, 2), KernelConfig(32, 64, 4, 2), KernelConfig(64, 32, 4, 2)),
    (256, "short"): PhaseConfigs(KernelConfig(64, 32, 4, 2), KernelConfig(32, 64, 4, 2), KernelConfig(64, 32, 4, 2)),
}
# float32 inputs (tests, debugging): small blocks, one stage, so shared memory fits at any head_dim
FP32_CONFIGS = PhaseConfigs(KernelConfig(32, 32, 4, 1), KernelConfig(32, 32, 4, 1), KernelConfig(32, 32, 4, 1))


@dataclass
class TritonConfig:
    """Backend options.

    overrides: head_dim or (head_dim, row class) -> PhaseConfigs replacing the defaults (tiny blocks in
        tests, configs from a sweep, ``configs_from_json``).
    deterministic: backward bitwise reproducible (Triton kernels only, no cuDNN).
    dense_fast_path: run dense pieces on cuDNN (CUDA, float16 / bfloat16, not deterministic): a list
        that is one full / square causal tile over everything as one cuDNN call, and with dense_tiles
        the pieces of other lists (kernels/pieces.py).
    dkdv_split_min: see triton_blocks.column_work (long key columns run as several programs).
    dense_tiles: with dense_fast_path, also split other lists into cuDNN pieces (full rectangles, square
        causal tiles; bottom-right causal tiles split into both) of at least dense_min_rows x
        dense_min_keys, the rest on Triton, merged by LSE. dense_min_keys 8192: short pieces lose
        (kernels/pieces.py says what was measured).
    band_squares: forward only, bands (BI_CAUSAL tiles: sliding windows) whose window and rows are both
        at least this many run on cuDNN as batched squares (kernels/pieces.py), merged in one pass,
        straight into the output when the pairs' rows are theirs alone; 0 keeps bands on Triton. The
        backward keeps bands on Triton. Default 4096: from that window on the squares beat the Triton
        band, below it their extra passes cost more than cuDNN gains (docs/measurements.md;
        docs/tried-and-lost.md for band chunks).
    """

    overrides: dict = field(default_factory=dict)
    deterministic: bool = False
    dense_fast_path: bool = True
    dkdv_split_min: int = 16  # dK/dV: split k blocks with > 2x the mean entries and > this many (schedule)
    dense_tiles: bool = True
    dense_min_rows: int = 512
    dense_min_keys: int = 8192
    band_squares: int = 4096

    def for_head_dim(self, head_dim: int, row_class: str = "long", dtype=None) -> PhaseConfigs:
        if (head_dim, row_class) in self.overrides:
            return self.overrides[(head_dim, row_class)]
        if head_dim in self.overrides:
            return self.overrides[head_dim]
        if dtype == torch.float32:
            return FP32_CONFIGS
        d = min({d for d, _ in DEFAULT_CONFIGS}, key=lambda x: (x < head_dim, abs(x - head_dim)))
        return DEFAULT_CONFIGS.get((d, row_class)) or DEFAULT_CONFIGS[(d, "short")]


def configs_from_json(obj: dict) -> dict:
    """{"128/long": {"fwd": [bm, bn, warps, stages, tma], "dkdv": [...], "dq": [...]}, ...} -> overrides."""
    out = {}
    for key, st in obj.items():
        d, cls = key.split("/")
        out[(int(d), cls)] = PhaseConfigs(*(KernelConfig(*map(int, st[n][:4]), bool(st[n][4])) for n in ("fwd", "dkdv", "dq")))
    return out
