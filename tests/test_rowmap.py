"""RowMap: the runtime's row moves, as slice copies or indexed copies, against plain indexing."""

import numpy as np
import pytest
import torch

from megatron_cp.runtime.rowmap import RowMap, runs_of


def test_runs_of_splits_where_either_index_jumps():
    assert runs_of(np.array([5, 6, 7, 0, 1, 9]), np.array([0, 1, 2, 3, 4, 5])) == [(5, 0, 3), (0, 3, 2), (9, 5, 1)]
    assert runs_of(np.array([0, 1, 2]), np.array([4, 5, 9])) == [(0, 4, 2), (2, 9, 1)]
    assert runs_of(np.zeros(0, np.int64), np.zeros(0, np.int64)) == []
    with pytest.raises(ValueError, match="differ"):
        runs_of(np.arange(3), np.arange(4))


@pytest.mark.parametrize("max_runs", [64, 0])  # slice copies / indexed fallback
def test_scatter_and_gather_match_indexing(max_runs):
    g = torch.Generator().manual_seed(0)
    n_dst, n = 40, 23
    dst_idx = np.concatenate([np.arange(10, 20), np.arange(30, 38), np.array([2, 0, 5, 4, 1])])
    assert len(dst_idx) == n
    src = torch.randn(n, 3, 4, generator=g).to(torch.bfloat16)
    dst = torch.zeros(n_dst, 3, 4, dtype=torch.float32)  # copies convert the dtype
    m = RowMap(dst_idx, None, "cpu", max_runs=max_runs)
    assert m.indexed == (max_runs == 0)
    m.copy(dst, src)
    ref = torch.zeros(n_dst, 3, 4)
    ref[torch.from_numpy(dst_idx)] = src.float()
    assert torch.equal(dst, ref)
    # into a strided view (the K half of a [rows, 2 * H, D] send buffer)
    wide = torch.zeros(n_dst, 6, 4, dtype=torch.bfloat16)
    m.copy(wide[:, :3], src)
    assert torch.equal(wide[:, :3].float(), ref) and not wide[:, 3:].any()

    src_idx = dst_idx
    gm = RowMap(None, src_idx, "cpu", max_runs=max_runs)
    got = gm.gather(ref)
    assert torch.equal(got, ref[torch.from_numpy(src_idx)]) and got.is_contiguous()
    out = torch.empty(n, 3, 4)
    gm.copy(out, ref)
    assert torch.equal(out, ref[torch.from_numpy(src_idx)])
    with pytest.raises(ValueError, match="dst_idx None"):
        m.gather(ref)


def test_one_run_gathers_a_view():
    x = torch.arange(24.0).reshape(12, 2)
    v = RowMap(None, np.arange(3, 9), "cpu").gather(x)
    assert v.data_ptr() == x[3].data_ptr() and torch.equal(v, x[3:9])
    assert RowMap(None, np.zeros(0, np.int64), "cpu").gather(x).shape == (0, 2)


