"""Every name list is its registry (issue 64 item 1): the argparse choices of the Megatron flags, the command line,
the tools and the examples, and the tools' own lists, equal the registry of their family - kernel backends
(``kernels.BACKENDS``), context-parallel strategies (``baselines.STRATEGY_NAMES``), mask builders with their argument
kinds (``masks.BUILDERS``), sparse selectors (``sparse.SELECTORS``) and head-gating methods (``gating.METHODS``).
A sweep over every tool's and example's parser finds any other choice list that names a backend, strategy,
selector or gating method (a hand-copied list the table below does not know)."""

from __future__ import annotations

import argparse
import importlib
import pathlib

import pytest

import megatron_cp as mcp
from megatron_cp import baselines, gating, kernels, sparse
from megatron_cp.kernels.fa4 import measured
from megatron_cp.masks import catalog
from scripts import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]

BACKENDS = tuple(kernels.BACKENDS)
GPU_BACKENDS = tuple(b for b in BACKENDS if b != "reference")
SIZES = mcp.masks.builders_taking("sizes")
# names only these families use: a choice list holding one of them is one of these families' lists
DISTINCT = set(BACKENDS) | set(baselines.STRATEGIES) | set(sparse.SELECTORS) | set(gating.METHODS)


class _Parsed(Exception):
    pass


def parser_of(main, argv=(), monkeypatch=None) -> argparse.ArgumentParser:
    """The parser ``main`` builds, caught at its ``parse_args`` (nothing after it runs)."""
    got = {}

    def catch(self, *a, **k):
        got["parser"] = self
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(_Parsed):
        main(list(argv)) if argv is not None else main()
    monkeypatch.undo()
    return got["parser"]


