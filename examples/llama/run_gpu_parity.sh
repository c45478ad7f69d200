#!/usr/bin/env bash
# Done-when 3: tiny Llama, 50 steps, --context-parallel-impl megatron_cp, CP=4 vs CP=1 on NCCL (4 GPUs).
#   OUT=benchmarks/llama_tiny_cp4 STEPS=50 bash examples/llama/run_gpu_parity.sh
# Writes under $OUT: pretrain_cp1.log, pretrain_cp4.log (megatron.training.pretrain via torchrun),
# loop.log + loop.json (examples/tiny_llama's loop, NCCL), parity.json (device, date, command, losses,
# max relative difference) and parity.png (loss curves).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/llama_tiny_cp4}
STEPS=${STEPS:-50}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} CUDA_DEVICE_MAX_CONNECTIONS=1
ngpu=$($PY -c 'import torch; print(torch.cuda.device_count())')
if [ "$ngpu" -lt 4 ]; then echo "need 4 GPUs, found $ngpu" >&2; exit 2; fi

# megatron.training.pretrain needs CUDA; one run per CP size, same seed, data and global batch.
run_pretrain() {  # $1 = CP size
  timeout ${PRETRAIN_TIMEOUT:-240} $PY -m torch.distributed.run --nproc-per-node "$1" --master-port $((29600 + $1)) \
    examples/llama/pretrain_llama.py --config tiny --context-parallel-size "$1" --train-iters "$STEPS" \
    2>&1 | tee "$OUT/pretrain_cp$1.log" | grep -E "iteration +[0-9]+/|Error|error" | tail -n 3
}
run_pretrain 1
run_pretrain 4
run_loop() {  # $1 = kernel backend
  timeout ${LOOP_TIMEOUT:-240} $PY examples/llama/pretrain_llama.py --loop --backend nccl --cp 4 --steps "$STEPS" \
    --kernel-backend "$1" --json "$OUT/loop.json" 2>&1 | tee "$OUT/loop.log" | tail -n 3
}
run_loop auto || { echo "loop with the auto kernel backend failed; retrying with the reference backend"; run_loop reference; }
$PY examples/llama/summarize_parity.py --out "$OUT" --steps "$STEPS" --command "OUT=$OUT STEPS=$STEPS bash examples/llama/run_gpu_parity.sh"
