#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py with --context-parallel-impl megatron_cp: mock data, tiny Llama, a few
# iterations, on GPUs. Megatron's training entry cannot run on CPU: initialize_megatron asserts CUDA
# (megatron/training/initialize.py:66, "Megatron requires CUDA."), and at CP > 1 its argument check already
# reads the GPU's architecture (megatron/training/arguments.py:1414, get_device_arch_version).
#
#   MLM=out/megatron-lm bash examples/llama/run_pretrain_gpt.sh            # 1 GPU: CP 1 runs; 2+ GPUs: all
#   DRY_RUN=1 MLM=... bash examples/llama/run_pretrain_gpt.sh              # print the launches only
#   RUNS="cp1 cp2" MLM=... bash examples/llama/run_pretrain_gpt.sh         # only these runs (names below)
#
# MLM:   a Megatron-LM checkout, or a .tar/.tar.gz of one (at least pretrain_gpt.py, gpt_builders.py,
#        model_provider.py); patched here with patches/megatron_lm.py (idempotent).
# WHEEL: megatron-core wheel installed (--no-deps) into $SITE (default /tmp/megatron_cp_site) when `import megatron.core` fails
#        (default: .whl/megatron_core-*.whl).
# Runs, same seed and data (tiny Llama, GQA 4:2, seq 256, global batch 4, ITERS iterations):
#   cp1            fp32, CP 1                          (1 GPU)
#   cp2            fp32, CP 2                          (2 GPUs; equals cp1 up to fp32 reduction order)
#   cp2_distopt    fp32, CP 2, --use-distributed-optimizer (shards over the DP x CP group of 2)
#   cp1_distopt    fp32, CP 1, --use-distributed-optimizer (1 GPU: Megatron's DDP buffers + distributed optimizer)
#   cp1_bf16       --bf16 (fp32 main params), CP 1
#   cp2_bf16       --bf16, CP 2, --use-distributed-optimizer (close to cp1_bf16, not equal)
#   cp1_bf16_distopt --bf16, CP 1, --use-distributed-optimizer
#   cp2_packed     fp32, CP 2, --reset-attention-mask --reset-position-ids (-> --cp-mask packed)
#   cp1_packed     the same at CP 1
#   cp1_moe        fp32, CP 1, 4 experts top-2 with the load-balancing aux loss (Megatron's MoE layers, our attention)
#   cp2_moe        the same at CP 2
# Writes $OUT/<run>.log and $OUT/summary.json (device, date, command, losses, CP 2 vs CP 1 differences).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
OUT=${OUT:-out/pretrain_gpt}
ITERS=${ITERS:-8}
PY=${PYTHON:-python3}
MLM=${MLM:?set MLM to a Megatron-LM checkout or tarball}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [ -f "$MLM" ]; then  # a tarball: unpack once
  mkdir -p "$OUT/mlm" && tar -xf "$MLM" -C "$OUT/mlm" && MLM="$OUT/mlm"
fi
MLM=$(cd "$MLM" && pwd)
$PY patches/megatron_lm.py apply "$MLM" || exit 2

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
if [ -z "${DRY_RUN:-}" ] && ! $PY -c "import megatron.core" 2>/dev/null; then
  WHEEL=${WHEEL:-$(ls .whl/megatron_core-*.whl 2>/dev/null | head -n 1)}
  [ -n "$WHEEL" ] || { echo "megatron.core does not import and no WHEEL given" >&2; exit 2; }
  SITE=${SITE:-/tmp/megatron_cp_site}
  $PY -m pip install -q --no-deps --target "$SITE" "$WHEEL" || exit 2
  export PYTHONPATH="$SITE:$PYTHONPATH"
fi
ngpu=0
[ -n "${DRY_RUN:-}" ] || ngpu=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)

