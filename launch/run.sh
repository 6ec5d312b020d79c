#!/usr/bin/env bash
# Run one experiment on every worker (multi-host: jax.distributed initialises itself on TPU).
# Usage: launch/run.sh configs/nq_extractive.py[:preset] [--config.x=y ...]
set -euo pipefail
source "$(dirname "$0")/common.sh"
config=${1:?usage: launch/run.sh CONFIG [overrides...]}; shift
gcloud_tpu ssh "$TPU_NAME" --worker=all --command="
  cd $REPO_DIR && python3 -m recomp_jax.main --config=$config --workdir=$WORKDIR $*
"
