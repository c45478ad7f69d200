#!/usr/bin/env python3
"""Run a Megatron-LM training script unchanged (e.g. its ``pretrain_gpt.py``, patched by
``patches/megatron_lm.py``) against an installed megatron-core wheel.

    torchrun --nproc-per-node 2 examples/llama/megatron_script.py /path/to/Megatron-LM/pretrain_gpt.py FLAGS...
    torchrun --nproc-per-node 2 examples/llama/megatron_script.py --share-gpu pretrain_gpt.py FLAGS...   # one GPU

The wheel ships Megatron's compiled dataset helpers but not their Makefile, and ``initialize_megatron``
runs ``make`` on rank 0 and exits the job when it fails; ``pretrain_llama.use_prebuilt_dataset_helpers``
skips that ``make`` when the compiled module imports (a source checkout is left alone). Then the script
runs as ``__main__`` with its own folder first on ``sys.path`` (``gpt_builders``, ``model_provider``).

``--share-gpu`` (before the script): the ranks share the visible GPUs (rank r on GPU r % GPUs) over
``megatron_cp.comm.shared_gpu`` (gloo through host copies), a process group made here before the script runs,
which ``initialize_megatron`` then keeps (it would give rank r ``cuda:r`` and NCCL, which refuses two ranks on one
GPU). A correctness check: Megatron's ms per iteration and TFLOP/s mean nothing there.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def share_gpu() -> None:
    """This rank's GPU among the visible ones and the shared-GPU process group (module docstring)."""
    import torch
    import torch.distributed as dist

    from megatron_cp.comm import shared_gpu

    local = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's
    device = shared_gpu.rank_device(*local, share_gpu=True)
    torch.cuda.set_device(device)
    dist.init_process_group(shared_gpu.BACKEND)


def main() -> None:
    shared = len(sys.argv) > 1 and sys.argv[1] == "--share-gpu"
    if shared:
        del sys.argv[1]
    if len(sys.argv) < 2 or not Path(sys.argv[1]).is_file():
        raise SystemExit("usage: megatron_script.py SCRIPT.py [FLAGS...] (SCRIPT.py: a Megatron-LM training script)")
    script = Path(sys.argv[1]).resolve()
    sys.argv = [str(script)] + sys.argv[2:]
    sys.path.insert(0, str(script.parent))
    sys.path.insert(1, str(HERE))
    from pretrain_llama import use_prebuilt_dataset_helpers

    use_prebuilt_dataset_helpers()
    if shared:
        share_gpu()
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
