#!/usr/bin/env bash
# Set up and run the test suite (README "Run the tests"): installs the package with its
# test, demo, serve and tf extras (torch==2.13.0 CPU is the ground truth in tests), then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q -e '.[test,demo,serve,tf]'
# The notebooks start full pipelines (and a model server) in child processes: they run in a
# pytest process of their own, so the suite's session fixtures (real models) are not resident
# beside them on a 24 GB machine.
python3 -m pytest -q -rs tests --ignore=tests/test_notebooks.py "$@"
python3 -m pytest -q -rs tests/test_notebooks.py "$@"
