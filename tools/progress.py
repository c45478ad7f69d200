"""How the long-running tools report: a tqdm bar on stderr while they run, one table on stdout at the end.

A module shared by the tools (not a tool itself). ``Progress`` is the bar: its postfix names the case
being run, the line a tool used to print per case goes to stderr only with ``--verbose``, and
``note`` writes lines every run must show (failures) above the bar. On a terminal the bar redraws as
tqdm does; where stderr is not a terminal (CI, a log file) it redraws at most every
``NON_TTY_INTERVAL_S`` seconds, so a log gets a line per half minute instead of one per case. Under
torchrun only rank 0 passes ``enabled=True``. ``markdown_table`` formats the closing table.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

NON_TTY_INTERVAL_S = 30.0


class Progress:
    """A tqdm bar of ``total`` steps on stderr (none where ``enabled`` is False: the other ranks).

    ``verbose``: ``step``'s per-case lines are written above the bar (stderr) too, where it is enabled."""

    def __init__(self, total: int | None, desc: str, enabled: bool = True, verbose: bool = False):
        tty = sys.stderr.isatty()
        self.verbose = verbose
        self.bar = tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, dynamic_ncols=True,
                        mininterval=0.1 if tty else NON_TTY_INTERVAL_S)

    def running(self, what: str):
        """Name the case now running in the postfix (before it runs: one case can take minutes)."""
        self.bar.set_postfix_str(what, refresh=False)

    def step(self, line: str | None = None, n: int = 1):
        """One case done; ``line``: its result, shown with --verbose."""
        if line is not None and self.verbose and not self.bar.disable:
            self.note(line)
        self.bar.update(n)

    def add(self, n: int):
        """``n`` more steps than the total said (cases found on the way)."""
        if self.bar.total is not None:
            self.bar.total += n

    def note(self, line: str, file=None):
        """A line every run shows (a failure, an error), written above the bar (stderr unless ``file``)."""
        tqdm.write(line, file=file or sys.stderr)

    def close(self):
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def markdown_table(header, rows) -> list[str]:
    """Lines of a markdown table: ``header`` the column names, ``rows`` sequences of cells (str() each)."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return lines
