"""Runs a test class with fake CPU devices in a fresh interpreter.

XLA fixes the device count when jax initialises, so a pytest process with one
device reruns the multi-device class of a test file in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``.
"""

import os
import subprocess
import sys

NUM_DEVICES = 8
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_with_fake_devices(test_file: str, selector: str, *, num_devices: int = NUM_DEVICES,
                          timeout: int = 900) -> None:
  """Runs ``pytest test_file -k selector`` with ``num_devices`` CPU devices; fails with its report."""
  env = dict(os.environ, XLA_FLAGS=f'--xla_force_host_platform_device_count={num_devices}')
  result = subprocess.run(
      [sys.executable, '-m', 'pytest', '-q', '-x', '-p', 'no:cacheprovider', os.path.abspath(test_file),
       '-k', selector],
      env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
  report = result.stdout[-6000:] + result.stderr[-3000:]
  assert result.returncode == 0, report
  assert ' passed' in result.stdout and 'skipped' not in result.stdout, report
