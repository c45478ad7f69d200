#!/usr/bin/env python3
"""Pretrain a Llama model with megatron-cp context parallelism on ``megatron.training.pretrain``.

    # 4 GPUs, CP=4, tiny config on the Python standard library's sources (no download):
    torchrun --nproc-per-node 4 examples/llama/pretrain_llama.py --config tiny --context-parallel-size 4

    # a real model: add --data-path / --tokenizer-model and the parallel sizes
    torchrun ... examples/llama/pretrain_llama.py --config llama3-8b --data-path DATA_PREFIX \
        --tokenizer-model meta-llama/Meta-Llama-3-8B --tensor-model-parallel-size 2 --context-parallel-size 4

    # CPU (gloo) or any machine: the same tiny model with the small training loop of
    # examples/tiny_llama, CP=4 beside CP=1 (this is what `./dev demo` runs):
    python examples/llama/pretrain_llama.py --loop --cp 4 --steps 30

``--config NAME`` prepends ``configs/NAME.args`` (Megatron flags, one per line) to the command line;
flags given later override it. Every megatron-cp flag is checked on any machine before anything needs a GPU
(``check_flags``); ``--help`` lists this example's and megatron-cp's flags, ``--help-all`` Megatron's too.
The model comes from Megatron's GPT builder with
``--spec megatron_cp.megatron.specs megatron_cp_layer_spec``; ``forward_step`` is
``megatron_cp.megatron.plugin.forward_step`` (plan per micro-batch, dispatch, RoPE, per-token loss).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # examples/: the tiny_llama package (the stdlib data, the --loop demo)
    sys.path.insert(0, str(HERE.parent))


def config_args(name: str) -> list[str]:
    path = HERE / "configs" / f"{name}.args"
    if not path.is_file():
        names = sorted(p.stem for p in (HERE / "configs").glob("*.args"))
        raise SystemExit(f"--config {name!r}: no {path}; choose from {', '.join(names)}")
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out += shlex.split(line)
    return out


def expand_argv(argv: list[str]) -> list[str]:
    """Replace ``--config NAME`` by the config's flags (placed first, so later flags win)."""
    if "--config" not in argv:
        return argv
    i = argv.index("--config")
    if i + 1 >= len(argv):
        raise SystemExit("--config needs a name")
    return config_args(argv[i + 1]) + argv[:i] + argv[i + 2:]


class StdlibDataset:
    """Samples of ``seq_length + 1`` bytes of packed stdlib documents, as Megatron's GPT data dicts."""

    def __init__(self, num_samples: int, seq_length: int, seed: int):
        import torch

        from tiny_llama.demo import stdlib_stream

        stream = torch.from_numpy(stdlib_stream(num_samples * seq_length + 1, seed))
        self.samples = [stream[i * seq_length: i * seq_length + seq_length + 1] for i in range(num_samples)]
        self.seq_length = seq_length

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        import torch

        s = self.samples[i]
        return {"tokens": s[:-1], "labels": s[1:], "loss_mask": torch.ones(self.seq_length),
                "position_ids": torch.arange(self.seq_length)}


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    from megatron.training import get_args

    args = get_args()
    if args.data_path:
        return _gpt_datasets(args, train_val_test_num_samples)
    return StdlibDataset(int(train_val_test_num_samples[0]), args.seq_length, args.seed), None, None


datasets_provider.is_distributed = True


