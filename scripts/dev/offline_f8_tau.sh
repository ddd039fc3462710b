#!/usr/bin/env bash
# Issue 13's float8 question on a real target: does an e4m3 feature cache (per-token scale, half
# the bytes) train SmolLM2 drafts as well as a bfloat16 one? The same greedy answers to the first
# ShareGPT prompts are captured twice (scripts/prepare_features.py --storage ...), the recipe's
# DFlash2 draft trains offline on each for the same steps and seed, and each export's true tau is
# measured on 40 MT-Bench prompts in fp32. On a machine lent in command slots: each run does what
# fits before DEADLINE (epoch seconds); the same command continues (stages resume).
#   DEADLINE=$(( $(date +%s) + 560 )) bash scripts/dev/offline_f8_tau.sh
# SOURCE: chat rows (default: the packaged ShareGPT); CACHE: a local-disk folder for the caches;
# OUT: logs, runs and eval reports. bfloat16 features are what the online bf16 target captures,
# so the bfloat16 cache is the online reference (tests/test_offline_equivalence.py).
set -u
cd "$(dirname "$0")/../.."
: "${DEADLINE:?set DEADLINE to the epoch second by which this run must have returned}"
OUT=${OUT:-outputs/f8tau}; STATE=$OUT/state; SOURCE=${SOURCE:-sharegpt}; CACHE=${CACHE:-/tmp/f8tau}
PROMPTS=${PROMPTS:-8200} STEPS=${STEPS:-1600}
TGT=outputs/targets/smollm2 DATA=outputs/data/smollm2_regen_${PROMPTS}
mkdir -p "$OUT" "$STATE" "$CACHE"
left() { echo $(( DEADLINE - $(date +%s) )); }
log() { echo "[$(date +%T) left $(left)s] $*" | tee -a "$OUT/driver.log"; }
# JOB_ARGS: overrides for prepare and training alike (a CPU dry run shrinks the job with them)
JOB=(--job.config_file train_configs/dflash2_smollm2.toml --target.path $TGT --data.source $DATA ${JOB_ARGS:-})

if [ ! -f $TGT/config.json ]; then
  log "write target"; python3 scripts/write_smollm2_target.py --out $TGT > "$OUT/target.log" 2>&1 || { tail -3 "$OUT/target.log"; exit 1; }
fi
if [ ! -f "$STATE/regen" ]; then
  b=$(( $(left) - 60 )); [ $b -gt 30 ] || { log "no time to regenerate"; exit 0; }
  log "regenerate the first $PROMPTS prompts (greedy)"
  python3 scripts/regenerate_data.py --target $TGT --out $DATA --source "$SOURCE" --num-prompts $PROMPTS \
    --max-new-tokens ${REGEN_TOKENS:-512} --batch-size 1024 --max-seconds $b >> "$OUT/regen.log" 2>&1
  tail -1 "$OUT/regen.log" | tee -a "$OUT/driver.log"
  python3 -c "import json,sys; sys.exit(0 if json.load(open('$DATA/meta/settings-00000.json'))['left'] == 0 else 1)" \
    && touch "$STATE/regen" || exit 0
fi
for s in bfloat16 float8_e4m3; do
  [ -f "$STATE/prepare_$s" ] && continue
  [ $(left) -gt 120 ] || { log "no time to prepare $s"; exit 0; }
  log "prepare $s cache"
  rm -rf "$CACHE/$s"  # a cut run resumes by shard, but a fresh one is as quick here
  python3 scripts/prepare_features.py --out "$CACHE/$s" --storage $s "${JOB[@]}" > "$OUT/prepare_$s.log" 2>&1 \
    && touch "$STATE/prepare_$s"; tail -2 "$OUT/prepare_$s.log" | tee -a "$OUT/driver.log"
  du -sh "$CACHE/$s" | tee -a "$OUT/driver.log"
done
for s in bfloat16 float8_e4m3; do
  run=$OUT/run_$s
  if [ ! -f "$STATE/train_$s" ]; then
    t=$(( $(left) - 45 )); [ $t -gt 90 ] || { log "no time to train $s"; exit 0; }
    log "train offline on $s (SIGTERM after $t s if not done)"
    timeout -s TERM -k 40 $t ./run_train.sh "${JOB[@]}" --data.feature_cache "$CACHE/$s" --training.steps $STEPS \
      --job.dump_folder $run --eval.enable false >> "$OUT/train_$s.log" 2>&1
    log "train $s exit status $?"
    [ -f $run/export/config.json ] && [ -d $run/checkpoint/step-$STEPS ] && touch "$STATE/train_$s" || exit 0
  fi
done
for s in bfloat16 float8_e4m3; do
  [ -f "$STATE/eval_$s" ] && continue
  [ $(left) -gt 150 ] || { log "no time to eval $s"; exit 0; }
  log "eval $s"
  python3 -m titan_draft.eval --target $TGT --draft $OUT/run_$s/export --prompts mtbench --num-prompts ${EVAL_PROMPTS:-40} \
    --max-new-tokens 256 --dtype float32 --out "$OUT/tau_$s.json" > "$OUT/eval_$s.log" 2>&1 && touch "$STATE/eval_$s"
  tail -4 "$OUT/eval_$s.log" | tee -a "$OUT/driver.log"
done
log "all stages done"
