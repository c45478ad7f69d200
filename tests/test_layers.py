"""The layer rules of docs/layers.md, checked on the code (ast; nothing is imported):

- every import of a megatron_cp package is allowed by the layer table (kept here and in docs/layers.md:
  the test checks that the two agree);
- no import cycle among megatron_cp modules (function-level imports count);
- no module imports another package's private names, nor reads a private attribute of another
  package's module; tools/ and examples/ use public names only; no module imports another module's private
  names either, inside its own package included;
- kernels/fa4 imports nothing of kernels/triton (the shared kernels/config.py and kernels/fallback.py instead);
- a name taken from another package is in that package's ``__all__`` (its user API) or ``__shared__`` (what it
  shares with the layers above; a public module listed there, e.g. ``kernels.pieces``, may be imported and read);
- the user API and the shared API are apart: every package below the adapter declares both, they do not overlap,
  ``megatron_cp.__all__`` re-exports user names only, the quickstart example uses user names only, and
  docs/layers.md lists each package's shared names;
- the runtime takes from the planner only what ``megatron_cp.planner`` exports (``__all__`` and ``__shared__``);
- only megatron_cp.megatron imports megatron; masks, planner and kernels never import torch.distributed.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "megatron_cp"

# layer -> the megatron_cp layers it may import (itself always allowed); docs/layers.md holds the same table
LAYERS = {
    "kinds": set(),
    "masks": {"kinds"},
    "planner": {"kinds", "masks"},
    "kernels": {"kinds"},
    "comm": set(),
    "runtime": {"kinds", "masks", "planner", "kernels", "comm"},
    "baselines": {"kinds", "masks", "planner", "kernels", "comm", "runtime"},
    "sparse": {"kinds", "masks", "planner", "kernels", "comm", "runtime"},
    "gating": {"kinds", "masks", "planner", "kernels", "comm", "runtime"},
    "megatron": {"kinds", "masks", "planner", "kernels", "comm", "runtime", "baselines", "sparse", "gating"},
    "cli": {"masks", "planner"},
    "__main__": {"cli"},  # python -m megatron_cp
    "testing": {"masks", "planner", "runtime"},
}
FRONT = {"kinds", "masks", "planner", "runtime", "sparse", "gating"}  # what megatron_cp/__init__.py may re-export


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(path: pathlib.Path, name: str):
    """(module imported, names taken from it, line) for every import in the file, relative ones resolved;
    ``names`` is None for ``import x``."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.append((mod, [a.name for a in node.names], node.lineno))
    return tree, out


def _layer(mod: str) -> str | None:
    parts = mod.split(".")
    if parts[0] != "megatron_cp":
        return None
    return parts[1] if len(parts) > 1 else ""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(mod: str, names, mods: dict) -> list[str]:
    """Modules an import statement depends on: ``from pkg import sub`` names a submodule when it is one."""
    deps = [mod]
    for n in names or ():
        if f"{mod}.{n}" in mods:
            deps.append(f"{mod}.{n}")
    return deps


def test_layer_table_matches_the_docs():
    text = (ROOT / "docs" / "layers.md").read_text()
    rows = re.findall(r"^\| (\w+) \| megatron_cp\.(\w+) \| (.+?) \|$", text, flags=re.M)
    assert rows, "docs/layers.md has no layer table"
    doc = {}
    for layer, pkg, allowed in rows:
        assert layer == pkg
        if allowed.strip() == "every layer above":
            doc[layer] = set(doc)
        else:
            doc[layer] = set(re.findall(r"megatron_cp\.(\w+)", allowed))
    assert doc == LAYERS


