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

# expandable segments avoid the late-run OOMs from allocator fragmentation
PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True} \
torchrun --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint=localhost:0 \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m titan_draft.train "${config_args[@]}" "$@"
