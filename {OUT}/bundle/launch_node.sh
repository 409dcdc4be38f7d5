#!/usr/bin/env bash
# Run on every node of the job, each with its own NODE_RANK (see README.md):
#   bash launch_node.sh NODE_RANK [runner options, e.g. --steps 100 --checkpoint-dir DIR --resume]
# HAP_RDZV_ENDPOINT=HOST:PORT overrides the rendezvous (node 0's machine by default).
set -euo pipefail
BUNDLE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NODE_RANK="${1:?usage: launch_node.sh NODE_RANK [runner options] (NODE_RANK 0..0)}"
shift
DEFAULT_RDZV_ENDPOINT=localhost:29500
RDZV_ENDPOINT="${HAP_RDZV_ENDPOINT:-$DEFAULT_RDZV_ENDPOINT}"
export HAP_NODE_RANK="$NODE_RANK"  # the runner maps (node, local rank) to the plan's rank
case "$NODE_RANK" in
  0)  # machine localhost: ranks 0-3
    exec torchrun --nnodes=1 --node-rank=0 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id=hap-mlp-cpu-4-uneven -m runner.launch "$BUNDLE_DIR" "$@" ;;
  *) echo "launch_node.sh: NODE_RANK must be 0..0, got $NODE_RANK" >&2; exit 2 ;;
esac
