#!/usr/bin/env bash
# Usage: TPU_NAME=NAME WORKDIR=DIR [TB_PORT=6006] launch/tensorboard.sh
# Serves TensorBoard for WORKDIR (every stage's summaries) on worker 0, forwarded to
# localhost:TB_PORT. For a gs:// WORKDIR it serves worker 0's mirror (LOCAL_WORKDIR).
# Settings and their defaults: launch/common.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "$0")/common.sh"
require TPU_NAME WORKDIR
logdir=$REPO_DIR/$WORKDIR
[[ "$WORKDIR" != /* ]] || logdir=$WORKDIR
# A gs:// run: worker 0's mirror, where the summaries are written as training goes.
[[ "$WORKDIR" != gs://* ]] || logdir=$REPO_DIR/$LOCAL_WORKDIR
[[ "$WORKDIR" != gs://* || "$LOCAL_WORKDIR" != /* ]] || logdir=$LOCAL_WORKDIR
tpu_vm ssh "$TPU_NAME" --worker=0 \
  --command="python3 -m tensorboard.main $(quote "--logdir=$logdir") --port=$TB_PORT" \
  -- -L "$TB_PORT:localhost:$TB_PORT"
