#!/usr/bin/env bash
# Launch titan_draft training with torchrun on this machine.
#   NGPU       ranks to start (default: the GPUs present, else 1 CPU rank with gloo)
#   LOG_RANK   ranks whose output is shown (default 0; e.g. 0,1)
#   CONFIG_FILE job TOML (default train_configs/debug_model.toml)
# Everything after the script name is passed to the trainer, e.g.
#   ./run_train.sh --job.config_file train_configs/dflash2_fp8.toml --target.path /models/Qwen3-8B
set -euo pipefail
cd "$(dirname "$0")"

if [ -z "${NGPU:-}" ]; then
  NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  [ "$NGPU" -gt 0 ] || NGPU=1
fi
LOG_RANK=${LOG_RANK:-0}
CONFIG_FILE=${CONFIG_FILE:-"./train_configs/debug_model.toml"}

# A --job.config_file on the command line wins over CONFIG_FILE.
config_args=(--job.config_file "$CONFIG_FILE")
for arg in "$@"; do
  case "$arg" in --job.config_file|--job.config_file=*|--job.config-file|--job.config-file=*) config_args=() ;; esac
done

# When a rank fails, the trainer has already said why in one line ("[rank0]:titan_draft: error:
# ..."); torchrun then adds its own launcher traceback and ChildFailedError table, which only
# repeat that a rank failed. Drop that report (and torchrun's "failed (exitcode" log line) from
# stderr; any other launcher traceback is shown whole. The exit status stays torchrun's.
# mawk (Debian's awk) reads a pipe in blocks unless told otherwise, which would hold log lines back
# for minutes; -W interactive makes it read line by line
# (not `awk -W version | grep -q mawk`: grep -q quits at the first match, awk may then die of
# SIGPIPE, and pipefail turns that into "not mawk" now and then: lines held back at random)
awk_live=()
case "$(awk -W version 2>&1 || true)" in *mawk*) awk_live=(-W interactive) ;; esac
drop_launcher_report() {
  awk ${awk_live[@]+"${awk_live[@]}"} '
    /^Traceback \(most recent call last\):/ { block = 1; n = 0; rules = 0; child = 0 }
    block {
      buf[++n] = $0
      if ($0 ~ /ChildFailedError|SignalException/) child = 1
      if ($0 ~ /^=+$/ && ++rules == 2) {
        if (!child) for (i = 1; i <= n; i++) print buf[i]
        block = 0
      }
      next
    }
    /torch\/distributed\/elastic\/multiprocessing\/api\.py:[0-9]+\] failed \(exitcode/ { next }
    { print; fflush() }
    END { if (block) for (i = 1; i <= n; i++) print buf[i] }
  '
}

# A stop request (SIGTERM from kill, Kubernetes or Slurm's launcher; Ctrl-C) goes to the trainer
# ranks only: each finishes its step, saves a checkpoint and exits 0, and torchrun, seeing its
# ranks end well, exits 0 too. Delivered to torchrun itself it would tear the ranks down and exit
# non-zero after they saved. So torchrun runs in a session of its own (Ctrl-C reaches only this
# script) and this script forwards the signal to torchrun's children, the ranks; a second signal
# is forwarded as well, which the ranks take as "stop now".
# A stop that comes before torchrun has started its ranks (pkill finds no child yet) stays pending
# and is sent as soon as they exist, so a job stopped during start-up still stops.
interrupted=
pending=
launcher=
maybe_forward() {
  if [ -n "$launcher" ] && pkill -TERM -P "$launcher" 2>/dev/null; then pending=; fi
}
forward_stop() {
  interrupted=1 pending=1
  maybe_forward
}
trap forward_stop TERM INT
own_session=()
if command -v setsid >/dev/null 2>&1; then own_session=(setsid); fi

# The stderr filter is this script's child, not torchrun's (so the forwarded signal skips it), and
# ignores the signals (Ctrl-C reaches this script's whole process group).
exec 4> >(trap '' INT TERM; drop_launcher_report >&2)
filter=$!

# expandable segments avoid the late-run OOMs from allocator fragmentation
PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True} \
  ${own_session[@]+"${own_session[@]}"} torchrun --nproc_per_node="$NGPU" --rdzv_backend c10d \
    --rdzv_endpoint=localhost:0 --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m titan_draft.train "${config_args[@]}" "$@" 2>&4 &
launcher=$!
exec 4>&-  # the filter ends when torchrun's stderr closes
while :; do  # a trapped signal interrupts wait: wait again while the ranks save
  while [ -n "$pending" ] && kill -0 "$launcher" 2>/dev/null; do sleep 0.2; maybe_forward; done
  interrupted= rc=0
  wait "$launcher" || rc=$?
  [ -n "$interrupted" ] || break
done
wait "$filter" 2>/dev/null || true  # its last lines
exit "$rc"
