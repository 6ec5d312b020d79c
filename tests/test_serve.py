"""The OpenAI-compatible server, end to end: a real server process on 127.0.0.1 serving the
real Gemma 3 270M, driven by the real ``openai`` client (and raw HTTP for the error cases)."""

import concurrent.futures
import os
import time

import pytest

import openai
import httpx
from recomp_jax.serving import chat  # noqa: E402
from recomp_jax.serving.engine import StreamingText  # noqa: E402
from recomp_jax.serving.launch import LocalServer  # noqa: E402

KEY_ENV = 'RECOMP_JAX_TEST_SERVER_KEY'
KEY = 'test-key-4f1d'
MAX_QUEUE = 40


@pytest.fixture(scope='module')
def server(gemma3_hf_dir):
  """``(base_url, model_id)`` of a server process; stopped after the module."""
  log = os.path.join(os.environ.get('TMPDIR', '/tmp'), f'recomp_serve_test_{os.getpid()}.log')
  with LocalServer(gemma3_hf_dir, model_id='gemma-test', env={KEY_ENV: KEY}, log_path=log,
                   args=(f'--api-key-env={KEY_ENV}', '--max-batch=16', f'--max-queue={MAX_QUEUE}',
                         '--batch-window-ms=50', '--max-new-tokens=1024')) as local:
    yield local.url, 'gemma-test'


def _client(server):
  return openai.OpenAI(base_url=server[0] + '/v1', api_key=KEY, max_retries=0, timeout=600)


def _error(response) -> dict:
  body = response.json()
  assert set(body) == {'error'} and set(body['error']) == {'message', 'type', 'param', 'code'}
  assert 'Traceback' not in body['error']['message']
  return body['error']


def test_models_lists_the_served_model(server):
  models = _client(server).models.list().data
  assert [m.id for m in models] == ['gemma-test'] and models[0].object == 'model'


def test_concurrent_chat_requests_equal_the_same_requests_alone(server):
  client = _client(server)
  questions = [f'Question {i}: what is {i} plus {i + 3}?' for i in range(32)]

  def ask(question):
    reply = client.chat.completions.create(
        model=server[1], messages=[{'role': 'user', 'content': question}], max_tokens=8,
        temperature=0)
    return reply.choices[0].message.content, reply.usage.completion_tokens, reply.choices[0].finish_reason

  before = httpx.get(server[0] + '/health').json()['batches_run']
  with concurrent.futures.ThreadPoolExecutor(32) as pool:
    together = list(pool.map(ask, questions))
  batches = httpx.get(server[0] + '/health').json()['batches_run'] - before
  alone = [ask(q) for q in questions]
  assert together == alone
  assert batches < 32  # they were batched, not run one by one
  assert len({text for text, _, _ in together}) > 1 and all(n >= 1 for _, n, _ in together)


def test_streamed_answers_equal_whole_ones(server):
  client = _client(server)
  whole = client.completions.create(model=server[1], prompt='The river Amazon flows through',
                                    max_tokens=24, temperature=0)
  chunks = list(client.completions.create(model=server[1], prompt='The river Amazon flows through',
                                          max_tokens=24, temperature=0, stream=True))
  assert ''.join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
  assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == 'length'
  assert whole.usage.completion_tokens == 24
  messages = [{'role': 'system', 'content': 'Answer briefly.'},
              {'role': 'user', 'content': 'Where is Paris?'}]
  whole = client.chat.completions.create(model=server[1], messages=messages, max_tokens=16,
                                         temperature=0)
  stream = client.chat.completions.create(model=server[1], messages=messages, max_tokens=16,
                                          temperature=0, stream=True)
  text = ''.join(c.choices[0].delta.content or '' for c in stream if c.choices)
  assert text == whole.choices[0].message.content and text


def test_stop_strings_seed_and_n(server):
  client = _client(server)
  full = client.completions.create(model=server[1], prompt='1, 2, 3, 4,', max_tokens=12,
                                   temperature=0).choices[0].text
  cut = full.find(',', 1)
  assert cut > 0, full
  stopped = client.completions.create(model=server[1], prompt='1, 2, 3, 4,', max_tokens=12,
                                      temperature=0, stop=[','])
  assert stopped.choices[0].text == full[:full.find(',')] and stopped.choices[0].finish_reason == 'stop'
  sample = lambda seed: [c.text for c in client.completions.create(
      model=server[1], prompt='Once upon a time', max_tokens=10, temperature=1.0, top_p=0.9,
      seed=seed, n=3).choices]
  first = sample(11)
  assert len(first) == 3 and first == sample(11) and first != sample(12)


