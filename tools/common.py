"""What the tools share (a module, not a tool): timing (``Timer``: every tool times kernels the same way, or the
cost model tools/sim/calibrate.py fits would predict another quantity than the benchmarks measure); progress
(``Progress``: a tqdm bar on stderr naming the running case, per-case lines with --verbose, failures always;
``markdown_table``: the one table on stdout at the end); result records (``run_record``, ``write_json``, written
after every case: a run cut short keeps what it measured); the common arguments (``parser``, ``out_dir``);
pictures (``bar_panels``) and profiling (``profile_step``, ``timeline_summary``: bench_dist --profile).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function
from tqdm import tqdm

from megatron_cp.baselines import OWN
from megatron_cp.comm import all_gather_single

# our own attention's label in every tool's records and comma lists (--impls, --strategies): the registry's name
# (baselines.OWN, --context-parallel-impl's); records and commands written before it say "megatron-cp"
OURS = OWN
_OLD_OURS = "megatron-cp"


def impl_name(label: str) -> str:
    """``label`` in the registry's spelling: ``megatron-cp`` and the labels built on it (``megatron-cp+moba``) read
    as ``megatron_cp`` ones, every other label as it is. What reads a record or a list of implementations passes
    each label through this, so that the committed records and quoted commands still load."""
    return OURS + label[len(_OLD_OURS):] if label.startswith(_OLD_OURS) else label


def impl_list(text: str) -> list[str]:
    """A comma list of implementations (``--impls``, ``--strategies``), each label as ``impl_name`` reads it."""
    return [impl_name(x) for x in text.split(",")]


def device_name(device=None) -> str:
    """The GPU's name for a CUDA ``device`` (default: the current one when CUDA is up), else "cpu"."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def local_rank_and_world() -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) as torchrun sets them (0, 1 outside torchrun): the launcher's, read here so
    that the library's ``shared_gpu.rank_device`` takes them as arguments."""
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def run_record(device: str, command: str | None = None, **extra) -> dict:
    """What a result file starts with: ``device``, ``date`` (UTC, to the minute), ``command`` (default this
    process's: ``python <script> <args>``), torch's and flash-attn-4's versions (None: not installed); ``extra``."""
    cmd = command or " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]])
    return {"device": device, "date": f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", "command": cmd,
            "torch": torch.__version__, "flash_attn_4": fa4_version(), **extra}


def fa4_version() -> str | None:
    return next((d.version for d in importlib.metadata.distributions(name="flash-attn-4")), None)


def write_json(path: str, obj) -> None:
    """``obj`` as indented JSON at ``path`` (its folder made); what JSON has no type for (a dtype) as its str()."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


def keep_row(rows: list, row: dict, summary, path: str, meta: dict, show: bool = True, stream=None) -> None:
    """Append ``row`` to ``rows``, print its line of ``summary``'s table (where ``show``) and rewrite ``path`` with
    every row so far: a long run keeps what it measured if it is stopped."""
    rows.append(row)
    if show:
        print("\n".join(summary(rows[-1:])[2:]), file=stream or sys.stdout, flush=True)
    write_json(path, {**meta, "rows": rows})


def parser(doc: str, out: str, timing: tuple[int, int] | None = None) -> argparse.ArgumentParser:
    """A parser for a tool documented by ``doc``, with the arguments every tool shares, one meaning in all:
    --dry-run (CPU, tiny sizes), --out (a folder; default ``out``), --tag, --verbose and with ``timing`` (their
    defaults) --warmup / --iters."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: checks the pipeline, times mean nothing")
    ap.add_argument("--out", default=None, help=f"output folder (default {out}; a dry run: a temporary folder); "
                    "results the README quotes go to benchmarks/<date>_<device>_<what>/ (benchmarks/RESULTS.md)")
    ap.add_argument("--tag", default="", help="appended to the result files' names")
    ap.add_argument("--verbose", action="store_true", help="each case's line on stderr as it finishes")
    if timing is not None:
        ap.add_argument("--warmup", type=int, default=timing[0], help="untimed steps per measurement")
        ap.add_argument("--iters", type=int, default=timing[1], help="timed steps per measurement (medians)")
    ap.set_defaults(default_out=out)
    return ap


