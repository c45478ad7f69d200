"""The dense (cuDNN) path's plumbing on CPU, with an fp64 stand-in for the cuDNN ops.

cuDNN runs only on CUDA, so CI cannot run it; what CI can check is everything around it: which pieces
go to cuDNN and which to Triton (kernels/pieces.py, as prepare calls it), the probe that picks a layout
once per family, the LSE merges (torch and the one-pass Triton merge kernel under the interpreter), the
accumulating forward into a float32 running pair, the backward with and without an lse gradient, and the
staged distributed runtime routing whole dense stages to it. The stand-in replaces the two raw ops
(kernels/triton/cudnn.py: sdpa_forward / sdpa_backward) with cuDNN's contract exactly (square causal = top-left;
backward from the given global out/lse, delta = rowsum(dout * out) recomputed inside) in fp64, so any
error is the plumbing's.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest.py, before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import megatron_cp.kernels.triton.backend as tb  # noqa: E402
import megatron_cp.kernels.triton.prepared as tprep  # noqa: E402
from megatron_cp.kernels import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL  # noqa: E402
from megatron_cp.kernels.triton import cudnn  # noqa: E402
from megatron_cp.kernels.merge import merge_into, merge_torch  # noqa: E402
from megatron_cp.kernels.pieces import row_class, split_pieces  # noqa: E402
from megatron_cp.masks.catalog import tiles_to_dense  # noqa: E402
from megatron_cp.testing import reference_attention  # noqa: E402

CALLS = []
QUIET = []  # non-empty while cudnn.probe runs: its calls are not recorded


def _one_forward(q, k, v, scale, is_causal):
    sq, sk = q.shape[0], k.shape[0]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if is_causal:
        keep = torch.tril(keep)
    out, lse = reference_attention(q, k, v, keep, scale)[:2]
    return out.to(q.dtype), lse.float()


def _one_backward(q, k, v, out, lse, dout, scale, is_causal):
    """Gradients from the given (global) out and lse, delta = rowsum(dout * out), in fp64."""
    g = q.shape[1] // k.shape[1]
    qd, kd, vd, od, dod = (x.double() for x in (q, k, v, out, dout))
    kk, vv = kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", qd, kk) * scale
    if is_causal:
        s = s.masked_fill(~torch.tril(torch.ones(s.shape[1:], dtype=torch.bool)), float("-inf"))
    lse_h = lse.double().T[..., None]  # [H, sq, 1]
    p = torch.where(torch.isinf(lse_h), 0.0, torch.exp(s - torch.where(torch.isinf(lse_h), 0.0, lse_h)))
    dp = torch.einsum("qhd,khd->hqk", dod, vv)
    delta = (dod * od).sum(-1).T[..., None]
    ds = p * (dp - delta)
    dq = torch.einsum("hqk,khd->qhd", ds, kk) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, qd) * scale
    dv = torch.einsum("hqk,qhd->khd", p, dod)
    hkv = k.shape[1]
    dk = dk.view(k.shape[0], hkv, g, -1).sum(2)
    dv = dv.view(k.shape[0], hkv, g, -1).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def fake_sdpa_forward(qb, kb, vb, scale, is_causal):
    """cuDNN's SDPA contract in fp64: qb [n, r, Hq, D], kb/vb [n, kw, Hkv, D] (views, possibly overlapping)
    -> out [n, r, Hq, D] (q's dtype), lse [n, r, Hq] fp32, piece by piece."""
    if not QUIET:
        CALLS.append(("fwd", qb.shape[0], qb.shape[1], kb.shape[1], is_causal))
    res = [_one_forward(q, k, v, scale, is_causal) for q, k, v in zip(qb, kb, vb)]
    return torch.stack([o for o, _ in res]), torch.stack([l for _, l in res])


def fake_sdpa_backward(qb, kb, vb, ob, lseb, dob, scale, is_causal):
    if not QUIET:
        CALLS.append(("bwd", qb.shape[0], qb.shape[1], kb.shape[1], is_causal))
    res = [_one_backward(*x, scale, is_causal) for x in zip(qb, kb, vb, ob, lseb, dob)]
    return tuple(torch.stack(g) for g in zip(*res))


class FakeCudnnBackend(tb.TritonBackend):
    """TritonBackend whose cuDNN path runs on CPU float32 (the stand-in above); the probe runs as on CUDA."""

    def _cudnn_allowed(self, q):
        return self._cudnn_wanted


_REAL_PROBE = cudnn.probe


def _quiet_probe(*args):
    QUIET.append(1)
    try:
        return _REAL_PROBE(*args)
    finally:
        QUIET.pop()


def install_fake(monkeypatch=None):
    """Route the raw cuDNN ops to the stand-ins, and say CUDA is present (also used in spawned ranks)."""
    for mod, name, val in ((cudnn, "sdpa_forward", fake_sdpa_forward), (cudnn, "sdpa_backward", fake_sdpa_backward),
                           (cudnn, "probe", _quiet_probe), (tb, "_cuda_present", lambda: True)):
        if monkeypatch is not None:
            monkeypatch.setattr(mod, name, val)
        else:
            setattr(mod, name, val)


def backend(min_rows=16, min_keys=16, d=16, band_squares=2048):
    c = tb.KernelConfig(16, 16, 4, 1, False)
    return FakeCudnnBackend(tb.TritonConfig({d: tb.PhaseConfigs(c, c, c)}, dense_min_rows=min_rows,
                                            dense_min_keys=min_keys, band_squares=band_squares))


def _data(sq, sk, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, hq, d, generator=g)
    k = torch.randn(sk, hkv, d, generator=g)
    v = torch.randn(sk, hkv, d, generator=g)
    do = torch.randn(sq, hq, d, generator=g)
    return q, k, v, do


# a rank's list as the planner emits it: a bottom-right causal tile over a long prefix (splits into a
# full rectangle and a square causal piece), a small full tile left to Triton, a window-like tile
TILES = torch.tensor([[0, 32, 0, 64, CAUSAL], [32, 40, 0, 8, FULL], [40, 56, 64, 80, INV_CAUSAL]], dtype=torch.int32)


@pytest.mark.parametrize("use_triton", [False, True])
def test_merge_one_pass_kernel(use_triton):
    torch.manual_seed(0)
    s, h, d = 37, 3, 16
    acc = torch.randn(s, h, d)
    lse = torch.randn(s, h)
    o = torch.randn(s, h, d).to(torch.bfloat16)
    l = torch.randn(s, h)
    lse[:5] = float("-inf")  # running side empty: takes o as it is (acc garbage ignored)
    acc[:5] = float("nan")
    l[3:8] = float("-inf")  # new side empty; rows 3, 4 empty on both sides
    ref_acc, ref_lse = acc.clone(), lse.clone()
    merge_torch(ref_acc, ref_lse, o, l)
    merge_into(acc, lse, o, l, use_triton=use_triton)
    assert not torch.isnan(acc).any()
    assert torch.allclose(acc, ref_acc, atol=1e-6) and torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-6)
    assert bool((acc[3:5] == 0).all()) and bool((lse[3:5] == float("-inf")).all())


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("two,rev,rev2", [(False, True, False), (True, False, True), (True, True, False)])
def test_merge_reversed_and_pair(use_triton, two, rev, rev2):
    """One pass merging one or two partials, either stored with its positions reversed, equals the
    attention-weighted union computed directly: out = sum_i exp(l_i - L) o_i, L = logsumexp_i l_i."""
    torch.manual_seed(1)
    s, h, d = 29, 3, 16
    acc, lse = torch.randn(s, h, d), torch.randn(s, h)
    lse[:3] = float("-inf")
    parts = [(torch.randn(s, h, d), torch.randn(s, h), rev)] + ([(torch.randn(s, h, d), torch.randn(s, h), rev2)]
                                                               if two else [])
    parts[0][1][2:6] = float("-inf")  # rows 2, 5: empty running side too for row 2
    if two:
        parts[1][1][2:4] = float("-inf")  # row 2, 3 (in stored order)
    # in acc's order: a reversed partial's stored row p is position s - 1 - p
    aligned = [(o.flip(0), l.flip(0)) if r else (o, l) for o, l, r in parts]
    ls = torch.stack([lse] + [l for _, l in aligned])  # [k, s, h]
    big = torch.logsumexp(ls, 0)
    w = torch.where(torch.isinf(big), 0.0, torch.exp(ls - big.where(torch.isfinite(big), torch.zeros_like(big))))
    ref = w[0, ..., None] * acc.where(torch.isfinite(lse)[..., None], torch.zeros_like(acc))
    for (o, _), wi in zip(aligned, w[1:]):
        ref = ref + wi[..., None] * o
    kw = dict(o2=parts[1][0], l2=parts[1][1], reverse2=rev2) if two else {}
    # fresh: the same partials into an output holding nothing yet (not read: NaN garbage), in bf16
    fresh_out, fresh_lse = torch.full((s, h, d), float("nan")).bfloat16(), torch.full((s, h), float("nan"))
    merge_into(fresh_out, fresh_lse, parts[0][0], parts[0][1], use_triton=use_triton, reverse=rev, fresh=True, **kw)
    merge_into(acc, lse, parts[0][0], parts[0][1], use_triton=use_triton, reverse=rev, **kw)
    assert torch.allclose(acc, ref, atol=1e-5) and not torch.isnan(acc).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(big))
    assert torch.allclose(lse[torch.isfinite(big)], big[torch.isfinite(big)], atol=1e-5)
    ls_f = torch.stack([l for _, l in aligned])
    big_f = torch.logsumexp(ls_f, 0)
    w_f = torch.where(torch.isinf(big_f), 0.0, torch.exp(ls_f - big_f.where(torch.isfinite(big_f), torch.zeros_like(big_f))))
    ref_f = sum(wi[..., None] * o for (o, _), wi in zip(aligned, w_f))
    assert not torch.isnan(fresh_out).any() and torch.allclose(fresh_out.float(), ref_f, atol=2e-2)
    assert torch.equal(torch.isinf(fresh_lse), torch.isinf(big_f))
    assert torch.allclose(fresh_lse[torch.isfinite(big_f)], big_f[torch.isfinite(big_f)], atol=1e-5)


