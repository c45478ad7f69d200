#!/usr/bin/env python3
"""Run a Megatron-LM training script unchanged (e.g. its ``pretrain_gpt.py``, patched by
``patches/megatron_lm.py``) against an installed megatron-core wheel.

    torchrun --nproc-per-node 2 examples/llama/megatron_script.py /path/to/Megatron-LM/pretrain_gpt.py FLAGS...

The wheel ships Megatron's compiled dataset helpers but not their Makefile, and ``initialize_megatron``
runs ``make`` on rank 0 and exits the job when it fails; ``pretrain_llama.use_prebuilt_dataset_helpers``
skips that ``make`` when the compiled module imports (a source checkout is left alone). Then the script
runs as ``__main__`` with its own folder first on ``sys.path`` (``gpt_builders``, ``model_provider``).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    if len(sys.argv) < 2 or not Path(sys.argv[1]).is_file():
        raise SystemExit("usage: megatron_script.py SCRIPT.py [FLAGS...] (SCRIPT.py: a Megatron-LM training script)")
    script = Path(sys.argv[1]).resolve()
    sys.argv = [str(script)] + sys.argv[2:]
    sys.path.insert(0, str(script.parent))
    sys.path.insert(1, str(HERE))
    from pretrain_llama import use_prebuilt_dataset_helpers

    use_prebuilt_dataset_helpers()
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
