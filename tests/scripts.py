"""Load a repository script (tools/*.py, examples/**/run.py, a patched pretrain_gpt.py) as a module, so tests can
call its functions and its ``main`` in-process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(path, name: str | None = None):
    """The module of the Python file at ``path`` (relative paths from the repository root), executed once per
    call under ``name`` (default: the file's stem with ``_script`` appended)."""
    path = Path(path)
    if not path.is_absolute():
        path = ROOT / path
    spec = importlib.util.spec_from_file_location(name or f"{path.stem}_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
