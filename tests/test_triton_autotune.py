"""Autotuning of the Triton kernels' block configs (kernels/triton_autotune.py) on CPU.

Autotuning is a no-op on CPU unless the backend gets a timer; here a fake timer (which prefers chosen
candidates) runs the whole selection path in Triton's interpreter with tiny block configs. A spy on the
kernel launches records which config every launch used (and can make a config fail at launch as
Triton's OutOfResources does on a GPU whose shared memory it overflows). Checked: keys, candidate
filtering, one tuning per key then reuse, failure skipping, the call's results equal those of a backend
configured with the winner (bitwise: candidates write into scratch only) and match the fp64 reference.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest.py, before anything imports triton

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from triton.runtime.errors import OutOfResources  # noqa: E402

from megatron_cp.kernels import CAUSAL, FULL  # noqa: E402
from megatron_cp.kernels import triton_autotune as at  # noqa: E402
from megatron_cp.kernels import triton_backend as tb  # noqa: E402
from megatron_cp.kernels import triton_bwd_atomic  # noqa: E402
from megatron_cp.kernels.triton_backend import KernelConfig, StageConfigs, TritonBackend, TritonConfig  # noqa: E402
from test_triton_kernels import dense_mask, reference  # noqa: E402  (tests/ is on sys.path: conftest.py)

ATOL = 1e-4  # test_triton_kernels.run_case's fp32 tolerance (gradients 4x)
SCALE = 0.5
D = 16
DEFAULT = KernelConfig(16, 16, 4, 1)
A = KernelConfig(32, 16, 4, 1)
B = KernelConfig(16, 32, 4, 1)
C = KernelConfig(32, 32, 4, 1, True)
BAD = KernelConfig(24, 16, 4, 1)  # not a power of two: filtered before any launch
ALTS = (A, B, DEFAULT, C, BAD)  # DEFAULT again: deduplicated
PHASE_KERNELS = {"fwd": (tb, "attn_fwd_kernel"), "dkdv": (tb, "attn_bwd_dkdv_kernel"),
                 "dq": (tb, "attn_bwd_dq_kernel"), "bwd_atomic": (triton_bwd_atomic, "attn_bwd_fused_atomic_kernel")}


class Spy:
    """Stands in for a kernel: records (phase, KernelConfig) of each launch; raises OutOfResources at
    launch for the configs in ``fail``."""

    def __init__(self, kernel, phase, log, fail):
        self.kernel, self.phase, self.log, self.fail = kernel, phase, log, fail

    def __getitem__(self, grid):
        inner = self.kernel[grid]

        def launch(*args, **kw):
            c = KernelConfig(kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"], kw["TMA"])
            self.log.append((self.phase, c))
            if c in self.fail.get(self.phase, ()):
                raise OutOfResources(300_000, 232_448, "shared memory")
            return inner(*args, **kw)

        return launch


@pytest.fixture
def spy(monkeypatch):
    """-> (log, fail): launches recorded in log; fail[phase] = configs that fail at launch."""
    log, fail = [], {}
    for phase, (mod, name) in PHASE_KERNELS.items():
        monkeypatch.setattr(mod, name, Spy(getattr(mod, name), phase, log, fail))
    return log, fail


class FakeTimer:
    """timer(fn): runs fn once, reads the config it launched from the spy's log and returns 1 ms for the
    preferred config of that phase, else a time growing with the block area (so the default, the
    smallest, comes second). ``constant``: every candidate 1 ms (a tie)."""

    def __init__(self, log, prefer=None, constant=False):
        self.log, self.prefer, self.constant, self.calls = log, prefer or {}, constant, 0

    def __call__(self, fn):
        self.calls += 1
        n = len(self.log)
        fn()
        phase, c = self.log[n]
        if self.constant:
            return 1.0
        return 1.0 if self.prefer.get(phase) == c else 2.0 + c.block_m * c.block_n / 1024


def config(**kw):
    return TritonConfig({D: StageConfigs(DEFAULT, DEFAULT, DEFAULT)}, **kw)


def candidates_for(phases):
    return {(D, p): ALTS for p in phases}


def data(sq=48, sk=48, hq=2, hkv=1, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, hq, D, generator=g).to(dtype)
    k = torch.randn(sk, hkv, D, generator=g).to(dtype)
    v = torch.randn(sk, hkv, D, generator=g).to(dtype)
    do = torch.randn(sq, hq, D, generator=g).to(dtype)
    return q, k, v, do


def tiles48():
    """Causal over 48 rows as three tiles (a causal square, a full rectangle, a bottom-right causal piece)."""
    return torch.tensor([[0, 32, 0, 32, CAUSAL], [32, 48, 0, 16, FULL], [32, 48, 16, 48, CAUSAL]], dtype=torch.int32)


def run(be, q, k, v, do, tiles, sq=48, sk=48):
    prep = be.prepare(tiles, sq, sk, head_dims=(D,))
    out, lse = be.forward(q, k, v, prep, SCALE)
    grads = be.backward(q, k, v, out, lse, do, prep, SCALE)
    return prep, (out, lse, *grads)


def check_reference(q, k, v, do, tiles, res, sq=48, sk=48):
    out, lse, dq, dk, dv = res
    r_out, r_lse, r_dq, r_dk, r_dv = reference(q, k, v, dense_mask(tiles, sq, sk), SCALE, do)
    torch.testing.assert_close(out.double(), r_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse.double(), r_lse, atol=ATOL, rtol=0)
    for name, a, b in (("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
        torch.testing.assert_close(a.double(), b, atol=4 * ATOL, rtol=0, msg=lambda m: f"{name}: {m}")


# -- selection logic without kernels --------------------------------------------------------------------
def test_candidates_default_first_filtered_deduplicated(monkeypatch):
    q, k = torch.zeros(4, 8, 128, dtype=torch.bfloat16), torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    key = at.tune_key(q, k, "long", "fwd")
    assert key == at.TuneKey("cpu", 128, "bfloat16", 4, "long", "fwd")
    dflt = tb.DEFAULT_CONFIGS[(128, "long")].fwd
    cands, skipped = at.candidates(dflt, key, {}, q)
    assert cands[0] == dflt and len(cands) == len(set(cands))
    assert set(cands) == {dflt, *at.CANDIDATES[(128, "fwd")]} and not skipped
    # an explicit list replaces the built-in one; bad block shapes are skipped with a reason
    cands, skipped = at.candidates(DEFAULT, key, {(128, "fwd"): ALTS}, q)
    assert cands == [DEFAULT, A, B, C] and list(skipped) == [BAD] and "power of two" in skipped[BAD]
    # float32: built-in candidates (sized for 16-bit tiles) are not used, explicit ones are
    key32 = at.tune_key(q.float(), k.float(), "long", "fwd")
    assert at.candidates(DEFAULT, key32, {}, q.float())[0] == [DEFAULT]
    # no tensor descriptors on this device: tma=True candidates run as (and merge with) tma=False
    monkeypatch.setattr(at, "_use_tma", lambda c, q: False)
    cands, _ = at.candidates(KernelConfig(32, 32, 4, 1), key, {(128, "fwd"): (C,)}, q)
    assert cands == [KernelConfig(32, 32, 4, 1)]
    with pytest.raises(ValueError, match="phase"):
        at.tune_key(q, k, "long", "bwd")


def test_deterministic_excludes_autotune():
    with pytest.raises(ValueError, match="autotune"):
        TritonConfig(deterministic=True, autotune=True)
    assert TritonConfig().autotune is False


# -- tuning through the interpreter ---------------------------------------------------------------------
def test_tunes_each_key_once_then_runs_the_winner(spy):
    log, _ = spy
    q, k, v, do = data()
    tiles = tiles48()
    prefer = {"fwd": A, "dkdv": B, "dq": C}
    timer = FakeTimer(log, prefer)
    be = TritonBackend(config(autotune=True, autotune_candidates=candidates_for(("fwd", "dkdv", "dq"))),
                       timer=timer, tuned={})
    prep = be.prepare(tiles, 48, 48, head_dims=(D,))
    out, lse = be.forward(q, k, v, prep, SCALE)
    assert log[-1] == ("fwd", A), "the call itself runs with the winner"
    dq, dk, dv = be.backward(q, k, v, out, lse, do, prep, SCALE)
    assert timer.calls == 3 * 4  # 4 candidates (default, A, B, C) per phase, BAD filtered
    keys = {at.TuneKey("cpu", D, "float32", 2, prep.row_class, p) for p in ("fwd", "dkdv", "dq")}
    assert set(be.tuned) == keys
    for key in keys:
        res = be.tuned[key]
        assert res.config == prefer[key.phase]
        assert set(res.times_ms) == {DEFAULT, A, B, C} and res.times_ms[res.config] == 1.0
        assert list(res.errors) == [BAD]
    assert be.last_configs == prefer
    # later calls: no timing, only the winners launch
    log.clear()
    res2 = run(be, q, k, v, do, tiles)[1]
    assert timer.calls == 12
    assert log == [("fwd", A), ("dkdv", B), ("dq", C)]
    # results: bitwise those of a backend configured with the winners, and right
    fixed = TritonBackend(TritonConfig({D: StageConfigs(A, B, C)}))
    ref = run(fixed, q, k, v, do, tiles)[1]
    for a, b, c in zip((out, lse, dq, dk, dv), res2, ref):
        assert torch.equal(a, c) and torch.equal(b, c)
    check_reference(q, k, v, do, tiles, ref)


def test_failing_candidates_are_skipped(spy):
    log, fail = spy
    q, k, v, do = data(seed=1)
    tiles = tiles48()
    fail["dkdv"] = {B, C}  # B would be preferred: it fails at launch (as out of shared memory), so does C
    fail["fwd"] = {A, B, C}  # every alternative fails: the default stays
    timer = FakeTimer(log, {"fwd": A, "dkdv": B, "dq": B})
    be = TritonBackend(config(autotune=True, autotune_candidates=candidates_for(("fwd", "dkdv", "dq"))),
                       timer=timer, tuned={})
    prep, res = run(be, q, k, v, do, tiles)
    tuned = {key.phase: r for key, r in be.tuned.items()}
    assert tuned["fwd"].config == DEFAULT and set(tuned["fwd"].times_ms) == {DEFAULT}
    assert set(tuned["fwd"].errors) == {A, B, C, BAD}
    assert all(tuned["fwd"].errors[x].startswith("OutOfResources") for x in (A, B, C))
    # dkdv: fastest of the survivors by the fake timer's area rule is the default (16x16), then A
    assert tuned["dkdv"].config == DEFAULT and set(tuned["dkdv"].times_ms) == {DEFAULT, A}
    assert tuned["dq"].config == B
    assert be.last_configs == {"fwd": DEFAULT, "dkdv": DEFAULT, "dq": B}
    fixed = TritonBackend(TritonConfig({D: StageConfigs(DEFAULT, DEFAULT, B)}))
    assert all(torch.equal(a, b) for a, b in zip(res, run(fixed, q, k, v, do, tiles)[1]))
    check_reference(q, k, v, do, tiles, res)


def test_atomic_backward_has_its_own_phase(spy):
    log, _ = spy
    q, k, v, do = data(hq=4, hkv=2, seed=2)
    tiles = tiles48()
    timer = FakeTimer(log, {"bwd_atomic": A})
    cands = {(D, "bwd_atomic"): (A, B)}  # no "fwd" entry: float32, so the forward has only its default
    be = TritonBackend(config(autotune=True, bwd_mode="atomic", autotune_candidates=cands), timer=timer, tuned={})
    prep, res = run(be, q, k, v, do, tiles)
    assert {key.phase for key in be.tuned} == {"fwd", "bwd_atomic"}
    assert be.tuned[at.TuneKey("cpu", D, "float32", 2, prep.row_class, "fwd")].times_ms == {}  # one candidate
    assert be.tuned[at.TuneKey("cpu", D, "float32", 2, prep.row_class, "bwd_atomic")].config == A
    assert timer.calls == 3 and be.last_configs == {"fwd": DEFAULT, "bwd_atomic": A}
    log.clear()
    run(be, q, k, v, do, tiles)
    assert timer.calls == 3 and log == [("fwd", DEFAULT), ("bwd_atomic", A)]
    check_reference(q, k, v, do, tiles, res)


def test_accumulating_forward_tunes_on_copies(spy):
    """forward_accumulate reads the running out/lse: candidates must run on copies, or the running pair
    would hold several stages' worth after tuning. The second stage (another tile list) reuses the key."""
    log, _ = spy
    q, k, v, _ = data(sq=48, sk=64, seed=3)
    t1 = torch.tensor([[0, 48, 0, 32, FULL]], dtype=torch.int32)
    t2 = torch.tensor([[0, 48, 32, 64, CAUSAL]], dtype=torch.int32)
    timer = FakeTimer(log, {"fwd": B})
    be = TritonBackend(config(autotune=True, autotune_candidates=candidates_for(("fwd",))), timer=timer, tuned={})
    fixed = TritonBackend(TritonConfig({D: StageConfigs(B, DEFAULT, DEFAULT)}))
    outs = []
    for b in (be, fixed):
        out, lse = torch.zeros_like(q), torch.full((48, 2), float("-inf"))
        for t in (t1, t2):
            b.forward_accumulate(q, k, v, b.prepare(t, 48, 64, head_dims=(D,)), SCALE, out, lse)
        outs.append((out, lse))
    assert timer.calls == 4 and len(be.tuned) == 1
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    r_out, r_lse = reference(q, k, v, dense_mask(torch.cat([t1, t2]), 48, 64), SCALE)
    torch.testing.assert_close(outs[0][0].double(), r_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(outs[0][1].double(), r_lse, atol=ATOL, rtol=0)


def test_keys_by_group_and_dtype_ties_keep_default(spy):
    log, _ = spy
    timer = FakeTimer(log, constant=True)
    cands = candidates_for(("fwd",))
    be = TritonBackend(config(autotune=True, autotune_candidates=cands), timer=timer, tuned={})
    tiles = torch.tensor([[0, 32, 0, 32, CAUSAL]], dtype=torch.int32)
    for hkv, dtype in ((1, torch.float32), (2, torch.float32), (1, torch.float16), (1, torch.float32)):
        q, k, v, _ = data(32, 32, hq=4, hkv=hkv, dtype=dtype)
        be.forward(q, k, v, be.prepare(tiles, 32, 32, head_dims=(D,)), SCALE)
    assert sorted((key.group, key.dtype) for key in be.tuned) == [(2, "float32"), (4, "float16"), (4, "float32")]
    assert timer.calls == 3 * 4  # the fourth call met a known key
    assert all(r.config == DEFAULT for r in be.tuned.values()), "ties go to the default"


def test_cpu_without_timer_is_a_no_op(spy):
    log, _ = spy
    q, k, v, do = data(seed=4)
    tiles = tiles48()
    be = TritonBackend(config(autotune=True, autotune_candidates=candidates_for(("fwd", "dkdv", "dq"))), tuned={})
    res = run(be, q, k, v, do, tiles)[1]
    assert be.tuned == {} and log == [("fwd", DEFAULT), ("dkdv", DEFAULT), ("dq", DEFAULT)]
    plain = run(TritonBackend(config()), q, k, v, do, tiles)[1]
    assert all(torch.equal(a, b) for a, b in zip(res, plain))


def test_save_load_roundtrip_and_loaded_winner_used(spy, tmp_path):
    log, _ = spy
    q, k, v, _ = data(seed=5)
    tiles = tiles48()
    row_class = TritonBackend(config()).prepare(tiles, 48, 48, head_dims=(D,)).row_class
    key = at.TuneKey("cpu", D, "float32", 2, row_class, "fwd")
    other = at.TuneKey("NVIDIA H200", 128, "bfloat16", 4, "long", "dq")
    tuned = {key: at.TuneResult(C, {DEFAULT: 2.0, C: 1.5}, {A: "OutOfResources: shared memory"}),
             other: at.TuneResult(KernelConfig(64, 64, 4, 3, True), {}, {})}
    path = tmp_path / "tuned.json"
    at.save_tuned(str(path), tuned)
    assert json.loads(path.read_text())["entries"][0]["config"] == [32, 32, 4, 1, 1]
    loaded = {}
    assert at.load_tuned(str(path), loaded) == 2 and loaded == tuned

    def no_timing(fn):
        raise AssertionError("a loaded key must not be timed")

    be = TritonBackend(config(autotune=True, autotune_candidates=candidates_for(("fwd",))), timer=no_timing,
                       tuned=loaded)
    out, lse = be.forward(q, k, v, be.prepare(tiles, 48, 48, head_dims=(D,)), SCALE)
    assert log == [("fwd", C)]
    r_out, r_lse = reference(q, k, v, dense_mask(tiles, 48, 48), SCALE)
    torch.testing.assert_close(out.double(), r_out, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="format"):
        at.tuned_from_json({"128/long": {}})
