#!/usr/bin/env bash
# Usage: TPU_NAME=NAME [ZONE=...] [QUEUED=1] launch/delete.sh
# Deletes the TPU VM slice (with QUEUED=1, the queued resource and its node).
# Settings and their defaults: launch/common.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "$0")/common.sh"
require TPU_NAME
if [ "$QUEUED" = 1 ]; then
  gcloud_cmd compute tpus queued-resources delete "$TPU_NAME" --force --quiet --zone="$ZONE"
else
  tpu_vm delete "$TPU_NAME" --quiet
fi
