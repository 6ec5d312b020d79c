"""A tiny causal LM built from ``recomp_jax.models.layers`` for the training-engine tests.

Every parameter carries logical axes (``vocab/embed/heads/head_dim/mlp/norm``)
so the sharding rules apply to it exactly as to the real models; it has
biases and both norm kinds so the weight-decay mask has something to exclude.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from recomp_jax.models import layers
from recomp_jax.sharding import with_logical_constraint
from recomp_jax.training.losses import LOSS_WEIGHT


@dataclasses.dataclass(frozen=True)
class TinyConfig:
  vocab_size: int = 32
  embed_dim: int = 16
  num_heads: int = 2
  head_dim: int = 8
  mlp_dim: int = 32
  dropout_rate: float = 0.1


class TinyLM(nnx.Module):
  """``[B, T]`` tokens -> ``[B, T, V]`` logits: embed, one pre-norm block, tied head."""

  def __init__(self, config: TinyConfig = TinyConfig(), *, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs | None):
    c = config
    self.config = c
    self.dtype = dtype
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.embed = layers.Embed(c.vocab_size, c.embed_dim, **kw)
    self.attn_norm = layers.RMSNorm(c.embed_dim, **kw)
    self.query = layers.DenseGeneral((c.embed_dim,), (c.num_heads, c.head_dim),
                                     axes=('embed', 'heads', 'head_dim'), **kw)
    self.key = layers.DenseGeneral((c.embed_dim,), (c.num_heads, c.head_dim),
                                   axes=('embed', 'heads', 'head_dim'), **kw)
    self.value = layers.DenseGeneral((c.embed_dim,), (c.num_heads, c.head_dim),
                                     axes=('embed', 'heads', 'head_dim'), **kw)
    self.out = layers.DenseGeneral((c.num_heads, c.head_dim), (c.embed_dim,),
                                   axes=('heads', 'head_dim', 'embed'), **kw)
    self.mlp_norm = layers.RMSNorm(c.embed_dim, scale_plus_one=True, **kw)
    self.wi = layers.DenseGeneral((c.embed_dim,), (c.mlp_dim,), axes=('embed', 'mlp'), use_bias=True, **kw)
    self.wo = layers.DenseGeneral((c.mlp_dim,), (c.embed_dim,), axes=('mlp', 'embed'), use_bias=True, **kw)
    self.final_norm = layers.LayerNorm(c.embed_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def _dropout(self, x: jax.Array, rng: jax.Array | None) -> jax.Array:
    rate = self.config.dropout_rate
    if rng is None or rate == 0.0:
      return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)

  def __call__(self, tokens: jax.Array, rng: jax.Array | None = None) -> jax.Array:
    """``[B, T]`` int -> ``[B, T, V]`` float32 logits; ``rng`` enables dropout."""
    rngs = (None, None) if rng is None else tuple(jax.random.split(rng))
    residual = ('batch', 'length', 'embed')
    heads = ('batch', 'length', 'heads', 'head_dim')
    x = with_logical_constraint(self.embed(tokens), residual)          # [B, T, D]
    h = self.attn_norm(x)
    q, k, v = (with_logical_constraint(proj(h), heads)                 # [B, T, N, H]
               for proj in (self.query, self.key, self.value))
    length = tokens.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))[None, None]    # [1, 1, T, S]
    attn = layers.dot_product_attention(q, k, v, mask=causal, scale=self.config.head_dim ** -0.5)
    x = with_logical_constraint(x + self._dropout(self.out(attn), rngs[0]), residual)
    h = jax.nn.gelu(self.wi(self.mlp_norm(x)))                         # [B, T, F]
    h = with_logical_constraint(h, ('batch', 'length', 'mlp'))
    x = with_logical_constraint(x + self._dropout(self.wo(h), rngs[1]), residual)
    logits = self.embed.attend(self.final_norm(x)) * self.config.embed_dim ** -0.5
    return with_logical_constraint(logits.astype(jnp.float32), ('batch', 'length', 'vocab'))


def make_model(seed: int = 0, config: TinyConfig = TinyConfig(), **kw) -> TinyLM:
  return TinyLM(config, rngs=nnx.Rngs(seed), **kw)


def lm_loss(model: TinyLM, batch: dict, rng: jax.Array | None):
  """Next-token cross-entropy over ``batch['mask']`` positions (mean per token)."""
  tokens, mask = batch['tokens'], batch['mask'].astype(jnp.float32)
  logits = model(tokens[:, :-1], rng)                                  # [B, T-1, V]
  targets, weights = tokens[:, 1:], mask[:, 1:]
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  count = jnp.maximum(weights.sum(), 1.0)
  loss = (nll * weights).sum() / count
  accuracy = ((jnp.argmax(logits, -1) == targets) * weights).sum() / count
  return loss, {'accuracy': accuracy, 'num_tokens': weights.sum(), LOSS_WEIGHT: weights.sum()}


def token_data(num_examples: int = 64, length: int = 9, vocab_size: int = 32, seed: int = 0,
               padded: bool = True) -> dict[str, np.ndarray]:
  """Learnable synthetic sequences (``t[i+1] = (t[i] + step) % V``) with optional right padding."""
  rng = np.random.default_rng(seed)
  start = rng.integers(0, vocab_size, (num_examples, 1))
  stride = rng.integers(1, 4, (num_examples, 1))
  tokens = (start + stride * np.arange(length)[None]) % vocab_size
  mask = np.ones((num_examples, length), np.int32)
  if padded:
    lengths = rng.integers(length // 2, length + 1, num_examples)
    mask = (np.arange(length)[None] < lengths[:, None]).astype(np.int32)
  return {'tokens': tokens.astype(np.int32), 'mask': mask}


def char_tokenizer(vocab_size: int, seq2seq: bool = False):
  """Character-level fast tokenizer of ``vocab_size`` ids: pad 0, eos 1, bos 2.

  Gemma-style (``<bos>`` first) by default, T5-style (``<eos>`` last) with ``seq2seq``.
  """
  import transformers
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
  specials = ['<pad>', '<eos>', '<bos>', '<unk>']
  chars = ['\n'] + [chr(c) for c in range(32, 127)]
  vocab = {tok: i for i, tok in enumerate(specials + chars)}
  vocab.update({f'<unused{i}>': i for i in range(len(vocab), vocab_size)})
  tok = Tokenizer(models.WordLevel(vocab, unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex('.|\n'), behavior='isolated')
  tok.decoder = decoders.Fuse()
  if seq2seq:
    tok.post_processor = processors.TemplateProcessing(single='$A <eos>', special_tokens=[('<eos>', 1)])
  else:
    tok.post_processor = processors.TemplateProcessing(single='<bos> $A', special_tokens=[('<bos>', 2)])
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token='<bos>',
                                              eos_token='<eos>', pad_token='<pad>', unk_token='<unk>')


def check_export_reproduces_the_trained_row(workdir, row: str) -> list[str]:
  """``recomp_jax.load_compressor(workdir/compressor)`` gives, on the run's test questions, the
  evidence that ``row`` of ``workdir/predictions.jsonl`` holds, question by question; returns it."""
  import json
  import os

  import recomp_jax
  from recomp_jax.data import stage_records
  compressor = recomp_jax.load_compressor(os.path.join(str(workdir), 'compressor'))
  examples = stage_records.read_examples(os.path.join(str(workdir), 'stages', 'retrieve', 'test.jsonl'))
  with open(os.path.join(str(workdir), 'predictions.jsonl'), encoding='utf-8') as f:
    expected = {p['id']: p['evidence'] for p in map(json.loads, f) if p['row'] == row}
  assert len(expected) == len(examples) > 0
  got = compressor.compress([e.question for e in examples], [e.ctxs for e in examples])
  assert got == [expected[e.id] for e in examples]
  return got


def check_truncation_row(workdir, tokenizer, top_docs: int) -> int:
  """The truncation row of ``workdir``'s results holds, per test question, the first ``k`` reader
  tokens of its top ``top_docs`` documents, ``k`` the trained row's mean evidence tokens (over its
  seeds), rounded; returns ``k``. ``tokenizer``: the reader's, or the directory it is saved in."""
  import json
  import os

  from recomp_jax.data import stage_records
  from recomp_jax.evaluation.rows import in_rank_order, truncate
  with open(os.path.join(str(workdir), 'results.json'), encoding='utf-8') as f:
    rows = {r['key']: r for r in json.load(f)['rows']}
  k = max(int(round(rows['trained']['tokens'])), 1)
  if isinstance(tokenizer, str):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer)
  examples = {e.id: e for e in stage_records.read_examples(os.path.join(str(workdir), 'stages', 'retrieve', 'test.jsonl'))}
  with open(os.path.join(str(workdir), 'predictions.jsonl'), encoding='utf-8') as f:
    got = {p['id']: p['evidence'] for p in map(json.loads, f) if p['row'] == 'truncation'}
  assert len(got) == len(examples) == rows['truncation']['n'] > 0
  for i, evidence in got.items():
    assert evidence == truncate(tokenizer, in_rank_order(examples[i].ctxs[:top_docs]), k), i
  return k