@pytest.mark.parametrize("use_triton", [False, True])  # torch index ops / the Triton kernels (interpreter)
def test_copy_rows_and_reduce_rows(use_triton):
    """kernels.rows against plain indexing: strided halves of a [rows, 2H, D] buffer, dtype conversion,
    and the reduce's fp32 sum in source order, rounded once (ragged counts, rows with no partial)."""
    from megatron_cp.kernels.rows import copy_rows, reduce_rows

    g = torch.Generator().manual_seed(1)
    h, d = 2, 24  # width 48: not a power of two (masked tail)
    got = torch.randn(9, 2 * h, d, generator=g).half()
    kbuf = torch.zeros(12, h, d, dtype=torch.float16)
    dst_idx = torch.tensor([11, 3, 4, 5, 0, 7, 8, 1, 2])
    copy_rows(kbuf, got[:, :h], dst_idx, None, use_triton=use_triton)
    ref = torch.zeros(12, h, d, dtype=torch.float16)
    ref[dst_idx] = got[:, :h]
    assert torch.equal(kbuf, ref)
    send = torch.zeros(4, 2 * h, d, dtype=torch.float32)
    src_idx = torch.tensor([8, 0, 0, 5])
    copy_rows(send[:, h:], kbuf, None, src_idx, use_triton=use_triton)
    assert torch.equal(send[:, h:], kbuf[src_idx].float()) and not send[:, :h].any()
    # a source whose heads lie apart in each row: K of Megatron's fused QKV ([s, groups, (q + 2) * D] split per
    # group), the layout a GPU training step hands the runtime
    qkv = torch.randn(9, h, 4 * d, generator=g).half()
    k = qkv[:, :, 2 * d:3 * d]  # heads stride 4 * d, not d
    kbuf.zero_()
    copy_rows(kbuf, k, dst_idx, None, use_triton=use_triton)
    ref.zero_()
    ref[dst_idx] = k
    assert torch.equal(kbuf, ref)

    # fp16: Triton's CPU interpreter here truncates fp32 -> bf16 instead of rounding (GPU rounds)
    dst = torch.randn(6, h, d, generator=g).half()
    parts = torch.randn(7, 2 * h, d, generator=g).half()
    target = torch.tensor([4, 1, 4, 0, 4, 1, 0])  # local row of each returned partial
    order = torch.argsort(target, stable=True)
    rows, counts = torch.unique(target, return_counts=True)
    ptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    expect = dst.float().clone()
    for j in range(7):
        expect[target[j]] += parts[j, :h].float()
    out = dst.clone()
    reduce_rows(out, parts[:, :h], rows, ptr, order, use_triton=use_triton)
    assert torch.equal(out, expect.half())  # one rounding of the fp32 sum
    assert torch.equal(out[[2, 3, 5]], dst[[2, 3, 5]])  # rows without partials untouched
    # dK and dV in one launch: the two halves of one received buffer, widths of their own (MLA: 3 x 8 and 2 x 8 here)
    from megatron_cp.kernels.rows import reduce_row_pairs
    buf = torch.randn(7, h * 5 * 8, generator=g).half()
    pa, pb = buf[:, :h * 3 * 8].unflatten(1, (h, 24)), buf[:, h * 3 * 8:].unflatten(1, (h, 16))
    da, db = torch.randn(6, h, 24, generator=g).half(), torch.randn(6, h, 16, generator=g).half()
    ea, eb, da0 = da.clone(), db.clone(), da.clone()
    reduce_rows(ea, pa, rows, ptr, order, use_triton=use_triton)
    reduce_rows(eb, pb, rows, ptr, order, use_triton=use_triton)
    reduce_row_pairs(da, pa, db, pb, rows, ptr, order, use_triton=use_triton)
    assert torch.equal(da, ea) and torch.equal(db, eb) and not torch.equal(da[rows], da0[rows])


@pytest.mark.parametrize("use_triton", [False, True])  # torch index ops / the Triton kernel (interpreter)
def test_copy_row_pairs_moves_both_pairs_like_two_copies(use_triton):
    """kernels.rows.copy_row_pairs: K and V of different widths (MLA's 192 / 128 in miniature) into strided halves
    of one buffer, through a destination index, and gathered through a source index: what two copy_rows give."""
    from megatron_cp.kernels.rows import copy_row_pairs, copy_rows

    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(5, 2, 12, generator=g).half(), torch.randn(5, 2, 8, generator=g).half()
    buf = torch.zeros(9, 2 * 12 + 2 * 8, dtype=torch.float16)
    ka, va = buf[:, :24].unflatten(1, (2, 12)), buf[:, 24:].unflatten(1, (2, 8))
    dst_idx = torch.tensor([7, 0, 3, 8, 2])
    copy_row_pairs(ka, k, va, v, dst_idx, None, use_triton=use_triton)
    ref_k, ref_v = torch.zeros(9, 2, 12, dtype=torch.float16), torch.zeros(9, 2, 8, dtype=torch.float16)
    copy_rows(ref_k, k, dst_idx, None, use_triton=False)
    copy_rows(ref_v, v, dst_idx, None, use_triton=False)
    assert torch.equal(ka, ref_k) and torch.equal(va, ref_v)
    src_idx = torch.tensor([8, 8, 0])
    ok, ov = torch.empty(3, 2, 12, dtype=torch.float32), torch.empty(3, 2, 8, dtype=torch.float32)
    copy_row_pairs(ok, ka, ov, va, None, src_idx, use_triton=use_triton)
    assert torch.equal(ok, ref_k[src_idx].float()) and torch.equal(ov, ref_v[src_idx].float())
    m = RowMap(dst_idx.numpy(), None, "cpu", max_runs=0)
    bk, bv = torch.zeros(9, 2, 12, dtype=torch.float16), torch.zeros(9, 2, 8, dtype=torch.float16)
    m.copy_pair(bk, k, bv, v)
    assert torch.equal(bk, ref_k) and torch.equal(bv, ref_v)


