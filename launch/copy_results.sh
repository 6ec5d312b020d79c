#!/usr/bin/env bash
# Usage: TPU_NAME=NAME WORKDIR=DIR [DEST=results_from_tpu] launch/copy_results.sh
# Copies results.json, results.md and predictions.jsonl of WORKDIR from worker 0 to DEST
# (from the bucket, for a gs:// WORKDIR).
# Settings and their defaults: launch/common.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "$0")/common.sh"
require TPU_NAME WORKDIR
: "${DEST:=results_from_tpu}"
run_dir=$WORKDIR
[[ "$WORKDIR" = /* ]] || run_dir="$REPO_DIR/$WORKDIR"
[ "$DRY_RUN" = 1 ] || mkdir -p "$DEST"
for name in results.json results.md predictions.jsonl; do
  if [[ "$WORKDIR" = gs://* ]]; then
    gcloud_cmd storage cp "${WORKDIR%/}/$name" "$DEST/"
  else
    gcloud_cmd compute tpus tpu-vm scp "$TPU_NAME:$run_dir/$name" "$DEST/" --worker=0 --zone="$ZONE"
  fi
done
