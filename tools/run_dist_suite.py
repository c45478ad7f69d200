"""The multi-GPU run as one command: self-checks, calibration, benchmark, the simulator's prediction.

In order, each step a subprocess whose output goes to <out>/logs/<step>.log:

    kernel_check   tools/gpu_kernel_check.py --json                        (GPU only)
    fa4_sparse     tools/fa4_sparse_check.py                                (GPU only)
    dist_check     torchrun tools/gpu_dist_check.py --json                  (CPU: --device cpu --seqlen 512)
    calibrate      torchrun tools/sim/calibrate.py --out <out>/cost.json     (CPU: --device cpu --tiny)
    bench          torchrun tools/bench_dist.py: S = 131072, 262144, every benchmark mask, megatron-cp and its
                   sparse rows (megatron-cp+xattention, megatron-cp+moba), the baselines and PyTorch's CP
                   (CPU: --device cpu --tiny)
    predict        tools/sim/simulate.py --compare <each bench JSON> --cost <out>/cost.json: that lease's
                   calibration predicting the measured cases (sim_predict_<bench JSON's name>.json)
    scaling        tools/sim/simulate.py --masks packed --cps 8,16,32,64 --cost <out>/cost.json: the cp 8-64
                   table for packed documents (CPU: cp 2, 4 at 256 tokens per GPU)

torchrun runs ``--nproc`` processes (default: every visible GPU; one GPU is CP = 1, where the
distributed steps run on one rank). ``--cpu-dry-run`` runs the same sequence with gloo on CPU at tiny
sizes, skipping the GPU-only steps (kernel_check, fa4_sparse: it names them in suite.json). A failed step
is recorded and the next runs (bench rows record their own errors, listed in suite.json as the bench
step's row_errors); predict needs calibrate and bench.
Arguments after ``--`` go to bench_dist unchanged (``-- --heads 64 --kv-heads 8 --iters 3``).
``--steps`` runs a subset (e.g. to stay within a per-command time limit: one call for the checks and
calibration, one for the benchmark per S, ``--steps bench --seqlens 131072``, one for the prediction and
the table, all into the same --out).

Writes <out>/suite.json: per call (``runs``) device, GPU count, date and command, and per step run
(``steps``, in order) its command, exit status, seconds, log and outputs; later calls into the same --out
append, so split runs (e.g. bench once per S) end in one record.

    python tools/run_dist_suite.py --out benchmarks/2026-11-25_4xH200_dist                # 4 GPUs
    python tools/run_dist_suite.py --out out/suite --nproc 1                              # one GPU, CP = 1
    python tools/run_dist_suite.py --out out/dry --cpu-dry-run                            # CPU, 2 gloo ranks
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import subprocess
import sys
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
STEPS = ("kernel_check", "fa4_sparse", "dist_check", "calibrate", "bench", "predict", "scaling")
GPU_ONLY = ("kernel_check", "fa4_sparse")
OUTPUTS = {"kernel_check": "gpu_kernel_check.json", "dist_check": "gpu_dist_check.json", "calibrate": "cost.json",
           "scaling": "sim_packed_scaling.json"}  # bench: bench/bench_*.json; predict: sim_predict_<bench>.json


def _torchrun(nproc, port):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(port)]


def step_commands(args) -> dict:
    """{step: argv} of the steps to run (GPU-only ones left out on CPU), in STEPS order. ``predict``'s
    argv is a template: it runs once per benchmark JSON in the folder (their names carry the date)."""
    out, cpu, n = args.out, args.cpu_dry_run, args.nproc
    py = [sys.executable]
    tr = _torchrun(n, args.master_port)
    cost = os.path.join(out, "cost.json")
    dev = ["--device", "cpu"] if cpu else []
    bench = [*tr, os.path.join(TOOLS, "bench_dist.py"), *dev, "--out-dir", os.path.join(out, "bench"),
             "--seqlens", args.seqlens or ("512" if cpu else "131072,262144")]
    # split runs (one S each, or other head counts) write distinct files
    heads = args.bench_args[args.bench_args.index("--heads") + 1] if "--heads" in args.bench_args else None
    bench += ["--tag", "_s" + bench[-1].replace(",", "_") + (f"_hq{heads}" if heads else "")]
    if cpu:
        bench.append("--tiny")
    if args.masks:
        bench += ["--masks", args.masks]
    if args.impls:
        bench += ["--impls", args.impls]
    bench += args.bench_args
    cmds = {
        "kernel_check": [*py, os.path.join(TOOLS, "gpu_kernel_check.py"), "--json",
                         os.path.join(out, "gpu_kernel_check.json")],
        "fa4_sparse": [*py, os.path.join(TOOLS, "fa4_sparse_check.py")],
        "dist_check": [*tr, os.path.join(TOOLS, "gpu_dist_check.py"), *dev, "--json",
                       os.path.join(out, "gpu_dist_check.json")] + (["--seqlen", "512"] if cpu else []),
        "calibrate": [*tr, os.path.join(TOOLS, "sim", "calibrate.py"), *dev, "--out", cost]
                     + (["--tiny"] if cpu else []),
        "bench": bench,
        "predict": [*py, os.path.join(TOOLS, "sim", "simulate.py"), "--compare", "<bench json>", "--cost", cost,
                    "--json", "<predict json>"],
        "scaling": [*py, os.path.join(TOOLS, "sim", "simulate.py"), "--masks", "packed", "--cost", cost,
                    "--json", os.path.join(out, "sim_packed_scaling.json")]
                   + (["--cps", "2,4", "--tokens-per-gpu", "256", "--heads", "4", "--kv-heads", "2",
                       "--head-dim", "16"] if cpu else ["--cps", "8,16,32,64"]),
    }
    return {s: cmds[s] for s in args.steps if not (cpu and s in GPU_ONLY)}


def bench_jsons(out):
    """The benchmark JSONs in the folder, oldest first."""
    return sorted(glob.glob(os.path.join(out, "bench", "bench_*.json")), key=os.path.getmtime)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for every output, the logs and suite.json")
    ap.add_argument("--cpu-dry-run", action="store_true", help="gloo on CPU, tiny sizes, GPU-only steps skipped")
    ap.add_argument("--nproc", type=int, default=None,
                    help="processes per torchrun (default: the visible GPUs; --cpu-dry-run: 2)")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)} (run in that order)")
    ap.add_argument("--seqlens", default=None, help="bench_dist's S list (default 131072,262144; dry run 512)")
    ap.add_argument("--masks", default=None, help="bench_dist's masks (default: its own, every benchmark mask)")
    ap.add_argument("--impls", default=None, help="bench_dist's implementations (default: its own, sparse rows included)")
    ap.add_argument("--master-port", type=int, default=29517)
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.bench_args = argv[cut + 1:]  # after "--": passed to bench_dist as they are (e.g. --heads 64 --kv-heads 8)
    steps = args.steps.split(",")
    bad = [s for s in steps if s not in STEPS]
    if bad:
        raise ValueError(f"--steps: unknown step(s) {bad}; choose from {STEPS}")
    args.steps = [s for s in STEPS if s in steps]
    import torch

    if args.cpu_dry_run:
        device, args.nproc = "cpu", args.nproc or 2
    else:
        if not torch.cuda.is_available():
            raise ValueError("no GPU visible: pass --cpu-dry-run for the CPU sequence")
        device = torch.cuda.get_device_name(0)
        args.nproc = args.nproc or torch.cuda.device_count()
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    record_path = os.path.join(args.out, "suite.json")
    record = {"runs": [], "steps": []}
    if os.path.exists(record_path):
        with open(record_path) as f:
            record = json.load(f)
    utc = datetime.datetime.now(datetime.UTC)
    now, stamp = utc.strftime("%Y-%m-%d %H:%M UTC"), utc.strftime("%Y%m%d_%H%M%S")
    record["runs"].append(dict(device=device, num_devices=args.nproc, date=now, torch=torch.__version__,
                               command=" ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
                               skipped_gpu_only=[s for s in GPU_ONLY if args.cpu_dry_run and s in args.steps]))
    cmds = step_commands(args)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")) if args.cpu_dry_run else None
    failed = []

    def save():
        with open(record_path, "w") as f:
            json.dump(record, f, indent=1)

    for name, cmd in cmds.items():
        runs = [(cmd, OUTPUTS.get(name) and os.path.join(args.out, OUTPUTS[name]))]
        if name == "predict":  # one prediction per benchmark JSON in the folder (split runs write several)
            benches = bench_jsons(args.out)
            if not benches or not os.path.exists(os.path.join(args.out, "cost.json")):
                record["steps"].append(dict(name=name, rc=None, date=now,
                                            error="needs the calibrate and bench steps' outputs in --out"))
                failed.append(name)
                save()
                continue
            runs = []
            for b in benches:
                out = os.path.join(args.out, "sim_predict_" + os.path.splitext(os.path.basename(b))[0] + ".json")
                runs.append(([b if c == "<bench json>" else out if c == "<predict json>" else c for c in cmd], out))
        for i, (argv_i, out) in enumerate(runs):
            log = os.path.join(args.out, "logs", f"{name}{'_%d' % i if len(runs) > 1 else ''}_{stamp}.log")
            print(f"[suite] {name}: {' '.join(argv_i)}", flush=True)
            before = set(bench_jsons(args.out))
            t0 = time.perf_counter()
            with open(log, "w") as f:
                rc = subprocess.run(argv_i, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
            if name == "bench":
                outputs = sorted(set(bench_jsons(args.out)) - before)
            else:
                outputs = [out] if out and os.path.exists(out) else []
            st = dict(name=name, command=" ".join(argv_i), rc=rc, seconds=round(time.perf_counter() - t0, 1),
                      log=log, outputs=outputs, date=now)
            if name == "bench" and outputs:  # rows that failed (a case records its error and the run goes on)
                with open(outputs[0]) as f:
                    st["row_errors"] = [f"S={r['seqlen']} {r['mask']} {r['impl']}: {r['error']}"
                                        for r in json.load(f)["results"] if "error" in r]
            record["steps"].append(st)
            print(f"[suite] {name}: exit {rc} in {st['seconds']} s (log {log})", flush=True)
            if rc != 0 or (name == "bench" and not outputs):
                failed.append(name)
            save()
    save()
    print(f"[suite] wrote {record_path}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
