"""BlockKeep (per-head block selection) in the reference and Triton backends, forward and backward, against a
dense float64 reference written here: softmax over the cells a tile keeps AND the head's block mask selects.

Triton runs through its CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before triton is
imported); tiny shapes keep the file fast. Tolerances are those of tests/test_triton_kernels.py (float32:
1e-4 on out / lse, 4e-4 on gradients).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest.py, before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from megatron_cp.kernels import CAUSAL, FULL, INV_CAUSAL  # noqa: E402
from megatron_cp.kernels import KernelConfig, PhaseConfigs, ReferenceBackend, TritonBackend, TritonConfig  # noqa: E402
from megatron_cp.kernels.block_keep import BlockKeep  # noqa: E402
from megatron_cp.kernels.triton.blocks import build_schedules  # noqa: E402
from megatron_cp.kernels.triton.sparse import head_schedule, kernel_blocks, static_entries  # noqa: E402
from megatron_cp.masks.catalog import tiles_to_dense  # noqa: E402

SCALE = 0.5
ATOL32 = 1e-4  # tests/test_triton_kernels.py: out / lse; gradients 4x
ATOL64 = 1e-10  # the reference backend in float64 (its lse output is float32: held to LSE64)
LSE64 = 1e-6


def dense_reference(q, k, v, cells, dout, dlse=None):
    """(out, lse, dq, dk, dv) float64 of softmax attention over ``cells`` bool [Hq, sq, sk], loss
    sum(out * dout) + sum(lse * dlse) (rows that select nothing: out 0, lse -inf, zero gradients)."""
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    qd, dod = q.double(), dout.double()
    kk, vv = (x.double().repeat_interleave(g, 1) for x in (k, v))  # [sk, Hq, D]
    s = torch.einsum("qhd,khd->hqk", qd, kk) * SCALE
    s = s.masked_fill(~cells, float("-inf"))
    lse = torch.logsumexp(s, -1)  # [Hq, sq]
    empty = torch.isinf(lse)
    p = torch.exp(s - torch.where(empty, 0.0, lse)[..., None])  # 0 on masked cells and empty rows
    out = torch.einsum("hqk,khd->qhd", p, vv)
    delta = (dod * out).sum(-1).T  # [Hq, sq]
    if dlse is not None:
        delta = delta - dlse.double().T
    dp = torch.einsum("qhd,khd->hqk", dod, vv)
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, kk) * SCALE
    dk = torch.einsum("hqk,qhd->khd", ds, qd) * SCALE
    dv = torch.einsum("hqk,qhd->khd", p, dod)
    sk, d = k.shape[0], k.shape[2]
    dk = dk.reshape(sk, hkv, g, d).sum(2)
    dv = dv.reshape(sk, hkv, g, d).sum(2)
    return out, lse.T, dq, dk, dv


def selected_cells(tiles, sq, sk, keep):
    """bool [Hq, sq, sk]: cells some tile keeps and the head's block mask selects (built with torch)."""
    env = tiles_to_dense(tiles, sq, sk)
    return env[None] & keep.cells(torch.arange(sq), torch.arange(sk))


def random_mask(hq, nqb, nkb, seed, p=0.6):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(hq, nqb, nkb, generator=g) < p


