"""Split long q blocks in the forward and dQ kernels (triton_schedule.RowWork) on CPU through Triton's
interpreter, against the dense fp64 reference of test_triton_kernels.

Masks with a few dense rows (global + local, star, a dense row range inside a block, a wide dense range)
make some q blocks meet every k block while the others meet a handful; a small ``row_split_min`` forces
those blocks into segments (asserted through the RowWork fields). Checked: out / lse / dq / dk / dv
against the reference, the accumulating forward (fp32 and q-dtype running out), rows with nothing kept
(out 0, lse -inf, dq 0, never NaN), GQA 4:1, TMA loads, split vs unsplit runs, and bitwise-identical
repeated runs. Tiny shapes: the interpreter is slow.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest.py, before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from megatron_cp.kernels import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL  # noqa: E402
from megatron_cp.kernels import triton_backend as tb  # noqa: E402
from megatron_cp.kernels.triton_backend import KernelConfig, StageConfigs, TritonBackend, TritonConfig  # noqa: E402
from megatron_cp.kernels.triton_schedule import build_schedules, row_work  # noqa: E402
from test_triton_kernels import dense_mask, reference  # noqa: E402  (tests/ is on sys.path: conftest.py)

ATOL = 1e-4  # test_triton_kernels.run_case's fp32 tolerance (gradients at 4x)
SCALE = 0.5
NO_SPLIT = 1 << 30


def global_local(s, g=16, w=16):
    """Longformer-like, bidirectional: q < g or k < g or |q - k| <= w, as cell-disjoint tiles at block
    granularity w (s, g multiples of w; the layout of tools/_kernel_masks.py's global_local)."""
    t = [[0, g, 0, s, FULL]]
    for q0 in range(g, s, w):
        q1 = q0 + w
        t.append([q0, q1, 0, g, FULL])
        if q0 - w >= g:
            t.append([q0, q1, q0 - w, q0, INV_CAUSAL])
        t.append([q0, q1, q0, q1, FULL])
        if q1 < s:
            t.append([q0, q1, q1, q1 + w, CAUSAL])
    return t


def star(s, g=16):
    """g global rows see every key, every row sees the g global keys, plus a causal diagonal of g-row
    chunks: the dense rows' blocks meet every k block, the others two."""
    t = [[0, g, 0, s, FULL]]
    for q0 in range(g, s, g):
        t += [[q0, q0 + g, 0, g, FULL], [q0, q0 + g, q0, q0 + g, CAUSAL]]
    return t


def dense_rows_in_a_block(s=150):
    """Rows 70..74 see every key (inside q block 4 of 16 rows); rows 64..69 and 100..103 see nothing;
    the others: causal chunks of 16 rows plus 8 sink keys. s not a multiple of 16 (partial last block)."""
    bounds = [0, 16, 32, 48, 64, 70, 75, 80, 96, 100, 104, 112, 128, 144, s]
    t = [[70, 75, 0, s, FULL]]
    for a, b in zip(bounds[:-1], bounds[1:]):
        if (a, b) in ((64, 70), (100, 104), (70, 75)):
            continue
        t.append([a, b, a, b, CAUSAL])
        if a >= 16:
            t.append([a, b, 0, 8, FULL])
    return t


def backend(d=16, bm=16, bn=16, tma=False, row_split_min=2, dq_row_split=True):
    # dq_row_split on (the library default is off, by measurement) so the split dQ kernels stay tested
    c = KernelConfig(bm, bn, 4, 1, tma)
    return TritonBackend(TritonConfig({d: StageConfigs(c, KernelConfig(bn, bm, 4, 1, tma), c)},
                                      row_split_min=row_split_min, dq_row_split=dq_row_split))


def inputs(sq, sk, hq, hkv, d, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return (torch.randn(sq, hq, d, dtype=dtype), torch.randn(sk, hkv, d, dtype=dtype),
            torch.randn(sk, hkv, d, dtype=dtype), torch.randn(sq, hq, d, dtype=dtype))


def row_split(prep, bm=16, bn=16):
    return prep.schedules(bm, bn, "cpu")[1].work


def run(be, prep, q, k, v, dout):
    out, lse = be.forward(q, k, v, prep, SCALE)
    delta = (dout.float() * out.float()).sum(-1)
    dq, dk, dv = be.backward(q, k, v, out, lse, dout, prep, SCALE, delta)
    return out, lse, dq, dk, dv


def check(tiles, sq, sk, hq=2, hkv=1, d=16, bm=16, bn=16, tma=False, min_segments=2):
    """Split run against the fp64 reference and against the unsplit run; returns the split results."""
    q, k, v, dout = inputs(sq, sk, hq, hkv, d)
    t = torch.tensor(tiles, dtype=torch.int32)
    be = backend(d, bm, bn, tma)
    prep = be.prepare(t, sq, sk, head_dims=(d,))
    w = row_split(prep, bm, bn)
    assert w.n_slots > 0 and int(w.nseg.max()) >= min_segments, "the dense rows' q blocks must be split"
    res = run(be, prep, q, k, v, dout)
    out, lse, dq, dk, dv = res
    keep = dense_mask(t, sq, sk)
    r_out, r_lse, r_dq, r_dk, r_dv = reference(q, k, v, keep, SCALE, dout)
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), res):
        assert not torch.isnan(x).any(), name
    empty = ~keep.any(1)
    assert torch.equal(torch.isinf(lse), empty[:, None].expand_as(lse)), "lse = -inf exactly on empty rows"
    assert (out[empty] == 0).all() and (dq[empty] == 0).all()
    torch.testing.assert_close(out.double(), r_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse[~empty].double(), r_lse[~empty], atol=ATOL, rtol=0)
    for name, a, b in (("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
        torch.testing.assert_close(a.double(), b, atol=ATOL * 4, rtol=0, msg=lambda m: f"{name}: {m}")
    # the same problem unsplit: the kernels of before; dK/dV does not depend on the row split at all
    be0 = backend(d, bm, bn, tma, row_split_min=NO_SPLIT)
    prep0 = be0.prepare(t, sq, sk, head_dims=(d,))
    assert row_split(prep0, bm, bn).n_slots == 0
    out0, lse0 = be0.forward(q, k, v, prep0, SCALE)
    # backward from the split run's out / lse: dK/dV (which the row split does not touch) bitwise equal
    dq0, dk0, dv0 = be0.backward(q, k, v, out, lse, dout, prep0, SCALE, (dout * out).sum(-1))
    for name, a, b in (("out", out, out0), ("lse", lse, lse0), ("dq", dq, dq0)):
        fin = torch.isfinite(b)
        assert torch.equal(fin, torch.isfinite(a)), name
        torch.testing.assert_close(a[fin], b[fin], atol=2e-6, rtol=0, msg=lambda m: f"{name}: {m}")
    assert torch.equal(dk, dk0) and torch.equal(dv, dv0)
    return be, prep, (q, k, v, dout), res


# -- schedule --------------------------------------------------------------------------------------
def test_row_work_segments_cover_each_block_once():
    counts = torch.tensor([40, 3, 3, 0, 4, 3, 25, 3, 2, 3])
    ptr = torch.zeros(len(counts) + 1, dtype=torch.int64)
    ptr[1:] = torch.cumsum(counts, 0)
    mid = ptr[:-1] + counts // 2  # the first half of each block's entries full
    w = row_work(ptr, mid, min_segment=4)
    mean = float(counts.float().mean())  # 8.6 -> segments of 2 * mean + 1 = 18 entries at most
    assert w.n_slots == 3 + 2 and w.red_m.tolist() == [0, 6] and w.red_nseg.tolist() == [3, 2]
    assert w.red_slot0.tolist() == [0, 3]
    seen = {}
    for i, (m, seg, nseg, slot) in enumerate(zip(w.m.tolist(), w.seg.tolist(), w.nseg.tolist(), w.slot.tolist())):
        p0, p1 = int(ptr[m]), int(ptr[m + 1])
        e0, e1 = p0 + (p1 - p0) * seg // nseg, p0 + (p1 - p0) * (seg + 1) // nseg
        assert (int(w.e0[0, i]), int(w.e1[0, i])) == (e0, e1)
        assert int(w.e_mid[0, i]) == min(max(int(mid[m]), e0), e1)
        assert e1 - e0 <= max(4, int(2 * mean) + 1)
        seen.setdefault(m, []).append((e0, e1, slot))
        if nseg == 1:
            assert slot == -1
        else:
            i = w.red_m.tolist().index(m)
            assert slot == int(w.red_slot0[i]) + seg
    for m in range(len(counts)):  # every entry exactly once
        spans = sorted(seen[m])
        assert spans[0][0] == int(ptr[m]) and spans[-1][1] == int(ptr[m + 1])
        assert all(a[1] == b[0] for a, b in zip(spans[:-1], spans[1:]))
    per_item = [int(counts[m]) / n for m, n in zip(w.m.tolist(), w.nseg.tolist())]
    assert per_item == sorted(per_item, reverse=True), "heaviest items first"
    # equally heavy split blocks: segment-major (segment 0 of each block, then segment 1, ...)
    w2 = row_work(torch.tensor([0, 30, 60, 62, 64, 66, 68]), torch.tensor([0, 30, 60, 62, 64, 66]), min_segment=4)
    assert list(zip(w2.m.tolist(), w2.seg.tolist()))[:4] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_default_threshold_splits_global_rows_not_causal_or_windows():
    # default row_split_min (128): the tools' global_local mask at S=16k with 64-row blocks is split...
    s = 16384
    rows, _ = build_schedules(torch.tensor(global_local(s, 512, 512), dtype=torch.int32), s, s, 64, 64)
    assert rows.work.n_slots == 16 and rows.work.red_m.tolist() == list(range(8))
    # ... but not causal, nor a sliding window
    rows, _ = build_schedules(torch.tensor([[0, s, 0, s, CAUSAL]], dtype=torch.int32), s, s, 64, 64)
    assert rows.work.n_slots == 0
    w = 1024
    t = [[0, w, 0, w, CAUSAL]] + [x for q0 in range(w, s, w) for x in
                                  ([q0, q0 + w, q0, q0 + w, CAUSAL], [q0, q0 + w, q0 - w, q0, INV_CAUSAL])]
    rows, _ = build_schedules(torch.tensor(t, dtype=torch.int32), s, s, 64, 64)
    assert rows.work.n_slots == 0


def test_unsplit_lists_launch_the_unsplit_kernels(monkeypatch):
    monkeypatch.setattr(tb, "attn_fwd_split_kernel", None)
    monkeypatch.setattr(tb, "attn_bwd_dq_split_kernel", None)
    t = [[0, 48, 0, 48, CAUSAL]]
    q, k, v, dout = inputs(48, 48, 2, 1, 16)
    be = backend(row_split_min=16)
    prep = be.prepare(torch.tensor(t, dtype=torch.int32), 48, 48, head_dims=(16,))
    assert row_split(prep).n_slots == 0
    run(be, prep, q, k, v, dout)


# -- kernels ---------------------------------------------------------------------------------------
def test_global_local_split():
    check(global_local(256), 256, 256, hq=2, hkv=1, min_segments=2)


def test_star_three_segments_gqa():
    # 16 k blocks for the global rows' block, 2 for the others: 3 segments; 4 q heads on 1 kv head
    check(star(256), 256, 256, hq=4, hkv=1, min_segments=3)


@pytest.mark.parametrize("tma", [False, True])
def test_dense_rows_inside_a_block_with_empty_rows(tma):
    # the split q block also holds rows that keep nothing (out 0, lse -inf after the merge)
    check(dense_rows_in_a_block(), 150, 150, hq=2, hkv=2, tma=tma)


def test_unequal_lengths_dense_rows():
    # 40 q rows over 200 keys: rows 16..20 see every key, the rest a causal band + sinks
    t = [[0, 16, 0, 16, CAUSAL], [16, 21, 0, 200, FULL], [21, 40, 21, 40, CAUSAL], [21, 40, 0, 8, FULL]]
    check(t, 40, 200, hq=2, hkv=1)


def test_deterministic():
    be, prep, (q, k, v, dout), a = check(star(256), 256, 256, hq=2, hkv=1)
    b = run(be, prep, q, k, v, dout)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype,running", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                           (torch.float16, torch.float16)])
def test_accumulate_two_split_stages(dtype, running):
    # the global rows' tile in two halves, one per stage, so both stages split; plus rows no stage keeps
    s = 320
    t = global_local(s)
    t = [[0, 16, 0, s // 2, FULL], [0, 16, s // 2, s, FULL]] + [x for x in t[1:] if x[0] < 288]
    stages = [t[0::2], t[1::2]]
    q, k, v, _ = inputs(s, s, 2, 1, 16, dtype)
    be = backend()
    preps = [be.prepare(torch.tensor(x, dtype=torch.int32), s, s, head_dims=(16,)) for x in stages]
    assert all(row_split(p).n_slots > 0 for p in preps), "both stages must split"
    out = torch.zeros(s, 2, 16, dtype=running)
    lse = torch.full((s, 2), float("-inf"))
    for p in preps:
        be.forward_accumulate(q, k, v, p, SCALE, out, lse)
    keep = dense_mask(torch.tensor(t, dtype=torch.int32), s, s)
    r_out, r_lse = reference(q, k, v, keep, SCALE)
    empty = ~keep.any(1)
    assert empty.any() and not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), empty[:, None].expand_as(lse))
    assert (out[empty] == 0).all()
    atol = ATOL if dtype == torch.float32 and running == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), r_out, atol=atol, rtol=0)
    torch.testing.assert_close(lse[~empty].double(), r_lse[~empty], atol=atol, rtol=0)
    # the same stages unsplit: close (exact arithmetic differs only in the segment merge)
    be0 = backend(row_split_min=NO_SPLIT)
    out0 = torch.zeros(s, 2, 16, dtype=running)
    lse0 = torch.full((s, 2), float("-inf"))
    for x in stages:
        be0.forward_accumulate(q, k, v, be0.prepare(torch.tensor(x, dtype=torch.int32), s, s, head_dims=(16,)),
                               SCALE, out0, lse0)
    tol = 2e-6 if running == torch.float32 and dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), out0.float(), atol=tol, rtol=0)
    fin = ~empty
    torch.testing.assert_close(lse[fin], lse0[fin], atol=tol, rtol=0)


