"""``python -m megatron_cp``: plan a mask from the command line, or compare every solver on it.

    python -m megatron_cp plan --mask packed --seqlen 131072 --cp 8 [--docs FILE | --seed S]
                               [--solver auto] [--json plan.json] [--png plan.png]
    python -m megatron_cp compare --mask causal --seqlen 16384 --cp 4 [--json compare.json]

``plan`` prints ``Plan.describe()`` (per rank: tokens, work, received K/V, tiles, guest rows) and writes
the plan's statistics (``Plan.stats()``) as JSON and its picture (``Plan.draw``) as PNG. ``compare`` plans
the mask with every solver and prints one row each (imbalance, busiest rank's received K/V tokens, bytes
moved, planning time); on small instances (cp <= 8, at most 64 chunks) it also solves the chunk
assignment exactly (``planner.milp``) and prints each solver's gap to that optimum.

Masks are the named masks of ``megatron_cp.masks.catalog``, or a builder of ``megatron_cp.masks`` that takes
(seqlen, sizes) (``masks.builders_taking("sizes")``) with its sizes (``--mask prefix_lm --mask-args prefix=4096``;
``--help`` lists them). For the document masks (``packed``,
``docs_causal``) ``--docs FILE`` gives the document lengths (one integer per line, or a JSON list) and
``--seed S`` draws new ones (lognormal, sigma 1, around a median of min(1500, S/64) tokens, clipped to
[min(64, S/64), S/8]: the catalog's ``packed`` rule with another seed). Bad values are refused by the
argument parser before any mask is built.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import sys
import time

import numpy as np

from . import masks as M
from .masks import catalog
from .planner import SOLVERS, Plan, Topology, in_feasible_set, optimal_assignment, plan

__all__ = ["main"]

MILP_MAX_CP = 8
MILP_MAX_CHUNKS = 64


def random_doc_lengths(seqlen: int, seed: int) -> list[int]:
    """Document lengths summing to ``seqlen`` (see the module doc for the rule)."""
    rng = np.random.default_rng(seed)
    median = min(1500, max(8, seqlen // 64))
    lo, hi = min(64, max(2, seqlen // 64)), max(2, seqlen // 8)
    out, tot = [], 0
    while tot < seqlen:
        n = min(max(lo, min(int(np.exp(np.log(median) + rng.standard_normal())), hi)), seqlen - tot)
        out.append(n)
        tot += n
    return out


def read_doc_lengths(path: str) -> list[int]:
    """Document lengths from ``path``: a JSON list, or one integer per line (blank lines skipped)."""
    with open(path) as f:
        text = f.read()
    try:
        vals = json.loads(text)
        if not isinstance(vals, list):
            raise ValueError(f"{path}: JSON must be a list of document lengths, got {type(vals).__name__}")
    except json.JSONDecodeError:
        vals = [line.strip() for line in text.splitlines() if line.strip()]
    out = []
    for v in vals:
        try:
            n = int(v)
        except (TypeError, ValueError):
            raise ValueError(f"{path}: document length {v!r} is not an integer") from None
        if n < 1 or str(n) != str(v).strip():
            raise ValueError(f"{path}: document length {v!r} must be a positive integer")
        out.append(n)
    if not out:
        raise ValueError(f"{path}: no document lengths")
    return out


def _number(name: str, convert, expected: str, in_range, range_text: str):
    """An argparse ``type``: ``convert(text)``, refused with "expected <expected>" when it does not parse and
    "expected <range_text>" when ``in_range`` rejects the value (argparse prints the message)."""
    def parse(text: str):
        try:
            v = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not in_range(v):
            raise argparse.ArgumentTypeError(f"expected {range_text}, got {v}")
        return v

    parse.__name__ = name
    return parse


_positive = _number("_positive", int, "a positive integer", lambda v: v >= 1, "a positive integer")
_fraction = _number("_fraction", float, "a number >= 0", lambda v: 0 <= v < 10, "a fraction in [0, 10)")


# the builders of megatron_cp.masks that take (seqlen, integer sizes): --mask NAME --mask-args K=V,...
BUILDER_MASKS = M.builders_taking("sizes")
MASK_CHOICES = tuple(catalog.NAMES) + tuple(n for n in BUILDER_MASKS if n not in catalog.NAMES)


def _mask_args(text: str) -> dict:
    out = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        try:
            out[key.strip()] = int(value) if value.strip().lower() not in ("true", "false") else value.strip().lower() == "true"
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not K=V with an integer (or true / false) V") from None
        if not eq or not key.strip():
            raise argparse.ArgumentTypeError(f"{item!r} is not K=V")
    return out


def _version() -> str:
    """The installed distribution's version (pip install / -e record it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-cp")
    except PackageNotFoundError:
        return "(not installed: run from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megatron_cp", description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="version", version=f"megatron-cp {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--mask", required=True, choices=MASK_CHOICES,
                        help="a mask of megatron_cp.masks.catalog, or (with --mask-args) a builder of "
                             f"megatron_cp.masks: {', '.join(BUILDER_MASKS)}")
    common.add_argument("--mask-args", metavar="K=V[,K=V]", type=_mask_args,
                        help="build --mask with megatron_cp.masks.<mask>(seqlen, K=V, ...) and these integer "
                             "arguments instead of the catalog's sizes, e.g. --mask prefix_lm --mask-args prefix=4096")
    common.add_argument("--seqlen", type=_positive, help="sequence length (with --docs: their sum by default)")
    common.add_argument("--cp", type=_positive, required=True, help="context-parallel ranks")
    docs = common.add_mutually_exclusive_group()
    docs.add_argument("--docs", metavar="FILE", help="document lengths (packed masks): one per line or a JSON list")
    docs.add_argument("--seed", type=int, help="draw document lengths with this seed (packed masks)")
    common.add_argument("--chunk-size", type=_positive, help="the planner's chunk size (default: its own)")
    common.add_argument("--nodes", type=_positive, default=1, help="nodes of cp / nodes GPUs each (default 1)")
    common.add_argument("--imbalance-target", type=_fraction, default=0.03,
                        help="work imbalance the planner accepts (default 0.03)")
    common.add_argument("--json", metavar="PATH", help="write the figures here")
    # the model's K/V shape, which prices the bytes moved (Plan.stats / describe / draw)
    common.add_argument("--kv-heads", type=_positive, default=8, help="K/V heads per rank's attention (default 8)")
    common.add_argument("--head-dim", type=_positive, default=128, help="head dim (default 128)")
    common.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="K/V element type (default bfloat16)")

    p = sub.add_parser("plan", parents=[common], help="plan a mask and print what every rank does")
    p.add_argument("--solver", default="auto", choices=SOLVERS)
    p.add_argument("--png", metavar="PATH", help="save the plan's picture (Plan.draw; needs matplotlib)")

    c = sub.add_parser("compare", parents=[common], help="every solver side by side, and the optimum when small")
    c.add_argument("--milp-chunks", type=_positive,
                   help=f"chunks of the exact chunk assignment (default 8 per rank; at most {MILP_MAX_CHUNKS})")
    c.add_argument("--milp-time-limit", type=float, default=20.0, help="seconds for HiGHS (default 20)")
    c.add_argument("--no-milp", action="store_true", help="skip the exact chunk assignment")
    return ap


