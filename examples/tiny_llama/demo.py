"""The tiny Llama demo: CP=N vs CP=1 on packed documents of Python standard-library source text.

    ./dev demo --cp 4 --steps 30                                     (gloo on CPU; NCCL with --backend nccl)
    ./dev demo --cp 4 --backend gloo_shared_gpu                      (the 4 ranks sharing the one GPU: a check
                                                                      of the GPU path, not a timing)
    PYTHONPATH=examples python -m tiny_llama.demo --cp 4 --steps 30  (the same, from the repository root)

Bytes are tokens (vocab 320: 256 bytes, EOD = 256, the rest unused padding for TP divisibility).
Documents are pieces of the stdlib's ``.py`` files (deterministic lengths 32..480 bytes), each ended
by EOD and packed into samples of ``seq_length + 1`` tokens; the mask is ``packed`` (causal inside
each document) and positions restart at every document. Both runs start from the same weights and
see the same batches, so their losses agree up to floating-point summation order.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from megatron_cp.comm import shared_gpu
from megatron_cp.kernels import BACKEND_CHOICES
from megatron_cp.megatron import MaskSpec, PlanOptions

from .model import TINY, LlamaShape
from .quiet import note

EOD = 256


def stdlib_files(recursive: bool = False) -> list[Path]:
    """The standard library's ``.py`` files in a fixed order: the top folder (4.6 MB on CPython 3.12), or with
    ``recursive`` every package below it too (32 MB), never third-party ``site-packages``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = root.rglob("*.py") if recursive else root.glob("*.py")
    files = sorted(p for p in found if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library at {root}")
    return files


def stdlib_stream(n_tokens: int, seed: int = 0, doc_lengths: tuple[int, int] = (32, 480),
                  recursive: bool = False, median: int | None = None, sigma: float = 1.0,
                  files: list[Path] | None = None, repeat: bool = True) -> np.ndarray:
    """int64 ``[n_tokens]``: documents cut from the stdlib's sources (or ``files``, in their order), each followed
    by EOD; the files repeat in order when the stream needs more, or with ``repeat=False`` a ValueError says the
    stream would repeat. Lengths uniform in ``doc_lengths`` (shorter where a file ends), or with ``median``
    log-normal around it (``sigma``) clipped to ``doc_lengths``, cut from the files' concatenation (a long document
    runs on into the next file: heavy-tailed lengths up to the largest asked for)."""
    lo, hi = doc_lengths
    if not 1 <= lo < hi:
        raise ValueError(f"doc_lengths must be (lo, hi) with 1 <= lo < hi, got {doc_lengths}")
    if median is not None and not (lo <= median <= hi and sigma > 0):
        raise ValueError(f"median {median} must lie within doc_lengths {doc_lengths} and sigma {sigma} be > 0")
    files = stdlib_files(recursive) if files is None else list(files)
    rng = np.random.default_rng(seed)
    out, total, fi = [], 0, 0

    def next_file():
        if not repeat and fi >= len(files):
            raise ValueError(f"{n_tokens} tokens asked of {len(files)} files that hold {total} (repeat=False: no "
                             "document may come twice)")
        return np.frombuffer(files[fi % len(files)].read_bytes(), dtype=np.uint8)

    if median is not None:
        text, pos = np.zeros(0, dtype=np.uint8), 0
        while total < n_tokens:
            n = int(np.clip(rng.lognormal(np.log(median), sigma), lo, hi))
            while len(text) - pos < n:  # more of the files' concatenation
                text = np.concatenate([text[pos:], next_file()])
                pos, fi = 0, fi + 1
            out += [text[pos:pos + n].astype(np.int64), np.array([EOD], dtype=np.int64)]
            pos += n
            total += n + 1
        return np.concatenate(out)[:n_tokens]
    while total < n_tokens:
        data = next_file()
        fi += 1
        pos = 0
        while pos < len(data) and total < n_tokens:
            n = int(rng.integers(lo, hi))
            doc = data[pos:pos + n].astype(np.int64)
            pos += n
            out.append(doc)
            out.append(np.array([EOD], dtype=np.int64))
            total += len(doc) + 1
    return np.concatenate(out)[:n_tokens]


def stdlib_batches(steps: int, global_batch: int, seq_length: int, seed: int = 0):
    """A function step -> (tokens, labels, loss_mask) each ``[global_batch, seq_length]``."""
    n = steps * global_batch
    stream = torch.from_numpy(stdlib_stream(n * seq_length + 1, seed))
    samples = torch.stack([stream[i * seq_length: i * seq_length + seq_length + 1] for i in range(n)])

    def get(step):
        s = samples[step * global_batch:(step + 1) * global_batch]
        return s[:, :-1].contiguous(), s[:, 1:].contiguous(), torch.ones(global_batch, seq_length)

    return get


def _train_worker(rank, world, tp, cp, steps, shape, global_batch, micro_batch, lr, backend, seed,
                  kernel_backend="auto"):
    from . import trainer
    from .model import build_llama, transformer_config

    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    trainer.init_parallel(tp, cp)
    device = torch.device("cuda", torch.cuda.current_device()) if backend != "gloo" else None
    torch.manual_seed(seed)
    options = PlanOptions(kernel_backend=kernel_backend)
    model = build_llama(shape, transformer_config(shape), options=options)
    if device is not None:
        model = model.to(device)
    cfg = trainer.TrainConfig(steps=steps, global_batch=global_batch, micro_batch=micro_batch, lr=lr, seed=seed,
                              spec=MaskSpec("packed", eod=EOD), options=options)
    batches = stdlib_batches(steps, global_batch, shape.seq_length, seed)
    t0 = time.time()
    log = (lambda s, r: print(f"  [cp={cp}] step {s:3d} loss {r.loss:.6f} tokens {r.tokens}", flush=True)) \
        if rank == 0 else None
    losses = trainer.train(model, batches, cfg, device=device, log=log)
    # ranks sharing a GPU: their time means nothing, so none is reported
    return {"losses": losses, "seconds": None if shared_gpu.ranks_share_gpu() else time.time() - t0}


MAX_CPU_RANKS = 64


def run(cp: int = 4, steps: int = 30, tp: int = 1, shape: LlamaShape = TINY, global_batch: int = 2,
        micro_batch: int = 1, lr: float = 3e-3, backend: str = "gloo", seed: int = 1234,
        kernel_backend: str = "auto") -> dict:
    """Train CP=1 and CP=``cp`` (world = tp*cp each) and return both loss curves and the difference."""
    from .trainer import spawn

    check_sizes(cp, steps, tp, shape, backend)
    runs = {}
    for c in (1, cp):
        print(f"training tiny Llama with TP={tp} CP={c} ({backend}, {steps} steps) ...", flush=True)
        runs[c] = spawn(_train_worker, tp * c, tp, c, steps, shape, global_batch, micro_batch, lr, backend, seed,
                        kernel_backend, backend=backend)
    a, b = np.array(runs[1]["losses"]), np.array(runs[cp]["losses"])
    rel = np.abs(a - b) / np.abs(a)
    return {"cp": cp, "tp": tp, "steps": steps, "backend": backend, "kernel_backend": kernel_backend, "loss_cp1": a.tolist(), f"loss_cp{cp}": b.tolist(),
            "max_rel_diff": float(rel.max()), "seconds_cp1": runs[1]["seconds"], f"seconds_cp{cp}": runs[cp]["seconds"],
            "shape": shape.__dict__, "global_batch": global_batch, "micro_batch": micro_batch, "lr": lr}


def check_sizes(cp: int, steps: int, tp: int, shape: LlamaShape, backend: str) -> None:
    """ValueError naming the flag unless the demo can run these sizes on this machine (no process started)."""
    if cp < 1 or steps < 1 or tp < 1:
        raise ValueError(f"--cp, --tp and --steps must be >= 1, got --cp {cp} --tp {tp} --steps {steps}")
    # refused before any process starts: every CP rank holds whole tokens, and each rank is a process here
    if cp > shape.seq_length:
        raise ValueError(f"cp={cp} exceeds the sequence length {shape.seq_length} (--seq-length): every CP rank "
                         "needs tokens of its own")
    if backend != "gloo" and not torch.cuda.is_available():
        raise ValueError(f"--backend {backend} runs ranks on GPUs and none is visible here: --backend gloo runs them "
                         "on CPU")
    if backend == "nccl" and tp * cp > torch.cuda.device_count():
        raise ValueError(f"--backend nccl needs a GPU per rank: tp * cp = {tp * cp} ranks, "
                         f"{torch.cuda.device_count()} GPU(s) visible; --backend {shared_gpu.BACKEND} runs them "
                         "sharing the GPUs (a correctness check, times mean nothing)")
    if backend == "gloo" and tp * cp > MAX_CPU_RANKS:
        raise ValueError(f"tp * cp = {tp * cp} processes on CPU (gloo): at most {MAX_CPU_RANKS} here (each rank is a "
                         "process with its own model copy)")


def print_table(res: dict) -> None:
    cp = res["cp"]
    print(f"\n step | loss CP=1   | loss CP={cp}   | rel diff")
    for i, (x, y) in enumerate(zip(res["loss_cp1"], res[f"loss_cp{cp}"])):
        print(f" {i:4d} | {x:.8f} | {y:.8f} | {abs(x - y) / abs(x):.2e}")
    print(f"\nmax relative difference CP={cp} vs CP=1 over {res['steps']} steps: {res['max_rel_diff']:.3e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-length", type=int, default=TINY.seq_length)
    ap.add_argument("--global-batch", type=int, default=2)
    ap.add_argument("--backend", choices=("gloo", "nccl", shared_gpu.BACKEND), default="gloo",
                    help=f"gloo: CPU ranks; nccl: a GPU per rank; {shared_gpu.BACKEND}: ranks sharing the visible "
                         "GPUs through host copies (correctness only)")
    ap.add_argument("--kernel-backend", choices=BACKEND_CHOICES, default="auto")
    ap.add_argument("--json", type=str, default=None, help="also write the result here")
    a = ap.parse_args(argv)
    shape = LlamaShape(**{**TINY.__dict__, "seq_length": a.seq_length})
    try:
        check_sizes(a.cp, a.steps, a.tp, shape, a.backend)
    except ValueError as e:  # bad sizes: one line (no usage, no note), exit 2, before any process starts
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    if note():
        print(note(), flush=True)
    res = run(cp=a.cp, tp=a.tp, steps=a.steps, shape=shape, global_batch=a.global_batch, backend=a.backend,
              kernel_backend=a.kernel_backend)
    print_table(res)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
