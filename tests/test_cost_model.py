"""Cost model: it prices what the kernels run (their own split into cuDNN pieces and Triton rest, their
row class; its visited-block counts match the kernels' block schedule), the classes use their own fits,
and the exchange choice respects the dense path."""

import json
import pathlib

import numpy as np
import pytest
import torch

import megatron_cp as mcp
from megatron_cp.kernels.pieces import row_class as kernel_row_class, split_pieces
from megatron_cp.masks import builders as M
from megatron_cp.masks.geometry import traps_to_tiles as clip_tiles
from megatron_cp.planner import Workload
from megatron_cp.runtime.cost import CostModel, block_counts, row_block_entries, tile_areas

ROOT = pathlib.Path(__file__).resolve().parents[1]
from megatron_cp.runtime.schedule import choose_num_stages
from scripts import load_script


def _random_tiles(rng, n):
    out = []
    for _ in range(n):
        sq, sk = int(rng.integers(1, 300)), int(rng.integers(1, 300))
        q0, k0 = int(rng.integers(0, 50)), int(rng.integers(0, 50))
        out.append([q0, q0 + sq, k0, k0 + sk, int(rng.integers(0, 4))])
    return np.array(out, dtype=np.int64)


def _pieces(tiles, **kw):
    return split_pieces(torch.tensor(np.asarray(tiles).tolist(), dtype=torch.int32).reshape(-1, 5), **kw)


@pytest.mark.parametrize("rule", [(1, 1, 0), (16, 32, 8), (64, 64, 16), (100, 250, 0)])
def test_the_model_prices_the_kernels_own_split(rule):
    """One split of tiles into kernel pieces, the kernels': the model's Triton rest and cuDNN pieces are
    ``kernels.pieces.split_pieces``' (forward with band squares, backward without), and the pieces' cells
    and the rest's add up to the list's."""
    min_rows, min_keys, squares = rule
    m = CostModel.from_flat(dict(dense_min_rows=min_rows, dense_min_keys=min_keys, band_squares=squares))
    rng = np.random.default_rng(sum(rule))
    seen = 0
    for _ in range(60):
        tiles = _random_tiles(rng, int(rng.integers(1, 6)))
        for backward in (False, True):
            p = _pieces(tiles, min_rows=min_rows, min_keys=min_keys, band_squares=squares, forward=not backward)
            got = m.rest_tiles(tiles, backward)
            assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, p.rest.tolist()))
            pieces, rest, _ = m.dense.pieces(tiles, backward, 1)
            cells = 0.0 if pieces is None else float(pieces[2].sum())
            assert cells + float(tile_areas(rest)[0].sum()) == float(tile_areas(tiles)[0].sum())
            assert (pieces is None) == (len(p.cudnn) == 0)
            seen += pieces is not None
    assert seen > 10


def test_the_models_row_class_is_the_kernels():
    """The class of a Triton list is the kernels' (``kernels.pieces.row_class``); a model without numbers
    for a class falls back (blocky -> short -> long)."""
    s = 8192
    lists = {"long": M.causal(s), "short": M.sliding_window(s, 512, 0), "blocky": M.strided(s, 512, 4, local_blocks=1)}
    full = CostModel.from_flat(dict(short_fwd_tflops=1.0, blocky_fwd_tflops=1.0))
    no_blocky = CostModel.from_flat(dict(short_fwd_tflops=1.0))
    plain = CostModel()
    for want, mask in lists.items():
        tiles = mcp.plan(mask, 1).ranks[0].tiles
        assert kernel_row_class(torch.from_numpy(tiles)) == want == full.row_class(tiles)
        assert no_blocky.row_class(tiles) == ("short" if want == "blocky" else want)
        assert plain.row_class(tiles) == "long"


@pytest.mark.parametrize("bm,bn", [(128, 64), (64, 64), (32, 16), (16, 32)])
def test_block_counts_match_kernel_schedule(bm, bn):
    from megatron_cp.kernels.triton.blocks import block_pairs, tile_descriptors

    rng = np.random.default_rng(bm * 7 + bn)
    tiles = _random_tiles(rng, 300)
    tid, _, _, full = block_pairs(tile_descriptors(torch.tensor(tiles)), bm, bn)
    visited, got_full = block_counts(tiles, bm, bn)
    assert visited.tolist() == np.bincount(tid.numpy(), minlength=len(tiles)).astype(float).tolist()
    assert got_full.tolist() == np.bincount(tid.numpy()[full.numpy()], minlength=len(tiles)).astype(float).tolist()
    assert visited.sum() > got_full.sum() > 0


@pytest.mark.parametrize("bm,bn", [(128, 64), (64, 64), (32, 16)])
def test_row_block_entries_match_kernel_schedule(bm, bn):
    """A q block's entries in the model are the row-major schedule's entries of that block (what one
    forward program walks), duplicates across tiles included."""
    from megatron_cp.kernels.triton.blocks import block_pairs, tile_descriptors

    rng = np.random.default_rng(bm + bn)
    tiles = _random_tiles(rng, 200)
    _, m, _, _ = block_pairs(tile_descriptors(torch.tensor(tiles)), bm, bn)
    want = np.bincount(m.numpy())[int(m.min()):]  # from the first q block with an entry, as the model counts
    got = row_block_entries(tiles, bm, bn)
    assert np.trim_zeros(got, "b").tolist() == want.astype(float).tolist()  # (a last block with no entry: 0)
    assert got.sum() == len(m) > 0


