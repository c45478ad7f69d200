"""Test-session set-up. This is the CPU suite: Triton kernels run through Triton's interpreter, which
must be switched on before anything imports triton (a test file cannot do it once another one has)."""

import os
import sys

import pytest

os.environ["TRITON_INTERPRET"] = "1"
if "PYTEST_XDIST_WORKER" in os.environ:
    # ./dev test runs a worker per core: one intra-op thread each (and in every process a worker starts), since
    # OpenMP threads of two workers on the same cores spin waiting for each other (~11% more CPU for the whole suite)
    os.environ["OMP_NUM_THREADS"] = "1"
sys.path.insert(0, os.path.dirname(__file__))  # tests' shared helpers (_dist, reference)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))


def pytest_configure(config):
    """Start the rank processes' fork server now, with Megatron and the example model imported once (the first
    start's list holds for the session): a 4-rank world otherwise imports them four times over, ~8 s of CPU each.
    Without megatron-core installed the server skips what does not import. Not in pytest-xdist's controller,
    which runs no test (its workers each start their own)."""
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return
    from tiny_llama import forkserver

    # the server and every rank it forks write into pytest's capture, as during the conftest's import, not into the
    # terminal (pytest has suspended its global capture by now)
    capture = config.pluginmanager.getplugin("capturemanager")
    capture.resume_global_capture()
    try:
        forkserver.start(("tiny_llama", "tiny_llama.trainer", "tiny_llama.model", "megatron.core.models.gpt",
                          "megatron.core.pipeline_parallel", "tiny_llama.convergence", "tiny_llama.leak",
                          "tiny_llama.train_gates"))
    finally:
        capture.suspend_global_capture()


@pytest.fixture(scope="module")
def world1():
    """A 1-process gloo world with Megatron's groups (TP=CP=1), released at the end of the module."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_cp.testing import free_port

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, context_parallel_size=1, create_gloo_process_groups=False)
    yield
    ps.destroy_model_parallel()
    if created:
        dist.destroy_process_group()
