#!/usr/bin/env python3
"""Collect the CP=4 vs CP=1 loss curves written by run_gpu_parity.sh into parity.json + parity.png."""

from __future__ import annotations

import argparse
import datetime
import json
import re
from pathlib import Path

LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.Ee+-]+)")


def pretrain_losses(log: Path) -> list[float]:
    if not log.is_file():
        return []
    found = {}
    for line in log.read_text(errors="replace").splitlines():
        m = LOSS.search(line)
        if m:
            found[int(m.group(1))] = float(m.group(2))
    return [found[k] for k in sorted(found)]


def max_rel(a, b):
    n = min(len(a), len(b))
    return max((abs(x - y) / abs(x) for x, y in zip(a[:n], b[:n])), default=None), n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--command", default="")
    a = ap.parse_args()
    out = Path(a.out)
    try:
        import torch

        device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cpu"
        torch_version = torch.__version__
    except Exception as e:  # report, never fail the summary
        device, torch_version = f"unknown ({e})", None
    res = {"device": device, "torch": torch_version, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "command": a.command, "steps": a.steps}
    p1, p4 = pretrain_losses(out / "pretrain_cp1.log"), pretrain_losses(out / "pretrain_cp4.log")
    rel, n = max_rel(p1, p4)
    res["pretrain"] = {"loss_cp1": p1, "loss_cp4": p4, "steps_compared": n, "max_rel_diff": rel,
                       "note": "megatron.training.pretrain, losses as printed by Megatron (7 significant digits)"}
    loop = out / "loop.json"
    if loop.is_file():
        lj = json.loads(loop.read_text())
        res["loop"] = {"loss_cp1": lj["loss_cp1"], "loss_cp4": lj.get("loss_cp4"), "max_rel_diff": lj["max_rel_diff"]}
    (out / "parity.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if "loss" not in kk})
                      for k, v in res.items()}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        if p1:
            ax.plot(range(1, len(p1) + 1), p1, "-", lw=2.5, alpha=0.5, label="pretrain CP=1")
        if p4:
            ax.plot(range(1, len(p4) + 1), p4, "--", lw=1.2, label=f"pretrain CP=4 (max rel diff {rel:.1e})" if rel is not None else "pretrain CP=4")
        if "loop" in res and res["loop"]["loss_cp4"]:
            l1, l4 = res["loop"]["loss_cp1"], res["loop"]["loss_cp4"]
            ax.plot(range(1, len(l1) + 1), l1, "-", lw=2.5, alpha=0.5, label="loop CP=1")
            ax.plot(range(1, len(l4) + 1), l4, ":", lw=1.2, label=f"loop CP=4 (max rel diff {res['loop']['max_rel_diff']:.1e})")
        ax.set_xlabel("step")
        ax.set_ylabel("lm loss (packed stdlib documents)")
        ax.set_title(f"tiny Llama, megatron_cp CP=4 vs CP=1, {device}", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "parity.png", dpi=120)
    except ImportError:
        print("matplotlib missing: no parity.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
