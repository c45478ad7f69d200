"""FA4Backend with a BlockKeep (per-head block-sparse FA4 calls, kernels/fa4/sparse.py) on the CPU: the
calls run through the reference of FA4's call semantics (tests/fa4_semantics.py, per-head block lists
included) and are compared with a dense float64 reference of the tile list AND the per-head block mask,
forward and backward (with an lse gradient); the fallbacks to Triton's keep path with their reasons; the
per-call list builder reads no device value on the host. GPU check: tools/gpu_kernel_check.py --parts sparse."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

import fa4_semantics
from megatron_cp.kernels import CAUSAL, FULL, BlockKeep, FA4Backend, TritonConfig
from megatron_cp.kernels.fa4 import sparse as fa4_sparse
from megatron_cp.kernels.fa4.backend import Fa4Functions
from megatron_cp.masks.catalog import tiles_to_dense
from megatron_cp.testing import reference_attention

SPARSE_PATH = "fa4 (per-head block-sparse)"


class Recorder:
    """EMULATED FA4 functions that record each call's block-sparse lists."""

    def __init__(self):
        self.calls = []

    def _wrap(self, name, f):
        def g(*a, **kw):
            self.calls.append((name, kw.get("block_sparse_tensors")))
            return f(*a, **kw)
        return g

    def functions(self) -> Fa4Functions:
        return Fa4Functions(self._wrap("fwd", fa4_semantics.fwd), self._wrap("bwd", fa4_semantics.bwd), "reference",
                            (torch.float64,), fa4_semantics.block_sparse, fa4_semantics.interval_masks(),
                            fa4_semantics.band_mask)


