#!/usr/bin/env bash
# Create a TPU VM slice: TPU_NAME, ZONE, ACCELERATOR_TYPE, RUNTIME_VERSION (see common.sh).
set -euo pipefail
source "$(dirname "$0")/common.sh"
gcloud_tpu create "$TPU_NAME" --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" "$@"