def test_every_import_is_allowed_by_the_layer_table():
    mods = _modules()
    assert set(LAYERS) <= {_layer(m) for m in mods}, "a layer of the table has no module"
    bad = []
    for name, path in mods.items():
        me = _layer(name)
        _, imps = _imports(path, name)
        for mod, names, line in imps:
            # ``from megatron_cp import kernels`` imports the package megatron_cp.kernels
            subs = [f"{mod}.{n}" for n in names or () if f"{mod}.{n}" in mods]
            for target in subs or [mod]:
                them = _layer(target)
                if them is None or them == me:
                    continue
                assert me == "" or me in LAYERS, f"{name}: module outside the layer table"
                # the adapter may use the public front (``import megatron_cp as mcp``), as users do
                allowed = FRONT if me == "" else LAYERS[me] | ({""} if me == "megatron" else set())
                if them not in allowed:
                    bad.append(f"{path.relative_to(ROOT)}:{line} ({me}) imports {target} ({them or 'megatron_cp'})")
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        _, imps = _imports(path, name)
        deps = set()
        for mod, names, _ in imps:
            deps.update(d for d in _resolve(mod, names, mods) if d in mods and d != name)
        graph[name] = deps
    # a package imports its own submodules in __init__ and they import siblings through it: only edges
    # from a module into a package it is not part of, or between modules, can close a real cycle
    def edges(n):
        return {d for d in graph[n] if not (n.startswith(d + ".") and mods[d].name == "__init__.py")}

    state, stack, cycles = {}, [], []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(edges(n)):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _private_uses(path: pathlib.Path, name: str | None, tree, imps) -> list[str]:
    """Private names of other megatron_cp packages this file imports or reads as attributes."""
    me = _layer(name) if name else None
    out = []
    aliases = {}  # local name -> module it stands for (imports of megatron_cp modules)
    for mod, names, line in imps:
        them = _layer(mod)
        if them is None or (me is not None and them == me):
            continue
        if any(_private(p) for p in mod.split(".")):
            out.append(f"{path.relative_to(ROOT)}:{line} imports the private module {mod}")
        for n in names or ():
            if _private(n):
                out.append(f"{path.relative_to(ROOT)}:{line} imports {mod}.{n}")
            else:
                aliases[n] = f"{mod}.{n}"
        if names is None:
            aliases[mod.split(".")[0]] = mod.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and _layer(a.name) is not None and _layer(a.name) != me:
                    aliases[a.asname] = a.name
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            chain = []
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in aliases:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {aliases[root.id]}"
                           f"{''.join('.' + c for c in reversed(chain))}.{node.attr}")
    return out


def test_no_private_names_across_packages():
    bad = []
    for name, path in _modules().items():
        tree, imps = _imports(path, name)
        bad += _private_uses(path, name, tree, imps)
    assert not bad, "\n".join(bad)


def _private_imports(path: pathlib.Path, name: str, imps) -> list[str]:
    """Private names (``_x``) this module imports from any other megatron_cp module, its own package's included."""
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return [f"{where}:{line} imports {mod}.{n}" for mod, names, line in imps
            if _layer(mod) is not None and mod != name for n in names or () if _private(n)]


def test_no_private_names_across_modules():
    """Stricter than across packages: no module takes another module's private name, inside a package too."""
    bad = []
    for name, path in _modules().items():
        _, imps = _imports(path, name)
        bad += _private_imports(path, name, imps)
    assert not bad, "\n".join(bad)


def test_the_private_rule_catches_a_planted_import(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("from .blocks import _helper, tile_descriptors\nfrom ..tiles import check_tiles\n")
    _, imps = _imports(planted, "megatron_cp.kernels.triton.planted")
    bad = _private_imports(planted, "megatron_cp.kernels.triton.planted", imps)
    assert len(bad) == 1 and "megatron_cp.kernels.triton.blocks._helper" in bad[0], bad


def test_fa4_imports_nothing_of_the_triton_package():
    """FA4Backend reaches the Triton kernels through the shared config and fallback modules only."""
    bad = []
    for name, path in _modules().items():
        if name.startswith("megatron_cp.kernels.fa4"):
            _, imps = _imports(path, name)
            bad += [f"{path.relative_to(ROOT)}:{line} imports {mod}" for mod, names, line in imps
                    for d in _resolve(mod, names, _modules())
                    if d == "megatron_cp.kernels.triton" or d.startswith("megatron_cp.kernels.triton.")]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("folder", ["tools", "examples"])
def test_tools_and_examples_use_public_names_only(folder):
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree, imps = _imports(path, "x.y")
        bad += _private_uses(path, None, tree, imps)
        # nor each other's private modules through sys.path
        bad += [f"{path.relative_to(ROOT)}:{line} imports the private module {mod}" for mod, _, line in imps
                if mod != "__future__" and _private(mod.split(".")[0])]
    assert not bad, "\n".join(bad)


def _public_faces(mods) -> dict:
    """``__all__`` and ``__shared__`` of every top-level megatron_cp package or module (imported: some are built
    with ``*``): what other packages may take from it."""
    import importlib

    faces = {}
    for layer in sorted({_layer(m) for m in mods} - {None, "", "__main__"}):  # __main__ runs the CLI
        m = importlib.import_module(f"megatron_cp.{layer}")
        faces[layer] = set(getattr(m, "__all__", ())) | set(getattr(m, "__shared__", ()))
    return faces


def _outside_all(path: pathlib.Path, name: str, imps, faces: dict) -> list[str]:
    """Imports in ``path`` (module ``name``) of names another package's ``__all__`` does not list."""
    me, out = _layer(name), []
    for mod, names, line in imps:
        them = _layer(mod)
        if them in (None, "", me):
            continue
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}"
        if names is None:  # ``import megatron_cp.x.y``: only the package itself is a public face
            if mod != f"megatron_cp.{them}":
                out.append(f"{where} imports the module {mod}, not in megatron_cp.{them}.__all__")
            continue
        out += [f"{where} imports {mod}.{n}, not in megatron_cp.{them}.__all__ or __shared__" for n in names
                if n not in faces.get(them, ())]
    return out


