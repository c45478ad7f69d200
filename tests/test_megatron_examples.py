"""examples/llama: configs parse with Megatron's parser, SLURM dry runs; examples/tiny_llama: the stdlib data, the demo."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_helpers import EXAMPLES  # also puts examples/ on sys.path (tiny_llama)

LLAMA = EXAMPLES / "llama"
sys.path.insert(0, str(LLAMA))
import pretrain_llama  # noqa: E402


@pytest.mark.parametrize("name,layers,groups", [("tiny", 2, 2), ("llama2-7b", 32, 1), ("llama3-8b", 32, 8)])
def test_configs_parse_with_megatron_and_our_flags(name, layers, groups, monkeypatch):
    from megatron.training.arguments import parse_args

    from megatron_cp.megatron.arguments import add_megatron_cp_args

    argv = pretrain_llama.expand_argv(["--config", name, "--context-parallel-size", "4"])
    monkeypatch.setattr(sys, "argv", ["pretrain_llama.py"] + argv)
    a = parse_args(add_megatron_cp_args)
    assert a.num_layers == layers and a.num_query_groups == groups and a.context_parallel_size == 4
    assert a.swiglu and a.normalization == "RMSNorm" and a.position_embedding_type == "rope"
    assert a.context_parallel_impl == "megatron_cp" and a.calculate_per_token_loss
    assert a.untie_embeddings_and_output_weights and not a.add_bias_linear


def test_later_flags_override_the_config():
    argv = pretrain_llama.expand_argv(["--train-iters", "7", "--config", "tiny"])
    assert argv[-2:] == ["--train-iters", "7"] and "--config" not in argv
    with pytest.raises(SystemExit, match="choose from"):
        pretrain_llama.expand_argv(["--config", "gpt-5"])


@pytest.mark.parametrize("script,expect", [
    ("pretrain_llama.sbatch", ["--nnodes 2", "--config tiny", "--rdzv-backend c10d"]),
    ("llama3-8b.sbatch", ["--nnodes 4", "--config llama3-8b", "--context-parallel-size 8"]),
    ("llama2-7b.sbatch", ["--nnodes 2", "--config llama2-7b", "--tensor-model-parallel-size 2"]),
])
def test_slurm_dry_run_prints_the_launch(script, expect):
    args = ["--dry-run"] + (["--config", "tiny"] if script == "pretrain_llama.sbatch" else [])
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    r = subprocess.run(["bash", str(LLAMA / "slurm" / script), *args], capture_output=True, text=True, env=env,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("srun ") and "torch.distributed.run" in line and "pretrain_llama.py" in line
    for e in expect:
        assert e in line, (e, line)
    assert "NCCL_NVLS_ENABLE=0" in line


def test_prebuilt_dataset_helpers_skip_make_only_for_the_wheel(monkeypatch, tmp_path):
    import megatron.core.datasets.utils as dsu

    original = dsu.compile_helpers
    monkeypatch.setattr(dsu, "compile_helpers", original)  # restored after the test
    wheel_layout = not (Path(dsu.__file__).parent / "Makefile").exists()
    assert pretrain_llama.use_prebuilt_dataset_helpers() is wheel_layout
    assert (dsu.compile_helpers is not original) is wheel_layout
    if wheel_layout:
        assert dsu.compile_helpers() is None


def test_stdlib_documents_are_bytes_and_eod():
    from tiny_llama.demo import EOD, stdlib_batches, stdlib_stream

    s = stdlib_stream(5000, seed=0)
    assert s.shape == (5000,) and s.min() >= 0 and s.max() <= EOD
    n_docs = int((s == EOD).sum())
    assert 10 <= n_docs <= 160  # documents of 32..480 bytes
    assert np.array_equal(s, stdlib_stream(5000, seed=0))  # deterministic
    tokens, labels, lm = stdlib_batches(2, 2, 64)(1)
    assert tokens.shape == (2, 64) and (labels[:, :-1] == tokens[:, 1:]).all()


def test_cpu_demo_cp2_matches_cp1_and_prints_its_result_last(tmp_path):
    """The README's main job as a user runs it, at a smaller size: CP=2 vs CP=1 on packed stdlib documents, 3 steps,
    equal within 1e-5 and learning; the result table ends the output, and Megatron's start-up warnings (Transformer
    Engine / Apex missing, one per module and rank) are said once, not two dozen times."""
    import json
    import os

    env = dict(os.environ, PYTHONPATH=str(EXAMPLES) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out_json = tmp_path / "demo.json"
    r = subprocess.run([sys.executable, "-m", "tiny_llama.demo", "--cp", "2", "--steps", "3", "--seq-length", "64",
                        "--json", str(out_json)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out_json.read_text())
    assert len(res["loss_cp1"]) == 3 and res["max_rel_diff"] <= 1e-5
    assert res["loss_cp1"][-1] < res["loss_cp1"][0]  # it trains
    out = r.stdout.strip().splitlines()
    assert out[-1].startswith("max relative difference CP=2 vs CP=1 over 3 steps"), out[-3:]
    assert not re.search(r"Warning|IS DEPRECATED|No CUDA runtime", r.stdout + r.stderr), r.stderr
    assert sum("Transformer Engine" in line for line in out) <= 1


@pytest.mark.parametrize("argv,needle", [
    (["--cp", "300", "--seq-length", "100"], "cp=300 exceeds the sequence length 100"),
    (["--cp", "100", "--seq-length", "256"], "tp \\* cp = 100 processes on CPU"),
    (["--cp", "0"], "--cp, --tp and --steps must be >= 1, got --cp 0 --tp 1"),
    (["--backend", "nccl"], "--backend nccl runs ranks on GPUs and none is visible here: --backend gloo"),
    (["--backend", "gloo_shared_gpu"], "--backend gloo_shared_gpu runs ranks on GPUs and none is visible"),
])
def test_cpu_demo_refuses_absurd_sizes_before_spawning(argv, needle, capsys, monkeypatch):
    """``./dev demo --cp 300 --seq-length 100`` once spawned 300 processes and hung: one line (no usage, no note),
    exit 2, no process."""
    from tiny_llama import demo, trainer

    monkeypatch.setattr(trainer, "spawn", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and ": error: " in err, (out, err)
    assert re.search(needle, err)


PRETRAIN_GPT_STAND_IN = '''from megatron.training.arguments import parse_and_validate_args


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    return None


if __name__ == "__main__":
    args = parse_and_validate_args(extra_args_provider=None, args_defaults={})
'''


def test_run_pretrain_gpt_dry_run_patches_and_launches_flags_that_validate(tmp_path):
    """examples/llama/run_pretrain_gpt.sh (GPU only: Megatron's training entry asserts CUDA) patches the
    checkout and launches Megatron's pretrain_gpt.py with flags our parse-time checks accept."""
    import argparse
    import shlex

    from megatron.training.arguments import add_megatron_arguments

    from megatron_cp.megatron import plugin
    from megatron_cp.megatron.arguments import add_megatron_cp_args

    mlm = tmp_path / "Megatron-LM"
    mlm.mkdir()
    (mlm / "pretrain_gpt.py").write_text(PRETRAIN_GPT_STAND_IN)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "DRY_RUN": "1", "MLM": str(mlm), "OUT": str(tmp_path / "out"),
           "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(LLAMA / "run_pretrain_gpt.sh")], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "install_into(globals())" in (mlm / "pretrain_gpt.py").read_text()  # patched
    launches = [shlex.split(line) for line in r.stdout.splitlines() if "torch.distributed.run" in line]
    names = [cmd[0].rstrip(":") for cmd in launches]
    assert names[:4] == ["cp1", "cp1_packed", "cp1_bf16", "cp1_moe"]  # the CP 1 runs first: one GPU each, together
    assert {"cp4", "cp4_packed", "cp4_bf16", "cp4_moe", "tp2cp2", "tp2cp2_sp", "pp2cp2", "tp2", "tp2_sp", "pp2"} <= set(names)
    parser = add_megatron_cp_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    for cmd in launches:
        i = cmd.index(str(mlm / "pretrain_gpt.py"))
        assert cmd[i - 1].endswith("examples/llama/megatron_script.py")
        args = parser.parse_args(cmd[i + 1:])
        plugin.validate_args(args)
        nproc = int(cmd[cmd.index("--nproc-per-node") + 1])
        assert args.context_parallel_impl == "megatron_cp"
        # data parallel 1: every GPU of the run is a CP, TP or PP rank (the runs compare with CP 1 at equal batch)
        assert args.context_parallel_size * args.tensor_model_parallel_size * args.pipeline_model_parallel_size == nproc
        assert args.cp_mask == ("packed" if args.reset_attention_mask else "causal")
    assert sum("--num-experts" in cmd for cmd in launches) == 3


def test_megatron_script_refuses_a_missing_script():
    r = subprocess.run([sys.executable, str(LLAMA / "megatron_script.py"), "/nonexistent/pretrain_gpt.py"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "usage: megatron_script.py" in r.stderr


@pytest.mark.parametrize("argv,needle", [
    (["--context-parallel-impl", "magic"], r"argument --context-parallel-impl: invalid choice: 'magic'"),
    (["--config", "tiny", "--context-parallel-impl", "te"], r"--context-parallel-impl te: pretrain_llama.py runs megatron_cp"),
    (["--config", "tiny", "--cp-mask", "packed_sliding_window"],
     r"--cp-mask packed_sliding_window needs --cp-window W >= 0 .*got no --cp-window"),
    (["--config", "tiny", "--cp-mask", "sliding_window", "--cp-window", "-5"], r"--cp-window must be >= 0"),
    (["--config", "tiny", "--cp-eod-token", "999"], r"--cp-eod-token 999 is outside the vocabulary \(--vocab-size 320\)"),
    (["--config", "tiny", "--cp-kernel-backend", "fa4"], r"--cp-kernel-backend fa4: FA4 runs on CUDA GPUs and none is visible"),
    (["--config", "tiny", "--cp-solver", "zigzagg"], r"--cp-solver 'zigzagg' is unknown"),
])
def test_pretrain_llama_checks_every_flag_before_needing_a_gpu(argv, needle, capsys, monkeypatch):
    """On a machine without a GPU each megatron-cp mistake gets its own message (exit 2) instead of the CUDA one."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        pretrain_llama.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "needs CUDA" not in err, (e.value.code, err)
    assert re.search(needle, err.splitlines()[-1]), err


def test_pretrain_llama_help_lists_the_example_and_megatron_cp_flags(capsys):
    """--help: this example's flags (--config, --loop) and megatron-cp's, not Megatron's ~4,000 lines."""
    assert pretrain_llama.main(["--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--config NAME", "--loop", "--help-all", "--context-parallel-impl", "--cp-mask", "--cp-eod-token",
                 "--cp-moba-top-k", "--cp-head-pattern"):
        assert flag in text, flag
    assert "--num-layers" not in text and len(text.splitlines()) < 200, len(text.splitlines())


def test_pretrain_llama_on_a_cpu_machine_says_what_to_run_instead():
    """A plain launch without a GPU: one line naming the CPU paths, not Megatron's "Found no NVIDIA driver"."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the launch would train")
    with pytest.raises(SystemExit) as e:
        pretrain_llama.main(["--config", "tiny"])
    assert e.value.code == pretrain_llama.NO_CUDA and "./dev demo" in str(e.value.code)
