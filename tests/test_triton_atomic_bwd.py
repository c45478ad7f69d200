"""Atomic-dQ backward (kernels/triton_bwd_atomic.py) on CPU through Triton's interpreter.

Each case runs the deterministic forward and backward of TritonBackend and the atomic launcher on the
same dK/dV schedule, then checks: dq/dk/dv against the dense fp64 reference of test_triton_kernels (same
tolerance as the deterministic backward tests there), dk/dv bitwise equal to the deterministic kernels'
(same schedule, same arithmetic), dq close to the deterministic dq, and dq exactly 0 on rows that keep
no key. Tiny shapes: the interpreter is slow.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest.py, before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from megatron_cp.kernels import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL  # noqa: E402
from megatron_cp.kernels.triton_backend import (  # noqa: E402
    KernelConfig, StageConfigs, TritonBackend, TritonConfig, _descriptor,
)
from megatron_cp.kernels.triton_bwd_atomic import _launch, launch_bwd_atomic  # noqa: E402
from test_triton_kernels import dense_mask, reference, window_tiles  # noqa: E402  (tests/ is on sys.path: conftest.py)

ATOL = 1e-4  # test_triton_kernels.run_case's fp32 tolerance; gradients are checked at 4x it there too
SCALE = 0.5


def backend(d, bm, bn, tma, split_min):
    """dK/dV blocks bm q rows x bn k rows (the schedule both backward modes walk)."""
    c = KernelConfig(16, 16, 4, 1, tma)
    return TritonBackend(TritonConfig({d: StageConfigs(c, KernelConfig(bm, bn, 4, 1, tma), c)},
                                      dkdv_split_min=split_min))


def atomic(be, prep, q, k, v, dout, lse, delta, scale=SCALE):
    """The launcher called exactly as TritonBackend.backward's deterministic dK/dV block has its inputs."""
    sq, hq, d = q.shape
    c = be.config.for_head_dim(d, prep.row_class, q.dtype).dkdv
    desc, _, cols = prep.schedules(c.block_m, c.block_n, q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq = launch_bwd_atomic(q, k, v, dout, lse.float().contiguous(), delta.float().contiguous(), dk, dv, desc,
                           cols, c, scale, hq // k.shape[1])
    return dq, dk, dv, cols


def run_case(tiles, sq, sk, hq=2, hkv=1, d=16, bm=16, bn=16, tma=False, split_min=16, dtype=torch.float32,
             with_dlse=False, atol=ATOL, seed=0, packed=False):
    """packed: q/k/v are head slices of one [s, Hq + 2 Hkv, D] buffer (row strides != heads x D)."""
    torch.manual_seed(seed)
    tiles = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 5)
    if packed:
        assert sq == sk
        qkv = torch.randn(sq, hq + 2 * hkv, d, dtype=dtype)
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    else:
        q = torch.randn(sq, hq, d, dtype=dtype)
        k = torch.randn(sk, hkv, d, dtype=dtype)
        v = torch.randn(sk, hkv, d, dtype=dtype)
    dout = torch.randn(sq, hq, d, dtype=dtype)
    dlse = torch.randn(sq, hq) if with_dlse else None
    be = backend(d, bm, bn, tma, split_min)
    prep = be.prepare(tiles, sq, sk, head_dims=(d,))
    out, lse = be.forward(q, k, v, prep, SCALE)
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse
    det = be.backward(q, k, v, out, lse, dout, prep, SCALE, delta)
    dq, dk, dv, cols = atomic(be, prep, q, k, v, dout, lse, delta)
    assert dq.dtype == q.dtype and dq.shape == q.shape and dk.dtype == k.dtype
    keep = dense_mask(tiles, sq, sk)
    _, _, r_dq, r_dk, r_dv = reference(q, k, v, keep, SCALE, dout, dlse)
    for name, a, b in (("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
        assert not torch.isnan(a).any(), name
        torch.testing.assert_close(a.double(), b, atol=atol * 4, rtol=0, msg=lambda m: f"{name}: {m}")
    assert torch.equal(dk, det[1]), "dk must equal the deterministic kernel's bitwise"
    assert torch.equal(dv, det[2]), "dv must equal the deterministic kernel's bitwise"
    # same products summed in another order (fp32 atomics vs a register accumulator)
    torch.testing.assert_close(dq.double(), det[0].double(), atol=atol / 10, rtol=0)
    empty = ~keep.any(1)
    assert (dq[empty] == 0).all(), "rows without keys get exactly 0"
    return cols


# -- masks: one tile kind each, band tiles, tiles sharing rows --------------------------------------
def test_causal_square():
    run_case([[0, 48, 0, 48, CAUSAL]], 48, 48)


@pytest.mark.parametrize("sq,sk", [(40, 72), (72, 40)])
def test_full_unequal(sq, sk):
    run_case([[0, sq, 0, sk, FULL]], sq, sk)


def test_causal_more_rows_than_keys_leaves_empty_rows():
    # bottom-right causal with sq > sk: rows 0..31 keep no key (lse -inf); dlse makes their delta
    # nonzero, so only P = 0 keeps their dq at exactly 0
    run_case([[0, 72, 0, 40, CAUSAL]], 72, 40, with_dlse=True)


def test_sliding_window_band_tiles():
    # window w: per chunk of w rows a causal diagonal tile and an inv_causal tile of the w-1 keys before it
    run_case(window_tiles(24, 80), 80, 80, bm=16, bn=32)


def test_tiles_sharing_rows_and_blocks():
    # several tiles meet the same q rows (and the same blocks): their dQ shares add up atomically
    tiles = [[0, 30, 0, 50, BI_CAUSAL], [0, 30, 50, 64, FULL], [30, 64, 10, 20, FULL], [30, 64, 33, 64, CAUSAL]]
    run_case(tiles, 64, 64, bm=32, bn=16)


def test_offset_tile_partial_blocks_empty_rows_tma():
    # starts and ends inside blocks; rows 0..4 and 43..49 are covered by nothing; rows past sq in the last
    # q block are zero-filled by the copy engine and masked out of the atomic add
    run_case([[5, 43, 7, 61, CAUSAL]], 50, 64, hq=4, hkv=2, tma=True, with_dlse=True)


# -- GQA / MQA --------------------------------------------------------------------------------------
@pytest.mark.parametrize("hq,hkv", [(8, 2), (3, 1)])
def test_gqa_mqa(hq, hkv):
    # 4:1 groups over 2 kv heads; MQA with an odd group: each q head's dQ lands in its own slice; q/k/v
    # slices of a packed qkv buffer, so the workspace's strides differ from q's
    tiles = [[0, 40, 0, 8, FULL], [8, 40, 8, 40, CAUSAL], [0, 8, 8, 24, INV_CAUSAL]]
    run_case(tiles, 40, 40, hq=hq, hkv=hkv, packed=True)


# -- split k columns: segments add their dQ shares atomically, dK/dV via slots + reduce -------------
@pytest.mark.parametrize("tma", [False, True])
def test_split_long_key_columns(tma):
    # attention sinks + window: key block 0 is met by every q block; split_min=2 cuts it into segments
    s, w = 112, 16
    tiles = [[0, 2 * w, 0, 2 * w, CAUSAL]]
    for q0 in range(2 * w, s, w):
        tiles += [[q0, q0 + w, q0, q0 + w, CAUSAL], [q0, q0 + w, q0 - w, q0, INV_CAUSAL], [q0, q0 + w, 0, 4, FULL]]
    cols = run_case(tiles, s, s, hq=4, hkv=2, tma=tma, split_min=2)
    assert cols.work.n_slots > 0 and bool((cols.work.slot >= 0).any()), "the sink column must be split"
    assert bool((cols.work.nseg > 1).any())


# -- low precision: the non-IEEE dots and the cast of the fp32 workspace -----------------------------
def test_fp16_inputs():
    # fp16 tolerance as test_triton_kernels.test_fp16_inputs
    run_case([[0, 48, 0, 48, CAUSAL]], 48, 48, dtype=torch.float16, atol=2e-2)


# -- degenerate shapes -------------------------------------------------------------------------------
def test_no_tiles_all_rows_empty():
    be = backend(16, 16, 16, False, 16)
    prep = be.prepare(torch.zeros(0, 5, dtype=torch.int32), 20, 30, head_dims=(16,))
    q, k, v, dout = torch.randn(20, 2, 16), torch.randn(30, 1, 16), torch.randn(30, 1, 16), torch.randn(20, 2, 16)
    lse = torch.full((20, 2), float("-inf"))
    dq, dk, dv, _ = atomic(be, prep, q, k, v, dout, lse, torch.randn(20, 2))
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


@pytest.mark.parametrize("sq,sk", [(0, 24), (24, 0)])
def test_zero_length(sq, sk):
    be = backend(16, 16, 16, False, 16)
    tiles = torch.zeros(0, 5, dtype=torch.int32)
    prep = be.prepare(tiles, sq, sk, head_dims=(16,))
    q, dout = torch.randn(sq, 2, 16), torch.randn(sq, 2, 16)
    k, v = torch.randn(sk, 1, 16), torch.randn(sk, 1, 16)
    dq, dk, dv, _ = atomic(be, prep, q, k, v, dout, torch.zeros(sq, 2), torch.zeros(sq, 2))
    assert dq.shape == (sq, 2, 16) and dk.shape == (sk, 1, 16)
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


@pytest.mark.parametrize("tma", [False, True])
def test_rows_past_sq_are_not_written(tma):
    # sq = 50: the last q block (rows 48..63) sticks out by 14 rows. Their shares are 0 (zero q rows, P = 0),
    # but an unmasked atomic would still add +0.0 past the workspace: guard it with -0.0, which +0.0 clears
    sq, sk, hq, d = 50, 40, 2, 16
    torch.manual_seed(1)
    tiles = torch.tensor([[0, sq, 0, sk, FULL]], dtype=torch.int32)
    q, dout = torch.randn(sq, hq, d), torch.randn(sq, hq, d)
    k, v = torch.randn(sk, 1, d), torch.randn(sk, 1, d)
    be = backend(d, 16, 16, tma, 16)
    prep = be.prepare(tiles, sq, sk, head_dims=(d,))
    out, lse = be.forward(q, k, v, prep, SCALE)
    delta = (dout * out).sum(-1)
    c = be.config.for_head_dim(d, prep.row_class, q.dtype).dkdv
    desc, _, cols = prep.schedules(c.block_m, c.block_n, q.device)
    buf = torch.full((64, hq, d), -0.0)
    dqw = buf[:sq].zero_()
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    qd, dod = (_descriptor(x, c.block_m) for x in (q, dout)) if tma else (q, dout)
    _launch(q, k, v, dout, lse, delta, dk, dv, dqw, qd, dod, desc, cols, c, SCALE, hq, tma)
    assert torch.signbit(buf[sq:]).all(), "rows past sq must not be touched"
    dq_det = be.backward(q, k, v, out, lse, dout, prep, SCALE, delta)[0]
    torch.testing.assert_close((dqw * SCALE).double(), dq_det.double(), atol=ATOL / 10, rtol=0)


def test_backend_bwd_mode_atomic_end_to_end():
    """TritonConfig(bwd_mode="atomic") routes TritonBackend.backward to the fused kernel: same dk/dv as
    the deterministic backend, dq within tolerance of the fp64 reference; deterministic=True refuses it."""
    torch.manual_seed(3)
    tiles = torch.tensor([[0, 40, 0, 48, CAUSAL], [40, 56, 8, 30, FULL]], dtype=torch.int32)
    sq, sk, d = 56, 48, 16
    c = KernelConfig(16, 16, 4, 1, False)
    det = TritonBackend(TritonConfig({d: StageConfigs(c, c, c)}))
    atm = TritonBackend(TritonConfig({d: StageConfigs(c, c, c)}, bwd_mode="atomic"))
    q, k, v = torch.randn(sq, 4, d), torch.randn(sk, 2, d), torch.randn(sk, 2, d)
    do = torch.randn(sq, 4, d)
    keep = dense_mask(tiles, sq, sk)
    out_r, lse_r, dq_r, dk_r, dv_r = reference(q, k, v, keep, SCALE, do)
    prep = atm.prepare(tiles, sq, sk)
    out, lse = atm.forward(q, k, v, prep, SCALE)
    spy = []
    import megatron_cp.kernels.triton_bwd_atomic as mod

    real = mod.launch_bwd_atomic
    mod.launch_bwd_atomic = lambda *a, **kw: spy.append(1) or real(*a, **kw)
    try:
        dq, dk, dv = atm.backward(q, k, v, out, lse, do, prep, SCALE)
    finally:
        mod.launch_bwd_atomic = real
    assert spy, "the atomic kernel did not run"
    dq0, dk0, dv0 = det.backward(q, k, v, out, lse, do, det.prepare(tiles, sq, sk), SCALE)
    assert torch.equal(dk, dk0) and torch.equal(dv, dv0)
    for a, b in ((dq, dq_r), (dk, dk_r), (dv, dv_r)):
        assert (a.double() - b).abs().max() < 4 * ATOL
    assert (dq.double() - dq_r).abs().max() < 4 * ATOL and not torch.equal(dq, torch.zeros_like(dq))
    with pytest.raises(ValueError, match="deterministic=True needs bwd_mode='deterministic'"):
        TritonConfig(deterministic=True, bwd_mode="atomic")