def test_bad_requests_get_openai_errors(server):
  base = server[0] + '/v1'
  auth = {'Authorization': f'Bearer {KEY}'}
  assert _error(httpx.get(base + '/models'))['type'] == 'authentication_error'
  no_key = httpx.get(base + '/models', headers={'Authorization': 'Bearer wrong'})
  assert no_key.status_code == 401
  cases = [
      ({'model': server[1], 'prompt': 'x', 'temperature': 3.0}, 400, 'temperature'),
      ({'model': server[1], 'prompt': 'x', 'logprobs': 2}, 400, 'logprobs'),
      ({'model': server[1], 'prompt': 'x', 'max_tokens': 5000}, 400, 'max_tokens'),
      ({'model': server[1]}, 400, 'prompt'),
      ({'model': 'other', 'prompt': 'x'}, 404, 'model'),
  ]
  for body, status, param in cases:
    response = httpx.post(base + '/completions', json=body, headers=auth)
    assert response.status_code == status, (body, response.text)
    assert _error(response)['param'] == param
  broken = httpx.post(base + '/completions', content=b'{"model": ', headers=auth)
  assert broken.status_code == 400 and _error(broken)
  chat_cases = [{'model': server[1], 'messages': []},
                {'model': server[1], 'messages': [{'role': 'tool', 'content': 'x'}]},
                {'model': server[1], 'messages': [{'role': 'assistant', 'content': 'x'}]}]
  for body in chat_cases:
    response = httpx.post(base + '/chat/completions', json=body, headers=auth)
    assert response.status_code == 400, (body, response.text)
    assert _error(response)['param'].startswith('messages')
  missing = httpx.get(base + '/nothing', headers=auth)
  assert missing.status_code == 404 and _error(missing)


def test_full_queue_is_429_and_a_disconnected_client_frees_its_slot(server):
  base, model = server
  auth = {'Authorization': f'Bearer {KEY}'}
  too_many = httpx.post(base + '/v1/completions', headers=auth, json={
      'model': model, 'prompt': ['a', 'b', 'c'], 'n': 16, 'max_tokens': 4})  # 48 rows > 40
  assert too_many.status_code == 429 and _error(too_many)['type'] == 'rate_limit_error'
  with httpx.stream('POST', base + '/v1/completions', headers=auth, timeout=600, json={
      'model': model, 'prompt': 'Tell me a long story.', 'max_tokens': 1000, 'temperature': 0,
      'stream': True}) as response:
    for line in response.iter_lines():
      if line.startswith('data:'):
        break  # the first token arrived; now leave
  assert httpx.get(base + '/health').json()['active_rows'] <= 1
  for _ in range(50):
    if httpx.get(base + '/health').json()['active_rows'] == 0:
      break
    time.sleep(0.2)
  assert httpx.get(base + '/health').json()['active_rows'] == 0  # long before 1000 tokens
  after = _client(server).completions.create(model=model, prompt='Hello', max_tokens=2)
  assert after.usage.completion_tokens >= 1


# -- pieces, without a server ------------------------------------------------------------


class _CharTokenizer:
  def decode(self, ids, skip_special_tokens=True):
    return ''.join(chr(i) for i in ids)


def test_streaming_text_holds_back_a_possible_stop_string():
  text = StreamingText(_CharTokenizer(), ['END'])
  out = [text.add(ord(c)) for c in 'abcENxEND!']
  emitted = ''.join(d for d, _ in out)
  assert emitted == 'abcENx' and out[-2][1] and not out[3][1]
  assert [d for d, _ in out[:5]] == ['a', 'b', 'c', '', '']  # 'E', 'EN' may start END


def test_gemma_turn_format():
  text = chat.gemma_turns([{'role': 'system', 'content': 'Be brief.'},
                           {'role': 'user', 'content': 'Hi'},
                           {'role': 'assistant', 'content': 'Hello'},
                           {'role': 'user', 'content': 'Bye'}])
  assert text == ('<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n'
                  '<start_of_turn>model\nHello<end_of_turn>\n'
                  '<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n')
  with pytest.raises(chat.ChatFormatError, match=r'messages\[1\]'):
    chat.gemma_turns([{'role': 'user', 'content': 'a'}, {'role': 'system', 'content': 'b'}])


