"""A CP rank that raises alone tells its peers, so that every rank raises and none waits or finishes.

Where one rank of a CP group finds a mistake its peers cannot see (a later attention call whose head counts or
dtype only it changed, ``state.verify_plan``; an input check that fails on it alone), those peers are already in
that call's exchange or cross-rank check: on NCCL their GPU waits there without end and their host runs on, and on
gloo they wait until the rank exits. So the rank posts its message in the group's store before it raises
(``post``, ``tell_peers``); each peer has a watcher
(``watch``: a daemon thread per gloo twin of a group, started by a plan's first check on the group), which
waits for that one key on a store client of its own (a blocked wait, no traffic: a job of thousands of ranks
would load the store with polls) and on finding it (unless its own rank posts the same fault within ``ALIKE_S``:
every rank met the error and raises it itself) raises the same ``RanksDisagreeError`` in the peer's step
thread and aborts the CP group, which ends a wait on its exchange (NCCL kernels leave on an abort). No collective
and nothing on the step's path: a wait on another thread, and a look at a dict in every call (``raise_posted``).
"""

from __future__ import annotations

import ctypes
import datetime
import threading
import time
import weakref

import torch.distributed as dist

from ..comm import loopback
from .groups import group_token, host_group

WAIT_S = 60.0  # a watcher's wait for its group's fault key, renewed (a store's client may time out a longer one)
POLL_S = 1.0  # how often a watcher reads the key where the store cannot give it a client of its own
ALIKE_S = 1.0  # how long a watcher that met a peer's fault waits for this rank's own post of it (the same error)
ACK_WAIT_S = 10.0  # how long the posting rank waits for its peers' watchers before it raises (a launcher ends
# the job's other processes once one exits: they should have raised by then)

_LOCK = threading.Lock()
_WATCHERS: dict = {}  # host group token -> the watcher's thread
_SEEN: dict = {}  # host group token -> faults this process posted or met there: the next fault key's number
POSTED: dict = {}  # CP group token -> the message a peer posted, met by this rank's watcher


class RanksDisagreeError(ValueError, RuntimeError):
    """CP ranks hold different plans or call attention with different inputs: raised on every rank of the group
    alike, before any exchange (or, on the peers of a rank alone in a later call's change, from that call's
    exchange). A ValueError (bad input); also a RuntimeError, what it was before."""


def _key(gen: int) -> str:
    return f"megatron_cp/fault/{gen}"


def _store(hg):
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_process_group_store(hg)


def tell_peers(group, err: Exception) -> None:
    """On a rank about to raise ``err`` (an input check's error) from an attention call on ``group``: its peers
    may be in that call's exchange or check, so post the error to them (their watchers raise it). Once per error
    (an entry point wrapping another tells once); nothing for a ``RanksDisagreeError`` (raised on every rank
    alike, or told already) or before the group's first check (no watcher yet: the group's gloo twin may not
    exist, and making it is a collective). Never raises itself: the caller raises ``err``."""
    if not _WATCHERS or isinstance(err, RanksDisagreeError) or getattr(err, "_told_peers", False):
        return
    err._told_peers = True
    if isinstance(group, dist.ProcessGroup):
        post(group, str(err))


def post(group, message: str) -> None:
    """``message`` posted to ``group``'s peers (their watchers raise it), then a wait of up to ``ACK_WAIT_S`` for
    each to take it (a peer that met the same error posts it too, which counts). Nothing where this process does
    not watch the group; never raises."""
    try:
        hg = host_group(group)
        store, token, me = _store(hg), group_token(hg), hg.rank()
        with _LOCK:
            if token not in _WATCHERS:
                return
            gen = _SEEN[token] = _SEEN.get(token, 0) + 1
        store.set(_key(gen), f"{me}\n{message}")
        store.set(f"{_key(gen)}/ack/{me}", "1")
        store.wait([f"{_key(gen)}/ack/{r}" for r in range(hg.size())], datetime.timedelta(seconds=ACK_WAIT_S))
    except Exception:  # noqa: BLE001 - a peer without a watcher, a store gone: the caller's error stands
        pass


