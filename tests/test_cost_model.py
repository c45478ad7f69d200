"""Cost model: the dense-path rule matches the kernels' split, and stage choice respects it."""

import numpy as np
import pytest
import torch

import megatron_cp as mcp
from megatron_cp.kernels.dense_tiles import split_dense
from megatron_cp.masks import builders as M
from megatron_cp.planner.cost import CostModel, Workload, dense_areas, tile_areas
from megatron_cp.planner.schedule import choose_num_stages


def _random_tiles(rng, n):
    out = []
    for _ in range(n):
        sq, sk = int(rng.integers(1, 300)), int(rng.integers(1, 300))
        q0, k0 = int(rng.integers(0, 50)), int(rng.integers(0, 50))
        out.append([q0, q0 + sq, k0, k0 + sk, int(rng.integers(0, 4))])
    return np.array(out, dtype=np.int64)


def test_dense_areas_match_kernel_split():
    rng = np.random.default_rng(0)
    for min_rows, min_keys in ((1, 1), (16, 32), (64, 64), (100, 250)):
        tiles = _random_tiles(rng, 400)
        cells, pieces, causal = dense_areas(tiles, min_rows, min_keys)
        for t, c, p, cc in zip(tiles, cells, pieces, causal):
            dense, _ = split_dense(torch.tensor([t.tolist()], dtype=torch.int32), min_rows, min_keys)
            want = sum(float(tile_areas(np.array([[a, b, x, y, 1 if causal else 0]]))[0][0])
                       for a, b, x, y, causal in dense)
            want_c = sum(float(tile_areas(np.array([[a, b, x, y, 1]]))[0][0])
                         for a, b, x, y, is_causal in dense if is_causal)
            assert (c, p, cc) == (want, len(dense), want_c), (t, c, p, cc, dense)


def test_dense_path_changes_kernel_time_and_stage_choice():
    work = Workload(32, 8, 128, 2)
    full = np.array([[0, 16384, 0, 65536, 0]])
    plain = CostModel(fwd_tflops=400.0, bwd_tflops=300.0, dense_fwd_tflops=0.0)
    dense = CostModel(fwd_tflops=400.0, bwd_tflops=300.0, dense_fwd_tflops=600.0, dense_bwd_tflops=500.0,
                      dense_min_keys=8192)
    flops = 4.0 * 16384 * 65536 * 32 * 128
    assert abs(plain.tile_time(full, work) - (flops / 400e12 / (65536 / (65536 + plain.half_keys))
                                              + (plain.launch_us + plain.tile_us) * 1e-6)) < 1e-9
    assert dense.tile_time(full, work) < 0.72 * plain.tile_time(full, work)
    # eight pieces of 8192 keys stay dense; sixteen of 4096 do not
    assert dense.tile_time(full, work, key_split=8) * 8 < 0.75 * plain.tile_time(full, work)
    assert dense.tile_time(full, work, key_split=16) > 0.95 * plain.tile_time(full, work, key_split=16)
    # zigzag causal at cp 4, S = 64k, on links slow enough that overlap pays: the plain model splits the
    # remote keys in three or more stages; the dense-aware one keeps stages whose pieces stay on cuDNN
    plan = mcp.plan(M.causal(65536), 4, solver="zigzag")
    slow = dict(intra_gbps=5.0, latency_us=5.0, launch_us=5.0)
    n_plain, _ = choose_num_stages(plan, CostModel(**{**plain.__dict__, **slow}), work, None)
    n_dense, preds = choose_num_stages(plan, CostModel(**{**dense.__dict__, **slow}), work, None)
    smallest_remote = min(r.num_remote for r in plan.ranks if r.num_remote)
    assert n_plain >= 3 and 1 <= n_dense < n_plain, (n_plain, n_dense, preds)
    assert smallest_remote // n_dense >= 8192 and preds[n_dense] < preds[n_plain]


def test_single_exchange_chosen_when_little_moves():
    """choose_stages: packed short documents move a few boundary rows: one exchange and one kernel
    call beat the staged path's extra passes; a dense mask on slow links is staged (overlap pays)."""
    from megatron_cp.planner.schedule import choose_stages, predict_single, schedule

    work = Workload(32, 8, 128, 2)
    model = CostModel(intra_gbps=300.0)
    docs = mcp.plan(M.varlen(list(range(0, 65536, 1000)) + [65536], causal=True), 4)
    assert max(r.num_remote for r in docs.ranks) > 0
    assert choose_stages(docs, model, work) == 0
    staged = schedule(docs, None, cost=model, work=work)
    single = predict_single(docs, model, work)
    assert single["fwd_s"] + single["bwd_s"] < staged.predicted["candidates"][staged.num_stages]
    causal = mcp.plan(M.causal(65536), 4, solver="zigzag")
    assert choose_stages(causal, CostModel(intra_gbps=3.0, launch_us=5.0), work) >= 2


