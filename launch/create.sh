#!/usr/bin/env bash
# Usage: TPU_NAME=NAME [ACCELERATOR_TYPE=v4-8] [ZONE=...] [QUEUED=1] [SPOT=1] launch/create.sh
# Creates a TPU VM slice (or, with QUEUED=1, a queued resource whose node is TPU_NAME).
# Settings and their defaults: launch/common.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "$0")/common.sh"
require TPU_NAME
if [ -z "${RUNTIME_VERSION:-}" ]; then
  RUNTIME_VERSION=$(default_runtime_version "$ACCELERATOR_TYPE")
fi
spot=()
[ "$SPOT" != 1 ] || spot=(--spot)
if [ "$QUEUED" = 1 ]; then
  gcloud_cmd compute tpus queued-resources create "$TPU_NAME" --node-id="$TPU_NAME" \
    --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" \
    --zone="$ZONE" "${spot[@]}"
else
  tpu_vm create "$TPU_NAME" --accelerator-type="$ACCELERATOR_TYPE" \
    --version="$RUNTIME_VERSION" "${spot[@]}"
fi
