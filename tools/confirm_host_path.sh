#!/usr/bin/env bash
# The 4-GPU confirmation of the host path (issue 60; benchmarks/2026-11-29_1xH200_host-path measured one rank alone):
# a training step's attention with a new plan per micro-batch under every implementation at 8k / 16k / 32k tokens per
# GPU (bench_train, back to back beside GPU time) and one rank's host path (host_path) through run_dist_suite; then
# the recipes' 300M model in bf16 at CP 4 against CP 1 as DP 4 on 32k sequences, whose tokens/s per GPU it prints;
# then the same model's whole training steps at CP 4 under megatron-cp and the baselines (8k tokens per GPU).
# Run from the repository root of a 4-GPU machine (FA4 and megatron-core installed as for examples/llama/recipes):
#
#     bash tools/confirm_host_path.sh OUT
set -euo pipefail
W=${1:?usage: bash tools/confirm_host_path.sh OUT}
python tools/run_dist_suite.py --steps train,host --out "$W/suite"
python examples/llama/recipes/run.py dense --precision bf16 --steps 20 --runs cp1,cp4 --out "$W/recipes"
python examples/llama/recipes/throughput.py --cp 4 --masks packed --lengths 32768 --tokens 131072 \
    --impls megatron_cp,ring,allgather,ulysses --warmup 3 --steps 3 --profile-lengths none --out "$W/throughput"
