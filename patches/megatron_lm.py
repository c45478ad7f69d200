#!/usr/bin/env python3
"""Apply, check or revert the megatron-cp patch of a Megatron-LM checkout's ``pretrain_gpt.py``.

    python patches/megatron_lm.py check  /path/to/Megatron-LM   # exit 0 if patched, 1 if not
    python patches/megatron_lm.py apply  /path/to/Megatron-LM   # idempotent
    python patches/megatron_lm.py revert /path/to/Megatron-LM

The patch is the two lines of ``pretrain_gpt.patch``, inserted right before the script's
``if __name__ == "__main__":`` line. Before writing, the tool checks that the script has exactly one
such line, defines ``forward_step`` and calls ``parse_and_validate_args`` (the two names
``megatron_cp.megatron.plugin.install_into`` rebinds), and refuses otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PATCH_LINES = [
    "import megatron_cp.megatron.plugin as _megatron_cp  # megatron-cp\n",
    "_megatron_cp.install_into(globals())  # megatron-cp\n",
    "\n",
]
ANCHOR = re.compile(r"^if __name__ == ['\"]__main__['\"]:\s*$")
MARK = "# megatron-cp"


def target(path: Path) -> Path:
    path = Path(path)
    return path / "pretrain_gpt.py" if path.is_dir() else path


def is_patched(text: str) -> bool:
    return all(line.rstrip("\n") in text.splitlines() for line in PATCH_LINES[:2])


def _check_shape(lines: list[str], name: str) -> int:
    anchors = [i for i, l in enumerate(lines) if ANCHOR.match(l.rstrip("\n"))]
    if len(anchors) != 1:
        raise SystemExit(f"{name}: expected one `if __name__ == \"__main__\":` line, found {len(anchors)}")
    text = "".join(lines)
    if not re.search(r"^def forward_step\(", text, re.M):
        raise SystemExit(f"{name}: no top-level `def forward_step(`; not a pretrain_gpt.py this patch knows")
    if "parse_and_validate_args" not in text:
        raise SystemExit(
            f"{name}: does not call parse_and_validate_args (Megatron-LM older than megatron-core 0.19?)"
        )
    return anchors[0]


def apply(text: str, name: str = "pretrain_gpt.py") -> str:
    if is_patched(text):
        return text
    lines = text.splitlines(keepends=True)
    i = _check_shape(lines, name)
    return "".join(lines[:i] + PATCH_LINES + lines[i:])


def revert(text: str) -> str:
    lines = text.splitlines(keepends=True)
    out, i = [], 0
    while i < len(lines):
        if lines[i] == PATCH_LINES[0] and lines[i + 1:i + 2] == [PATCH_LINES[1]]:
            i += 2
            if lines[i:i + 1] == ["\n"]:
                i += 1
            continue
        out.append(lines[i])
        i += 1
    return "".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("apply", "check", "revert"))
    ap.add_argument("checkout", help="Megatron-LM checkout (or the pretrain_gpt.py file itself)")
    a = ap.parse_args(argv)
    f = target(a.checkout)
    if not f.is_file():
        print(f"{f}: no such file", file=sys.stderr)
        return 2
    text = f.read_text()
    if a.action == "check":
        ok = is_patched(text)
        print(f"{f}: {'patched' if ok else 'not patched'}")
        return 0 if ok else 1
    new = apply(text, str(f)) if a.action == "apply" else revert(text)
    if new != text:
        f.write_text(new)
    print(f"{f}: {a.action} {'done' if new != text else 'nothing to do'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