def _check(ap: argparse.ArgumentParser, args) -> None:
    """Every refusal before work: argparse's error (exit status 2) names the value."""
    if args.mask_args is not None and args.mask not in BUILDER_MASKS:
        ap.error(f"--mask-args builds one of {', '.join(BUILDER_MASKS)}, not --mask {args.mask}")
    if args.mask_args is None and args.mask not in catalog.NAMES:
        sig = inspect.signature(getattr(M, args.mask))
        need = [n for n, p in list(sig.parameters.items())[1:] if p.default is inspect.Parameter.empty]
        ap.error(f"--mask {args.mask} is a builder, not a catalog mask: give its sizes with --mask-args "
                 f"({', '.join(f'{n}=...' for n in need)})")
    if (args.docs is not None or args.seed is not None) and args.mask not in catalog.DOCUMENT_MASKS:
        ap.error(f"--docs / --seed apply to the document masks {', '.join(catalog.DOCUMENT_MASKS)}, not --mask "
                 f"{args.mask}")
    if args.docs is not None:
        try:
            args.doc_lengths = read_doc_lengths(args.docs)
        except (OSError, ValueError) as e:
            ap.error(f"--docs: {e}")
        total = sum(args.doc_lengths)
        if args.seqlen is None:
            args.seqlen = total
        elif args.seqlen != total:
            ap.error(f"--docs lengths sum to {total}, not --seqlen {args.seqlen}")
    elif args.seqlen is None:
        ap.error("--seqlen is required (unless --docs gives the document lengths)")
    if args.cp > args.seqlen:
        ap.error(f"--cp {args.cp} exceeds --seqlen {args.seqlen}")
    if args.mask_args is not None:  # built here, so that a wrong size is an argument error, not a traceback
        try:
            args.built_mask = getattr(M, args.mask)(args.seqlen, **args.mask_args)
        except (TypeError, ValueError) as e:
            ap.error(f"--mask {args.mask} --mask-args {','.join(f'{k}={v}' for k, v in args.mask_args.items())}: "
                     f"{e} (signature: {args.mask}{inspect.signature(getattr(M, args.mask))})")
    if args.cp % args.nodes:
        ap.error(f"--nodes {args.nodes} does not divide --cp {args.cp}")
    if args.chunk_size is not None and args.chunk_size > args.seqlen:
        ap.error(f"--chunk-size {args.chunk_size} exceeds --seqlen {args.seqlen}")
    if getattr(args, "png", None) is not None and not hasattr(Plan, "draw"):
        ap.error("--png needs Plan.draw(path), which this megatron_cp does not have")
    for flag in ("json", "png"):  # said before planning, not as a traceback after it
        path = getattr(args, flag, None)
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            ap.error(f"--{flag} {path}: the folder {os.path.dirname(os.path.abspath(path))} does not exist")
    if args.command == "compare" and not args.milp_time_limit > 0:
        ap.error(f"--milp-time-limit must be > 0 seconds, got {args.milp_time_limit}")
    if args.command == "compare" and args.milp_chunks is not None:
        n = args.milp_chunks
        if n % args.cp or args.seqlen % n or n > MILP_MAX_CHUNKS:
            ap.error(f"--milp-chunks {n} must be a multiple of --cp {args.cp} that divides --seqlen "
                     f"{args.seqlen}, at most {MILP_MAX_CHUNKS}")


