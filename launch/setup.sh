#!/usr/bin/env bash
# Install recomp_jax with JAX for TPU on every worker of the slice.
set -euo pipefail
source "$(dirname "$0")/common.sh"
[ -n "$REPO_URL" ] || { echo "set REPO_URL to this repository's git URL" >&2; exit 2; }
gcloud_tpu ssh "$TPU_NAME" --worker=all --command="
  set -e
  [ -d $REPO_DIR ] || git clone $REPO_URL $REPO_DIR
  cd $REPO_DIR && git pull --ff-only
  python3 -m pip install -q -U pip
  python3 -m pip install -q -e . 'jax[tpu]==0.10.2'
"
