"""GPU correctness of the distributed runtime with the production kernel paths (torchrun).

    torchrun --nproc-per-node 4 tools/gpu_dist_check.py --out out                 # a GPU per rank, NCCL
    torchrun --nproc-per-node 4 tools/gpu_dist_check.py --share-gpu --out out     # 4 ranks on one GPU (gloo)
    torchrun --nproc-per-node 2 tools/gpu_dist_check.py --dry-run     # CPU (gloo, reference backend), S 256

Each rank runs forward and backward on its tokens of one random bf16 problem per case, on each kernel backend
(--backends: FA4 and Triton where the GPU has them; Triton with cuDNN's dense pieces, ``dense_min_keys`` lowered to
have some), against a dense fp64 reference (ANCHORS.md: rms error <= 2 x bf16's + 1e-6 x rms(reference); no NaN;
rows keeping no key: out 0, lse -inf), counting the cuDNN calls. The cases, by family:

    dense     every benchmark mask (catalog.DIST_MASKS, S 16384): megatron-cp staged and single exchange, with guest
              rows where ``auto`` keeps them home, and each baseline (STRATEGIES)
    sparse    megatron_cp.sparse's MoBA and XAttention (S 8192, causal and packed, structured q / k) against the
              reference under the cells every rank selected (sparse.select_blocks, gathered), which must be the
              selection of the whole sequence on one rank
    sink      mcp.apply_sink on the merged out / lse (a learnable sink; its gradient summed over the ranks)
    mla       q/k head dim 192, v head dim 128
    mismatch  the last rank attends with another plan (``plan``) or half the query heads (``heads``), or alone
              brings half the query heads or one row too few on a plan's later call (``later heads`` / ``later rows``, the
              latter on NCCL only: its peers are in that call's exchange by then, runtime.faults): ok when every rank raised
              (RuntimeError / ValueError; ``later``: RanksDisagreeError, the rows' own rank its ValueError), none
              hung or finished without an error

Writes OUT/gpu_dist_check<tag>.json (every rank's records); ends with one table; exits 1 where a case fails.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import megatron_cp as mcp
from megatron_cp import kernels
from megatron_cp.baselines import get_strategy, plan_for
from megatron_cp.baselines import STRATEGIES as BASELINES
from megatron_cp.kernels.triton import cudnn
from megatron_cp.masks import catalog, geometry
from megatron_cp.planner.guests import candidate_rows
from megatron_cp.runtime import state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/
from gpu_kernel_check import chunked_reference, rms  # noqa: E402
from bench_dist import start_ranks, torchrun_record  # noqa: E402
from bench_sparse import structured_qk  # noqa: E402
from common import OURS, Progress, markdown_table, out_dir, parser, write_json  # noqa: E402

STRATEGIES = tuple(BASELINES)  # every baseline beside megatron-cp
# the default --backends: the GPU backends (the reference is what they are checked against) that the GPU has
BACKENDS = tuple(b for b in kernels.BACKENDS if b != "reference")
EXTRA_MASKS = ("causal", "packed")  # the sparse, sink and MLA families' masks
MLA_DIMS = (192, 128)  # q/k, v head dims
ERR_KEYS = ("out", "lse", "dq", "dk", "dv", "dsink")
# cuDNN calls by kind: the backend calls these functions of megatron_cp.kernels.triton.cudnn, which main() wraps
CUDNN_OPS = {"fwd": "forward", "bwd": "backward", "fwd_band": "forward_batched", "bwd_band": "backward_batched"}
CUDNN_CALLS = dict.fromkeys(CUDNN_OPS, 0)


def _counted(kind, fn, *a, **k):
    CUDNN_CALLS[kind] += 1
    return fn(*a, **k)


def make_backend(name, dev):
    """The backend object ``name`` runs on: Triton with cuDNN's dense pieces from 2048 keys, else the registry's."""
    if name == "triton":
        return kernels.TritonBackend(kernels.TritonConfig(dense_min_keys=2048))
    return kernels.get_backend(name, dev)


def summary_table(flat):
    """The closing table (lines) of every rank's records: a row per mask, backend, impl and variant."""
    rows = []
    key = lambda r: (r["mask"], r["backend"], r["impl"], r["variant"])  # noqa: E731
    for k in dict.fromkeys(map(key, flat)):
        rs = [r for r in flat if key(r) == k]
        worst = [e / max(el, 1e-30) for r in rs for e, el in r.get("rms_err_vs_bf16_ref", {}).values()]
        calls = [sum(r.get("cudnn_calls", {}).get(x, 0) for r in rs) for x in ("fwd", "bwd")]
        rows.append([*k, max(r.get("guest_rows", 0) for r in rs), f"{sum(r['ok'] for r in rs)}/{len(rs)}",
                     f"{max(worst):.3f}" if worst else "refused" if all(r.get("refused") for r in rs) else "-",
                     f"{calls[0]} / {calls[1]}"])
    return markdown_table(["mask", "backend", "impl", "variant", "guest rows", "ranks ok", "worst err/bf16 err",
                           "cuDNN fwd / bwd"], rows)


