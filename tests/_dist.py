"""Distributed-test helpers: ``raise_before_collectives``. Spawning ranks is megatron_cp.testing's
``run_ranks``; ``free_port`` is re-exported from there for the tests that launch torchrun themselves."""

from __future__ import annotations

import torch.distributed as dist

from megatron_cp.testing import free_port  # noqa: F401


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


def assert_errors_within(results: list) -> None:
    """Each rank's ``{case key: {tensor name: error}}`` within 1e-12 for float64 inputs (which stay float64 through
    lse, every merge and the sink's weight) and 1e-4 for cases keyed "triton" (float32 inputs, as the other
    distributed tests)."""
    for rank, r in enumerate(results):
        for key, errs in r.items():
            tol = 1e-4 if "triton" in key else 1e-12
            bad = {n: e for n, e in errs.items() if e > tol}
            assert not bad, (rank, key, bad)
