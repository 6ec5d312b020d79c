#!/usr/bin/env bash
# Usage: TPU_NAME=NAME REPO_URL=GIT_URL [REPO_REF=main] [JAX_VERSION=0.10.2] launch/setup.sh
# On every worker: clone (or update) the repository at REPO_REF and install it with
# jax[tpu]. Settings and their defaults: launch/common.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "$0")/common.sh"
require TPU_NAME REPO_URL
dir=$(quote "$REPO_DIR")
remote="set -e; [ -d $dir ] || git clone $(quote "$REPO_URL") $dir"
remote+="; cd $dir && git fetch -q origin && git checkout -q $(quote "$REPO_REF")"
remote+="; python3 -m pip install -q -U pip"
remote+="; python3 -m pip install -q -e . $(quote "jax[tpu]==$JAX_VERSION")"
tpu_vm ssh "$TPU_NAME" --worker=all --command="$remote"
