"""Guest rows (planner.guests, runtime.guests): query rows computed where their keys live.

Planner: which rows become guests, exact cover of the mask by main and guest cells, loads that count
guest cells at the key owner, less traffic for global + local. Runtime: both paths (single exchange,
staged) with automatic and explicit guest rows against the fp64 dense reference, forward
and backward (with and without an LSE gradient), fully masked guest rows, cp 1 / 2 / 4.
"""

from __future__ import annotations

import numpy as np
import pytest

import megatron_cp as mcp
from megatron_cp import masks as M
from megatron_cp.masks import geometry
from megatron_cp.planner import guests
from megatron_cp.testing import run_ranks

from test_attention_dist import _case, _check, random_mask


def _computed_cells(plan) -> int:
    """Cells the plan's tiles cover, main and guest, over all ranks."""
    return sum(_tile_area(t) for rp in plan.ranks for t in rp.tiles.tolist() + rp.guest_tiles.tolist())


def _tile_area(t) -> int:
    q0, q1, k0, k1, kind = t
    tr = geometry.slice_to_trap(q0, q1, k0, k1, kind)
    return 0 if tr is None else geometry.traps_area(np.asarray([tr], dtype=np.int64))


def _dense(traps, s):
    return geometry.traps_to_dense(np.asarray(traps, dtype=np.int64).reshape(-1, 6), s, s)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_global_rows_become_guests_and_cut_traffic(cp):
    s = 65536
    mask = M.global_local(s, 512, 1, 1)
    with_g, without = mcp.plan(mask, cp), mcp.plan(mask, cp, guest_rows="none")
    assert with_g.guest_runs.tolist() == [[0, 512]] and not without.has_guests
    a, b = with_g.stats(), without.stats()
    # without guests the rank(s) holding the 512 global rows need nearly every key
    assert b["max_remote_kv_tokens"] >= s * (cp - 1) // cp - 512
    assert a["max_remote_kv_tokens"] * 20 <= b["max_remote_kv_tokens"], (a, b)
    assert a["imbalance"] <= 0.03
    assert sum(a["guest_rows_in_per_rank"]) == 512 * (cp - 1)
    # loads are the cells computed
    assert sum(a["area_per_rank"]) == with_g.mask_area == _computed_cells(with_g)
    for rp in with_g.ranks:
        assert rp.area == sum(_tile_area(t) for t in rp.tiles.tolist()) + sum(_tile_area(t) for t in rp.guest_tiles.tolist())


def test_small_masks_keep_their_global_rows():
    """Below ~15k key tokens saved the guest path's fixed cost (two calls, five collectives) wins."""
    mask = M.global_local(4096, 64, 1, 1)
    p = mcp.plan(mask, 4)
    assert not p.has_guests and any(k.endswith("+guests") for k in p.candidates)  # considered, declined
    assert mcp.plan(mask, 4, guest_rows=[[0, 64]]).has_guests


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_guest_plans_cover_the_mask_exactly(cp):
    s = 4096
    mask = M.global_local(s, 64, 1, 1)
    p = mcp.plan(mask, cp, guest_rows=[[0, 64]])
    assert np.array_equal(_dense(p.computed_traps(), s), mask.to_dense())
    assert sum(r.area for r in p.ranks) == p.mask_area == _computed_cells(p)
    assert p.stats()["max_remote_kv_tokens"] <= 3 * 64


@pytest.mark.parametrize("name", ["full", "causal", "sliding", "packed", "prefix_lm", "strided"])
def test_no_guests_where_rows_are_many_or_short(name):
    s = 2048
    mask = {"full": M.full(s), "causal": M.causal(s), "sliding": M.sliding_window(s, 128, 0),
            "packed": M.varlen([0, 700, 1200, s], causal=True), "prefix_lm": M.prefix_lm(s, 1500),
            "strided": M.strided(s, 4, 64)}[name]
    assert len(guests.candidate_rows(geometry.row_area_prefix(mask.traps, s), s, 4)) == 0
    assert not mcp.plan(mask, 4).has_guests


def test_explicit_guest_rows_tile_the_mask_on_random_masks():
    for seed in range(40):
        mask = random_mask(seed)
        s = mask.seqlen_q
        rng = np.random.default_rng(seed)
        a = int(rng.integers(0, s - 3))
        runs = [[a, a + 2]] + ([[a + 3, min(s, a + 7)]] if seed % 2 else [])
        for cp in (2, 3):
            p = mcp.plan(mask, cp, guest_rows=runs)
            assert p.guest_runs.tolist() == runs
            assert np.array_equal(_dense(p.computed_traps(), s), mask.to_dense()), (seed, cp)
            assert sum(r.area for r in p.ranks) == p.mask_area == _computed_cells(p), (seed, cp)
            # a guest row is sent exactly to the ranks owning keys it keeps
            dense = mask.to_dense()
            owner = np.repeat(p.owner, np.diff(p.bounds))
            for rp in p.ranks:
                for dst, runs_d in enumerate(rp.guest_send_runs):
                    for q0, q1 in runs_d.tolist():
                        for q in range(q0, q1):
                            assert owner[q] == rp.rank and dense[q][owner == dst].any()
            assert p.digest != mcp.plan(mask, cp, guest_rows="none").digest


