"""Test-session set-up. This is the CPU suite: Triton kernels run through Triton's interpreter, which
must be switched on before anything imports triton (a test file cannot do it once another one has)."""

import os
import sys

import pytest

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(__file__))  # tests' shared helpers (_dist, reference)


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
