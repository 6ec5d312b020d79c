"""The teacher client: retries, backoff, caching, accounting and failure kinds, against an
HTTP transport that plays a misbehaving OpenAI endpoint (the thing under test is our client)."""

import json
import os
import sqlite3

import pytest

import httpx
from recomp_jax import teacher as teacher_lib  # noqa: E402

SECRET = 'sk-test-never-log-me-123456'


def _chat_reply(text, prompt_tokens=11, completion_tokens=5, refusal=None):
  return {'id': 'c1', 'object': 'chat.completion', 'created': 0, 'model': 'm',
          'choices': [{'index': 0, 'finish_reason': 'stop', 'logprobs': None,
                       'message': {'role': 'assistant', 'content': text, 'refusal': refusal}}],
          'usage': {'prompt_tokens': prompt_tokens, 'completion_tokens': completion_tokens,
                    'total_tokens': prompt_tokens + completion_tokens}}


class Endpoint:
  """Answers each request with the next scripted ``(status, body, headers)``; records requests."""

  def __init__(self, script):
    self.script = list(script)
    self.requests = []

  def __call__(self, request: httpx.Request) -> httpx.Response:
    self.requests.append(request)
    status, body, headers = self.script.pop(0) if self.script else (200, _chat_reply('again'), {})
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.Response(status, content=content, headers={'content-type': 'application/json',
                                                              **headers})


def _teacher(tmp_path, endpoint, sleeps, monkeypatch, **kwargs):
  monkeypatch.setenv('TEST_TEACHER_KEY', SECRET)
  return teacher_lib.Teacher(
      'm', base_url='http://teacher.test/v1', api_key_env='TEST_TEACHER_KEY',
      cache_path=str(tmp_path / 'cache.sqlite'), http_client=httpx.Client(transport=httpx.MockTransport(endpoint)),
      sleep=sleeps.append, **kwargs)


def test_rate_limit_honours_retry_after_then_succeeds_and_caches(tmp_path, monkeypatch):
  endpoint = Endpoint([(429, {'error': {'message': 'slow down'}}, {'retry-after': '2'}),
                       (200, _chat_reply(' A short summary. '), {})])
  sleeps = []
  t = _teacher(tmp_path, endpoint, sleeps, monkeypatch, prices=(0.5, 1.5))
  out = t.complete('tmpl {query}', 'prompt one')
  assert out.text == 'A short summary.' and sleeps == [2.0] and t.accounting.retries == 1
  sent = json.loads(endpoint.requests[-1].content)
  assert sent['temperature'] == 0.7 and sent['top_p'] == 1.0 and sent['seed'] == 0
  assert endpoint.requests[-1].headers['authorization'] == f'Bearer {SECRET}'
  report = t.report()
  assert report['prompt_tokens'] == 11 and report['completion_tokens'] == 5
  assert report['cost_usd'] == pytest.approx((11 * 0.5 + 5 * 1.5) / 1e6)
  # a second run (new client, same cache) sends nothing
  endpoint2 = Endpoint([])
  t2 = _teacher(tmp_path, endpoint2, [], monkeypatch)
  again = t2.complete('tmpl {query}', 'prompt one')
  assert again.text == out.text and again.cached and not endpoint2.requests
  assert t2.accounting.cached == 1 and t2.accounting.prompt_tokens == 0
  assert SECRET not in json.dumps(report) and SECRET not in json.dumps(t2.report())
  with sqlite3.connect(tmp_path / 'cache.sqlite') as db:
    assert SECRET not in json.dumps(db.execute('SELECT * FROM completions').fetchall())


def test_server_errors_back_off_exponentially_then_give_up(tmp_path, monkeypatch):
  endpoint = Endpoint([(500, {'error': {'message': 'boom'}}, {})] * 4)
  sleeps = []
  t = _teacher(tmp_path, endpoint, sleeps, monkeypatch, max_retries=3, backoff_s=1.0)
  out = t.complete('t', 'p')
  assert out.text is None and out.error.startswith('gave_up_after_retries')
  assert len(endpoint.requests) == 4 and len(sleeps) == 3
  assert all(0 <= s <= cap for s, cap in zip(sleeps, (1.0, 2.0, 4.0)))
  assert t.accounting.failures == {'gave_up_after_retries': 1}
  assert len(t.cache) == 0  # failures are not cached: the next run tries again


