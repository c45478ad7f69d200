"""One profiled forward + backward, summarised as a GPU timeline (tools/bench_dist.py --profile).

Every rank runs the profiled iteration (the collectives need them all); the caller writes the summary
of one rank. The summary lists, per phase, the host wall time, the GPU span, the busy time per stream,
the device work (kernels, copies, sets) in launch order with start offset and duration, the same work
totalled by name, and the idle gaps of the GPU longer than ``gap_us`` - where time goes that the
kernel-only measurement does not see.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from torch.profiler import ProfilerActivity, profile, record_function

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def profile_step(fwd, bwd, sync, phases=("fwd", "bwd"), hold=None, b2b=False):
    """Run fwd() then bwd(out) once under torch.profiler; returns (trace events, host ms per phase).

    ``hold``: called before each phase (e.g. ``timing.Timer.hold``, a spin kernel on the stream):
    the host then issues the phase while the GPU is busy, so the timeline shows GPU work without the
    host's launch gaps, as bench_dist's GPU time does; host ms is then the issue time.
    ``b2b``: as bench_dist's back-to-back timing: one unrecorded step first, then the profiled one, with
    no sync or hold between them or between its phases (host ms: the issue time)."""
    host = {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sync()
        if b2b:
            bwd(fwd())
        elif hold is not None:
            hold()
        t0 = time.perf_counter()
        with record_function(phases[0]):
            out = fwd()
        if b2b:
            pass
        elif hold is None:
            sync()
        else:
            hold()
        t1 = time.perf_counter()
        with record_function(phases[1]):
            bwd(out)
        sync()
        t2 = time.perf_counter()
    host[phases[0]] = (t1 - t0) * 1e3
    host[phases[1]] = (t2 - t1) * 1e3
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.remove(path)
    return events, host


def summarize(events, host, title, gap_us=15.0, max_rows=80):
    """Text summary of profile_step's result."""
    ranges = {e["name"]: (e["ts"], e["ts"] + e.get("dur", 0)) for e in events
              if e.get("cat") == "user_annotation" and e.get("name") in host}
    dev = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    lines = [f"== {title}"]
    # device work is attributed to the phase whose host range launched it: correlation -> runtime call
    launch_ts = {e["args"].get("correlation"): e["ts"] for e in events
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    for phase, (h0, h1) in sorted(ranges.items(), key=lambda kv: kv[1][0]):
        work = [e for e in dev if h0 <= launch_ts.get(e.get("args", {}).get("correlation"), e["ts"]) <= h1]
        ops = {}
        for e in events:  # host ops of this phase, inclusive times (a nested op also counts in its parent)
            if e.get("cat") == "cpu_op" and h0 <= e["ts"] <= h1:
                ops.setdefault(e["name"][:60], [0, 0.0])
                ops[e["name"][:60]][0] += 1
                ops[e["name"][:60]][1] += e.get("dur", 0)
        host_ops = "   host ops, inclusive (total us, count): " + "; ".join(
            f"{n} {d:.0f} x{c}" for n, (c, d) in sorted(ops.items(), key=lambda kv: -kv[1][1])[:18])
        if not work:
            lines.append(f"-- {phase}: host {host[phase]:.3f} ms, no device work")
            lines.append(host_ops)
            continue
        g0 = work[0]["ts"]
        g1 = max(e["ts"] + e["dur"] for e in work)
        streams = {}
        for e in work:
            streams[e["args"].get("stream", "?")] = streams.get(e["args"].get("stream", "?"), 0.0) + e["dur"]
        lines.append(f"-- {phase}: host {host[phase]:.3f} ms; GPU span {(g1 - g0) / 1e3:.3f} ms from "
                     f"{(g0 - h0) / 1e3:.3f} ms after the host began (profiler clock {g0:.1f} to {g1:.1f} us); "
                     "busy per stream (ms) "
                     + ", ".join(f"{s}: {t / 1e3:.3f}" for s, t in sorted(streams.items(), key=str)))
        busy_end, gaps = g0, []
        for e in work:
            if e["ts"] - busy_end > gap_us:
                gaps.append((busy_end - g0, e["ts"] - busy_end, e["name"]))
            busy_end = max(busy_end, e["ts"] + e["dur"])
        lines.append(f"   idle gaps > {gap_us:.0f} us: {len(gaps)}, total {sum(g[1] for g in gaps) / 1e3:.3f} ms"
                     + "".join(f"\n     at {a / 1e3:8.3f} ms: {d:8.1f} us before {n[:70]}" for a, d, n in gaps[:20]))
        tot = {}
        for e in work:
            tot.setdefault(e["name"][:90], [0, 0.0])
            tot[e["name"][:90]][0] += 1
            tot[e["name"][:90]][1] += e["dur"]
        lines.append(host_ops)
        lines.append("   by name (count, total us):")
        for n, (c, d) in sorted(tot.items(), key=lambda kv: -kv[1][1])[:25]:
            lines.append(f"     {d:10.1f} {c:4d}  {n}")
        lines.append("   timeline (start us, dur us, stream, name):")
        for e in work[:max_rows]:
            lines.append(f"     {e['ts'] - g0:9.1f} {e['dur']:9.1f} {str(e['args'].get('stream', '?')):>4}  "
                         f"{e['name'][:80]}")
        if len(work) > max_rows:
            lines.append(f"     ... {len(work) - max_rows} more")
    return "\n".join(lines) + "\n"
