"""megatron_cp.testing, the kit the other tests use: the fp64 reference against autograd through a plain
masked softmax, the 2x-low-precision rule's numbers and message, run_ranks' results and failures, and the
docs/support.md's "Test your own masks" example run as written."""

from __future__ import annotations

import os
import pathlib
import re
import time

import pytest
import torch

import megatron_cp as mcp
import megatron_cp.testing as mt

SUPPORT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "support.md"


def _inputs(sq, sk, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(sq, hq, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(sk, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, do, torch.randn(sq, hq, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2), (4, 1)])
def test_reference_matches_autograd_of_a_masked_softmax(hq, hkv):
    # sq != sk, overlapping slices of every kind, rows 0..3 keep no key
    mask = mcp.AttnMask([mcp.AttnSlice((3, 30), (0, 20), "causal"), mcp.AttnSlice((10, 37), (15, 44), "bi_causal"),
                         mcp.AttnSlice((3, 37), (40, 44), "full"), mcp.AttnSlice((20, 37), (0, 9), "inv_causal")], 37, 44)
    keep = torch.as_tensor(mask.to_dense())
    empty = ~keep.any(1)
    assert empty[:3].all() and not empty[3:].any()
    q, k, v, do, dl = _inputs(37, 44, hq, hkv, 8)
    ref = mt.reference_attention(q, k, v, mask, 0.4, dout=do, dlse=dl)
    assert all(t.dtype == torch.float64 and not torch.isnan(t).any() for t in ref)
    assert [tuple(t.shape) for t in ref] == [(37, hq, 8), (37, hq), (37, hq, 8), (44, hkv, 8), (44, hkv, 8)]
    assert (ref.out[empty] == 0).all() and (ref.lse[empty] == float("-inf")).all() and (ref.dq[empty] == 0).all()
    assert torch.isfinite(ref.lse[~empty]).all()
    # the same loss by autograd, key heads repeated per query head, scores of empty rows left out
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    g = hq // hkv
    s = torch.einsum("qhd,khd->hqk", qa[~empty], ka.repeat_interleave(g, 1)) * 0.4
    s = s.masked_fill(~keep[~empty], float("-inf"))
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), va.repeat_interleave(g, 1))
    lse = torch.logsumexp(s, -1).T
    ((out * do[~empty]).sum() + (lse * dl[~empty]).sum()).backward()
    for got, want in ((ref.out[~empty], out), (ref.lse[~empty], lse), (ref.dq, qa.grad), (ref.dk, ka.grad),
                      (ref.dv, va.grad)):
        assert (got - want.detach()).abs().max() < 1e-12
    # a dense bool mask gives the same; no dout, no gradients
    fwd = mt.reference_attention(q, k, v, keep, 0.4)
    assert fwd.dq is None and torch.equal(fwd.out, ref.out) and torch.equal(fwd.lse, ref.lse)
    # low precision: the same computation in bf16, close to the fp64 one
    low = mt.reference_attention(q, k, v, mask, 0.4, dout=do, dlse=dl, dtype=torch.bfloat16)
    assert low.out.dtype == torch.bfloat16 and (low.out.double() - ref.out).abs().max() < 0.05
    assert torch.equal(torch.isinf(low.lse), torch.isinf(ref.lse)) and not any(torch.isnan(t).any() for t in low)


def test_reference_errors_name_the_bad_value():
    q, k, v, _, _ = _inputs(8, 8, 4, 2, 4)
    with pytest.raises(ValueError, match=r"k \(8, 3, 4\)"):
        mt.reference_attention(q, torch.randn(8, 3, 4), torch.randn(8, 3, 4), mcp.masks.causal(8))
    with pytest.raises(ValueError, match=r"mask shape \(8, 9\)"):
        mt.reference_attention(q, k, v, mcp.masks.causal(8, 9))
    with pytest.raises(ValueError, match=r"2-D \(or per-head 3-D\) bool array, got torch.float32"):
        mt.reference_attention(q, k, v, torch.ones(8, 8))
    with pytest.raises(ValueError, match=r"mask shape \(3, 8, 8\)"):
        mt.reference_attention(q, k, v, torch.ones(3, 8, 8, dtype=torch.bool))