def _inputs(sq, sk, hq=4, hkv=2, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(sq, hq, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(sk, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    dl = torch.randn(sq, hq, generator=g, dtype=torch.float64)
    return (*(t.to(dtype) for t in (q, k, v, do)), dl)


def _causal(s):
    return torch.tensor([[0, s, 0, s, CAUSAL]], dtype=torch.int32)


def _docs(lengths):
    """Packed documents, causal inside each (boundaries off the 128-grid: partial off-diagonal blocks)."""
    b = np.concatenate([[0], np.cumsum(lengths)])
    return torch.tensor([[a, e, a, e, CAUSAL] for a, e in zip(b[:-1], b[1:])], dtype=torch.int32)


def _rank_list():
    """A planner-style rank list, sq != sk: 256 own rows against a 512-key buffer (a full rectangle of
    earlier keys, then the causal diagonal)."""
    return torch.tensor([[0, 256, 0, 256, FULL], [0, 256, 256, 512, CAUSAL]], dtype=torch.int32)


def _keep(hq, sq, sk, block, seed, density=0.5):
    """A random per-head block mask with every pattern the kernels must get right: one head selecting
    nothing, one q block of another head selecting nothing, the rest random."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(hq, -(-sq // block), -(-sk // block), generator=g) < density
    m[1] = False  # a head with nothing selected: out 0, lse -inf, zero gradients
    m[2, 0] = False  # a q block of head 2 with nothing selected
    m[3, -1] = True  # a q block of head 3 with everything selected
    return BlockKeep(m, block)


def _check(tiles, sq, sk, keep, dlse, seed=0, hkv=2):
    """FA4Backend(keep) with emulated FA4 against the dense fp64 reference of tiles & keep; one FA4 call per
    direction with per-query-head lists."""
    rec = Recorder()
    be = FA4Backend(functions=rec.functions())
    prep = be.prepare(tiles, sq, sk)
    hq = keep.mask.shape[0]
    q, k, v, do, dl = _inputs(sq, sk, hq=hq, hkv=hkv, seed=seed)
    scale = 0.3
    cells = tiles_to_dense(tiles, sq, sk)[None] & keep.cells(torch.arange(sq), torch.arange(sk))  # [Hq, sq, sk]
    o_ref, l_ref, dq_ref, dk_ref, dv_ref = reference_attention(q, k, v, cells, scale, dout=do,
                                                               dlse=dl if dlse else None)
    out, lse = be.forward(q, k, v, prep, scale, keep=keep)
    assert be.last_path == SPARSE_PATH, be.last_path
    torch.testing.assert_close(out, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, l_ref, rtol=1e-10, atol=1e-10)  # -inf where a row keeps nothing
    assert not out.isnan().any() and not lse.isnan().any()
    empty = ~cells.any(-1).t()  # [sq, Hq]
    assert bool((out[empty] == 0).all()) and bool((lse[empty] == float("-inf")).all())
    delta = ((do * o_ref).sum(-1) - dl) if dlse else None
    dq, dk, dv = be.backward(q, k, v, o_ref, l_ref, do, prep, scale, delta, keep=keep)
    assert be.last_path == SPARSE_PATH, be.last_path
    for got, want in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    # one call per direction, per-query-head lists (heads axis = Hq, not Hkv and not broadcast)
    assert [c[0] for c in rec.calls] == ["fwd", "bwd"], rec.calls
    m, n = -(-sq // 128), -(-sk // 128)
    (_, fl), (_, bl) = rec.calls
    assert tuple(fl.mask_cnt.shape) == (1, hq, m) and tuple(fl.full_idx.shape) == (1, hq, m, n)
    assert tuple(bl.mask_cnt.shape) == (1, hq, n) and tuple(bl.full_idx.shape) == (1, hq, n, m)
    assert fl.block_size == bl.block_size == (128, 128)
    return be, prep


@pytest.mark.parametrize("block", [128, 256])
def test_causal_gqa(block):
    s = 512
    _check(_causal(s), s, s, _keep(4, s, s, block, seed=block), dlse=True)


@pytest.mark.parametrize("block,dlse", [(128, False), (256, True)])
def test_packed_documents(block, dlse):
    """Document boundaries inside 128-blocks: partial blocks masked by the rows' intervals / band."""
    s = 768
    tiles = _docs([200, 320, 248])
    _check(tiles, s, s, _keep(4, s, s, block, seed=7), dlse=dlse, seed=1)


def test_two_intervals_per_row():
    """Sink keys [0, 60) for the rows of documents 2 and 3: their rows keep two key intervals on partial
    blocks (the two-interval mask_mod, aux bounds [sq, 4])."""
    s = 768
    tiles = torch.cat([_docs([200, 320, 248]), torch.tensor([[200, 768, 0, 60, FULL]], dtype=torch.int32)])
    static = fa4_sparse.sparse_static(tiles.numpy(), s, s)
    assert static.blocks.band is None and static.blocks.intervals == 2
    _check(tiles, s, s, _keep(4, s, s, 128, seed=9), dlse=True, seed=2)


def test_rank_list_mha_and_ragged_keep_block():
    """sq != sk (a rank's rows against its key buffer), Hq = Hkv, keep.block 256 over 384 rows: the last
    keep block holds one 128-block (trimmed when expanded)."""
    tiles = _rank_list()
    _check(tiles, 256, 512, _keep(4, 256, 512, 256, seed=3), dlse=True, hkv=4)
    tiles = torch.tensor([[0, 384, 0, 384, CAUSAL]], dtype=torch.int32)
    _check(tiles, 384, 384, _keep(4, 384, 384, 256, seed=4), dlse=False)


def test_all_selected_equals_the_list():
    """A selection of every block gives the list's own attention (the non-sparse FA4 path)."""
    s = 512
    tiles = _docs([300, 212])
    keep = BlockKeep(torch.ones(4, 4, 4, dtype=torch.bool), 128)
    be, prep = _check(tiles, s, s, keep, dlse=False)
    q, k, v, *_ = _inputs(s, s)
    o1, l1 = be.forward(q, k, v, prep, 0.3, keep=keep)
    o2, l2 = be.forward(q, k, v, prep, 0.3)
    torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(l1, l2, rtol=1e-10, atol=1e-10)


def test_empty_list():
    """A list keeping no cell: no FA4 call, out 0, lse -inf, zero gradients."""
    rec = Recorder()
    be = FA4Backend(functions=rec.functions())
    prep = be.prepare(torch.zeros(0, 5, dtype=torch.int32), 256, 256)
    q, k, v, do, _ = _inputs(256, 256)
    keep = BlockKeep(torch.ones(4, 2, 2, dtype=torch.bool), 128)
    out, lse = be.forward(q, k, v, prep, keep=keep)
    assert (out == 0).all() and (lse == float("-inf")).all() and not rec.calls
    for g in be.backward(q, k, v, out, lse, do, prep, keep=keep):
        assert (g == 0).all()


def test_lists_match_a_naive_build():
    """The device builder's lists against a plain Python construction from the same masks."""
    s = 768
    static = fa4_sparse.sparse_static(_docs([200, 320, 248]).numpy(), s, s)
    keep = _keep(4, s, s, 256, seed=11)
    m = static.classes.shape[0]
    sel = keep.mask.repeat_interleave(2, 1).repeat_interleave(2, 2)[:, :m, :m].numpy()
    for direction in ("fwd", "bwd"):
        mc, mi, fc, fi = head_lists = fa4_sparse.head_lists(static, keep, direction)
        assert all(t.dtype == torch.int32 for t in head_lists)
        cls = static.classes if direction == "fwd" else static.classes.T
        for h in range(4):
            sh = sel[h] if direction == "fwd" else sel[h].T
            for r in range(m):
                for cnt, idx, val in ((mc, mi, 1), (fc, fi, 2)):
                    want = [j for j in range(m) if sh[r, j] and cls[r, j] == val]
                    assert int(cnt[0, h, r]) == len(want)
                    assert idx[0, h, r, :len(want)].tolist() == want
                    assert (idx[0, h, r, len(want):] == 0).all()  # padding


class _NoHostSync:
    """Makes every way of reading a tensor's value on the host raise (what would synchronise on a GPU)."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "cpu", "any",
             "all", "unique")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}
        self.saved_fn = {n: getattr(torch, n) for n in ("nonzero", "unique", "where")}

        def boom(name):
            def f(*a, **kw):
                raise AssertionError(f"host read: Tensor.{name}")
            return f
        for n in self.NAMES:
            setattr(torch.Tensor, n, boom(n))
        torch.nonzero = boom("torch.nonzero")
        torch.unique = boom("torch.unique")
        where = self.saved_fn["where"]

        def where_3(cond, *a, **kw):  # torch.where(cond) alone is nonzero
            if not a:
                raise AssertionError("host read: torch.where(cond)")
            return where(cond, *a, **kw)
        torch.where = where_3
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)
        for n, f in self.saved_fn.items():
            setattr(torch, n, f)


def test_lists_are_built_without_host_reads():
    """After the static part is cached, the per-call lists use torch ops only: no .item(), .tolist(),
    bool/int of a tensor, nonzero, .cpu() or .numpy() (each raises here), and no Python loop over blocks."""
    s = 768
    for tiles, block in ((_docs([200, 320, 248]), 256), (_causal(s), 128)):
        static = fa4_sparse.sparse_static(tiles.numpy(), s, s)
        keep = _keep(4, s, s, block, seed=5)
        rec = Recorder()
        static.on(keep.mask.device)  # the static part's one host -> device copy
        with _NoHostSync():
            for direction in ("fwd", "bwd"):
                kw = fa4_sparse.call_kwargs(static, keep, direction, rec.functions())
        assert kw["block_sparse_tensors"].mask_idx.shape == (1, 4, 6, 6)
    for f in (fa4_sparse.expand_keep, fa4_sparse.packed_lists, fa4_sparse.head_lists, fa4_sparse.call_kwargs):
        src = inspect.getsource(f)
        assert "for " not in src and "while " not in src, f.__name__


class StubTriton:
    """Stands in for the Triton backend (its keep path is tested with the Triton kernels): records the
    calls and answers with the dense reference."""

    def __init__(self):
        self.calls = []
        self.last_configs = []

    def prepare(self, tiles, sq, sk, head_dims=()):
        return ("prepared", tiles, sq, sk)

    def forward(self, q, k, v, prepared, softmax_scale=None, keep=None):
        self.calls.append(("fwd", keep))
        _, tiles, sq, sk = prepared
        cells = tiles_to_dense(tiles, sq, sk)[None] & keep.cells(torch.arange(sq), torch.arange(sk))
        o, l = reference_attention(q, k, v, cells, softmax_scale)[:2]
        return o.to(q.dtype), l.float()

    def backward(self, q, k, v, out, lse, dout, prepared, softmax_scale=None, delta=None, keep=None):
        self.calls.append(("bwd", keep))
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def _fallback(tiles, s, keep, dtype=torch.float64, d=8, deterministic=False):
    rec = Recorder()
    be = FA4Backend(TritonConfig(deterministic=deterministic), functions=rec.functions())
    be.triton = StubTriton()
    prep = be.prepare(tiles, s, s, head_dims=(d,))
    q, k, v, do, _ = _inputs(s, s, d=d, dtype=dtype)
    out, lse = be.forward(q, k, v, prep, keep=keep)
    fwd_path = be.last_path
    be.backward(q, k, v, out, lse, do, prep, keep=keep)
    return be, rec, fwd_path, out, lse


def test_fallback_float32():
    s = 256
    keep = _keep(4, s, s, 128, seed=0)
    be, rec, fwd_path, out, lse = _fallback(_causal(s), s, keep, dtype=torch.float32)
    assert fwd_path.startswith("triton (") and "float32" in fwd_path
    assert be.last_path == fwd_path and not rec.calls
    assert [(c[0], c[1] is keep) for c in be.triton.calls] == [("fwd", True), ("bwd", True)]
    assert any("float32" in r for r in be.describe()["fallbacks"].values())
    assert out.dtype == torch.float32


@pytest.mark.parametrize("block", [128, 64])
def test_fallback_float32_values(block):
    """The fp32 fallback runs Triton's keep path (its kernels in the interpreter) and gives the dense
    reference of tiles & keep, forward and backward with an lse gradient (tolerances of the FA4 fallback test)."""
    s = 256
    be = FA4Backend(functions=Recorder().functions())
    tiles = _docs([100, 156])
    prep = be.prepare(tiles, s, s, head_dims=(16,))
    q, k, v, do, dl = _inputs(s, s, d=16, dtype=torch.float32)
    keep = _keep(4, s, s, block, seed=1)
    cells = tiles_to_dense(tiles, s, s)[None] & keep.cells(torch.arange(s), torch.arange(s))
    ref = reference_attention(q, k, v, cells, 0.3, dout=do, dlse=dl.float())
    out, lse = be.forward(q, k, v, prep, 0.3, keep=keep)
    assert be.last_path.startswith("triton (") and "float32" in be.last_path
    delta = (do * out).sum(-1) - dl.float()
    grads = be.backward(q, k, v, out, lse, do, prep, 0.3, delta, keep=keep)
    for got, want in zip((out, lse, *grads), ref):
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)  # lse: -inf where nothing is kept


def test_fallback_block_64():
    s = 256
    keep = _keep(4, s, s, 64, seed=0)
    be, rec, fwd_path, *_ = _fallback(_causal(s), s, keep)
    assert "keep.block 64" in fwd_path and "multiples of 128" in fwd_path
    assert not rec.calls and [c[0] for c in be.triton.calls] == ["fwd", "bwd"]
    assert any("keep.block 64" in r for r in be.describe()["fallbacks"].values())


def test_rows_with_three_intervals_run_with_the_bitmap_and_fall_back_above_its_cap(monkeypatch):
    """Three key intervals of one row on a partial block: the cells' bitmap mask_mod, exact; with the bitmap above
    its size cap no block-sparse form, and Triton runs both, with the reason."""
    from megatron_cp.kernels.fa4 import calls as fc

    s = 256
    tiles = torch.tensor([[0, 128, 0, 10, FULL], [0, 128, 20, 30, FULL], [0, 128, 40, 50, FULL],
                          [128, 256, 128, 256, CAUSAL]], dtype=torch.int32)
    static = fa4_sparse.sparse_static(tiles.numpy(), s, s)
    assert static.blocks.bitmap and static.blocks.mask_key == "bitmap"
    _check(tiles, s, s, _keep(4, s, s, 128, seed=0), dlse=True, seed=3)
    monkeypatch.setattr(fc, "BITMAP_MAX_BYTES", 0)
    be, rec, fwd_path, *_ = _fallback(tiles, s, _keep(4, s, s, 128, seed=0))
    assert "key intervals" in fwd_path and "bitmap" in fwd_path and not rec.calls
    assert "bwd keep list" in be.describe()["fallbacks"]


def test_fallback_backward_only():
    """Deterministic mode and head_dim 192: the forward runs on FA4, the backward on Triton."""
    s = 256
    keep = _keep(4, s, s, 128, seed=0)
    be, rec, fwd_path, *_ = _fallback(_causal(s), s, keep, deterministic=True)
    assert fwd_path == SPARSE_PATH and "deterministic" in be.last_path
    assert [c[0] for c in rec.calls] == ["fwd"] and [c[0] for c in be.triton.calls] == ["bwd"]
    be, rec, fwd_path, *_ = _fallback(_causal(s), s, keep, d=192)
    assert fwd_path == SPARSE_PATH and "head_dim 192" in be.last_path
    assert [c[0] for c in rec.calls] == ["fwd"] and [c[0] for c in be.triton.calls] == ["bwd"]


def test_bad_keep_is_a_value_error():
    s = 256
    be = FA4Backend(functions=Recorder().functions())
    prep = be.prepare(_causal(s), s, s)
    q, k, v, *_ = _inputs(s, s)
    with pytest.raises(ValueError, match="BlockKeep.mask"):
        be.forward(q, k, v, prep, keep=BlockKeep(torch.ones(4, 3, 2, dtype=torch.bool), 128))

