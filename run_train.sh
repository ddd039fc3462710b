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

# --help is the trainer's config reference: print it here, not through torchrun (which would
# prefix every line with "[rank0]:")
for arg in "$@"; do
  case "$arg" in -h|--help) exec python3 -m titan_draft.train "${config_args[@]}" "$@" ;; esac
done

# When a rank fails, the trainer has already said why in one line ("[rank0]:titan_draft: error:
# ..."); torchrun then adds its own launcher traceback and ChildFailedError table, which only
# repeat that a rank failed. Drop that report (and torchrun's "failed (exitcode" log line) from
# stderr; any other launcher traceback is shown whole. What the table knows and the trainer could
# not say (which rank failed first, its exit status or the signal that killed it) goes to
# $failure, from which this script prints the last line and takes its exit status.
# mawk (Debian's awk) reads a pipe in blocks unless told otherwise, which would hold log lines back
# for minutes; -W interactive makes it read line by line
# (not `awk -W version | grep -q mawk`: grep -q quits at the first match, awk may then die of
# SIGPIPE, and pipefail turns that into "not mawk" now and then: lines held back at random)
awk_live=()
case "$(awk -W version 2>&1 || true)" in *mawk*) awk_live=(-W interactive) ;; esac
drop_launcher_report() {
  awk ${awk_live[@]+"${awk_live[@]}"} -v failure="$1" '
    /^Traceback \(most recent call last\):/ { block = 1; n = 0; rules = 0; child = 0; root = 0; rank = ""; code = "" }
    block {
      buf[++n] = $0
      if ($0 ~ /ChildFailedError|SignalException/) child = 1
      if ($0 ~ /^Root Cause/) root = 1
      if (root && rank == "" && $0 ~ /^ +rank +: /) { split($0, f, ":"); rank = f[2] + 0 }
      if (root && code == "" && $0 ~ /^ +exitcode +: /) { split($0, f, ":"); code = f[2] + 0 }
      if ($0 ~ /^=+$/ && ++rules == 2) {
        if (!child) for (i = 1; i <= n; i++) print buf[i]
        else if (code != "") { print rank, code > failure; close(failure) }
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
stopped=
pending=
launcher=
watch=
tell_watchdog() {  # a dead watchdog must not take this script down with SIGPIPE
  if [ -n "$watch" ] && kill -0 "$watch" 2>/dev/null; then echo "$1" >&5 2>/dev/null || true; fi
}
maybe_forward() {
  if [ -n "$launcher" ] && pkill -TERM -P "$launcher" 2>/dev/null; then pending=; tell_watchdog forwarded; fi
}
forward_stop() {
  interrupted=1 stopped=1 pending=1
  maybe_forward
}
trap forward_stop TERM INT
own_session=()
if command -v setsid >/dev/null 2>&1; then own_session=(setsid); fi

# where the stderr filter leaves what torchrun's failure report says (see drop_launcher_report)
failure=$(mktemp "${TMPDIR:-/tmp}/titan_draft_failure.XXXXXX")
trap 'rm -f "$failure"' EXIT

# In its own session torchrun would outlive this script: a closed terminal (SIGHUP) or a kill -9
# of the script would leave the ranks training on, detached, holding the dump folder's lock. So a
# watchdog holds the read end of a pipe that only this script writes to. When the script ends
# normally it says "done"; when the pipe closes without it, the script is gone, and the watchdog
# stops the ranks as a SIGTERM to the script would (they save and exit; torchrun follows), once.
watchdog() {  # stdin: torchrun's pid, then "forwarded" (the ranks have the stop already), "done"
  trap '' INT TERM HUP
  local pid line sent=
  read -r pid || return 0
  while read -r line; do
    case "$line" in done) return 0 ;; forwarded) sent=1 ;; esac
  done
  while kill -0 "$pid" 2>/dev/null; do
    if [ -z "$sent" ] && pkill -TERM -P "$pid" 2>/dev/null; then sent=1; fi
    sleep 0.2
  done
  sleep 1  # the filter's last write
  rm -f "$failure"  # the script's own cleanup did not run
}
exec 5> >(watchdog >/dev/null 2>&1)
watch=$!

# The stderr filter is this script's child, not torchrun's (so the forwarded signal skips it), and
# ignores the signals (Ctrl-C reaches this script's whole process group).
exec 4> >(exec 5>&-; trap '' INT TERM HUP; drop_launcher_report "$failure" >&2)
filter=$!

# expandable segments avoid the late-run OOMs from allocator fragmentation
PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True} \
  ${own_session[@]+"${own_session[@]}"} torchrun --nproc_per_node="$NGPU" --rdzv_backend c10d \
    --rdzv_endpoint=localhost:0 --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m titan_draft.train "${config_args[@]}" "$@" 2>&4 5>&- &
launcher=$!
tell_watchdog "$launcher"
exec 4>&-  # the filter ends when torchrun's stderr closes
while :; do  # a trapped signal interrupts wait: wait again while the ranks save
  while [ -n "$pending" ] && kill -0 "$launcher" 2>/dev/null; do sleep 0.2; maybe_forward; done
  interrupted= rc=0
  wait "$launcher" || rc=$?
  [ -n "$interrupted" ] || break
done
tell_watchdog done
wait "$filter" 2>/dev/null || true  # its last lines, and $failure

# torchrun exits 1 whenever a rank fails; the status is the first failed rank's own (2 for a
# job that is wrong), or 128 + the signal that killed it, as a shell reports it. A rank killed
# by a signal could not say why, so this script does, as the last line.
if [ "$rc" -ne 0 ] && [ -s "$failure" ]; then
  read -r rank code < "$failure"
  if [ "$code" -ge 0 ]; then
    rc=$code
  else
    sig=$((-code))
    name=SIG$(kill -l "$sig" 2>/dev/null || echo "$sig")
    if [ -n "$stopped" ] && { [ "$sig" -eq 15 ] || [ "$sig" -eq 2 ]; }; then
      # the stop came while a rank was still starting Python, before it could handle it
      echo "titan_draft: stopped by $name during start-up, before training began: nothing new was saved; run the same command again to start (or resume)" >&2
      rc=0
    else
      why=
      [ "$sig" -ne 9 ] || why=" (when nobody sent it, SIGKILL is most often the kernel's out-of-memory killer: see \`dmesg\`; lower training.local_batch_size or data.max_length)"
      echo "titan_draft: error: rank $rank was killed by $name$why; checkpoints saved before it are kept: run the same command again to resume" >&2
      rc=$((128 + sig))
    fi
  fi
fi
exit "$rc"
