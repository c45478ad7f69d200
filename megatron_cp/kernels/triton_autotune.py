"""Runtime autotuning of the Triton kernels' block configs (``TritonConfig(autotune=True)``).

What is tuned
-------------
One ``KernelConfig`` (block_m, block_n, num_warps, num_stages, tma) per ``TuneKey``:

    (device name, head_dim, dtype, group = Hq // Hkv, row class "long"/"short"/"blocky", phase)

with phase "fwd" (``attn_fwd_kernel``), "dkdv" (``attn_bwd_dkdv_kernel`` and its split-column reduce),
"dq" (``attn_bwd_dq_kernel``) for ``bwd_mode="deterministic"``, and "bwd_atomic" (the fused atomic-dQ
backward of ``triton_bwd_atomic.launch_bwd_atomic``, which replaces both dkdv and dq) for
``bwd_mode="atomic"``.

When it happens
---------------
The first time a backend call meets a key on CUDA, ``select`` times every candidate on that call's own
tensors and prepared tile list, each candidate writing into scratch outputs (never into the caller's
tensors), then caches the fastest and returns it; the call itself then runs with the winner, and every
later call with that key takes the cached winner without timing anything. Tuning therefore costs the
first step (JIT compiles of every candidate, host-side block schedules of new block shapes via
``TritonPrepared.schedules``, a few timed launches): run one untimed warmup step before measuring
anything. Nothing is tuned while a CUDA graph is being captured (the configured default runs, uncached).

Candidates: the config the backend would use without tuning (``TritonConfig.for_head_dim``: defaults or
the caller's overrides) first, then ``TritonConfig.autotune_candidates[(head_dim, phase)]`` if given,
else ``CANDIDATES[(head_dim, phase)]`` (16-bit inputs only; float32 inputs get only the explicit list,
since the built-in blocks are sized for 16-bit tiles). Block sizes must be powers of two >= 16 (others are
skipped with a reason); ``tma`` is normalised to what runs (off before Hopper), duplicates dropped. A
candidate that fails to compile or launch (e.g. Triton's ``OutOfResources`` when its shared memory does
not fit) is skipped, its error recorded; if all fail the default is kept (and the call raises as it would
have without tuning). Ties go to the earlier candidate, so the default wins unless something is faster.

Timing: ``TritonBackend.timer``, a callable ``timer(fn) -> milliseconds`` that runs ``fn`` (one
candidate's launches) and measures it; None (default) means ``cuda_event_timer`` (1 warmup launch, then
5 launches timed by CUDA events, median) on CUDA tensors and no tuning at all elsewhere (CPU: the
defaults run). Tests inject a fake timer to run the whole selection path in Triton's interpreter.

Cache: ``TUNED``, process-wide, shared by every ``TritonBackend`` unless one is given its own dict
(``TritonBackend(config, tuned={})``); ``TritonBackend.tuned`` is the dict in use. The device name in
the key keeps results of different GPU models apart; ``save_tuned`` / ``load_tuned`` write and read it
as JSON (format in ``tuned_to_json``); loaded entries are used as if tuned in this process.
"""

from __future__ import annotations

import functools
import json
import statistics
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

import torch

from .triton_backend import KernelConfig, _use_tma

PHASES = ("fwd", "dkdv", "dq", "bwd_atomic")
FORMAT = "megatron-cp-tuned/1"


class TuneKey(NamedTuple):
    device: str  # torch.cuda.get_device_name, or "cpu"
    head_dim: int
    dtype: str  # "bfloat16", "float16", "float32"
    group: int  # Hq // Hkv
    row_class: str  # "long" / "short" / "blocky" (TritonPrepared.row_class)
    phase: str  # one of PHASES


@dataclass
class TuneResult:
    """The winner of one key and what was measured: medians in ms of the candidates that ran, and why
    the others were skipped (empty when only one candidate was left: nothing was timed)."""

    config: KernelConfig
    times_ms: dict = field(default_factory=dict)  # KernelConfig -> float
    errors: dict = field(default_factory=dict)  # KernelConfig -> str


TUNED: dict[TuneKey, TuneResult] = {}


def _k(*cfgs) -> tuple[KernelConfig, ...]:
    return tuple(KernelConfig(*c) for c in cfgs)