def test_guest_row_errors():
    mask = M.causal(32)
    with pytest.raises(ValueError, match=r"guest row run 0 = \(5, 5\)"):
        mcp.plan(mask, 2, guest_rows=[[5, 5]])
    with pytest.raises(ValueError, match=r"run 1 = \(3, 8\) starts before"):
        mcp.plan(mask, 2, guest_rows=[[0, 4], [3, 8]])
    with pytest.raises(ValueError, match=r"outside \[0, 32\)"):
        mcp.plan(mask, 2, guest_rows=[[30, 40]])
    with pytest.raises(ValueError, match="guest_rows must be"):
        mcp.plan(mask, 2, guest_rows="always")


def test_pair_rows_and_units():
    s = 256
    mask = M.global_local(s, 16, 1, 1)
    p = mcp.plan(mask, 4, guest_rows=[[0, 16]])
    M_ = guests.pair_rows(p.guest_traps, p.bounds, p.owner, 4)
    # each of the 16 global rows keeps every key: it is computed on all 4 ranks
    owner = np.repeat(p.owner, np.diff(p.bounds))
    assert M_.sum(1).tolist() == [4 * int((owner[:16] == r).sum()) for r in range(4)]
    assert M_.sum(0).tolist() == [16] * 4
    u = guests.traffic_units(M_)
    to_key, to_row = guests.row_bytes(mcp.planner.Workload())
    key = 2 * mcp.planner.Workload().kv_bytes_per_token
    for r in range(4):
        assert u[r] == pytest.approx(((16 - M_[r, r]) * to_key + (M_[r].sum() - M_[r, r]) * to_row) / key)


