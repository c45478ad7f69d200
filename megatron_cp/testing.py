"""Testing kit: check attention on your own masks the way megatron-cp checks its own.

    import torch, megatron_cp as mcp, megatron_cp.testing as mt
    mask = mcp.masks.varlen([0, 24, 64], causal=True)
    q, k, v, dout = (torch.randn(64, h, 16, dtype=torch.float64) for h in (4, 2, 2, 4))
    ours = mt.distributed_attention(mask, 2, q, k, v, dout, dtype=torch.bfloat16)
    ref, plain = (mt.reference_attention(q, k, v, mask, dout=dout, dtype=t) for t in (torch.float64, torch.bfloat16))
    mt.assert_low_precision_close(ours, ref, plain)

Four pieces:

- ``reference_attention``: dense softmax attention over the whole ``[sq, sk]`` mask, forward and (given
  ``dout``) backward by the textbook formulas, in float64 (the reference) or in a low precision (the plain
  PyTorch computation a low-precision result is measured against).
- the 2x-low-precision rule (``low_precision_errors`` returns the numbers, ``assert_low_precision_close``
  asserts): a low-precision result passes when its rms error against the fp64 reference is at most twice
  the rms error of the plain PyTorch computation in the same precision, plus a floor of
  ``1e-6 x rms(reference)``.
- ``plan_coverage_errors``: the rows where a plan's tiles (every rank's, guest rows' too) do not give exactly
  the mask's keys, checked row by row without a dense matrix (full-size plans: 32k rows in milliseconds).
- ``run_ranks``: a function on N CPU ranks (gloo), each its own process, each rank's result returned;
  ``distributed_attention`` uses it to run ``megatron_cp.attention`` and gather full-sequence results.

Layouts follow megatron_cp.attention: q ``[S, Hq, D]``, k/v ``[S, Hkv, D]`` (Hkv divides Hq), out like q,
lse ``[S, Hq]`` natural log. Dense references hold ``Hq x sq x sk`` scores: small sizes only.
"""

from __future__ import annotations

import gc
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_cp.masks import AttnMask
from megatron_cp.planner import plan as make_plan
from megatron_cp.runtime import attention, dispatch

__all__ = ["Attention", "LowPrecisionError", "dense_mask", "reference_attention", "low_precision_errors",
           "assert_low_precision_close", "free_port", "run_ranks", "distributed_attention"]

FIELDS = ("out", "lse", "dq", "dk", "dv")


class Attention(NamedTuple):
    """Attention results over whole sequences: out ``[sq, Hq, D]``, lse ``[sq, Hq]`` (natural log, -inf on
    rows that keep no key) and, when a backward ran, dq ``[sq, Hq, D]``, dk / dv ``[sk, Hkv, D]`` (else None)."""

    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None


class LowPrecisionError(NamedTuple):
    """One tensor under the 2x rule: ``rms`` / ``max`` error of ours and ``plain_rms`` / ``plain_max`` of the
    plain low-precision computation, both against the fp64 reference; ``bound`` = 2 x plain_rms + floor x
    rms(reference); ``ok``: rms <= bound and ours is -inf / NaN exactly where the reference is."""

    rms: float
    plain_rms: float
    bound: float
    max: float
    plain_max: float
    ok: bool