# Alternatives to the defaults (triton_backend.DEFAULT_CONFIGS, tried first), per (head_dim, phase), for
# 16-bit inputs. A handful each: tuning compiles and times every one on the first call of each key.
_BWD_128 = _k((64, 64, 4, 3, True), (32, 64, 4, 3, True), (64, 128, 8, 2, True), (128, 64, 8, 2, True))
_BWD_64 = _k((32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3, True), (64, 64, 4, 3, True))
_BWD_256 = _k((32, 64, 4, 2), (32, 32, 4, 2), (64, 32, 4, 2), (64, 64, 8, 1))
CANDIDATES: dict[tuple[int, str], tuple[KernelConfig, ...]] = {
    (64, "fwd"): _k((128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 4, 3, True), (64, 64, 4, 3, True)),
    (64, "dkdv"): _BWD_64,
    (64, "dq"): _k((64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3, True), (128, 64, 8, 3, True)),
    (64, "bwd_atomic"): _BWD_64,
    (128, "fwd"): _k((128, 128, 8, 3, True), (128, 64, 4, 3, True), (64, 64, 4, 3, True), (128, 64, 8, 2, True)),
    (128, "dkdv"): _BWD_128,
    (128, "dq"): _BWD_128,
    (128, "bwd_atomic"): _BWD_128,
    (256, "fwd"): _k((64, 32, 4, 2), (64, 64, 4, 2), (32, 32, 4, 2), (128, 32, 8, 2)),
    (256, "dkdv"): _BWD_256,
    (256, "dq"): _k((64, 32, 4, 2), (32, 32, 4, 2), (64, 64, 8, 1), (128, 32, 8, 2)),
    (256, "bwd_atomic"): _BWD_256,
}


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str:
    """The device part of a TuneKey: the GPU model for CUDA devices, else the device type."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


def tune_key(q: torch.Tensor, k: torch.Tensor, row_class: str, phase: str) -> TuneKey:
    """Key of a call with q [sq, Hq, D], k [sk, Hkv, D] on a prepared list of ``row_class``."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    return TuneKey(device_name(q.device), int(q.shape[2]), str(q.dtype).removeprefix("torch."),
                   int(q.shape[1] // k.shape[1]), row_class, phase)


def _bad_block(c: KernelConfig) -> str | None:
    for name in ("block_m", "block_n"):
        b = getattr(c, name)
        if b < 16 or b & (b - 1):
            return f"skipped: {name}={b} is not a power of two >= 16"
    if c.num_warps < 1 or c.num_stages < 1:
        return f"skipped: num_warps={c.num_warps}, num_stages={c.num_stages} must be >= 1"
    return None


def candidates(default: KernelConfig, key: TuneKey, listed: dict, q: torch.Tensor):
    """(configs to time, default first; {config: why skipped}) for ``key``.

    listed: TritonConfig.autotune_candidates, (head_dim, phase) -> sequence of KernelConfig, replacing
    CANDIDATES for that pair. q: the call's query tensor (decides whether tma can run)."""
    extra = listed.get((key.head_dim, key.phase))
    if extra is None:
        extra = () if key.dtype == "float32" else CANDIDATES.get((key.head_dim, key.phase), ())
    out, skipped = [], {}
    for c in (default, *extra):
        if c.tma and not _use_tma(c, q):  # runs without tensor descriptors: the same as tma=False
            c = replace(c, tma=False)
        why = _bad_block(c)
        if why is not None:
            skipped[c] = why
        elif c not in out:
            out.append(c)
    return out, skipped


def cuda_event_timer(fn: Callable[[], None], warmup: int = 1, reps: int = 5) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` timed by CUDA events on the current stream,
    after ``warmup`` untimed calls (JIT compile, schedule upload). Waits for the last event only, not
    the whole device."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    ends[-1].synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def wall_timer(fn: Callable[[], None], warmup: int = 1, reps: int = 1) -> float:
    """Median wall-clock milliseconds of ``fn`` (synchronising CUDA if present): for CPU dry runs in
    Triton's interpreter, where CUDA events do not exist. Not a measurement of GPU kernels."""
    import time

    def sync():
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def tune(cands, skipped: dict, run: Callable[[KernelConfig], None], prepared, device,
         timer: Callable[[Callable[[], None]], float]) -> TuneResult:
    """Time ``run(c)`` for each candidate c with ``timer``; the fastest wins (first on ties). Block
    schedules of each shape are built (``prepared.schedules``) before its timing. A candidate whose
    schedule, compile, launch or timing raises is skipped and its error recorded. With one candidate
    nothing is timed. All failing: the first (the default) is returned."""
    if not cands:
        raise ValueError("no candidate configs to tune")
    errors = dict(skipped)
    if len(cands) == 1:
        return TuneResult(cands[0], {}, errors)
    times = {}
    for c in cands:
        try:
            prepared.schedules(c.block_m, c.block_n, device)
            times[c] = float(timer(lambda c=c: run(c)))
        except Exception as e:  # noqa: BLE001  (OutOfResources, CompilationError, ...: skip, never fail the step)
            errors[c] = f"{type(e).__name__}: {e}"[:300]
    best = min(times, key=times.get) if times else cands[0]
    return TuneResult(best, times, errors)


def select(backend, phase: str, default: KernelConfig, q, k, prepared, make_run) -> KernelConfig:
    """The KernelConfig ``phase`` runs with for this call of ``backend`` (a TritonBackend with autotune).

    q [sq, Hq, D], k [sk, Hkv, D]: the call's inputs; prepared: its TritonPrepared; default: the config
    without tuning; make_run(): allocates scratch outputs and returns run(config), which launches the
    phase's kernels with that config into the scratch (called only when tuning happens). Cached winner
    when the key is known; else tunes (CUDA, or any device when ``backend.timer`` is set) and caches;
    else (CPU without a timer, CUDA graph capture, an empty tile list or empty q/k) the default, uncached.
    The first call of a key decides for all later ones, whatever their tile lists: the key's row class
    and GQA group are what the kernels' speed depends on most."""
    key = tune_key(q, k, prepared.row_class, phase)
    hit = backend.tuned.get(key)
    if hit is not None:
        return hit.config
    if prepared.tiles.shape[0] == 0 or q.shape[0] == 0 or k.shape[0] == 0 or k.shape[1] == 0:
        return default  # nothing to compute: timings would say nothing about the key
    timer = backend.timer
    if timer is None:
        if not q.is_cuda or torch.cuda.is_current_stream_capturing():
            return default
        timer = cuda_event_timer
    cands, skipped = candidates(default, key, backend.config.autotune_candidates, q)
    if not cands:  # even the default has an impossible block shape: let the call raise as without tuning
        return default
    if q.is_cuda:
        with torch.cuda.device(q.device):
            res = tune(cands, skipped, make_run(), prepared, q.device, timer)
    else:
        res = tune(cands, skipped, make_run(), prepared, q.device, timer)
    backend.tuned[key] = res
    return res.config


# -- JSON -----------------------------------------------------------------------------------------------
def _cfg_list(c: KernelConfig) -> list:
    return [c.block_m, c.block_n, c.num_warps, c.num_stages, int(c.tma)]


def _cfg(x) -> KernelConfig:
    return KernelConfig(*map(int, x[:4]), bool(x[4]))


def tuned_to_json(tuned: dict | None = None) -> dict:
    """The cache as a JSON-able dict::

        {"format": "megatron-cp-tuned/1",
         "entries": [{"device": "NVIDIA H200", "head_dim": 128, "dtype": "bfloat16", "group": 4,
                      "row_class": "long", "phase": "fwd", "config": [128, 128, 8, 3, 1],
                      "times_ms": [[[128, 128, 8, 3, 1], 1.92], ...],
                      "errors": [[[128, 64, 8, 2, 1], "OutOfResources: ..."], ...]}, ...]}

    Configs as in ``configs_from_json``: [block_m, block_n, num_warps, num_stages, tma 0/1]."""
    tuned = TUNED if tuned is None else tuned
    entries = []
    for key, res in tuned.items():
        e = dict(key._asdict())
        e["config"] = _cfg_list(res.config)
        e["times_ms"] = [[_cfg_list(c), t] for c, t in res.times_ms.items()]
        e["errors"] = [[_cfg_list(c), m] for c, m in res.errors.items()]
        entries.append(e)
    return {"format": FORMAT, "entries": entries}


def tuned_from_json(obj: dict) -> dict[TuneKey, TuneResult]:
    """Inverse of ``tuned_to_json``."""
    if obj.get("format") != FORMAT:
        raise ValueError(f"not a tuned-config file: format {obj.get('format')!r}, expected {FORMAT!r}")
    out = {}
    for e in obj["entries"]:
        key = TuneKey(str(e["device"]), int(e["head_dim"]), str(e["dtype"]), int(e["group"]),
                      str(e["row_class"]), str(e["phase"]))
        if key.phase not in PHASES or key.row_class not in ("long", "short", "blocky"):
            raise ValueError(f"bad tuned entry key {tuple(key)}")
        out[key] = TuneResult(_cfg(e["config"]), {_cfg(c): float(t) for c, t in e.get("times_ms", [])},
                              {_cfg(c): str(m) for c, m in e.get("errors", [])})
    return out


def save_tuned(path: str, tuned: dict | None = None) -> None:
    """Write the cache (``TUNED`` by default, or e.g. ``backend.tuned``) to ``path`` as JSON."""
    with open(path, "w") as f:
        json.dump(tuned_to_json(tuned), f, indent=1)


def load_tuned(path: str, tuned: dict | None = None) -> int:
    """Merge the entries of a ``save_tuned`` file into the cache (``TUNED`` by default; file entries
    replace existing ones of the same key). Returns how many were read. Later calls with those keys use
    the loaded winners without timing."""
    with open(path) as f:
        entries = tuned_from_json(json.load(f))
    (TUNED if tuned is None else tuned).update(entries)
    return len(entries)