def test_teacher_pipeline_against_our_server_caches_every_answer(server, tmp_path, monkeypatch):
  from recomp_jax import teacher as teacher_lib
  monkeypatch.setenv(KEY_ENV, KEY)
  template = teacher_lib.TEACHER_PROMPTS['nq']
  prompts = [teacher_lib.render_prompt(template, q, 'Paris is the capital of France.')
             for q in ('what is the capital of france', 'which country has paris as capital')]
  make = lambda: teacher_lib.Teacher(
      server[1], base_url=server[0] + '/v1', api_key_env=KEY_ENV, api='completions',
      cache_path=str(tmp_path / 'teacher.sqlite'),
      sampling=teacher_lib.Sampling(temperature=0.7, max_tokens=12))
  first = make()
  out = first.complete_all(template, prompts, samples=2)
  assert first.accounting.requests == 4 and first.accounting.completion_tokens > 0
  texts = [[c.text for c in row] for row in out]
  assert all(isinstance(t, str) or c.error for row in out for t, c in zip([x.text for x in row], row))
  batches = httpx.get(server[0] + '/health').json()['batches_run']
  second = make()
  again = second.complete_all(template, prompts, samples=2)
  assert [[c.text for c in row] for row in again] == texts
  assert httpx.get(server[0] + '/health').json()['batches_run'] == batches  # nothing re-sent
  assert second.accounting.cached == sum(t is not None for row in texts for t in row)


def test_server_children_die_with_their_parent(tmp_path):
  """LocalServer's child gets SIGTERM when its parent is SIGKILLed (no orphaned server)."""
  import signal
  import subprocess
  import sys
  import time
  code = ('import subprocess, sys, time\n'
          'from recomp_jax.serving.launch import _die_with_parent\n'
          'child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], '
          'preexec_fn=_die_with_parent)\n'
          'print(child.pid, flush=True)\n'
          'time.sleep(120)\n')
  parent = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, text=True)
  child_pid = int(parent.stdout.readline())
  parent.send_signal(signal.SIGKILL)
  parent.wait()
  deadline = time.time() + 10
  while time.time() < deadline:
    try:
      with open(f'/proc/{child_pid}/stat') as f:
        if f.read().split(')')[-1].split()[0] == 'Z':
          break  # exited, waiting for init to reap it
    except FileNotFoundError:
      break
    time.sleep(0.1)
  else:
    os.kill(child_pid, signal.SIGKILL)
    raise AssertionError('the child outlived its SIGKILLed parent')


def test_warm_up_compiles_every_batch_size_so_the_first_requests_compile_nothing(tiny_gemma_dir):
  import threading

  from recomp_jax.models import gemma_decoding
  from recomp_jax.pretrained import load_pretrained
  from recomp_jax.serving.engine import Engine, Failed, Finished, Job

  pretrained = load_pretrained(tiny_gemma_dir)
  tokenizer = pretrained.tokenizer()
  engine = Engine(pretrained.model, tokenizer, max_batch=4, steps=4, window_s=0.2)
  try:
    warm = engine.warm_up([10], max_new_tokens=8)
    assert [shape[:2] for shape in warm['shapes']] == [[1, 16], [2, 16], [4, 16]]
    compiled = (gemma_decoding._prefill_and_sample._cache_size(), gemma_decoding._decode_and_sample._cache_size())
    ends, done = [], threading.Event()

    def sink(event):
      if isinstance(event, (Finished, Failed)):
        ends.append(event)
        if len(ends) == 3:
          done.set()

    prompts = [tokenizer(f'a question of number {i}')['input_ids'] for i in range(3)]
    assert max(len(p) for p in prompts) <= 16  # the warmed length bucket
    engine.submit([Job(p, 8, 0.0, 1.0, 0, (), (), sink) for p in prompts])  # 3 rows: the batch-4 programs
    assert done.wait(120)
    assert all(isinstance(e, Finished) for e in ends) and engine.batches_run == 1
    assert (gemma_decoding._prefill_and_sample._cache_size(),
            gemma_decoding._decode_and_sample._cache_size()) == compiled
  finally:
    engine.close()
