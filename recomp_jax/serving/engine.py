"""The server's batching engine: concurrent requests -> one jitted batch -> streamed text.

A worker thread owns the model. Requests (:class:`Job`, one per completion choice)
wait in a bounded queue; the worker takes the first, waits ``window_s`` for others
to arrive, and runs up to ``max_batch`` of them as one batch: prompts left-padded to a
length bucket, the batch padded to a power of two (so few shapes compile), then
:class:`recomp_jax.models.gemma_decoding.RowSampler` (prefill, then ``steps`` decode
steps per call). After each call the worker detokenises every row, cuts at stop
strings, and hands text deltas to the job's ``sink``; a row is done at an end-of-sequence
token, a stop string or its ``max_tokens``, and the batch ends when all rows are done
or their clients left. Greedy rows give the same text in any batch (left padding is
masked and every row samples from its own PRNG stream).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable, Sequence

import numpy as np
from absl import logging

from recomp_jax.data.buckets import bucket_length, pad_rows


class QueueFull(RuntimeError):
  """More rows are waiting or running than the engine accepts."""


@dataclasses.dataclass(frozen=True)
class Delta:
  """New text of one choice."""
  text: str


@dataclasses.dataclass(frozen=True)
class Finished:
  """The end of one choice: ``reason`` is ``'stop'`` or ``'length'`` (OpenAI's names)."""
  reason: str
  prompt_tokens: int
  completion_tokens: int


@dataclasses.dataclass(frozen=True)
class Failed:
  """The batch holding this choice raised; ``message`` names the error (no traceback)."""
  message: str


@dataclasses.dataclass
class Job:
  """One completion choice.

  Attributes:
    prompt_ids: the prompt's token ids (special tokens included).
    max_tokens: the most tokens to generate.
    temperature, top_p: sampling settings (temperature 0 = greedy).
    seed: this choice's PRNG seed.
    stop: strings that end the text (not included in it).
    stop_ids: token ids that end it besides the model's end-of-sequence ids.
    sink: called from the worker thread with each :class:`Delta`, then one
      :class:`Finished` or :class:`Failed`.
    closed: set once the choice needs no more work (finished, or its client left).
  """
  prompt_ids: Sequence[int]
  max_tokens: int
  temperature: float
  top_p: float
  seed: int
  stop: tuple[str, ...]
  stop_ids: tuple[int, ...]
  sink: Callable[[object], None]
  closed: threading.Event = dataclasses.field(default_factory=threading.Event)


class StreamingText:
  """Token ids -> text deltas, holding back what may still become a stop string.

  Each :meth:`add` decodes the row so far (so multi-token characters come out whole)
  and returns ``(delta, stopped)``; text from the first stop string on is never emitted.
  """

  def __init__(self, tokenizer, stop: Sequence[str]):
    self.tokenizer = tokenizer
    self.stop = tuple(s for s in stop if s)
    self.ids: list[int] = []
    self.emitted = 0

  def add(self, token: int) -> tuple[str, bool]:
    self.ids.append(int(token))
    text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
    hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
    if hits:
      end, stopped = min(hits), True
    else:
      end, stopped = len(text), False
      if text.endswith('\ufffd'):  # an incomplete UTF-8 sequence: wait for its next token
        end -= 1
      for s in self.stop:  # the tail might be the start of a stop string
        for k in range(min(len(s) - 1, end), 0, -1):
          if text[end - k:end] == s[:k]:
            end -= k
            break
    delta = text[self.emitted:end] if end > self.emitted else ''
    self.emitted = max(self.emitted, end)
    return delta, stopped

  def flush(self) -> str:
    """What was held back, at the end of a row that did not stop on a stop string."""
    text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
    delta, self.emitted = text[self.emitted:], len(text)
    return delta


def _batch_size_bucket(rows: int, max_batch: int) -> int:
  size = 1
  while size < rows:
    size *= 2
  return min(size, max(max_batch, rows))


class Engine:
  """Owns the model and a worker thread; :meth:`submit` queues jobs.

  Args:
    model: a causal :class:`recomp_jax.models.gemma.GemmaModel`.
    tokenizer: its Hugging Face tokenizer.
    max_batch: rows per batch.
    max_queue: rows waiting or running before :meth:`submit` raises :class:`QueueFull`.
    window_s: how long the first request of a batch waits for company.
    steps: decode steps per jitted call (tokens reach clients in runs of this many).
    pad_id: prompt padding id.
  """

  def __init__(self, model, tokenizer, *, max_batch: int = 16, max_queue: int = 64,
               window_s: float = 0.01, steps: int = 8, pad_id: int = 0):
    self.model = model
    self.tokenizer = tokenizer
    self.max_batch = max_batch
    self.max_queue = max_queue
    self.window_s = window_s
    self.steps = steps
    self.pad_id = pad_id
    eos = [*model.config.eos_token_id, tokenizer.eos_token_id]
    self.eos_ids = frozenset(int(i) for i in eos if i is not None)
    self._pending: collections.deque[Job] = collections.deque()
    self._active = 0  # rows queued or running whose client still waits
    self._lock = threading.Condition()
    self._closed = False
    self.batches_run = 0
    self.rows_run = 0
    self._thread = threading.Thread(target=self._work, name='recomp-jax-engine', daemon=True)
    self._thread.start()

  # -- client side --------------------------------------------------------------------

  def submit(self, jobs: Sequence[Job]) -> None:
    """Queues ``jobs`` (the choices of one request) together, or raises :class:`QueueFull`."""
    with self._lock:
      if self._closed:
        raise RuntimeError('the engine is shut down')
      if self._active + len(jobs) > self.max_queue:
        raise QueueFull(f'{self._active} rows are queued or running (limit {self.max_queue})')
      self._active += len(jobs)
      self._pending.extend(jobs)
      self._lock.notify()

  def cancel(self, jobs: Sequence[Job]) -> None:
    """The client left: its rows stop counting against the queue and produce nothing more."""
    with self._lock:
      for job in jobs:
        if not job.closed.is_set():
          job.closed.set()
          self._active -= 1

  @property
  def active_rows(self) -> int:
    with self._lock:
      return self._active

  def close(self) -> None:
    with self._lock:
      self._closed = True
      self._lock.notify()
    self._thread.join(timeout=10)

  def warm_up(self, prompt_tokens: Sequence[int], max_new_tokens: int) -> dict:
    """Compiles the prefill and decode programs of every batch bucket (1, 2, 4, ... ``max_batch``)
    for the length buckets of ``prompt_tokens`` and the cache room of ``max_new_tokens``, so the
    first requests of those shapes wait for no compiler (a fresh server otherwise compiles while
    its first clients wait, and concurrent clients, arriving as a batch of one and then a batch of
    the rest, wait for two compilations). Runs the model on the calling thread: call it before
    serving. Returns the shapes (``[rows, prompt length, room]``) and the seconds it took."""
    from recomp_jax.models.gemma_decoding import RowSampler  # pylint: disable=import-outside-toplevel
    start = time.perf_counter()
    row_buckets = sorted({_batch_size_bucket(n, self.max_batch) for n in range(1, self.max_batch + 1)})
    lengths = sorted({bucket_length(max(int(n), 1)) for n in prompt_tokens})
    shapes = []
    for length in lengths:
      for rows in row_buckets:
        ids = np.full((rows, length), self.pad_id, np.int32)
        mask = np.zeros((rows, length), np.int32)
        mask[:, -1] = 1  # one real token, left-padded as requests are
        ids[:, -1] = self.tokenizer.bos_token_id or self.pad_id
        sampler = RowSampler(self.model, ids, mask, seeds=np.zeros(rows, np.uint32),
                             temperature=np.ones(rows, np.float32), top_p=np.ones(rows, np.float32),
                             max_new_tokens=max_new_tokens, steps=self.steps)
        sampler.start()
        sampler.advance()
        shapes.append([rows, length, sampler.room])
    return {'shapes': shapes, 'seconds': round(time.perf_counter() - start, 1)}

  # -- worker side --------------------------------------------------------------------

  def _release(self, job: Job) -> None:
    with self._lock:
      if not job.closed.is_set():
        job.closed.set()  # done: a later cancel() is a no-op
        self._active -= 1

  def _next_batch(self) -> list[Job]:
    with self._lock:
      while not self._pending and not self._closed:
        self._lock.wait()
      if self._closed:
        return []
    deadline = time.monotonic() + self.window_s
    with self._lock:
      while len(self._pending) < self.max_batch and not self._closed:
        left = deadline - time.monotonic()
        if left <= 0:
          break
        self._lock.wait(left)
      batch = []
      while self._pending and len(batch) < self.max_batch:
        job = self._pending.popleft()
        if not job.closed.is_set():
          batch.append(job)
      return batch

  def _work(self) -> None:
    while True:
      batch = self._next_batch()
      if not batch:
        with self._lock:
          if self._closed:
            return
        continue
      try:
        self._run(batch)
      except Exception as error:  # pylint: disable=broad-except
        logging.exception('generation batch failed')
        for job in batch:
          if not job.closed.is_set():
            job.sink(Failed(f'{type(error).__name__}: {error}'))
          self._release(job)

  def _run(self, jobs: list[Job]) -> None:
    from recomp_jax.models.gemma_decoding import RowSampler  # pylint: disable=import-outside-toplevel
    rows = _batch_size_bucket(len(jobs), self.max_batch)
    filled = jobs + [jobs[0]] * (rows - len(jobs))
    ids, mask = pad_rows([j.prompt_ids for j in filled],
                         bucket_length(max(len(j.prompt_ids) for j in jobs)), self.pad_id, left=True)
    sampler = RowSampler(
        self.model, ids, mask, seeds=np.array([j.seed for j in filled], np.uint32),
        temperature=np.array([j.temperature for j in filled], np.float32),
        top_p=np.array([j.top_p for j in filled], np.float32),
        max_new_tokens=max(j.max_tokens for j in jobs), steps=self.steps)
    texts = [StreamingText(self.tokenizer, j.stop) for j in jobs]
    counts = [0] * len(jobs)
    live = [True] * len(jobs)
    self.batches_run += 1
    self.rows_run += len(jobs)

    def finish(i: int, reason: str) -> None:
      live[i] = False
      job = jobs[i]
      if not job.closed.is_set():
        if reason != 'stop':
          tail = texts[i].flush()
          if tail:
            job.sink(Delta(tail))
        job.sink(Finished(reason, len(job.prompt_ids), counts[i]))
      self._release(job)

    def feed(tokens: np.ndarray) -> None:
      for i, job in enumerate(jobs):
        for token in tokens[i]:
          if not live[i]:
            break
          if job.closed.is_set():
            live[i] = False
            break
          counts[i] += 1
          if int(token) in self.eos_ids or int(token) in job.stop_ids:
            finish(i, 'stop')
            break
          delta, stopped = texts[i].add(int(token))
          if delta:
            job.sink(Delta(delta))
          if stopped:
            finish(i, 'stop')
          elif counts[i] >= job.max_tokens:
            finish(i, 'length')

    feed(sampler.start()[:, None])
    while any(live[i] and not job.closed.is_set() for i, job in enumerate(jobs)):
      feed(sampler.advance())


__all__ = ['Delta', 'Engine', 'Failed', 'Finished', 'Job', 'QueueFull', 'StreamingText']