def build_mask(args) -> M.AttnMask:
    if args.mask_args is not None:
        return args.built_mask
    if args.mask in catalog.DOCUMENT_MASKS and (args.docs is not None or args.seed is not None):
        lens = args.doc_lengths if args.docs is not None else random_doc_lengths(args.seqlen, args.seed)
        return M.varlen(np.concatenate([[0], np.cumsum(lens)]).tolist(), causal=True)
    return catalog.build(args.mask, args.seqlen)


def _topology(args) -> Topology | None:
    return Topology(args.nodes, args.cp // args.nodes) if args.nodes > 1 else None


def _write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m megatron_cp"] + sys.argv[1:]) if sys.argv else "",
        "machine": platform.processor() or platform.machine(),
    }
    with open(path, "w") as f:
        json.dump({"meta": meta, **payload}, f, indent=1)


def _shape(args) -> dict:
    """The keywords that price bytes in Plan.stats / describe / draw, from --kv-heads, --head-dim, --dtype."""
    return dict(num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype_bytes=args.dtype)


def _mask_label(args) -> str:
    src = f", docs from {args.docs}" if args.docs is not None else (f", docs seed {args.seed}" if args.seed is not None else "")
    if args.mask_args is not None:
        src = "(" + ", ".join(f"{k}={v}" for k, v in args.mask_args.items()) + ")"
    return f"{args.mask}{src}"