def case_args(ap: argparse.ArgumentParser, masks: str) -> None:
    """A one-rank host tool's case arguments, one meaning in all: --masks (default ``masks``), --tokens-per-rank,
    --cps, --rank (``case_lists`` reads them)."""
    ap.add_argument("--masks", default=masks, help=f"comma list of catalog masks (default {masks})")
    ap.add_argument("--tokens-per-rank", default=None, help="comma list (default 8192; dry run 64)")
    ap.add_argument("--cps", default="4,8", help="comma list of CP sizes (default 4,8)")
    ap.add_argument("--rank", type=int, default=0, help="which rank of the plan this process is (default 0)")


def heads_list(text: str | None, dry_run: bool, default: str) -> list[tuple[int, int]]:
    """``--heads`` (comma list of Hq:Hkv; ``default``, a dry run 4:2) as [(Hq, Hkv), ...]."""
    return [tuple(int(y) for y in x.split(":")) for x in (text or ("4:2" if dry_run else default)).split(",")]


def case_lists(ap: argparse.ArgumentParser, a, least_cp: int) -> tuple[list[str], list[int], list[int]]:
    """``--masks`` (catalog names), ``--cps`` (each >= ``least_cp``, ``--rank`` below each) and ``--tokens-per-rank``
    (default 8192; a dry run 64) of a one-rank host tool, as lists; a bad value is ``ap.error`` naming it."""
    from megatron_cp.masks import catalog

    masks = a.masks.split(",")
    if bad := [m for m in masks if m not in catalog.NAMES]:
        ap.error(f"--masks: {bad[0]!r} is not a catalog mask ({', '.join(catalog.NAMES)})")
    cps = [int(x) for x in a.cps.split(",")]
    if any(c < least_cp for c in cps) or not all(0 <= a.rank < c for c in cps):
        ap.error(f"--cps {a.cps} / --rank {a.rank}: each cp must be >= {least_cp} and the rank below it")
    tokens = [int(x) for x in (a.tokens_per_rank or ("64" if a.dry_run else "8192")).split(",")]
    return masks, cps, tokens


def out_dir(args) -> str:
    """The folder ``args.out`` names, made (unset: the parser's default, or a new temporary folder for a dry run)."""
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="megatron_cp_") if args.dry_run else args.default_out
    os.makedirs(args.out, exist_ok=True)
    return args.out


def bar_panels(path: str, panels: list[dict], title: str, cols: int = 1) -> None:
    """Grouped bar charts in a grid of ``cols`` columns, saved as ``path``. Each panel is a dict: ``labels`` (the
    x ticks), ``series`` ({name: one value per label}), ``ylabel``, optional ``title`` and ``hline`` (a reference
    line, e.g. 1.0 under speedups). No PNG (a note on stderr) without matplotlib."""
    try:
        from matplotlib.figure import Figure  # no pyplot: headless, no global figure state
    except ImportError:
        print("matplotlib missing: no PNG (pip install megatron-cp[plot])", file=sys.stderr)
        return
    rows, width = math.ceil(len(panels) / cols), max(len(p["labels"]) for p in panels) * cols
    fig = Figure(figsize=(max(8.0, 1.2 * width + 2), 3.6 * rows))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, p in zip(axes, panels):
        w = 0.8 / max(len(p["series"]), 1)
        for j, (name, ys) in enumerate(p["series"].items()):
            ax.bar([i + (j - (len(p["series"]) - 1) / 2) * w for i in range(len(ys))], ys, width=w, label=name)
        if p.get("hline") is not None:
            ax.axhline(p["hline"], color="k", lw=0.6)
        ax.set_xticks(range(len(p["labels"])), p["labels"], fontsize=7)
        ax.set_ylabel(p["ylabel"])
        if p.get("title"):
            ax.set_title(p["title"], fontsize=9)
        ax.legend(fontsize=7)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