def test_dense_pieces_forward_backward(monkeypatch):
    install_fake(monkeypatch)
    CALLS.clear()
    be = backend()
    sq, sk = 56, 80
    q, k, v, do = _data(sq, sk)
    prep = be.prepare(TILES, sq, sk)
    split = prep.cudnn_bwd
    assert prep.cudnn_fwd is split and not split.whole and len(split.pieces) == 2 and split.rest is not None
    keep = tiles_to_dense(TILES, sq, sk)
    out_r, lse_r, dq_r, dk_r, dv_r = reference_attention(q, k, v, keep, 0.25, dout=do)
    out, lse = be.forward(q, k, v, prep, 0.25)
    assert be.last_path == "cudnn+triton" and [c[0] for c in CALLS] == ["fwd", "fwd"]
    fin = torch.isfinite(lse_r)
    assert torch.equal(torch.isfinite(lse), fin) and bool((out[~fin.all(1)] == 0).all())
    assert (out.double() - out_r).abs().max() < 1e-4 and (lse[fin].double() - lse_r[fin]).abs().max() < 1e-4
    CALLS.clear()
    dq, dk, dv = be.backward(q, k, v, out, lse, do, prep, 0.25, None)
    assert be.last_path == "cudnn+triton" and [c[0] for c in CALLS] == ["bwd", "bwd"]
    for a, b in ((dq, dq_r), (dk, dk_r), (dv, dv_r)):
        assert (a.double() - b).abs().max() < 1e-4
    # an lse gradient: cuDNN cannot take it (it recomputes delta itself), everything runs on Triton
    dlse = torch.randn(sq, q.shape[1])
    dlse[~fin] = 0
    _, _, dq_l, dk_l, dv_l = reference_attention(q, k, v, keep, 0.25, dout=do, dlse=dlse)
    CALLS.clear()
    delta = (do.double() * out.double()).sum(-1).float() - dlse
    dq, dk, dv = be.backward(q, k, v, out, lse, do, prep, 0.25, delta)
    assert be.last_path == "triton" and not CALLS
    for a, b in ((dq, dq_l), (dk, dk_l), (dv, dv_l)):
        assert (a.double() - b).abs().max() < 1e-4


