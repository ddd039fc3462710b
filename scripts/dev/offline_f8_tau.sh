#!/usr/bin/env bash
# Issue 13's float8 question on a real target: does an e4m3 feature cache (per-token scale, half
# the bytes) train SmolLM2 drafts as well as a bfloat16 one? The same SmolLM2 answers are captured
# twice (scripts/prepare_features.py --storage ...), the recipe's DFlash2 draft trains offline on
# each for the same steps and seed, and each export's true tau is measured on MT-Bench in fp32.
# On a machine lent in command slots: each run does what fits before DEADLINE (epoch seconds);
# the same command continues (stages resume).
#   DEADLINE=$(( $(date +%s) + 560 )) bash scripts/dev/offline_f8_tau.sh
# DATA: regenerated rows already there (e.g. the recipe's greedy pass, carried); without it the
# first PROMPTS rows of SOURCE (default: the packaged ShareGPT) are regenerated first.
# CACHE: a local-disk folder for the caches; OUT: logs, runs and eval reports. bfloat16 features
# are what the online bf16 target captures, so the bfloat16 cache is the online reference
# (tests/test_offline_equivalence.py).
# The two trainings run at once, as do the two evals (each is host-bound and leaves most of the
# GPU idle; tau does not depend on speed), each in its own process session so that it outlives a
# command; a command waits for them until DEADLINE.
set -u
cd "$(dirname "$0")/../.."
: "${DEADLINE:?set DEADLINE to the epoch second by which this run must have returned}"
OUT=${OUT:-outputs/f8tau}; STATE=$OUT/state; SOURCE=${SOURCE:-sharegpt}; CACHE=${CACHE:-/tmp/f8tau}
PROMPTS=${PROMPTS:-8200} STEPS=${STEPS:-1600}
TGT=outputs/targets/smollm2 DATA=${DATA:-outputs/data/smollm2_regen_${PROMPTS}}
STORAGES="bfloat16 float8_e4m3"
mkdir -p "$OUT" "$STATE" "$CACHE"
left() { echo $(( DEADLINE - $(date +%s) )); }
log() { echo "[$(date +%T) left $(left)s] $*" | tee -a "$OUT/driver.log"; }
# JOB_ARGS: overrides for prepare and training alike (a CPU dry run shrinks the job with them)
JOB=(--job.config_file train_configs/dflash2_smollm2.toml --target.path $TGT --data.source $DATA ${JOB_ARGS:-})
finished() { python3 -c "import json,sys; sys.exit(0 if json.load(open('$1'))['left'] == 0 else 1)" 2>/dev/null; }
# run NAME CMD...: CMD in its own process session, once; its exit status lands in STATE/NAME.rc
start() { name=$1; shift
  [ -f "$STATE/$name.started" ] && return 0
  date +%s > "$STATE/$name.started"; log "start $name"
  setsid bash -c "$(printf '%q ' "$@") > '$OUT/$name.log' 2>&1; echo \$? > '$STATE/$name.rc'" < /dev/null > /dev/null 2>&1 &
}
# wait_for NAME...: until each has an exit status or DEADLINE is near; 0 when all are done
wait_for() {
  for name in "$@"; do
    while [ ! -f "$STATE/$name.rc" ] && [ $(left) -gt 8 ]; do sleep 3; done
    [ -f "$STATE/$name.rc" ] || { log "$name still running: $(tail -c 300 "$OUT/$name.log" | tr '\n\r' '  ' | tail -c 160)"; return 1; }
  done
  for name in "$@"; do
    log "$name exit status $(cat "$STATE/$name.rc"), $(( $(stat -c %Y "$STATE/$name.rc") - $(cat "$STATE/$name.started") )) s"
  done
}

if [ ! -f $TGT/config.json ]; then
  log "write target"; python3 scripts/write_smollm2_target.py --out $TGT > "$OUT/target.log" 2>&1 || { tail -3 "$OUT/target.log"; exit 1; }
fi
if [ ! -f "$STATE/regen" ] && ! finished "$DATA/meta/settings-00000.json"; then
  b=$(( $(left) - 60 )); [ $b -gt 30 ] || { log "no time to regenerate"; exit 0; }
  log "regenerate the first $PROMPTS prompts (greedy)"
  python3 scripts/regenerate_data.py --target $TGT --out $DATA --source "$SOURCE" --num-prompts $PROMPTS \
    --max-new-tokens ${REGEN_TOKENS:-512} --batch-size 1024 --max-seconds $b >> "$OUT/regen.log" 2>&1
  tail -1 "$OUT/regen.log" | tee -a "$OUT/driver.log"
  finished "$DATA/meta/settings-00000.json" || exit 0
fi
touch "$STATE/regen"
for s in $STORAGES; do
  [ -f "$STATE/prepare_$s" ] && continue
  [ $(left) -gt 120 ] || { log "no time to prepare $s"; exit 0; }
  # float8 shards hold half of bfloat16's MiB: shard boundaries count feature elements, so both
  # caches cut their shards after the same rows and the seeded shard shuffle reads them in one order
  mb=$([ $s = bfloat16 ] && echo 1024 || echo 512)
  log "prepare $s cache (shards of $mb MiB)"
  rm -rf "$CACHE/$s"  # a cut run resumes by shard, but a fresh one is as quick here
  python3 scripts/prepare_features.py --out "$CACHE/$s" --storage $s --shard-mb $mb "${JOB[@]}" > "$OUT/prepare_$s.log" 2>&1 \
    && touch "$STATE/prepare_$s"; tail -2 "$OUT/prepare_$s.log" | tee -a "$OUT/driver.log"
  du -sh "$CACHE/$s" | tee -a "$OUT/driver.log"
done
# SIGTERM (a run cut short elsewhere) makes the trainer save and exit 0; the run then lacks
# checkpoint/step-STEPS and is started again, resuming from its last checkpoint
for s in $STORAGES; do
  [ -f "$STATE/train_$s.rc" ] && [ ! -d $OUT/run_$s/checkpoint/step-$STEPS ] && rm -f "$STATE/train_$s".*
  start train_$s ./run_train.sh "${JOB[@]}" --data.feature_cache "$CACHE/$s" --training.steps $STEPS \
    --job.dump_folder $OUT/run_$s --eval.enable false
done
wait_for train_bfloat16 train_float8_e4m3 || exit 0
for s in $STORAGES; do
  [ -f $OUT/run_$s/export/config.json ] || { log "run_$s has no export"; exit 1; }
  start eval_$s python3 -m titan_draft.eval --target $TGT --draft $OUT/run_$s/export --prompts mtbench \
    --num-prompts ${EVAL_PROMPTS:-80} --max-new-tokens ${EVAL_TOKENS:-256} --dtype float32 --out "$OUT/tau_$s.json"
done
wait_for eval_bfloat16 eval_float8_e4m3 || exit 0
for s in $STORAGES; do tail -4 "$OUT/eval_$s.log" | tee -a "$OUT/driver.log"; done
log "all stages done"
