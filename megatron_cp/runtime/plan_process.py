"""Plans made in a helper process, so that planning ahead does not take the training loop's interpreter.

A planning thread (``megatron.PlanAhead``) shares the GIL with the loop it plans for. Where the loop is
host-bound (small micro-batches: issuing kernels is all it does), every millisecond the planner holds the
GIL is a millisecond the loop cannot issue work: at 8k tokens per GPU a step of 8 attention layers per
micro-batch took about 2x as long with its plans made by a thread beside it as with the same plans made before
the step (docs/measurements.md). ``plan_in_helper`` makes
``planner.plan``'s plan, the exchange choice the attention's first call would make on it
(``runtime.prebuild``'s costliest part) and, given the rank (and its backend), the rank's host work of that first
call (index arrays and row maps; the tile lists prepared for the backend: FA4's calls, a millisecond or two), in
one helper process per training process; the calling thread waits on
a pipe, without the GIL, and gets back the plan with its choice kept in the plan's cache. Threads asking at
once (``megatron.PlanAhead`` making several slow plans at once) each get a helper of their own. The rank's
execution state (device tensors) is built by the plan's first attention call, in this process.

The helper is this interpreter running ``serve`` on this process's ``sys.path``, started
on first use (it imports megatron_cp: a second or so, once) and ended when this process ends or closes its
end of the pipe. Its failures come back as the exception the planner raised; a helper that dies raises
RuntimeError with its exit code.
"""

from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import threading
import traceback

import torch

from ..masks import AttnMask
from ..planner import Plan, Workload
from ..planner import plan as make_plan
from .attention import DEFAULT_COST, resolve_backend
from .cost import CostModel
from .schedule import choose_schedule
from .state import keep_exchange_choice, keep_rank_ahead, rank_ahead

_LOCK = threading.Lock()
_IDLE: list = []  # started helpers no thread is asking now (one request at a time each)


