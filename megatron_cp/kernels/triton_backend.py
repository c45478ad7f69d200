"""TritonBackend: fused attention over tile lists (forward, accumulating forward, backward).

Interface as in ``kernels/__init__.py``. Configuration is explicit (``TritonConfig``); nothing is read
from the environment. Triton's CPU interpreter (``TRITON_INTERPRET=1`` set by the caller before
``triton`` is imported) runs the same kernels on CPU tensors for tests.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from .tiles import CAUSAL, INV_CAUSAL, check_tiles
from .triton_bwd import attn_bwd_dkdv_kernel, attn_bwd_dkdv_reduce_kernel, attn_bwd_dq_kernel
from .triton_fwd import LOG2E, attn_fwd_kernel
from .dense_fast_path import (band_view, cudnn_backward, cudnn_backward_batched, cudnn_forward, cudnn_forward_batched,
                              dense_kind)
from .dense_tiles import split_band_squares, split_dense
from .merge import merge_into
from .triton_delta import head_major, row_delta
from .triton_schedule import BlockSchedule, build_schedules, covered_rows, kept_area, tile_descriptors


@dataclass(frozen=True)
class KernelConfig:
    """Block shape and launch parameters of one kernel: block_m q rows x block_n k rows."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    tma: bool = False  # load the streamed K/V (fwd, dQ) or Q/dO (dK/dV) blocks through tensor descriptors


@dataclass(frozen=True)
class StageConfigs:
    fwd: KernelConfig
    dkdv: KernelConfig
    dq: KernelConfig


# Defaults by (head_dim, row class). Row class "long" when the mean kept keys per row is >= 4096
# (dense / causal-like), "short" otherwise (windows, short documents), where smaller blocks waste less on
# partial blocks. head_dim 128: tuned on H200 at S = 16k by tools/bench_kernels.py --tune
# (benchmarks/kernels/tune.json, tuned_configs.json; checked by tools/gpu_kernel_check.py with exactly
# these). tma=True loads the streamed blocks with the copy engine (Hopper+; ignored on older GPUs and
# on CPU). Other head dims: untuned, checked for correctness only.
DEFAULT_CONFIGS: dict[tuple[int, str], StageConfigs] = {
    (64, "long"): StageConfigs(KernelConfig(128, 64, 4, 3), KernelConfig(32, 64, 4, 3), KernelConfig(64, 64, 4, 3)),
    (64, "short"): StageConfigs(KernelConfig(64, 64, 4, 3), KernelConfig(32, 64, 4, 3), KernelConfig(64, 64, 4, 3)),
    (128, "long"): StageConfigs(KernelConfig(128, 128, 8, 3, True), KernelConfig(64, 64, 4, 3, True),
                                KernelConfig(64, 64, 4, 3, True)),
    (128, "short"): StageConfigs(KernelConfig(64, 64, 4, 3, True), KernelConfig(64, 64, 4, 3, True),
                                 KernelConfig(64, 64, 4, 3, True)),
    (128, "blocky"): StageConfigs(KernelConfig(128, 64, 4, 3, True), KernelConfig(64, 64, 4, 3, True),
                                  KernelConfig(64, 64, 4, 3, True)),
    (256, "long"): StageConfigs(KernelConfig(64, 32, 4, 2), KernelConfig(32, 64, 4, 2), KernelConfig(64, 32, 4, 2)),
    (256, "short"): StageConfigs(KernelConfig(64, 32, 4, 2), KernelConfig(32, 64, 4, 2), KernelConfig(64, 32, 4, 2)),
}
LONG_ROW_KEYS = 4096
# "blocky": short rows whose 128 x 64 forward blocks are mostly full (strided blocks, documents, global +
# local), where a 128-row forward block with 4 warps pays. Measured on H200, S = 16k, forward TFLOP/s of
# 128x64x4 vs 64x64x4 (benchmarks/kernels/tune_1053): strided 414 vs 366 (full fraction 0.94), global +
# local 406 vs 395 (0.89), documents 355 vs 340 (0.82); sliding window 342 vs 357 (0.78), streaming
# 319 vs 331 (0.74). Other head dims use their "short" configs.
BLOCKY_FULL_FRACTION = 0.8
# float32 inputs (tests, debugging): small blocks, one stage, so shared memory fits at any head_dim
FP32_CONFIGS = StageConfigs(KernelConfig(32, 32, 4, 1), KernelConfig(32, 32, 4, 1), KernelConfig(32, 32, 4, 1))