def test_upload_all_packs_every_array_at_an_aligned_offset_and_unpacks_it_as_it_was():
    """kernels.upload_all's packing (what a CUDA upload copies in one go): arrays of several dtypes and shapes,
    empty ones, a strided one, a tensor and None come back equal, each a view at a 16-byte offset of the one
    buffer."""
    from megatron_cp.kernels.upload import ALIGN, pack, unpack, upload_all

    rng = np.random.default_rng(3)
    arrays = [rng.integers(-9, 9, 7).astype(np.int64), None, np.zeros(0, np.int32),
              rng.integers(0, 100, (3, 5)).astype(np.int32), rng.standard_normal(5).astype(np.float32),
              np.arange(20, dtype=np.int64)[::3], torch.arange(6, dtype=torch.int32).reshape(2, 3),
              np.array([1], np.int8)]
    blob, spans = pack(arrays)
    buf = torch.from_numpy(blob)
    got = unpack(buf, spans)
    assert len(got) == len(arrays)
    for a, g, sp in zip(arrays, got, spans):
        if a is None:
            assert g is None and sp is None
            continue
        want = torch.as_tensor(np.ascontiguousarray(a))
        assert g.dtype == want.dtype and g.shape == want.shape and torch.equal(g, want)
        assert sp[0] % ALIGN == 0 and (g.numel() == 0 or g.data_ptr() == buf.data_ptr() + sp[0])  # (empty: no pointer)
    ends = [sp[0] for sp in spans if sp is not None]
    assert ends == sorted(ends) and len(set(ends[:2])) == 2  # an empty array takes no room, the others do
    # off CUDA: one tensor per array, as upload gives
    cpu = upload_all(arrays, "cpu")
    assert cpu[1] is None and all(torch.equal(c, torch.as_tensor(np.ascontiguousarray(a)))
                                  for a, c in zip(arrays, cpu) if a is not None)


def test_upload_all_copies_an_array_passed_twice_once():
    """A map's row index and its inverse's are one array (a single exchange's own rows, say): packed once, both
    tensors views of the same bytes."""
    from megatron_cp.kernels.upload import pack, unpack

    a, b = np.arange(9, dtype=np.int64), np.arange(4, dtype=np.int32)
    blob, spans = pack([a, b, a])
    assert blob.nbytes == pack([a, b])[0].nbytes
    ga, gb, ga2 = unpack(torch.from_numpy(blob), spans)
    assert torch.equal(ga, torch.from_numpy(a)) and torch.equal(gb, torch.from_numpy(b))
    assert ga2.data_ptr() == ga.data_ptr() and torch.equal(ga2, ga)


@pytest.mark.parametrize("use_triton", [False, True])  # torch index ops / the Triton kernel (interpreter)
def test_two_row_pair_moves_in_one_launch_are_the_two_moves(use_triton):
    """kernels.copy_row_pair_moves: a scatter through a destination index into a K / V buffer beside a gather
    through a source index into strided halves of a send buffer (a layer call's own-rows placement and send
    gather), of different lengths and widths, dtype converted; and a one-run slice move beside an indexed one,
    as runtime.rowmap.copy_pairs pairs them: each what its own copy_row_pairs gives."""
    from megatron_cp.kernels.rows import copy_row_pair_moves, copy_row_pairs

    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(7, 2, 12, generator=g).half(), torch.randn(7, 2, 8, generator=g).half()
    own_idx, send_idx = torch.tensor([9, 0, 4, 5, 2, 8, 1]), torch.tensor([6, 6, 0, 3])

    def run(one_by_one):
        kbuf, vbuf = torch.zeros(10, 2, 12, dtype=torch.float16), torch.zeros(10, 2, 8, dtype=torch.float16)
        send = torch.zeros(4, 2 * 12 + 2 * 8, dtype=torch.float32)
        sa, sb = send[:, :24].unflatten(1, (2, 12)), send[:, 24:].unflatten(1, (2, 8))
        moves = [(kbuf, k, vbuf, v, own_idx, None), (sa, k, sb, v, None, send_idx),
                 (kbuf[6:8], k[1:3], vbuf[6:8], v[1:3], None, None)]  # rows no other move writes
        if one_by_one:
            for m in moves:
                copy_row_pairs(*m, use_triton=False)
        else:
            copy_row_pair_moves(moves[:2], use_triton=use_triton)
            copy_row_pair_moves(moves[2:] + [moves[0]], use_triton=use_triton)
        return kbuf, vbuf, send

    for got, want in zip(run(one_by_one=False), run(one_by_one=True)):
        assert torch.equal(got, want)
    assert run(False)[2].abs().sum() > 0


