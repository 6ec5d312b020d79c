#!/usr/bin/env bash
# Delete the TPU VM slice.
set -euo pipefail
source "$(dirname "$0")/common.sh"
gcloud_tpu delete "$TPU_NAME" --quiet
