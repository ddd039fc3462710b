#!/usr/bin/env bash
# The SmolLM2 GPU recipe end to end -- target folder, the regeneration passes, the 7200-step
# train_configs/dflash2_smollm2.toml job, true-tau evals -- on a machine lent in command slots of a
# few minutes. Each run does what fits before DEADLINE (epoch seconds) and stops cleanly; the same
# command continues where the last one stopped (regeneration and training both resume).
#   DEADLINE=$(( $(date +%s) + 560 )) bash scripts/dev/smollm2_recipe_slots.sh
# SOURCE: the chat rows to regenerate (default: the packaged ShareGPT). OUT: logs and eval reports
# (default outputs/slots). STATE: markers of finished stages (default outputs/slots/state).
# TRAIN_ARGS: extra job overrides. REGEN_ONLY=1: stop after the regeneration passes (so that the
# training's wall clock is not split over one more command). BACKGROUND=1: see below. Used for
# docs/performance.md's figures.
set -u
cd "$(dirname "$0")/../.."
: "${DEADLINE:?set DEADLINE to the epoch second by which this run must have returned}"
OUT=${OUT:-outputs/slots}; STATE=${STATE:-outputs/slots/state}; SOURCE=${SOURCE:-sharegpt}
mkdir -p "$OUT" "$STATE"
TGT=outputs/targets/smollm2 DATA=outputs/data/smollm2_regen JOB=outputs/dflash2_smollm2 STEPS=${STEPS:-7200}
# PASSES: the regeneration passes, in order (t07b, a third with seed 2, gave no gain on 2026-12-02)
PASSES=${PASSES:-greedy t07}
left() { echo $(( DEADLINE - $(date +%s) )); }
log() { echo "[$(date +%T) ${1:+left $(left)s}] ${*:2}" | tee -a "$OUT/driver.log"; }

if [ ! -f $TGT/config.json ]; then
  log t "write target"; python3 scripts/write_smollm2_target.py --out $TGT > "$OUT/target.log" 2>&1 || { tail -3 "$OUT/target.log"; exit 1; }
fi

# a pass is finished when its settings say nothing is left
finished() { python3 -c "import json,os,sys; p=sys.argv[1]; sys.exit(0 if os.path.isfile(p) and json.load(open(p))['left'] == 0 else 1)" "$1"; }
# greedy, then sampled answers to each prompt (seed 1; seed 2 for t07b)
for pass in $PASSES; do
  case $pass in
    greedy) meta=$DATA/meta/settings-00000.json; extra=() ;;
    t07) meta=$DATA/meta/settings-t07-00000.json; extra=(--skip-rows 200 --temperature 0.7 --top-p 0.9 --seed 1 --tag t07) ;;
    t07b) meta=$DATA/meta/settings-t07b-00000.json; extra=(--skip-rows 200 --temperature 0.7 --top-p 0.9 --seed 2 --tag t07b) ;;
  esac
  finished $meta && continue
  budget=$(( $(left) - 60 )); [ $budget -gt 30 ] || { log t "no time for regeneration pass $pass"; exit 0; }
  log t "regeneration pass $pass (--max-seconds $budget)"
  python3 scripts/regenerate_data.py --target $TGT --out $DATA --source "$SOURCE" --max-new-tokens 512 \
    --batch-size 1024 --max-seconds $budget "${extra[@]}" >> "$OUT/regen-$pass.log" 2>&1
  tail -1 "$OUT/regen-$pass.log" | tee -a "$OUT/driver.log"
  finished $meta || exit 0
done
[ "${REGEN_ONLY:-0}" = 1 ] && { log t "regeneration done"; exit 0; }

# BACKGROUND=1: the job runs in its own process session (setsid), so that it outlives this command
# and runs uninterrupted over several back-to-back commands on a warm machine; each command waits
# for it until DEADLINE, and the wall clock from start to exit is logged
if [ "${BACKGROUND:-0}" = 1 ] && [ ! -f "$STATE/trained" ]; then
  if [ ! -f "$STATE/train_started" ]; then
    date +%s > "$STATE/train_started"; log t "train in the background (setsid)"
    setsid bash -c "./run_train.sh --job.config_file train_configs/dflash2_smollm2.toml --training.steps $STEPS ${TRAIN_ARGS:-} \
      >> '$OUT/train.log' 2>&1; echo \$? > '$STATE/train_rc'; date +%s > '$STATE/train_ended'" < /dev/null > /dev/null 2>&1 &
  fi
  while [ ! -f "$STATE/train_ended" ] && [ $(left) -gt 8 ]; do sleep 3; done
  [ -f "$STATE/train_ended" ] || { log t "training still running: $(grep -o 'step *[0-9]*/[0-9]*' "$OUT/train.log" | tail -1)"; exit 0; }
  log t "train exit status $(cat "$STATE/train_rc"), wall clock $(( $(cat "$STATE/train_ended") - $(cat "$STATE/train_started") )) s"
  if [ "$(cat "$STATE/train_rc")" = 0 ] && [ -f $JOB/checkpoint/step-$STEPS/.metadata ] && [ -f $JOB/export/config.json ]; then
    touch "$STATE/trained"
  else exit 0; fi
fi

if [ ! -f "$STATE/trained" ]; then
  t=$(( $(left) - 45 )); [ $t -gt 90 ] || { log t "no time to train"; exit 0; }
  log t "train (stopped by SIGTERM after $t s if not done)"
  # SIGTERM: the trainer finishes its step, saves a checkpoint and exits 0; the next run resumes
  timeout -s TERM -k 40 $t ./run_train.sh --job.config_file train_configs/dflash2_smollm2.toml --training.steps $STEPS ${TRAIN_ARGS:-} >> "$OUT/train.log" 2>&1
  rc=$?; log t "train exit status $rc"
  if [ $rc = 0 ] && [ -f $JOB/checkpoint/step-$STEPS/.metadata ] && [ -f $JOB/export/config.json ]; then
    touch "$STATE/trained"
  else exit 0; fi
fi

evaluate() { name=$1; need=$2; shift 2
  [ -f "$STATE/$name" ] && return 0
  [ $(left) -gt $need ] || { log t "no time for eval $name"; return 1; }
  log t "eval $name"
  python3 -m titan_draft.eval --target $TGT --draft $JOB/export "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1 \
    && touch "$STATE/$name"
  tail -4 "$OUT/$name.log" | tee -a "$OUT/driver.log"; }
# EVALS=0: leave the fp32 evals to another machine (the CPU gives the same rounds)
[ "${EVALS:-1}" = 1 ] || { log t "trained; fp32 evals left to another machine"; exit 0; }
evaluate tau_fp32_mtbench80 260 --prompts mtbench --max-new-tokens 256 --dtype float32 || exit 0
evaluate tau_fp32_holdout20 120 --prompts holdout --num-prompts 20 --max-new-tokens 256 --dtype float32 || exit 0
log "" "all stages done"