@pytest.mark.parametrize("case", ["squares", "wide"])
def test_band_squares_forward(monkeypatch, case):
    """Forward band squares (TritonConfig.band_squares): a sliding window after a causal head, as a rank's
    list. "squares": w = 16, chunks of 16 rows: a reversed causal square (cuDNN on flipped copies) and a
    causal square, merged in one pass, the causal head and the tail rows on Triton. "wide": a window wider
    than the band's rows: one chunk with a full rectangle between the squares. Forward (writing and
    accumulating into a running pair) equals the fp64 reference; the backward keeps the band on Triton."""
    install_fake(monkeypatch)
    be = backend(min_keys=10**6, band_squares=12)  # no other dense pieces: only the band goes to cuDNN
    if case == "squares":
        sq, w = 70, 16
        tiles = torch.tensor([[0, 8, 0, 8, CAUSAL], [8, sq, 8, sq + w, BI_CAUSAL]], dtype=torch.int32)
        calls = [("fwd", 3, 16, 16, True), ("fwd", 3, 16, 16, True)]
        kinds = [(INV_CAUSAL, 3), (CAUSAL, 3)]
    else:
        sq, w = 30, 40
        tiles = torch.tensor([[0, 8, 0, 8, CAUSAL], [8, sq, 8, sq + w, BI_CAUSAL]], dtype=torch.int32)
        calls = [("fwd", 1, 22, 22, True), ("fwd", 1, 22, 18, False), ("fwd", 1, 22, 22, True)]
        kinds = [(INV_CAUSAL, 1), (FULL, 1), (CAUSAL, 1)]
    sk = sq + w
    q, k, v, do = _data(sq, sk, seed=4)
    prep = be.prepare(tiles, sq, sk)
    fwd = prep.cudnn_fwd
    assert prep.cudnn_bwd is None and [p[4:] for p in fwd.pieces] == kinds and fwd.rest is not None
    # squares: the pair's rows are the band's alone (head and tail rows on Triton): written directly
    assert fwd.direct == (case == "squares") and fwd.gaps == ()
    keep = tiles_to_dense(tiles, sq, sk)
    out_r, lse_r, dq_r, dk_r, dv_r = reference_attention(q, k, v, keep, 0.3, dout=do)
    CALLS.clear()
    out, lse = be.forward(q, k, v, prep, 0.3)
    assert be.last_path == "cudnn+triton" and CALLS == calls, CALLS
    assert (out.double() - out_r).abs().max() < 1e-4 and (lse.double() - lse_r).abs().max() < 1e-4
    # accumulating: a first stage over other keys already in the running pair
    k2, v2 = torch.randn(5, *k.shape[1:]), torch.randn(5, *v.shape[1:])
    pre = torch.tensor([[0, sq, 0, 5, FULL]], dtype=torch.int32)
    acc = torch.zeros(q.shape)
    run_lse = torch.full(q.shape[:2], float("-inf"))
    be.forward_accumulate(q, k2, v2, be.prepare(pre, sq, 5), 0.3, acc, run_lse)
    be.forward_accumulate(q, k, v, prep, 0.3, acc, run_lse)
    both = torch.cat([torch.ones(sq, 5, dtype=torch.bool), keep], 1)
    out_b, lse_b = reference_attention(q, torch.cat([k2, k]), torch.cat([v2, v]), both, 0.3)[:2]
    assert (acc.double() - out_b).abs().max() < 1e-4 and (run_lse.double() - lse_b).abs().max() < 1e-4
    CALLS.clear()
    dq, dk, dv = be.backward(q, k, v, out, lse, do, prep, 0.3, None)
    assert be.last_path == "triton" and not CALLS
    for a, b in ((dq, dq_r), (dk, dk_r), (dv, dv_r)):
        assert (a.double() - b).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_band_squares_direct_with_gaps(monkeypatch, dtype):
    """Band-square pairs alone (no Triton rest): written straight into the output in its dtype by one fresh
    merge per pair; rows no tile covers (before and after the band) come out 0 with lse -inf."""
    install_fake(monkeypatch)
    be = backend(min_keys=10**6, band_squares=12)
    sq, sk = 48, 60
    tiles = torch.tensor([[8, 40, 8, 56, BI_CAUSAL]], dtype=torch.int32)  # w = 16: 2 chunks of 16 rows
    prep = be.prepare(tiles, sq, sk)
    fwd = prep.cudnn_fwd
    assert fwd.direct and fwd.rest is None and fwd.gaps == ((0, 8), (40, 48))
    q, k, v, _ = _data(sq, sk, seed=5)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out_r, lse_r = reference_attention(q.float(), k.float(), v.float(), tiles_to_dense(tiles, sq, sk), 0.3)[:2]
    out, lse = be.forward(q, k, v, prep, 0.3)
    assert out.dtype == dtype and be.last_path == "cudnn"
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (out.double() - out_r).abs().max() < tol
    fin = torch.isfinite(lse_r)
    assert torch.equal(torch.isfinite(lse), fin) and (lse.double()[fin] - lse_r[fin]).abs().max() < 1e-4
    assert bool((out[:8] == 0).all()) and bool((out[40:] == 0).all())


