"""Routes by measured cost (kernels/fa4/measured.py): where a list could run on FA4 or on Triton, each is timed
once per list class on the device in hand and the faster runs, forward and backward apart; a class timed once is
not timed again; one dense FA4 call, full or causal, is never timed; without a timer (the CPU) the rules of calls.py hold. FA4 runs
through the reference of its call semantics (tests/fa4_semantics.py); timings come from a scripted timer that
also checks which candidate it was given."""

from __future__ import annotations

import pytest
import torch

import fa4_semantics
import megatron_cp as mcp
from megatron_cp.kernels import FA4Backend, TritonConfig
from megatron_cp.kernels.fa4.backend import Fa4Functions
from megatron_cp.masks import catalog
from megatron_cp.masks.catalog import tiles_to_dense
from megatron_cp.testing import reference_attention

# float32, a dtype both candidates run (the Triton kernels run on the CPU under TRITON_INTERPRET)
EMULATED = Fa4Functions(fa4_semantics.fwd, fa4_semantics.bwd, "reference", (torch.float32,),
                        fa4_semantics.block_sparse, fa4_semantics.interval_masks(), fa4_semantics.band_mask)


class ScriptedTimer:
    """Times the candidates as scripted, in the order they are given ("varlen", "blocks" where FA4 has them, then
    "triton"), class after class; keeps what each run returned and fails when asked more often than scripted."""

    def __init__(self, *times):
        self.left = list(times)
        self.ran = []

    def __call__(self, fn):
        if not self.left:
            raise AssertionError("a class was timed that the test did not expect")
        self.ran.append(fn())
        return self.left.pop(0)


S = 256
TOL = 2e-5  # float32 kernels against the float64 reference
MASKS = {"streaming": lambda: mcp.masks.streaming(S, 4, 65),  # 3 varlen calls or one block-sparse call with
         # every block partial: the prior's forward is FA4's, its backward Triton's (the partial-block rule)
         "causal": lambda: mcp.masks.causal(S),  # one dense call
         "strided": lambda: mcp.masks.strided(S, 8, 2, local_blocks=1),  # 16 varlen calls, no block-sparse form
         "packed": lambda: mcp.masks.varlen([0, 50, 150, S], causal=True),  # one varlen call
         "window": lambda: mcp.masks.sliding_window(S, 32, 0)}  # one dense call with a window


def _case(name, s=S, hq=4, hkv=2, d=16, seed=0):
    tiles = catalog.tiles(MASKS[name]())
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(s, hq, d, generator=g) for _ in range(2))
    k, v = (torch.randn(s, hkv, d, generator=g) for _ in range(2))
    ref = reference_attention(q, k, v, tiles_to_dense(tiles, s, s), 0.25, dout=do)
    ref = type(ref)(*(None if t is None else t.float() for t in ref))
    return tiles, (q, k, v, do), ref


TIMES = {"varlen": (1e-3, 2e-3, 3e-3), "blocks": (2e-3, 1e-3, 3e-3), "triton": (2e-3, 3e-3, 1e-3)}