def _long_rows_model(**kw):
    base = dict(launch_us=0.0, tile_us=0.0, dense_fwd_tflops=0.0, short_fwd_tflops=400.0, short_bwd_tflops=300.0,
                blocky_fwd_tflops=400.0, blocky_bwd_tflops=300.0, num_sms=132)
    return CostModel.from_flat(dict(**{**base, **kw}))


def test_long_rows_bound_forward_of_a_list_with_global_rows():
    """One q block keeping 131072 keys among rows of 512: its 32 programs (one per head) outlast the
    list's throughput time, and the bound follows the calibrated rates; a list without such a row, the
    backward (its long dK/dV columns are split) and an uncalibrated model keep the throughput time."""
    w = Workload(32, 8, 128, 2)
    rows, keys = 32768, 131072
    band = [[i, i + 512, i, i + 2048, 0] for i in range(128, rows, 512)]
    gl = np.array([[0, 128, 0, keys, 0]] + band, dtype=np.int64)
    plain = _long_rows_model()
    t0 = plain.tile_time(gl, w)
    t_alone = _long_rows_model(row_alone_tflops=3.0, row_share=1e-6).tile_time(gl, w)
    long_work = 128 * keys * 4 * 128  # one program: a head of the q block over every key
    # a share of ~0: the long programs wait for the rest of the list, then run alone
    assert t_alone == pytest.approx(t0 - long_work * 32 / 400e12 + long_work / 3e12, rel=1e-3)
    t_shared = _long_rows_model(row_alone_tflops=3.0, row_share=0.5).tile_time(gl, w)
    assert t0 < t_shared < t_alone
    assert _long_rows_model(row_alone_tflops=3.0, row_share=0.5).tile_time(gl, w, backward=True) == plain.tile_time(
        gl, w, backward=True)
    flat = np.array(band, dtype=np.int64)
    assert _long_rows_model(row_alone_tflops=3.0, row_share=0.5).tile_time(flat, w) == pytest.approx(
        plain.tile_time(flat, w))


def test_p2p_time_interpolates_two_measured_sizes():
    """The neighbour transfer time passes through the two calibrated sizes and keeps their slope beyond."""
    mb = 2**20
    c = CostModel.from_flat(dict(p2p_gbps=128 * mb / 1e9 / 0.8e-3, p2p_big_gbps=256 * mb / 1e9 / 1.0e-3, p2p_bytes=128 * mb,
                  latency_us=50.0))
    assert c.p2p_time(128 * mb) == pytest.approx(0.85e-3)
    assert c.p2p_time(256 * mb) == pytest.approx(1.05e-3)
    assert c.p2p_time(384 * mb) == pytest.approx(1.25e-3)
    assert c.p2p_time(64 * mb) == pytest.approx(0.45e-3)
    one = CostModel.from_flat(dict(p2p_gbps=100.0, latency_us=0.0))  # no second size: proportional
    assert one.p2p_time(2e9) == pytest.approx(2 * one.p2p_time(1e9))


def test_dense_path_changes_kernel_time_and_stage_choice():
    work = Workload(32, 8, 128, 2)
    full = np.array([[0, 16384, 0, 65536, 0]])
    plain = CostModel.from_flat(dict(fwd_tflops=400.0, bwd_tflops=300.0, dense_fwd_tflops=0.0))
    dense = CostModel.from_flat(dict(fwd_tflops=400.0, bwd_tflops=300.0, dense_fwd_tflops=600.0, dense_bwd_tflops=500.0,
                      dense_min_keys=8192))
    flops = 4.0 * 16384 * 65536 * 32 * 128
    assert abs(plain.tile_time(full, work) - (flops / 400e12 / (65536 / (65536 + plain.triton.long.half_keys))
                                              + (plain.launch_us + plain.triton.tile_us) * 1e-6)) < 1e-9
    assert dense.tile_time(full, work) < 0.72 * plain.tile_time(full, work)
    # eight pieces of 8192 keys stay dense; sixteen of 4096 do not
    assert dense.tile_time(full, work, key_split=8) * 8 < 0.75 * plain.tile_time(full, work)
    assert dense.tile_time(full, work, key_split=16) > 0.95 * plain.tile_time(full, work, key_split=16)
    # zigzag causal at cp 4, S = 64k, on links slow enough that overlap pays (10 GB/s): the plain model
    # splits the remote keys in two or more stages; the dense-aware one (pieces of >= 16384 keys dense: a
    # rank's remote keys, 24576 .. 49152, are one merged piece per stage) keeps them in one cuDNN piece
    plan = mcp.plan(M.causal(65536), 4, solver="zigzag")
    slow = dict(intra_gbps=10.0, latency_us=5.0, launch_us=5.0)
    n_plain, _ = choose_num_stages(plan, CostModel.from_flat(dict(**{**plain.flat(), **slow})), work, None)
    dense_16k = CostModel.from_flat(dict(**{**dense.flat(), **slow, "dense_min_keys": 16384}))
    n_dense, preds = choose_num_stages(plan, dense_16k, work, None)
    smallest_remote = min(r.num_remote for r in plan.ranks if r.num_remote)
    assert n_plain >= 2 and 1 <= n_dense < n_plain, (n_plain, n_dense, preds)
    assert smallest_remote // n_dense >= 16384 and preds[n_dense] < preds[n_plain]