def watch(group) -> None:
    """Start ``group``'s watcher in this process unless one runs (one per gloo twin, i.e. per set of ranks); the
    calling thread is the one the peer's error is raised in. Nothing for a group with no peer."""
    if group is None or dist.get_world_size(group) == 1 or str(dist.get_backend(group)) in (loopback.BACKEND, "fake"):
        return  # comm.loopback / fake: one rank of a plan run alone
    hg = host_group(group)
    token = group_token(hg)
    with _LOCK:
        t = _WATCHERS.get(token)
        if t is not None and t.is_alive():
            return
        store, own = _store(hg), True
        try:
            store = store.clone()  # its own connection: a wait on the shared client would hold the step's calls
        except (AttributeError, RuntimeError):
            own = False
        t = _WATCHERS[token] = threading.Thread(
            target=_watch, args=(store, own, token, hg.rank(), weakref.ref(group), group_token(group),
                                 threading.get_ident()),
            name=f"megatron_cp fault watcher {token}", daemon=True)
        t.start()


def _watch(store, own: bool, token: int, me: int, group, group_tok: int, step_thread: int) -> None:
    while True:
        with _LOCK:
            gen = _SEEN.get(token, 0) + 1
        try:
            if own:
                try:
                    store.wait([_key(gen)], datetime.timedelta(seconds=WAIT_S))
                except dist.DistStoreError:
                    continue  # the wait's time ran out: wait again
            else:
                time.sleep(POLL_S)
                if not store.check([_key(gen)]):
                    continue
            poster, _, text = store.get(_key(gen)).decode().partition("\n")
        except Exception:  # noqa: BLE001 - the store went with its host (the job ends): stop watching
            return
        # where every rank met the same error (the common mistake: the same bad input everywhere) each posts it and
        # raises its own: this rank's own post of the fault comes within ALIKE_S, and the group stays as it is (a
        # caller may catch the error and go on)
        alone, end = False, time.monotonic() + ALIKE_S
        while True:
            with _LOCK:
                if _SEEN.get(token, 0) >= gen:  # this process posted it too (or met it already)
                    break
                if time.monotonic() >= end:
                    _SEEN[token] = gen
                    alone = True
                    break
            time.sleep(0.005)
        if not alone or int(poster) == me:
            continue
        message = (f"CP rank {poster} of this group raised, and this rank stops with it: {text} (the CP group was "
                   "aborted: no exchange of it meets the other ranks again)")
        POSTED[group_tok] = message
        _raise_in(step_thread, message)
        try:
            store.set(f"{_key(gen)}/ack/{me}", "1")
        except Exception:  # noqa: BLE001
            pass
        cp_group = group()
        if cp_group is not None:
            _abort(cp_group)
        return


def _raise_in(thread_id: int, message: str) -> None:
    """A ``RanksDisagreeError`` with ``message`` raised in thread ``thread_id`` at its next Python instruction (a
    thread blocked in a wait gets it once the wait ends: the abort ends it)."""
    def init(self, *args):
        RanksDisagreeError.__init__(self, message)

    # the thread gets a class, not an instance: one made for this message
    cls = type("RanksDisagreeError", (RanksDisagreeError,),
               {"__init__": init, "__module__": RanksDisagreeError.__module__})
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(cls))


def _abort(group) -> None:
    """Abort ``group`` where its backend can (NCCL: its kernels leave, a host wait on them ends). A gloo collective
    the peer's host waits in is not ended by an abort: it ends when the posting rank's process exits (a job's
    error does), and the error is raised then."""
    try:
        group.abort()
    except Exception:  # noqa: BLE001 - a backend without an abort
        pass


def raise_posted(group) -> None:
    """Raise the message a peer posted for ``group``, if one did (a call after the watcher's error was caught)."""
    if POSTED and group is not None:
        msg = POSTED.get(group_token(group))
        if msg is not None:
            raise RanksDisagreeError(msg)
