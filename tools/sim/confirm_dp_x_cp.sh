#!/usr/bin/env bash
# The 4-GPU confirmation of tools/sim/train_step.py's DP x CP predictions (benchmarks/2026-11-29_CPU_dp-x-cp): the
# three 2026-11-28 settings with Megatron at CP 1 (DP 4 micro-batching) under one plan over DP x CP and plain DP 4,
# and at CP 4 (the best fixed layout predicted for (b) and (c)); then each rank's share of (b)'s profiled step alone
# on one GPU (rank_shares.py); then predicted against measured. Run from the repository root of a 4-GPU machine
# (FA4 and megatron-core installed as for examples/llama/recipes):
#
#     bash tools/sim/confirm_dp_x_cp.sh OUT
set -euo pipefail
W=${1:?usage: bash tools/sim/confirm_dp_x_cp.sh OUT}
T="python examples/llama/recipes/throughput.py --masks packed --warmup 3 --steps 3 --profile-lengths none"
A="--size 12l --lengths 16384 --tokens 131072 --docs 128,8192,621"
B="--lengths 131072 --tokens 524288 --docs 1024,131072,4096,1.5"
$T $A --cp 1 --impls megatron_cp+over_dp,dp --out "$W/a1"
$T $A --cp 4 --impls megatron_cp --out "$W/a4"
$T $B --cp 1 --impls megatron_cp+over_dp,dp --out "$W/b1"
$T $B --cp 4 --impls megatron_cp --out "$W/b4"
$T $B --layer-window 4096,1000 --cp 1 --impls megatron_cp+over_dp,dp --out "$W/c1"
$T $B --layer-window 4096,1000 --cp 4 --impls megatron_cp --out "$W/c4"
CUDA_VISIBLE_DEVICES=0 python tools/sim/rank_shares.py --setting b --layout global --cp 2 --step 0 --out "$W"
python tools/sim/train_step.py --check "$W" --out "$W"
