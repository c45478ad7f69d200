"""What the planner did, in Megatron's own logs: per logged iteration, through Megatron's writers.

``forward_step`` hands every micro-batch's plan to ``record``; at iterations Megatron logs (``--log-interval``)
the figures of that iteration's micro-batches go where Megatron's iteration figures go: TensorBoard and W&B
under ``megatron-cp/`` when their writers are configured (``--tensorboard-dir``, ``--wandb-project``), and one
line beside Megatron's iteration line (printed by the last rank, as that line is).

Figures (``FIGURES``): the work imbalance of the micro-batches' plans (worst), the K/V bytes they move (all ranks,
per micro-batch on average) and the most one rank receives, priced for the model's K/V heads per TP rank, head
dim and dtype; and this rank's host time in ``prepare_batch`` (planning not done ahead, the checks, dispatch),
the figure that shows a step waiting on the planner. Plans are pure, so every rank computes the same plan figures
without a collective; nothing is computed at iterations that are not logged.
"""

from __future__ import annotations

import numpy as np

__all__ = ["StepLog", "FIGURES"]

FIGURES = ("plan_imbalance_max", "kv_bytes_per_microbatch", "max_kv_bytes_received", "prepare_batch_ms")


class StepLog:
    """One per process: ``record`` every micro-batch, ``flush`` writes an iteration's figures when Megatron logs it."""

    def __init__(self):
        self.iteration = None  # Megatron's args.curr_iteration of the micro-batches held
        self.rows: list[tuple] = []
        self.written: list[tuple[int, dict]] = []  # (iteration, figures) written so far, newest last

    def record(self, args, plan, host_ms: float) -> None:
        """One micro-batch's plan and this rank's host milliseconds in ``prepare_batch``."""
        it = getattr(args, "curr_iteration", None)
        if it is None:  # outside Megatron's training loop: nothing to log against
            return
        if it != self.iteration:
            self.flush(args)
            self.iteration, self.rows = it, []
        if self._logged(args, it):
            self.rows.append((plan, float(host_ms)))

    @staticmethod
    def _logged(args, it: int) -> bool:
        interval = int(getattr(args, "log_interval", 1) or 1)
        return (it + 1) % interval == 0  # Megatron logs iteration curr_iteration + 1, after the step

    def figures(self, args) -> dict:
        """The held micro-batches' figures (``FIGURES``)."""
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        heads = int(getattr(args, "num_attention_heads", 1) or 1)
        kv = int(getattr(args, "num_query_groups", None) or heads)
        hd = int(getattr(args, "kv_channels", None) or (int(getattr(args, "hidden_size", 128)) // heads))
        dtype = "bfloat16" if getattr(args, "bf16", False) else "float16" if getattr(args, "fp16", False) else "float32"
        stats = [plan.stats(num_kv_heads=max(1, kv // tp), head_dim=hd, dtype_bytes=dtype) for plan, _ in self.rows]
        return dict(plan_imbalance_max=float(max(s["imbalance"] for s in stats)),
                    kv_bytes_per_microbatch=float(np.mean([s["bytes_moved"] for s in stats])),
                    max_kv_bytes_received=float(max(s["max_bytes_received"] for s in stats)),
                    prepare_batch_ms=float(np.mean([ms for _, ms in self.rows])))

    def flush(self, args) -> None:
        """Write the held iteration's figures if Megatron logs it (and drop them)."""
        if self.iteration is None or not self.rows:
            return
        it = self.iteration + 1
        figs = self.figures(args)
        self.rows = []
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
        from megatron.training.utils import print_rank_last

        tb, wb = get_tensorboard_writer(), get_wandb_writer()
        if tb is not None:
            for name, value in figs.items():
                tb.add_scalar(f"megatron-cp/{name}", value, it)
        if wb is not None:
            wb.log({f"megatron-cp/{name}": value for name, value in figs.items()}, it)
        print_rank_last(f" [megatron-cp] iteration {it:8d} | plan imbalance (max) {figs['plan_imbalance_max']:.4f} | "
                        f"K/V moved per micro-batch {figs['kv_bytes_per_microbatch'] / 2**20:.2f} MiB | "
                        f"most received by a rank {figs['max_kv_bytes_received'] / 2**20:.2f} MiB | "
                        f"prepare_batch {figs['prepare_batch_ms']:.2f} ms (host)")
        self.written.append((it, figs))
        del self.written[:-16]  # the last few, for tests and callers that read them back
