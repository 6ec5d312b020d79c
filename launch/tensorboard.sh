#!/usr/bin/env bash
# Serve TensorBoard for WORKDIR from worker 0, forwarded to localhost:6006.
set -euo pipefail
source "$(dirname "$0")/common.sh"
gcloud_tpu ssh "$TPU_NAME" --worker=0 -- -L 6006:localhost:6006 \
  "python3 -m tensorboard.main --logdir=$WORKDIR --port=6006"