def test_single_exchange_chosen_when_little_moves():
    """choose_schedule: packed short documents move a few boundary rows: one exchange and one kernel
    call beat the staged path's extra passes; a dense mask on slow links is staged (overlap pays)."""
    from megatron_cp.runtime.predict import predict_single
    from megatron_cp.runtime.schedule import choose_schedule, schedule

    work = Workload(32, 8, 128, 2)
    model = CostModel.from_flat(dict(intra_gbps=300.0))
    docs = mcp.plan(M.varlen(list(range(0, 65536, 1000)) + [65536], causal=True), 4)
    assert max(r.num_remote for r in docs.ranks) > 0
    assert choose_schedule(docs, None, model, work) is None
    staged = schedule(docs, None, cost=model, work=work)
    single = predict_single(docs, model, work)
    assert single["fwd_s"] + single["bwd_s"] < staged.predicted["candidates"][staged.num_stages]
    causal = mcp.plan(M.causal(65536), 4, solver="zigzag")
    assert choose_schedule(causal, None, CostModel.from_flat(dict(intra_gbps=3.0, launch_us=5.0)), work).num_stages >= 2
    assert choose_schedule(causal, 0, model, work) is None and choose_schedule(causal, 3, model, work).num_stages == 3


def test_flat_routes_on_several_nodes_pay_the_inter_node_link():
    """predict(): with flat routes (topo None) rows from another node of plan.topology still cross the
    slow link (once per receiving rank); hierarchical routes cross once per node, spread over its GPUs."""
    from megatron_cp.runtime.predict import predict
    from megatron_cp.runtime.schedule import _stage_ids, _stage_tiles

    work = Workload(32, 8, 128, 2)
    plan = mcp.plan(M.causal(8192), 4, topology=mcp.Topology(2, 2), solver="zigzag")
    traps = [rp.traps for rp in plan.ranks]
    flat_ids = _stage_ids(plan, 1, None)
    flat_tiles = _stage_tiles(plan, flat_ids, traps)
    slow, fast = CostModel.from_flat(dict(inter_gbps=1.0, intra_gbps=1e4)), CostModel.from_flat(dict(inter_gbps=1e4, intra_gbps=1e4))
    c_slow = predict(plan, flat_ids, flat_tiles, None, slow, work)["comm_s"][0]
    c_fast = predict(plan, flat_ids, flat_tiles, None, fast, work)["comm_s"][0]
    far = max(int(sum(1 for i in flat_ids[r][0] if plan.owner[np.searchsorted(plan.bounds, i, "right") - 1] // 2 != r // 2))
              for r in range(4))
    assert far > 0
    assert abs(c_slow - (slow.links.latency_us * 1e-6 + far * work.kv_bytes_per_token / 1e9)) < 1e-9
    assert c_fast < c_slow / 100
    hier_ids = _stage_ids(plan, 1, plan.topology)
    c_hier = predict(plan, hier_ids, _stage_tiles(plan, hier_ids, traps), plan.topology, slow, work)["comm_s"][0]
    assert c_hier < c_slow  # one crossing per node, shared by its 2 GPUs


def test_short_row_class_uses_its_own_fit():
    """A list whose mean kept keys per covered row is below the kernels' LONG_ROW_KEYS runs the backend's
    short-row block shapes: the model then uses the short-row peak and half-efficiency keys (when
    calibrated)."""
    from megatron_cp.kernels.triton.backend import LONG_ROW_KEYS
    from megatron_cp.kernels.pieces import covered_rows

    base = dict(fwd_tflops=400.0, bwd_tflops=300.0, half_keys=200.0, tile_us=0.0, launch_us=0.0,
                dense_fwd_tflops=0.0)
    plain = CostModel.from_flat(dict(**base))
    fitted = CostModel.from_flat(dict(**base, short_fwd_tflops=500.0, short_bwd_tflops=450.0, short_half_keys=100.0))
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


def test_short_and_blocky_classes_count_visited_blocks():
    """Calibrated short / blocky classes: time = (visited block cells + half_keys x rows) / peak, with the
    class's forward blocks (backward: bwd_block); a mostly-full short list takes the blocky numbers."""
    w = Workload(8, 2, 64, 2)
    pf = 4.0 * 8 * 64
    m = CostModel.from_flat(dict(fwd_tflops=400.0, bwd_tflops=300.0, half_keys=200.0, tile_us=0.0, launch_us=0.0, dense_fwd_tflops=0.0,
                  short_fwd_tflops=300.0, short_bwd_tflops=250.0, short_half_keys=100.0, short_bwd_half_keys=150.0,
                  blocky_fwd_tflops=450.0, blocky_bwd_tflops=350.0, blocky_half_keys=50.0))
    # block-diagonal 512-blocks on 4096 rows: every 128 x 64 block full -> blocky; visited == kept cells
    bd = np.array([[i, i + 512, i, i + 512, 0] for i in range(0, 4096, 512)])
    assert m.row_class(bd) == "blocky"
    assert m.tile_time(bd, w) == pytest.approx(pf * (4096 * 512 + 50.0 * 4096) / 450e12)
    assert m.tile_time(bd, w, True) == pytest.approx(pf * (4096 * 512 + 50.0 * 4096) / (350e12 / 2.5))  # no bwd half: fwd's
    # a 100-key band (causal window): mostly partial blocks -> short; costs its visited 64 x 64 blocks
    win = clip_tiles(M.sliding_window(4096, 100, 0).traps, None, [[0, 4096]])
    area = float(tile_areas(win)[0].sum())
    assert m.row_class(win) == "short"
    vis = float(block_counts(win, 64, 64)[0].sum()) * 64 * 64
    assert vis > 1.5 * area
    assert m.tile_time(win, w) == pytest.approx(pf * (vis + 100.0 * 4096) / 300e12)
    assert m.tile_time(win, w, True) == pytest.approx(pf * (vis + 150.0 * 4096) / (250e12 / 2.5))
    # without a blocky fit the block-diagonal list takes the short numbers; without a short fit, the long ones
    no_blocky = CostModel.from_flat(dict(**{**m.flat(), "blocky_fwd_tflops": 0.0}))
    assert no_blocky.row_class(bd) == "short"
    plain = CostModel.from_flat(dict(**{**m.flat(), "short_fwd_tflops": 0.0}))
    assert plain.row_class(win) == "long"


def test_blocky_bands_run_at_their_own_peaks():
    """A blocky list mostly of band cells (a 2048-key sliding window) takes blocky_band_* peaks with the
    blocky half terms and blocks; documents keep the blocky peaks; uncalibrated (0): the blocky numbers."""
    w = Workload(8, 2, 64, 2)
    pf = 4.0 * 8 * 64
    m = CostModel.from_flat(dict(tile_us=0.0, launch_us=0.0, dense_fwd_tflops=0.0, short_fwd_tflops=300.0, short_bwd_tflops=250.0,
                  short_half_keys=100.0, blocky_fwd_tflops=450.0, blocky_bwd_tflops=350.0, blocky_half_keys=50.0,
                  blocky_bwd_half_keys=80.0, blocky_band_fwd_tflops=480.0, blocky_band_bwd_tflops=400.0))
    win = clip_tiles(M.sliding_window(16384, 2048, 0).traps, None, [[0, 16384]])
    area, n_rows = float(tile_areas(win)[0].sum()), 16384
    assert m.row_class(win) == "blocky"
    assert (win[:, 4] == 3).any() and tile_areas(win[win[:, 4] == 3])[0].sum() >= 0.5 * area
    vf = float(block_counts(win, 128, 64)[0].sum()) * 128 * 64
    vb = float(block_counts(win, 64, 64)[0].sum()) * 64 * 64
    assert m.tile_time(win, w) == pytest.approx(pf * (vf + 50.0 * n_rows) / 480e12)
    assert m.tile_time(win, w, True) == pytest.approx(pf * (vb + 80.0 * n_rows) / (400e12 / 2.5))
    off = CostModel.from_flat(dict(**{**m.flat(), "blocky_band_fwd_tflops": 0.0, "blocky_band_bwd_tflops": 0.0}))
    assert off.tile_time(win, w) == pytest.approx(pf * (vf + 50.0 * n_rows) / 450e12)
    assert off.tile_time(win, w, True) == pytest.approx(pf * (vb + 80.0 * n_rows) / (350e12 / 2.5))
    bd = np.array([[i, i + 512, i, i + 512, 0] for i in range(0, 4096, 512)])
    assert m.tile_time(bd, w) == pytest.approx(off.tile_time(bd, w))


def test_dense_pieces_cost_per_row_and_key_column():
    """Dense pieces: cells + dense_half_keys x rows + dense_half_rows x keys at the dense peak."""
    w = Workload(8, 2, 64, 2)
    pf = 4.0 * 8 * 64
    base = dict(tile_us=0.0, launch_us=0.0, dense_fwd_tflops=600.0, dense_bwd_tflops=500.0, dense_piece_us=0.0,
                dense_min_rows=512, dense_min_keys=1024, hbm_gbps=1e30, band_squares=0)
    m = CostModel.from_flat(dict(**base, dense_half_keys=300.0, dense_half_rows=100.0, dense_bwd_half_keys=700.0, dense_bwd_half_rows=50.0))
    for r, k in ((512, 8192), (4096, 1024)):
        t = np.array([[0, r, 0, k, 0]])
        assert m.tile_time(t, w) == pytest.approx(pf * (r * k + 300.0 * r + 100.0 * k) / 600e12)
        assert m.tile_time(t, w, True) == pytest.approx(pf * (r * k + 700.0 * r + 50.0 * k) / (500e12 / 2.5))
        # a key split: each call runs 1 / split of the keys (the per-row term stays)
        assert m.tile_time(t, w) == pytest.approx(m.tile_time(np.array([[0, r, 0, k * 2, 0]]), w, key_split=2))


def test_band_squares_cost_forward_only():
    """Forward: a band of w >= band_squares keys and rows costs its cuDNN squares (a reversed one: flips
    and a shared merge pass; a full rectangle when the window is wider than the rows) plus its tail rows
    on Triton; backward: the band on Triton as with band_squares 0."""
    w = Workload(8, 2, 64, 2)
    pf = 4.0 * 8 * 64
    hbm = 2000.0
    m = CostModel.from_flat(dict(tile_us=0.0, launch_us=0.0, dense_fwd_tflops=600.0, dense_bwd_tflops=500.0,
                  dense_causal_fwd_tflops=400.0, dense_piece_us=5.0, dense_min_rows=512, dense_min_keys=10**9,
                  hbm_gbps=hbm, band_squares=1024))
    off = CostModel.from_flat(dict(**{**m.flat(), "band_squares": 0}))
    # w = 2048, 4096 + 100 rows: 2 chunks of 2048 (reversed + causal squares), 100 tail rows on Triton
    band = np.array([[0, 4196, 0, 4196 + 2048, 3]])
    tail = np.array([[4096, 4196, 4096, 4196 + 2048, 3]])
    causal_cells = 2 * 2048 * 2049 / 2
    elems = 4096 * 8 * 64
    flips = 6.0 * elems + 8.0 * 4096 * 2 * 64  # q rows (4 bytes) + its merge share (2), K/V span flipped
    t_sq = 2 * pf * causal_cells / 400e12 + 2 * 5e-6 + (flips + 10.0 * elems) / (hbm * 1e9)
    assert m.tile_time(band, w, accumulate=True) == pytest.approx(t_sq + off.tile_time(tail, w))
    # the tail's rows are not the pairs': written directly, the pair's merge moves 4 bytes, not 10
    assert _pieces(band, min_rows=512, min_keys=10**9, band_squares=1024, forward=True).direct
    t_direct = t_sq - 6.0 * elems / (hbm * 1e9)
    assert m.tile_time(band, w) == pytest.approx(t_direct + off.tile_time(tail, w))
    # another tile on the pairs' rows: accumulated, as the backend does
    other = np.array([[0, 4196, 0, 4196 + 2048, 3], [100, 200, 9000, 9100, 0]])
    assert not _pieces(other, min_rows=512, min_keys=10**9, band_squares=1024, forward=True).direct
    assert m.tile_time(other, w) == pytest.approx(m.tile_time(other, w, accumulate=True))
    assert m.tile_time(band, w, True) == pytest.approx(off.tile_time(band, w, True))
    assert m.rest_tiles(band).tolist() == tail.tolist() and m.rest_tiles(band, True).tolist() == band.tolist()
    # window wider than the rows (C = 1500 rows): reversed square, a 1500 x 1548 rectangle, causal square
    wide = np.array([[0, 1500, 0, 1500 + 3048, 3]])
    (rows, keys, cells, causal, batch, rev), rest, _ = m.dense.pieces(wide, False, 1)
    assert rows.tolist() == [1500] * 3 and keys.tolist() == [1500, 1548, 1500] and batch.tolist() == [1, 1, 1]
    assert causal.tolist() == [True, False, True] and rev.tolist() == [True, False, False]
    assert float(cells.sum()) == float(tile_areas(wide)[0].sum())
    assert len(rest) == 0
    # below the threshold (rows or window): unchanged
    for t in ([[0, 1000, 0, 1000 + 2048, 3]], [[0, 4096, 0, 4096 + 1000, 3]]):
        assert m.tile_time(np.array(t), w) == pytest.approx(off.tile_time(np.array(t), w))


def test_cost_file_without_band_squares_predates_them(tmp_path):
    """A calibration file (flat fields) without band_squares was measured on a backend that ran bands on Triton: it
    loads as 0 (the forward prices bands on Triton); a file with the field keeps its value."""
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    raw = CostModel().flat()
    assert raw["band_squares"] == CostModel().dense.band_squares == 4096
    new.write_text(json.dumps(raw))
    del raw["band_squares"]
    old.write_text(json.dumps(raw))
    assert CostModel.load(str(old)).dense.band_squares == 0 and CostModel.load(str(new)).dense.band_squares == 4096
    band = np.array([[0, 32768, 0, 32768 + 4096, 3]])
    w = Workload()
    assert CostModel.load(str(old)).tile_time(band, w) != CostModel.load(str(new)).tile_time(band, w)


def test_rates_nest_by_backend_and_row_class_and_read_flat_calibration_files(tmp_path):
    """The rates live in groups (triton per row class, dense, links, memory, call); save writes them nested and
    load reads that back equal; a calibration file of flat fields (the committed benchmarks' cost.json) loads with
    every value where its name says (short_fwd_tflops -> triton.short.fwd_tflops, band_squares -> dense), the
    fields it lacks at their defaults; replace changes one rate and keeps the rest; unknown fields are refused."""
    import glob

    from megatron_cp.runtime.cost import flat_names

    m = CostModel()
    assert m.triton.short.fwd_tflops == 0.0 and m.triton.blocky.block_m == 128 and m.dense.fwd_tflops == 680.0
    names = flat_names()
    assert names["short_fwd_tflops"] == ("triton", "short", "fwd_tflops")
    assert names["blocky_band_bwd_tflops"] == ("triton", "blocky", "band_bwd_tflops")
    assert names["band_squares"] == ("dense", "band_squares") and names["dense_grid_heads"] == ("dense", "grid", "heads")
    assert names["call_fwd_us"] == ("call", "fwd_us") and names["latency_us"] == ("links", "latency_us")
    files = sorted(glob.glob(str(ROOT / "benchmarks" / "*" / "cost*.json")))
    assert files
    for f in files:
        raw = json.load(open(f))
        loaded = CostModel.load(f)
        got = loaded.flat()
        for k, v in raw.items():
            if k in names:
                assert got[k] == (tuple(v) if isinstance(v, list) else v), (f, k)
        path = tmp_path / "nested.json"
        loaded.save(str(path))
        assert isinstance(json.loads(path.read_text())["triton"]["blocky"], dict)
        assert CostModel.load(str(path)) == loaded and hash(CostModel.load(str(path))) == hash(loaded)
    r = m.replace(triton={"blocky": {"fwd_tflops": 7.0}}, links={"latency_us": 1.0})
    assert (r.triton.blocky.fwd_tflops, r.triton.blocky.block_m, r.links.latency_us) == (7.0, 128, 1.0)
    assert r.triton.short == m.triton.short and r.dense == m.dense and r != m
    assert CostModel.from_flat({"blocky_fwd_tflops": 7.0, "latency_us": 1.0}) == r
    with pytest.raises(ValueError, match=r"unknown cost-model fields \['warp'\] in triton.blocky"):
        m.replace(triton={"blocky": {"warp": 1}})
    with pytest.raises(ValueError, match=r"unknown cost-model fields \['warp_speed'\]"):
        CostModel.from_flat({"fwd_tflops": 1.0, "warp_speed": 9})


def _calibrate_tool():
    """tools/sim/calibrate.py loaded as a module."""
    return load_script("tools/sim/calibrate.py")


def test_calibrate_dry_run_writes_a_loadable_model(tmp_path):
    """tools/sim/calibrate.py on CPU with tiny sizes: every kernel field measured, the file loads back."""
    mod = _calibrate_tool()
    out = tmp_path / "cost.json"
    mod.main(["--dry-run", "--out", str(tmp_path)])
    m = CostModel.load(str(out))
    t = m.triton
    for f, v in {"long": (t.long.fwd_tflops, t.long.bwd_tflops), "short": (t.short.fwd_tflops, t.short.bwd_tflops),
                 "blocky": (t.blocky.fwd_tflops, t.blocky.bwd_tflops),
                 "blocky band": (t.blocky.band_fwd_tflops, t.blocky.band_bwd_tflops)}.items():
        assert all(0 < x < 1e4 for x in v), (f, v)
    assert m.launch_us > 0 and m.source.startswith("tools/sim/calibrate.py on 1 x cpu") and "timed held" in m.source
    assert m.memory.hbm_gbps > 0 and m.memory.hbm_gbps != CostModel().memory.hbm_gbps  # the passes' rate is measured too
    assert (m.triton.short.block_m, m.triton.blocky.block_m, m.triton.bwd_block_m) == (64, 128, 64)


def test_calibrate_check_dry_run_writes_a_row_per_call(tmp_path, capsys):
    """calibrate.py --check on CPU (causal, S = 1024, cp 4): a row per kernel call with its measured and predicted
    time per phase (finite, positive), the JSON written, one table row per implementation."""
    import json
    import math

    rows = _calibrate_tool().main(["--dry-run", "--check", "--masks", "causal", "--out", str(tmp_path)])
    assert rows and json.loads((tmp_path / "cost_check.json").read_text())["results"] == rows
    assert {"megatron_cp", "ring", "ulysses", "allgather"} <= {r["impl"] for r in rows}
    for r in rows:
        for k in ("fwd_ms", "bwd_ms", "fwd_pred_ms", "bwd_pred_ms"):
            assert math.isfinite(r[k]) and r[k] > 0, (k, r)
    out = capsys.readouterr().out
    assert "| mask | impl | calls | fwd meas / pred ms (ratio) |" in out and "| causal | ring |" in out


def test_calibrate_long_rows_recovers_the_model_parameters():
    """tools/sim/calibrate.py's long-row fit: given the forward times a model with known ``row_alone_tflops``
    and ``row_share`` predicts for its two lists, it finds those two values again."""
    mod = _calibrate_tool()
    w = Workload(32, 8, 128, 2)
    fitted = dict(short_fwd_tflops=460.0, short_bwd_tflops=300.0, short_half_keys=250.0, blocky_fwd_tflops=470.0,
                  blocky_bwd_tflops=320.0, blocky_half_keys=150.0, num_sms=132)
    truth = CostModel.from_flat(dict(**fitted, launch_us=0.0, tile_us=0.0, dense_fwd_tflops=0.0, row_alone_tflops=2.2, row_share=0.35))
    seen = []

    def timed(tiles, sq, sk, row_class=None):  # calibrate's timer: GPU time less the per-call launch
        t = np.array(tiles, dtype=np.int64)
        assert truth.row_class(t) == row_class == "blocky"
        seen.append(len(tiles))
        return truth.tile_time(t, w)

    got = mod.fit_long_rows(timed, fitted, w, 16384, tiny=False)
    assert len(seen) == 2
    assert got["row_alone_tflops"] == pytest.approx(2.2, rel=1e-3)
    assert got["row_share"] == pytest.approx(0.35, rel=1e-3)


def test_dense_pieces_pay_for_partial_waves():
    """With num_sms, a dense piece of few rows x heads forward (keys x heads backward) runs in whole waves:
    512 rows x 8 heads = 32 programs on 132 multiprocessors take as long as 132 would."""
    w8 = Workload(8, 8, 128, 2)
    base = dict(tile_us=0.0, launch_us=0.0, dense_fwd_tflops=600.0, dense_bwd_tflops=500.0, dense_piece_us=0.0,
                dense_min_rows=512, dense_min_keys=1024, hbm_gbps=1e30)
    flat, waves = CostModel.from_flat(dict(**base)), CostModel.from_flat(dict(**base, num_sms=132))
    narrow = np.array([[0, 512, 0, 65536, 0]])
    assert waves.tile_time(narrow, w8) == pytest.approx(flat.tile_time(narrow, w8) * 132 / 32)
    # backward: 512 key blocks x 8 = 4096 programs in 32 waves of 132
    assert waves.tile_time(narrow, w8, True) == pytest.approx(flat.tile_time(narrow, w8, True) * 32 * 132 / 4096)
    wide = np.array([[0, 128 * 33, 0, 65536, 0]])  # 33 x 8 = 264 programs: two whole waves
    assert waves.tile_time(wide, w8) == pytest.approx(flat.tile_time(wide, w8))
    assert float(waves.wave_efficiency(133 * 128, 1)) == pytest.approx(133 / 264)


def test_dense_grid_reads_measured_rates_for_full_pieces():
    """A calibrated grid gives full pieces the measured rate of their shape (exact on grid points,
    log-bilinear between, clamped outside); square causal pieces keep the peak model."""
    g = dict(dense_grid_rows=(512, 2048), dense_grid_keys=(8192, 32768), dense_grid_fwd_tflops=(300.0, 400.0, 500.0, 600.0),
             dense_grid_bwd_tflops=(200.0, 300.0, 400.0, 500.0), dense_grid_heads=32)
    m = CostModel.from_flat(dict(num_sms=0, **g))
    assert m.dense.grid.tflops(512, 8192) == pytest.approx(300.0) and m.dense.grid.tflops(2048, 32768, True) == pytest.approx(500.0)
    assert m.dense.grid.tflops(1024, 16384) == pytest.approx(450.0)  # half way in log2 both ways
    assert m.dense.grid.tflops(100000, 100) == pytest.approx(500.0)  # clamped: most rows, fewest keys
    w = Workload()
    full = np.array([[0, 2048, 0, 32768, 0]])
    t = m.tile_time(full, w) - m.launch_us * 1e-6 - m.dense.piece_us * 1e-6
    merge = 2048 * w.num_heads * w.head_dim * 10.0 / (m.memory.hbm_gbps * 1e9)
    assert t - merge == pytest.approx(w.fwd_flops(2048 * 32768) / 600e12, rel=1e-9)
    causal = np.array([[0, 16384, 0, 16384, 1]])
    assert m.tile_time(causal, w) == pytest.approx(CostModel.from_flat(dict(num_sms=0)).tile_time(causal, w), rel=1e-12)


def test_calibrate_fit_is_least_squares_with_nonnegative_terms():
    """tools/sim/calibrate.py's fit: exact through consistent points, a term the points contradict is 0."""
    mod = _calibrate_tool()
    peak, half = 500e12, 200.0
    pts = [([c, r], (c + half * r) / peak) for c, r in ((1e8, 1e4), (4e8, 1e4), (2e8, 5e4))]
    p, h = mod.linear_fit(pts, "t")
    assert p == pytest.approx(peak) and h[0] == pytest.approx(half)
    # longer rows slower per cell (a negative half term would fit): the half term is 0, the peak between
    pts = [([1e8, 1e4], 1e8 / 500e12), ([4e8, 1e4], 4e8 / 400e12)]
    p, h = mod.linear_fit(pts, "t")
    assert h == [0.0] and 400e12 < p < 500e12


def test_rest_tiles_are_what_the_dense_pieces_leave():
    """``rest_tiles``: the cells the backend's own kernels run, i.e. the list minus its dense pieces (by
    the backend's rule); everything when the model has no dense path."""
    import numpy as np

    tiles = np.array([[0, 1024, 0, 16384, 0], [1024, 1040, 0, 16, 0], [1040, 1104, 0, 64, 1]])
    m = CostModel.from_flat(dict(dense_fwd_tflops=600.0, dense_min_rows=512, dense_min_keys=8192))
    rest = m.rest_tiles(tiles)
    assert tile_areas(rest)[0].sum() == tile_areas(tiles[1:])[0].sum()
    assert rest[:, 0].min() >= 1024  # the 1024 x 16384 piece went dense
    assert np.array_equal(CostModel.from_flat(dict(dense_fwd_tflops=0.0)).rest_tiles(tiles), tiles)


def test_tile_time_is_remembered_by_content(monkeypatch):
    """A fresh plan's schedule choice prices the same tile lists once per candidate stage count and rank: the
    cost model remembers tile_time, the row class and block counts by the list's content (same value, no
    recount), and a list that differs in one value is priced anew."""
    from megatron_cp.planner import Workload
    from megatron_cp.runtime import CostModel
    from megatron_cp.runtime import rates as C

    tiles = np.array([[0, 64, 0, 64, 1], [64, 128, 0, 128, 1], [128, 200, 0, 50, 0]])
    model, work = CostModel(), Workload()
    first = model.tile_time(tiles, work)
    back = model.tile_time(tiles, work, backward=True)
    calls = []
    real = C.pieces.row_class
    monkeypatch.setattr(C.pieces, "row_class", lambda t: calls.append(len(t)) or real(t))
    assert model.tile_time(tiles.copy(), work) == first and model.tile_time(tiles, work, backward=True) == back
    assert model.tile_time(tiles, work, key_split=2) > 0  # another split: priced, its list's row class remembered
    assert calls == []
    other = tiles.copy()
    other[2, 1] = 190
    assert model.tile_time(other, work) != first and calls == [3]


@pytest.mark.parametrize("case", ["packed", "causal_slow_links", "sliding"])
def test_choose_schedule_builds_only_the_choice_it_returns(case):
    """choose_schedule prices the candidates before building a staged schedule: its answer is the one the
    full staged schedule and the single exchange's prediction give (None where the single exchange is no
    slower), and a staged answer is the schedule ``schedule(plan, None)`` builds, stage for stage."""
    from megatron_cp.runtime.predict import predict_single
    from megatron_cp.runtime.schedule import choose_schedule, schedule

    work = Workload(32, 8, 128, 2)
    plan, model = {
        "packed": (mcp.plan(M.varlen(list(range(0, 65536, 1000)) + [65536], causal=True), 4), CostModel()),
        "causal_slow_links": (mcp.plan(M.causal(65536), 4, solver="zigzag"), CostModel.from_flat(dict(intra_gbps=3.0, launch_us=5.0))),
        "sliding": (mcp.plan(M.sliding_window(32768, 4096), 4), CostModel.from_flat(dict(intra_gbps=30.0))),
    }[case]
    staged = schedule(plan, None, cost=model, work=work)
    single = predict_single(plan, model, work)
    n = staged.num_stages
    want_single = n == 0 or single["fwd_s"] + single["bwd_s"] <= staged.predicted["candidates"][n]
    got = choose_schedule(plan, None, model, work)
    if want_single:
        assert got is None
        return
    assert got.num_stages == n and got.active == staged.active
    assert got.predicted == staged.predicted
    for a, b in zip(got.ranks, staged.ranks):
        assert [np.array_equal(x.tiles, y.tiles) and x.buf_len == y.buf_len for x, y in zip(a, b)] == [True] * len(a)


def test_prebuild_chooses_the_exchange_the_attention_then_uses(monkeypatch):
    """runtime.prebuild makes the plan's exchange choice ahead (as a planning thread does); the attention's
    first call on that plan with inputs of the same workload uses it instead of choosing again, and a
    call with another workload chooses for itself."""
    import importlib

    from megatron_cp.runtime import state

    default_cost = importlib.import_module("megatron_cp.runtime.attention").DEFAULT_COST  # what attention() prices with
    plan = mcp.plan(M.varlen([0, 100, 256], causal=True), 2)
    calls = []
    real = state.choose_schedule
    monkeypatch.setattr(state, "choose_schedule", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    mcp.runtime.prebuild(plan, Workload(4, 2, 16, 4))
    assert calls == [Workload(4, 2, 16, 4)]
    q, k, v = (torch.randn(plan.num_local(0), h, 16) for h in (4, 2, 2))
    for r in (0, 1):  # every rank's state from the one choice (no group: cp_size 2 planned, rank given)
        state.rank_state(plan, r, torch.device("cpu"), mcp.kernels.get_backend("reference", "cpu"), "reference",
                         stages=None, hierarchical=True, cost=default_cost,
                         work=Workload(q.shape[1], k.shape[1], q.shape[2], q.element_size()))
    assert len(calls) == 1
    state.rank_state(plan, 0, torch.device("cpu"), mcp.kernels.get_backend("reference", "cpu"), "reference",
                     stages=None, hierarchical=True, cost=CostModel(), work=Workload(8, 2, 16, 2))
    assert calls == [Workload(4, 2, 16, 4), Workload(8, 2, 16, 2)]
    with pytest.raises(ValueError, match="work must be a megatron_cp.planner.Workload"):
        mcp.runtime.prebuild(plan, (4, 2, 16, 4))
    with pytest.raises(ValueError, match="cost_model must be a CostModel"):
        mcp.runtime.prebuild(plan, Workload(), cost_model="fast")


def test_the_state_of_a_packed_plan_makes_few_torch_calls():
    """The execution state of a fresh packed-document plan (8k tokens per rank, FA4 lists), which the plan's
    first attention call builds on the step's thread, calls torch at most a few hundred times (the counters of
    kernels.pieces are numpy for that; they made ~2000 torch calls per plan when they were torch)."""
    from torch.overrides import TorchFunctionMode

    from test_fa4_backend import EMULATED

    from megatron_cp.kernels import FA4Backend

    class Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    rng = np.random.default_rng(0)
    lengths = np.minimum(np.maximum(rng.lognormal(7.5, 1.0, 200).astype(int), 64), 16384)
    cuts = np.concatenate([[0], np.cumsum(lengths)])
    cuts = np.append(cuts[cuts < 32768], 32768)
    plan = mcp.plan(M.varlen(cuts.tolist(), causal=True), 4)
    from megatron_cp.runtime import state

    work = Workload(32, 8, 128, 2)
    mcp.runtime.prebuild(plan, work)  # the exchange choice, as a planning thread makes it
    with Count():
        state.rank_state(plan, 0, torch.device("cpu"), FA4Backend(functions=EMULATED), "fa4", stages=None,
                         hierarchical=True, cost=CostModel(), work=work)
    assert 0 < Count.n <= 400, Count.n


@pytest.mark.parametrize("seed", range(4))
def test_staged_floor_is_under_every_candidate(seed):
    """choose_schedule skips pricing the staged candidates when the single exchange is no slower than their
    floor: the floor is under every candidate's predicted time (so skipping never changes the answer), on
    random packed documents, causal and sliding-window plans under fast and slow links."""
    from megatron_cp.runtime import predict as P
    from megatron_cp.runtime import schedule as S

    rng = np.random.default_rng(seed)
    cuts = np.unique(np.concatenate([[0, 32768], rng.integers(1, 32768, size=int(rng.integers(2, 60)))]))
    work = Workload(32, 8, 128, 2)
    for mask in (M.varlen(cuts.tolist(), causal=True), M.causal(32768), M.sliding_window(32768, 2048)):
        for model in (CostModel(), CostModel.from_flat(dict(intra_gbps=3.0, launch_us=5.0))):
            plan = mcp.plan(mask, 4)
            one = S._stage_tiles(plan, S._stage_ids(plan, 1, None), [rp.traps for rp in plan.ranks])
            floor = P.staged_floor(plan, one, model, work)
            _, _, preds = S._priced(plan, model, work, None, one)
            assert preds and floor <= min(preds.values())
            single = P.predict_single(plan, model, work)
            staged = S.schedule(plan, None, cost=model, work=work)
            want_single = single["fwd_s"] + single["bwd_s"] <= staged.predicted["candidates"][staged.num_stages]
            got = S.choose_schedule(plan, None, model, work)
            assert (got is None) == want_single
            if got is not None:
                assert got.num_stages == staged.num_stages
