"""CPCoreAttention against a dense fp64 reference, written the way Megatron's unit tests are.

Megatron's ``tests/unit_tests`` classes set up parallel state in ``setup_method`` with
``Utils.initialize_model_parallel(tensor_model_parallel_size=..., context_parallel_size=...)`` and
tear it down in ``teardown_method``; torchrun starts one process per GPU (NCCL). Copied into that
harness, this file uses its ``Utils`` and runs with CP = world size on CUDA. Here (pytest on CPU) it
runs the same class in-process at CP=1 and, through ``test_spawned_cp2``, in 2 gloo processes at CP=2.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_cp.testing import free_port, reference_attention

try:  # inside Megatron-LM's tests/unit_tests harness
    from tests.unit_tests.test_utilities import Utils  # type: ignore
except Exception:  # standalone: a gloo group of whatever world size is initialised (1 if none)

    class Utils:
        @staticmethod
        def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                      context_parallel_size=1, **kw):
            from megatron.core import parallel_state as ps

            if not dist.is_initialized() and "WORLD_SIZE" in os.environ:  # under torchrun
                if torch.cuda.is_available():
                    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
                dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            if not dist.is_initialized():
                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size,
                                         context_parallel_size=context_parallel_size,
                                         create_gloo_process_groups=False)

        @staticmethod
        def destroy_model_parallel():
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()


@pytest.fixture(scope="module", autouse=True)
def _release_default_group():
    """Leave no process group behind for other test modules of the same pytest process."""
    was = dist.is_initialized()
    yield
    if not was and dist.is_initialized():
        dist.destroy_process_group()


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and \
        dist.get_backend() == "nccl" else torch.device("cpu")


def dense_reference(q, k, v, mask: np.ndarray, scale: float, dout):
    """fp64 attention over full sequences, batch by batch (megatron_cp.testing.reference_attention):
    q [S, b, Hq, D], k/v [S, b, Hkv, D], dout [S, b, Hq*D] -> out [S, b, Hq*D], dq, dk, dv like q, k, v."""
    S, b, hq, d = q.shape
    refs = [reference_attention(q[:, i], k[:, i], v[:, i], mask, scale, dout=dout[:, i].reshape(S, hq, d))
            for i in range(b)]
    out, dq, dk, dv = (torch.stack([getattr(r, n) for r in refs], 1) for n in ("out", "dq", "dk", "dv"))
    return out.reshape(S, b, hq * d), dq, dk, dv


class TestCPCoreAttention:
    def setup_method(self, method):
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
        Utils.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=world)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def _config(self, heads=4, groups=2, kv=16):
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig(num_layers=1, hidden_size=heads * kv, num_attention_heads=heads,
                                 num_query_groups=groups, kv_channels=kv, attention_dropout=0.0,
                                 use_cpu_initialization=True,
                                 context_parallel_size=dist.get_world_size())

    def _module(self, config):
        from megatron.core.transformer.enums import AttnMaskType

        from megatron_cp.megatron import CPCoreAttention

        return CPCoreAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                               attention_type="self", cp_comm_type=None, softmax_scale=None, pg_collection=None)

    @pytest.mark.parametrize("mask_name,b", [("causal", 2), ("packed", 1), ("sliding_window", 1)])
    def test_forward_backward_match_dense(self, mask_name, b):
        from megatron.core import parallel_state as ps

        import megatron_cp as mcp
        from megatron_cp.megatron import CPParams

        torch.manual_seed(0)
        dev = _device()
        cfg = self._config()
        attn = self._module(cfg).to(dev)
        S, hq, hkv, d = 40, 4, 2, 16
        cu = np.array([0, 7, 23, 40]) if mask_name == "packed" else np.array([0, S])
        mask = (mcp.masks.varlen(cu, causal=True, window=5) if mask_name == "sliding_window"
                else mcp.masks.varlen(cu, causal=True))
        group = ps.get_context_parallel_group()
        plan = mcp.plan(mask, group.size())
        q = torch.randn(S, b, hq, d, device=dev, dtype=torch.float64)
        k = torch.randn(S, b, hkv, d, device=dev, dtype=torch.float64)
        v = torch.randn(S, b, hkv, d, device=dev, dtype=torch.float64)
        dout = torch.randn(S, b, hq * d, device=dev, dtype=torch.float64)
        assert group.size() == dist.get_world_size()  # CP spans the whole world in this test
        ref, dq_ref, dk_ref, dv_ref = dense_reference(q, k, v, mask.to_dense(), d ** -0.5, dout)

        ids = torch.from_numpy(plan.local_ids(group.rank())).to(dev)
        ql, kl, vl = (t.index_select(0, ids).float().requires_grad_(True) for t in (q, k, v))
        params = CPParams(plan=plan, position_ids=ids[None], cp_rank=group.rank())
        out = attn(ql, kl, vl, None, packed_seq_params=params)
        assert out.shape == (len(ids), b, hq * d)
        out.backward(dout.index_select(0, ids).float())
        torch.testing.assert_close(out.double(), ref.index_select(0, ids), atol=2e-5, rtol=2e-5)
        # dK/dV of a local token collect contributions from every rank's queries: the runtime
        # reduces them back to the owner, so the local slices equal the dense gradients.
        for got, want in ((ql.grad, dq_ref), (kl.grad, dk_ref), (vl.grad, dv_ref)):
            torch.testing.assert_close(got.double(), want.index_select(0, ids), atol=2e-5, rtol=2e-5)

    def test_errors_name_bad_values_before_any_collective(self):
        import megatron_cp as mcp
        from megatron_cp.megatron import CPParams

        cfg = self._config()
        attn = self._module(cfg)
        world = dist.get_world_size()
        plan = mcp.plan(mcp.masks.causal(16), world)
        n = len(plan.local_ids(dist.get_rank()))
        q = torch.randn(n, 1, 4, 16)
        kv = torch.randn(n, 1, 2, 16)
        p = CPParams(plan=plan, position_ids=torch.zeros(1, n, dtype=torch.long), cp_rank=dist.get_rank())
        with pytest.raises(ValueError, match="attention_bias"):
            attn(q, kv, kv, None, attention_bias=torch.zeros(1), packed_seq_params=p)
        with pytest.raises(ValueError, match=r"\[s, b, h, d\]"):
            attn(q[:, 0], kv[:, 0], kv[:, 0], None, packed_seq_params=p)
        with pytest.raises(ValueError, match="holds"):
            attn(q[:-1], kv[:-1], kv[:-1], None, packed_seq_params=p)
        with pytest.raises(ValueError, match="Hkv dividing Hq"):
            attn(q, torch.randn(n, 1, 3, 16), torch.randn(n, 1, 3, 16), None, packed_seq_params=p)
        wrong = mcp.plan(mcp.masks.causal(16), world + 1)
        with pytest.raises(ValueError, match=f"cp_size={world + 1}"):
            attn(q, kv, kv, None, packed_seq_params=CPParams(plan=wrong, position_ids=None, cp_rank=0))
        if world > 1:
            with pytest.raises(ValueError, match="CPParams"):
                attn(q, kv, kv, None, packed_seq_params=None)
        else:
            from megatron.core.transformer.enums import AttnMaskType

            with pytest.raises(ValueError, match="no_mask"):
                attn(q, kv, kv, None, attn_mask_type=AttnMaskType.no_mask, packed_seq_params=None)

    def test_constructor_refuses_unsupported_config(self):
        from megatron.core.transformer.enums import AttnMaskType

        from megatron_cp.megatron import CPCoreAttention

        cfg = self._config()
        cfg.attention_dropout = 0.1
        with pytest.raises(ValueError, match="0.1"):
            CPCoreAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        cfg = self._config()
        with pytest.raises(ValueError, match="cross"):
            CPCoreAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="cross")


def _spawned(rank, world):
    t = TestCPCoreAttention()
    for case in [("causal", 2), ("packed", 1), ("sliding_window", 1)]:
        t.setup_method(None)
        t.test_forward_backward_match_dense(*case)
        t.teardown_method(None)
    t.setup_method(None)
    t.test_errors_name_bad_values_before_any_collective()
    t.teardown_method(None)
    return "ok"


def test_spawned_cp2():
    """The same class at CP=2: two gloo processes, every case inside each worker."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        pytest.skip("already running distributed (Megatron harness)")
    from megatron_helpers import EXAMPLES  # noqa: F401  (puts examples/ on sys.path)
    from tiny_llama.trainer import spawn

    assert spawn(_spawned, 2) == "ok"