def reference(q, k, v, do, keep, dt, scale, sink=None):
    """chunked_reference in ``dt`` (float64: the reference; bf16: the plain computation the rule measures against)
    under cells ``keep``, also for a v head dim below q/k's (MLA: v and do zero-padded to q/k's, which adds exact
    zeros) and with a sink column of logits ``sink`` [Hq]: the loss sum(out' do) of out' = out w, lse' = log(e^lse +
    e^sink), w = sigmoid(lse - sink), whose gradients are those of dout = do w and dlse = rowsum(do out) w (1 - w).
    Returns float64 (out, lse, dq, dk, dv[, dsink])."""
    dv_ = v.shape[-1]
    v, do = (F.pad(t, (0, q.shape[-1] - dv_)) for t in (v, do))
    out, lse, dq, dk, dv = chunked_reference(q, k, v, do, keep, dt, scale)
    extra = []
    if sink is not None:
        acc = torch.float64 if dt == torch.float64 else torch.float32
        w = torch.sigmoid(lse.to(acc) - sink.to(acc))
        dlse = (do.to(acc) * out.to(acc)).sum(-1) * w * (1 - w)
        _, _, dq, dk, dv = chunked_reference(q, k, v, do * w[..., None], keep, dt, scale, dlse=dlse)
        out, lse = (out * w[..., None]).to(dt).double(), torch.logaddexp(lse, sink.double())
        extra = [-dlse.sum(0).double()]
    return out[..., :dv_], lse, dq, dk, dv[..., :dv_], *extra


