#!/usr/bin/env bash
# The CLI runs a refactor must leave unchanged (fp32, CPU): the demo recipe in one process for 20
# steps, under PP=2 x EP=2, HSDP 2x2 and interleaved PP=2, and the chat LoRA recipe on the demo's
# export. Compare two trees' outputs with scripts/compare_runs.py.
#
#   scripts/cli_parity_runs.sh SRC_TREE OUT_DIR     # e.g. a `git worktree` of the old commit
set -uo pipefail
SRC=$(cd "$1" && pwd); OUT=$(mkdir -p "$2" && cd "$2" && pwd)
PY=${PY:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
export PYTHONPATH=$SRC/src OMP_NUM_THREADS=1
DEMO=("$PY" -m hybridtrain finetune -c "$SRC/examples/squad_tiny.yaml" --training.max_steps=20
      --training.dtype=float32 --training.micro_batch_size=2 --metrics.progress_bar=false
      --metrics.plot=false)
run() {  # run NAME CMD...: from OUT (the demo writes outputs/ relative to the working folder)
  local name=$1; shift
  (cd "$OUT" && "$@" --checkpoint.dir="$OUT/$name" > "$OUT/$name.log" 2>&1); echo "$name rc=$?"
}
run demo "${DEMO[@]}"
run pp2ep2 "${DEMO[@]}" --nproc-per-node 4 --distributed.pp=2 --distributed.ep=2
run hsdp "${DEMO[@]}" --nproc-per-node 4 --distributed.dp_replicate=2 --distributed.dp_shard=2
run ipp2 "${DEMO[@]}" --nproc-per-node 2 --distributed.pp=2 --distributed.pp_schedule=interleaved1f1b
# the LoRA recipe's data paths are relative to the tree; its base is the demo run's export
(cd "$SRC" && HYBRIDTRAIN_TINY_BASE="$OUT/demo/step_20/hf" "$PY" -m hybridtrain finetune \
  -c examples/chat_lora_tiny.yaml --training.max_steps=20 --metrics.progress_bar=false \
  --metrics.plot=false --checkpoint.dir="$OUT/lora" > "$OUT/lora.log" 2>&1); echo "lora rc=$?"
