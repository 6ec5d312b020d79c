"""Our OpenAI-compatible server in a child process, for as long as a ``with`` block runs.

The abstractive pipeline's offline teacher and the server tests start
``python -m recomp_jax.serve`` this way: on 127.0.0.1, a free port, its output in a log
file, stopped (SIGTERM, then SIGKILL) when the block ends::

    with LocalServer(model='', model_id='teacher') as server:
      client = openai.OpenAI(base_url=server.base_url, api_key='none')
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Sequence


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on right now."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _die_with_parent() -> None:
  """In the child, before exec: on Linux, SIGTERM when the parent dies (even by SIGKILL), so a
  killed pipeline or notebook kernel leaves no server holding gigabytes behind."""
  if sys.platform.startswith('linux'):
    import ctypes  # pylint: disable=import-outside-toplevel
    import signal  # pylint: disable=import-outside-toplevel
    pr_set_pdeathsig = 1
    ctypes.CDLL('libc.so.6', use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class ServerStartError(RuntimeError):
  """The server process exited or did not answer ``/health`` in time (names its log)."""


class LocalServer:
  """``python -m recomp_jax.serve`` on 127.0.0.1 in a child process.

  Args:
    model: ``--model`` ('' = the PyPI Gemma 3 270M).
    model_id: the name clients pass as ``model``.
    args: further command-line flags (``--max-batch=16`` ...).
    env: extra environment variables (an API key variable named by ``--api-key-env``).
    log_path: where the server's output goes (default: a temporary file).
    startup_timeout_s: how long to wait for ``/health`` (loading a GGUF the first time
      converts it: tens of seconds).
  """

  def __init__(self, model: str = '', *, model_id: str = 'local', args: Sequence[str] = (),
               env: dict | None = None, log_path: str | None = None,
               startup_timeout_s: float = 600.0):
    self.model, self.model_id, self.args = model, model_id, tuple(args)
    self.env = dict(env or {})
    self.log_path = log_path or os.path.join(tempfile.gettempdir(), f'recomp_serve_{os.getpid()}_{id(self)}.log')
    self.startup_timeout_s = startup_timeout_s
    self.port = 0
    self.process: subprocess.Popen | None = None
    self._log = None

  @property
  def url(self) -> str:
    return f'http://127.0.0.1:{self.port}'

  @property
  def base_url(self) -> str:
    """The OpenAI base URL (``.../v1``)."""
    return self.url + '/v1'

  def start(self) -> 'LocalServer':
    import httpx  # pylint: disable=import-outside-toplevel
    self.port = free_port()
    command = [sys.executable, '-m', 'recomp_jax.serve', f'--model={self.model}',
               f'--model-id={self.model_id}', f'--port={self.port}', *self.args]
    self._log = open(self.log_path, 'w')
    self.process = subprocess.Popen(command, env={**os.environ, **self.env}, stdout=self._log,
                                    stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    deadline = time.monotonic() + self.startup_timeout_s
    while time.monotonic() < deadline:
      if self.process.poll() is not None:
        self.stop()
        raise ServerStartError(f'the server exited with status {self.process.returncode}; '
                               f'its output is in {self.log_path}')
      try:
        if httpx.get(self.url + '/health', timeout=1).status_code == 200:
          return self
      except httpx.HTTPError:
        pass
      time.sleep(0.5)
    self.stop()
    raise ServerStartError(f'the server did not answer /health within {self.startup_timeout_s:.0f} s; '
                           f'its output is in {self.log_path}')

  def stop(self) -> None:
    if self.process is not None and self.process.poll() is None:
      self.process.terminate()
      try:
        self.process.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()
    if self._log is not None:
      self._log.close()
      self._log = None

  def __enter__(self) -> 'LocalServer':
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


__all__ = ['LocalServer', 'ServerStartError', 'free_port']