def _guest_cases(rank, world):
    res = {}
    explicit = {"global_local_8": (M.global_local(96, 4, 2, 1), [[0, 8]]),"global_local": (M.global_local(53, 4, 1, 1), [[0, 4]]),
                "global_local_causal": (M.global_local(61, 4, 2, 1, causal=True), [[0, 8]]),
                "star": (M.star(53, 8, 6), [[0, 8]])}
    cases = [(n, m, r) for n, (m, r) in explicit.items()]
    for name, mask, rows in cases:
        for kw in ({"stages": 0}, {"stages": 1}, {"stages": 2}):
            for lse_grad in (False, True):
                res[(name, str(kw), lse_grad)] = _case(rank, world, mask, 4, 2, with_lse_grad=lse_grad,
                                                       guest_rows=rows, **kw)
    for seed in range(4):  # explicit guest rows on random masks (some rows fully masked, some guests too)
        mask = random_mask(seed)
        s = mask.seqlen_q
        runs = [[1, 4], [s // 2, s // 2 + 3]]
        for kw in ({"stages": 0}, {"stages": 1}):
            res[("random", seed, str(kw))] = _case(rank, world, mask, 4, 2, with_lse_grad=seed % 2 == 0,
                                                   guest_rows=runs, **kw)
    # a guest row with no kept key at all: out 0, lse -inf, no NaN (checked inside _case)
    empty_row = mcp.AttnMask([mcp.AttnSlice((0, 3), (0, 40), "full"), mcp.AttnSlice((4, 40), (0, 40), "causal")], 40, 40)
    res[("masked guest row",)] = _case(rank, world, empty_row, 4, 2, guest_rows=[[2, 6]], with_lse_grad=True)
    return res


@pytest.mark.parametrize("world", [1, 2, 4])
def test_guest_rows_match_fp64_reference(world):
    _check(run_ranks(_guest_cases, world))


def test_guest_rows_on_the_triton_backend():
    pytest.importorskip("triton")
    _check(run_ranks(_triton_guest_cases, 2))


def _triton_guest_cases(rank, world):
    from test_attention_dist import _case_backend

    mask = M.global_local(96, 4, 2, 1)
    plan = mcp.plan(mask, world, guest_rows=[[0, 8]])
    return {("triton", st): _case_backend(rank, world, mask, plan, "triton", stages=st) for st in (0, 1)}


def test_guest_fixed_cost_is_the_cost_models_default():
    """The planner prices the guest path's fixed time with the default calibration's figures (it may not
    import the runtime's cost model): they must be the same numbers."""
    from megatron_cp.planner import LINKS
    from megatron_cp.runtime import CostModel

    c = CostModel()
    assert guests.GUEST_LAUNCH_US == c.launch_us
    assert (LINKS.intra_gbps, LINKS.inter_gbps, LINKS.latency_us) == (c.links.intra_gbps, c.links.inter_gbps, c.links.latency_us)
    assert (mcp.Topology(2, 2).intra_node_gbps, mcp.Topology(2, 2).inter_node_gbps) == (c.links.intra_gbps, c.links.inter_gbps)
    w = mcp.planner.Workload()
    want = (2 * c.launch_us + 5 * c.links.latency_us) * 1e-6 * c.links.intra_gbps * 1e9 / (2 * w.kv_bytes_per_token)
    assert guests.fixed_units(w) == pytest.approx(want)


@pytest.mark.parametrize("d", [16, 24])  # a power of two and not (the kernel pads the head dim)
def test_the_guest_rows_merge_kernel_matches_the_torch_merge(d):
    """kernels.merge.merge_sources: the one-launch merge of every source's partial into the guest rows (Triton under
    the CPU interpreter) against the torch ops it replaces on a GPU: rows some sources kept and others did not, a
    row and a head no source kept (0 / -inf), an lse that is a transposed view (FA4's head-major lse), and the rows
    outside ``rows`` untouched."""
    import torch

    from megatron_cp.kernels.merge import merge_sources

    g = torch.Generator().manual_seed(0)
    k, n, hq, s = 3, 5, 20, 9
    parts = torch.randn(k, n, hq, d + 1, generator=g)
    parts[..., :d] /= 3
    parts[1, 2, :, d] = float("-inf")  # a source without row 2
    parts[:, 3, :, d] = float("-inf")  # row 3: no source kept a cell
    parts[:, 4, 7, d] = float("-inf")  # row 4, head 7 likewise
    parts[parts[..., d] == float("-inf")] = torch.cat([torch.zeros(d), torch.tensor([float("-inf")])])
    rows = torch.tensor([8, 0, 5, 2, 6])
    got = {}
    for use_triton in (False, True):
        out = torch.full((s, hq, d), 7.0, dtype=torch.bfloat16)
        lse = torch.full((hq, s), 7.0).t()  # head-major storage, [s, hq] view
        merge_sources(out, lse, rows, parts, use_triton=use_triton)
        got[use_triton] = out.float(), lse.clone()
    (o0, l0), (o1, l1) = got[False], got[True]
    assert torch.allclose(l0, l1, atol=1e-6, rtol=0) and torch.equal(l0.isinf(), l1.isinf())
    assert (o0 - o1).abs().max() <= 2 ** -8 * o0.abs().max()  # bf16 rounding of fp32 sums that may differ in order
    assert (o1[2] == 0).all() and (l1[2] == float("-inf")).all()  # parts' row 3 is local row rows[3] = 2
    assert (o1[6, 7] == 0).all() and l1[6, 7] == float("-inf") and (l1[6, :7] > float("-inf")).all()
    untouched = [r for r in range(s) if r not in rows.tolist()]
    assert (o1[untouched] == 7).all() and (l1[untouched] == 7).all()
    lse0 = torch.logsumexp(parts[:, 0, :, d], dim=0)  # parts' row 0 (local row 8) by hand
    out0 = (parts[:, 0, :, :d] * torch.exp(parts[:, 0, :, d] - lse0).unsqueeze(-1)).sum(0)
    # one bf16 step: Triton's CPU interpreter truncates fp32 -> bf16 where a GPU rounds (tests/test_rowmap.py)
    assert torch.allclose(l1[8], lse0, atol=1e-6) and torch.allclose(o1[8], out0, atol=2 ** -7 * out0.abs().max())


def _bf16_guest_cases(rank, world):
    from reference import bf16_errors

    out = {}
    for name, mask, rows in (("global_local", M.global_local(96, 4, 2, 1), [[0, 8]]),
                             ("star", M.star(53, 8, 6), [[0, 8]])):
        plan = mcp.plan(mask, world, guest_rows=rows)
        assert plan.has_guests
        for st in (0, 1):
            out.update({(name, st, tag): e for tag, e in bf16_errors(rank, world, mask, plan, stages=st).items()})
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_guest_rows_in_bf16_within_twice_plain_bf16_error(world):
    """Guest rows' partials travel in q's dtype as the kernel wrote them (bf16 here) and merge at the owner in fp32:
    out, dq, dk, dv within the 2x rule of a plain bf16 dense PyTorch run, on both exchange paths."""
    from reference import assert_bf16

    for r in run_ranks(_bf16_guest_cases, world):
        for key, e in r.items():
            assert_bf16({key[2]: e}, key[:2])