BACKWARD_INTO_CASES = {
    # (tiles, sq, sk, backend kwargs, what runs): pieces and a Triton rest / one dense tile
    "pieces+rest": (TILES, 56, 80, {}, "cudnn+triton"),
    "one_piece": (torch.tensor([[0, 24, 0, 40, FULL]], dtype=torch.int32), 24, 40, {}, "cudnn"),
}


@pytest.mark.parametrize("case", sorted(BACKWARD_INTO_CASES))
@pytest.mark.parametrize("strided", [False, True])
def test_backward_into_adds_to_running_sums(monkeypatch, case, strided):
    """backward_into adds the gradients into given float32 running sums (already holding other stages'
    sums; strided: the dK and dV halves of one [rows, 2*Hkv, D] buffer, as the staged runtime passes them)
    and equals running sums + the fp64 reference's gradients; the cuDNN pieces still run."""
    install_fake(monkeypatch)
    tiles, sq, sk, kw, path = BACKWARD_INTO_CASES[case]
    be = backend(**kw)
    q, k, v, do = _data(sq, sk, seed=6)
    prep = be.prepare(tiles, sq, sk)
    out_r, lse_r, dq_r, dk_r, dv_r = reference_attention(q, k, v, tiles_to_dense(tiles, sq, sk), 0.3, dout=do)
    out, lse = be.forward(q, k, v, prep, 0.3)
    g = torch.Generator().manual_seed(1)
    dq0 = torch.randn(q.shape, generator=g)
    dkv0 = torch.randn(sk, 2 * k.shape[1], k.shape[2], generator=g)
    dq = dq0.clone()
    dkv = dkv0.clone()
    hkv = k.shape[1]
    dk, dv = (dkv[:, :hkv], dkv[:, hkv:]) if strided else (dkv[:, :hkv].contiguous(), dkv[:, hkv:].contiguous())
    CALLS.clear()
    res = be.backward_into(q, k, v, out, lse, do, prep, 0.3, None, dq, dk, dv)
    assert res is None  # in place (protocol)
    assert be.last_path == path and CALLS and all(c[0].startswith("bwd") for c in CALLS), (be.last_path, CALLS)
    for got, before, ref in ((dq, dq0, dq_r), (dk, dkv0[:, :hkv], dk_r), (dv, dkv0[:, hkv:], dv_r)):
        assert (got.double() - before.double() - ref).abs().max() < 1e-4
    with pytest.raises(ValueError, match="dq must be a float32 tensor"):
        be.backward_into(q, k, v, out, lse, do, prep, 0.3, None, dq.bfloat16(), dk, dv)


