"""OpenAI-compatible HTTP API over the batching :class:`~recomp_jax.serving.engine.Engine`.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` sends server-sent events ending in ``data: [DONE]``). Supported request
fields: ``model``, ``prompt`` / ``messages``, ``max_tokens`` (``max_completion_tokens``),
``temperature``, ``top_p``, ``stop``, ``seed``, ``n``, ``stream``, ``user``; fields
this server cannot honour (``logprobs``, ``echo``, tools, ...) are a 400, not silently
ignored. Every error has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:
400 bad request, 401 missing or wrong bearer key, 404 unknown model or path, 429 queue
full, 500 (message only, never a traceback) if generation itself fails.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from typing import Any, Literal

import fastapi
import pydantic
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from recomp_jax.serving import chat
from recomp_jax.serving.engine import Delta, Engine, Failed, Finished, Job, QueueFull

UNSUPPORTED = ('logprobs', 'top_logprobs', 'echo', 'suffix', 'best_of', 'logit_bias', 'tools',
               'tool_choice', 'functions', 'function_call', 'response_format', 'audio',
               'modalities', 'prediction')


class APIError(Exception):
  """An error returned to the client in OpenAI's shape."""

  def __init__(self, status: int, message: str, *, type_: str = 'invalid_request_error',
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

  def response(self) -> JSONResponse:
    return JSONResponse({'error': {'message': self.message, 'type': self.type, 'param': self.param,
                                   'code': self.code}}, status_code=self.status)


class _Request(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra='allow')

  model: str
  max_tokens: int | None = pydantic.Field(default=None, ge=1)
  temperature: float = pydantic.Field(default=1.0, ge=0.0, le=2.0)
  top_p: float = pydantic.Field(default=1.0, gt=0.0, le=1.0)
  n: int = pydantic.Field(default=1, ge=1, le=16)
  stop: str | list[str] | None = None
  seed: int | None = None
  stream: bool = False
  stream_options: dict | None = None
  user: str | None = None

  @pydantic.field_validator('stop')
  @classmethod
  def _at_most_four(cls, stop):
    if isinstance(stop, list) and len(stop) > 4:
      raise ValueError('at most 4 stop sequences')
    return stop

  def stop_strings(self) -> tuple[str, ...]:
    if self.stop is None:
      return ()
    return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Request):
  prompt: str | list[str]
  max_tokens: int | None = pydantic.Field(default=16, ge=1)


class ChatMessage(pydantic.BaseModel):
  role: Literal['system', 'developer', 'user', 'assistant']
  content: str | list[dict]

  def text(self) -> str:
    if isinstance(self.content, str):
      return self.content
    parts = []
    for part in self.content:
      if part.get('type') != 'text':
        raise APIError(400, f'content part type {part.get("type")!r} is not supported (text only)',
                       param='messages')
      parts.append(str(part.get('text', '')))
    return ''.join(parts)


class ChatRequest(_Request):
  messages: list[ChatMessage] = pydantic.Field(min_length=1)
  max_completion_tokens: int | None = pydantic.Field(default=None, ge=1)


def _usage(finished: list[Finished]) -> dict:
  prompt = sum(f.prompt_tokens for f in finished[:1]) if finished else 0
  completion = sum(f.completion_tokens for f in finished)
  return {'prompt_tokens': prompt, 'completion_tokens': completion,
          'total_tokens': prompt + completion}


