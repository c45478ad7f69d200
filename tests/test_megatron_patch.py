"""patches/: the pretrain_gpt.py patch applies, checks, reverts and wires the flag in.

Megatron-LM's pretrain_gpt.py is not in the megatron-core wheel, so the tests use a small stand-in
written here with the same shape (imports, forward_step, a main block calling
parse_and_validate_args(extra_args_provider=...)); the tool checks exactly that shape before editing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "patches"))
import megatron_lm as tool  # noqa: E402
from scripts import load_script  # noqa: E402

STAND_IN = '''"""Stand-in with the structure of Megatron-LM's pretrain_gpt.py (megatron-core 0.19)."""
from megatron.training.arguments import parse_and_validate_args


def get_batch(data_iterator, vp_stage=None):
    return next(data_iterator)


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    return "upstream forward_step"


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    return None, None, None


if __name__ == "__main__":
    args = parse_and_validate_args(extra_args_provider=None, args_defaults={})
'''


@pytest.fixture
def checkout(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text(STAND_IN)
    return tmp_path


def test_apply_check_revert_roundtrip(checkout):
    f = checkout / "pretrain_gpt.py"
    assert tool.main(["check", str(checkout)]) == 1
    assert tool.main(["apply", str(checkout)]) == 0
    patched = f.read_text()
    added = [l for l in patched.splitlines() if l not in STAND_IN.splitlines()]
    assert added == [l.rstrip("\n") for l in tool.PATCH_LINES[:2]], added  # two lines, nothing else
    assert patched.index("install_into") < patched.index('if __name__ == "__main__":')
    assert tool.main(["check", str(checkout)]) == 0
    assert tool.main(["apply", str(checkout)]) == 0 and f.read_text() == patched  # idempotent
    assert tool.main(["revert", str(checkout)]) == 0
    assert f.read_text() == STAND_IN


def test_refuses_a_file_of_another_shape(tmp_path):
    f = tmp_path / "pretrain_gpt.py"
    f.write_text("def forward_step(a, b):\n    pass\n")
    with pytest.raises(SystemExit, match="__main__"):
        tool.main(["apply", str(f)])
    f.write_text(STAND_IN.replace("def forward_step", "def other_step"))
    with pytest.raises(SystemExit, match="forward_step"):
        tool.main(["apply", str(f)])
    assert tool.main(["check", str(tmp_path / "missing.py")]) == 2


@pytest.mark.skipif(shutil.which("patch") is None, reason="no patch(1)")
def test_patch_file_applies_with_patch_p1(checkout):
    r = subprocess.run(["patch", "-p1", "--dry-run", "-i", str(ROOT / "patches" / "pretrain_gpt.patch")],
                       cwd=checkout, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    subprocess.run(["patch", "-p1", "-i", str(ROOT / "patches" / "pretrain_gpt.patch")], cwd=checkout, check=True,
                   capture_output=True)
    assert (checkout / "pretrain_gpt.py").read_text() == tool.apply(STAND_IN)


def test_patched_script_wires_flag_and_dispatches(checkout, monkeypatch):
    """Import the patched stand-in: its names are rebound, `te` runs upstream code, `megatron_cp`
    ours, the parser gains our flags, and uninstall_from restores everything."""
    import argparse

    from megatron_cp.megatron import plugin

    tool.main(["apply", str(checkout)])
    ns = vars(load_script(checkout / "pretrain_gpt.py", "pretrain_gpt_standin"))
    assert ns["forward_step"].__name__ == "dispatch_forward_step"
    original_parse = ns[plugin._SAVED]["parse_and_validate_args"]

    seen = {}

    def fake_parse(extra_args_provider=None, **kw):  # stands for Megatron's parse_and_validate_args
        p = argparse.ArgumentParser()
        p.add_argument("--calculate-per-token-loss", action="store_true")
        p.add_argument("--spec", nargs="*", default=None)
        p = extra_args_provider(p)
        a = p.parse_args(seen["argv"])
        a.pipeline_model_parallel_size, a.attention_backend, a.position_embedding_type = 1, "auto", "rope"
        a.sequence_parallel = False
        return a

    wrapped = plugin.wrap_parse(fake_parse)
    seen["argv"] = []
    assert wrapped(extra_args_provider=None).context_parallel_impl == "te"
    seen["argv"] = ["--context-parallel-impl", "megatron_cp", "--calculate-per-token-loss"]
    a = wrapped(extra_args_provider=None)
    assert a.spec == plugin.SPEC  # our layer spec selected when none was given
    seen["argv"] = ["--context-parallel-impl", "megatron_cp"]
    with pytest.raises(ValueError, match="calculate-per-token-loss"):
        wrapped(extra_args_provider=None)

    import megatron.training as mt

    monkeypatch.setattr(mt, "get_args", lambda: argparse.Namespace(context_parallel_impl="te"))
    assert ns["forward_step"](iter([]), None) == "upstream forward_step"
    monkeypatch.setattr(plugin, "forward_step", lambda it, model, *a, **k: "megatron-cp forward_step")
    monkeypatch.setattr(mt, "get_args", lambda: argparse.Namespace(context_parallel_impl="megatron_cp"))
    assert ns["forward_step"](iter([]), None) == "megatron-cp forward_step"

    plugin.uninstall_from(ns)
    assert ns["parse_and_validate_args"] is original_parse
    assert ns["forward_step"](iter([]), None) == "upstream forward_step"
