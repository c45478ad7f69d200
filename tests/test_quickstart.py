"""examples/quickstart.py, the README's quick start, runs as documented (torchrun, 2 CPU ranks, gloo) and
matches dense attention; a loss of undispatch output on every rank gives cp x the gradients."""

import re
import subprocess
import sys
from pathlib import Path

from _dist import free_port

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"
README = SCRIPT.parents[1] / "README.md"


def test_quickstart_two_ranks_matches_dense():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(SCRIPT)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=SCRIPT.parents[1])
    log = res.stdout + res.stderr
    assert res.returncode == 0, log

    # out, dq, dk, dv of float32 CP=2 against float64 dense attention: float32 rounding only (~1e-6)
    per = re.search(r"cp=2 S=2048 .*: out (\S+) dq (\S+) dk (\S+) dv (\S+)", res.stdout)
    assert per, log
    errs = [float(x) for x in per.groups()]
    m = re.search(r"^max difference: (\S+)$", res.stdout, re.M)
    assert m, log
    assert abs(float(m.group(1)) - max(errs)) <= 0.01 * max(errs), (m.group(0), errs)  # printed to 3 vs 2 digits
    assert 0 < max(errs) < 2e-5, errs
    # the README states a bound, not one run's figure (it moves with the machine's summation order)
    bound = re.search(r"examples/quickstart\.py  # .*the max difference \(< (\S+)\)", README.read_text())
    assert bound and max(errs) < float(bound.group(1)), (bound, errs)

    # the pitfall line: exactly cp = 2 times the right gradients
    pit = re.search(r"on every rank: gradients = (\d+) x the above \(max relative deviation (\S+)\)", res.stdout)
    assert pit, log
    assert int(pit.group(1)) == 2 and float(pit.group(2)) < 1e-6, pit.group(0)

    # the plan splits 2048 tokens evenly (printed once, by rank 0)
    assert res.stdout.count("max difference:") == 1
    assert "'tokens_per_rank': [1024, 1024]" in res.stdout, log


def test_readme_quick_start_lines_are_the_scripts():
    """Every statement of the README's quick-start code block is a line of the script (comments aside), so
    the README shows code that runs; imports and the stats print are written shorter there."""
    readme = (SCRIPT.parents[1] / "README.md").read_text()
    start = readme.index("## Quick start")
    section = re.split(r"\n##+ ", readme[start:])[0]  # up to the next heading
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)

    def code(line):
        return line.split("  #")[0].strip()

    script = {code(x) for x in SCRIPT.read_text().splitlines()}
    lines = [code(x) for x in block.splitlines() if code(x) and not code(x).startswith("#")]
    shown = [x for x in lines if not x.startswith(("import ", "print("))]
    assert len(shown) >= 12, lines
    assert [x for x in shown if x not in script] == []
    assert "torchrun --nproc-per-node 2 examples/quickstart.py" in section