def _gpt_datasets(args, num_samples):
    """Megatron's own GPTDataset over ``--data-path`` (indexed .bin/.idx files)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list
    from megatron.training import get_tokenizer

    cfg = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=get_blend_from_list(args.data_path),
        split=args.split, tokenizer=get_tokenizer(), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=args.eod_mask_loss, path_to_cache=args.data_cache_path,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, num_samples, lambda: True, cfg).build()


def use_prebuilt_dataset_helpers() -> bool:
    """Skip Megatron's ``make`` of the dataset helpers when the installed package cannot need it.

    ``initialize_megatron`` calls ``megatron.core.datasets.utils.compile_helpers`` on rank 0, which runs
    ``make`` in the package folder and exits the job when that fails. The megatron-core wheel ships
    the compiled ``helpers_cpp`` module but not its Makefile, so from a wheel ``make`` always fails.
    When the compiled module imports and there is no Makefile, rebind that module attribute (the one
    ``_compile_dependencies`` reads at call time) to a no-op. A source checkout (Makefile present) is
    left alone. Returns whether it rebound.
    """
    import megatron.core.datasets.utils as dsu

    if (Path(dsu.__file__).parent / "Makefile").exists():
        return False
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return False
    dsu.compile_helpers = lambda: None
    return True


USAGE = "pretrain_llama.py [--config NAME] [--loop] [megatron-cp flags] [Megatron flags]  (--help, --help-all)"


def short_help() -> str:
    """This example's flags and megatron-cp's (Megatron's own: ``--help-all``)."""
    import argparse

    from tiny_llama.quiet import quiet

    quiet()  # Megatron-Core's start-up notices (missing Transformer Engine / Apex) would bury the help
    from megatron_cp.megatron.arguments import add_megatron_cp_args

    p = argparse.ArgumentParser(prog="pretrain_llama.py", usage=USAGE, add_help=False,
                                description="Pretrain a Llama model with megatron-cp context parallelism "
                                            "(megatron.training.pretrain; CUDA GPUs).")
    g = p.add_argument_group("this example")
    g.add_argument("-h", "--help", action="store_true", help="this help: the example's and megatron-cp's flags")
    g.add_argument("--help-all", action="store_true", help="Megatron's whole help too (~4,000 lines)")
    names = ", ".join(sorted(x.stem for x in (HERE / "configs").glob("*.args")))
    g.add_argument("--config", metavar="NAME", help=f"prepend configs/NAME.args ({names}); later flags win")
    g.add_argument("--loop", action="store_true",
                   help="the tiny model in examples/tiny_llama's training loop on any machine, CP beside CP 1 (what "
                        "./dev demo runs; its flags: --loop --help)")
    return add_megatron_cp_args(p).format_help()


def check_flags(argv: list[str]) -> None:
    """Every megatron-cp flag, and Megatron's flags against megatron-cp, checked on this machine before anything
    needs a GPU: Megatron's parser with our flags (argparse's errors) and ``plugin.validate_args`` (a ValueError
    naming the flag), each an exit 2 with the message."""
    import argparse

    from tiny_llama.quiet import quiet

    quiet()  # one message per mistake, not beneath Megatron-Core's start-up notices
    from megatron.training.arguments import add_megatron_arguments

    from megatron_cp.megatron import plugin
    from megatron_cp.megatron.arguments import OURS, add_megatron_cp_args

    parser = add_megatron_cp_args(add_megatron_arguments(argparse.ArgumentParser(
        prog="pretrain_llama.py", usage=USAGE, allow_abbrev=False, add_help=False)))
    args = parser.parse_args(argv)
    if args.context_parallel_impl not in OURS:
        parser.error(f"--context-parallel-impl {args.context_parallel_impl}: pretrain_llama.py runs "
                     f"{', '.join(OURS)}; for te use Megatron's pretrain_gpt.py")
    try:
        plugin.validate_args(args)
    except ValueError as e:
        parser.error(str(e))


NO_CUDA = ("pretrain_llama.py runs megatron.training.pretrain, which needs CUDA (Megatron's initialize asserts it), "
           "and this machine has no GPU. On CPU: ./dev demo (CP vs CP 1), python examples/llama/recipes/run.py all "
           "--size tiny --cpu (CP, TP + SP, PP, --cp-sparse, head gates), ./dev test")


def main_megatron(argv: list[str]) -> None:
    import torch

    full_help = bool({"-h", "--help"} & set(argv))
    if not full_help:
        check_flags(argv)
    if not torch.cuda.is_available() and not full_help:
        raise SystemExit(NO_CUDA)  # one line instead of Megatron's "Found no NVIDIA driver" traceback
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from megatron_cp.megatron import plugin
    from megatron_cp.megatron.arguments import OURS, add_megatron_cp_args

    sys.argv = [sys.argv[0]] + argv
    args = parse_and_validate_args(extra_args_provider=add_megatron_cp_args)
    if args.context_parallel_impl not in OURS:
        raise SystemExit(f"pretrain_llama.py runs --context-parallel-impl in {', '.join(OURS)}; for te use Megatron's pretrain_gpt.py")
    plugin.validate_args(args)
    plugin.check_eod(args)  # --cp-eod-token inside the tokenizer's vocabulary, or the tokenizer's EOD
    use_prebuilt_dataset_helpers()
    cfg = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(cfg, datasets_provider, ModelType.encoder_or_decoder, plugin.forward_step)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--loop" in argv:
        argv.remove("--loop")
        from tiny_llama.demo import main as demo_main

        return demo_main(argv)
    if "--help-all" in argv:  # Megatron's whole help (its parser prints it and exits)
        argv = ["--help" if a == "--help-all" else a for a in argv]
    elif {"-h", "--help"} & set(argv):
        print(short_help())
        return 0
    main_megatron(expand_argv(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