def choices(parser) -> dict:
    """option string -> tuple of choices, for every argument with choices (subparsers' included)."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.update(choices(sub))
        elif action.choices is not None and action.option_strings:
            out[action.option_strings[0]] = tuple(action.choices)
    return out


def _tool(name):
    return load_script(ROOT / "tools" / f"{name}.py")


# every parser of the tools and examples: (label, how to get its main, argv or None for a main without one)
def _parsers():
    for path in sorted((ROOT / "tools").glob("*.py")):
        if "def main(" in path.read_text():
            takes_argv = "def main(argv" in path.read_text()
            yield f"tools/{path.name}", (lambda p=path: load_script(p).main), [] if takes_argv else None
    yield "examples/tiny_llama/demo.py", (lambda: importlib.import_module("tiny_llama.demo").main), []
    yield "examples/tiny_llama/train_gates.py", (lambda: importlib.import_module("tiny_llama.train_gates").parse), []
    yield "megatron_cp/cli.py", (lambda: (lambda argv: mcp_cli().build_parser().parse_args(argv))), []


def mcp_cli():
    from megatron_cp import cli

    return cli


def _megatron_parser():
    pytest.importorskip("megatron.core")
    from megatron_cp.megatron.arguments import add_megatron_cp_args

    return add_megatron_cp_args(argparse.ArgumentParser())


def test_megatron_flags_are_their_registries():
    got = choices(_megatron_parser())
    from megatron_cp.megatron.batch import BOUNDARY_MASKS

    assert got["--context-parallel-impl"] == ("te", *baselines.STRATEGY_NAMES)
    assert got["--cp-kernel-backend"] == kernels.BACKEND_CHOICES == ("auto", *BACKENDS)
    assert got["--cp-sparse"] == ("none", *sparse.SELECTORS)
    assert got["--cp-head-gating"] == ("none", *gating.METHODS)
    # the masks built from batch boundaries (one of them is sliding_window's per-document form), then every builder
    # that takes (seqlen, sizes)
    assert got["--cp-mask"] == BOUNDARY_MASKS + tuple(n for n in SIZES if n not in BOUNDARY_MASKS)
    assert set(SIZES) <= set(got["--cp-mask"])
    assert set(got) == {"--context-parallel-impl", "--cp-kernel-backend", "--cp-sparse", "--cp-head-gating",
                        "--cp-mask"}, "a megatron-cp flag with choices this test does not check"


def test_command_line_masks_are_the_catalog_and_the_sized_builders():
    from megatron_cp import cli

    got = choices(cli.build_parser())
    assert got["--mask"] == tuple(catalog.NAMES) + tuple(n for n in SIZES if n not in catalog.NAMES)
    assert cli.BUILDER_MASKS == SIZES == ("sliding_window", "block_causal", "prefix_lm", "strided", "global_local",
                                          "star", "streaming")
    assert got["--solver"] == tuple(mcp.planner.SOLVERS)


def test_every_builder_is_registered_with_an_argument_kind():
    """Every mask builder the package exports is in BUILDERS, called by its own name, with a known argument kind;
    the two mask-from-masks functions are not builders."""
    import inspect

    from megatron_cp.masks import builders, general

    reg = mcp.masks.BUILDERS
    assert set(reg) | {"streaming_within", "block_diagonal"} == {n for m in (builders, general) for n in m.__all__
                                                                 if inspect.isfunction(getattr(m, n))}
    for name, b in reg.items():
        assert b.fn is getattr(mcp.masks, name) and b.fn.__name__ == name and b.args in mcp.masks.ARG_KINDS
    # a sized builder is called as builder(seqlen, **sizes): its first parameter is the one length
    for name in SIZES:
        assert list(inspect.signature(reg[name].fn).parameters)[0] == "seqlen", name
    with pytest.raises(ValueError, match="'sizez' is unknown"):
        mcp.masks.builders_taking("sizez")


def test_registries_name_what_they_hold():
    assert all(cls.name == name for name, cls in sparse.SELECTORS.items())
    assert all(getattr(cls, "name", name) == name for name, cls in kernels.BACKENDS.items())
    assert baselines.STRATEGY_NAMES == (baselines.OWN, *baselines.STRATEGIES)
    for name in BACKENDS:
        assert type(kernels.get_backend(name)) is kernels.BACKENDS[name]
    with pytest.raises(ValueError, match="choose from auto, fa4, triton, reference"):
        kernels.get_backend("cudnn")


def test_tools_and_examples_choices_are_their_registries(monkeypatch):
    expected = {
        ("tools/bench_sparse.py", "--methods"): tuple(sparse.SELECTORS),
        ("tools/bench_sparse.py", "--backend"): kernels.BACKEND_CHOICES,
        ("tools/gpu_kernel_check.py", "--backend"): ("auto", *GPU_BACKENDS),
        ("tools/gpu_kernel_check.py", "--route"): ("measured", *measured.ROUTES),
        ("tools/bench_first_call.py", "--backend"): GPU_BACKENDS,
        ("examples/tiny_llama/demo.py", "--kernel-backend"): kernels.BACKEND_CHOICES,
        ("examples/tiny_llama/train_gates.py", "--method"): (*gating.METHODS, "both"),
    }
    seen, unknown = set(), []
    for label, main, argv in _parsers():
        for flag, ch in choices(parser_of(main(), argv, monkeypatch)).items():
            if (label, flag) in expected:
                assert ch == expected[(label, flag)], (label, flag, ch)
                seen.add((label, flag))
            elif set(ch) & DISTINCT:
                unknown.append(f"{label} {flag} {ch}")
    assert seen == set(expected), set(expected) - seen
    assert not unknown, "choice lists naming a registry's entries, not checked against it:\n" + "\n".join(unknown)


def test_tools_lists_are_their_registries():
    bench_train, bench_dist, gpu_dist = _tool("bench_train"), _tool("bench_dist"), _tool("gpu_dist_check")
    assert bench_train.IMPLS == (baselines.OWN, *baselines.STRATEGIES)
    assert set(bench_train.IMPLS) - set(bench_train.DEFAULT_IMPLS) == {"head_context"}
    impls = bench_dist.IMPLS.split(",")
    assert set(impls) == {baselines.OWN, *bench_dist.SPARSE_IMPLS, *baselines.STRATEGIES, "torch-native"} - {
        "head_context"}
    assert {i.split("+")[1] for i in bench_dist.SPARSE_IMPLS} <= set(sparse.SELECTORS)
    assert gpu_dist.STRATEGIES == tuple(baselines.STRATEGIES)
    assert gpu_dist.BACKENDS == GPU_BACKENDS


def test_the_sweep_catches_a_hand_copied_list(monkeypatch):
    """A parser with a hand-copied backend list (here without fa4) is found by the sweep's rule."""
    def main(argv):
        ap = argparse.ArgumentParser()
        ap.add_argument("--kernel-backend", choices=("auto", "triton", "reference"))
        ap.add_argument("--mask", choices=("causal", "packed"))
        return ap.parse_args(argv)

    got = choices(parser_of(main, [], monkeypatch))
    flagged = [f for f, ch in got.items() if set(ch) & DISTINCT]
    assert flagged == ["--kernel-backend"]
    assert got["--kernel-backend"] != kernels.BACKEND_CHOICES