class Timer:
    """Times a forward + backward step three ways (``run``: medians of the slowest rank's times):

    * GPU time (the headline): a spin kernel holds the stream while the host issues the step, so CUDA events
      time the GPU's work alone, as in training, where the host runs ahead. Kernel-only rows are timed the same
      way, from the same GPU state (after a hold kernels ran 5-17% faster than in a loop: docs/cost-model.md);
      a host issue that outlasts the hold shows as GPU idle time.
    * wall time: host issue + GPU of an isolated step (sync, barrier, time, sync).
    * back to back (``back_to_back``): no sync or hold between steps: a training step's conditions.
    On the CPU (gloo dry runs) the first two are wall time and the third is not measured."""

    HOLD_CYCLES = 20_000_000  # ~10 ms of GPU clock: longer than any implementation's host issue time

    def __init__(self, device):
        self.device = device

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def hold(self, group):
        """Hold this GPU's stream; with ``group``, a tiny all-reduce behind the spin (whose length differs per GPU:
        clocks differ) releases every GPU together."""
        torch.cuda._sleep(self.HOLD_CYCLES)  # torch's only spin kernel (private, used by its own tests)
        if group is not None:
            dist.all_reduce(torch.zeros(1, device=self.device), group=group)

    def held(self, fwd, bwd, group=None):
        """(fwd, bwd) GPU seconds of one step, each phase issued behind a held stream."""
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        self.sync()
        self.hold(group)
        ev[0].record()
        out = fwd()
        ev[1].record()
        self.hold(group)
        ev[2].record()
        bwd(out)
        ev[3].record()
        self.sync()
        del out
        return ev[0].elapsed_time(ev[1]) / 1e3, ev[2].elapsed_time(ev[3]) / 1e3

    def wall(self, fwd, bwd):
        """(fwd, bwd) wall seconds of one step, the device synchronised around each phase."""
        self.sync()
        t0 = time.perf_counter()
        out = fwd()
        self.sync()
        t1 = time.perf_counter()
        bwd(out)
        self.sync()
        return t1 - t0, time.perf_counter() - t1

    def medians(self, fwd, bwd=None, warmup: int = 0, iters: int = 1):
        """Medians of (fwd, bwd) milliseconds of ``fwd() -> out``, ``bwd(out)`` (None: forward only) over ``iters``
        steps after ``warmup``; on CUDA behind a held stream, on the CPU wall clock."""
        back = bwd if bwd is not None else (lambda out: None)
        for _ in range(warmup):
            back(fwd())
        rows = [self.held(fwd, back) if self.device.type == "cuda" else self.wall(fwd, back) for _ in range(iters)]
        med = torch.tensor(rows, dtype=torch.float64).median(dim=0).values * 1e3
        return float(med[0]), (float(med[1]) if bwd is not None else None)

    def sustained(self, fn, reps: int = 1, seconds: float = 0.0) -> float:
        """Mean seconds per call of ``fn`` run back to back (one sync at the end), after a warm-up of ``seconds``
        (at least one call; a cold GPU's first bursts run at clocks a long run does not keep): at least
        ``reps`` calls, and about ``seconds`` of them."""
        t0, warm = time.perf_counter(), 0
        while warm == 0 or time.perf_counter() - t0 < seconds:
            fn()
            self.sync()
            warm += 1
        per_call = (time.perf_counter() - t0) / warm
        n = max(reps, math.ceil(seconds / max(per_call, 1e-6)) if seconds else 0)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        self.sync()
        return (time.perf_counter() - t0) / n

    def held_calls(self, fn, n: int) -> float:
        """GPU seconds per call of ``fn`` issued ``n`` times behind one hold (the host's issue hidden, as in
        training); fewer calls where the host's issue outlasts the hold. On the CPU wall time per call."""
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            return (time.perf_counter() - t0) / n
        while True:
            self.sync()
            h, e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            h.record()
            self.hold(None)
            e0.record()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            e1.record()
            host = time.perf_counter() - t0
            self.sync()
            # a hold the host's issue outlasts times the host: the cuDNN piece beside a tile measured 108 us on
            # one 4 x H200 lease and 316 on the next, whose host issued ~30% slower
            if host < 0.8 * h.elapsed_time(e0) / 1e3:
                return e0.elapsed_time(e1) / 1e3 / n
            if n == 1:
                print(f"one call took the host {host * 1e3:.1f} ms to issue, longer than the hold: its time "
                      "includes the host's", file=sys.stderr, flush=True)
                return e0.elapsed_time(e1) / 1e3
            n = max(1, n // 2)

    def run(self, fwd, bwd, warmup, iters, group):
        """(fwd, bwd, fwd wall, bwd wall, fwd back to back, bwd back to back) seconds (the last two None on CPU)."""
        rows = []
        for i in range(warmup + iters):
            self.sync()
            dist.barrier(group)
            wf, wb = self.wall(fwd, bwd)
            gf, gb = wf, wb
            if self.device.type == "cuda":
                dist.barrier(group)
                gf, gb = self.held(fwd, bwd, group)
            if i >= warmup:
                t = torch.tensor([gf, gb, wf, wb], dtype=torch.float64, device=self.device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                rows.append(t.tolist())
        rows = torch.tensor(rows, dtype=torch.float64)
        return tuple(float(x) for x in rows.median(dim=0).values) + self.back_to_back(fwd, bwd, iters, group)

    def back_to_back(self, fwd, bwd, iters, group):
        """(fwd, bwd) seconds of steps with no sync or hold between them (the host issues step i+1 while the GPU
        runs step i), CUDA events around each phase, the first step dropped; (None, None) on CPU. Each rank's
        medians (GPU fwd, bwd, host issue fwd, bwd) go to ``self.b2b_ranks``: a phase whose host issue outlasts
        the GPU's work runs at the host's pace, and the slowest rank's phase is what the others wait for."""
        if self.device.type != "cuda":
            return None, None
        self.sync()
        dist.barrier(group)
        evs, host = [], []
        for _ in range(iters + 1):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            h0 = time.perf_counter()
            ev[0].record()
            out = fwd()
            ev[1].record()
            h1 = time.perf_counter()
            bwd(out)
            ev[2].record()
            host.append((h1 - h0, time.perf_counter() - h1))
            del out
            evs.append(ev)
        self.sync()
        t = torch.tensor([[a.elapsed_time(b) / 1e3, b.elapsed_time(c) / 1e3] + list(h)
                          for (a, b, c), h in zip(evs[1:], host[1:])], dtype=torch.float64, device=self.device)
        # each rank's medians (GPU fwd, bwd, host issue fwd, bwd): where the slowest rank's time comes from
        mine = t.median(dim=0).values
        ranks = torch.empty(dist.get_world_size(group), 4, dtype=torch.float64, device=self.device)
        all_gather_single(ranks, mine, group=group)
        self.b2b_ranks = ranks.tolist()
        t = t[:, :2].contiguous()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return tuple(float(x) for x in t.median(dim=0).values)


NON_TTY_INTERVAL_S = 30.0


class Progress:
    """A tqdm bar of ``total`` steps on stderr (none where ``enabled`` is False: the other ranks); ``verbose``:
    ``step``'s per-case lines are written above it too."""

    def __init__(self, total: int | None, desc: str, enabled: bool = True, verbose: bool = False):
        self.verbose = verbose
        self.bar = tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, dynamic_ncols=True,
                        mininterval=0.1 if sys.stderr.isatty() else NON_TTY_INTERVAL_S)

    def running(self, what: str):
        """Name the case now running in the postfix (before it runs: one case can take minutes)."""
        self.bar.set_postfix_str(what, refresh=False)

    def step(self, line: str | None = None, n: int = 1):
        """One case done; ``line``: its result, shown with --verbose."""
        if line is not None and self.verbose and not self.bar.disable:
            self.note(line)
        self.bar.update(n)

    def add(self, n: int):
        """``n`` more steps than the total said (cases found on the way)."""
        if self.bar.total is not None:
            self.bar.total += n

    def note(self, line: str, file=None):
        """A line every run shows (a failure, an error), written above the bar (stderr unless ``file``)."""
        tqdm.write(line, file=file or sys.stderr)

    def close(self):
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()


def markdown_table(header, rows) -> list[str]:
    """Lines of a markdown table: ``header`` the column names, ``rows`` sequences of cells (str() each)."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return lines


DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def profile_step(fwd, bwd, sync, phases=("fwd", "bwd"), b2b=False):
    """(trace events, host ms per phase) of fwd() then bwd(out) run once under torch.profiler. ``b2b``: after an
    unrecorded step, with no sync between the steps or the phases (as back-to-back timing); else each phase
    starts on an idle GPU."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sync()
        if b2b:
            bwd(fwd())
        t0 = time.perf_counter()
        with record_function(phases[0]):
            out = fwd()
        if not b2b:
            sync()
        t1 = time.perf_counter()
        with record_function(phases[1]):
            bwd(out)
        sync()
        t2 = time.perf_counter()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)  # writes a new file at that path: read it by name
        with open(f.name) as g:
            events = json.load(g)["traceEvents"]
    return events, {phases[0]: (t1 - t0) * 1e3, phases[1]: (t2 - t1) * 1e3}


