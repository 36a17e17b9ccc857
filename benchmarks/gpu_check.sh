#!/bin/bash
# The GPU check of one GPU in under 8 minutes, from the project root:
#   bash benchmarks/gpu_check.sh            # on a GPU machine (OUT=folder for the logs)
#   bash benchmarks/gpu_check.sh --dry-run  # tiny shapes on the CPU: checks the script (< 2 min)
# Runs: hybridtrain benchmark of nano8 (Nemotron 3 Nano layer shapes, 1.9B) and dense2b (1.25B),
# each with the mamba_ssm kernels (where importable) and without (HYBRIDTRAIN_MAMBA_KERNELS=0);
# transformers' training step on nano8; decoding at batch 1 and 8 against transformers; the
# profiler's top operators of the nano8 step (torch path). Then one table of the results.
# PY: the python to use (default: python3). Extra PYTHONPATH entries (e.g. a mamba_ssm copy) pass through.
set -u
R=$(cd "$(dirname "$0")/.." && pwd); G=$R/benchmarks/gpu
O=${OUT:-$R/outputs/gpu_check}; mkdir -p "$O"
export PYTHONPATH=$R/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
S=""; SD=""; HS=""; DS="--prompt 512 --new 128 --batches 1,8"; T=1
if [ "${1:-}" = "--dry-run" ]; then
  T=4  # the limits are for one GPU; a shared CPU needs more
  C="--model.config.hidden_size=64 --model.config.vocab_size=512 --model.config.mamba_num_heads=4 --model.config.mamba_head_dim=16 --model.config.intermediate_size=64 --model.config.num_attention_heads=4 --model.config.num_key_value_heads=2 --model.config.head_dim=16 --model.config.n_groups=2 --model.config.ssm_state_size=16 --model.config.chunk_size=16 --benchmark.seq_len=64 --benchmark.warmup_steps=1 --benchmark.steps=1 --benchmark.profile_steps=1 --training.dtype=float32"
  SD="$C --model.config.hybrid_override_pattern=M-M*"
  S="$C --model.config.n_routed_experts=4 --model.config.num_experts_per_tok=2 --model.config.moe_intermediate_size=32 --model.config.moe_shared_expert_intermediate_size=64"
  HS="--small --seq 64 --steps 1"; DS="--small --prompt 16 --new 4 --batches 1,2"
fi
# part NAME SECONDS CMD...: runs CMD under a time limit, its log in $O/NAME.log
part() { local name=$1 secs=$2; shift 2; echo "=== $name ($(date +%T), limit $((secs * T))s)"
  timeout $((secs * T)) "$@" >"$O/$name.log" 2>&1; echo "rc=$?" | tee "$O/$name.rc"; }
B="$PY -m hybridtrain benchmark"
echo "=== env"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
$PY -c "import torch,transformers;from hybridtrain.models.nemotron_h import kernels;print('torch',torch.__version__,'transformers',transformers.__version__,'mamba kernels',kernels.kernels_available())" 2>&1 | tail -1
part nano8_kernels 120 $B -c "$G/nano8.yaml" $S --checkpoint.dir="$O/nano8_kernels" --benchmark.output="$O/nano8_kernels.json"
HYBRIDTRAIN_MAMBA_KERNELS=0 part nano8_torch 90 $B -c "$G/nano8.yaml" $S --benchmark.profile=true --checkpoint.dir="$O/nano8_torch" --benchmark.output="$O/nano8_torch.json"
part dense2b_kernels 60 $B -c "$G/dense2b.yaml" $SD --checkpoint.dir="$O/dense2b_kernels" --benchmark.output="$O/dense2b_kernels.json"
HYBRIDTRAIN_MAMBA_KERNELS=0 part dense2b_torch 50 $B -c "$G/dense2b.yaml" $SD --checkpoint.dir="$O/dense2b_torch" --benchmark.output="$O/dense2b_torch.json"
part hf_nano8 70 $PY "$G/hf_train.py" "$G/nano8.yaml" $HS --steps 3
part decode_nano8 80 $PY "$G/decode.py" "$G/nano8.yaml" $DS
echo "=== done $(date +%T)"
$PY "$G/table.py" "$O"
