"""A tiny Llama on megatron.core with megatron-cp attention: example code, not part of the plugin.

    model.py    ``LlamaShape``, ``transformer_config``, ``build_llama`` (GPTModel + the plugin's layer spec and RoPE)
    trainer.py  a small explicit training loop (CPU gloo or GPU NCCL) and ``spawn`` for local process groups
    forkserver.py  the CPU ranks' fork server, started with Megatron and the model imported once
    demo.py     ``./dev demo``: CP=N vs CP=1 on packed standard-library documents
    quiet.py    Megatron-Core's start-up notices silenced (imported first: every process of the examples)

Importable as ``tiny_llama`` with ``examples/`` on ``sys.path`` (``./dev demo`` sets ``PYTHONPATH=examples``;
the tests and ``examples/llama/pretrain_llama.py`` insert that folder themselves).
"""

from .quiet import quiet

quiet()  # before anything here imports megatron: its start-up notices, in this process and every spawned rank