FLAGS=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2
  --ffn-hidden-size 176 --seq-length 256 --max-position-embeddings 256 --position-embedding-type rope
  --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0 --hidden-dropout 0 --tokenizer-type NullTokenizer --vocab-size 320
  --micro-batch-size 2 --global-batch-size 4 --train-iters "$ITERS" --lr 1e-3 --min-lr 1e-3
  --lr-decay-style constant --weight-decay 0 --clip-grad 0 --seed 1234 --init-method-std 0.02 --mock-data
  --calculate-per-token-loss --transformer-impl local --no-gradient-accumulation-fusion
  --no-masked-softmax-fusion --no-bias-swiglu-fusion --no-rope-fusion --no-persist-layer-norm
  --eval-iters 0 --eval-interval 1000000 --log-interval 1 --context-parallel-impl megatron_cp)

run() {  # $1 = name, $2 = GPUs (= CP size here: DP 1), then extra flags
  local name=$1 n=$2; shift 2
  if [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $name "* ]]; then return 0; fi
  local cmd=($PY -m torch.distributed.run --nproc-per-node "$n" --master-port $((29500 + RANDOM % 1000))
    examples/llama/megatron_script.py "$MLM/pretrain_gpt.py" "${FLAGS[@]}" --context-parallel-size "$n" "$@")
  if [ -n "${DRY_RUN:-}" ]; then echo "${cmd[*]}"; return 0; fi
  if [ "$ngpu" -lt "$n" ]; then echo "$name: needs $n GPUs, found $ngpu; skipped"; return 0; fi
  echo "== $name: ${cmd[*]}" > "$OUT/$name.log"
  timeout ${RUN_TIMEOUT:-300} "${cmd[@]}" >> "$OUT/$name.log" 2>&1
  echo "$name: exit $? ($(grep -c 'lm loss' "$OUT/$name.log") logged iterations)"
}
run cp1 1
run cp2 2
run cp2_distopt 2 --use-distributed-optimizer
run cp1_distopt 1 --use-distributed-optimizer
run cp1_bf16 1 --bf16
run cp2_bf16 2 --bf16 --use-distributed-optimizer
run cp1_bf16_distopt 1 --bf16 --use-distributed-optimizer
run cp1_packed 1 --reset-attention-mask --reset-position-ids
run cp2_packed 2 --reset-attention-mask --reset-position-ids
MOE=(--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 128 --moe-aux-loss-coeff 1e-2)
run cp1_moe 1 "${MOE[@]}"
run cp2_moe 2 "${MOE[@]}"
[ -n "${DRY_RUN:-}" ] && exit 0

$PY - "$OUT" "${RUNS:+RUNS=\"$RUNS\" }MLM=$MLM ITERS=$ITERS bash examples/llama/run_pretrain_gpt.sh" <<'EOF'
import datetime, json, re, sys
from pathlib import Path

import torch

out, command = Path(sys.argv[1]), sys.argv[2]
losses = {}
for log in sorted(out.glob("*.log")):
    vals = [float(m) for m in re.findall(r"lm loss: ([0-9.eE+-]+)", log.read_text(errors="replace"))]
    if vals:
        losses[log.stem] = vals


def rel(a, b):
    if a not in losses or b not in losses or len(losses[a]) != len(losses[b]):
        return None
    return max(abs(x - y) / abs(y) for x, y in zip(losses[a], losses[b]))


pairs = [("cp2", "cp1"), ("cp2_distopt", "cp1"), ("cp1_distopt", "cp1"), ("cp2_bf16", "cp1_bf16"),
         ("cp1_bf16_distopt", "cp1_bf16"), ("cp1_bf16", "cp1"),
         ("cp2_packed", "cp1_packed"), ("cp2_moe", "cp1_moe")]
summary = dict(device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               gpus=torch.cuda.device_count(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               command=command, losses=losses,
               max_rel_diff={f"{a} vs {b}": rel(a, b) for a, b in pairs})
(out / "summary.json").write_text(json.dumps(summary, indent=1))
for k, v in summary["max_rel_diff"].items():
    print(f"{k:>24}: {'n/a' if v is None else f'{v:.2e}'}")
EOF