@pytest.mark.parametrize("faster", ["varlen", "blocks", "triton"])
def test_the_fastest_candidate_runs_and_its_class_is_timed_once(faster):
    """The streaming list: 3 varlen calls or one block-sparse call (every block partial) on FA4, or Triton; the
    prior runs its forward block-sparse and its backward on Triton (the partial-block rule)."""
    tiles, (q, k, v, do), ref = _case("streaming")
    timer = ScriptedTimer(*TIMES[faster], *TIMES[faster])  # the forward's class, then the backward's
    be = FA4Backend(functions=EMULATED, timer=timer)
    prep = be.prepare(tiles, S, S)
    assert (prep.calls.route("fwd"), prep.calls.route("bwd"), len(prep.calls.fwd)) == ("blocks", "triton", 3)
    out, lse = be.forward(q, k, v, prep, 0.25)
    if faster == "triton":
        assert be.last_path.startswith("triton (measured fastest here: 1.000 ms against FA4's varlen 2.000 ms")
    else:
        assert be.last_path == "fa4"
    torch.testing.assert_close(out, ref.out, rtol=TOL, atol=TOL)
    torch.testing.assert_close(lse, ref.lse, rtol=TOL, atol=TOL)
    dq, dk, dv = be.backward(q, k, v, ref.out, ref.lse, do, prep, 0.25)
    assert be.last_path == "fa4" if faster != "triton" else be.last_path.startswith("triton (measured")
    for got, want in ((dq, ref.dq), (dk, ref.dk), (dv, ref.dv)):
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    assert len(timer.ran) == 6 and not timer.left
    for got in timer.ran[:3]:  # each timed forward candidate computed the same attention
        torch.testing.assert_close(got[0], ref.out, rtol=TOL, atol=TOL)
    for got in timer.ran[3:]:  # and each backward candidate the same gradients
        torch.testing.assert_close(got[1], ref.dk, rtol=TOL, atol=TOL)
    routes = be.describe()["routes"]
    assert [r["runs"] for r in routes] == [faster, faster] and [r["class"][1] for r in routes] == ["fwd", "bwd"]
    assert routes[0]["triton_ms"] == TIMES[faster][2] * 1e3
    # another list of the same class (a new plan's, other inputs): no timing (the timer would fail), same routes
    prep2 = be.prepare(tiles, S, S)
    _, (q2, k2, v2, do2), ref2 = _case("streaming", seed=1)
    acc = torch.zeros_like(q2)
    run = torch.full(q2.shape[:2], float("-inf"))
    be.forward_accumulate(q2, k2, v2, prep2, 0.25, acc, run)
    torch.testing.assert_close(acc, ref2.out, rtol=TOL, atol=TOL)
    sums = [torch.zeros_like(t) for t in (q2, k2, v2)]
    be.backward_into(q2, k2, v2, ref2.out, ref2.lse, do2, prep2, 0.25, None, *sums)
    assert be.last_path == "fa4" if faster != "triton" else be.last_path.startswith("triton (measured")
    # the route chosen is the one that runs: on the untimed list only its FA4 launches were built
    assert {key[2] for key in prep2._device} == (set() if faster == "triton" else {faster})
    for got, want in zip(sums, (ref2.dq, ref2.dk, ref2.dv)):
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_one_varlen_call_is_timed_but_one_dense_call_never():
    tiles, (q, k, v, do), ref = _case("packed")
    be = FA4Backend(functions=EMULATED, timer=ScriptedTimer(1e-3, 2e-3))  # varlen (no block form), Triton
    out, _ = be.forward(q, k, v, be.prepare(tiles, S, S), 0.25)
    ((route,),) = [be.describe()["routes"]]
    assert route["runs"] == "varlen" and route["class"][8:] == (1, 0, None)  # 1 call, < 1 block's cells, no blocks
    torch.testing.assert_close(out, ref.out, rtol=TOL, atol=TOL)
    tiles, (q, k, v, do), ref = _case("causal")
    be = FA4Backend(functions=EMULATED, timer=ScriptedTimer())  # any timing fails
    prep = be.prepare(tiles, S, S)
    out, _ = be.forward(q, k, v, prep, 0.25)
    be.backward(q, k, v, ref.out, ref.lse, do, prep, 0.25)
    assert be.last_path == "fa4" and be.describe()["routes"] == []
    torch.testing.assert_close(out, ref.out, rtol=TOL, atol=TOL)
    tiles, (q, k, v, do), ref = _case("streaming")
    be = FA4Backend(functions=EMULATED)  # no timer, CPU tensors: the prior's routes, nothing timed
    prep = be.prepare(tiles, S, S)
    be.forward(q, k, v, prep, 0.25)
    assert be.last_path == "fa4"
    be.backward(q, k, v, ref.out, ref.lse, do, prep, 0.25)
    assert be.last_path.startswith("triton (") and "partial blocks" in be.last_path
    assert be.describe()["routes"] == []


def test_one_dense_call_with_a_window_is_timed_and_the_faster_runs():
    """A sliding window is one dense FA4 call, but not FA4's own best case (a narrow window's backward can run faster
    on Triton): both directions are timed, and each runs the faster, exactly."""
    tiles, (q, k, v, do), ref = _case("window")
    be = FA4Backend(functions=EMULATED, timer=ScriptedTimer(1e-3, 2e-3, 2e-3, 1e-3))  # fwd: FA4 faster; bwd: Triton
    prep = be.prepare(tiles, S, S)
    assert prep.calls.fwd[0].dense and prep.calls.fwd[0].left is not None
    out, lse = be.forward(q, k, v, prep, 0.25)
    assert be.last_path == "fa4"
    grads = be.backward(q, k, v, out, lse, do, prep, 0.25)
    assert be.last_path.startswith("triton (measured fastest here")
    assert [r["runs"] for r in be.describe()["routes"]] == ["varlen", "triton"]
    torch.testing.assert_close(out, ref.out, rtol=TOL, atol=TOL)
    for g, want in zip(grads, (ref.dq, ref.dk, ref.dv)):
        torch.testing.assert_close(g, want, rtol=TOL, atol=TOL)