@dataclass
class TritonConfig:
    """Backend options.

    overrides: head_dim or (head_dim, row class) -> StageConfigs replacing the defaults (tiny blocks in
        tests, configs tuned by tools/bench_kernels.py --tune).
    deterministic: backward bitwise reproducible (Triton kernels only, no atomics, no cuDNN).
    dense_fast_path: route a single full / square causal tile covering everything to cuDNN (CUDA only).
    dkdv_split_min: see triton_schedule.column_work (long key columns run as several programs).
    bwd_mode: "deterministic" (dK/dV programs and dQ programs, each output written once: bitwise
        reproducible) or "atomic" (dQ accumulated with fp32 atomics inside the dK/dV programs: 5 instead of
        7 matmuls per block pair, not reproducible bitwise; kernels/triton_bwd_atomic.py).
    dense_tiles: with dense_fast_path, also split other tile lists into dense pieces (full rectangles,
        square causal tiles; bottom-right causal tiles split into both, kernels/dense_tiles.py) of at least
        dense_min_rows x dense_min_keys, run on cuDNN, and the rest on Triton, merged by LSE (CUDA only).
        Measured (benchmarks/kernels/README.md, H100): zigzag rank lists (pieces of 16k rows, >= 16k keys)
        1.35x fwd / 1.49x bwd; packed documents at 16k (square pieces of 0.5k-4k) 3.3x slower fwd with
        512-key pieces (per-piece launches and fp32 merges dominate short rows), hence dense_min_keys 8192.
        Bands (BI_CAUSAL tiles: sliding windows) of at least band_chunk + band_min_keys keys per row are cut
        in chunks of band_chunk rows whose full rectangles and square causal tiles run as two batched cuDNN
        calls (kernels/dense_tiles.py); band_chunk 0 (default) keeps bands on Triton. Off by default:
        measured on H200 (tools/bench_band.py, benchmarks/dist/run_2126/), the benchmark's window of 4096
        at S = 128k, cp 4: forward 5.12 / 5.22 / 5.36 ms at chunks 256 / 512 / 1024 vs 5.17 on Triton,
        backward 25.6 / 20.9 / 19.2 vs 15.0 (cuDNN's dK/dV of overlapping windows, folded afterwards).
    band_squares: forward only, bands (BI_CAUSAL tiles) whose window and rows are both at least this many
        run on cuDNN as batched squares (kernels/dense_tiles.py, split_band_squares: per chunk of
        C = min(window, rows) rows a reversed-causal square, a full rectangle when the window is wider,
        a causal square; the reversed square on flipped copies of the chunk's rows and keys), merged in one
        pass, straight into the output when the pairs' rows are theirs alone; 0 keeps bands on Triton.
        The backward keeps bands on Triton (band_chunk aside): the flips and the gradients' extra passes
        would cost what cuDNN gains. Default 4096, measured on H200 (one rank's band of 32768 rows, bf16,
        Hq 32, Hkv 8, D 128; benchmarks/kernels/band_squares/direct_0517/): forward ms on Triton vs squares,
        written / accumulated into a float32 running pair as the staged runtime does: window 2048 2.80 vs
        3.17 / 3.03 vs 3.01, 4096 5.21 vs 4.77 / 5.47 vs 5.02 (1.09x; the benchmark's rank-1 tiles 5.31 vs
        4.86 / 5.52 vs 5.05), 8192 10.65 vs 8.40 / 10.91 vs 8.83 (1.27x / 1.24x).
    autotune: pick each kernel's KernelConfig per (head_dim, dtype, Hq // Hkv, row class, phase) by timing
        candidates on the first call that meets the key (CUDA only; cached process-wide, reused by later
        calls; kernels/triton_autotune.py). The first call is slow (compiles, times): run one untimed
        warmup step. Not with deterministic=True (timings choose the block shapes, hence the bits).
    autotune_candidates: (head_dim, phase) -> sequence of KernelConfig, replacing
        triton_autotune.CANDIDATES for that pair (phase "fwd", "dkdv", "dq" or "bwd_atomic"); the
        untuned config is always tried first.
    """

    overrides: dict = field(default_factory=dict)
    deterministic: bool = False
    dense_fast_path: bool = True
    dkdv_split_min: int = 16  # dK/dV: split k blocks with > 2x the mean entries and > this many (schedule)
    dense_tiles: bool = True
    dense_min_rows: int = 512
    dense_min_keys: int = 8192
    band_chunk: int = 0
    band_min_keys: int = 1024
    band_squares: int = 4096
    bwd_mode: str = "deterministic"
    autotune: bool = False
    autotune_candidates: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.bwd_mode not in ("deterministic", "atomic"):
            raise ValueError(f"bwd_mode must be 'deterministic' or 'atomic', got {self.bwd_mode!r}")
        if self.deterministic and self.bwd_mode != "deterministic":
            raise ValueError(f"deterministic=True needs bwd_mode='deterministic', got {self.bwd_mode!r}")
        if self.deterministic and self.autotune:
            raise ValueError("deterministic=True excludes autotune=True: the block shapes it picks come from "
                             "timings, so two runs could differ bitwise")

    def for_head_dim(self, head_dim: int, row_class: str = "long", dtype=None) -> StageConfigs:
        if (head_dim, row_class) in self.overrides:
            return self.overrides[(head_dim, row_class)]
        if head_dim in self.overrides:
            return self.overrides[head_dim]
        if dtype == torch.float32:
            return FP32_CONFIGS
        d = min({d for d, _ in DEFAULT_CONFIGS}, key=lambda x: (x < head_dim, abs(x - head_dim)))
        return DEFAULT_CONFIGS.get((d, row_class)) or DEFAULT_CONFIGS[(d, "short")]


