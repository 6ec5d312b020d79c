#!/usr/bin/env bash
# Usage: TPU_NAME=NAME WORKDIR=DIR launch/run.sh CONFIG[:preset] [--config.field=value ...]
# Runs the same `python3 -m recomp_jax.main` on every worker of the slice; JAX finds the
# other workers itself (jax.distributed) and process 0 writes results and summaries.
# A gs:// WORKDIR is mirrored in LOCAL_WORKDIR on every worker.
# Settings and their defaults: launch/common.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "$0")/common.sh"
require TPU_NAME WORKDIR
if [ "$#" -lt 1 ]; then
  echo "error: give a config file" >&2
  usage >&2
  exit 2
fi
remote="cd $(quote "$REPO_DIR") && python3 -m recomp_jax.main"
args=("--config=$1" "--workdir=$WORKDIR")
[[ "$WORKDIR" != gs://* ]] || args+=("--local_workdir=$LOCAL_WORKDIR")
for arg in "${args[@]}" "${@:2}"; do remote+=" $(quote "$arg")"; done
tpu_vm ssh "$TPU_NAME" --worker=all --command="$remote"