def _start() -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    # the answers' pipe is set apart before anything is imported: whatever an import prints goes to stderr
    cmd = f"import os; fd = os.dup(1); os.dup2(2, 1); from {__name__} import serve; serve(fd)"
    proc = subprocess.Popen([sys.executable, "-c", cmd], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    atexit.register(_stop, proc)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            proc.stdin.close()  # the helper exits at the end of its input
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()


def start_planning_helpers(count: int = 1) -> int:
    """Start planning helpers now, without waiting for them, until ``count`` idle ones are alive; returns how
    many were started. A helper's imports take seconds (torch, megatron_cp; docs/measurements.md): started
    ahead (e.g. while the model is built), the first plans ``plan_in_helper`` asks for do not wait for them."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an int >= 0 (idle planning helpers to keep), got {count!r}")
    with _LOCK:
        _IDLE[:] = [p for p in _IDLE if p.poll() is None]
        missing = max(0, count - len(_IDLE))
    started = [_start() for _ in range(missing)]
    with _LOCK:
        _IDLE[:0] = started  # under the ready ones: a thread takes the last idle helper first
    return missing


def _ask(request: tuple):
    """Send one request to an idle helper (started if none is) and return its answer. Taking the last idle
    helper starts a spare one: a thread asking next (planning that fell behind runs plans at once) then finds a
    helper whose imports are under way or done instead of starting one and waiting seconds for it."""
    # pickled whole before anything is written: a request that cannot be pickled (a backend's prepare_host that
    # is not a module-level function) raises here and leaves no half-written request in a helper's input
    data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
    with _LOCK:
        proc = _IDLE.pop() if _IDLE else None
        spare = not _IDLE
    if proc is None or proc.poll() is not None:
        proc = _start()
    if spare:
        start_planning_helpers(1)
    try:
        proc.stdin.write(data)
        proc.stdin.flush()
        status, *answer = pickle.load(proc.stdout)
    except pickle.UnpicklingError as e:  # alive but its answer unreadable: stopped
        proc.kill()
        proc.wait()
        raise RuntimeError("megatron-cp's planning helper process gave an unreadable answer and was stopped") from e
    except (EOFError, BrokenPipeError) as e:  # its end of the pipe closed: it is exiting
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        raise RuntimeError(f"megatron-cp's planning helper process exited (code {code}) before answering: "
                           f"see its error above") from e
    with _LOCK:
        _IDLE.append(proc)
    if status == "error":
        exc, text = answer
        raise exc from RuntimeError(f"in megatron-cp's planning helper process:\n{text}")
    return answer


def plan_in_helper(mask: AttnMask, cp_size: int, *, work: Workload | None = None, stages: int | None = None,
                   hierarchical: bool = True, cost_model: CostModel | None = None, rank: int | None = None,
                   backend=None, device=None, **plan_kwargs) -> Plan:
    """``planner.plan(mask, cp_size, **plan_kwargs)``, made in this process's planning helper process; given
    ``work``, the exchange choice ``runtime.attention`` / ``runtime.prebuild`` would make for it (with the same
    ``stages``, ``hierarchical``, ``cost_model``) is made there too and kept with the plan; given also ``rank``
    (this process's rank in the plan), so is that rank's host work of its first call (``state.rank_ahead``: the
    single exchange's index arrays and row maps) and, given the ``backend`` (name or object) and ``device`` of
    its attention calls too, its tile lists where the backend can prepare them elsewhere (its ``prepare_host``:
    FA4's, Triton's); the plan's first call takes them instead of making them on the step's thread. The same plan, bit
    for bit, as ``planner.plan`` here; the calling thread waits without holding the GIL."""
    if not isinstance(mask, AttnMask):
        raise TypeError(f"plan_in_helper() needs an AttnMask, got {type(mask).__name__}")
    if work is not None and not isinstance(work, Workload):
        raise ValueError(f"work must be a megatron_cp.planner.Workload, got {type(work).__name__}")
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
    prepare = None
    if rank is not None:
        if work is None:
            raise ValueError("plan_in_helper(rank=...) needs work too (the rank's state follows the exchange chosen "
                             "for it)")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < cp_size:
            raise ValueError(f"rank must be an int in [0, cp_size={cp_size}), got {rank!r}")
    if (backend is None) != (device is None) or (backend is not None and rank is None):
        raise ValueError("plan_in_helper's backend= and device= come together, with rank= (the lists prepared for "
                         "that rank's attention calls)")
    if backend is not None:
        prepare = getattr(resolve_backend(backend, torch.device(device))[1], "prepare_host", None)
        if hasattr(prepare, "with_head_dims"):  # it builds what the calls' head dim needs there too (schedules)
            prepare = prepare.with_head_dims((work.head_dim,))
    cost = cost_model or DEFAULT_COST
    choice = None if work is None else (stages, hierarchical, cost, work)
    plan, sched, ahead = _ask((mask, cp_size, plan_kwargs, choice, None if rank is None else (rank, prepare)))
    if choice is not None:
        keep_exchange_choice(plan, sched, stages=stages, hierarchical=hierarchical, cost=cost, work=work)
    if ahead is not None:
        keep_rank_ahead(plan, rank, ahead, stages=stages, hierarchical=hierarchical, cost=cost, work=work)
    return plan


def _answer(request: tuple) -> tuple:
    mask, cp_size, plan_kwargs, choice, ahead_for = request
    try:
        plan = make_plan(mask, cp_size, **plan_kwargs)
        sched = ahead = None
        if choice is not None:
            stages, hierarchical, cost, work = choice
            sched = choose_schedule(plan, stages, cost, work, hierarchical)
            if ahead_for is not None:
                rank, prepare = ahead_for
                ahead = rank_ahead(plan, rank, sched, prepare)
        return ("ok", plan, sched, ahead)
    except Exception as e:  # the planner's own error, raised again in the asking process
        text = traceback.format_exc()
        try:
            pickle.dumps(e)
        except Exception:
            e = RuntimeError(f"{type(e).__name__}: {e}")
        return ("error", e, text)


def serve(answers_fd: int) -> None:
    """The helper's loop: requests from stdin, answers on ``answers_fd`` (the original stdout, set apart by
    the command that starts the helper: what the planner or an import prints goes to stderr)."""
    answers = os.fdopen(answers_fd, "wb")
    requests = sys.stdin.buffer
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        pickle.dump(_answer(request), answers, protocol=pickle.HIGHEST_PROTOCOL)
        answers.flush()

