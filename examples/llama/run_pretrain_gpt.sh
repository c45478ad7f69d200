#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py with --context-parallel-impl megatron_cp: mock data, tiny Llama, a few
# iterations, on GPUs. Megatron's training entry cannot run on CPU: initialize_megatron asserts CUDA
# (megatron/training/initialize.py:66, "Megatron requires CUDA."), and at CP > 1 its argument check already
# reads the GPU's architecture (megatron/training/arguments.py:1414, get_device_arch_version).
#
#   MLM=out/megatron-lm bash examples/llama/run_pretrain_gpt.sh            # 1 GPU: CP 1 runs; 2+ GPUs: all
#   DRY_RUN=1 MLM=... bash examples/llama/run_pretrain_gpt.sh              # print the launches only
#   RUNS="cp1 cp2" MLM=... bash examples/llama/run_pretrain_gpt.sh         # only these runs (names below)
#   SHARE_GPU=1 RUNS="cp1 cp2" MLM=... bash examples/llama/run_pretrain_gpt.sh  # every rank on the visible GPU(s)
#        (megatron_script.py --share-gpu: gloo through host copies; runs one after the other; correctness only,
#        Megatron's ms per iteration and TFLOP/s are left out of summary.json)
#
# MLM:   a Megatron-LM checkout, or a .tar/.tar.gz of one (at least pretrain_gpt.py, gpt_builders.py,
#        model_provider.py); patched here with patches/megatron_lm.py (idempotent).
# WHEEL: megatron-core wheel installed (--no-deps) into $SITE (default /tmp/megatron_cp_site) when `import megatron.core` fails
#        (default: .whl/megatron_core-*.whl).
# Runs, same seed and data (tiny Llama, GQA 4:2, seq 256, global batch 4, ITERS iterations); GPUs in brackets:
#   cp1 [1]            fp32, CP 1                   cp2 [2], cp4 [4]        the same at CP 2 / 4 (equal up to fp32
#                                                                           reduction order)
#   cp2_distopt [2]    fp32, CP 2, --use-distributed-optimizer (shards over the DP x CP group)
#   cp1_distopt [1]    fp32, CP 1, --use-distributed-optimizer
#   cp1_bf16 [1]       --bf16 (fp32 main params)    cp2_bf16 [2], cp4_bf16 [4]  --bf16 --use-distributed-optimizer
#   cp1_bf16_distopt [1]  --bf16 --use-distributed-optimizer
#   cp1_packed [1]     fp32, --reset-attention-mask --reset-position-ids (-> --cp-mask packed); cp2_packed, cp4_packed
#   cp1_moe [1]        fp32, 4 experts top-2, aux loss (Megatron's MoE layers, our attention); cp2_moe, cp4_moe
#   tp2 [2]            fp32, TP 2, CP 1                        tp2cp2 [4]     the same at CP 2
#   tp2_sp [2]         fp32, TP 2, --sequence-parallel        tp2cp2_sp [4]  the same at CP 2 (Megatron's torch norm,
#                      which refuses SP, is swapped for ours where neither Apex nor Transformer Engine is installed)
#   pp2 [2]            fp32, PP 2, CP 1                        pp2cp2 [4]     the same at CP 2
#   (TP and PP runs compare with the TP / PP run at CP 1: Megatron draws TP shards' and later stages' initial
#   weights from seeds of their own, so they start from other weights than cp1)
# Runs are packed onto the machine's GPUs (CUDA_VISIBLE_DEVICES): on 4 GPUs the four CP 1 runs start together,
# then pairs of 2-GPU runs, then the 4-GPU runs one by one; a run that needs more GPUs than the machine has is skipped.
# Writes $OUT/<run>.log and $OUT/summary.json (device, date, command, losses, Megatron's throughput line per run,
# the pairs' relative loss differences).
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
  --eval-iters 0 --eval-interval 1000000 --log-interval 1 --log-throughput --context-parallel-impl megatron_cp)