@pytest.mark.parametrize("use_triton", [False, True])  # torch index ops / the Triton kernels (interpreter)
def test_two_gathers_in_one_launch_are_the_two_gathers(use_triton):
    """A backward call's pairing: the partial dK / dV rows gathered into the column halves of the send buffer and the
    own rows' dK / dV gathered into their own tensors, both through source indices only, in one launch."""
    from megatron_cp.kernels.rows import copy_row_pair_moves, copy_row_pairs

    g = torch.Generator().manual_seed(8)
    dk, dv = torch.randn(9, 2, 12, generator=g), torch.randn(9, 2, 12, generator=g)
    recv_idx, own_idx = torch.tensor([7, 2, 2, 5]), torch.tensor([0, 1, 3, 4, 6, 8])

    def run(one_by_one):
        send = torch.zeros(4, 2 * 2 * 12)
        sa, sb = send[:, :24].unflatten(1, (2, 12)), send[:, 24:].unflatten(1, (2, 12))
        ok, ov = torch.zeros(6, 2, 12), torch.zeros(6, 2, 12)
        moves = [(sa, dk, sb, dv, None, recv_idx), (ok, dk, ov, dv, None, own_idx)]
        if one_by_one:
            for m in moves:
                copy_row_pairs(*m, use_triton=False)
        else:
            copy_row_pair_moves(moves, use_triton=use_triton)
        return send, ok, ov

    for got, want in zip(run(one_by_one=False), run(one_by_one=True)):
        assert torch.equal(got, want)
    assert torch.equal(run(False)[1], dk[own_idx])


@pytest.mark.parametrize("use_triton", [False, True])  # torch index ops / the Triton kernels (interpreter)
def test_copy_pairs_runs_each_maps_copy_pair(use_triton):
    """runtime.rowmap.copy_pairs over an indexed scatter with a one-run map (which joins its launch with the Triton
    kernels) and an empty one, then an indexed gather alone: what each map's copy_pair gives."""
    from megatron_cp.runtime.rowmap import copy_pairs

    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(7, 2, 12, generator=g).half(), torch.randn(7, 2, 8, generator=g).half()
    own = RowMap(np.array([9, 0, 4, 5, 2, 8, 1]), None, "cpu")
    send = RowMap(None, np.array([6, 6, 0, 3]), "cpu")
    one = RowMap(np.array([6, 7]), np.array([1, 2]), "cpu")
    none = RowMap(None, np.zeros(0, np.int64), "cpu")
    assert own.indexed and send.indexed and not one.indexed and len(one.runs) == 1

    def buffers():
        return (torch.zeros(10, 2, 12, dtype=torch.float16), torch.zeros(10, 2, 8, dtype=torch.float16),
                torch.zeros(4, 2, 12, dtype=torch.float32), torch.zeros(4, 2, 8, dtype=torch.float32),
                torch.zeros(10, 2, 12, dtype=torch.float16), torch.zeros(10, 2, 8, dtype=torch.float16))

    kb, vb, sk, sv, ok_, ov = got = buffers()
    copy_pairs([(own, kb, k, vb, v), (one, ok_, k, ov, v), (none, sk, k, sv, v)], use_triton=use_triton)  # joined
    copy_pairs([(send, sk, k, sv, v)], use_triton=use_triton)
    kb, vb, sk, sv, ok_, ov = want = buffers()
    own.copy_pair(kb, k, vb, v)
    send.copy_pair(sk, k, sv, v)
    one.copy_pair(ok_, k, ov, v)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and ok_.abs().sum() > 0