def _totals(events, key, width):
    """{name[:width]: [count, total of key]} over ``events``."""
    tot = {}
    for e in events:
        c = tot.setdefault(e["name"][:width], [0, 0.0])
        c[0] += 1
        c[1] += e.get(key, 0)
    return sorted(tot.items(), key=lambda kv: -kv[1][1])


def timeline_summary(events, host, title, gap_us=15.0, max_rows=80):
    """profile_step's result as text, per phase: host time, GPU span, busy time per stream, idle gaps longer than
    ``gap_us``, host ops and device work totalled by name, and the device work in launch order."""
    ranges = {e["name"]: (e["ts"], e["ts"] + e.get("dur", 0)) for e in events
              if e.get("cat") == "user_annotation" and e.get("name") in host}
    dev = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    # device work belongs to the phase whose host range launched it (correlation id -> runtime call)
    launch_ts = {e["args"].get("correlation"): e["ts"] for e in events
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    lines = [f"== {title}"]
    for phase, (h0, h1) in sorted(ranges.items(), key=lambda kv: kv[1][0]):
        work = [e for e in dev if h0 <= launch_ts.get(e.get("args", {}).get("correlation"), e["ts"]) <= h1]
        ops = _totals([e for e in events if e.get("cat") == "cpu_op" and h0 <= e["ts"] <= h1], "dur", 60)
        host_ops = "   host ops, inclusive (total us, count): " + "; ".join(
            f"{n} {d:.0f} x{c}" for n, (c, d) in ops[:18])
        if not work:
            lines += [f"-- {phase}: host {host[phase]:.3f} ms, no device work", host_ops]
            continue
        g0, g1 = work[0]["ts"], max(e["ts"] + e["dur"] for e in work)
        streams = {}
        for e in work:
            streams[str(e["args"].get("stream", "?"))] = streams.get(str(e["args"].get("stream", "?")), 0.0) + e["dur"]
        lines.append(f"-- {phase}: host {host[phase]:.3f} ms; GPU span {(g1 - g0) / 1e3:.3f} ms from "
                     f"{(g0 - h0) / 1e3:.3f} ms after the host began (profiler clock {g0:.1f} to {g1:.1f} us); "
                     "busy per stream (ms) "
                     + ", ".join(f"{s}: {t / 1e3:.3f}" for s, t in sorted(streams.items())))
        busy_end, gaps = g0, []
        for e in work:
            if e["ts"] - busy_end > gap_us:
                gaps.append((busy_end - g0, e["ts"] - busy_end, e["name"]))
            busy_end = max(busy_end, e["ts"] + e["dur"])
        lines.append(f"   idle gaps > {gap_us:.0f} us: {len(gaps)}, total {sum(g[1] for g in gaps) / 1e3:.3f} ms"
                     + "".join(f"\n     at {a / 1e3:8.3f} ms: {d:8.1f} us before {n[:70]}" for a, d, n in gaps[:20]))
        lines += [host_ops, "   by name (count, total us):"]
        lines += [f"     {d:10.1f} {c:4d}  {n}" for n, (c, d) in _totals(work, "dur", 90)[:25]]
        lines.append("   timeline (start us, dur us, stream, name):")
        lines += [f"     {e['ts'] - g0:9.1f} {e['dur']:9.1f} {str(e['args'].get('stream', '?')):>4}  {e['name'][:80]}"
                  for e in work[:max_rows]]
        if len(work) > max_rows:
            lines.append(f"     ... {len(work) - max_rows} more")
    return "\n".join(lines) + "\n"