@dataclass
class TritonPrepared:
    """Per-plan state: the tile list, its descriptors and block schedules (cached per block shape
    and device, built on the host once)."""

    tiles: torch.Tensor
    seqlen_q: int
    seqlen_k: int
    desc: torch.Tensor  # int32 [n, 6] (qs, qe, ks, ke, lo, hi)
    row_class: str = "long"  # "long" / "short" (mean kept keys per row vs LONG_ROW_KEYS) / "blocky"
    dense: bool | None = None  # is_causal for the dense fast path, None when it does not apply
    split_min: int = 16
    dense_plan: list = field(default_factory=list)  # dense pieces (qs, qe, ks, ke, kind, n) for cuDNN
    rest: "TritonPrepared | None" = None  # the other tiles (Triton) when dense_plan is used; None: none
    # the forward's own split when it differs (band squares): dense pieces and the Triton rest
    fwd_plan: list | None = None
    fwd_rest: "TritonPrepared | None" = None
    # the forward's pieces are band-square pairs whose rows nothing else touches: written straight into the
    # output (one pass, its dtype); rows neither they nor the rest cover, as (start, end), filled empty
    fwd_direct: bool = False
    fwd_gaps: list = field(default_factory=list)

    def forward_parts(self):
        """(dense pieces, Triton rest) of the forward."""
        return (self.dense_plan, self.rest) if self.fwd_plan is None else (self.fwd_plan, self.fwd_rest)
    _host: dict = field(default_factory=dict)  # (bm, bn) -> (rows, cols) on cpu
    _dev: dict = field(default_factory=dict)  # (bm, bn, device) -> (desc, rows, cols)

    def schedules(self, block_m: int, block_n: int, device) -> tuple[torch.Tensor, BlockSchedule, BlockSchedule]:
        key = (block_m, block_n, str(device))
        if key not in self._dev:
            if (block_m, block_n) not in self._host:
                self._host[(block_m, block_n)] = build_schedules(
                    self.tiles, self.seqlen_q, self.seqlen_k, block_m, block_n, self.split_min)
            rows, cols = self._host[(block_m, block_n)]
            self._dev[key] = (self.desc.to(device), rows.to(device), cols.to(device))
        return self._dev[key]


def configs_from_json(obj: dict) -> dict:
    """{"128/long": {"fwd": [bm, bn, warps, stages, tma], "dkdv": [...], "dq": [...]}, ...} -> overrides."""
    out = {}
    for key, st in obj.items():
        d, cls = key.split("/")
        out[(int(d), cls)] = StageConfigs(*(KernelConfig(*map(int, st[n][:4]), bool(st[n][4])) for n in ("fwd", "dkdv", "dq")))
    return out


def _check_call(q, k, v, prepared) -> None:
    """``_check_qkv`` and the lengths ``prepared`` was built for."""
    _check_qkv(q, k, v)
    if q.shape[0] != prepared.seqlen_q or k.shape[0] != prepared.seqlen_k:
        raise ValueError(f"q/k lengths {q.shape[0]}/{k.shape[0]} differ from the prepared "
                         f"{prepared.seqlen_q}/{prepared.seqlen_k}")