def _raise(*a, **k):
    raise RuntimeError("cuDNN: no engine for this shape")


def test_probe_picks_the_first_layout_that_runs(monkeypatch):
    """cudnn.probe with stand-in ops that reject strided views picks "contiguous"; that also reject K/V with
    fewer heads than Q, "expand" (K/V expanded to Hq heads, dK/dV summed back); that reject everything,
    or give wrong numbers, None with the reasons."""
    def strict(op, contiguous=False, same_heads=False, wrong=False):
        def run(qb, kb, vb, *rest):
            if contiguous and not all(x.is_contiguous() for x in (qb, kb, vb)):
                raise RuntimeError("cuDNN: no engine for strided views")
            if same_heads and kb.shape[2] != qb.shape[2]:
                raise RuntimeError("cuDNN: Hkv must equal Hq")
            res = op(qb, kb, vb, *rest)
            return (res[0] * 2,) + tuple(res[1:]) if wrong else res
        return run

    for kw, group, want in (({}, 2, "as_is"), ({"contiguous": True}, 2, "contiguous"),
                            ({"contiguous": True, "same_heads": True}, 4, "expand"),
                            ({"same_heads": True}, 1, "as_is")):
        monkeypatch.setattr(cudnn, "sdpa_forward", strict(fake_sdpa_forward, **kw))
        monkeypatch.setattr(cudnn, "sdpa_backward", strict(fake_sdpa_backward, **kw))
        assert cudnn.probe("cpu", torch.float32, 16, group) == cudnn.CudnnSupport(want), (kw, group)
    monkeypatch.setattr(cudnn, "sdpa_backward", _raise)
    found = cudnn.probe("cpu", torch.float32, 16, 2)
    assert found.layout is None and "no engine" in found.reason and "expand" in found.reason
    monkeypatch.setattr(cudnn, "sdpa_forward", strict(fake_sdpa_forward, wrong=True))
    monkeypatch.setattr(cudnn, "sdpa_backward", fake_sdpa_backward)
    found = cudnn.probe("cpu", torch.float32, 16, 1)
    assert found.layout is None and "out differs from the float32 reference" in found.reason