def run_plan(args) -> int:
    mask = build_mask(args)
    t = time.perf_counter()
    p = plan(mask, args.cp, chunk_size=args.chunk_size, topology=_topology(args), solver=args.solver,
             imbalance_target=args.imbalance_target)
    dt = time.perf_counter() - t
    print(f"mask {_mask_label(args)}: planned in {dt:.2f} s")
    print(p.describe(**_shape(args)))
    if args.json:
        _write_json(args.json, {"mask": args.mask, "mask_args": args.mask_args, "solver_requested": args.solver,
                                "plan_seconds": dt,
                                "digest": p.digest, "kv_shape": _shape(args), **p.stats(**_shape(args))})
        print(f"wrote {args.json}")
    if args.png:
        p.draw(args.png, **_shape(args))
        print(f"wrote {args.png}")
    return 0


def _milp_chunks(args) -> int | None:
    """Chunks of the exact assignment: --milp-chunks, else 8 per rank (fewer when that does not divide
    the sequence); None when the instance is too large for it."""
    if args.no_milp or args.cp > MILP_MAX_CP:
        return None
    if args.milp_chunks is not None:
        return args.milp_chunks
    for k in (8, 4, 2, 1):
        if args.seqlen % (k * args.cp) == 0:
            return k * args.cp
    return None


def compare_rows(args, mask=None) -> tuple[list[dict], dict | None]:
    """One row per solver (plan statistics, planning time, gap to the optimum) and the exact chunk
    assignment's result (None when not run). With the exact assignment, every solver plans on its chunk
    size unless --chunk-size says otherwise, so that the gaps compare layouts under the same rules."""
    mask = build_mask(args) if mask is None else mask
    n = _milp_chunks(args)
    chunk = args.chunk_size if args.chunk_size is not None or n is None else args.seqlen // n
    rows, plans = [], []
    for solver in SOLVERS:
        t = time.perf_counter()
        p = plan(mask, args.cp, chunk_size=chunk, topology=_topology(args), solver=solver,
                 imbalance_target=args.imbalance_target)
        dt = time.perf_counter() - t
        rows.append({**p.stats(**_shape(args)), "solver": solver, "chosen": p.solver + ("+guests" if p.has_guests else ""),
                     "plan_seconds": dt})
        plans.append(p)
    if n is None:
        return rows, None
    print(f"solving the exact assignment of {n} chunks (scipy HiGHS, at most {args.milp_time_limit:g} s; --no-milp "
          "skips it) ...", flush=True)
    res = optimal_assignment(mask, args.cp, n, imbalance_target=args.imbalance_target,
                             time_limit=args.milp_time_limit,
                             layouts=[(p.bounds, p.owner) for p in plans if not p.has_guests])
    for row, p in zip(rows, plans):
        row["in_milp_set"] = in_feasible_set(p, res)
        row["gap_to_optimum"] = (row["max_remote_kv_tokens"] / res.max_remote - 1.0
                                 if res.max_remote else None)
    milp = {"status": res.status, "num_chunks": res.num_chunks, "chunk_size": res.chunk_size,
            "imbalance_target": res.imbalance_target, "max_remote_kv_tokens": res.max_remote,
            "lower_bound": res.lower_bound, "imbalance": res.imbalance, "seconds": res.seconds,
            "owner": res.owner.tolist(), "remote_kv_tokens_per_rank": res.remote_kv_tokens_per_rank}
    return rows, milp


