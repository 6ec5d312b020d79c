#!/usr/bin/env bash
# Set up and run the test suite (README "Run the tests"): installs the package with its
# test, demo, serve and tf extras (torch==2.13.0 CPU is the ground truth in tests), then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q -e '.[test,demo,serve,tf]'
# One persistent XLA compilation cache for this run: every pytest process, xdist worker, pipeline
# and notebook kernel below loads a program another one already compiled instead of compiling it
# again. It starts empty, so each run still compiles everything once; it is removed at the end.
# Its size bound also makes JAX lock the directory, so processes never read a half-written entry.
xla_cache="$(mktemp -d -t recomp_jax_xla_cache.XXXXXX)"
trap 'rm -rf "$xla_cache"' EXIT
export JAX_COMPILATION_CACHE_DIR="$xla_cache" JAX_COMPILATION_CACHE_MAX_SIZE=$((4 << 30))
# Two workers (2 CPU cores): each test file is one unit; the tests marked end_to_end (whole
# pipelines with real models, the quickstart notebook among them) run one after another on one
# worker, never side by side, and start first (tests/conftest.py).
# --durations: the slowest tests, so that the suite's 90-minute CI budget can be watched.
python3 -m pytest -q -rs --durations=15 -n 2 --dist loadgroup --no-loadscope-reorder -m 'not alone' tests "$@"
# Then the tests marked alone, in a process of their own with nothing beside them: the allocator's
# page-fault counts, the two-process training runs (gloo gives up when one process reaches a
# collective 30 s after the other) and the abstractive notebook (a model server beside a fine-tune).
python3 -m pytest -q -rs --durations=5 -m alone tests "$@"