def test_dq_row_split_off_by_default_runs_the_unsplit_dq(monkeypatch):
    """The default config splits the forward but not dQ (measured slower); results still exact."""
    assert TritonConfig().dq_row_split is False
    calls = []
    real = tb.attn_bwd_dq_kernel

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    monkeypatch.setattr(tb, "attn_bwd_dq_split_kernel", None)  # would raise if launched
    monkeypatch.setattr(tb, "attn_bwd_dq_kernel", Spy())
    sq = sk = 96
    tiles = torch.tensor([[0, 16, 0, 96, FULL], [16, 96, 16, 96, BI_CAUSAL]], dtype=torch.int32)
    be = backend(dq_row_split=False)
    q, k, v = torch.randn(sq, 2, 16), torch.randn(sk, 1, 16), torch.randn(sk, 1, 16)
    do = torch.randn(sq, 2, 16)
    prep = be.prepare(tiles, sq, sk)
    c = be.config.for_head_dim(16, prep.row_class, q.dtype).dq
    assert prep.schedules(c.block_m, c.block_n, q.device)[1].work.n_slots > 0  # the rows do split
    out, lse = be.forward(q, k, v, prep, 0.5)
    dq, dk, dv = be.backward(q, k, v, out, lse, do, prep, 0.5)
    assert calls, "the unsplit dQ kernel did not run"
    _, _, dq_r, dk_r, dv_r = reference(q, k, v, dense_mask(tiles, sq, sk), 0.5, do)
    for a, b in ((dq, dq_r), (dk, dk_r), (dv, dv_r)):
        assert (a.double() - b).abs().max() < 4e-4
