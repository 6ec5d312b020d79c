"""The teacher LLM of RECOMP's abstractive compressor, over any OpenAI-compatible endpoint.

RECOMP (§3.2, Table 14) prompts gpt-3.5-turbo for query-focused summaries of the top-5
documents; offline the endpoint is our own server (``python -m recomp_jax.serve``).
This module sends those prompts and keeps what comes back:

* :data:`TEACHER_PROMPTS` -- Table 14's prompt per task (``{query}``, ``{docs}``), and
  :data:`LM_TEACHER_PROMPTS`, its four language-modelling prompts;
* :class:`ResponseCache` -- sqlite, keyed by model, template, rendered prompt and
  sampling settings: a killed run loses nothing and a rerun pays for nothing;
* :class:`Teacher` -- bounded concurrency, retries with exponential backoff and jitter
  on 429 / 5xx / timeouts / dropped connections (honouring ``Retry-After``), none on
  other 4xx; token accounting (and cost, when prices are given); every failure,
  refusal and empty completion counted by kind and never returned as a summary.

The API key is read from the environment variable the config names and is never logged
or written anywhere.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import random
import sqlite3
import threading
import time
from typing import Callable, Sequence

from absl import logging

from recomp_jax.reader import prompts

# Table 14 of the RECOMP appendix. The PDF wraps the NQ/TQA/HotpotQA prompts over lines;
# they are one line here, with single spaces where the PDF breaks. Wikitext's "\n" are the
# paper's own.
TEACHER_PROMPTS = {
    'nq': ('Compress the information in the retrieved documents into a 2-sentence summary that '
           'could be used to answer the question: Question: {query} Retrieved documents: {docs} '
           'Compressed documents:'),
    'tqa': ('Compress the information in the retrieved documents into a 2-sentence summary that '
            'could be used to answer the question: Question: {query} Retrieved documents: {docs} '
            'Compressed documents:'),
    'hotpotqa': ('Source documents: {docs} Question: {query} Generate a reasoning chain to answer '
                 'the question:'),
    'wikitext': ('Generate the next two sentences of the given query using the information from '
                 'the provided documents. \nSource Documents: {docs} \nQuery: {query} \n'),
}

# Table 14's four language-modelling prompts (Fig. 3 keeps the summary of whichever makes the
# continuation most likely); the first is TEACHER_PROMPTS['wikitext']. The "\n" are the paper's.
LM_TEACHER_PROMPTS = (
    TEACHER_PROMPTS['wikitext'],
    'Select sentences from the retrieved docs that are most likely be in the next sentence.\n'
    'Source Documents: {docs} \nQuery: {query}\n',
    'Generate the next one sentence of the given query using the information from the provided '
    'documents\nSource Documents: {docs} \nQuery: {query} \n',
    'Summarize the information from the provided documents\nSource Documents: {docs} \nQuery: {query}\n',
)

REFUSAL_PREFIXES = ("i'm sorry", 'i am sorry', "i can't", 'i cannot', 'as an ai')


def render_prompt(template: str, query: str, docs: str) -> str:
  """Fills ``{query}`` and ``{docs}`` (literal braces elsewhere in the texts stay as they are)."""
  return prompts.fill(template, docs=docs, query=query)


@dataclasses.dataclass(frozen=True)
class Sampling:
  """What is sent besides the prompt (part of the cache key). The paper: 0.7, top-p 1."""
  temperature: float = 0.7
  top_p: float = 1.0
  max_tokens: int = 128
  stop: tuple[str, ...] = ()
  seed: int = 0  # sample k of a prompt is requested with seed + k


@dataclasses.dataclass(frozen=True)
class Completion:
  """One teacher answer: ``text`` is None when it failed (``error`` names the kind)."""
  text: str | None
  prompt_tokens: int = 0
  completion_tokens: int = 0
  finish_reason: str | None = None
  error: str | None = None
  cached: bool = False

  @property
  def failure_kind(self) -> str | None:
    """The error's kind without its detail (``'gave_up_after_retries'``); None if it succeeded."""
    if self.text is not None:
      return None
    return self.error.split(':')[0] if self.error else 'unknown'


