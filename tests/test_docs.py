"""The paperwork holds together: every relative link of the Markdown files resolves, every benchmarks/ folder is a
measurement with its README (device, date, command) indexed in benchmarks/RESULTS.md and naming only files it
holds, and benchmarks/ stays small (raw runs and logs stay out of the tree: git history keeps them)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
MAX_BENCHMARK_FILES = 60
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
NAMED = re.compile(r"`([\w.+-]+\.(?:json|png|log|txt|csv))`")


def _markdown() -> list[pathlib.Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted(BENCH.rglob("*.md")),
             *sorted((ROOT / "examples").rglob("*.md"))]
    return [f for f in files if f.exists()]


@pytest.mark.parametrize("md", _markdown(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(md):
    bad = []
    for target in LINK.findall(md.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        if path and not (md.parent / path).exists():
            bad.append(target)
    assert not bad, f"{md.relative_to(ROOT)} links to missing files: {bad}"


def _folders() -> list[pathlib.Path]:
    return sorted(p for p in BENCH.iterdir() if p.is_dir())


@pytest.mark.parametrize("folder", _folders(), ids=lambda p: p.name)
def test_each_benchmark_folder_says_what_ran_and_is_indexed(folder):
    readme = folder / "README.md"
    assert readme.exists(), f"{folder.name} has no README.md"
    text = readme.read_text()
    for word in ("Device", "Date", "ommand"):  # "Command(s)" or "command"
        assert word.lower() in text.lower(), f"{folder.name}/README.md does not say its {word.lower()}"
    assert f"]({folder.name}/README.md)" in (BENCH / "RESULTS.md").read_text(), f"{folder.name} not in RESULTS.md"
    missing = sorted({n for n in NAMED.findall(text) if not (folder / n).exists()})
    assert not missing, f"{folder.name}/README.md names files the folder does not hold: {missing}"


def test_results_index_names_existing_folders_and_benchmarks_stay_small():
    index = re.findall(r"\]\(([^)/]+)/README\.md\)", (BENCH / "RESULTS.md").read_text())
    assert sorted(set(index)) == [p.name for p in _folders()]
    files = [p for p in BENCH.rglob("*") if p.is_file()]
    assert len(files) <= MAX_BENCHMARK_FILES, f"benchmarks/ holds {len(files)} files (at most {MAX_BENCHMARK_FILES})"


def test_readme_is_a_front_door():
    """README.md stays at most 12 KiB: tables and matrices live in benchmarks/RESULTS.md, docs/ and examples/."""
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 12 * 1024, f"README.md is {size} bytes"
