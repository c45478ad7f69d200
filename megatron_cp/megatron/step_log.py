"""What the planner did, in Megatron's own logs: per logged iteration, through Megatron's writers.

``forward_step`` hands every micro-batch's plan to ``record``; at iterations Megatron logs (``--log-interval``)
the figures of that iteration's micro-batches go where Megatron's iteration figures go: TensorBoard and W&B
under ``megatron-cp/`` when their writers are configured (``--tensorboard-dir``, ``--wandb-project``), and one
line beside Megatron's iteration line (printed by the last rank, as that line is).

Figures (``FIGURES``, plus ``SPARSE_FIGURES`` under ``--cp-sparse``): the work imbalance of the micro-batches' plans (worst), the K/V bytes they move (all ranks,
per micro-batch on average) and the most one rank receives, priced for the model's K/V heads per TP rank, head
dim and dtype; and this rank's host time in ``prepare_batch`` (planning not done ahead, the checks, dispatch),
the figure that shows a step waiting on the planner, and where a planning thread runs its time per plan and how
long the step waited for it (``PLANNING_FIGURES``). Plans are pure, so every rank computes the same plan figures
without a collective; nothing is computed at iterations that are not logged. At logged iterations core attention
also reports which kernel path ran (``kernels``: e.g. ``fa4``, or ``triton (<why FA4 could not>)``) and, for
sparse layers, the blocks its selector kept out of the mask's (``sparse_kept_fraction``, over every sparse layer
and micro-batch, and the least of any one layer): reading the selection counts waits for the GPU, so it happens
on logged iterations only.
"""

from __future__ import annotations

import numpy as np

__all__ = ["StepLog", "FIGURES", "SPARSE_FIGURES", "PLANNING_FIGURES", "STEP_LOG"]

FIGURES = ("plan_imbalance_max", "kv_bytes_per_microbatch", "max_kv_bytes_received", "prepare_batch_ms")
SPARSE_FIGURES = ("sparse_kept_fraction", "sparse_kept_fraction_min_layer")
PLANNING_FIGURES = ("plan_ms", "plan_wait_ms")  # where a planning thread runs (forward_step's, by default)


class StepLog:
    """One per process: ``record`` every micro-batch, ``flush`` writes an iteration's figures when Megatron logs it."""

    def __init__(self):
        self.iteration = None  # Megatron's args.curr_iteration of the micro-batches held
        self.written: list[tuple[int, dict]] = []  # (iteration, figures) written so far, newest last
        self.kernels_written: list[tuple[int, str]] = []  # (iteration, kernel paths) of the lines printed
        self._clear()

    def _clear(self) -> None:
        """Drop the held micro-batches' figures."""
        self.rows = []
        self.kernels: set[str] = set()  # kernel paths core attention ran in the held micro-batches
        self.sparse: dict[int, list] = {}  # layer number -> [blocks selected, blocks in the envelope]
        self.planning: list[tuple[float, float]] = []  # (planning thread ms, step's wait ms) per held micro-batch

    @property
    def collecting(self) -> bool:
        """True while the micro-batches of an iteration Megatron logs run: core attention then reports."""
        return bool(self.rows)

    def layer(self, layer_number: int, kernel_path: str | None, sparse_stats: dict | None = None) -> None:
        """One core attention call of a held micro-batch: its kernel path and, for a sparse layer,
        ``sparse_attention``'s ``stats`` (blocks selected / in the envelope)."""
        if kernel_path:
            self.kernels.add(kernel_path)
        if sparse_stats:
            acc = self.sparse.setdefault(int(layer_number), [0, 0])
            acc[0] += int(sparse_stats["blocks_selected"])
            acc[1] += int(sparse_stats["blocks_envelope"])

    def record(self, args, plan, host_ms: float, planning: tuple[float, float] | None = None) -> None:
        """One micro-batch's plan, this rank's host milliseconds in ``prepare_batch`` and, when a planning thread
        made the plan (``plan_ahead.PlanAhead``), (its planning ms, ms the step waited for it)."""
        it = getattr(args, "curr_iteration", None)
        if it is None:  # outside Megatron's training loop: nothing to log against
            return
        if it != self.iteration:
            self.flush(args)
            self._clear()
            self.iteration = it
        if self._logged(args, it):
            self.rows.append((plan, float(host_ms)))
            if planning is not None:
                self.planning.append(planning)

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
        figs = dict(plan_imbalance_max=float(max(s["imbalance"] for s in stats)),
                    kv_bytes_per_microbatch=float(np.mean([s["bytes_moved"] for s in stats])),
                    max_kv_bytes_received=float(max(s["max_bytes_received"] for s in stats)),
                    prepare_batch_ms=float(np.mean([ms for _, ms in self.rows])))
        if self.planning:
            figs.update(plan_ms=float(np.mean([p for p, _ in self.planning])),
                        plan_wait_ms=float(np.mean([w for _, w in self.planning])))
        layers = {n: a / e for n, (a, e) in self.sparse.items() if e}
        if layers:
            sel, env = (sum(v[i] for v in self.sparse.values()) for i in (0, 1))
            figs.update(sparse_kept_fraction=sel / env, sparse_kept_fraction_min_layer=min(layers.values()))
        return figs

    def flush(self, args) -> None:
        """Write the held iteration's figures if Megatron logs it (and drop them)."""
        if self.iteration is None or not self.rows:
            return
        it = self.iteration + 1
        figs = self.figures(args)
        kernels = ", ".join(sorted(self.kernels)) or "-"
        self._clear()
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
                        f"prepare_batch {figs['prepare_batch_ms']:.2f} ms (host)"
                        + (f" | planning {figs['plan_ms']:.2f} ms ahead, step waited {figs['plan_wait_ms']:.2f} ms"
                           if "plan_ms" in figs else "")
                        + f" | kernels {kernels}"
                        + (f" | sparse kept {figs['sparse_kept_fraction']:.3f} of the mask's blocks (least in a "
                           f"layer {figs['sparse_kept_fraction_min_layer']:.3f})" if "sparse_kept_fraction" in figs
                           else ""))
        self.written.append((it, figs))
        self.kernels_written.append((it, kernels))
        del self.kernels_written[:-16]
        del self.written[:-16]  # the last few, for tests and callers that read them back


STEP_LOG = StepLog()  # one per process: forward_step records plans, core attention its layers
