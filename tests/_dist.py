"""Run a function on N CPU ranks (gloo) in spawned processes and collect what each returns."""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, queue):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report every failure to the parent, never hang it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 300.0):
    """Call ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the list of results by rank.

    Raises AssertionError carrying the remote traceback if any rank fails.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue() if False else ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.terminate()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]


COLLECTIVES = ("all_to_all_single", "all_gather", "all_reduce", "batch_isend_irecv", "new_group")


def raise_before_collectives(cases: dict) -> dict:
    """Run on a rank: each case ``name: (fn, pattern)`` must raise ValueError whose message matches
    ``pattern`` before any torch.distributed collective (or group creation) ran. Returns {name: "ok" or
    what happened instead}; the collectives are restored afterwards."""
    import re

    real = {n: getattr(dist, n) for n in COLLECTIVES}
    called = []
    for n, f in real.items():
        setattr(dist, n, (lambda f_, n_: (lambda *a, **k: (called.append(n_), f_(*a, **k))[1]))(f, n))
    out = {}
    try:
        for key, (fn, pattern) in cases.items():
            called.clear()
            try:
                fn()
                out[key] = "no error"
            except ValueError as e:
                out[key] = "ok" if re.search(pattern, str(e)) and not called else f"{e!r} collectives={called}"
    finally:
        for n, f in real.items():
            setattr(dist, n, f)
    return out
