#!/usr/bin/env bash
# Settings shared by the launch scripts. Every one comes from the environment; defaults:
#   TPU_NAME          (required) name of the TPU VM, or of the queued resource and its node
#   ZONE              us-central2-b
#   ACCELERATOR_TYPE  v4-8            e.g. v4-32, v5litepod-16 (v5e), v5p-8
#   RUNTIME_VERSION   from the type:  v4 tpu-ubuntu2204-base, v5e v2-alpha-tpuv5-lite,
#                                     v5p v2-alpha-tpuv5
#   PROJECT           gcloud's default project
#   QUEUED            0               1: create/delete through a queued resource
#   SPOT              0               1: spot capacity
#   REPO_URL          (setup.sh)      git URL of this repository, cloned on every worker
#   REPO_REF          main            branch, tag or commit checked out on every worker
#   REPO_DIR          recomp_jax      checkout directory in each worker's home
#   JAX_VERSION       0.10.2          installed as jax[tpu]==JAX_VERSION
#   WORKDIR           (run.sh, tensorboard.sh, copy_results.sh) run directory: on a pod
#                     gs://BUCKET/DIR (survives preemption; every worker mirrors it on local
#                     disk, process 0 uploads each finished stage, checkpoints go straight
#                     to it: recomp_jax/storage.py), or a directory on the workers, e.g.
#                     runs/nq_extractive, on a shared file system when there are several
#   LOCAL_WORKDIR     runs/mirror     (run.sh, tensorboard.sh) each worker's mirror of a
#                     gs:// WORKDIR, in REPO_DIR; TensorBoard serves worker 0's
#   TB_PORT           6006
#   DRY_RUN           0               1: print every gcloud command instead of running it

: "${ZONE:=us-central2-b}"
: "${ACCELERATOR_TYPE:=v4-8}"
: "${PROJECT:=}"
: "${QUEUED:=0}"
: "${SPOT:=0}"
: "${REPO_REF:=main}"
: "${REPO_DIR:=recomp_jax}"
: "${JAX_VERSION:=0.10.2}"
: "${TB_PORT:=6006}"
: "${LOCAL_WORKDIR:=runs/mirror}"
: "${DRY_RUN:=0}"

default_runtime_version() {
  case "$1" in
    v4-*) echo tpu-ubuntu2204-base ;;
    v5litepod-*|v5e-*) echo v2-alpha-tpuv5-lite ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    *) echo "unknown ACCELERATOR_TYPE '$1': set RUNTIME_VERSION" >&2; return 2 ;;
  esac
}

# The comment block under the shebang of the calling script, without the '# '.
usage() {
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
}

# require VAR...: stop with the usage message, before any gcloud call, if a VAR is empty.
require() {
  local name missing=()
  for name in "$@"; do
    [ -n "${!name:-}" ] || missing+=("$name")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "error: set ${missing[*]}" >&2
    usage >&2
    exit 2
  fi
}

# quote WORD: WORD as one shell word, in single quotes unless it needs none; a --flag=value
# keeps its flag outside the quotes.
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=@,%+-]*$ && -n "$1" ]]; then
    printf '%s' "$1"
  elif [[ "$1" =~ ^(--[A-Za-z0-9.-]+=)(.+)$ ]]; then
    printf '%s' "${BASH_REMATCH[1]}"
    quote "${BASH_REMATCH[2]}"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# gcloud_cmd ARGS...: run gcloud, or with DRY_RUN=1 print the command, one per line, each
# argument quoted as a shell would need it.
gcloud_cmd() {
  local command=(gcloud) arg line=
  [ -z "$PROJECT" ] || command+=(--project="$PROJECT")
  command+=("$@")
  if [ "$DRY_RUN" = 1 ]; then
    for arg in "${command[@]}"; do line+="${line:+ }$(quote "$arg")"; done
    echo "$line"
  else
    "${command[@]}"
  fi
}

# tpu_vm VERB TARGET ARGS...: gcloud compute tpus tpu-vm VERB TARGET in ZONE.
tpu_vm() {
  local verb=$1 target=$2
  shift 2
  gcloud_cmd compute tpus tpu-vm "$verb" "$target" --zone="$ZONE" "$@"
}
