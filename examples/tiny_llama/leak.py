"""One forward and backward of the convergence model under each layout, built so that any leak shows exactly.

The samples keep the corpus's document boundaries (the plans are those of training) but not its bytes: the
first half of every other document is written in bytes 0-127 and only those rows count in the loss; every
other token is a byte 128-255 (EODs stay). Under the packed causal mask no counted row reaches a high byte, so
the word-embedding gradient of bytes 128-255 is exactly zero: a masked key adds exact zeros to the forward
(p = 0) and to the backward (dS = P (dP - D) = 0). One nonzero value there is a leak: a row that read a later
token or another document's in the forward, or a key's gradient delivered to the wrong token.

Beside it, every parameter's gradient against the first run's (relative L2 norm of the difference): a CP
layout in bf16 should stand as far from an fp32 reference as CP 1 in bf16 does. And ``plan_errors``: the plan
of every row a run trains on, as the adapter makes it, checked row by row against the mask (on the host, no
model: what a leak on some rare document layout would come from).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_cp.megatron import MaskSpec

from .demo import EOD

HIGH = 128  # bytes >= HIGH: tokens no counted row may see
EMBEDDING = "embedding.word_embeddings.weight"


def split_samples(tokens: torch.Tensor, labels: torch.Tensor):
    """(tokens, labels, loss_mask) ``[n, S]`` from a corpus batch's tokens and labels: documents (ended by EOD)
    keep their places; the first half of each is in low bytes and counted, the second half in high bytes."""
    rows = torch.cat([tokens, labels[:, -1:]], 1)
    mask = torch.zeros(rows.shape[0], rows.shape[1] - 1)
    for r in range(rows.shape[0]):
        row = rows[r]
        ends = (row[:-1] == EOD).nonzero().flatten().tolist()
        starts = [0] + [e + 1 for e in ends]
        stops = [e + 1 for e in ends] + [row.shape[0] - 1]
        text = row != EOD
        row[text] = HIGH + row[text] % HIGH
        for a, b in zip(starts, stops):
            mid = a + (b - a) // 2
            if mid > a:
                low = slice(a, mid)
                row[low] = torch.where(text[low], row[low] % HIGH, row[low])
                mask[r, low] = 1.0
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), mask


def plan_errors(rows: list[torch.Tensor], spec: MaskSpec, layouts: dict) -> dict:
    """{name: rows whose plan computes other keys than the mask's} for ``layouts`` {name: (cp, PlanOptions)},
    each row ``[S]`` planned alone as the adapter plans a micro-batch (``plan_for_batch``)."""
    from megatron_cp.megatron.batch import build_mask, document_bounds, plan_for_batch
    from megatron_cp.testing import plan_coverage_errors

    out = {}
    for name, (cp, options) in layouts.items():
        wrong = 0
        for row in rows:
            tok = row.reshape(1, -1).numpy()
            plan, _ = plan_for_batch(tok, spec, cp, options)
            mask = build_mask(spec, document_bounds(tok, spec), 1, tok.shape[1])
            wrong += len(plan_coverage_errors(plan, mask)) > 0
        out[name] = wrong
    return out


def count_worker(rank: int, world: int, rows: list, spec: MaskSpec, options, heads: tuple, device_kind: str,
                 dtype: str, against: MaskSpec | None = None) -> dict:
    """Each row's kept keys counted through the kernels a run uses: every row ``[S]`` planned at cp = ``world`` as
    the adapter plans it, then attention on q = k = 0 (every score 0, whatever K the exchange brings), so a row's
    lse is the log of how many keys its tiles kept. ``heads``: (Hq, Hkv, D) of one rank's attention. Rank 0
    returns {rows, token_rows, wrong_token_rows, wrong: the first few (row, local row, counted, mask's), kernels}; a
    row keeping no key must give lse -inf. ``against``: the mask the counts are checked against (default ``spec``,
    the plans')."""
    import numpy as np

    import megatron_cp as mcp
    from megatron_cp.masks import geometry
    from megatron_cp.megatron.batch import build_mask, document_bounds, plan_for_batch

    from .convergence import DTYPES

    device = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
    hq, hkv, d = heads
    wrong, examples, tokens = 0, [], 0
    for i, row in enumerate(rows):
        tok = row.reshape(1, -1).numpy()
        plan, _ = plan_for_batch(tok, spec, world, options)
        ref = against or spec
        mask = build_mask(ref, document_bounds(tok, ref), 1, tok.shape[1])
        kept = np.diff(geometry.row_area_prefix(mask.traps, mask.seqlen_q))[plan.local_ids(rank)][:, None]
        n = plan.num_local(rank)
        q, k = (torch.zeros(n, h, d, device=device, dtype=DTYPES[dtype]) for h in (hq, hkv))
        lse = mcp.attention(q, k, torch.zeros_like(k), plan, dist.group.WORLD, backend=options.kernel_backend)[1]
        got = lse.double().cpu().numpy()  # [n, Hq]: every head must count alike
        ok = np.where(kept == 0, np.isneginf(got), np.abs(np.exp(got) - kept) < 0.5).all(1)
        wrong += int((~ok).sum())
        tokens += n
        examples += [(i, int(j), float(np.exp(got[j].max())), int(kept[j, 0])) for j in np.nonzero(~ok)[0][:3]]
    got = [None] * world
    dist.all_gather_object(got, (wrong, examples[:5], tokens))
    from megatron_cp.kernels import get_backend

    return {"rows": len(rows), "token_rows": sum(g[2] for g in got), "wrong_token_rows": sum(g[0] for g in got),
            "wrong": [e for g in got for e in g[1]][:10], "cp": world, "dtype": dtype,
            "kernels": get_backend(options.kernel_backend, device).name}


def check_runs(runs: list) -> None:
    """ValueError naming the first (Train, Run) pair whose gradients the check cannot read whole."""
    for _, run in runs:
        if run.layout.tp > 1 or run.layout.pp > 1 or run.layout.over_dp:
            raise ValueError(f"run {run.name!r}: the leak check reads whole gradients of one CP group's rows "
                             f"(TP 1, PP 1, a plan per CP group), got {run.layout.name}")


def worker(rank: int, world: int, runs: list, batch: tuple, device_kind: str) -> list[dict]:
    """``runs``: (Train, Run) pairs; ``batch``: a corpus batch's (tokens, labels), which each DP rank takes whole
    (its loss and gradients are then the same for every DP size). Rank 0 returns one dict per run."""
    from . import trainer
    from .convergence import MainParams, _build, _full_init

    device = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else None
    if device is None:
        from .cpu import cuda_to_cpu_shim

        cuda_to_cpu_shim()
    check_runs(runs)
    tokens, labels, mask = split_samples(*batch)
    length = tokens.shape[1]
    ref, out, inits = None, [], {}
    for train, run in runs:
        key = (train.shape, train.seed)
        if key not in inits:
            inits[key] = _full_init(train, length)
        full = inits[key]
        chunks, _ = _build(train, run.layout, length, full, device, run.options(train))
        main = MainParams(chunks)
        spec = train.mask_spec()
        micro = [(tokens[i:i + 1], labels[i:i + 1], mask[i:i + 1]) for i in range(tokens.shape[0])]
        s, n = trainer.forward_backward(chunks[0], micro, spec, run.options(train), device=device)
        res = trainer.reduce_and_scale(chunks, s, n, params=main.main)
        grads = {k: m.grad.detach().float().cpu() for k, m in zip(main.names, main.main)}
        emb = grads[EMBEDDING]
        r = dict(dtype=train.dtype, run=run.name, layout=run.layout.name, loss=res.loss, tokens=res.tokens,
                 high_max=float(emb[HIGH:EOD].abs().max()), low_max=float(emb[:HIGH].abs().max()))
        if ref is None:
            ref = grads
        else:
            r["rel_diff"] = {k: float((g - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)) for k, g in grads.items()}
        out.append(r)
        del chunks, main, grads
        trainer.release_groups()
        if device is not None:
            torch.cuda.empty_cache()
    dist.barrier()
    return out


def report(results: list[dict]) -> list[str]:
    """Lines: each run's loss, the largest high-byte embedding gradient (0 = no leak), and its gradients'
    distance from the first run's (the largest over parameters, and the parameter it is)."""
    lines = [f"{'run':>16} {'loss':>10} {'high-byte grad':>15} {'low-byte grad':>14}  rel. L2 diff vs "
             f"{results[0]['dtype']} {results[0]['run']} (median / max, where)"]
    for r in results:
        d = r.get("rel_diff")
        where = ""
        if d:
            vals = sorted(d.values())
            k = max(d, key=d.get)
            where = f"{vals[len(vals) // 2]:.2e} / {d[k]:.2e}  {k}"
        lines.append(f"{r['dtype'] + ' ' + r['run']:>16} {r['loss']:10.6f} {r['high_max']:15.3e} "
                     f"{r['low_max']:14.3e}  {where}")
    return lines