def test_reference_per_head_mask_is_each_head_alone():
    q, k, v, dout, _ = _inputs(8, 8, 4, 2, 4)
    g = torch.Generator().manual_seed(5)
    masks = torch.rand(4, 8, 8, generator=g) < 0.5
    both = mt.reference_attention(q, k, v, masks, dout=dout)
    for h in range(4):
        one = mt.reference_attention(q[:, h:h + 1], k[:, h // 2:h // 2 + 1], v[:, h // 2:h // 2 + 1], masks[h],
                                     dout=dout[:, h:h + 1])
        torch.testing.assert_close(both.out[:, h], one.out[:, 0], rtol=0, atol=0)
        torch.testing.assert_close(both.dq[:, h], one.dq[:, 0], rtol=1e-12, atol=1e-12)


def test_low_precision_rule_numbers_and_message():
    ref = {"out": torch.tensor([1.0, -1.0, 2.0, -2.0], dtype=torch.float64),
           "lse": torch.tensor([0.5, float("-inf")], dtype=torch.float64)}
    plain = {"out": ref["out"] + torch.tensor([0.1, -0.1, 0.1, -0.1]), "lse": torch.tensor([0.6, float("-inf")])}
    floor = 1e-6 * (10 / 4) ** 0.5  # 1e-6 x rms(reference out)
    e = mt.low_precision_errors({"out": ref["out"] + 0.2}, ref, plain)["out"]
    assert e.rms == pytest.approx(0.2) and e.plain_rms == pytest.approx(0.1) and e.max == pytest.approx(0.2)
    assert e.bound == pytest.approx(0.2 + floor) and e.ok
    e = mt.low_precision_errors({"out": ref["out"] + 0.2 + 2 * floor}, ref, plain)["out"]
    assert not e.ok
    # -inf entries must coincide and are left out of the numbers
    errs = mt.low_precision_errors({"lse": torch.tensor([0.55, float("-inf")])}, ref, plain)
    assert errs["lse"].ok and errs["lse"].rms == pytest.approx(0.05)
    assert not mt.low_precision_errors({"lse": torch.tensor([0.5, 0.0])}, ref, plain)["lse"].ok
    # the assertion names each failing tensor with its numbers and passes the good ones through
    with pytest.raises(AssertionError, match=r"out: rms error 0\.3 > bound 0\.2.*\n.*lse: -inf / NaN entries"):
        mt.assert_low_precision_close({"out": ref["out"] + 0.3, "lse": torch.tensor([0.5, 0.0])}, ref, plain)
    assert set(mt.assert_low_precision_close(mt.Attention(ref["out"], ref["lse"]), ref, plain)) == {"out", "lse"}
    with pytest.raises(ValueError, match="'dq' is in ours"):
        mt.low_precision_errors({"dq": ref["out"]}, ref, plain)


def _rank_result(rank, world, tag):
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return (tag, rank, world, float(t))


def _rank_fails(rank, world):
    if rank == 1:
        raise RuntimeError("rank one says no")
    return rank


def _rank_dies(rank, world):
    if rank == 0:
        os._exit(3)
    return rank


def _rank_dies_and_a_peer_fails(rank, world, running):
    if rank == 0:
        # die once the peer runs (on a loaded machine its start can take seconds): its failure then follows
        # within 0.3 s, well before the 2 s in which a silent exit is noticed
        t = time.monotonic()
        while not os.path.exists(running) and time.monotonic() - t < 60:
            time.sleep(0.01)
        os._exit(3)
    open(running, "w").close()
    time.sleep(0.3)
    raise RuntimeError("my peer is gone")


def _rank_returns_a_tensor(rank, world):
    return {"out": torch.ones(2, 3)}


def test_run_ranks_results_and_failures(tmp_path):
    assert mt.run_ranks(_rank_result, 3, "x") == [("x", r, 3, 6.0) for r in range(3)]
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 failed:.*RuntimeError: rank one says no"):
        mt.run_ranks(_rank_fails, 2)
    # a rank that dies without a word: no hang and no wait for the timeout, an error naming it
    t = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[0\] exited without a result.*0: 3"):
        mt.run_ranks(_rank_dies, 2, timeout=120)
    assert time.monotonic() - t < 60
    # ... and named first when a peer's failure (e.g. a reset connection) reports before its silence is noticed
    with pytest.raises(AssertionError, match=r"ranks \[0\] exited without a result \(exit codes: \{0: 3\}\); then "
                                             r"rank 1 of 2 failed:(?s:.*)RuntimeError: my peer is gone"):
        mt.run_ranks(_rank_dies_and_a_peer_fails, 2, str(tmp_path / "running"))
    # a tensor in a result: a message saying what to return, not the parent's bare FileNotFoundError
    with pytest.raises(AssertionError, match=r"_rank_returns_a_tensor's result\['out'\] holds a torch.Tensor \(2, 3\)"):
        mt.run_ranks(_rank_returns_a_tensor, 2)


def test_support_doc_example_runs_as_written():
    text = SUPPORT.read_text()
    section = text[text.index("## Test your own masks"):]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(code.strip().splitlines()) == 6  # the import line and five more
    scope = {}
    exec(compile(code, "docs/support.md", "exec"), scope)  # raises if the 2x rule breaks
    ours, ref = scope["ours"], scope["ref"]
    assert ours.out.dtype == torch.bfloat16 and ours.lse.dtype == torch.float32 and ours.dk.shape == (64, 2, 16)
    errs = mt.low_precision_errors(ours, ref, scope["plain"])
    assert set(errs) == {"out", "lse", "dq", "dk", "dv"} and all(e.ok and 0 < e.rms for e in errs.values())
    # the prose after it: in float64 the same check is exact to rounding, lse included
    assert "within 1e-12" in section
    exact = mt.distributed_attention(scope["mask"], 2, *(scope[n] for n in ("q", "k", "v", "dout")), dtype=torch.float64)
    assert exact.lse.dtype == torch.float64
    worst = {n: float((getattr(exact, n) - getattr(ref, n)).nan_to_num(posinf=0, neginf=0).abs().max()) for n in mt.FIELDS}
    assert all(e <= 1e-12 for e in worst.values()), worst


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    """free_port: a port that binds, outside the range the kernel hands out as connections' local ends (a port of
    that range was taken by some connection before torchrun's rendezvous bound it: EADDRINUSE)."""
    import socket

    low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").exists() else 32768
    ports = [mt.free_port() for _ in range(8)]
    assert all(1024 <= p < low for p in ports), (ports, low)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
