"""Every solver on every named mask (megatron_cp.masks.catalog): ``python -m megatron_cp compare`` once
per mask, the tables printed and the rows saved as JSON. One mask alone:

    python -m megatron_cp compare --mask packed --seqlen 131072 --cp 8

    python tools/plan_report.py [--seqlen 131072] [--cp 8] [--masks causal,packed] [--milp] [--json out/plan_report.json]

Exit status 1 when the default solver's worst imbalance exceeds 5%.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

from megatron_cp import cli
from megatron_cp.masks import catalog


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--masks", default=",".join(catalog.NAMES), help="comma-separated catalog names (default: all)")
    ap.add_argument("--milp", action="store_true", help="also the exact chunk assignment (up to 20 s per mask)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    rows, worst = [], 0.0
    for name in args.masks.split(","):
        c = cli.parse_args(["compare", "--mask", name, "--seqlen", str(args.seqlen), "--cp", str(args.cp)]
                           + ([] if args.milp else ["--no-milp"]))
        got, milp = cli.compare_rows(c)
        print(f"\n{name} (S = {args.seqlen}, cp = {args.cp})")
        print(cli.format_table(got, milp, c.imbalance_target))
        rows += [{"mask": name, **r} for r in got]
        if milp:
            rows.append({"mask": name, "solver": "milp", **milp})
        worst = max(worst, next(r["imbalance"] for r in got if r["solver"] == "auto"))
    print(f"\nworst imbalance of the default solver: {100 * worst:.2f}% (target <= 5%)")
    if args.json:
        meta = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python"] + sys.argv),
            "machine": platform.processor() or platform.machine(),
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