def test_probe_once_per_family_then_cudnn_errors_raise(monkeypatch):
    """The probe runs on a family's first call only (cached on the backend, per device, dtype, head_dim and
    Hq / Hkv); after it, a cuDNN error is the caller's: nothing falls back to Triton, nothing is switched off."""
    install_fake(monkeypatch)
    probes = []
    monkeypatch.setattr(cudnn, "probe", lambda *a: probes.append(a) or _quiet_probe(*a))
    be = backend()
    sq, sk = 56, 80
    q, k, v, do = _data(sq, sk, seed=7)
    prep = be.prepare(TILES, sq, sk)
    out, lse = be.forward(q, k, v, prep, 0.3)
    be.forward(q, k, v, prep, 0.3)
    be.backward(q, k, v, out, lse, do, prep, 0.3)
    assert probes == [(torch.device("cpu"), torch.float32, 16, 2)] and be.last_path == "cudnn+triton"
    assert be.cudnn_probes == {probes[0]: cudnn.CudnnSupport("as_is")}
    be.forward(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), prep, 0.3)  # Hq / Hkv 1: a new family
    assert probes[1:] == [(torch.device("cpu"), torch.float32, 16, 1)]
    monkeypatch.setattr(cudnn, "sdpa_backward", _raise)
    dq, dk, dv = torch.ones(q.shape), torch.ones(k.shape), torch.ones(v.shape)
    with pytest.raises(RuntimeError, match="no engine"):
        be.backward_into(q, k, v, out, lse, do, prep, 0.3, None, dq, dk, dv)
    be.forward(q, k, v, prep, 0.3)
    assert be.last_path == "cudnn+triton" and len(probes) == 2


def test_family_the_probe_rejects_runs_on_triton(monkeypatch):
    """A family cuDNN cannot run (every layout failed in the probe) runs on the Triton kernels alone, with
    the probe's reason kept; results equal the fp64 reference."""
    install_fake(monkeypatch)
    monkeypatch.setattr(cudnn, "sdpa_forward", _raise)
    CALLS.clear()
    be = backend()
    sq, sk = 56, 80
    q, k, v, do = _data(sq, sk, seed=8)
    prep = be.prepare(TILES, sq, sk)
    out_r, lse_r, dq_r, dk_r, dv_r = reference_attention(q, k, v, tiles_to_dense(TILES, sq, sk), 0.3, dout=do)
    out, lse = be.forward(q, k, v, prep, 0.3)
    assert be.last_path == "triton"
    found = be.cudnn_probes[(torch.device("cpu"), torch.float32, 16, 2)]
    assert found.layout is None and "no engine" in found.reason
    dq, dk, dv = torch.ones(q.shape), torch.ones(k.shape), torch.ones(v.shape)
    be.backward_into(q, k, v, out, lse, do, prep, 0.3, None, dq, dk, dv)
    assert be.last_path == "triton" and not CALLS
    fin = torch.isfinite(lse_r)
    assert (out.double() - out_r).abs().max() < 1e-4 and (lse[fin].double() - lse_r[fin]).abs().max() < 1e-4
    for got, ref in ((dq, dq_r), (dk, dk_r), (dv, dv_r)):
        assert (got.double() - 1 - ref).abs().max() < 1e-4