def _check_qkv(q, k, v):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [s, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    if k.shape[2] != d:
        raise ValueError(f"q and k head_dim differ: {d} vs {k.shape[2]}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hkv={hkv} must divide Hq={hq}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"TritonBackend supports power-of-two head_dim >= 16, got {d}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one of fp16/bf16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}")


def _descriptor(t: torch.Tensor, block_rows: int):
    """Tensor descriptor of [s, H, D] viewed as [s, H * D], blocks of [block_rows, D] (one head)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    s, h, d = t.shape
    if t.stride(2) != 1 or t.stride(1) != d:
        t = t.contiguous()
    return TensorDescriptor(t, [s, h * d], [t.stride(0), 1], [block_rows, d])


@functools.lru_cache(maxsize=None)
def _sm_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _use_tma(c: KernelConfig, q: torch.Tensor) -> bool:
    """Tensor descriptors: wanted by the config and usable (Hopper or newer GPU, or the CPU interpreter)."""
    if not c.tma:
        return False
    if not q.is_cuda:
        return True
    return _sm_major(q.device.index if q.device.index is not None else torch.cuda.current_device()) >= 9


def _cuda_present() -> bool:
    # the dense split only pays where cuDNN runs (a function so CPU tests can stand in a fake cuDNN)
    return torch.cuda.is_available()


def _rows(t: torch.Tensor) -> torch.Tensor:
    # kernels need unit stride along head_dim only
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonBackend:
    """Fused Triton attention over tile lists. Deterministic backward (no atomics) unless bwd_mode="atomic".

    timer: with TritonConfig.autotune, ``timer(fn) -> ms`` measures one candidate's launches; None:
        CUDA events on CUDA tensors, no tuning on CPU (triton_autotune.select).
    tuned: the autotune cache (TuneKey -> TuneResult: the chosen KernelConfig and the measured times);
        None: the process-wide ``triton_autotune.TUNED``. Exposed as ``self.tuned``.
    last_configs: phase -> KernelConfig the Triton kernels of the latest calls ran with.
    """

    name = "triton"

    def __init__(self, config: TritonConfig | None = None, *, timer=None, tuned: dict | None = None):
        self.config = config or TritonConfig()
        self.timer = timer
        if tuned is None:
            from .triton_autotune import TUNED as tuned
        self.tuned = tuned
        self.last_configs = {}

    def _kernel_config(self, phase: str, q, k, prepared, make_run) -> KernelConfig:
        """KernelConfig of ``phase`` ("fwd", "dkdv", "dq", "bwd_atomic": the dK/dV config) for this call;
        with autotune the tuned one (make_run: see triton_autotune.select)."""
        st = self.config.for_head_dim(q.shape[2], prepared.row_class, q.dtype)
        c = st.dkdv if phase == "bwd_atomic" else getattr(st, phase)
        if self.config.autotune:
            from .triton_autotune import select

            c = select(self, phase, c, q, k, prepared, make_run)
        self.last_configs[phase] = c
        return c

    _fast_failed = False

    def _fast_off(self, e: Exception) -> None:
        """A cuDNN path failed: off for this backend from now on, the reason kept."""
        self._fast_failed, self.fast_path_error = True, f"{type(e).__name__}: {e}"[:300]
    fast_path_error = None  # why the dense fast path was switched off, if it was
    last_path = None  # "cudnn" or "triton": what the last forward/backward call ran

    def _fast_ok(self, q) -> bool:
        return (self.config.dense_fast_path and not self.config.deterministic and q.is_cuda
                and q.dtype in (torch.float16, torch.bfloat16) and not self._fast_failed)

    def _fast(self, q, prepared) -> bool:
        return prepared.dense is not None and self._fast_ok(q)

    def _general(self, q, prepared, forward: bool = False) -> bool:
        """Dense pieces on cuDNN, the rest on Triton: a list that is one dense tile (dense_fast_path) or
        has dense pieces (TritonConfig.dense_tiles; ``forward``: the forward's pieces). Also serves the
        calls the single-call fast path cannot: accumulating forwards and backwards given a delta."""
        plan = prepared.forward_parts()[0] if forward else prepared.dense_plan
        return bool(plan) and (prepared.dense is not None or self.config.dense_tiles) and self._fast_ok(q)

    @staticmethod
    def _scale(softmax_scale, q):
        return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])

    # -- per plan ---------------------------------------------------------------------------------
    def prepare(self, tiles: torch.Tensor, seqlen_q: int, seqlen_k: int, head_dims=(64, 128)) -> TritonPrepared:
        """tiles int [n, 5] (cpu) -> TritonPrepared; builds the schedules of ``head_dims``' configs now.

        With TritonConfig.dense_tiles (and CUDA present, not deterministic) also splits the list into
        dense pieces for cuDNN and a rest list for Triton (prepared too); the whole list stays prepared for
        the Triton fallback."""
        prep = self._prepare(tiles, seqlen_q, seqlen_k, head_dims)
        c = self.config
        if prep.dense is not None:  # one dense tile covering everything: one cuDNN piece, nothing else
            prep.dense_plan = [(0, prep.seqlen_q, 0, prep.seqlen_k, prep.dense, 1)]
        elif (c.dense_tiles and c.dense_fast_path and not c.deterministic
                and prep.tiles.shape[0] and _cuda_present()):
            dense, rest = split_dense(prep.tiles, c.dense_min_rows, c.dense_min_keys, c.band_chunk,
                                      c.band_min_keys)
            if dense:
                prep.dense_plan = dense
                prep.rest = self._prepare(rest, seqlen_q, seqlen_k, head_dims) if rest.shape[0] else None
            bands, rest_f = split_band_squares(rest, c.band_squares)
            if bands:
                prep.fwd_plan = dense + bands
                prep.fwd_rest = self._prepare(rest_f, seqlen_q, seqlen_k, head_dims) if rest_f.shape[0] else None
                prep.fwd_direct, prep.fwd_gaps = _direct_pairs(dense, bands, rest_f, seqlen_q)
        return prep

    def _prepare(self, tiles, seqlen_q, seqlen_k, head_dims) -> TritonPrepared:
        check_tiles(tiles, seqlen_q, seqlen_k)
        tiles = tiles.to("cpu", torch.int32).contiguous()
        area = kept_area(tiles)
        # mean kept keys per row over the rows the list covers (a list may cover a few rows of many)
        row_class = "long" if area >= LONG_ROW_KEYS * max(covered_rows(tiles), 1) else "short"
        prep = TritonPrepared(tiles, int(seqlen_q), int(seqlen_k),
                              tile_descriptors(tiles).to(torch.int32).contiguous(), row_class,
                              dense_kind(tiles, seqlen_q, seqlen_k), self.config.dkdv_split_min)
        if row_class == "short" and tiles.shape[0]:
            sched = build_schedules(tiles, prep.seqlen_q, prep.seqlen_k, 128, 64, prep.split_min)
            prep._host[(128, 64)] = sched
            rows = sched[0]
            visited = int(rows.ptr[..., -1].sum())
            full = int((rows.mid - rows.ptr[..., :-1]).sum())
            if visited and full >= BLOCKY_FULL_FRACTION * visited:
                prep.row_class = row_class = "blocky"
        for d in head_dims:
            c = self.config.for_head_dim(d, row_class)
            for kc in (c.fwd, c.dq, c.dkdv):
                if (kc.block_m, kc.block_n) not in prep._host:
                    prep._host[(kc.block_m, kc.block_n)] = build_schedules(
                        tiles, prep.seqlen_q, prep.seqlen_k, kc.block_m, kc.block_n, prep.split_min)
        return prep

    # -- forward ----------------------------------------------------------------------------------
    def running_dtype(self, q, *prepared) -> torch.dtype:
        """dtype for a running output that ``forward_accumulate`` calls on these lists (None entries
        skipped) will add into: float32 when one of them runs dense pieces on cuDNN (their merges then
        keep full precision and run in place), else q's (the Triton kernels merge in registers and round
        once; rows a call does not cover are left as they are)."""
        return torch.float32 if any(p is not None and self._general(q, p, True) for p in prepared) else q.dtype

    def forward(self, q, k, v, prepared: TritonPrepared, softmax_scale=None, out_dtype=None):
        """q [sq, Hq, D], k/v [sk, Hkv, D] -> out [sq, Hq, D] (``out_dtype``, q's when None: float32
        starts a full-precision running output), lse [sq, Hq] float32."""
        odt = out_dtype or q.dtype
        if self._fast(q, prepared):
            try:
                o, lse = cudnn_forward(q, k, v, self._scale(softmax_scale, q), prepared.dense)
                self.last_path = "cudnn"
                return o.to(odt), lse
            except Exception as e:  # noqa: BLE001  e.g. no cuDNN for this shape/version: Triton from now on
                self._fast_off(e)
        if self._general(q, prepared, True) and prepared.fwd_direct:
            try:
                out, lse = self._direct_forward(q, k, v, prepared, self._scale(softmax_scale, q), odt)
                self.last_path = "cudnn+triton" if prepared.fwd_rest is not None else "cudnn"
                return out, lse
            except Exception as e:  # noqa: BLE001
                self._fast_off(e)
        if self._general(q, prepared, True):
            try:
                acc, lse = self._dense_forward(q, k, v, prepared, self._scale(softmax_scale, q))
                self.last_path = "cudnn+triton" if prepared.forward_parts()[1] is not None else "cudnn"
                return acc.to(odt), lse
            except Exception as e:  # noqa: BLE001
                self._fast_off(e)
        self.last_path = "triton"
        out = torch.empty(q.shape, device=q.device, dtype=odt)
        lse = torch.empty(q.shape[0], q.shape[1], device=q.device, dtype=torch.float32)
        self._forward(q, k, v, prepared, softmax_scale, out, lse, accumulate=False)
        return out, lse

    def forward_accumulate(self, q, k, v, prepared: TritonPrepared, softmax_scale, out, lse):
        """Add this stage into a running (out [sq, Hq, D] in q's dtype or float32, lse [sq, Hq] float32)
        in place; returns them. A float32 ``out`` keeps the running sum in full precision across stages.

        Rows with lse = -inf hold nothing yet (their out is ignored); the merge is LSE-weighted.
        """
        if (out.shape != q.shape or out.dtype not in (q.dtype, torch.float32) or lse.shape != q.shape[:2]
                or lse.dtype != torch.float32):
            raise ValueError(f"running out/lse must be {tuple(q.shape)} {q.dtype} or float32 / "
                             f"{tuple(q.shape[:2])} float32; got {tuple(out.shape)} {out.dtype} / "
                             f"{tuple(lse.shape)} {lse.dtype}")
        if self._general(q, prepared, True):
            scale = self._scale(softmax_scale, q)
            in_place = out.dtype == torch.float32 and out.is_contiguous() and lse.is_contiguous()
            done = []  # merges already made into (out, lse) when in place
            try:
                if in_place:
                    self._dense_forward(q, k, v, prepared, scale, out, lse, progress=done)
                else:
                    acc, lse_new = self._dense_forward(q, k, v, prepared, scale, out.float(), lse.clone())
                    out.copy_(acc)
                    lse.copy_(lse_new)
                self.last_path = "cudnn+triton" if prepared.forward_parts()[1] is not None else "cudnn"
                return out, lse
            except Exception as e:  # noqa: BLE001
                if done:  # falling back now would count the merged pieces twice
                    raise RuntimeError("dense-tile forward failed after a partial in-place merge") from e
                self._fast_off(e)
        self.last_path = "triton"
        self._forward(q, k, v, prepared, softmax_scale, out, lse, accumulate=True)
        return out, lse

    def _dense_forward(self, q, k, v, prepared, scale, acc=None, lse=None, progress=None):
        """Dense pieces through cuDNN, the rest through Triton, merged by LSE in fp32 into the running
        (acc fp32 [sq, Hq, D], lse [sq, Hq]) when given (rows with lse -inf hold nothing), else into a new
        one. With a running pair the cuDNN pieces go first and the Triton rest merges inside its kernel
        (accumulating launch, no extra pass); ``progress`` (a list) gets one entry per merge done, so a
        caller can tell whether a failure left the running pair partly merged."""
        _check_call(q, k, v, prepared)
        sq, hq, d = q.shape
        plan, rest = prepared.forward_parts()
        rest_left = rest is not None
        if acc is None:
            if rest_left:  # the Triton rest writes the fp32 running output itself (no conversion pass)
                acc = torch.empty(q.shape, device=q.device, dtype=torch.float32)
                lse = torch.empty(sq, hq, device=q.device, dtype=torch.float32)
                self._forward(q, k, v, rest, scale, acc, lse, accumulate=False)
                rest_left = False
            else:
                acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
                lse = torch.full((sq, hq), float("-inf"), device=q.device, dtype=torch.float32)
        pending = None  # a reversed piece's (rows, out, lse), merged together with the next piece on its rows
        for piece in plan:
            qs, qe = piece[:2]
            o_t, l_t = _piece_forward(q, k, v, piece, scale)
            if piece[4] == INV_CAUSAL:
                pending = (qs, qe, o_t, l_t)
                continue
            if pending is not None and pending[:2] == (qs, qe):
                merge_into(acc[qs:qe], lse[qs:qe], o_t, l_t, o2=pending[2], l2=pending[3], reverse2=True)
                pending = None
            else:
                merge_into(acc[qs:qe], lse[qs:qe], o_t, l_t)
            if progress is not None:
                progress.append(1)
        if pending is not None:
            qs, qe, o_t, l_t = pending
            merge_into(acc[qs:qe], lse[qs:qe], o_t, l_t, reverse=True)
            if progress is not None:
                progress.append(1)
        if rest_left:
            self._forward(q, k, v, rest, scale, acc, lse, accumulate=True)
        return acc, lse

    def _direct_forward(self, q, k, v, prepared, scale, odt):
        """Band-square pairs written straight into out (``odt``) by one fresh merge each; the Triton rest,
        row-disjoint from them, writes its rows first (every row: its launch visits every block)."""
        _check_call(q, k, v, prepared)
        sq, hq, d = q.shape
        out = torch.empty(q.shape, device=q.device, dtype=odt)
        lse = torch.empty(sq, hq, device=q.device, dtype=torch.float32)
        plan, rest = prepared.forward_parts()
        if rest is not None:
            self._forward(q, k, v, rest, scale, out, lse, accumulate=False)
        for a, b in prepared.fwd_gaps:
            out[a:b] = 0
            lse[a:b] = float("-inf")
        for inv, causal in zip(plan[0::2], plan[1::2]):
            qs, qe = inv[:2]
            o_r, l_r = _piece_forward(q, k, v, inv, scale)
            o_c, l_c = _piece_forward(q, k, v, causal, scale)
            merge_into(out[qs:qe], lse[qs:qe], o_c, l_c, o2=o_r, l2=l_r, reverse2=True, fresh=True)
        return out, lse

    def _forward(self, q, k, v, prepared, softmax_scale, out, lse, accumulate):
        _check_call(q, k, v, prepared)
        sq, hq, d = q.shape
        if sq == 0:
            return
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        q, k, v = _rows(q), _rows(k), _rows(v)

        def make_run():  # autotune: candidates write into copies (an accumulating launch reads them too)
            o, l = (out.clone(), lse.clone()) if accumulate else (torch.empty_like(out), torch.empty_like(lse))
            return lambda c: _launch_fwd(c, q, k, v, o, l, prepared, scale, accumulate)

        c = self._kernel_config("fwd", q, k, prepared, make_run)
        _launch_fwd(c, q, k, v, out, lse, prepared, scale, accumulate)

    # -- backward ---------------------------------------------------------------------------------
    def backward(self, q, k, v, out, lse, dout, prepared: TritonPrepared, softmax_scale=None, delta=None,
                 grad_dtype=None):
        """Gradients (dq like q, dk/dv like k) from the merged lse [sq, Hq] and
        delta [sq, Hq] fp32 = rowsum(dout * out) - dlse (computed from out, dout when None).
        ``grad_dtype``: the Triton kernels' gradient dtype when not q's (float32 for callers that add
        further partial gradients; the cuDNN paths return q's dtype)."""
        _check_call(q, k, v, prepared)
        sq, hq, d = q.shape
        sk, hkv = k.shape[0], k.shape[1]
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        if delta is None and self._fast(q, prepared):
            try:
                res = cudnn_backward(q, k, v, out, lse, dout, scale, prepared.dense)
                self.last_path = "cudnn"
                return res
            except Exception as e:  # noqa: BLE001
                self._fast_off(e)
        if self._general(q, prepared):
            # cuDNN computes delta = rowsum(dout * out) itself: usable only when the given delta is that
            # (no LSE gradient); checked bitwise against the same fp32 computation, else Triton for all
            if delta is None:
                delta = row_delta(out, dout)
                dense_ok = True
            else:
                dense_ok = torch.equal(delta.float(), (dout.float() * out.float()).sum(-1))
            if dense_ok:
                try:
                    res = self._dense_backward(q, k, v, out, lse, dout, prepared, scale, delta)
                    self.last_path = "cudnn+triton" if prepared.rest is not None else "cudnn"
                    return res
                except Exception as e:  # noqa: BLE001
                    self._fast_off(e)
        self.last_path = "triton"
        # head-major lse / delta: the kernels' per-block row reads are then contiguous
        delta = row_delta(out, dout) if delta is None else head_major(delta)
        lse = head_major(lse)
        q, k, v, dout = _rows(q), _rows(k), _rows(v), _rows(dout)
        gdt = grad_dtype or q.dtype
        dk = torch.empty(k.shape, device=k.device, dtype=gdt)
        dv = torch.empty(v.shape, device=v.device, dtype=gdt)
        group = hq // hkv
        if self.config.bwd_mode == "atomic":
            from .triton_bwd_atomic import launch_bwd_atomic

            def run_atomic(c, dk, dv):
                desc, _, cols = prepared.schedules(c.block_m, c.block_n, q.device)
                return launch_bwd_atomic(q, k, v, dout, lse, delta, dk, dv, desc, cols, c, scale, group)

            def make_run():  # autotune: scratch dk/dv (launch_bwd_atomic allocates its own dq)
                dk_s, dv_s = torch.empty_like(k), torch.empty_like(v)
                return lambda c: run_atomic(c, dk_s, dv_s)

            c = self._kernel_config("bwd_atomic", q, k, prepared, make_run)
            return run_atomic(c, dk, dv).to(gdt), dk, dv
        dq = torch.empty(q.shape, device=q.device, dtype=gdt)
        if sk > 0 and hkv > 0:
            def make_run():  # autotune: scratch dk/dv
                dk_s, dv_s = torch.empty_like(k), torch.empty_like(v)
                return lambda c: _launch_dkdv(c, q, k, v, dout, lse, delta, dk_s, dv_s, prepared, scale)

            c = self._kernel_config("dkdv", q, k, prepared, make_run)
            _launch_dkdv(c, q, k, v, dout, lse, delta, dk, dv, prepared, scale)
        if sq > 0:
            def make_run():  # autotune: scratch dq
                dq_s = torch.empty_like(q)
                return lambda c: _launch_dq(c, q, k, v, dout, lse, delta, dq_s, prepared, scale)

            c = self._kernel_config("dq", q, k, prepared, make_run)
            _launch_dq(c, q, k, v, dout, lse, delta, dq, prepared, scale)
        return dq, dk, dv

    def backward_into(self, q, k, v, out, lse, dout, prepared: TritonPrepared, softmax_scale, delta, dq, dk, dv):
        """``backward``'s gradients added into ``dq``/``dk``/``dv`` (float32 or float64 running sums shaped
        like q/k/v, any strides: e.g. the K and V halves of a [rows, 2*Hkv, D] buffer) instead of returned:
        what the staged runtime sums its stages' gradients in. The cuDNN pieces' gradients add straight
        into them (no conversion to q's dtype and back, no rounding of a stage's partial sums); Triton's go
        through a float32 result. Returns (dq, dk, dv)."""
        _check_call(q, k, v, prepared)
        for name, acc, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
            if acc.shape != like.shape or not acc.is_floating_point() or acc.element_size() < 4:
                raise ValueError(f"{name} must be a float32/float64 tensor of shape {tuple(like.shape)}, "
                                 f"got {acc.dtype} {tuple(acc.shape)}")
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
        if delta is None and (self._fast(q, prepared) or self._general(q, prepared)):
            try:  # a cuDNN failure raises before anything is added (_dense_backward)
                self._dense_backward(q, k, v, out, lse, dout, prepared, scale, row_delta(out, dout)
                                     if prepared.rest is not None else None, acc=(dq, dk, dv))
                self.last_path = "cudnn+triton" if prepared.dense is None and prepared.rest is not None else "cudnn"
                return dq, dk, dv
            except Exception as e:  # noqa: BLE001
                self._fast_off(e)
        for acc, g in zip((dq, dk, dv), self.backward(q, k, v, out, lse, dout, prepared, scale, delta,
                                                        grad_dtype=torch.float32)):
            acc += g
        return dq, dk, dv

    def _dense_backward(self, q, k, v, out, lse, dout, prepared, scale, delta, acc=None):
        """Partial gradients of the dense pieces (cuDNN, global out/lse) and the rest (Triton, global lse
        and delta), summed in fp32; with ``acc`` (dq, dk, dv running sums) added into those instead. Every
        cuDNN call runs before anything is summed, so a cuDNN failure leaves ``acc`` untouched."""
        lse = lse.float().contiguous()
        if prepared.dense is not None:  # one piece covering everything: cuDNN's gradients as they are
            grads = cudnn_backward(q, k, v, out, lse, dout, scale, prepared.dense)
            if acc is None:
                return grads
            for a, g in zip(acc, grads):
                a += g
            return acc
        parts = []
        for qs, qe, ks, ke, kind, n in prepared.dense_plan:
            causal = kind == CAUSAL  # split_dense's pieces are FULL or CAUSAL
            if n == 1:
                parts.append(cudnn_backward(q[qs:qe], k[ks:ke], v[ks:ke], out[qs:qe], lse[qs:qe], dout[qs:qe],
                                            scale, causal))
                continue
            r, kw = (qe - qs) // n, ke - ks
            parts.append(cudnn_backward_batched(
                band_view(q, qs, n, r, r), band_view(k, ks, n, r, kw), band_view(v, ks, n, r, kw),
                band_view(out, qs, n, r, r), lse[qs:qe].view(n, r, -1), band_view(dout, qs, n, r, r), scale, causal))
        if prepared.rest is not None:  # fp32 straight from the kernels: the pieces add into them
            rest = self.backward(q, k, v, out, lse, dout, prepared.rest, scale, delta, torch.float32)
            if acc is None:
                dq, dk, dv = rest
            else:
                dq, dk, dv = acc
                for a, g in zip(acc, rest):
                    a += g
        elif acc is None:
            dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
            dk = torch.zeros(k.shape, device=q.device, dtype=torch.float32)
            dv = torch.zeros(v.shape, device=q.device, dtype=torch.float32)
        else:
            dq, dk, dv = acc
        for (qs, qe, ks, ke, kind, n), (gq, gk, gv) in zip(prepared.dense_plan, parts):
            if n == 1:
                dq[qs:qe] += gq
                dk[ks:ke] += gk
                dv[ks:ke] += gv
                continue
            r = (qe - qs) // n
            dq[qs:qe].view(n, r, *dq.shape[1:]).add_(gq)
            _fold_add(dk, gk, ks, r)
            _fold_add(dv, gv, ks, r)
        if acc is not None:
            return acc
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _piece_forward(q, k, v, piece, scale):
    """(out [rows, Hq, D], lse [rows, Hq]) of one dense piece on cuDNN; an INV_CAUSAL (band-square) piece's
    rows come back reversed (row p is the piece's row rows - 1 - p): top-left causal squares of the problem
    with its rows and keys flipped."""
    qs, qe, ks, ke, kind, n = piece
    hq, d = q.shape[1:]
    r = (qe - qs) // n
    if kind == INV_CAUSAL:
        span = (n - 1) * r + (ke - ks)
        qr, kr, vr = q[qs:qe].flip(0), k[ks:ks + span].flip(0), v[ks:ks + span].flip(0)
        o_t, l_t = cudnn_forward_batched(band_view(qr, 0, n, r, r), band_view(kr, 0, n, r, ke - ks),
                                         band_view(vr, 0, n, r, ke - ks), scale, True)
    elif n == 1:
        return cudnn_forward(q[qs:qe], k[ks:ke], v[ks:ke], scale, kind == CAUSAL)
    else:  # a band piece: n chunks of r rows, keys sliding by r (one batched call)
        o_t, l_t = cudnn_forward_batched(band_view(q, qs, n, r, r), band_view(k, ks, n, r, ke - ks),
                                         band_view(v, ks, n, r, ke - ks), scale, kind == CAUSAL)
    return o_t.reshape(qe - qs, hq, d), l_t.reshape(qe - qs, hq).contiguous()


def _direct_pairs(dense, bands, rest, seqlen_q: int):
    """(direct, gaps): whether the forward's pieces are only band-square pairs (reversed + causal square, no
    rectangle) on rows no other piece nor ``rest`` tile touches, and the rows nothing covers (when there is no
    rest, whose writing launch fills every row)."""
    if dense or len(bands) % 2 or any(p[4] != INV_CAUSAL for p in bands[0::2]) \
            or any(p[4] != CAUSAL or p[:2] != i[:2] for i, p in zip(bands[0::2], bands[1::2])):
        return False, []
    rows = sorted(p[:2] for p in bands[0::2])
    if any(b[0] < a[1] for a, b in zip(rows, rows[1:])):
        return False, []
    if rest.shape[0]:
        for qs, qe, *_ in rest.tolist():
            if any(qs < b and a < qe for a, b in rows):
                return False, []
        return True, []
    gaps, at = [], 0
    for a, b in rows:
        if a > at:
            gaps.append((at, a))
        at = b
    if at < seqlen_q:
        gaps.append((at, seqlen_q))
    return True, gaps


def _fold_add(dst, g, start: int, step: int):
    """dst[start + b*step + j] += g[b, j] for g [n, kw, H, D] (overlapping windows of a band piece)."""
    n, kw = g.shape[:2]
    if kw % step == 0:  # kw / step shifted, non-overlapping adds
        for t in range(kw // step):
            a = start + t * step
            dst[a:a + n * step].view(n, step, *dst.shape[1:]).add_(g[:, t * step:(t + 1) * step])
        return
    idx = (start + torch.arange(n, device=dst.device)[:, None] * step
           + torch.arange(kw, device=dst.device)[None, :]).reshape(-1)
    dst.index_add_(0, idx, g.reshape(n * kw, *g.shape[2:]).to(dst.dtype))


# -- launches (one config each; also what triton_autotune times on scratch outputs) ------------------------
def _launch_fwd(c: KernelConfig, q, k, v, out, lse, prepared: TritonPrepared, scale: float, accumulate: bool):
    """Forward kernel with config c: q [sq, Hq, D], k/v [sk, Hkv, D] (unit stride along D), out [sq, Hq, D]
    (q's dtype or float32) and lse [sq, Hq] float32 written, or merged into when ``accumulate``."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    desc, rows, _ = prepared.schedules(c.block_m, c.block_n, q.device)
    # an accumulating launch leaves rows without tiles as they are: it skips their (empty) blocks;
    # a writing launch visits every block (rows without tiles get out 0, lse -inf)
    nm = rows.n_busy if accumulate else rows.order.shape[1]
    if nm == 0:
        return
    tma = _use_tma(c, q)
    kd, vd = (_descriptor(x, c.block_n) for x in (k, v)) if tma else (k, v)
    attn_fwd_kernel[(nm * hq,)](
        q, k, v, out, lse, kd, vd, desc, rows.ptr, rows.mid, rows.order, rows.off, rows.tile,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), 0, 0,
        sq, sk, hq, scale * LOG2E,
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
        ACCUM=accumulate, IEEE=q.dtype == torch.float32, TMA=tma,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )


def _launch_dkdv(c: KernelConfig, q, k, v, dout, lse, delta, dk, dv, prepared: TritonPrepared, scale: float):
    """dK/dV kernels (and the fixed-order reduce of split key columns) with config c: q/dout [sq, Hq, D],
    k/v [sk, Hkv, D] (sk, Hkv > 0), lse/delta [sq, Hq] float32 of one layout (head-major views in
    backward(), contiguous rows also work); dk/dv like k, written."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    desc, _, cols = prepared.schedules(c.block_m, c.block_n, q.device)
    w = cols.work
    tma = _use_tma(c, q)
    qd, dod = (_descriptor(x, c.block_m) for x in (q, dout)) if tma else (q, dout)
    if w.n_slots:
        wk = torch.empty(w.n_slots, hkv, c.block_n, d, device=q.device, dtype=torch.float32)
        wv = torch.empty_like(wk)
    else:
        wk = wv = dk  # unused
    attn_bwd_dkdv_kernel[(w.n.shape[0] * hkv,)](
        q, k, v, dout, lse, delta, dk, dv, qd, dod, desc, cols.ptr, cols.mid, cols.off, cols.tile,
        w.n, w.seg, w.nseg, w.slot, wk, wv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        lse.stride(0), lse.stride(1), 0, 0,
        sq, sk, hkv, scale * LOG2E, scale,
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
        IEEE=q.dtype == torch.float32, TMA=tma,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    if w.n_slots:
        attn_bwd_dkdv_reduce_kernel[(w.red_n.shape[0] * hkv,)](
            wk, wv, dk, dv, w.red_n, w.red_slot0, w.red_nseg,
            dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), sk, hkv,
            HEAD_DIM=d, BLOCK_N=c.block_n, num_warps=4,
        )


def _launch_dq(c: KernelConfig, q, k, v, dout, lse, delta, dq, prepared: TritonPrepared, scale: float):
    """dQ kernel with config c: shapes as _launch_dkdv (sq > 0); dq like q, written."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    desc, rows, _ = prepared.schedules(c.block_m, c.block_n, q.device)
    nm = rows.order.shape[1]
    tma = _use_tma(c, q)
    kd, vd = (_descriptor(x, c.block_n) for x in (k, v)) if tma else (k, v)
    attn_bwd_dq_kernel[(nm * hq,)](
        q, k, v, dout, lse, delta, dq, kd, vd, desc, rows.ptr, rows.mid, rows.order, rows.off, rows.tile,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), lse.stride(0), lse.stride(1),
        0, 0, sq, sk, hq, scale * LOG2E, scale,
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
        IEEE=q.dtype == torch.float32, TMA=tma,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