def selected_cells(q, k, plan, sel, mask):
    """Every rank's selection of ``sel`` on q, k (sparse.select_blocks: the selection sparse_attention makes of the
    same inputs) gathered: bool cells [Hq, S, S]. RuntimeError unless it is, block for block, the selection of the
    whole sequence on one rank (the selections are the same at every CP size)."""
    b, ids = sel.block, torch.from_numpy(plan.local_ids(dist.get_rank())).to(q.device)
    local = mcp.sparse.select_blocks(q[ids], k[ids], plan, dist.group.WORLD, sel)  # [Hq, local q blocks, nb]
    blocks = torch.zeros(local.shape[0], local.shape[2], local.shape[2], device=q.device)
    blocks[:, ids[::b] // b] = local.float()
    dist.all_reduce(blocks)
    view = mcp.sparse.single_view(mask, b, k)
    one = sel.select(q, k, view) & (view.envelope > 0)[None]
    if not torch.equal(blocks > 0, one):
        raise RuntimeError(f"{sel.name}: the selection at CP {dist.get_world_size()} differs from one rank's in "
                           f"{int(((blocks > 0) != one).sum())} of {one.numel()} block pairs")
    return (blocks > 0).repeat_interleave(b, 1).repeat_interleave(b, 2)


def problem(mask, dims, dev, sink=False, sparse=None):
    """One random bf16 problem on ``mask`` (dims: Hq, Hkv, D, Dv) and its references: (q, k, v, do, sink, the fp64
    and bf16 references' out, lse, dq, dk, dv[, dsink]). ``sink``: learnable sink logits [Hq] (around the rows'
    lse: the sink column takes a share); ``sparse``: (plan, selector): q / k structured (bench_sparse), the
    references under the selected cells (collective)."""
    (hq, hkv, d, dv), s = dims, mask.seqlen_q
    g = torch.Generator(device=dev).manual_seed(1234)
    q, k, v, do = (torch.randn(s, h, x, device=dev, dtype=torch.bfloat16, generator=g)
                   for h, x in ((hq, d), (hkv, d), (hkv, dv), (hq, dv)))
    keep = torch.from_numpy(mask.to_dense()).to(dev)
    if sparse is not None:
        q, k = (t.to(torch.bfloat16) for t in structured_qk(s, hq, hkv, d, dev))
        keep = selected_cells(q, k, *sparse, mask) & keep
    sk = 3 + 2 * torch.randn(hq, device=dev, generator=g) if sink else None
    refs = (reference(q, k, v, do, keep, dt, d ** -0.5, sk) for dt in (torch.float64, torch.bfloat16))
    return (q, k, v, do, sk, *refs)


def check(run, plan, data, be, may_refuse=False):
    """This rank's outputs and gradients of ``run(q, k, v, plan, backend, scale, stats) -> (out, lse)`` (then
    apply_sink where ``data`` has a sink) against the references: the record's figures. A ValueError (bad input:
    raised on every rank alike, before any collective) is a failure, unless ``may_refuse`` (a baseline refusing
    what it cannot run, e.g. ulysses where the ranks do not divide the heads): recorded as refused."""
    q, k, v, do, sink, ref, low = data
    CUDNN_CALLS.update(dict.fromkeys(CUDNN_OPS, 0))
    ids, stats = torch.from_numpy(plan.local_ids(dist.get_rank())).to(q.device), {}
    ql, kl, vl = (t[ids].clone().requires_grad_() for t in (q, k, v))
    try:
        out, lse = run(ql, kl, vl, plan, be, q.shape[-1] ** -0.5, stats)
    except ValueError as e:
        return dict(ok=may_refuse, refused=True, error=f"ValueError: {e}")
    sk = None if sink is None else sink.clone().requires_grad_()
    if sk is not None:
        out, lse = mcp.apply_sink(out, lse, sk)
    out.backward(do[ids])
    got = [out, lse, ql.grad, kl.grad, vl.grad]
    if sk is not None:  # the ranks' partial sink gradients add up
        got.append(sk.grad.double())
        dist.all_reduce(got[-1])
    empty = torch.isinf(ref[1][ids])  # (row, head) keeping no key
    nan = any(bool(torch.isnan(x).any()) for x in got)
    empty_ok = bool((lse[empty] == float("-inf")).all()) and bool((out[empty] == 0).all())
    errs, ok = {}, not nan and empty_ok
    for key, x, r, lo in zip(ERR_KEYS, got, ref, low):
        r, lo = (r, lo) if key == "dsink" else (r[ids], lo[ids])
        if key == "lse":  # on the (row, head) pairs that keep a cell
            x, r, lo = x[~empty], r[~empty], lo[~empty]
        errs[key] = [rms(x.detach().double() - r), rms(lo - r)]
        ok = ok and errs[key][0] <= 2 * errs[key][1] + 1e-6 * rms(r)
    return dict(ok=ok, nan=nan, guest_rows=int((plan.guest_runs[:, 1] - plan.guest_runs[:, 0]).sum()),
                empty_rows_ok=empty_ok, rms_err_vs_bf16_ref=errs, cudnn_calls=dict(CUDNN_CALLS),
                cudnn_off={str(key): found.reason for key, found in getattr(be, "cudnn_probes", {}).items()
                           if found.layout is None}, **({"sparse": stats} if stats else {}))


def mismatch(kind, name, s, dims, dev, _data, be):
    """The last rank attends with another plan (``plan``: of the full mask) or half the query heads (``heads``):
    every rank must raise. Fresh plans (a plan's ranks are checked once per group)."""
    (hq, hkv, d, dv), rank, cp = dims, dist.get_rank(), dist.get_world_size()
    odd = rank == cp - 1
    plan = mcp.plan(catalog.build("full" if odd and kind == "plan" else name, s), cp)
    hq = hq // 2 if odd and kind == "heads" else hq
    q, k, v = (torch.randn(plan.num_local(rank), h, x, device=dev, dtype=torch.bfloat16)
               for h, x in ((hq, d), (hkv, d), (hkv, dv)))
    try:
        mcp.attention(q, k, v, plan, dist.group.WORLD, backend=be)
        err = None
    except (RuntimeError, ValueError) as e:
        err = f"{type(e).__name__}: {e}"
    raised = [None] * cp
    dist.all_gather_object(raised, err is not None)
    return dict(ok=all(raised), raised=err is not None, ranks_raised=sum(raised), error=err)


def later_change(kind, name, s, dims, dev, _data, be):
    """The last rank alone brings half the query heads (``heads``) or one row less than the plan's (``rows``) on a
    plan's second call (the first agreed on): every rank raises (``RanksDisagreeError``; the last rank with
    ``rows`` its input check's ValueError) in that call or in its wait for the call's output (peers:
    ``runtime.faults``). On a CP group of its own, which the case leaves aborted (the peers' watchers abort it)."""
    (hq, hkv, d, dv), rank, cp = dims, dist.get_rank(), dist.get_world_size()
    group, gloo = dist.new_group(list(range(cp))), dist.new_group(list(range(cp)), backend="gloo")
    timeout, state.FIELD_CHANGE_TIMEOUT_S = state.FIELD_CHANGE_TIMEOUT_S, 10.0
    plan = mcp.plan(catalog.build(name, s), cp)
    q, k, v = (torch.randn(plan.num_local(rank), h, x, device=dev, dtype=torch.bfloat16)
               for h, x in ((hq, d), (hkv, d), (hkv, dv)))
    start, err = time.monotonic(), None
    try:  # the last rank's error may reach a peer still in the first call (the last rank through it first)
        mcp.attention(q, k, v, plan, group, backend=be)
        if rank == cp - 1:
            q, k, v = (q[:, :hq // 2], k, v) if kind == "heads" else (q[1:], k[1:], v[1:])
        out, _ = mcp.attention(q, k, v, plan, group, backend=be)
        float(out.float().sum())  # the host waits for the call's exchange
    except (RuntimeError, ValueError) as e:
        err = e
    seconds = time.monotonic() - start
    state.FIELD_CHANGE_TIMEOUT_S = timeout
    raised = [None] * cp
    dist.all_gather_object(raised, isinstance(err, state.RanksDisagreeError if kind == "heads" or rank < cp - 1
                                              else ValueError), group=gloo)
    if rank == cp - 1:
        group.abort()  # its peers aborted theirs: none of its collectives would meet them again
    return dict(ok=all(raised), raised=err is not None, ranks_raised=sum(raised), seconds=round(seconds, 2),
                error=None if err is None else f"{type(err).__name__}: {err}")


# the cases' calls: (q, k, v, plan, backend, scale, stats) -> (out, lse)
def run_ours(stages=None):
    return lambda q, k, v, plan, be, scale, stats: mcp.attention(q, k, v, plan, dist.group.WORLD,
                                                                 softmax_scale=scale, backend=be, stages=stages)


def run_baseline(impl):
    return lambda q, k, v, plan, be, scale, stats: get_strategy(impl, backend=be)(q, k, v, plan, dist.group.WORLD,
                                                                                  scale)


def run_sparse(sel):
    return lambda q, k, v, plan, be, scale, stats: mcp.sparse.sparse_attention(
        q, k, v, plan, dist.group.WORLD, sel, scale, backend=be, stats=stats)


def cases(s, s_x, cp, dims, dev, dry):
    """(mask name, data maker, [(family, impl, variant, fn(data, backend) -> record figures)]) per problem."""
    for name in catalog.DIST_MASKS:
        mask = catalog.build(name, s)
        plans = [(mcp.plan(mask, cp), "")]
        # rows keeping most keys: also run them as guest rows (planner.guests) where auto keeps them home
        cand = candidate_rows(geometry.row_area_prefix(mask.traps, s), s, cp)
        if len(cand) and not plans[0][0].has_guests:
            plans.append((mcp.plan(mask, cp, guest_rows=cand), " +guests"))
        yield name, functools.partial(problem, mask, dims, dev), [
            *(("dense", OURS, f"stages {'auto' if st is None else st}{tag}",
               functools.partial(check, run_ours(st), p)) for p, tag in plans for st in (None, 0)),
            *(("dense", x, "-", functools.partial(check, run_baseline(x), plan_for(x, mask, cp), may_refuse=True))
              for x in STRATEGIES)]
    mla = (*dims[:2], *MLA_DIMS)
    for name in EXTRA_MASKS:
        mask = catalog.build(name, s_x)
        # the dry run's sequences hold a few blocks; on the GPU blocks of 128 (FA4's block-sparse granularity)
        for sel in (mcp.sparse.MoBA(block=16 if dry else 128, top_k=2 if dry else 3),
                    mcp.sparse.XAttention(block=16 if dry else 128)):
            plan = mcp.plan(mask, cp, block=sel.block, guest_rows="none")  # what sparse_attention needs
            yield name, functools.partial(problem, mask, dims, dev, sparse=(plan, sel)), [
                ("sparse", OURS, sel.name, functools.partial(check, run_sparse(sel), plan))]
        plan = mcp.plan(mask, cp)
        yield name, functools.partial(problem, mask, dims, dev, sink=True), [
            ("sink", OURS, "sink", functools.partial(check, run_ours(), plan))]
        yield name, functools.partial(problem, mask, mla, dev), [
            ("mla", OURS, "q/k {} v {}".format(*MLA_DIMS), functools.partial(check, run_ours(), plan))]
    if cp > 1:
        yield "causal", lambda: None, [("mismatch", OURS, f"mismatch {kind}",
                                        functools.partial(mismatch, kind, "causal", s_x, dims, dev))
                                       for kind in ("plan", "heads")] + [
            ("mismatch", OURS, f"mismatch later {kind}", functools.partial(later_change, kind, "causal", s_x, dims, dev))
            # rows: on gloo the peer waits in the call's check until the raising rank's process exits, which this
            # tool's does not (it goes on to the next case): NCCL only (gloo: tests/test_later_call_fields.py)
            for kind in ("heads", "rows") if kind == "heads" or dist.get_backend() == "nccl"]


FAMILIES = ("dense", "sparse", "sink", "mla", "mismatch")


def main(argv=None):
    ap = parser(__doc__, "out")
    ap.add_argument("--share-gpu", action="store_true",
                    help="ranks spread over the visible GPUs on gloo through host copies: correctness only")
    ap.add_argument("--backends", default=None, help=f"comma list of kernel backends (default: those of "
                    f"{', '.join(BACKENDS)} the GPU has; a dry run: reference)")
    ap.add_argument("--families", default=None, help=f"comma list of case families (default: all of "
                    f"{', '.join(FAMILIES)}); e.g. dense alone checks the exchange paths on every mask")
    ap.add_argument("--impls", default=None, help="comma list of implementations (default: megatron_cp and every "
                    "baseline); e.g. megatron_cp alone")
    args = ap.parse_args(argv)
    fams = FAMILIES if args.families is None else tuple(args.families.split(","))
    if set(fams) - set(FAMILIES):
        ap.error(f"--families: unknown {sorted(set(fams) - set(FAMILIES))}; choose from {', '.join(FAMILIES)}")
    impls = (OURS, *BASELINES) if args.impls is None else tuple(args.impls.split(","))
    if set(impls) - {OURS, *BASELINES}:
        ap.error(f"--impls: unknown {sorted(set(impls) - {OURS, *BASELINES})}; choose from "
                 f"{', '.join((OURS, *BASELINES))}")
    dev = start_ranks(args.dry_run, args.share_gpu)
    names = args.backends.split(",") if args.backends else (
        ["reference"] if args.dry_run else [b for b in kernels.available_backends(dev) if b in BACKENDS])
    if not args.dry_run:
        for key, op in CUDNN_OPS.items():
            setattr(cudnn, op, functools.partial(_counted, key, getattr(cudnn, op)))
    backends = {n: make_backend(n, dev) for n in names}
    rank, cp = dist.get_rank(), dist.get_world_size()
    # the dry run: small enough for the CPU suite, blocks of 16 still leave the selections a choice
    (s, s_x), dims = ((256, 256), (4, 2, 32, 32)) if args.dry_run else ((16384, 8192), (8, 2, 128, 128))
    todo = [(name, make, [c for c in group if c[0] in fams and c[1] in impls]) for name, make, group in cases(s, s_x, cp, dims, dev,
                                                                                        args.dry_run)]
    todo, results = [t for t in todo if t[2]], []
    bar = Progress(len(backends) * sum(len(c) for *_, c in todo), "gpu_dist_check", enabled=rank == 0,
                   verbose=args.verbose)
    for name, make, group in todo:
        data = make()
        for bname, be in backends.items():
            for family, impl, variant, fn in group:
                bar.running(f"{name} {bname} {impl} {variant}")
                rec = dict(family=family, mask=name, backend=bname, impl=impl, variant=variant, rank=rank,
                           **fn(data, be))
                results.append(rec)
                if args.verbose or not rec["ok"]:  # every rank's (the bar is rank 0's)
                    bar.note(f"rank {rank} {name} {bname} {impl} {variant} ok={rec['ok']} "
                             + " ".join(f"{k}={rec[k]}" for k in ("guest_rows", "cudnn_calls", "rms_err_vs_bf16_ref",
                                                                   "sparse", "error") if k in rec))
                bar.step()
        del data
    bar.close()
    gathered = [None] * cp
    dist.all_gather_object(gathered, results)
    flat = [r for rr in gathered for r in rr]
    if rank == 0:
        print("\n".join(summary_table(flat)))
        meta = torchrun_record(dev, S=s, S_extra=s_x, Hq=dims[0], Hkv=dims[1], D=dims[2], backends=names,
                               share_gpu=args.share_gpu, all_ok=all(r["ok"] for r in flat))
        write_json(os.path.join(out_dir(args), f"gpu_dist_check{args.tag}.json"), {**meta, "results": flat})
    dist.destroy_process_group()
    return 0 if all(r["ok"] for r in flat) else 1


if __name__ == "__main__":
    sys.exit(main())
