"""The multi-GPU run as one command: self-checks, calibration, benchmark, the simulator's prediction.

    python tools/run_dist_suite.py --out benchmarks/2026-11-25_4xH200_dist                # every visible GPU
    python tools/run_dist_suite.py --out out/suite --nproc 1                              # one GPU, CP = 1
    python tools/run_dist_suite.py --dry-run                                              # CPU, 2 gloo ranks

Runs STEPS in order, each a subprocess (``step_commands``) writing into OUT, its log in OUT/logs/; a failed step is
recorded and the next runs. Arguments after ``--`` go to bench_dist. ``--steps`` runs a subset into the same OUT
(within a per-command time limit: the checks and calibration, then ``--steps bench --seqlens 131072`` per S, then
``--steps predict,scaling``). Writes OUT/suite.json (later calls into the same OUT append): per call its device,
GPU count, date and command, per step its command, exit status, seconds, log, outputs and bench's row_errors.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import torch

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)
from common import out_dir, parser, run_record, write_json  # noqa: E402

STEPS = ("kernel_check", "dist_check", "calibrate", "bench", "train", "host", "predict", "scaling")
GPU_ONLY = ("kernel_check",)
WRITES = {"kernel_check": "gpu_kernel_check", "dist_check": "gpu_dist_check", "calibrate": "cost",  # <this><tag>.json
          "bench": "bench_dist", "train": "bench_train", "host": "host_path", "predict": "simulate",
          "scaling": "simulate"}


def step_commands(args) -> dict:
    """{step: argv} of the steps to run, in STEPS order; predict's ``<bench>`` and ``<S>`` stand for each bench JSON
    in OUT and its name's tail."""
    out, dry = args.out, args.dry_run
    py, tr = [sys.executable], [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
                                "--master-port", str(args.master_port)]

    def tool(*path, tag=args.tag):
        return [os.path.join(TOOLS, *path), "--out", out] + ["--dry-run"] * dry + ["--tag", tag] * bool(tag)

    seqlens = args.seqlens or ("256" if dry else "131072,262144")
    # split runs (one S each, or other head counts) write distinct files
    heads = args.bench_args[args.bench_args.index("--heads") + 1] if "--heads" in args.bench_args else None
    bench = [*tr, *tool("bench_dist.py", tag="_s" + seqlens.replace(",", "_") + (f"_hq{heads}" if heads else "")
                        + args.tag), "--seqlens", seqlens]
    bench += ["--masks", args.masks] * bool(args.masks) + ["--impls", args.impls] * bool(args.impls) + args.bench_args
    cost = ["--cost", os.path.join(out, f"cost{args.tag}.json")]
    cmds = {
        "kernel_check": [*py, *tool("gpu_kernel_check.py")],
        "dist_check": [*tr, *tool("gpu_dist_check.py")],
        "calibrate": [*tr, *tool("sim", "calibrate.py")],
        "bench": bench,
        # a training step's attention with a new plan per micro-batch (every implementation) at 8k-32k per GPU, and
        # one rank's host path under its GPU work (rank 0 of cp 4 / 8 plans alone on GPU 0)
        "train": [*(py if dry else tr), *tool("bench_train.py")]
                 + ["--tokens-per-gpu", "8192,16384,32768"] * (not dry),
        "host": [*py, *tool("host_path.py")],
        "predict": [*py, *tool("sim", "simulate.py", tag="_predict<S>"), "--compare", "<bench>", *cost],
        "scaling": [*py, *tool("sim", "simulate.py", tag="_packed_scaling" + args.tag), "--masks", "packed", *cost]
                   + ([] if dry else ["--cps", "8,16,32,64"]),
    }
    return {s: cmds[s] for s in args.steps if not (dry and s in GPU_ONLY)}


def main(argv=None):
    ap = parser(__doc__, "out/suite")
    ap.add_argument("--nproc", type=int, default=None, help="processes per torchrun (default: the GPUs; dry run 2)")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)} (run in that order)")
    ap.add_argument("--seqlens", default=None, help="bench_dist's S list (default 131072,262144; dry run 256)")
    ap.add_argument("--masks", default=None, help="bench_dist's masks (default: its own, every benchmark mask)")
    ap.add_argument("--impls", default=None, help="bench_dist's implementations (default: its own)")
    ap.add_argument("--master-port", type=int, default=29517)
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.bench_args = argv[cut + 1:] + ["--verbose"] * args.verbose  # after "--": passed to bench_dist as they are
    bad = [s for s in args.steps.split(",") if s not in STEPS]
    if bad:
        raise ValueError(f"--steps: unknown step(s) {bad}; choose from {STEPS}")
    args.steps = [s for s in STEPS if s in args.steps.split(",")]
    if not args.dry_run and not torch.cuda.is_available():
        raise ValueError("no GPU visible: pass --dry-run for the CPU sequence")
    device = "cpu" if args.dry_run else torch.cuda.get_device_name(0)
    args.nproc = args.nproc or (2 if args.dry_run else torch.cuda.device_count())
    out = out_dir(args)
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    record_path = os.path.join(out, "suite.json")
    record = json.loads(open(record_path).read()) if os.path.exists(record_path) else {"runs": [], "steps": []}
    run = run_record(device, num_devices=args.nproc, skipped_gpu_only=[s for s in GPU_ONLY if args.dry_run
                                                                        and s in args.steps])
    record["runs"].append(run)
    stamp = time.strftime("%Y%m%d_%H%M%S", time.gmtime())
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")) if args.dry_run else None
    failed = []
    for name, cmd in step_commands(args).items():
        runs = [cmd]
        if name == "predict":  # one prediction per benchmark JSON in OUT (split runs write several)
            benches = sorted(glob.glob(os.path.join(out, "bench_dist*.json")), key=os.path.getmtime)
            runs = [[b if c == "<bench>" else c.replace("<S>", os.path.basename(b)[len("bench_dist"):-len(".json")])
                     for c in cmd] for b in benches] if os.path.exists(cmd[-1]) else []
            if not runs:
                record["steps"].append(dict(name=name, rc=None, date=run["date"],
                                            error="needs the calibrate and bench steps' outputs in --out"))
                failed.append(name)
        for i, argv_i in enumerate(runs):
            path = os.path.join(out, WRITES[name] + (argv_i[argv_i.index("--tag") + 1] if "--tag" in argv_i else "")
                                + ".json")  # what the step writes
            log = os.path.join(out, "logs", f"{name}{'_%d' % i if len(runs) > 1 else ''}_{stamp}.log")
            print(f"[suite] {name}: {' '.join(argv_i)}", flush=True)
            t0 = time.time()
            with open(log, "w") as f:
                rc = subprocess.run(argv_i, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
            # this run's (names are fixed: an earlier run's file is not this step's output)
            outputs = [path] if os.path.exists(path) and os.path.getmtime(path) >= t0 - 1 else []
            st = dict(name=name, command=" ".join(argv_i), rc=rc, seconds=round(time.time() - t0, 1), log=log,
                      outputs=outputs, date=run["date"])
            if name == "bench" and outputs:  # rows that failed (a case records its error and the run goes on)
                with open(outputs[0]) as f:
                    st["row_errors"] = [f"S={r['seqlen']} {r['mask']} {r['impl']}: {r['error']}"
                                        for r in json.load(f)["results"] if "error" in r]
            record["steps"].append(st)
            print(f"[suite] {name}: exit {rc} in {st['seconds']} s (log {log})", flush=True)
            if rc != 0 or not outputs:
                failed.append(name)
            write_json(record_path, record)
    write_json(record_path, record)
    print(f"[suite] wrote {record_path}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
