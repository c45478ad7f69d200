"""The examples' CPU rank processes: megatron_cp.testing's fork server, started with the example model imported."""

from __future__ import annotations

import os
import sys
from multiprocessing import forkserver

from megatron_cp.testing import process_context


def start(preload: tuple[str, ...]):
    """``megatron_cp.testing.process_context(preload)``, its server started now (where this process has none yet)
    on this process's sys.path: Python 3.12's server imports on its own default path, and examples/ (tiny_llama)
    is not installed, so the path goes to the server alone as its PYTHONPATH. A 4-rank world that imported
    Megatron in every rank spent ~5 s of CPU each, per spawn."""
    ctx = process_context(preload)
    saved = os.environ.copy()
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return ctx