def inputs(sq, sk, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    f = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return f(sq, hq, d), f(sk, hkv, d), f(sk, hkv, d), f(sq, hq, d), f(sq, hq).float()


def small_triton(bm=16, bn=16, d=16, tma=False):
    """Kernel blocks smaller than the keep block (several kernel blocks per selected block)."""
    c = KernelConfig(bm, bn, 4, 1, tma)
    return TritonBackend(TritonConfig({d: PhaseConfigs(c, KernelConfig(bn, bm, 4, 1, tma), c)}))


def check(be, tiles, sq, sk, mask, block, hq=2, hkv=1, d=16, with_dlse=False, given_delta=False, seed=0):
    """Forward and backward of ``be`` with BlockKeep(mask, block) against dense_reference; returns the
    backend's (out, lse, dq, dk, dv) and its inputs."""
    ref = isinstance(be, ReferenceBackend)
    dtype, atol = (torch.float64, ATOL64) if ref else (torch.float32, ATOL32)
    tiles = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 5)
    q, k, v, dout, dlse = inputs(sq, sk, hq, hkv, d, dtype, seed)
    dlse = dlse if with_dlse else None
    keep = BlockKeep(mask, block)
    prep = be.prepare(tiles, sq, sk) if ref else be.prepare(tiles, sq, sk, head_dims=(d,))
    out, lse = be.forward(q, k, v, prep, SCALE, keep=keep)
    cells = selected_cells(tiles, sq, sk, keep)
    r_out, r_lse, r_dq, r_dk, r_dv = dense_reference(q, k, v, cells, dout, dlse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = ~cells.any(-1).T  # [sq, Hq]
    assert torch.equal(lse == float("-inf"), empty), "lse = -inf exactly on rows that select nothing"
    assert (out[empty] == 0).all()
    torch.testing.assert_close(out.double(), r_out, atol=atol, rtol=0)
    torch.testing.assert_close(lse[~empty].double(), r_lse[~empty], atol=LSE64 if ref else atol, rtol=0)
    delta = None
    if with_dlse or given_delta:
        delta = (dout * out).sum(-1)  # float64 for the reference backend, float32 for Triton
        if dlse is not None:
            delta = delta - dlse.to(delta.dtype)
    # the reference backend computes in float64 from any lse it is given: the exact one lets its gradients
    # be held to ATOL64 (its own lse output is rounded to float32)
    lse_b = r_lse if ref else lse
    dq, dk, dv = be.backward(q, k, v, out, lse_b, dout, prep, SCALE, delta, keep=keep)
    for name, a, b in (("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
        assert a.dtype == dtype and not torch.isnan(a).any(), name
        torch.testing.assert_close(a.double(), b, atol=atol * 4, rtol=0, msg=lambda m: f"{name}: {m}")
    return (out, lse, dq, dk, dv), (q, k, v, dout, prep, keep, delta, empty)


BACKENDS = {"reference": lambda: ReferenceBackend(block_q=24, block_k=40), "triton": TritonBackend,
            "triton16": small_triton}


# -- the cases: every backend against the dense fp64 reference --------------------------------------
@pytest.mark.parametrize("name", list(BACKENDS))
def test_causal_tile(name):
    sq = sk = 128
    check(BACKENDS[name](), [[0, sq, 0, sk, CAUSAL]], sq, sk, random_mask(2, 4, 4, 1), 32)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_packed_documents(name):
    # documents end inside selection blocks: tiles and blocks cut each other
    cu = [0, 40, 64, 100, 128]
    tiles = [[a, b, a, b, CAUSAL] for a, b in zip(cu[:-1], cu[1:])]
    check(BACKENDS[name](), tiles, 128, 128, random_mask(2, 4, 4, 2, 0.7), 32, hq=2, hkv=2)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_gqa_per_head_masks(name):
    # Hq 4 over Hkv 2: the two q heads of a kv group select different key blocks (dK/dV sum both lists);
    # several tiles share rows (global keys + causal + an inv_causal corner)
    tiles = [[0, 128, 0, 8, FULL], [8, 128, 8, 128, CAUSAL], [0, 8, 8, 64, INV_CAUSAL]]
    mask = random_mask(4, 2, 2, 3, 0.7)
    mask[0, :, 0] = True
    mask[1, :, 0] = False  # head 1 drops the global keys' block, its group partner keeps it
    check(BACKENDS[name](), tiles, 128, 128, mask, 64, hq=4, hkv=2)


def test_gqa_asymmetric_blocks_tma():
    # block_m != block_n (dK/dV's q blocks differ from dQ's) and tensor-descriptor loads
    tiles = [[0, 100, 0, 100, CAUSAL], [100, 128, 0, 128, FULL]]
    mask = random_mask(4, 2, 2, 12, 0.7)
    mask[2, 1] = False
    check(small_triton(32, 16, tma=True), tiles, 128, 128, mask, 64, hq=4, hkv=2)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_empty_heads_and_rows(name):
    # head 0 selects nothing; head 2 selects nothing for q block 1; unequal lengths (ragged last blocks)
    sq, sk = 112, 80
    mask = random_mask(4, 4, 3, 4)
    mask[0] = False
    mask[2, 1] = False
    mask[3, :, 0] = True
    (out, lse, dq, dk, dv), (*_, empty) = check(BACKENDS[name](), [[0, sq, 0, sk, FULL]], sq, sk, mask, 32,
                                                hq=4, hkv=2)
    assert empty[:, 0].all() and empty[32:64, 2].all()
    assert (dq[:, 0] == 0).all() and (dq[32:64, 2] == 0).all()


@pytest.mark.parametrize("name", list(BACKENDS))
def test_lse_gradient(name):
    tiles = [[0, 64, 0, 64, CAUSAL], [64, 128, 0, 128, FULL]]
    mask = random_mask(2, 4, 4, 5)
    mask[1, 3] = False  # rows that select nothing get a dlse too: no gradient may come of it
    check(BACKENDS[name](), tiles, 128, 128, mask, 32, with_dlse=True)


@pytest.mark.parametrize("name", ["reference", "triton"])
def test_delta_given_equals_none(name):
    # delta = rowsum(dout * out) given, or None (the backend computes it): the same gradients
    be = BACKENDS[name]()
    sq = 96
    _, (q, k, v, dout, prep, keep, delta, _) = check(
        be, [[0, sq, 0, sq, CAUSAL]], sq, sq, random_mask(2, 3, 3, 6), 32, given_delta=True)
    out, lse = be.forward(q, k, v, prep, SCALE, keep=keep)
    g_given = be.backward(q, k, v, out, lse, dout, prep, SCALE, delta, keep=keep)
    g_none = be.backward(q, k, v, out, lse, dout, prep, SCALE, None, keep=keep)
    for a, b in zip(g_given, g_none):
        torch.testing.assert_close(a, b, atol=ATOL32 * 4 if q.dtype == torch.float32 else ATOL64, rtol=0)


# -- keep=None is today's path; the selection is validated ----------------------------------------
@pytest.mark.parametrize("name", ["reference", "triton"])
def test_keep_none_and_all_selected_match_dense(name):
    be = BACKENDS[name]()
    dtype = torch.float64 if name == "reference" else torch.float32
    sq = 96
    tiles = torch.tensor([[0, sq, 0, sq, CAUSAL]], dtype=torch.int32)
    q, k, v, dout, _ = inputs(sq, sq, 4, 2, 16, dtype, 7)
    prep = be.prepare(tiles, sq, sq) if name == "reference" else be.prepare(tiles, sq, sq, head_dims=(16,))
    base = be.forward(q, k, v, prep, SCALE)
    none = be.forward(q, k, v, prep, SCALE, keep=None)
    assert all(torch.equal(a, b) for a, b in zip(base, none))
    g_base = be.backward(q, k, v, *base, dout, prep, SCALE)
    g_none = be.backward(q, k, v, *base, dout, prep, SCALE, None, keep=None)
    assert all(torch.equal(a, b) for a, b in zip(g_base, g_none))
    # selecting every block computes exactly the dense list: the same kernels over the same entries
    keep = BlockKeep(torch.ones(4, 3, 3, dtype=torch.bool), 32)
    full = be.forward(q, k, v, prep, SCALE, keep=keep)
    assert all(torch.equal(a, b) for a, b in zip(base, full))
    g_full = be.backward(q, k, v, *base, dout, prep, SCALE, None, keep=keep)
    assert all(torch.equal(a, b) for a, b in zip(g_base, g_full))


@pytest.mark.parametrize("name", ["reference", "triton"])
def test_wrong_shape_raises(name):
    be = BACKENDS[name]()
    sq = 64
    tiles = torch.tensor([[0, sq, 0, sq, CAUSAL]], dtype=torch.int32)
    dtype = torch.float64 if name == "reference" else torch.float32
    q, k, v, dout, _ = inputs(sq, sq, 2, 1, 16, dtype, 8)
    prep = be.prepare(tiles, sq, sq) if name == "reference" else be.prepare(tiles, sq, sq, head_dims=(16,))
    bad = BlockKeep(torch.ones(2, 2, 3, dtype=torch.bool), 32)
    with pytest.raises(ValueError, match=r"\(2, 2, 2\)"):
        be.forward(q, k, v, prep, SCALE, keep=bad)
    out, lse = be.forward(q, k, v, prep, SCALE)
    with pytest.raises(ValueError, match=r"\(2, 2, 2\)"):
        be.backward(q, k, v, out, lse, dout, prep, SCALE, None, keep=bad)
    with pytest.raises(ValueError, match="bool"):
        be.forward(q, k, v, prep, SCALE, keep=BlockKeep(torch.ones(2, 2, 2), 32))


def test_triton_keep_block_not_a_multiple_of_16_raises():
    be = TritonBackend()
    sq = 48
    tiles = torch.tensor([[0, sq, 0, sq, CAUSAL]], dtype=torch.int32)
    q, k, v, _, _ = inputs(sq, sq, 2, 1, 16, torch.float32, 9)
    prep = be.prepare(tiles, sq, sq, head_dims=(16,))
    with pytest.raises(ValueError, match="BlockKeep.block=24"):
        be.forward(q, k, v, prep, SCALE, keep=BlockKeep(torch.ones(2, 2, 2, dtype=torch.bool), 24))


@pytest.mark.parametrize("name", ["reference", "triton"])
def test_no_tiles_with_keep(name):
    be = BACKENDS[name]()
    dtype = torch.float64 if name == "reference" else torch.float32
    q, k, v, dout, _ = inputs(40, 64, 2, 1, 16, dtype, 13)
    tiles = torch.zeros(0, 5, dtype=torch.int32)
    prep = be.prepare(tiles, 40, 64) if name == "reference" else be.prepare(tiles, 40, 64, head_dims=(16,))
    keep = BlockKeep(torch.ones(2, 2, 2, dtype=torch.bool), 32)
    out, lse = be.forward(q, k, v, prep, SCALE, keep=keep)
    assert (out == 0).all() and (lse == float("-inf")).all()
    grads = be.backward(q, k, v, out, lse, dout, prep, SCALE, None, keep=keep)
    assert all((g == 0).all() for g in grads)


def test_kernel_blocks_shrink_to_divide_the_keep_block():
    assert kernel_blocks(128, 64, 128) == (128, 64)
    assert kernel_blocks(128, 128, 64) == (64, 64)
    assert kernel_blocks(32, 32, 48) == (16, 16)
    with pytest.raises(ValueError, match="BlockKeep.block=40"):
        kernel_blocks(32, 32, 40)


def test_triton_backward_deterministic_with_keep():
    be = TritonBackend()
    (_, _, *g1), (q, k, v, dout, prep, keep, _, _) = check(
        be, [[0, 96, 0, 96, CAUSAL]], 96, 96, random_mask(4, 3, 3, 10), 32, hq=4, hkv=2)
    out, lse = be.forward(q, k, v, prep, SCALE, keep=keep)
    g2 = be.backward(q, k, v, out, lse, dout, prep, SCALE, None, keep=keep)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


# -- the per-head schedule builder against a direct filter on the host ---------------------------
@pytest.mark.parametrize("rows", [True, False])
def test_head_schedule_filters_each_block_list(rows):
    cu = [0, 40, 64, 100, 128]
    tiles = torch.tensor([[a, b, a, b, CAUSAL] for a, b in zip(cu[:-1], cu[1:])] + [[64, 128, 0, 16, FULL]],
                         dtype=torch.int32)
    bm, bn, block = 16, 32, 64
    r, c = build_schedules(tiles, 128, 128, bm, bn)
    sched = r if rows else c
    mask = random_mask(3, 2, 2, 11, 0.5)
    mask[1] = False
    hs = head_schedule(static_entries(sched, bm if rows else bn, block, 2, rows, "cpu"), mask)
    nb = sched.mid.shape[1]
    assert hs.ptr.stride(0) == hs.mid.stride(0) == hs.order.stride(0) and hs.mid.shape == (3, nb)
    for h in range(3):
        assert sorted(hs.order[h].tolist()) == list(range(nb))
        for b in range(nb):
            e0, mid, e1 = sched.ptr[0, b].item(), sched.mid[0, b].item(), sched.ptr[0, b + 1].item()
            want_full, want_part = [], []
            for e in range(e0, e1):
                off = sched.off[0, e].item()
                qb, kb = ((b * bm) // block, off // block) if rows else (off // block, (b * bn) // block)
                if mask[h, qb, kb]:
                    (want_full if e < mid else want_part).append((off, sched.tile[0, e].item()))
            p0, pm, p1 = hs.ptr[h, b].item(), hs.mid[h, b].item(), hs.ptr[h, b + 1].item()
            got = list(zip(hs.off[h, p0:p1].tolist(), hs.tile[h, p0:p1].tolist()))
            assert got == want_full + want_part and pm - p0 == len(want_full)
    if not rows:
        assert hs.work.n_slots == 0 and sorted(hs.work.n.tolist()) == list(range(nb))
