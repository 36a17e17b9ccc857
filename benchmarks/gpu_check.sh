#!/bin/bash
# The GPU check of one cold GPU (H100 / H200) within one budget, from the project root:
#   bash benchmarks/gpu_check.sh            # on a GPU machine (OUT=folder for logs and caches)
#   bash benchmarks/gpu_check.sh --dry-run  # tiny shapes on the CPU: checks the script
# BUDGET_S (default 540: 9 of a 10-minute device window, the rest for start-up and transfers) is
# the one budget: each part's time limit is its share of it (the shares below sum to 96 %), so
# the parts together never exceed it. A part that reaches its limit prints what it reached.
# Parts: nano8 (Nemotron 3 Nano layer shapes, 1.9B) as a GPU user trains it (mamba_ssm kernels
# where importable, compiled blocks); nano8 on the eager PyTorch path with its profile (as the
# measured baseline of 2026-11-26); decoding nano8 at batch 1 and 8 against transformers; dense2b
# (1.25B) as nano8; transformers' training step on nano8. Then one table: per run the kernel path
# that ran, warm-up (first step, compile, autotune seconds, the pre_hook kernels' apart) apart from the steady tokens/s, and
# the graph count of the compiled blocks.
# Caches persist under $OUT/cache across parts: Triton's kernels (TRITON_CACHE_DIR) and autotune
# results (TRITON_CACHE_AUTOTUNING=1: mamba_ssm's forward autotuning, 1-2 min per shape, is done
# once and read from disk by later parts), inductor's graphs (TORCHINDUCTOR_CACHE_DIR). Triton
# keeps no autotune result for a config with a pre_hook (mamba_ssm's SSD backward kernels): each
# training part tunes those again in its first step, and the table shows their seconds apart.
# PY: the python to use (default: python3). Extra PYTHONPATH entries (e.g. a mamba_ssm copy) pass through.
set -u
R=$(cd "$(dirname "$0")/.." && pwd); G=$R/benchmarks/gpu
O=${OUT:-$R/outputs/gpu_check}; mkdir -p "$O/cache"
export PYTHONPATH=$R/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TRITON_CACHE_DIR=$O/cache/triton TORCHINDUCTOR_CACHE_DIR=$O/cache/inductor
export TRITON_CACHE_AUTOTUNING=1 TRITON_PRINT_AUTOTUNING=1
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-540}
S=""; SD=""; HS=""; DS="--prompt 512 --new 128 --batches 1,8"
if [ "${1:-}" = "--dry-run" ]; then
  BUDGET_S=${DRY_RUN_BUDGET_S:-900}  # a shared 2-core CPU
  # one intra-op thread, as the test suite runs: on tiny shapes a second thread only adds
  # synchronisation (decoding 2.6x, transformers' step 2x the CPU seconds on a loaded 2-core CPU)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  C="--model.config.hidden_size=64 --model.config.vocab_size=512 --model.config.mamba_num_heads=4 --model.config.mamba_head_dim=16 --model.config.intermediate_size=64 --model.config.num_attention_heads=4 --model.config.num_key_value_heads=2 --model.config.head_dim=16 --model.config.n_groups=2 --model.config.ssm_state_size=16 --model.config.chunk_size=16 --benchmark.seq_len=64 --benchmark.warmup_steps=1 --benchmark.steps=1 --benchmark.profile_steps=1 --training.dtype=float32"
  SD="$C --model.config.hybrid_override_pattern=M-M*"
  S="$C --model.config.n_routed_experts=4 --model.config.num_experts_per_tok=2 --model.config.moe_intermediate_size=32 --model.config.moe_shared_expert_intermediate_size=64"
  HS="--small --seq 64 --steps 1"; DS="--small --prompt 16 --new 4 --batches 1,2"
fi
echo "=== budget ${BUDGET_S}s"
# part NAME PERCENT CMD...: runs CMD with PERCENT % of the budget as its limit (SIGTERM, then
# SIGKILL 10 s later), its log in $O/NAME.log, its exit status in $O/NAME.rc
part() { local name=$1 secs=$(( BUDGET_S * $2 / 100 )); shift 2
  echo "=== $name ($(date +%T), limit ${secs}s)"
  timeout -k 10 "$secs" "$@" >"$O/$name.log" 2>&1; local rc=$?
  echo "rc=$rc limit=$secs" | tee "$O/$name.rc"; }
B="$PY $G/bench_part.py"
echo "=== env"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
$PY -c "from importlib.metadata import version as v;print('torch',v('torch'),'transformers',v('transformers'))" 2>&1 | tail -1
part nano8 34 $B -c "$G/nano8.yaml" $S --checkpoint.dir="$O/nano8" --benchmark.output="$O/nano8.json"
part nano8_torch_eager 14 $B -c "$G/nano8.yaml" $S --training.mamba_kernels=false --training.compile=false \
  --benchmark.profile=true --checkpoint.dir="$O/nano8_torch_eager" --benchmark.output="$O/nano8_torch_eager.json"
part decode_nano8 18 $PY "$G/decode.py" "$G/nano8.yaml" $DS
part dense2b 18 $B -c "$G/dense2b.yaml" $SD --checkpoint.dir="$O/dense2b" --benchmark.output="$O/dense2b.json"
part hf_nano8 12 $PY "$G/hf_train.py" "$G/nano8.yaml" --steps 3 $HS
echo "=== done $(date +%T)"
$PY "$G/table.py" "$O"