def test_cross_package_imports_take_only_names_in_all():
    mods = _modules()
    faces = _public_faces(mods)
    assert all(faces[k] for k in ("masks", "planner", "kernels", "runtime", "sparse", "kinds")), faces
    bad = []
    for name, path in mods.items():
        _, imps = _imports(path, name)
        bad += _outside_all(path, name, imps, faces)
    assert not bad, "\n".join(bad)


def test_the_all_rule_catches_a_planted_import(tmp_path):
    """The check above would fail on a name a package does not export (here a planner helper taken by the
    runtime from the submodule that defines it), and passes the same name through a public module."""
    faces = _public_faces(_modules())
    planted = tmp_path / "planted.py"
    planted.write_text("from megatron_cp.planner.keys import KeySpans\nfrom megatron_cp.kernels import pieces\n"
                       "import megatron_cp.masks.builders\n")
    _, imps = _imports(planted, "megatron_cp.runtime.planted")
    bad = _outside_all(planted, "megatron_cp.runtime.planted", imps, faces)
    assert len(bad) == 2 and "KeySpans" in bad[0] and "megatron_cp.masks.builders" in bad[1], bad


def test_runtime_takes_only_the_planners_exports():
    import megatron_cp.planner as planner

    bad = []
    for name, path in _modules().items():
        if _layer(name) not in ("runtime", "baselines", "sparse"):
            continue
        _, imps = _imports(path, name)
        for mod, names, line in imps:
            if mod == "megatron_cp.planner":
                bad += [f"{path.relative_to(ROOT)}:{line} {n}" for n in names or ()
                        if n not in [*planner.__all__, *planner.__shared__]]
            elif mod.startswith("megatron_cp.planner.") and _layer(name) in ("runtime", "sparse"):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports planner internals from {mod}")
    assert not bad, "\n".join(bad)


def test_third_party_rules():
    bad = []
    for name, path in _modules().items():
        me = _layer(name)
        _, imps = _imports(path, name)
        for mod, _, line in imps:
            top = mod.split(".")[0]
            if top == "megatron" and me != "megatron":
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod} (only megatron_cp.megatron may)")
            if mod.startswith("torch.distributed") and me in ("masks", "planner", "kernels", "kinds"):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod} ({me} is pure)")
            if top in ("torch", "triton") and me == "planner":
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod} (the planner is numpy and scipy only)")
    assert not bad, "\n".join(bad)


def _environment_reads(tree) -> list[int]:
    """Lines where ``tree`` reads a setting from the environment: ``os.environ[...]``, ``os.environ.get``,
    ``os.getenv``, ``... in os.environ`` (handing the whole environment on, ``dict(os.environ, ...)``, reads none)."""
    def environ(n):
        return isinstance(n, ast.Attribute) and n.attr == "environ" and isinstance(n.value, ast.Name) and n.value.id == "os"

    lines = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and environ(n.value):
            lines.append(n.lineno)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and (
                (n.func.attr in ("get", "setdefault") and environ(n.func.value))
                or (n.func.attr == "getenv" and isinstance(n.func.value, ast.Name) and n.func.value.id == "os")):
            lines.append(n.lineno)
        elif isinstance(n, ast.Compare) and any(environ(c) for c in n.comparators):
            lines.append(n.lineno)
    return sorted(lines)


def test_the_library_reads_no_environment():
    """Configuration is explicit (arguments and dataclasses): no library module reads a launcher's or user's
    environment variable; tools and examples read what their launcher sets (torchrun's LOCAL_RANK: tools/common.py)
    and pass it on."""
    bad = [f"{path.relative_to(ROOT)}:{line} reads the environment" for path in _modules().values()
           for line in _environment_reads(ast.parse(path.read_text()))]
    assert not bad, "\n".join(bad)
    planted = "import os\nrank = int(os.environ.get('LOCAL_RANK', 0))\nw = os.environ['X']\nf = 'Y' in os.environ\n"
    assert _environment_reads(ast.parse(planted)) == [2, 3, 4]
    assert _environment_reads(ast.parse("import os\nenv = dict(os.environ, A='1')\n")) == []


