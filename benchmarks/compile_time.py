"""Compile time of a training step vs depth: layers as a Python loop vs one ``lax.scan``.

    python benchmarks/compile_time.py [--models minilm,gemma3_270m,gemma3_26l,t5_base]

For each architecture (random parameters, never materialised: the step is lowered and
compiled from abstract shapes), ``jax.jit(value_and_grad(loss)).lower(...).compile()`` is
timed with the layers unrolled (``scan_layers=False``), scanned (``scan_layers=True``) and
scanned with ``remat``, and the lowered program's ``dot_general`` count is printed: scanned, it
holds one layer body whatever the depth. There is no PyTorch column: eager PyTorch does not
compile.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import cpu_description  # noqa: E402


def _models():
  from recomp_jax.models import bert, gemma, t5
  minilm = bert.BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6,
                           num_attention_heads=12, intermediate_size=1536)
  gemma_26 = gemma.GemmaConfig(num_layers=26, layer_types=tuple(
      gemma.FULL if (i + 1) % 6 == 0 else gemma.SLIDING for i in range(26)))
  t5_base = t5.T5Config(d_model=768, d_ff=2048, num_layers=12, num_decoder_layers=12,
                        num_heads=12, feed_forward_proj='gated-gelu', tie_word_embeddings=False,
                        scale_decoder_outputs=False)
  return {
      'minilm': ('MiniLM-L6 (6 layers), 64 x 256 tokens', lambda rngs: bert.BertModel(minilm, rngs=rngs),
                 'bert', (64, 256)),
      'gemma3_270m': ('Gemma 3 270M (18 layers), 8 x 256 tokens',
                      lambda rngs: gemma.GemmaModel(gemma.GemmaConfig(), rngs=rngs), 'gemma', (8, 256)),
      'gemma3_26l': ('Gemma 3 270M widths, 26 layers (1B depth), 8 x 256 tokens',
                     lambda rngs: gemma.GemmaModel(gemma_26, rngs=rngs), 'gemma', (8, 256)),
      't5_base': ('T5 v1.1 base (12 + 12 layers), 8 x 256 -> 64 tokens',
                  lambda rngs: t5.T5Model(t5_base, rngs=rngs), 't5', (8, 256)),
  }


def _loss(kind: str, model, batch):
  import jax
  import jax.numpy as jnp
  if kind == 'bert':
    hidden = model(batch['ids'], batch['mask'])
    return jnp.mean(jnp.square(hidden))
  if kind == 'gemma':
    logits = model(batch['ids'], batch['mask'])
    return -jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])
  logits = model(batch['ids'], batch['mask'], batch['target'])
  return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])


def measure(factory, kind: str, shape: tuple[int, int], scan: bool, remat: bool
            ) -> tuple[float, float, int]:
  """(lower seconds, compile seconds, dot_general count) of one gradient step."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  abstract = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
  abstract.set_layer_execution(scan_layers=scan, remat=remat)
  graphdef, state = nnx.split(abstract)
  batch_size = shape[0]
  batch = {'ids': jax.ShapeDtypeStruct(shape, jnp.int32), 'mask': jax.ShapeDtypeStruct(shape, jnp.int32),
           'target': jax.ShapeDtypeStruct((batch_size, 64), jnp.int32)}

  def step(state, batch):
    return jax.value_and_grad(lambda s: _loss(kind, nnx.merge(graphdef, s), batch))(state)

  start = time.perf_counter()
  lowered = jax.jit(step).lower(state, batch)
  lowered_at = time.perf_counter()
  lowered.compile()
  done = time.perf_counter()
  return lowered_at - start, done - lowered_at, lowered.as_text().count('dot_general')


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--models', default='minilm,gemma3_270m,gemma3_26l,t5_base')
  args = parser.parse_args()
  import jax
  print(f'{cpu_description()}, {os.cpu_count()} cores; jax {jax.__version__}', flush=True)
  models = _models()
  lines = ['| model | layers | lower (s) | compile (s) | dot_general in the program |',
           '|---|---|---|---|---|']
  for key in args.models.split(','):
    title, factory, kind, shape = models[key]
    for name, scan, remat in (('loop', False, False), ('scan', True, False), ('scan + remat', True, True)):
      lower, compile_s, dots = measure(factory, kind, shape, scan, remat)
      lines.append(f'| {title} | {name} | {lower:.1f} | {compile_s:.1f} | {dots} |')
      print(lines[-1], flush=True)
  print('\n### Training-step compile time\n\n' + '\n'.join(lines))


if __name__ == '__main__':
  main()