class Server:
  """Request validation, job creation and response shaping for one served model.

  Args:
    engine: the batching engine.
    model_id: the name clients pass as ``model``.
    api_key: required bearer key (None = open).
    max_new_tokens: the largest ``max_tokens`` accepted.
    context_length: prompt plus ``max_tokens`` must fit in it.
  """

  def __init__(self, engine: Engine, model_id: str, *, api_key: str | None = None,
               max_new_tokens: int = 1024, context_length: int = 8192):
    self.engine = engine
    self.tokenizer = engine.tokenizer
    self.model_id = model_id
    self.api_key = api_key
    self.max_new_tokens = max_new_tokens
    self.context_length = context_length
    self.created = int(time.time())
    self.chat_stop_ids = chat.stop_ids(self.tokenizer)

  # -- checks -------------------------------------------------------------------------

  def check_key(self, request: fastapi.Request) -> None:
    if self.api_key is None:
      return
    header = request.headers.get('authorization', '')
    scheme, _, key = header.partition(' ')
    if scheme.lower() != 'bearer' or not secrets.compare_digest(key.strip(), self.api_key):
      raise APIError(401, 'missing or incorrect API key (send "Authorization: Bearer <key>")',
                     type_='authentication_error', code='invalid_api_key')

  def check_request(self, body: _Request) -> None:
    if body.model != self.model_id:
      raise APIError(404, f'the model {body.model!r} does not exist; this server serves '
                     f'{self.model_id!r}', param='model', code='model_not_found')
    for name in UNSUPPORTED:
      value = (body.model_extra or {}).get(name)
      allowed = (None, 1, body.n) if name == 'best_of' else (None, False, [])
      if value not in allowed:
        raise APIError(400, f'{name} is not supported by this server', param=name,
                       code='unsupported_parameter')

  def jobs(self, body: _Request, prompt_ids: list[int], max_tokens: int, stop_ids: tuple[int, ...],
           sink) -> list[Job]:
    if not prompt_ids:
      raise APIError(400, 'the prompt is empty', param='prompt')
    if max_tokens > self.max_new_tokens:
      raise APIError(400, f'max_tokens is {max_tokens}; this server allows at most '
                     f'{self.max_new_tokens}', param='max_tokens')
    if len(prompt_ids) + max_tokens > self.context_length:
      raise APIError(400, f'the prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens}: '
                     f'more than the context length {self.context_length}',
                     param='max_tokens', code='context_length_exceeded')
    base = secrets.randbits(31) if body.seed is None else body.seed
    return [Job(prompt_ids=prompt_ids, max_tokens=max_tokens, temperature=body.temperature,
                top_p=body.top_p, seed=(base + 7919 * i) % 2 ** 32, stop=body.stop_strings(),
                stop_ids=stop_ids, sink=lambda event, i=i: sink(i, event)) for i in range(body.n)]

  # -- running ------------------------------------------------------------------------

  async def run(self, request: fastapi.Request, body: _Request, prompts: list[tuple[list[int], str]],
                max_tokens: int, stop_ids: tuple[int, ...], shape) -> Any:
    """Submits every choice of every prompt; returns JSON or an event stream.

    ``shape(kind, index, text, finish_reason)`` builds one choice object in the
    endpoint's format; ``kind`` is ``'full'`` or ``'chunk'``.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    all_jobs: list[Job] = []
    for p, (prompt_ids, _) in enumerate(prompts):
      sink = lambda i, event, p=p: loop.call_soon_threadsafe(queue.put_nowait,
                                                            (p * body.n + i, event))
      all_jobs += self.jobs(body, prompt_ids, max_tokens, stop_ids, sink)
    try:
      self.engine.submit(all_jobs)
    except QueueFull as error:
      raise APIError(429, f'the server is busy ({error}); retry later', type_='rate_limit_error',
                     code='queue_full') from None
    ident = f'{"chatcmpl" if shape.chat else "cmpl"}-{uuid.uuid4().hex}'
    created = int(time.time())
    obj = 'chat.completion' if shape.chat else 'text_completion'
    if body.stream:
      return EventSourceResponse(self._events(request, queue, all_jobs, ident, created, obj, body,
                                              shape), ping=15)
    texts = [''] * len(all_jobs)
    finished: dict[int, Finished] = {}
    try:
      while len(finished) < len(all_jobs):
        try:
          index, event = await asyncio.wait_for(queue.get(), timeout=0.25)
        except asyncio.TimeoutError:
          if await request.is_disconnected():
            return None
          continue
        if isinstance(event, Delta):
          texts[index] += event.text
        elif isinstance(event, Failed):
          raise APIError(500, f'generation failed: {event.message}', type_='server_error')
        else:
          finished[index] = event
    finally:
      self.engine.cancel(all_jobs)
    choices = [shape('full', i, texts[i], finished[i].reason) for i in range(len(all_jobs))]
    usage = {'prompt_tokens': 0, 'completion_tokens': 0, 'total_tokens': 0}
    for p in range(len(prompts)):
      part = _usage([finished[p * body.n + i] for i in range(body.n)])
      usage = {k: usage[k] + part[k] for k in usage}
    return {'id': ident, 'object': obj, 'created': created, 'model': self.model_id,
            'choices': choices, 'usage': usage, 'system_fingerprint': None}

  async def _events(self, request, queue, jobs, ident, created, obj, body, shape):
    chunk_obj = obj + ('.chunk' if shape.chat else '')
    finished: dict[int, Finished] = {}

    def chunk(choices, usage=None):
      data = {'id': ident, 'object': chunk_obj, 'created': created, 'model': self.model_id,
              'choices': choices}
      if usage is not None:
        data['usage'] = usage
      return json.dumps(data)

    try:
      if shape.chat:
        yield chunk([shape('chunk', i, None, None) for i in range(len(jobs))])  # role first
      while len(finished) < len(jobs):
        try:
          index, event = await asyncio.wait_for(queue.get(), timeout=0.25)
        except asyncio.TimeoutError:
          if await request.is_disconnected():
            return
          continue
        if isinstance(event, Delta):
          yield chunk([shape('chunk', index, event.text, None)])
        elif isinstance(event, Failed):
          yield json.dumps({'error': {'message': f'generation failed: {event.message}',
                                      'type': 'server_error', 'param': None, 'code': None}})
          return
        else:
          finished[index] = event
          yield chunk([shape('chunk', index, '' if not shape.chat else None, event.reason)])
      if body.stream_options and body.stream_options.get('include_usage'):
        yield chunk([], _usage([finished[i] for i in range(body.n)]))
      yield '[DONE]'
    finally:
      self.engine.cancel(jobs)


class _Shape:
  """Builds one choice object for completions or chat, whole or as a stream chunk."""

  def __init__(self, chat_format: bool):
    self.chat = chat_format

  def __call__(self, kind, index, text, finish_reason):
    if not self.chat:
      return {'index': index, 'text': text or '', 'logprobs': None, 'finish_reason': finish_reason}
    if kind == 'full':
      return {'index': index, 'message': {'role': 'assistant', 'content': text, 'refusal': None},
              'logprobs': None, 'finish_reason': finish_reason}
    delta = {} if text is None and finish_reason else {'content': text} if text is not None else {
        'role': 'assistant', 'content': ''}
    return {'index': index, 'delta': delta, 'logprobs': None, 'finish_reason': finish_reason}


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
  first = error.errors()[0] if error.errors() else {}
  location = [str(x) for x in first.get('loc', ()) if x != 'body']
  param = '.'.join(location) or None
  return f'{param + ": " if param else ""}{first.get("msg", "invalid request")}', param


def create_app(server: Server) -> fastapi.FastAPI:
  """The FastAPI application for ``server``."""
  app = fastapi.FastAPI(title='recomp_jax OpenAI-compatible server', docs_url=None, redoc_url=None)

  @app.exception_handler(APIError)
  async def _api_error(_, error: APIError):
    return error.response()

  @app.exception_handler(RequestValidationError)
  async def _invalid(_, error: RequestValidationError):
    message, param = _validation_message(error)
    return APIError(400, message, param=param).response()

  @app.exception_handler(StarletteHTTPException)
  async def _http(_, error: StarletteHTTPException):
    code = {404: 'not_found', 405: 'method_not_allowed'}.get(error.status_code)
    return APIError(error.status_code, str(error.detail), code=code).response()

  @app.exception_handler(Exception)
  async def _unexpected(_, error: Exception):
    return APIError(500, f'internal error: {type(error).__name__}', type_='server_error').response()

  @app.get('/health')
  async def health():
    """Not OpenAI's: liveness and load (rows queued or running, batches run so far)."""
    return {'status': 'ok', 'model': server.model_id, 'active_rows': server.engine.active_rows,
            'batches_run': server.engine.batches_run, 'rows_run': server.engine.rows_run}

  @app.get('/v1/models')
  async def models(request: fastapi.Request):
    server.check_key(request)
    return {'object': 'list', 'data': [{'id': server.model_id, 'object': 'model',
                                        'created': server.created, 'owned_by': 'recomp_jax'}]}

  @app.post('/v1/completions')
  async def completions(request: fastapi.Request, body: CompletionRequest):
    server.check_key(request)
    server.check_request(body)
    texts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
    if not texts:
      raise APIError(400, 'prompt: an empty list', param='prompt')
    prompts = [(server.tokenizer(t)['input_ids'], t) for t in texts]
    return await server.run(request, body, prompts, body.max_tokens, (), _Shape(False))

  @app.post('/v1/chat/completions')
  async def chat_completions(request: fastapi.Request, body: ChatRequest):
    server.check_key(request)
    server.check_request(body)
    messages = [{'role': 'system' if m.role == 'developer' else m.role, 'content': m.text()}
                for m in body.messages]
    try:
      text, ids = chat.render(server.tokenizer, messages)
    except chat.ChatFormatError as error:
      raise APIError(400, str(error), param='messages') from None
    max_tokens = body.max_completion_tokens or body.max_tokens or min(
        server.max_new_tokens, server.context_length - len(ids))
    return await server.run(request, body, [(ids, text)], max_tokens, server.chat_stop_ids,
                            _Shape(True))

  return app


__all__ = ['APIError', 'Server', 'create_app']