def format_table(rows: list[dict], milp: dict | None, target: float, shape: dict) -> str:
    hdr = (f"{'solver':12s} {'chosen':22s} {'imbal':>7s} {'max recv K/V':>12s} {'MB moved':>9s} {'tiles':>6s} "
           f"{'plan s':>7s}" + (f" {'vs optimum':>12s}" if milp else ""))
    out = [hdr, "-" * len(hdr)]
    for r in rows:
        line = (f"{r['solver']:12s} {r['chosen']:22s} {100 * r['imbalance']:6.2f}% {r['max_remote_kv_tokens']:12,d} "
                f"{r['bytes_moved'] / 2**20:9.1f} {max(r['tiles_per_rank']):6d} {r['plan_seconds']:7.2f}")
        if milp:
            if r["imbalance"] > target:
                gap = "unbalanced"
            elif r["gap_to_optimum"] is None:
                gap = "-"
            else:
                gap = f"{100 * r['gap_to_optimum']:+.1f}%" + ("" if r["in_milp_set"] else "*")
            line += f" {gap:>12s}"
        out.append(line)
    if milp:
        rule = (f"{milp['num_chunks']} chunks of {milp['chunk_size']} tokens, {milp['num_chunks'] // len(rows[0]['tokens_per_rank'])}"
                f" per rank, imbalance <= {100 * target:g}%")
        if milp["status"] == "infeasible":
            out.append(f"MILP ({rule}): no layout balances; more chunks (--milp-chunks) or --imbalance-target")
        elif milp["status"] == "optimal":
            out.append(f"MILP ({rule}): optimum {milp['max_remote_kv_tokens']:,} K/V tokens on the busiest rank "
                       f"(imbalance {100 * milp['imbalance']:.2f}%), proven in {milp['seconds']:.1f} s")
        else:
            best = "none found" if milp["max_remote_kv_tokens"] is None else f"{milp['max_remote_kv_tokens']:,}"
            out.append(f"MILP ({rule}): time limit after {milp['seconds']:.1f} s; optimum between "
                       f"{milp['lower_bound']:,} and {best} K/V tokens (gaps are to the upper end)")
        out.append("gap: busiest rank's received K/V over the optimum; * = not in the MILP's set (other chunk "
                   "cuts, unequal token counts or guest rows), so it can be negative")
    out.append(f"MB moved: K and V of every received token, {shape['num_kv_heads']} K/V heads, head dim "
               f"{shape['head_dim']}, {shape['dtype_bytes']}")
    return "\n".join(out)


def run_compare(args) -> int:
    rows, milp = compare_rows(args)
    chunk = rows[0]["chunk_size"] if args.chunk_size is None and milp else args.chunk_size
    print(f"mask {_mask_label(args)}, S = {args.seqlen:,}, cp = {args.cp}"
          + (f", chunk_size {chunk} (the MILP's chunks)" if milp and args.chunk_size is None else ""))
    print(format_table(rows, milp, args.imbalance_target, _shape(args)))
    if milp is None and not args.no_milp:
        print(f"(no MILP: it runs for cp <= {MILP_MAX_CP}, with chunks that divide the sequence)")
    if milp is not None and args.chunk_size is None:
        # the rows use the MILP's chunks; say what `plan` with the same arguments (the planner's own chunks) gives
        p = plan(build_mask(args), args.cp, topology=_topology(args), imbalance_target=args.imbalance_target)
        st = p.stats(**_shape(args))
        print(f"`plan` with these arguments cuts chunks of {p.chunk_size} (the planner's default): solver {p.solver}, "
              f"imbalance {st['imbalance']:.2%}, busiest rank's received K/V {st['max_remote_kv_tokens']:,}; "
              f"`plan --chunk-size {chunk}` plans the MILP's chunks, as the rows above")
    if args.json:
        _write_json(args.json, {"mask": args.mask, "mask_args": args.mask_args, "seqlen": args.seqlen, "cp": args.cp,
                                "rows": rows, "milp": milp})
        print(f"wrote {args.json}")
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    """The command line's arguments, checked (a bad value exits with argparse's message, status 2)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    _check(ap, args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_plan(args) if args.command == "plan" else run_compare(args)