class ResponseCache:
  """Teacher answers in sqlite, one row per (model, template, prompt, sampling, sample index).

  Only successful answers are stored, so failures are retried by the next run.
  """

  def __init__(self, path: str):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self.path = path
    self._lock = threading.Lock()
    self._db = sqlite3.connect(path, check_same_thread=False)
    self._db.execute('CREATE TABLE IF NOT EXISTS completions (key TEXT PRIMARY KEY, model TEXT, '
                     'template TEXT, prompt_sha256 TEXT, response TEXT, created REAL)')
    self._db.commit()

  @staticmethod
  def key(model: str, template: str, prompt: str, sampling: Sampling, sample: int) -> str:
    blob = json.dumps({'model': model, 'template': hashlib.sha256(template.encode()).hexdigest(),
                       'prompt': hashlib.sha256(prompt.encode()).hexdigest(),
                       'sampling': dataclasses.asdict(sampling), 'sample': sample}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()

  def get(self, key: str) -> Completion | None:
    with self._lock:
      row = self._db.execute('SELECT response FROM completions WHERE key = ?', (key,)).fetchone()
    if row is None:
      return None
    return dataclasses.replace(Completion(**json.loads(row[0])), cached=True)

  def put(self, key: str, model: str, template: str, prompt: str, completion: Completion) -> None:
    record = json.dumps({k: v for k, v in dataclasses.asdict(completion).items() if k != 'cached'})
    with self._lock:
      self._db.execute('INSERT OR REPLACE INTO completions VALUES (?, ?, ?, ?, ?, ?)',
                       (key, model, hashlib.sha256(template.encode()).hexdigest(),
                        hashlib.sha256(prompt.encode()).hexdigest(), record, time.time()))
      self._db.commit()

  def count_missing(self, model: str, template: str, prompts: Sequence[str], sampling: Sampling,
                    samples: int = 1) -> int:
    """How many of ``prompts`` x ``samples`` answers are not cached yet (0: no endpoint is needed)."""
    return sum(self.get(self.key(model, template, p, sampling, s)) is None for p in prompts for s in range(samples))

  def __len__(self) -> int:
    with self._lock:
      return int(self._db.execute('SELECT COUNT(*) FROM completions').fetchone()[0])

  def close(self) -> None:
    with self._lock:
      self._db.close()


@dataclasses.dataclass
class Accounting:
  """What a run asked for and got: counts by outcome, tokens, and cost when priced."""
  requests: int = 0
  cached: int = 0
  ok: int = 0
  retries: int = 0
  failures: dict = dataclasses.field(default_factory=dict)
  prompt_tokens: int = 0
  completion_tokens: int = 0

  def cost(self, price_per_million_input: float | None, price_per_million_output: float | None):
    if price_per_million_input is None or price_per_million_output is None:
      return None
    return (self.prompt_tokens * price_per_million_input +
            self.completion_tokens * price_per_million_output) / 1e6

  def as_dict(self, prices: tuple[float | None, float | None] = (None, None)) -> dict:
    return {**dataclasses.asdict(self), 'cost_usd': self.cost(*prices)}


class Teacher:
  """Summaries from an OpenAI-compatible endpoint, cached, retried and accounted for.

  Args:
    model: the endpoint's model name.
    base_url: e.g. ``http://127.0.0.1:8000/v1`` (None: the openai client's default).
    api_key_env: environment variable with the key ('' sends a placeholder key, for
      servers that need none).
    cache_path: the sqlite file of :class:`ResponseCache`.
    api: ``'chat'`` (one user message) or ``'completions'`` (the prompt as is: base models).
    sampling: temperature / top-p / max tokens / stop.
    concurrency: requests in flight at once.
    max_retries: retries of a retryable failure before it counts as failed.
    timeout_s: per-request timeout.
    backoff_s: first backoff; doubles per retry (capped at ``max_backoff_s``), with full jitter.
    prices: USD per million input and output tokens (None: cost not reported).
    http_client: an ``httpx.Client`` for the openai client (tests, proxies).
  """

  def __init__(self, model: str, *, base_url: str | None = None, api_key_env: str = 'OPENAI_API_KEY',
               cache_path: str, api: str = 'chat', sampling: Sampling = Sampling(),
               concurrency: int = 8, max_retries: int = 5, timeout_s: float = 120.0,
               backoff_s: float = 1.0, max_backoff_s: float = 60.0,
               prices: tuple[float | None, float | None] = (None, None), http_client=None,
               sleep: Callable[[float], None] = time.sleep):
    import openai  # pylint: disable=import-outside-toplevel
    if api not in ('chat', 'completions'):
      raise ValueError(f"api must be 'chat' or 'completions', got {api!r}")
    key = os.environ.get(api_key_env, '') if api_key_env else ''
    if api_key_env and not key and base_url is None:
      raise ValueError(f'the teacher needs an API key in ${api_key_env} (or a base_url of a '
                       'server that needs none)')
    self._openai = openai
    self.client = openai.OpenAI(api_key=key or 'none', base_url=base_url, max_retries=0,
                                timeout=timeout_s, http_client=http_client)
    self.model, self.api, self.sampling = model, api, sampling
    self.concurrency, self.max_retries = concurrency, max_retries
    self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
    self.prices = prices
    self.cache = ResponseCache(cache_path)
    self.accounting = Accounting()
    self._lock = threading.Lock()
    self._sleep = sleep
    self._random = random.Random(0)

  # -- one request --------------------------------------------------------------------

  def _send(self, prompt: str, seed: int | None) -> Completion:
    extra = {} if seed is None else {'seed': seed}
    common = dict(model=self.model, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                  max_tokens=self.sampling.max_tokens, stop=list(self.sampling.stop) or None, **extra)
    if self.api == 'chat':
      reply = self.client.chat.completions.create(messages=[{'role': 'user', 'content': prompt}],
                                                  **common)
      choice = reply.choices[0] if reply.choices else None
      message = getattr(choice, 'message', None)
      if message is not None and getattr(message, 'refusal', None):
        return Completion(None, *_usage(reply), choice.finish_reason, error='refusal')
      text = None if message is None else message.content
    else:
      reply = self.client.completions.create(prompt=prompt, **common)
      choice = reply.choices[0] if reply.choices else None
      text = None if choice is None else choice.text
    if choice is None or text is None:
      return Completion(None, *_usage(reply), error='malformed_response')
    text = text.strip()
    if not text:
      return Completion(None, *_usage(reply), choice.finish_reason, error='empty_completion')
    if text.lower().startswith(REFUSAL_PREFIXES):
      return Completion(None, *_usage(reply), choice.finish_reason, error='refusal')
    return Completion(text, *_usage(reply), choice.finish_reason)

  def _retry_after(self, error) -> float | None:
    response = getattr(error, 'response', None)
    value = None if response is None else response.headers.get('retry-after')
    try:
      return None if value is None else max(0.0, float(value))
    except ValueError:
      return None

  def complete(self, template: str, prompt: str, *, sample: int = 0) -> Completion:
    """One prompt (cached). ``sample`` > 0 asks for another independent sample."""
    key = ResponseCache.key(self.model, template, prompt, self.sampling, sample)
    cached = self.cache.get(key)
    if cached is not None:
      self._count(cached)
      return cached
    retryable = (self._openai.RateLimitError, self._openai.InternalServerError,
                 self._openai.APITimeoutError, self._openai.APIConnectionError)
    attempt = 0
    while True:
      try:
        completion = self._send(prompt, seed=self.sampling.seed + sample)
        break
      except retryable as error:
        if attempt >= self.max_retries:
          completion = Completion(None, error=f'gave_up_after_retries:{type(error).__name__}')
          break
        wait = self._retry_after(error)
        if wait is None:
          wait = self._random.uniform(0, min(self.max_backoff_s, self.backoff_s * 2 ** attempt))
        attempt += 1
        with self._lock:
          self.accounting.retries += 1
        self._sleep(wait)
      except self._openai.APIStatusError as error:  # 400, 401, 403, 404, 422: retrying cannot help
        completion = Completion(None, error=f'http_{error.status_code}')
        break
      except (self._openai.APIError, ValueError, TypeError, AttributeError, KeyError) as error:
        completion = Completion(None, error=f'malformed_response:{type(error).__name__}')
        break
    if completion.text is not None:
      self.cache.put(key, self.model, template, prompt, completion)
    self._count(completion)
    return completion

  def _count(self, completion: Completion) -> None:
    with self._lock:
      a = self.accounting
      a.requests += 1
      a.cached += int(completion.cached)
      if not completion.cached:
        a.prompt_tokens += completion.prompt_tokens
        a.completion_tokens += completion.completion_tokens
      if completion.text is None:
        kind = completion.failure_kind
        a.failures[kind] = a.failures.get(kind, 0) + 1
      else:
        a.ok += 1

  # -- many -----------------------------------------------------------------------------

  def complete_all(self, template: str, prompts: Sequence[str], *, samples: int = 1,
                   desc: str = 'teacher') -> list[list[Completion]]:
    """``samples`` completions of every prompt, in order, ``concurrency`` requests at a time."""
    from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
    jobs = [(i, s) for i in range(len(prompts)) for s in range(samples)]
    out: list[list[Completion | None]] = [[None] * samples for _ in prompts]
    with tqdm(total=len(jobs), desc=desc, dynamic_ncols=True, disable=not jobs) as bar, \
        concurrent.futures.ThreadPoolExecutor(max(1, self.concurrency)) as pool:
      futures = {pool.submit(self.complete, template, prompts[i], sample=s): (i, s) for i, s in jobs}
      for future in concurrent.futures.as_completed(futures):
        i, s = futures[future]
        out[i][s] = future.result()
        bar.update(1)
    failures = self.accounting.failures
    if failures:
      logging.warning('teacher: %d of %d requests failed: %s', sum(failures.values()),
                      self.accounting.requests, ', '.join(f'{k} {v}' for k, v in sorted(failures.items())))
    return out  # type: ignore[return-value]

  def report(self) -> dict:
    """Accounting for the results file (no key, no URL credentials)."""
    return {'model': self.model, 'api': self.api, 'sampling': dataclasses.asdict(self.sampling),
            **self.accounting.as_dict(self.prices)}


def _usage(reply) -> tuple[int, int]:
  usage = getattr(reply, 'usage', None)
  if usage is None:
    return 0, 0
  return int(getattr(usage, 'prompt_tokens', 0) or 0), int(getattr(usage, 'completion_tokens', 0) or 0)


__all__ = ['Accounting', 'Completion', 'LM_TEACHER_PROMPTS', 'REFUSAL_PREFIXES', 'ResponseCache', 'Sampling',
           'TEACHER_PROMPTS', 'Teacher', 'render_prompt']