def test_many_varlen_calls_without_a_block_form_are_not_timed(monkeypatch):
    """16 varlen calls and no block-sparse form (rows of more than two key intervals on partial blocks, their
    periodic band not looked for and their bitmap over its cap): the prior's Triton, nothing timed (FA4 has no
    candidate worth timing: each call a launch)."""
    from megatron_cp.kernels.fa4 import calls as fc
    from megatron_cp.kernels.fa4 import cells

    monkeypatch.setattr(fc, "BITMAP_MAX_BYTES", 0)
    monkeypatch.setattr(cells, "PERIODIC_CHECK_MAX_CELLS", 0)
    tiles, (q, k, v, do), ref = _case("strided")
    be = FA4Backend(functions=EMULATED, timer=ScriptedTimer())  # any timing fails
    prep = be.prepare(tiles, S, S)
    assert len(prep.calls.fwd) == 16 and prep.calls.blocks is None
    out, _ = be.forward(q, k, v, prep, 0.25)
    assert be.last_path.startswith("triton (16 varlen calls") and be.describe()["routes"] == []
    torch.testing.assert_close(out, ref.out, rtol=TOL, atol=TOL)


def test_deterministic_mode_times_nothing():
    """Deterministic mode takes the same kernels in every run: the rules, never a timing's pick."""
    tiles, (q, k, v, do), ref = _case("streaming")
    be = FA4Backend(TritonConfig(deterministic=True), functions=EMULATED, timer=ScriptedTimer())
    prep = be.prepare(tiles, S, S)
    out, _ = be.forward(q, k, v, prep, 0.25)
    be.backward(q, k, v, ref.out, ref.lse, do, prep, 0.25)
    assert be.describe()["routes"] == [] and be.last_path.startswith("triton (") and "partial" in be.last_path
    torch.testing.assert_close(out, ref.out, rtol=TOL, atol=TOL)


def test_a_candidate_that_fails_is_left_out_and_shown():
    """A timed candidate that raises (once per class) is left out where another ran, its error in describe();
    where every candidate fails, the error is raised."""
    tiles, (q, k, v, do), ref = _case("streaming")
    be = FA4Backend(functions=EMULATED, timer=ScriptedTimer(1e-3, 2e-3))  # blocks, then Triton: varlen fails
    prep = be.prepare(tiles, S, S)
    real = be._fa4_forward

    def broken(q, k, v, prepared, scale, route):
        if route == "varlen":
            raise RuntimeError("varlen launch failed")
        return real(q, k, v, prepared, scale, route)

    be._fa4_forward = broken
    out, _ = be.forward(q, k, v, prep, 0.25)
    torch.testing.assert_close(out, ref.out, rtol=TOL, atol=TOL)
    routes = be.describe()["routes"]
    assert routes[0]["runs"] == "blocks" and "varlen_ms" not in routes[0]
    assert routes[1]["failed"] == "varlen" and "varlen launch failed" in routes[1]["error"]

    def fails(*a, **kw):
        raise RuntimeError("no kernel ran")

    be2 = FA4Backend(functions=EMULATED, timer=lambda fn: (fn(), 1.0)[1])
    be2.triton.forward = be2._fa4_forward = fails
    with pytest.raises(RuntimeError, match="no kernel ran"):
        be2.forward(q, k, v, be2.prepare(tiles, S, S), 0.25)


@pytest.mark.parametrize("gpu_ms, host_ms", [(4.0, 1.0), (0.5, 3.0)])
def test_a_candidate_costs_the_larger_of_its_gpu_time_and_its_host_issue_time(monkeypatch, gpu_ms, host_ms):
    """measured.cuda_time: two untimed runs, then three runs behind a spin; the cost is the fastest run's GPU time
    (between CUDA events) or the fastest run's issue time on the host, whichever is larger (back-to-back layer
    calls: a list with little GPU work costs the step its host time). CUDA's events, spin and sync are stand-ins
    here: each run's GPU time is ``gpu_ms`` (+ 1 ms on the first timed run), its issue time ``host_ms``."""
    import time as time_mod

    from megatron_cp.kernels.fa4 import measured

    clock = {"host": 0.0, "gpu": 0.0}

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = clock["gpu"]

        def elapsed_time(self, other):
            return other.at - self.at

        def synchronize(self):
            pass

    runs = []

    def fn():
        runs.append(1)
        clock["host"] += host_ms / 1e3
        clock["gpu"] += gpu_ms + (1.0 if len(runs) == 3 else 0.0)  # the first timed run is slower on the GPU

    monkeypatch.setattr(measured.torch.cuda, "Event", Event)
    monkeypatch.setattr(measured.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(measured.torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(time_mod, "perf_counter", lambda: clock["host"])
    cost = measured.cuda_time(fn)
    assert len(runs) == 5  # two untimed, three timed
    assert cost == pytest.approx(max(gpu_ms, host_ms) / 1e3)
