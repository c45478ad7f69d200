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

    def test_windowed_layers_run_the_window_plan(self):
        """config.window_size (5, 0) with window_attn_skip_freq 2 (Gemma-style mixed layers): layer 1 is windowed
        and runs CPParams.window_plan (keys i-5..i inside each document), layer 2 the documents' full plan;
        each equals dense attention under its own mask. A windowed layer given a micro-batch prepared without
        that window raises, naming both."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.transformer_config import TransformerConfig

        import megatron_cp as mcp
        from megatron_cp.megatron import CPCoreAttention, CPParams
        from megatron_cp.planner import plan_like

        torch.manual_seed(1)
        cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                kv_channels=16, attention_dropout=0.0, use_cpu_initialization=True,
                                context_parallel_size=dist.get_world_size(), window_size=(5, 0),
                                window_attn_skip_freq=2)
        layers = [CPCoreAttention(config=cfg, layer_number=n, attn_mask_type=AttnMaskType.causal,
                                  attention_type="self", pg_collection=None) for n in (1, 2)]
        assert [m.layer_window for m in layers] == [5, None]
        S, cu = 40, np.array([0, 9, 30, 40])
        full, win = mcp.masks.varlen(cu, causal=True), mcp.masks.varlen(cu, causal=True, window=5)
        group = ps.get_context_parallel_group()
        plan = mcp.plan(full, group.size())
        params = CPParams(plan=plan, position_ids=None, cp_rank=group.rank(), layer_window=5,
                          window_plan=plan_like(win, plan))
        ids = torch.from_numpy(plan.local_ids(group.rank()))
        q, k, v = (torch.randn(S, 1, h, 16, dtype=torch.float64) for h in (4, 2, 2))
        dout = torch.randn(S, 1, 64, dtype=torch.float64)
        for layer, mask in zip(layers, (win, full)):
            ref, dq_ref, dk_ref, dv_ref = dense_reference(q, k, v, mask.to_dense(), 16 ** -0.5, dout)
            ql, kl, vl = (t.index_select(0, ids).float().requires_grad_(True) for t in (q, k, v))
            out = layer(ql, kl, vl, None, packed_seq_params=params)
            out.backward(dout.index_select(0, ids).float())
            torch.testing.assert_close(out.double(), ref.index_select(0, ids), atol=2e-5, rtol=2e-5)
            for got, want in ((ql.grad, dq_ref), (kl.grad, dk_ref), (vl.grad, dv_ref)):
                torch.testing.assert_close(got.double(), want.index_select(0, ids), atol=2e-5, rtol=2e-5)
        bare = CPParams(plan=plan, position_ids=None, cp_rank=group.rank())
        ql = q.index_select(0, ids).float()
        with pytest.raises(ValueError, match="layer 1 is windowed \\(window 5\\) but its micro-batch was prepared "
                                             "with layer_window=None"):
            layers[0](ql, ql[:, :, :2], ql[:, :, :2], None, packed_seq_params=bare)

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
        with pytest.raises(ValueError, match=r"\[s, b, h, d\]"):  # (3-D is MLA's [s, h, d] with CPParams)
            attn(q[:, 0, 0], kv[:, 0, 0], kv[:, 0, 0], None, packed_seq_params=p)
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

    def test_a_batch_planned_for_other_run_options_is_refused(self):
        """A layer runs the kernel backend, strategy and sparse selectors bound in its spec; a micro-batch whose
        plan was made for others (a ring layout for a megatron_cp layer, another backend) is refused by name."""
        import megatron_cp as mcp
        from megatron.core.transformer.enums import AttnMaskType

        from megatron_cp.megatron import CPCoreAttention, CPParams, LayerOptions

        world = dist.get_world_size()
        plan = mcp.plan(mcp.masks.causal(16), world)
        n = len(plan.local_ids(dist.get_rank()))
        q, kv = torch.randn(n, 1, 4, 16), torch.randn(n, 1, 2, 16)
        ring = CPCoreAttention(config=self._config(), layer_number=3, attn_mask_type=AttnMaskType.causal,
                               attention_type="self", options=LayerOptions(strategy="ring"))
        for layer in (LayerOptions(), LayerOptions(kernel_backend="reference", strategy="ring")):
            p = CPParams(plan=plan, position_ids=None, cp_rank=dist.get_rank(), layer=layer)
            with pytest.raises(ValueError, match=r"layer 3 was built for LayerOptions\(kernel_backend='auto', "
                                                 r"strategy='ring'.*planned for"):
                ring(q, kv, kv, None, packed_seq_params=p)
        with pytest.raises(ValueError, match="options must be a LayerOptions"):
            CPCoreAttention(config=self._config(), layer_number=1, attn_mask_type=AttnMaskType.causal,
                            attention_type="self", options="ring")

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

    def test_sinks_cp_equals_cp1(self):
        """Learnable and off-by-one sinks over packed documents: CPCoreAttention on the CP group (all ranks)
        equals CPCoreAttention at CP=1 on the whole sequence (a one-rank CP group) - out, dq, dk, dv and the
        sink parameter's gradient summed over CP ranks (Megatron reduces it over dp-cp) - within 1e-5 (fp32)."""
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.enums import AttnMaskType

        import megatron_cp as mcp
        from megatron_cp.megatron import CPCoreAttention, CPParams

        group = ps.get_context_parallel_group()
        world, rank = group.size(), group.rank()
        singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group
        one = ProcessGroupCollection(tp=ps.get_tensor_model_parallel_group(), cp=singles[dist.get_rank()])
        S, b, hq, hkv, d = 40, 2, 4, 2, 16
        mask = mcp.masks.varlen(np.array([0, 7, 23, 40]), causal=True)
        plan, plan1 = mcp.plan(mask, world), mcp.plan(mask, 1)
        ids = torch.from_numpy(plan.local_ids(rank))
        gen = torch.Generator().manual_seed(7)
        q, dout = torch.randn(S, b, hq, d, generator=gen), torch.randn(S, b, hq * d, generator=gen)
        k, v = torch.randn(S, b, hkv, d, generator=gen), torch.randn(S, b, hkv, d, generator=gen)
        for softmax_type in ("learnable", "off-by-one"):
            cfg = self._config()
            cfg.softmax_type = softmax_type
            mods = [CPCoreAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                    attention_type="self", pg_collection=pg) for pg in (None, one)]
            if softmax_type == "learnable":
                assert isinstance(mods[0].softmax_offset, torch.nn.Parameter)
                assert mods[0].softmax_offset.shape == (hq,)  # heads of this TP rank (TP 1 here)
                assert mods[0].softmax_offset.tensor_model_parallel and mods[0].softmax_offset.partition_dim == 0
                with torch.no_grad():
                    for m in mods:
                        m.softmax_offset.copy_(torch.linspace(-1.0, 1.5, hq))
            else:
                assert not any(True for _ in mods[0].parameters()) and float(mods[0].softmax_offset.abs().sum()) == 0
            got = []
            for m, p, rows in ((mods[0], plan, ids), (mods[1], plan1, torch.arange(S))):
                ls = [t.index_select(0, rows).clone().requires_grad_() for t in (q, k, v)]
                out = m(*ls, None, packed_seq_params=CPParams(plan=p, position_ids=rows[None], cp_rank=0 if p is plan1 else rank))
                out.backward(dout.index_select(0, rows))
                gs = m.softmax_offset.grad.clone() if softmax_type == "learnable" else torch.zeros(hq)
                got.append((out.detach(), [t.grad for t in ls], gs))
            (o, gq, gs), (o1, gq1, gs1) = got
            if world > 1:
                dist.all_reduce(gs, group=group)
            torch.testing.assert_close(o, o1[ids], atol=1e-5, rtol=1e-5)
            for a, w in zip(gq, gq1):
                torch.testing.assert_close(a, w[ids], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(gs, gs1, atol=1e-5, rtol=1e-5)
            if softmax_type == "learnable":
                assert float(gs1.abs().max()) > 1e-3  # the sink is in play
        for g in singles:
            dist.destroy_process_group(g)

    def test_ranks_that_disagree_raise_on_every_rank(self):
        """Head counts, head dims or dtypes that differ across CP ranks: a ValueError on every rank naming
        the values (one all-reduce once per plan), before the attention's exchanges."""
        from megatron.core import parallel_state as ps

        import megatron_cp as mcp
        from megatron_cp.megatron import CPParams

        group = ps.get_context_parallel_group()
        world, rank = group.size(), group.rank()
        if world == 1:
            return  # nothing to disagree with: the spawned CP=2 run checks it
        n = 24
        results = {}
        for what, (hq, hkv, d, dtype), pattern in (
            ("heads", (4 + 4 * rank, 2, 16, torch.float32), r"query heads differs across ranks \(this rank: \d, seen from 4 to 8\)"),
            ("dtype", (4, 2, 16, (torch.float32, torch.float64)[rank % 2]), "dtype differs across ranks .*float32 to float64"),
            ("head_dim", (4, 2, 8 * (1 + rank % 2), torch.float32), "q/k head_dim differs"),
        ):
            plan = mcp.plan(mcp.masks.causal(n), world)  # a fresh plan: checked once per plan
            m = len(plan.local_ids(rank))
            cfg = self._config(heads=hq, kv=d)
            attn = self._module(cfg)
            q, k = torch.randn(m, 1, hq, d, dtype=dtype), torch.randn(m, 1, hkv, d, dtype=dtype)
            try:
                attn(q, k, k, None, packed_seq_params=CPParams(plan=plan, position_ids=None, cp_rank=rank))
                results[what] = "no error"
            except ValueError as e:
                import re

                results[what] = "ok" if re.search(pattern, str(e)) else repr(e)
        # megatron-cp's attention itself (no adapter) checks the same way: v head dims that differ
        plan = mcp.plan(mcp.masks.causal(n), world)
        m = len(plan.local_ids(rank))
        q, k = torch.randn(m, 4, 16), torch.randn(m, 2, 16)
        try:
            mcp.attention(q, k, torch.randn(m, 2, 8 * (1 + rank % 2)), plan, group)
            results["runtime v head_dim"] = "no error"
        except ValueError as e:
            results["runtime v head_dim"] = "ok" if "v head_dim differs across ranks" in str(e) else repr(e)
        assert all(r == "ok" for r in results.values()), results
        # the same plan with agreeing inputs then runs (the check passed and is not repeated)
        plan = mcp.plan(mcp.masks.causal(n), world)
        m = len(plan.local_ids(rank))
        attn = self._module(self._config())
        q, k = torch.randn(m, 1, 4, 16), torch.randn(m, 1, 2, 16)
        assert attn(q, k, k, None, packed_seq_params=CPParams(plan=plan, position_ids=None, cp_rank=rank)).shape == (m, 1, 64)


def _spawned(rank, world):
    t = TestCPCoreAttention()
    for case in [("causal", 2), ("packed", 1), ("sliding_window", 1)]:
        t.setup_method(None)
        t.test_forward_backward_match_dense(*case)
        t.teardown_method(None)
    for name in ("test_windowed_layers_run_the_window_plan", "test_errors_name_bad_values_before_any_collective",
                 "test_sinks_cp_equals_cp1",
                 "test_ranks_that_disagree_raise_on_every_rank"):
        t.setup_method(None)
        getattr(t, name)()
        t.teardown_method(None)
    return "ok"


def test_spawned_cp2():
    """The same class at CP=2: two gloo processes, every case inside each worker."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        pytest.skip("already running distributed (Megatron harness)")
    from megatron_helpers import EXAMPLES  # noqa: F401  (puts examples/ on sys.path)
    from tiny_llama.trainer import spawn

    assert spawn(_spawned, 2) == "ok"




@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one"])
def test_sinks_match_megatron_dot_product_attention(softmax_type, monkeypatch):
    """CPCoreAttention with sinks at CP=1 equals Megatron's own DotProductAttention with the same
    softmax_type (its SoftmaxOne: a sink column per head) on packed documents, fp32: out, dq, dk, dv and the
    sink parameter's gradient; the parameter has DotProductAttention's name and shape (checkpoints carry over)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron_helpers import CPUBuffer, NoRNG
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    import megatron_cp as mcp
    from megatron_cp.megatron import CPCoreAttention, CPParams

    # DotProductAttention places its offset and score buffer on the current CUDA device and forks the CUDA
    # RNG around (zero-probability) dropout; on CPU it gets a CPU device, buffer and no fork.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", lambda: CPUBuffer())
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: NoRNG())
    Utils.initialize_model_parallel(1, context_parallel_size=1)
    try:
        t = TestCPCoreAttention()
        cfg = t._config()
        cfg.context_parallel_size = 1
        cfg.softmax_type = softmax_type
        kw = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        torch.manual_seed(0)
        ref = DotProductAttention(**kw)
        torch.manual_seed(0)
        ours = CPCoreAttention(**kw)
        assert sorted(ours.state_dict()) == sorted(ref.state_dict())
        if softmax_type == "learnable":
            assert ours.softmax_offset.shape == ref.softmax_offset.shape == (4,)
            torch.testing.assert_close(ours.softmax_offset, ref.softmax_offset)  # same init (config.init_method)
            with torch.no_grad():  # sinks of both signs, one large enough to take most of a row
                for m in (ours, ref):
                    m.softmax_offset.copy_(torch.tensor([-1.0, 0.3, 2.5, 0.0]))
        S, b = 40, 2
        mask = mcp.masks.varlen(np.array([0, 7, 23, 40]), causal=True)
        gen = torch.Generator().manual_seed(1)
        q, dout = torch.randn(S, b, 4, 16, generator=gen), torch.randn(S, b, 64, generator=gen)
        k, v = torch.randn(S, b, 2, 16, generator=gen), torch.randn(S, b, 2, 16, generator=gen)
        got = []
        for m in (ref, ours):
            ls = [x.clone().requires_grad_() for x in (q, k, v)]
            if m is ref:  # Megatron's mask: True = masked out
                out = m(*ls, torch.as_tensor(~mask.to_dense())[None, None])
            else:
                out = m(*ls, None, packed_seq_params=CPParams(plan=mcp.plan(mask, 1), position_ids=None, cp_rank=0))
            out.backward(dout)
            got.append([out.detach()] + [x.grad for x in ls] +
                       ([m.softmax_offset.grad] if softmax_type == "learnable" else []))
        for a, w in zip(got[1], got[0]):
            torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)
        if softmax_type == "learnable":
            assert float(got[0][4].abs().max()) > 1e-3
        # and it is not vanilla attention: the sink changes the output
        van = CPCoreAttention(**{**kw, "config": t._config()})
        plain = van(q, k, v, None, packed_seq_params=CPParams(plan=mcp.plan(mask, 1), position_ids=None, cp_rank=0))
        assert float((plain - got[1][0]).abs().max()) > 1e-2
    finally:
        Utils.destroy_model_parallel()