def test_the_library_runs_without_megatron_core():
    """megatron-core is the ``[megatron]`` extra, not a dependency: with it unimportable, ``import megatron_cp``,
    planning and attention work, and ``megatron_cp.megatron`` fails with the install instruction."""
    import subprocess
    import sys
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("megatron-core") for d in meta["dependencies"])
    assert any(d.startswith("megatron-core>=0.19") for d in meta["optional-dependencies"]["megatron"])
    code = """
import sys
sys.modules["megatron"] = None  # as if megatron-core were not installed
import torch
import megatron_cp as mcp
plan = mcp.plan(mcp.masks.varlen([0, 40, 100, 256], causal=True), 1)
q, k, v = (torch.randn(256, h, 16, dtype=torch.float64) for h in (4, 2, 2))
out, lse = mcp.attention(q, k, v, plan, backend="reference")
assert out.shape == (256, 4, 16) and torch.isfinite(lse).all()
try:
    import megatron_cp.megatron
except ImportError as e:
    print("refused:", e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'refused: megatron_cp.megatron is the Megatron-Core plugin and needs megatron-core >= 0.19: pip install ' \
           '"megatron-cp[megatron]"' in r.stdout


# the packages other layers build on: each says what it shares with them apart from its user API
SHARING = ("kinds", "masks", "planner", "kernels", "comm", "runtime", "baselines", "sparse", "gating")


def _resolves(pkg, name: str) -> bool:
    import importlib

    if hasattr(pkg, name):
        return True
    try:  # a public module loaded on first use (masks.catalog, masks.draw)
        importlib.import_module(f"{pkg.__name__}.{name}")
        return True
    except ImportError:
        return False


def test_user_api_and_shared_api_are_apart():
    import importlib

    import megatron_cp

    user = {}
    for layer in SHARING:
        pkg = importlib.import_module(f"megatron_cp.{layer}")
        assert hasattr(pkg, "__shared__"), f"megatron_cp.{layer} declares no __shared__ (an empty list if none)"
        both = set(pkg.__all__) & set(pkg.__shared__)
        assert not both, f"megatron_cp.{layer}: {sorted(both)} in both __all__ and __shared__"
        missing = [n for n in [*pkg.__all__, *pkg.__shared__] if not _resolves(pkg, n)]
        assert not missing, f"megatron_cp.{layer} lists names it does not define: {missing}"
        user[layer] = set(pkg.__all__)
    # the front re-exports packages and user names, never a shared one
    for name in megatron_cp.__all__:
        obj = getattr(megatron_cp, name)
        if getattr(obj, "__name__", None) == f"megatron_cp.{name}":
            assert name in FRONT, name
            continue
        assert any(name in user[layer] for layer in FRONT), f"megatron_cp.{name} is no package's user name"
        assert not any(name in importlib.import_module(f"megatron_cp.{layer}").__shared__ for layer in SHARING), name


def test_the_quickstart_uses_the_user_api_only():
    """examples/quickstart.py, what a user copies first: ``mcp.X`` is a top-level name and ``mcp.pkg.Y`` a user name
    of that package."""
    import importlib

    import megatron_cp

    tree = ast.parse((ROOT / "examples" / "quickstart.py").read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "mcp":
            if node.attr not in megatron_cp.__all__:
                bad.append(f"mcp.{node.attr}")
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "mcp"):
            pkg = importlib.import_module(f"megatron_cp.{node.value.attr}")
            if node.attr not in pkg.__all__:
                bad.append(f"mcp.{node.value.attr}.{node.attr}")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            bad += [f"import {m}" for m in mods if m.startswith("megatron_cp.")]
    assert not bad, bad


def test_the_docs_list_each_packages_shared_api():
    """docs/layers.md's table of shared names is each package's ``__shared__``."""
    import importlib

    text = (ROOT / "docs" / "layers.md").read_text()
    rows = dict(re.findall(r"^\| megatron_cp\.(\w+) \| (.*?) \|$", text, flags=re.M))
    assert set(rows) == set(SHARING), sorted(rows)
    for layer, cell in rows.items():
        names = set(re.findall(r"`(\w+)`", cell))
        assert names == set(importlib.import_module(f"megatron_cp.{layer}").__shared__), layer
