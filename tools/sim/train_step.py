"""Research instrument: whole training steps of the recipes' Llama over DP x CP layouts, predicted (the model:
tools/sim/step_model.py), against the 2026-11-28 measurements and on Megatron's dynamic-CP setting; one plan over DP
x CP with DP's own layout among its candidates (not needed to use megatron-cp).

    python tools/sim/train_step.py --compare                   # the three measured 2026-11-28 cases
    python tools/sim/train_step.py --table --host-free         # every layout on Megatron's and those settings
    python tools/sim/train_step.py --dry-run                   # tiny sizes

Each row of --table also carries the setting's floors (``step_model.step_bound``): perfect balance of whole documents
over every rank, and every mask cell at the fastest fitted kernel rate (no placement is predicted below the latter;
below the former only where split pieces would run a cheaper kernel route), so their ratio to DP-balanced is the
most any plan over DP x CP could gain over it there.

Writes OUT/dp_x_cp_steps<tag>.json and prints the tables.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/sim: the model
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/common.py
from common import Progress, markdown_table, out_dir, parser, run_record, write_json  # noqa: E402
from step_model import (MEASURED, SEED, THROUGHPUT, Calibration, Setting, calibrate, sequences,  # noqa: E402,F401
                        step_bound, step_time)


# runs[i] of THROUGHPUT holding each (setting, layout)'s measured steps
MEASURED_RUNS = {k: {"fixed cp2": (i, "megatron_cp"), "over_dp cp2": (i, "megatron_cp+over_dp"), "fixed cp1": (i, "dp"),
                     "fixed cp4": (i + 1, "megatron_cp")} for k, i in (("a", 5), ("b", 8), ("c", 10))}


def megatron_setting(world: int, tpr: int, steps=(0, 1, 2, 3)) -> Setting:
    """Megatron's dynamic-CP measurement (ANCHORS.md): 12 layers, hidden 2048, documents log-normal in [128, 8192],
    sigma 1.5, mean 1024 (median 386 gives that mean once clipped); ``tpr`` tokens per rank a micro-batch.
    Sequences of 8192 (the longest document), four micro-batches' worth per rank a step."""
    return Setting("12l", world, 8192, 4 * world * tpr // 8192, (128, 8192, 386, 1.5), tpr, steps=steps)


# ------------------------------------------------------------------------------------------------ the programs

def layouts(setting: Setting) -> list[tuple[str, int]]:
    """(layout, Megatron CP) pairs a setting allows: CP sizes (powers of two up to the world) whose tokens per rank
    fit the budget; one plan over DP x CP needs two DP groups or more; DP-balanced at the smallest CP that fits."""
    cps = [c for c in (2 ** i for i in range(setting.world.bit_length())) if c <= setting.world
           and setting.L // c <= setting.budget and setting.G % (setting.world // c) == 0]
    # every configuration (at CP = GPUs the plan over DP x CP is that CP plan): its best is never behind a fixed one
    return [("fixed", c) for c in cps] + [("dp_balanced", cps[0])] + [("over_dp", c) for c in cps]


def simulate(setting: Setting, cal: Calibration, pairs=None, bar=None, with_library: bool = True) -> dict:
    """Every (layout, cp) of ``pairs`` (default ``layouts(setting)``) over the setting's steps: seconds per step."""
    out = {}
    for layout, cp in pairs or layouts(setting):
        if bar is not None:
            bar.running(f"{layout} cp {cp}")
        res = [step_time(setting, sequences(setting, k), layout, cp, cal, with_library) for k in setting.steps]
        # where the summed steps go (slowest rank's figures): host time (Megatron's layers, megatron-cp's calls, new
        # plans' first calls), the busiest GPU's kernels and linear layers, the gradient reduction
        host = sum(r["host_s"] for r in res)
        where = dict(host_s=host, host_megatron_layers_s=host - sum(r["attn_host_s"] + r["first_call_s"] for r in res),
                     host_attention_calls_s=sum(r["attn_host_s"] for r in res),
                     host_first_calls_s=sum(r["first_call_s"] for r in res),
                     gpu_busy_max_s=sum(max(r["busy_s"]) for r in res),
                     gpu_busy_mean_s=sum(float(np.mean(r["busy_s"])) for r in res),
                     gradient_reduction_s=len(res) * cal.fixed_s[setting.model])
        out[f"{layout} cp{cp}"] = dict(layout=layout, cp=cp, steps_s=[r["step_s"] for r in res],
                                       total_s=sum(r["step_s"] for r in res), chosen=[r["chosen"] for r in res],
                                       library=[r["library"] for r in res], busy_s=[r["busy_s"] for r in res],
                                       where=where)
        if bar is not None:
            bar.step()
    return out


def bound(setting: Setting, cal: Calibration) -> dict:
    """The setting's floors (``step_model.step_bound``) summed over its steps, and each step's."""
    per = [step_bound(setting, sequences(setting, k), cal) for k in setting.steps]
    return {**{k: sum(b[k] for b in per) for k in per[0]}, "steps": per}


def row(name: str, setting: Setting, sims: dict, floor: dict) -> dict:
    """One row of the table: the best fixed layout, DP-balanced and the best configuration of one plan over DP x CP
    (their summed steps) and the ratios; ``floor`` (``bound``): what no placement beats, its ratio to DP-balanced
    (the most any plan could gain over it) and where the plan over DP x CP's time goes beyond it."""
    best = lambda kind: min((v for v in sims.values() if v["layout"] == kind), key=lambda v: v["total_s"])  # noqa
    fixed, over, bal = best("fixed"), best("over_dp"), best("dp_balanced")
    picks = [c for v in over["chosen"] for c in v]
    lib = [c for v in over["library"] for c in v]  # empty without the library's picks (host-free)
    w = over["where"]
    # the plan's GPU time beyond perfect balance of whole documents: the kernels' extra cost of the documents it
    # splits (its ranks' mean busy time over the whole documents' share), the busiest rank over the mean, and the
    # end over the busiest rank's busy time (the exchange, waits for the slowest rank at each exchange, the host)
    end = over["total_s"] - w["gradient_reduction_s"]
    beyond = dict(split_s=w["gpu_busy_mean_s"] - floor["gpu_balanced_s"],
                  imbalance_s=w["gpu_busy_max_s"] - w["gpu_busy_mean_s"],
                  exchange_waits_host_s=end - w["gpu_busy_max_s"])
    return dict(setting=name, world=setting.world, model=setting.model, seqlen=setting.L, sequences_per_step=setting.G,
                tokens_per_rank_budget=setting.budget, docs=dict(zip(("lo", "hi", "median", "sigma"), setting.docs)),
                window=setting.window, steps=list(setting.steps),
                layouts={k: dict(cp=v["cp"], layout=v["layout"], steps_s=v["steps_s"], total_s=v["total_s"])
                         for k, v in sims.items()},
                best_fixed=f"fixed cp{fixed['cp']}", best_fixed_s=fixed["total_s"], dp_balanced_s=bal["total_s"],
                over_dp=f"over_dp cp{over['cp']}", over_dp_s=over["total_s"],
                dp_whole_share=picks.count("dp_whole") / max(len(picks), 1),
                library_agrees=sum(a == b for a, b in zip(picks, lib)) / len(lib) if lib else None,
                vs_best_fixed=fixed["total_s"] / over["total_s"], vs_dp_balanced=bal["total_s"] / over["total_s"],
                bound=floor, bound_s=floor["balanced_s"], bound_cells_s=floor["cells_s"],
                bound_vs_dp_balanced=bal["total_s"] / floor["balanced_s"],
                bound_cells_vs_dp_balanced=bal["total_s"] / floor["cells_s"], over_dp_beyond_bound=beyond)


def measured(name: str) -> dict:
    """The record's step seconds (timed steps) of each layout of measured setting ``name``."""
    with open(THROUGHPUT) as f:
        runs = json.load(f)["runs"]
    return {k: next(r for r in runs[i]["rows"] if r["impl"] == impl)["step_seconds"][3:]
            for k, (i, impl) in MEASURED_RUNS[name].items()}


def compare(cal: Calibration, bar=None) -> list[dict]:
    """Item 1: each measured layout's predicted and measured steps (what ran: over DP x CP took the global plan),
    and one plan over DP x CP against the best fixed layout, predicted and measured."""
    rows = []
    for name, st in MEASURED.items():
        meas = measured(name)
        sims = simulate(st, cal, [("fixed", 1), ("fixed", 2), ("fixed", 4), ("global", 2), ("over_dp", 2),
                                  ("global", 1), ("over_dp", 1)], bar)
        layouts_ = {}
        for key, m in meas.items():
            p = sims[key.replace("over_dp", "global")]
            layouts_[key] = dict(pred_steps_s=p["steps_s"], meas_steps_s=m, pred_s=p["total_s"], meas_s=sum(m),
                                 error=p["total_s"] / sum(m) - 1, where=p["where"])
        fixed = {k: v for k, v in layouts_.items() if k.startswith("fixed")}
        pb, mb = min(fixed, key=lambda k: fixed[k]["pred_s"]), min(fixed, key=lambda k: fixed[k]["meas_s"])
        over = layouts_["over_dp cp2"]
        rows.append(dict(setting=name, layouts=layouts_, pred_best_fixed=pb, meas_best_fixed=mb,
                         pred_vs_best_fixed=fixed[pb]["pred_s"] / over["pred_s"],
                         meas_vs_best_fixed=fixed[mb]["meas_s"] / over["meas_s"]))
        rows[-1]["ratio_error"] = rows[-1]["pred_vs_best_fixed"] / rows[-1]["meas_vs_best_fixed"] - 1
        # the same steps with DP's layout among the candidates, at the measured configuration and at CP 1; and the
        # adapter's plan as it is (global only) at CP 1, what tools/sim/confirm_dp_x_cp.sh runs
        rows[-1]["with_dp_whole"] = {k: dict(pred_s=sims[k]["total_s"], chosen=sims[k]["chosen"],
                                             where=sims[k]["where"])
                                     for k in ("over_dp cp2", "over_dp cp1", "global cp1")}
    return rows


def busy_check(cal: Calibration) -> list[dict]:
    """Every rank's GPU busy time (outside NCCL) of setting (b)'s profiled step (step 0's documents), predicted
    against the record's ``per_rank_busy_2026_11_28`` (a check of the per-rank kernel and linear-layer terms on
    four GPUs)."""
    with open(THROUGHPUT) as f:
        rec = json.load(f)["per_rank_busy_2026_11_28"]
    st = replace(MEASURED["b"], steps=(0,))
    out = []
    for key, impl, layout, cp in (("dp_x_cp", "megatron_cp+over_dp", "global", 2), ("cp4", "megatron_cp", "fixed", 4),
                                  ("dp_x_cp", "dp", "fixed", 1)):
        meas = next(r for r in rec[key]["rows"] if r["impl"] == impl)["profile"]["rank_busy_ms"]
        pred = [1e3 * x for x in step_time(st, sequences(st, 0), layout, cp, cal)["busy_s"]]
        out.append(dict(layout=f"{layout} cp{cp}", pred_ms=pred, meas_ms=meas,
                        ratios=[p / m for p, m in zip(pred, meas)]))
    return out


def check(folder: str, cal: Calibration, bar=None) -> list[dict]:
    """Predicted against every throughput.json under ``folder`` (tools/sim/confirm_dp_x_cp.sh's runs of the measured
    settings): each row's timed steps, as the record says it ran (``dp``: DP; ``megatron_cp``: fixed CP;
    ``megatron_cp+over_dp``: the adapter's plan over DP x CP, its global candidate)."""
    import glob
    import re

    out = []
    for path in sorted(glob.glob(os.path.join(folder, "**", "throughput.json"), recursive=True)):
        with open(path) as f:
            rec = json.load(f)
        cp = int(re.match(r"CP (\d+)", rec["layout"]).group(1))
        for r in rec["rows"]:
            window = "--layer-window" in rec["command"]
            name = next((k for k, st in MEASURED.items() if st.L == r["seqlen"] and bool(st.window) == window), None)
            if name is None:  # not one of the settings (another length): nothing to predict it with
                continue
            st = replace(MEASURED[name], steps=tuple(range(rec["warmup_steps"], rec["warmup_steps"]
                                                           + rec["timed_steps"])))
            layout, c = {"dp": ("fixed", 1), "megatron_cp": ("fixed", cp),
                         "megatron_cp+over_dp": ("global", cp)}[r["impl"]]
            sim = simulate(st, cal, [(layout, c)], bar)[f"{layout} cp{c}"]
            meas = r["step_seconds"][rec["warmup_steps"]:]
            out.append(dict(setting=name, impl=r["impl"], cp=cp, record=os.path.relpath(path, folder),
                            pred_steps_s=sim["steps_s"], meas_steps_s=meas,
                            error=sim["total_s"] / sum(meas) - 1))
    return out


def compare_table(rows) -> list[str]:
    return markdown_table(
        ["setting", "layout", "predicted s (steps 3-5)", "measured s", "error", "over DP x CP / best fixed: "
         "predicted (best) / measured (best)"],
        [[r["setting"], k, f"{v['pred_s']:.3f} ({', '.join(f'{x:.2f}' for x in v['pred_steps_s'])})",
          f"{v['meas_s']:.3f} ({', '.join(f'{x:.2f}' for x in v['meas_steps_s'])})", f"{100 * v['error']:+.1f}%",
          f"{r['pred_vs_best_fixed']:.3f} ({r['pred_best_fixed']}) / {r['meas_vs_best_fixed']:.3f} "
          f"({r['meas_best_fixed']})" if k == "over_dp cp2" else ""]
         for r in rows for k, v in r["layouts"].items()])


def table(rows) -> list[str]:
    return markdown_table(
        ["setting", "GPUs", "tokens / rank", "best fixed (s)", "DP-balanced s", "over DP x CP (s)", "vs_best_fixed",
         "vs_dp_balanced", "bound s: balanced / cells", "bound vs DP-balanced", "DP-whole taken", "library agrees"],
        [[r["setting"], r["world"], r["tokens_per_rank_budget"], f"{r['best_fixed']} ({r['best_fixed_s']:.3f})",
          f"{r['dp_balanced_s']:.3f}", f"{r['over_dp']} ({r['over_dp_s']:.3f})", f"{r['vs_best_fixed']:.3f}",
          f"{r['vs_dp_balanced']:.3f}", f"{r['bound_s']:.3f} / {r['bound_cells_s']:.3f}",
          f"{r['bound_vs_dp_balanced']:.3f} / {r['bound_cells_vs_dp_balanced']:.3f}",
          f"{100 * r['dp_whole_share']:.0f}%",
          "-" if r["library_agrees"] is None else f"{100 * r['library_agrees']:.0f}%"]
         for r in rows])


def beyond_table(rows) -> list[str]:
    """Where the plan over DP x CP's summed steps go beyond perfect balance of whole documents."""
    return markdown_table(
        ["setting", "GPUs", "tokens / rank", "over DP x CP (s)", "bound: balanced (s)", "split documents' kernels",
         "busiest rank over the mean", "exchange, waits, host", "host floor"],
        [[r["setting"], r["world"], r["tokens_per_rank_budget"], f"{r['over_dp_s']:.3f}", f"{r['bound_s']:.3f}",
          *(f"{r['over_dp_beyond_bound'][k]:+.3f}" for k in ("split_s", "imbalance_s", "exchange_waits_host_s")),
          f"{r['bound']['host_s']:.3f}"] for r in rows])


def main(argv=None) -> dict:
    ap = parser(__doc__, "out")
    ap.add_argument("--compare", action="store_true", help="the three measured cases against their record")
    ap.add_argument("--table", action="store_true", help="Megatron's setting and the measured ones, every layout")
    ap.add_argument("--worlds", default="4,8,64", help="Megatron's setting: comma list of GPU counts")
    ap.add_argument("--tokens-per-rank", default="2048,8192", help="Megatron's setting: comma list")
    ap.add_argument("--check", default=None, help="a folder of tools/sim/confirm_dp_x_cp.sh's runs: predicted vs them")
    ap.add_argument("--host-free", action="store_true", help="--table again with no host time at all (a bound: what "
                                                               "balance alone could give if the host kept up)")
    a = ap.parse_args(argv)
    if not (a.compare or a.table or a.check or a.dry_run):
        ap.error("say --compare, --table, --check DIR (or --dry-run)")
    cal = calibrate()
    out = dict(run_record("CPU (simulation)"), calibration=cal.sources,
               host=dict(attn_host=cal.attn_host, layer_host_s=cal.layer_host_s), rest_s=cal.rest_s,
               fixed_s=cal.fixed_s)
    settings = {}
    if a.dry_run:
        settings["megatron W4 t2048"] = replace(megatron_setting(4, 2048), steps=(0,))
    elif a.table:
        for w in (int(x) for x in a.worlds.split(",")):
            for t in (int(x) for x in a.tokens_per_rank.split(",")):
                settings[f"megatron W{w} t{t}"] = megatron_setting(w, t, steps=(0, 1) if w > 8 else (0, 1, 2, 3))
        settings.update({f"2026-11-28 ({k})": v for k, v in MEASURED.items()})
    with Progress(None, "train step", verbose=a.verbose) as bar:
        if a.check:
            out["check"] = check(a.check, cal, bar)
        if a.compare:
            out["compare"] = compare(cal, bar)
            out["busy_step0_b"] = busy_check(cal)
        out["rows"] = [row(k, s, simulate(s, cal, bar=bar), bound(s, cal)) for k, s in settings.items()]
        if a.host_free:
            free = replace(cal, attn_host={k: (0.0, 0.0) for k in cal.attn_host}, layer_host_s=0.0)
            out["rows_host_free"] = [row(k, s, simulate(s, free, bar=bar, with_library=False), bound(s, free))
                                     for k, s in settings.items()]
    write_json(os.path.join(out_dir(a), f"dp_x_cp_steps{a.tag}.json"), out)
    if a.compare:
        print("predicted (one calibration, docs/cost-model.md) against measured, 4 x H100, timed steps 3-5 summed")
        print("\n".join(compare_table(out["compare"])))
        print("\nsetting (b), profiled step 0: every rank's GPU busy ms outside NCCL, predicted / measured")
        cells = [[b["layout"], *(f"{p:.0f} / {m:.0f}" for p, m in zip(b["pred_ms"], b["meas_ms"]))]
                 for b in out["busy_step0_b"]]
        print("\n".join(markdown_table(["layout", *(f"rank {i}" for i in range(4))], cells)))
    if a.check:
        print("predicted against the runs in", a.check, "(timed steps summed)")
        print("\n".join(markdown_table(["setting", "impl", "CP", "predicted s", "measured s", "error"], [
            [c["setting"], c["impl"], c["cp"], f"{sum(c['pred_steps_s']):.3f}", f"{sum(c['meas_steps_s']):.3f}",
             f"{100 * c['error']:+.1f}%"] for c in out["check"]])))
    if out["rows"]:
        print(("\n" if a.compare else "") + "predicted whole steps, summed; one plan over DP x CP at its best "
              "configuration")
        print("\n".join(table(out["rows"])))
        print("\nwhere one plan over DP x CP's steps go beyond perfect balance of whole documents (seconds, summed)")
        print("\n".join(beyond_table(out["rows"])))
    if out.get("rows_host_free"):
        print("\nthe same with no host time at all (a bound, not a prediction)")
        print("\n".join(table(out["rows_host_free"])))
    return out


if __name__ == "__main__":
    main()