def test_megatron_flags_come_from_the_option_fields():
    """Every megatron-cp flag is an option field's (``options.flag`` metadata) or a selector's method flag, with the
    field's help, choices and default (unless the flag gives its own); nothing else adds one."""
    import dataclasses

    parser = _megatron_parser()
    from megatron_cp.megatron.gating import GatingSpec
    from megatron_cp.megatron.options import MaskSpec, PlanOptions
    from megatron_cp.megatron.sparse_spec import METHOD_FLAGS, SparseSpec

    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings and a.dest != "help"}
    want = {}
    for cls in (MaskSpec, PlanOptions, SparseSpec, GatingSpec):
        for f in dataclasses.fields(cls):
            if "flag" in f.metadata:
                name, help, kw = f.metadata["flag"]
                want[name] = (help, kw.get("choices"), kw.get("default", f.default))
    for name, _, _, kw in METHOD_FLAGS:
        want[name] = (kw["help"], None, None)
    assert set(actions) == set(want)
    for name, (help, ch, default) in want.items():
        a = actions[name]
        assert (a.help, a.choices, a.default) == (help, ch, default), name
    assert {"--cp-mask", "--cp-kernel-backend", "--context-parallel-impl", "--cp-sparse", "--cp-head-gating"} <= {
        n for n, (_, ch, _) in want.items() if ch is not None}


FAMILIES = {"kernel backends": kernels.BACKEND_CHOICES, "strategies": baselines.STRATEGY_NAMES,
            "sparse selectors": ("none", *sparse.SELECTORS), "gating methods": ("none", *gating.METHODS)}


def incomplete_lists(doc: str) -> list[str]:
    """The families a docstring lists three or more names of (``a | b | c``, ``a, b, c``, ``a / b / c``) without
    naming every one: a copy of a registry that has fallen behind it."""
    import re

    out = []
    for family, names in FAMILIES.items():
        alt = "|".join(re.escape(n) for n in names)
        item = rf"`*\b(?:{alt})\b`*"
        if re.search(rf"{item}(?:\s*(?:,|\||/|or|and)\s*{item}){{2,}}", doc):
            missing = [n for n in names if n != "none" and not re.search(rf"\b{re.escape(n)}\b", doc)]
            if missing:
                out.append(f"{family}: lacks {', '.join(missing)}")
    return out


def test_docstring_lists_name_the_whole_registry():
    import ast

    bad = []
    for path in sorted((ROOT / "megatron_cp").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))]:
            doc = ast.get_docstring(node)
            if doc:
                bad += [f"{path.relative_to(ROOT)} {getattr(node, 'name', '(module)')}: {m}"
                        for m in incomplete_lists(doc)]
    assert not bad, "\n".join(bad)
    # what the rule finds: the copies the registries replaced (fa4 missing), not a pair of names in prose
    assert incomplete_lists("kernel_backend: attention's kernel backend (auto | triton | reference)") == [
        "kernel backends: lacks fa4"]
    assert incomplete_lists("a kernel backend name (``auto``, ``triton``, ``reference``)") == [
        "kernel backends: lacks fa4"]
    assert incomplete_lists("FA4: ``fa4`` or ``triton (<why not FA4>)``") == []


def test_the_masks_package_doc_names_every_builder():
    import re

    doc = mcp.masks.__doc__
    assert [n for n in mcp.masks.BUILDERS if not re.search(rf"\b{n}\b", doc)] == []