def test_client_errors_are_not_retried_and_bad_answers_never_become_summaries(tmp_path, monkeypatch):
  endpoint = Endpoint([(400, {'error': {'message': 'bad'}}, {}),
                       (200, _chat_reply('   '), {}),
                       (200, _chat_reply(None, refusal='I will not'), {}),
                       (200, _chat_reply("I'm sorry, I can't help with that."), {}),
                       (200, b'{"not": "a completion"', {}),
                       (200, _chat_reply('Fine.'), {})])
  sleeps = []
  t = _teacher(tmp_path, endpoint, sleeps, monkeypatch)
  results = [t.complete('t', f'p{i}') for i in range(6)]
  assert [r.error and r.error.split(':')[0] for r in results] == [
      'http_400', 'empty_completion', 'refusal', 'refusal', 'malformed_response', None]
  assert results[-1].text == 'Fine.' and not sleeps and len(endpoint.requests) == 6
  assert t.accounting.ok == 1 and sum(t.accounting.failures.values()) == 5


def test_complete_all_keeps_order_samples_and_concurrency(tmp_path, monkeypatch):
  def reply(request):
    body = json.loads(request.content)
    text = f"{body['messages'][0]['content']}#{body['seed']}"
    return httpx.Response(200, json=_chat_reply(text))

  t = _teacher(tmp_path, reply, [], monkeypatch, concurrency=4)
  prompts = [teacher_lib.render_prompt(teacher_lib.TEACHER_PROMPTS['nq'], f'q{i}', 'D') for i in range(5)]
  out = t.complete_all(teacher_lib.TEACHER_PROMPTS['nq'], prompts, samples=2)
  assert [[c.text for c in row] for row in out] == [[f'{p}#0', f'{p}#1'] for p in prompts]
  assert prompts[0].startswith('Compress the information') and 'Question: q0' in prompts[0]
  assert t.accounting.requests == 10 and t.accounting.ok == 10
  # what a teacher stage checks before it starts an endpoint: every answer cached -> nothing missing
  cache = teacher_lib.ResponseCache(str(tmp_path / 'cache.sqlite'))
  template = teacher_lib.TEACHER_PROMPTS['nq']
  assert cache.count_missing('m', template, prompts, t.sampling, samples=2) == 0
  assert cache.count_missing('m', template, prompts + ['new prompt'], t.sampling, samples=3) == 5 + 3
  assert cache.count_missing('other model', template, prompts, t.sampling) == 5
  cache.close()


def test_missing_key_without_a_server_is_a_clear_error(tmp_path, monkeypatch):
  monkeypatch.delenv('NO_SUCH_KEY_VAR', raising=False)
  with pytest.raises(ValueError, match='NO_SUCH_KEY_VAR'):
    teacher_lib.Teacher('gpt', api_key_env='NO_SUCH_KEY_VAR', cache_path=str(tmp_path / 'c.sqlite'))
  assert not os.path.exists(tmp_path / 'c.sqlite')


def test_the_four_language_modelling_prompts_of_table_14():
  lm = teacher_lib.LM_TEACHER_PROMPTS
  assert len(lm) == 4 and lm[0] == teacher_lib.TEACHER_PROMPTS['wikitext']
  rendered = [teacher_lib.render_prompt(t, 'the query text', 'D1 D2') for t in lm]
  assert all('Source Documents: D1 D2 \nQuery: the query text' in r and '{' not in r for r in rendered)
  assert [r.split('\n')[0] for r in rendered] == [
      'Generate the next two sentences of the given query using the information from the provided documents. ',
      'Select sentences from the retrieved docs that are most likely be in the next sentence.',
      'Generate the next one sentence of the given query using the information from the provided documents',
      'Summarize the information from the provided documents']