def dense_mask(mask: AttnMask | np.ndarray | torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool ``[sq, sk]`` tensor of ``mask``: an ``AttnMask`` (``to_dense()``) or a bool array / tensor as is
    (``[Hq, sq, sk]`` per query head also passes)."""
    if isinstance(mask, AttnMask):
        mask = mask.to_dense()
    keep = torch.as_tensor(mask, device=device)
    if keep.dtype != torch.bool or keep.dim() not in (2, 3):
        raise ValueError(f"a dense mask must be a 2-D (or per-head 3-D) bool array, got {keep.dtype} of shape {tuple(keep.shape)}")
    return keep


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnMask | np.ndarray | torch.Tensor,
                        softmax_scale: float | None = None, *, dout: torch.Tensor | None = None,
                        dlse: torch.Tensor | None = None, dtype: torch.dtype = torch.float64) -> Attention:
    """Dense softmax attention of q ``[sq, Hq, D]``, k / v ``[sk, Hkv, D]`` (Hkv divides Hq) under ``mask``
    (an ``AttnMask``, a bool ``[sq, sk]``, or a bool ``[Hq, sq, sk]`` per query head), computed in ``dtype`` (float64: the reference; a low precision:
    the plain PyTorch computation the 2x rule measures against). softmax_scale defaults to ``D ** -0.5``.

    Returns ``Attention`` in ``dtype``: out ``[sq, Hq, D]``, lse ``[sq, Hq]``; with ``dout`` ``[sq, Hq, D]``
    (and optionally ``dlse`` ``[sq, Hq]``, the gradient of lse) also dq, dk, dv of the loss
    ``sum(out * dout) + sum(lse * dlse)`` (lse's -inf rows excluded). Rows that keep no key give out 0,
    lse -inf and zero gradients, never NaN. Nothing here is differentiable (plain formulas, no autograd).
    """
    sq, hq, d = q.shape
    sk, hkv = k.shape[:2]
    if k.shape != v.shape or k.shape[2] != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected q [sq, Hq, D] and "
                         "k, v [sk, Hkv, D] with Hkv dividing Hq")
    keep = dense_mask(mask, q.device)
    if tuple(keep.shape) not in ((sq, sk), (hq, sq, sk)):
        raise ValueError(f"mask shape {tuple(keep.shape)} is neither (sq, sk) = {(sq, sk)} nor (Hq, sq, sk)")
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    g = hq // hkv
    qd = q.detach().to(dtype)
    kk, vv = (x.detach().to(dtype).repeat_interleave(g, 1) for x in (k, v))  # [sk, Hq, D]
    s = torch.einsum("qhd,khd->hqk", qd, kk) * scale
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)  # [Hq, sq]; -inf on rows that keep nothing
    empty = torch.isinf(lse)
    p = torch.exp(s - torch.where(empty, 0.0, lse)[..., None])  # exp(-inf) = 0 on every masked cell
    out = torch.einsum("hqk,khd->qhd", p, vv)
    lse = lse.T.contiguous()
    if dout is None:
        return Attention(out, lse)
    do = dout.detach().to(dtype)
    delta = (do * out).sum(-1)  # [sq, Hq]; dlse enters as d(lse)/d(s) = p, i.e. delta - dlse
    if dlse is not None:
        delta = delta - torch.where(torch.isinf(lse), 0.0, dlse.detach().to(dtype))
    ds = p * (torch.einsum("qhd,khd->hqk", do, vv) - delta.T[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, kk) * scale
    dk = (torch.einsum("hqk,qhd->khd", ds, qd) * scale).reshape(sk, hkv, g, d).sum(2)
    dv = torch.einsum("hqk,qhd->khd", p, do).reshape(sk, hkv, g, d).sum(2)
    return Attention(out, lse, dq, dk, dv)


def _fields(x: Attention | Mapping[str, torch.Tensor | None] | torch.Tensor) -> dict[str, torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return {"out": x}
    items = x._asdict().items() if isinstance(x, Attention) else x.items()
    return {name: t for name, t in items if t is not None}


def _rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt()) if x.numel() else 0.0


def _maxabs(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


def low_precision_errors(ours: Attention | Mapping[str, torch.Tensor | None] | torch.Tensor,
                         reference: Attention | Mapping[str, torch.Tensor | None] | torch.Tensor,
                         plain: Attention | Mapping[str, torch.Tensor | None] | torch.Tensor,
                         floor: float = 1e-6) -> dict[str, LowPrecisionError]:
    """The 2x-low-precision rule's numbers for every tensor ours has (``Attention`` fields, a mapping of
    name -> tensor, or one tensor named "out"): ours, the fp64 ``reference`` and the ``plain`` computation
    in ours' precision (``reference_attention(..., dtype=low)``), same shapes, any dtypes.

    Entries where the reference is not finite (lse's -inf rows) are left out of the rms and max errors and
    must be equal in ours (and are what the plain computation gives there too). Returns {name:
    LowPrecisionError}; ``ok`` says whether that tensor passes.
    """
    ours, reference, plain = _fields(ours), _fields(reference), _fields(plain)
    res = {}
    for name, o in ours.items():
        if name not in reference or name not in plain:
            raise ValueError(f"{name!r} is in ours but not in the reference ({sorted(reference)}) or plain "
                             f"({sorted(plain)})")
        r, lo, o = reference[name].detach().double(), plain[name].detach().double(), o.detach().double()
        if not (o.shape == r.shape == lo.shape):
            raise ValueError(f"{name}: shapes differ: ours {tuple(o.shape)}, reference {tuple(r.shape)}, "
                             f"plain {tuple(lo.shape)}")
        fin = torch.isfinite(r)
        same_specials = bool(torch.equal(o[~fin], r[~fin])) and not bool(torch.isnan(o[fin]).any())
        e, el = o[fin] - r[fin], lo[fin] - r[fin]
        bound = 2 * _rms(el) + floor * _rms(r[fin])
        res[name] = LowPrecisionError(_rms(e), _rms(el), bound, _maxabs(e), _maxabs(el),
                                      same_specials and _rms(e) <= bound)
    return res


def assert_low_precision_close(ours: Attention | Mapping[str, torch.Tensor | None] | torch.Tensor,
                               reference: Attention | Mapping[str, torch.Tensor | None] | torch.Tensor,
                               plain: Attention | Mapping[str, torch.Tensor | None] | torch.Tensor,
                               floor: float = 1e-6) -> dict[str, LowPrecisionError]:
    """``low_precision_errors`` and raise AssertionError naming every tensor that breaks the 2x rule, with
    its numbers; returns the numbers when all pass."""
    errs = low_precision_errors(ours, reference, plain, floor)
    bad = [f"{name}: rms error {e.rms:.3g} > bound {e.bound:.3g} (2 x plain {e.plain_rms:.3g} + floor)"
           if e.rms > e.bound else f"{name}: -inf / NaN entries differ from the reference's"
           for name, e in errs.items() if not e.ok]
    assert not bad, "2x-low-precision rule broken:\n  " + "\n  ".join(bad)
    return errs


class _RowKeys:
    """Per global row: how many keys, their ids' sum and sum of squares, the first and last id. Two sets of keys
    with equal statistics are equal but for collisions no bug is built to make."""

    def __init__(self, rows: int, keys: int):
        self.n, self.s1, self.s2 = (np.zeros(rows, dtype=np.int64) for _ in range(3))
        self.lo, self.hi = np.full(rows, keys, dtype=np.int64), np.full(rows, -1, dtype=np.int64)

    def add(self, row_ids: np.ndarray, key_ids: np.ndarray, traps: np.ndarray) -> None:
        """Trapezoids ``[n, 6]`` (``AttnMask.traps``: rows index ``row_ids``, keys index ``key_ids``)."""
        key_ids = np.asarray(key_ids, dtype=np.int64)
        p1 = np.concatenate([[0], np.cumsum(key_ids)])
        p2 = np.concatenate([[0], np.cumsum(key_ids * key_ids)])
        for q0, q1, lo_a, lo_s, hi_a, hi_s in np.asarray(traps, dtype=np.int64).reshape(-1, 6).tolist():
            i = np.arange(q0, q1, dtype=np.int64)
            r, a, b = row_ids[q0:q1], lo_a + lo_s * i, hi_a + hi_s * i  # every row of a trapezoid keeps a key
            np.add.at(self.n, r, b - a)
            np.add.at(self.s1, r, p1[b] - p1[a])
            np.add.at(self.s2, r, p2[b] - p2[a])
            np.minimum.at(self.lo, r, key_ids[a])
            np.maximum.at(self.hi, r, key_ids[b - 1])

    def differ(self, other: "_RowKeys") -> np.ndarray:
        return ((self.n != other.n) | (self.s1 != other.s1) | (self.s2 != other.s2) | (self.lo != other.lo)
                | (self.hi != other.hi))


def _tile_traps(tiles, rows: int, keys: int) -> np.ndarray:
    """Each tile ``(q0, q1, k0, k1, kind)`` as its own trapezoid (not their union: a cell computed twice counts
    twice)."""
    from megatron_cp.masks import KINDS, AttnSlice

    out = [AttnMask([AttnSlice((q0, q1), (k0, k1), KINDS[kind])], rows, keys).traps
           for q0, q1, k0, k1, kind in np.asarray(tiles).tolist()]
    return np.concatenate(out) if out else np.zeros((0, 6), dtype=np.int64)


def plan_coverage_errors(plan, mask: AttnMask) -> np.ndarray:
    """Global row ids where ``plan``'s tiles do not compute exactly ``mask``'s keys (once each): every rank's own
    rows against its key buffer, and the guest rows it computes on its own keys. Empty: the plan is exact."""

    def runs_to_ids(runs):
        runs = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in runs] + [np.zeros(0, dtype=np.int64)])

    got, want = _RowKeys(mask.seqlen_q, mask.seqlen_k), _RowKeys(mask.seqlen_q, mask.seqlen_k)
    for rp in plan.ranks:
        own, buf = rp.local_ids(), runs_to_ids(rp.buffer_runs)
        got.add(own, buf, _tile_traps(rp.tiles, len(own), len(buf)))
        if len(rp.guest_tiles):
            guests = runs_to_ids(np.concatenate([runs for runs in rp.guest_recv_runs if len(runs)]))
            got.add(guests, own, _tile_traps(rp.guest_tiles, len(guests), len(own)))
    want.add(np.arange(mask.seqlen_q), np.arange(mask.seqlen_k), mask.traps)  # disjoint: each cell once
    return np.nonzero(got.differ(want))[0]


# -- N ranks, each its own process -----------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a tcp:// rendezvous), below the kernel's
    ephemeral range: a port of that range (what binding port 0 gives) can be taken as the local end of any
    connection (gloo opens many) between this call and the rendezvous binding it, and the rendezvous then fails
    with EADDRINUSE."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = np.random.default_rng()
    for port in rng.integers(max(1024, low // 2), max(1025, low), size=64).tolist():
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every candidate busy: one of the ephemeral range
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refuse_tensors(x, where: str) -> None:
    """TypeError for a torch.Tensor anywhere in a result: its shared memory leaves with the rank's process, and
    the parent then fails to unpickle it with a bare FileNotFoundError."""
    if isinstance(x, torch.Tensor):
        raise TypeError(f"{where} holds a torch.Tensor {tuple(x.shape)}: return t.numpy() (or plain values) from "
                        "a run_ranks worker")
    if isinstance(x, dict):
        for k, v in x.items():
            _refuse_tensors(v, f"{where}[{k!r}]")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _refuse_tensors(v, f"{where}[{i}]")


# what a rank process imports before it runs anything: loaded once by the fork server, then each rank is a fork of it
_PRELOAD = ("torch", "numpy", "torch.distributed", "megatron_cp", "megatron_cp.testing")


def process_context(preload: tuple[str, ...] = ()):
    """The multiprocessing context CPU rank processes start from: a fork server that has imported torch and
    megatron_cp once (and the modules ``preload``, e.g. ``megatron.core``, in that order), so a rank starts in
    milliseconds instead of importing them anew (seconds each: megatron.core alone takes ~5 s of CPU, the bulk
    of a small multi-rank check). Each rank is a fresh fork of that server (no state of an earlier world) and
    gets the caller's sys.path, working directory and main module as a spawned one would; the server never
    touches CUDA. The server is one per process, started by the first rank process: the preload list set last
    before then holds. It imports on its own default path (Python 3.12 does not give it the caller's sys.path),
    so ``preload`` names installed modules or ones on the PYTHONPATH the server starts with; one that does not
    import is skipped."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*_PRELOAD, *preload])
    return ctx


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, results) -> None:
    torch.set_num_threads(1)
    gc.freeze()  # the fork server's imports are never garbage: a collection the check makes skips them
    try:  # the rendezvous is explicit (no MASTER_ADDR / MASTER_PORT read from the environment)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        # gloo connects the ranks pair by pair: a rank whose pairs are up may run a quick check, exit and close
        # its sockets while another still connects, which then fails its init ("connection closed by peer").
        # Past this barrier every rank has finished connecting.
        dist.barrier()
        out = fn(rank, world, *args)
        _refuse_tensors(out, f"{getattr(fn, '__name__', fn)}'s result")
        results.put((rank, "ok", out))
    except BaseException:  # report every failure to the parent, never leave it waiting
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _died_without_result(procs, got: dict, reporting: int, wait_s: float = 1.0) -> dict[int, int]:
    """{rank: exit code} of the ranks that exited with a failure code and no result, waiting up to ``wait_s``
    for one that is still going down."""
    end = time.monotonic() + wait_s
    while True:
        died = {r: p.exitcode for r, p in enumerate(procs)
                if r not in got and r != reporting and p.exitcode not in (None, 0)}
        if died or time.monotonic() >= end:
            return died
        time.sleep(0.05)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Call ``fn(rank, world, *args)`` on ``world`` CPU ranks, each its own process (a fork of
    ``process_context``'s server) with a gloo process group (the default group) set up; return the results in
    rank order.

    ``fn`` and ``args`` must pickle (``fn`` a module-level function) and so must the results; return plain
    values or numpy arrays rather than tensors (a tensor's shared memory may leave with its process). Raises
    AssertionError with the remote traceback as soon as a rank fails, within seconds when a rank exits without a
    word, and when no further rank reports within ``timeout`` seconds (a hang); leftover processes are
    terminated, so nothing hangs. Scripts calling it need an ``if __name__ == "__main__":`` guard (spawn).
    """
    import sys

    # Megatron too where the caller has it: its start-up warnings then print once, in the server
    ctx = process_context(("megatron.core",) if "megatron.core" in sys.modules else ())
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    got, error = {}, None
    deadline, dead_since = time.monotonic() + timeout, {}
    try:
        while len(got) < world and error is None:
            try:
                rank, status, payload = results.get(timeout=1.0)
            except queue_mod.Empty:
                now = time.monotonic()
                missing = [r for r in range(world) if r not in got]
                codes = {r: procs[r].exitcode for r in missing}
                for r in missing:
                    if codes[r] is not None:
                        dead_since.setdefault(r, now)
                # a rank that exited 2 s ago without a result will not send one (its queue has flushed)
                gone = [r for r in missing if r in dead_since and now - dead_since[r] >= 2.0]
                if gone:
                    error = f"ranks {gone} exited without a result (exit codes, None = still running: {codes})"
                elif now >= deadline:
                    error = f"no result within {timeout}s from ranks {missing} (exit codes, None = still running: {codes})"
                continue
            deadline = time.monotonic() + timeout
            if status == "ok":
                got[rank] = payload
            else:
                error = f"rank {rank} of {world} failed:\n{payload}"
                # a rank that died without a word is usually why another's collective failed (connection reset):
                # name it first
                died = _died_without_result(procs, got, rank)
                if died:
                    error = (f"ranks {sorted(died)} exited without a result (exit codes: {died}); then " + error)
    finally:
        for p in procs:
            p.join(timeout=5 if error else 30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    if error is not None:
        raise AssertionError(error)
    return [got[r] for r in range(world)]


def _attention_rank(rank: int, world: int, mask: AttnMask, tensors: dict, scale: float | None, dtype: torch.dtype,
                    plan_kwargs: dict, attention_kwargs: dict) -> dict:
    """One rank of ``distributed_attention``: this rank's token ids and its results as float64 numpy arrays
    (exact for every float dtype up to float64)."""
    group = dist.group.WORLD
    plan = make_plan(mask, world, **plan_kwargs)
    q, k, v = (dispatch(torch.from_numpy(tensors[n]).to(dtype), plan, group).detach().requires_grad_()
               for n in ("q", "k", "v"))
    out, lse = attention(q, k, v, plan, group, softmax_scale=scale, **attention_kwargs)
    ids = torch.from_numpy(plan.local_ids(rank))
    res = {"ids": ids.numpy(), "out": out, "lse": lse}
    if tensors.get("dout") is not None:
        loss = (out.double() * torch.from_numpy(tensors["dout"])[ids].to(out.dtype).double()).sum()
        if tensors.get("dlse") is not None:
            loss = loss + (torch.where(torch.isinf(lse), 0.0, lse).double() * torch.from_numpy(tensors["dlse"])[ids]).sum()
        loss.backward()
        res.update(dq=q.grad, dk=k.grad, dv=v.grad)
    return {n: (t.detach().double().numpy() if isinstance(t, torch.Tensor) else t) for n, t in res.items()}


def distributed_attention(mask: AttnMask, world: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          dout: torch.Tensor | None = None, dlse: torch.Tensor | None = None, *,
                          softmax_scale: float | None = None, dtype: torch.dtype | None = None,
                          plan_kwargs: dict | None = None, timeout: float = 300.0, **attention_kwargs: Any) -> Attention:
    """``megatron_cp.attention`` over ``mask`` on ``world`` gloo CPU ranks (``run_ranks``), results gathered
    into whole-sequence order.

    q ``[S, Hq, D]``, k / v ``[S, Hkv, D]`` and dout ``[S, Hq, D]`` / dlse ``[S, Hq]`` (optional; the gradient
    of out / lse) are whole sequences; every rank plans ``megatron_cp.plan(mask, world, **plan_kwargs)``,
    dispatches its part in ``dtype`` (default q's), runs attention with ``softmax_scale`` and
    ``attention_kwargs`` and, given dout, backward of ``sum(out * dout) + sum(lse * dlse)`` (dout rounded to
    ``dtype`` first, as ``reference_attention(..., dtype=dtype)`` does). Returns
    ``Attention``: out, dq ``[S, Hq, D]`` and dk, dv ``[S, Hkv, D]`` in ``dtype``, lse ``[S, Hq]`` float32
    (float64 for float64 ``dtype``, as the attention returns it; dq, dk, dv None without dout). Same script
    guard as ``run_ranks``.
    """
    dtype = q.dtype if dtype is None else dtype
    tensors = {n: (None if t is None else t.detach().cpu().double().numpy())
               for n, t in (("q", q), ("k", k), ("v", v), ("dout", dout), ("dlse", dlse))}
    ranks = run_ranks(_attention_rank, world, mask, tensors, softmax_scale, dtype, dict(plan_kwargs or {}),
                      attention_kwargs, timeout=timeout)
    full = {}
    for name in FIELDS:
        if name not in ranks[0]:
            full[name] = None
            continue
        first = ranks[0][name]
        t = torch.empty((q.shape[0], *first.shape[1:]), dtype=torch.float64)
        for r in ranks:
            t[torch.from_numpy(r["ids"])] = torch.from_numpy(r[name])
        full[name] = t.to((torch.float64 if dtype == torch.float64 else torch.float32) if name == "lse" else dtype)
    return Attention(**full)