def test_flat_routes_on_several_nodes_pay_the_inter_node_link():
    """predict(): with flat routes (topo None) rows from another node of plan.topology still cross the
    slow link (once per receiving rank); hierarchical routes cross once per node, spread over its GPUs."""
    from megatron_cp.planner.schedule import _stage_ids, _stage_tiles, predict, rank_traps

    work = Workload(32, 8, 128, 2)
    plan = mcp.plan(M.causal(8192), 4, topology=mcp.Topology(2, 2), solver="zigzag")
    traps = [rank_traps(plan, r) for r in range(4)]
    flat_ids = _stage_ids(plan, 1, None)
    flat_tiles = _stage_tiles(plan, flat_ids, traps)
    slow, fast = CostModel(inter_gbps=1.0, intra_gbps=1e4), CostModel(inter_gbps=1e4, intra_gbps=1e4)
    c_slow = predict(plan, flat_ids, flat_tiles, None, slow, work)["comm_s"][0]
    c_fast = predict(plan, flat_ids, flat_tiles, None, fast, work)["comm_s"][0]
    far = max(int(sum(1 for i in flat_ids[r][0] if plan.owner[np.searchsorted(plan.bounds, i, "right") - 1] // 2 != r // 2))
              for r in range(4))
    assert far > 0
    assert abs(c_slow - (slow.latency_us * 1e-6 + far * work.kv_bytes_per_token / 1e9)) < 1e-9
    assert c_fast < c_slow / 100
    hier_ids = _stage_ids(plan, 1, plan.topology)
    c_hier = predict(plan, hier_ids, _stage_tiles(plan, hier_ids, traps), plan.topology, slow, work)["comm_s"][0]
    assert c_hier < c_slow  # one crossing per node, shared by its 2 GPUs


def test_short_row_class_uses_its_own_fit():
    """A list whose mean kept keys per covered row is below long_row_keys runs the backend's short-row
    block shapes: the model then uses the short-row peak and half-efficiency keys (when calibrated), and
    decides the class exactly as kernels/triton_backend.py (area vs LONG_ROW_KEYS x covered rows)."""
    from megatron_cp.kernels.triton_backend import LONG_ROW_KEYS
    from megatron_cp.kernels.triton_schedule import covered_rows

    base = dict(fwd_tflops=400.0, bwd_tflops=300.0, half_keys=200.0, tile_us=0.0, launch_us=0.0,
                dense_fwd_tflops=0.0)
    plain = CostModel(**base)
    fitted = CostModel(**base, short_fwd_tflops=500.0, short_bwd_tflops=450.0, short_half_keys=100.0)
    assert fitted.long_row_keys == LONG_ROW_KEYS
    w = Workload(8, 2, 64, 2)
    flops = lambda area: 4.0 * area * 8 * 64  # noqa: E731
    # 2048 rows with 1024 keys each (short), and rows far apart (covered rows, not the span, count)
    short = np.array([[0, 1024, 0, 1024, 0], [8192, 9216, 0, 1024, 0]])
    assert float(tile_areas(short)[0].sum()) < LONG_ROW_KEYS * covered_rows(torch.tensor(short))
    e = 1024 / (1024 + 100)
    assert fitted.tile_time(short, w) == pytest.approx(flops(2 * 1024 * 1024) / (500e12 * e))
    assert fitted.tile_time(short, w, True) == pytest.approx(flops(2 * 1024 * 1024) / (450e12 / 2.5 * e))
    assert plain.tile_time(short, w) == pytest.approx(flops(2 * 1024 * 1024) / (400e12 * 1024 / 1224))
    # long rows (8192 keys): the long-row numbers, calibrated short ones or not
    long = np.array([[0, 512, 0, 8192, 0]])
    assert float(tile_areas(long)[0].sum()) >= LONG_ROW_KEYS * covered_rows(torch.tensor(long))
    want = flops(512 * 8192) / (400e12 * 8192 / 8392)
    assert fitted.tile_time(long, w) == pytest.approx(want) == plain.tile_time(long, w)