slot=0 port=29500
run() {  # $1 = name, $2 = GPUs, then extra flags (CP size, TP, PP, ...)
  local name=$1 n=$2; shift 2
  if [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $name "* ]]; then return 0; fi
  port=$((port + 7))
  local cmd=($PY -m torch.distributed.run --nproc-per-node "$n" --master-port $port
    examples/llama/megatron_script.py ${SHARE_GPU:+--share-gpu} "$MLM/pretrain_gpt.py" "${FLAGS[@]}" "$@")
  if [ -n "${DRY_RUN:-}" ]; then echo "$name: ${cmd[*]}"; return 0; fi
  if [ -n "${SHARE_GPU:-}" ]; then  # every rank on the visible GPU(s), one run at a time
    if [ "$ngpu" -lt 1 ]; then echo "$name: SHARE_GPU needs a GPU, found none; skipped"; return 0; fi
    echo "== $name ($n ranks sharing $ngpu GPU(s)): ${cmd[*]}" > "$OUT/$name.log"
    timeout ${RUN_TIMEOUT:-300} "${cmd[@]}" >> "$OUT/$name.log" 2>&1
    echo "$name: exit $? ($(grep -c 'lm loss' "$OUT/$name.log") logged iterations)"
    return 0
  fi
  if [ "$ngpu" -lt "$n" ]; then echo "$name: needs $n GPUs, found $ngpu; skipped"; return 0; fi
  if [ $((slot + n)) -gt "$ngpu" ]; then wait; slot=0; fi  # this wave is full: let it finish
  local gpus; gpus=$(seq -s, $slot $((slot + n - 1)))
  slot=$((slot + n))
  echo "== $name (GPUs $gpus): ${cmd[*]}" > "$OUT/$name.log"
  ( CUDA_VISIBLE_DEVICES=$gpus timeout ${RUN_TIMEOUT:-300} "${cmd[@]}" >> "$OUT/$name.log" 2>&1
    echo "$name: exit $? ($(grep -c 'lm loss' "$OUT/$name.log") logged iterations)" ) &
}
cpn() { echo --context-parallel-size "$1"; }
MOE=(--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 128 --moe-aux-loss-coeff 1e-2)
PACKED=(--reset-attention-mask --reset-position-ids)
run cp1 1 $(cpn 1)
run cp1_packed 1 $(cpn 1) "${PACKED[@]}"
run cp1_bf16 1 $(cpn 1) --bf16
run cp1_moe 1 $(cpn 1) "${MOE[@]}"
run cp2 2 $(cpn 2)
run cp2_packed 2 $(cpn 2) "${PACKED[@]}"
run cp2_bf16 2 $(cpn 2) --bf16 --use-distributed-optimizer
run cp2_moe 2 $(cpn 2) "${MOE[@]}"
run cp2_distopt 2 $(cpn 2) --use-distributed-optimizer
run cp1_distopt 1 $(cpn 1) --use-distributed-optimizer
run cp1_bf16_distopt 1 $(cpn 1) --bf16 --use-distributed-optimizer
run tp2 2 $(cpn 1) --tensor-model-parallel-size 2
run tp2_sp 2 $(cpn 1) --tensor-model-parallel-size 2 --sequence-parallel
run pp2 2 $(cpn 1) --pipeline-model-parallel-size 2
run cp4 4 $(cpn 4)
run cp4_packed 4 $(cpn 4) "${PACKED[@]}"
run cp4_bf16 4 $(cpn 4) --bf16 --use-distributed-optimizer
run cp4_moe 4 $(cpn 4) "${MOE[@]}"
run tp2cp2 4 $(cpn 2) --tensor-model-parallel-size 2
run tp2cp2_sp 4 $(cpn 2) --tensor-model-parallel-size 2 --sequence-parallel
run pp2cp2 4 $(cpn 2) --pipeline-model-parallel-size 2
wait
[ -n "${DRY_RUN:-}" ] && exit 0

$PY - "$OUT" "${SHARE_GPU:+SHARE_GPU=1 }${RUNS:+RUNS=\"$RUNS\" }MLM=$MLM ITERS=$ITERS bash examples/llama/run_pretrain_gpt.sh" "${SHARE_GPU:-}" <<'EOF'
import datetime, json, re, sys
from pathlib import Path

import torch

out, command, shared = Path(sys.argv[1]), sys.argv[2], bool(sys.argv[3])
losses = {}
for log in sorted(out.glob("*.log")):
    vals = [float(m) for m in re.findall(r"lm loss: ([0-9.eE+-]+)", log.read_text(errors="replace"))]
    if vals:
        losses[log.stem] = vals


def rel(a, b):
    if a not in losses or b not in losses or len(losses[a]) != len(losses[b]):
        return None
    return max(abs(x - y) / abs(y) for x, y in zip(losses[a], losses[b]))


pairs = [("cp2", "cp1"), ("cp4", "cp1"), ("cp2_distopt", "cp1"), ("cp1_distopt", "cp1"),
         ("cp2_packed", "cp1_packed"), ("cp4_packed", "cp1_packed"), ("cp2_moe", "cp1_moe"), ("cp4_moe", "cp1_moe"),
         ("tp2cp2", "tp2"), ("tp2_sp", "tp2"), ("tp2cp2_sp", "tp2"), ("pp2cp2", "pp2"), ("tp2", "cp1"), ("pp2", "cp1"),
         ("cp2_bf16", "cp1_bf16"), ("cp4_bf16", "cp1_bf16"), ("cp1_bf16_distopt", "cp1_bf16"), ("cp1_bf16", "cp1")]


def throughput(text):
    """Megatron's own line of the last logged iteration: ms per iteration and TFLOP/s per GPU."""
    ms = re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)
    tf = re.findall(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)", text)
    return dict(ms_per_iteration=float(ms[-1]) if ms else None, tflops_per_gpu=float(tf[-1]) if tf else None)


# ranks sharing a GPU: Megatron's times mean nothing, so none is kept
speed = {} if shared else {log.stem: throughput(log.read_text(errors="replace")) for log in sorted(out.glob("*.log"))}
summary = dict(device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               gpus=torch.cuda.device_count(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               command=command, ranks_share_gpu=shared, losses=losses, throughput=speed,
               max_rel_diff={f"{a} vs {b}": rel(a, b) for a, b in pairs})
(out / "summary.json").write_text(json.dumps(summary, indent=1))
for k, v in summary["max_rel_diff"].items():
    print(f"{k:>24}: {'n/a' if v is None else f'{v:.2e}'}")
EOF
