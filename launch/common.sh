# Shared settings for the TPU VM scripts; override any of them in the environment.
: "${TPU_NAME:=recomp-jax}"
: "${ZONE:=us-central2-b}"
: "${ACCELERATOR_TYPE:=v4-32}"
: "${RUNTIME_VERSION:=tpu-ubuntu2204-base}"
: "${REPO_URL:=}"           # git URL of this repository, cloned on every worker
: "${REPO_DIR:=recomp_jax}"
: "${WORKDIR:=gs://YOUR_BUCKET/recomp_jax}"
gcloud_tpu() { gcloud compute tpus tpu-vm "$@" --zone="$ZONE"; }