def test_prepare_splits_with_split_pieces(monkeypatch):
    """prepare's split (kernels/triton/prepared.py) is pieces.split_pieces called with the config's values (backward: no band squares),
    and each prepared list's row class is pieces.row_class of its tiles."""
    install_fake(monkeypatch)
    seen = []
    monkeypatch.setattr(tprep, "split_pieces", lambda *a, **kw: seen.append(kw) or split_pieces(*a, **kw))
    be = backend(min_rows=16, min_keys=20, band_squares=12)
    sq, sk = 70, 86
    tiles = torch.tensor([[0, 8, 0, 8, CAUSAL], [8, 40, 8, 40, FULL], [40, sq, 40, sk, BI_CAUSAL]], dtype=torch.int32)
    prep = be.prepare(tiles, sq, sk)
    common = dict(min_rows=16, min_keys=20, seqlen_q=sq, seqlen_k=sk)
    assert seen == [dict(common, band_squares=0, forward=False), dict(common, band_squares=12, forward=True)]
    for split, kw in ((prep.cudnn_bwd, seen[0]), (prep.cudnn_fwd, seen[1])):
        want = split_pieces(tiles, **kw)
        assert split.pieces == want.cudnn and torch.equal(split.rest.tiles, want.rest)
        assert split.rest.row_class == row_class(want.rest)
    assert len(prep.cudnn_fwd.pieces) > len(prep.cudnn_bwd.pieces) and prep.row_class == row_class(tiles)


@pytest.mark.parametrize("strided", [False, True])
def test_accumulate_stages_in_place(monkeypatch, strided):
    """Keys split in two stages (one a single dense tile, one with pieces + rest) accumulated into one
    running pair equal the attention over all keys."""
    install_fake(monkeypatch)
    be = backend()
    sq = 56
    q, k, v, _ = _data(sq, 96, seed=1)
    # stage A: keys 0..80 with TILES; stage B: keys 80..96 as one full tile over all rows
    tiles_b = torch.tensor([[0, sq, 0, 16, FULL]], dtype=torch.int32)
    pa, pb = be.prepare(TILES, sq, 80), be.prepare(tiles_b, sq, 16)
    assert pb.cudnn_bwd.whole and pb.cudnn_bwd.pieces == ((0, sq, 0, 16, FULL, 1),)
    keep = torch.cat([tiles_to_dense(TILES, sq, 80), torch.ones(sq, 16, dtype=torch.bool)], 1)
    out_r, lse_r = reference_attention(q, k, v, keep, 0.3)[:2]
    # contiguous: merged in place; strided: through a float32 copy
    acc = torch.zeros(q.shape[1], sq, q.shape[2]).transpose(0, 1) if strided else torch.zeros(q.shape)
    lse = torch.full(q.shape[:2], float("-inf"))
    CALLS.clear()
    be.forward_accumulate(q, k[80:], v[80:], pb, 0.3, acc, lse)
    assert be.last_path == "cudnn" and CALLS == [("fwd", 1, sq, 16, False)]
    be.forward_accumulate(q, k[:80], v[:80], pa, 0.3, acc, lse)
    assert be.last_path == "cudnn+triton"
    assert (acc.double() - out_r).abs().max() < 1e-4 and (lse.double() - lse_r).abs().max() < 1e-4


def _dist_case(rank, world):
    import torch.distributed as dist

    import megatron_cp as mcp
    from megatron_cp.masks import builders as M
    from test_attention_dist import _case_backend

    install_fake()
    CALLS.clear()
    res = {}
    be = backend(min_rows=8, min_keys=8)
    for name, mask, stages in (("causal", M.causal(128), None), ("causal_2stages", M.causal(128), 2),
                               ("docs", M.varlen([0, 40, 128], causal=True), None)):
        plan = mcp.plan(mask, world, solver="zigzag")
        res[name] = _case_backend(rank, world, mask, plan, be, stages=stages)
    kinds = {c[0] for c in CALLS}
    assert kinds == {"fwd", "bwd"}, CALLS
    dist.barrier()
    return res


def test_staged_runtime_routes_dense_stages_to_cudnn():
    from megatron_cp.testing import run_ranks
    from test_attention_dist import _check

    _check(run_ranks(_dist_case, 2))


def test_calls_with_other_lengths_than_prepared_raise():
    """forward, backward and backward_into check q/k against the lengths the tile list was prepared for."""
    be = backend()
    q, k, v, do = _data(56, 80)
    prep = be.prepare(TILES, 56, 80)
    out, lse = be.forward(q, k, v, prep, 0.3)
    short = (q[:50], k, v)
    for call in (lambda: be.forward(*short, prep, 0.3),
                 lambda: be.backward(*short, out[:50], lse[:50], do[:50], prep, 0.3),
                 lambda: be.backward_into(*short, out[:50], lse[:50], do[:50], prep, 0.3, None,
                                          torch.zeros(50, 4, 16), torch.zeros(k.shape), torch.zeros(v.shape))):
        with pytest.raises(ValueError, match="q/k lengths 50/80 differ from the prepared 56/80"):
            call()
