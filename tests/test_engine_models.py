"""The sharded training engine on the real architectures: 8-device step == 1-device step.

For each model of the zoo -- the BERT dual encoder with the RECOMP contrastive
loss (1 positive + 2 hard negatives, in-batch negatives, dropout on), T5 v1.1
with the seq2seq loss, Gemma 3 (sliding + full layers) with K-COMP's
knowledge-injection causal LM loss, and T5 / Gemma again with their layers scanned and
rematerialised -- one :func:`recomp_jax.training.loop.make_train_step`
on a ``(data, fsdp, tensor) = (2, 2, 2)`` mesh of 8 fake CPU devices must give
the loss, gradients and updated parameters of the same step on one device
(within 1e-5), with every parameter (and Adam moment) sharded as
:data:`recomp_jax.sharding.LOGICAL_AXIS_RULES` says.

Models are tiny random configs built from each config dataclass (no Hugging
Face download). Like ``tests/test_sharding.py`` (whose helpers this file
reuses), the 8-device class runs in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` when this pytest process
has fewer devices.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multidevice import NUM_DEVICES, run_with_fake_devices  # noqa: E402
from test_sharding import EngineCase, _host, _max_diff  # noqa: E402

from recomp_jax import sharding  # noqa: E402
from recomp_jax.models import gemma, t5  # noqa: E402
from recomp_jax.models.bert import BertConfig, BertModel  # noqa: E402
from recomp_jax.models.dual_encoder import DualEncoder  # noqa: E402
from recomp_jax.training import loop as train_lib  # noqa: E402
from recomp_jax.training import losses  # noqa: E402
from recomp_jax.training.optim import OptimizerConfig  # noqa: E402

BATCH = 8  # divisible by the 4 batch shards (data x fsdp) of the 2x2x2 mesh
VOCAB = 64

# No clipping, so after one step Adam's first moment is exactly (1 - b1) * gradient and
# exposes the gradients. Adam's first update is lr * g / (|g| + eps): its sensitivity to the
# gradient, lr / eps near g = 0, turns the ~1e-8 absolute rounding differences of gradients
# that are sums of cancelling terms (1 vs 8 devices reduce in different orders) into
# parameter differences of lr * 1e-8 / eps; eps = 1e-4 keeps those at ~1e-7, where 1e-8
# would allow ~1e-3.
OPTIMIZER = OptimizerConfig(learning_rate=1e-3, warmup_steps=0, total_steps=100, weight_decay=0.1,
                            eps=1e-4, clip_grad_norm=None)


def _lengths(rng: np.random.Generator, low: int, high: int, size) -> np.ndarray:
  return rng.integers(low, high + 1, size)


def _padded(rng: np.random.Generator, lengths: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
  """Random ids in ``[3, VOCAB)`` right-padded with 0 to ``width``, and their 0/1 mask."""
  mask = (np.arange(width) < lengths[..., None]).astype(np.int32)
  ids = rng.integers(3, VOCAB, lengths.shape + (width,)) * mask
  return ids.astype(np.int32), mask


# --------------------------------------------------------------------------- (a) BERT dual encoder

BERT = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.1)


def make_dual_encoder() -> DualEncoder:
  return DualEncoder(BertModel(BERT, rngs=nnx.Rngs(0)), pooling='mean')


def dual_encoder_batch() -> dict[str, np.ndarray]:
  """``B`` queries (``[B, 8]``), each with 1 positive + 2 hard negatives (``[B, 3, 12]``)."""
  rng = np.random.default_rng(1)
  query_tokens, query_mask = _padded(rng, _lengths(rng, 3, 8, BATCH), 8)
  passage_tokens, passage_mask = _padded(rng, _lengths(rng, 4, 12, (BATCH, 3)), 12)
  passage_valid = np.ones((BATCH, 3), np.int32)
  passage_valid[[2, 5], 2] = 0  # two queries have a single hard negative
  return dict(query_tokens=query_tokens, query_mask=query_mask, passage_tokens=passage_tokens,
              passage_mask=passage_mask, passage_valid=passage_valid,
              query_ids=np.array([0, 1, 2, 3, 4, 5, 6, 1], np.int32))  # rows 1 and 7: same question


def contrastive_train_loss(model: DualEncoder, batch: dict, rng: jax.Array | None):
  """RECOMP extractive-compressor loss: cosine / 0.05 InfoNCE with in-batch negatives."""
  train = rng is not None
  rngs = nnx.Rngs(dropout=rng) if train else None
  queries = model.encode_queries(batch['query_tokens'], batch['query_mask'],
                                 deterministic=not train, rngs=rngs)             # [B, D]
  b, p, t = batch['passage_tokens'].shape
  passages = model.encode_passages(batch['passage_tokens'].reshape(b * p, t),
                                   batch['passage_mask'].reshape(b * p, t),
                                   deterministic=not train, rngs=rngs)           # [B * P, D]
  return losses.contrastive_loss(queries, passages.reshape(b, p, -1), batch['passage_valid'],
                                 temperature=0.05, similarity='cosine', query_ids=batch['query_ids'])


# --------------------------------------------------------------------------- (b) T5 v1.1

T5 = t5.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                 num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                 feed_forward_proj='gated-gelu', tie_word_embeddings=False,
                 scale_decoder_outputs=False)


def make_t5() -> t5.T5Model:
  return t5.T5Model(T5, rngs=nnx.Rngs(0))


def t5_batch() -> dict[str, np.ndarray]:
  """Padded inputs ``[B, 12]``; targets ``[B, 7]`` ending in EOS (an EOS-only target included)."""
  rng = np.random.default_rng(2)
  inputs, input_mask = _padded(rng, _lengths(rng, 4, 12, BATCH), 12)
  target_lengths = _lengths(rng, 1, 7, BATCH)
  target_lengths[3] = 1  # "output nothing": RECOMP's selective augmentation
  targets, target_mask = _padded(rng, target_lengths, 7)
  targets[np.arange(BATCH), target_lengths - 1] = T5.eos_token_ids[0]
  decoder_inputs = np.concatenate(
      [np.full((BATCH, 1), T5.decoder_start_token_id, np.int32), targets[:, :-1]], axis=1)
  return dict(inputs=inputs, input_mask=input_mask, decoder_inputs=decoder_inputs, targets=targets,
              target_mask=target_mask)


def seq2seq_train_loss(model: t5.T5Model, batch: dict, rng: jax.Array | None):
  del rng  # T5 has no dropout here
  logits = model(batch['inputs'], batch['input_mask'], batch['decoder_inputs'], batch['target_mask'])
  return losses.seq2seq_loss(logits, batch['targets'], batch['target_mask'], label_smoothing=0.1)


# --------------------------------------------------------------------------- (c) Gemma 3

GEMMA = gemma.GemmaConfig(model_type='gemma3_text', vocab_size=VOCAB, hidden_size=32,
                          intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                          layer_types=(gemma.SLIDING, gemma.SLIDING, gemma.FULL), sliding_window=4,
                          query_pre_attn_scalar=8, max_position_embeddings=64)


def make_gemma() -> gemma.GemmaModel:
  model = gemma.GemmaModel(GEMMA, rngs=nnx.Rngs(0))
  # Hugging Face's initializer_range (0.02) for the tied embedding: with layers.Embed's unit
  # scale the head's initial logits are ~30 and so is the loss, far from a real fine-tune.
  table = model.embedder.embedding
  table.set_value(table[...] * 0.02)
  return model


def gemma_batch() -> dict[str, np.ndarray]:
  """``[B, 16]`` rows: prompt, ``entity: description`` part, summary, right padding."""
  rng = np.random.default_rng(3)
  width = 16
  parts = np.stack([_lengths(rng, 3, 6, BATCH), _lengths(rng, 2, 4, BATCH), _lengths(rng, 2, 5, BATCH)], 1)
  ends = np.cumsum(parts, axis=1)  # [B, 3] end of prompt / knowledge / summary
  tokens, mask = _padded(rng, ends[:, 2], width)
  position = np.arange(width)[None]
  segment_ids = np.where(position < ends[:, :1], losses.PROMPT_SEGMENT,
                         np.where(position < ends[:, 1:2], losses.KNOWLEDGE_SEGMENT,
                                  losses.SUMMARY_SEGMENT)) * mask
  return dict(tokens=tokens, mask=mask, segment_ids=segment_ids.astype(np.int32))


def knowledge_injection_train_loss(model: gemma.GemmaModel, batch: dict, rng: jax.Array | None):
  del rng  # Gemma has no dropout
  logits = model(batch['tokens'], batch['mask'])                                 # [B, T, V]
  return losses.knowledge_injection_loss(logits, batch['tokens'], batch['segment_ids'])


def _scanned(model):
  return model.set_layer_execution(scan_layers=True, remat=True)


# --------------------------------------------------------------------------- cases

MODEL_CASES = [
    EngineCase('bert_dual_encoder_contrastive', make_dual_encoder, contrastive_train_loss,
               dual_encoder_batch),
    EngineCase('t5_v1_1_seq2seq', make_t5, seq2seq_train_loss, t5_batch),
    EngineCase('gemma3_knowledge_injection', make_gemma, knowledge_injection_train_loss, gemma_batch),
    # the same steps with the layers as one lax.scan over stacked, sharded parameters + remat
    EngineCase('t5_v1_1_seq2seq_scanned_remat', lambda: _scanned(make_t5()), seq2seq_train_loss,
               t5_batch),
    EngineCase('gemma3_knowledge_injection_scanned_remat', lambda: _scanned(make_gemma()),
               knowledge_injection_train_loss, gemma_batch),
]

# Parameters whose placement is asserted literally: (case, path) -> expected spec on the 2x2x2 mesh.
# TOWER: the dual encoder's one shared BERT (NNX stores a shared module under one of its names).
TOWER = object()
EXPECTED_SPECS = {
    'bert_dual_encoder_contrastive': {
        (TOWER, 'embeddings', 'word_embeddings', 'embedding'): P('tensor', 'fsdp'),
        (TOWER, 'embeddings', 'position_embeddings', 'embedding'): P(None, 'fsdp'),
        (TOWER, 'layers', 0, 'attn', 'query', 'kernel'): P('fsdp', 'tensor', None),
        (TOWER, 'layers', 0, 'attn', 'query', 'bias'): P('tensor', None),
        (TOWER, 'layers', 0, 'attn', 'out', 'kernel'): P('tensor', None, 'fsdp'),
        (TOWER, 'layers', 1, 'mlp', 'wi', 'kernel'): P('fsdp', 'tensor'),
        (TOWER, 'layers', 1, 'mlp', 'wi', 'bias'): P('tensor'),
        (TOWER, 'layers', 1, 'mlp', 'wo', 'kernel'): P('tensor', 'fsdp'),
        (TOWER, 'layers', 1, 'mlp_norm', 'scale'): P(None),
    },
    't5_v1_1_seq2seq': {
        ('shared', 'embedding'): P('tensor', 'fsdp'),
        ('lm_head', 'kernel'): P('fsdp', 'tensor'),
        ('encoder', 'blocks', 0, 'mlp', 'wi_0', 'kernel'): P('fsdp', 'tensor'),
        ('decoder', 'blocks', 1, 'mlp', 'wo', 'kernel'): P('tensor', 'fsdp'),
        ('decoder', 'blocks', 0, 'cross_attn', 'q', 'kernel'): P('fsdp', 'tensor', None),
        ('decoder', 'relative_bias', 'embedding'): P(None, 'tensor'),
        ('encoder', 'final_norm', 'scale'): P(None),
    },
    'gemma3_knowledge_injection': {
        ('embedder', 'embedding'): P('tensor', 'fsdp'),
        ('layers', 0, 'attn', 'q_proj', 'kernel'): P('fsdp', 'tensor', None),
        ('layers', 0, 'attn', 'k_proj', 'kernel'): P('fsdp', None, None),
        ('layers', 2, 'attn', 'o_proj', 'kernel'): P('tensor', None, 'fsdp'),
        ('layers', 2, 'mlp', 'gate_proj', 'kernel'): P('fsdp', 'tensor'),
        ('layers', 2, 'mlp', 'down_proj', 'kernel'): P('tensor', 'fsdp'),
        ('layers', 1, 'attn', 'q_norm', 'scale'): P(None),
        ('final_norm', 'scale'): P(None),
    },
}


def _get(tree, path):
  for key in path:
    if key is TOWER:
      (key,) = tree  # the shared towers hold a single set of parameters
    tree = tree[key]
  return tree


def _check_batch_metrics(case: EngineCase, metrics: dict) -> None:
  """The step saw the batch as built: token / candidate counts, a near-chance initial loss."""
  batch = case.make_batch()
  loss = float(metrics['loss'])
  if case.name.startswith('bert'):
    # 8 queries x 24 in-batch slots, minus 2 empty slots, minus the other copy's positive for
    # the two rows asking the same question; chance is log(21.75) but cosine / 0.05 is sharp.
    assert float(metrics['num_candidates']) == pytest.approx((8 * 22 - 2) / 8)
    assert 0.5 * np.log(21.75) < loss < 3 * np.log(21.75)
  elif case.name.startswith('t5'):
    assert float(metrics['num_tokens']) == batch['target_mask'].sum()
    assert loss == pytest.approx(np.log(VOCAB), rel=0.1)
  else:
    assert float(metrics['num_tokens']) == (batch['segment_ids'][:, 1:] > 0).sum()
    assert loss == pytest.approx(np.log(VOCAB), rel=0.1)


def _adam(opt_state) -> optax.ScaleByAdamState:
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
  (adam,) = [x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x)]
  return adam


def _one_step(case: EngineCase, mesh) -> dict:
  """Loss, metrics, gradients, new params and the state after one step of ``case`` on ``mesh``."""
  state = train_lib.create_train_state(case.make_model(), OPTIMIZER, mesh, seed=11)
  with sharding.use_mesh(mesh):
    step = train_lib.make_train_step(case.loss_fn, sharding.shardings_of(state),
                                     sharding.batch_sharding(mesh),
                                     grad_accum_steps=case.grad_accum_steps)
    new_state, metrics = step(state, sharding.shard_batch(case.make_batch(), mesh))
  adam = _adam(new_state.opt_state)
  grads = jax.tree.map(lambda mu: np.asarray(mu) / (1.0 - OPTIMIZER.b1), _host(adam.mu))
  return dict(grads=grads, params=_host(new_state.params), metrics=_host(metrics), state=new_state)


# --------------------------------------------------------------------------- multi-device

if jax.device_count() < NUM_DEVICES:

  def test_multidevice_suite_in_subprocess():
    """Runs ``TestRealModelsMultiDevice`` with 8 fake CPU devices in a fresh interpreter."""
    run_with_fake_devices(__file__, 'TestRealModelsMultiDevice')

else:

  class TestRealModelsMultiDevice:
    """Needs ``jax.device_count() >= 8``."""

    @pytest.fixture(scope='class')
    def mesh(self):
      return sharding.make_mesh(2, 2, 2, devices=jax.devices()[:NUM_DEVICES])

    @pytest.fixture(scope='class')
    def single(self):
      return sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])

    @pytest.mark.parametrize('case', MODEL_CASES, ids=lambda c: c.name)
    def test_train_step_matches_single_device(self, case, mesh, single):
      one, many = _one_step(case, single), _one_step(case, mesh)
      for name in ('loss', 'grad_norm', *(k for k in one['metrics'] if k.startswith('num_'))):
        assert float(many['metrics'][name]) == pytest.approx(float(one['metrics'][name]), abs=1e-5), name
      assert float(many['metrics']['nonfinite']) == 0.0
      _check_batch_metrics(case, one['metrics'])
      assert _max_diff(one['grads'], many['grads']) <= 1e-5
      assert _max_diff(one['params'], many['params']) <= 1e-5
      # not vacuous: nearly every parameter moved by far more than the tolerance (the
      # exceptions have a gradient of 0 in exact arithmetic: BERT's key biases), and those
      # with a clear gradient by about the learning rate (Adam's first step ~ lr * sign(g))
      initial = _host(nnx.to_pure_dict(nnx.state(case.make_model(), nnx.Param)))
      moved = jax.tree.leaves(jax.tree.map(lambda new, old: float(np.max(np.abs(new - old))),
                                           many['params'], initial))
      gradient = jax.tree.leaves(jax.tree.map(lambda g: float(np.max(np.abs(g))), one['grads']))
      assert np.mean(np.array(moved) > 1e-4) >= 0.9, moved
      assert all(m > 0.5 * OPTIMIZER.learning_rate for m, g in zip(moved, gradient)
                 if g > 10 * OPTIMIZER.eps), (moved, gradient)

      # parameters and both Adam moments are sharded as the logical-axis rules say ...
      abstract = nnx.state(nnx.eval_shape(case.make_model), nnx.Param)
      expected = jax.tree.map(lambda s: s.spec, nnx.to_pure_dict(sharding.state_shardings(abstract, mesh)))
      state = many['state']
      specs = jax.tree.map(lambda x: x.sharding.spec, state.params)
      adam = _adam(state.opt_state)
      assert specs == expected
      assert jax.tree.map(lambda x: x.sharding.spec, adam.mu) == expected
      assert jax.tree.map(lambda x: x.sharding.spec, adam.nu) == expected
      # ... which, spelled out, split mlp / heads / vocab over 'tensor' and embed over 'fsdp'
      for path, spec in EXPECTED_SPECS[case.name.removesuffix('_scanned_remat')].items():
        assert _get(specs, path) == spec, path
        array = _get(state.params, path)
        split = [mesh.shape[axis] if axis else 1 for axis in spec]
        assert {s.data.shape for s in array.addressable_shards} == {
            tuple(d // k for d, k in zip(array.shape, split))}, path
