"""Prompt-masked causal-LM and seq2seq fine-tuning recipes on tiny random Gemma and T5 models.

Loss on target tokens only (checked position by position), equal to a float64 NumPy
reference computed from the same logits, and falling when trained.
"""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from recomp_jax.models import gemma, t5
from recomp_jax.training import loop as train_lib
from recomp_jax.training import recipes
from tests.tiny_models import char_tokenizer

VOCAB = 128
PROMPTS = ['summarise: the cat sat on the mat. question: who sat?', 'q: 2+2?', 'a long prompt ' * 6]
TARGETS = ['the cat', '4', '']  # the empty target: say nothing (selective augmentation)


def _reference_nll(logits: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> float:
  logits = logits.astype(np.float64)
  log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  return float(((log_z - picked) * mask).sum() / mask.sum())


def _gemma():
  config = gemma.GemmaConfig(model_type='gemma3_text', vocab_size=VOCAB, hidden_size=32,
                             intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                             layer_types=(gemma.SLIDING, gemma.FULL), sliding_window=8,
                             query_pre_attn_scalar=16, max_position_embeddings=256)
  model = gemma.GemmaModel(config, rngs=nnx.Rngs(0))
  table = model.embedder.embedding
  table.set_value(table[...] * 0.02)
  return model


def _t5():
  config = t5.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                       num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                       feed_forward_proj='gated-gelu', tie_word_embeddings=False,
                       scale_decoder_outputs=False, pad_token_id=0, eos_token_id=1,
                       decoder_start_token_id=0)
  return t5.T5Model(config, rngs=nnx.Rngs(0))


def test_causal_lm_arrays_mask_exactly_the_target_and_eos():
  tok = char_tokenizer(VOCAB)
  report = recipes.TruncationReport()
  a = recipes.causal_lm_arrays(tok, PROMPTS, TARGETS, max_length=64, report=report)
  assert a['input_ids'].shape == (3, 64)  # 86 tokens of the long prompt are cut to 64 (bucket 64)
  assert report.prompts_truncated == 1 and report.targets_truncated == 0
  for i, (prompt, target) in enumerate(zip(PROMPTS, TARGETS)):
    predicted = a['targets'][i][a['loss_mask'][i] > 0]
    assert tok.decode(predicted[:-1].tolist()) == target and predicted[-1] == tok.eos_token_id
  row = a['input_ids'][0]
  assert row[0] == tok.bos_token_id and tok.decode(row[1:1 + len(PROMPTS[0])].tolist()) == PROMPTS[0]
  assert a['loss_mask'][2].sum() == 1  # empty target: only EOS is learnt
  # The long prompt lost its beginning, not its end; BOS and EOS are kept.
  long_row = a['input_ids'][2][a['attention_mask'][2] > 0]
  assert long_row[0] == tok.bos_token_id and long_row[-1] == tok.eos_token_id
  assert tok.decode(long_row[1:-1].tolist()) == PROMPTS[2][-62:]


def test_causal_lm_arrays_cut_targets_to_max_target_length_and_keep_the_head_narrow():
  """``max_target_length`` bounds target + EOS as in seq2seq_arrays; the head's slots ``A``
  follow the longest target, so one long target would otherwise widen every row's head."""
  tok = char_tokenizer(VOCAB)
  targets = ['a' * 5, 'b' * 200, '']  # one 200-token target among short ones
  wide = recipes.causal_lm_arrays(tok, ['q1', 'q2', 'q3'], targets, max_length=400)
  assert wide['target_ids'].shape[1] == 256
  report = recipes.TruncationReport()
  for pack in (False, True):
    a = recipes.causal_lm_arrays(tok, ['q1', 'q2', 'q3'], targets, max_length=400, max_target_length=16,
                                 report=report, pack=pack)
    assert a['target_ids'].shape[1] == 16
    learnt = [a['target_ids'][r][a['target_mask'][r] > 0].tolist() for r in range(a['target_ids'].shape[0])]
    flat = [t for row in learnt for t in row]
    assert flat.count(tok.eos_token_id) == 3  # every target still ends with EOS
    assert tok.decode([t for t in flat if t != tok.eos_token_id]) == 'a' * 5 + 'b' * 15  # the long one cut to 15 + EOS
  assert report.targets_truncated == 2 and report.prompts_truncated == 0


def test_causal_lm_loss_matches_float64_reference_and_ignores_the_prompt():
  tok = char_tokenizer(VOCAB)
  model = _gemma()
  a = recipes.causal_lm_arrays(tok, PROMPTS, TARGETS, max_length=96)
  loss, metrics = recipes.causal_lm_loss_fn()(model, a, None)
  logits = np.asarray(model(a['input_ids'], a['attention_mask']))
  assert float(loss) == pytest.approx(_reference_nll(logits, a['targets'], a['loss_mask']), rel=1e-5)
  assert float(metrics['num_tokens']) == a['loss_mask'].sum() == len('the cat') + 1 + 2 + 1
  # Changing what the prompt positions would predict changes nothing.
  other = dict(a, targets=np.where(a['loss_mask'] > 0, a['targets'], 5).astype(np.int32))
  full_head = recipes.causal_lm_loss_fn(head_on_targets_only=False)
  assert float(full_head(model, other, None)[0]) == pytest.approx(float(loss), rel=1e-6)
  # The compact targets are exactly the masked ones, in order.
  for i in range(len(PROMPTS)):
    positions = a['target_positions'][i][a['target_mask'][i] > 0]
    np.testing.assert_array_equal(positions, np.flatnonzero(a['loss_mask'][i]))
    np.testing.assert_array_equal(a['target_ids'][i][:len(positions)], a['targets'][i][positions])


def test_head_on_target_positions_only_gives_the_full_heads_gradients():
  tok = char_tokenizer(VOCAB)
  model = _gemma()
  a = recipes.causal_lm_arrays(tok, PROMPTS, TARGETS, max_length=96)

  def grads(loss_fn):
    return nnx.grad(lambda m: loss_fn(m, a, None)[0])(model)

  compact, full = grads(recipes.causal_lm_loss_fn()), grads(recipes.causal_lm_loss_fn(head_on_targets_only=False))
  for x, y in zip(jax.tree.leaves(compact), jax.tree.leaves(full)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-4, atol=1e-6)


def test_pack_first_fit_keeps_order_and_fills_earlier_rows():
  assert recipes.pack_first_fit([5, 4, 3, 2, 6], 8) == [[0, 2], [1, 3], [4]]
  # A row also holds at most target_width target tokens: 2 no longer joins 0.
  assert recipes.pack_first_fit([5, 4, 3, 2, 6], 8, [3, 1, 2, 1, 1], 4) == [[0, 3], [1, 2], [4]]
  with pytest.raises(ValueError, match='sequence 1 has 9 tokens'):
    recipes.pack_first_fit([3, 9], 8)


def _first_fit_by_scanning(lengths, width, targets, target_width):
  """First fit by its definition: each sequence goes to the first row with room."""
  rows, room = [], []
  for i, (n, a) in enumerate(zip(lengths, targets)):
    for r, (free, free_targets) in enumerate(room):
      if n <= free and a <= free_targets:
        rows[r].append(i)
        room[r] = (free - n, free_targets - a)
        break
    else:
      rows.append([i])
      room.append((width - n, target_width - a))
  return rows


@pytest.mark.parametrize('seed', range(4))
def test_pack_first_fit_matches_a_scan_of_every_row(seed):
  """The max-tree search finds the row a scan of every row finds, in both dimensions
  (targets uncorrelated with lengths, so subtrees often have room in one but not both)."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, 257, size=600).tolist()
  targets = rng.integers(1, 33, size=600).tolist()
  assert (recipes.pack_first_fit(lengths, 256, targets, 32)
          == _first_fit_by_scanning(lengths, 256, targets, 32))
  assert recipes.pack_first_fit(lengths, 256) == _first_fit_by_scanning(lengths, 256, [0] * 600, 0)


def test_packed_rows_give_the_unpacked_loss_and_gradients():
  """Packing six examples into fewer rows changes the shapes, not the token-mean loss or
  its gradients; each row's compact targets are its segments' targets in order."""
  tok = char_tokenizer(VOCAB)
  model = _gemma()
  prompts_ = PROMPTS[:2] + ['q: 3+3?', 'question: who wrote it?'] + PROMPTS[:2]
  targets = TARGETS[:2] + ['6', 'she did'] + ['', 'four']
  plain = recipes.causal_lm_arrays(tok, prompts_, targets, max_length=96)
  packed = recipes.causal_lm_arrays(tok, prompts_, targets, max_length=96, pack=True)
  assert plain['input_ids'].shape == (6, 64) and packed['input_ids'].shape == (5, 64)
  # Rows hold as many target tokens as one pair alone does (8): the head costs no more per row.
  assert packed['target_ids'].shape == (5, 8) and plain['target_ids'].shape == (6, 8)
  assert packed['segment_ids'].max() == 2 and packed['attention_mask'].sum() == plain['attention_mask'].sum()
  assert packed['loss_mask'].sum() == plain['loss_mask'].sum() == packed['target_mask'].sum()
  for r in range(5):
    positions = packed['target_positions'][r][packed['target_mask'][r] > 0]
    np.testing.assert_array_equal(positions, np.flatnonzero(packed['loss_mask'][r]))
  for head_only in (True, False):
    loss_fn = recipes.causal_lm_loss_fn(head_on_targets_only=head_only)
    loss_plain, loss_packed = float(loss_fn(model, plain, None)[0]), float(loss_fn(model, packed, None)[0])
    assert loss_packed == pytest.approx(loss_plain, rel=1e-5)
  loss_fn = recipes.causal_lm_loss_fn()
  g_plain = nnx.grad(lambda m: loss_fn(m, plain, None)[0])(model)
  g_packed = nnx.grad(lambda m: loss_fn(m, packed, None)[0])(model)
  for x, y in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_packed)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=2e-4, atol=1e-6)
  # Without the segment ids the rows' later examples would read their neighbours.
  leaky = {k: v for k, v in packed.items() if k != 'segment_ids'}
  assert abs(float(loss_fn(model, leaky, None)[0]) - float(loss_fn(model, packed, None)[0])) > 1e-4


def test_seq2seq_loss_matches_float64_reference():
  tok = char_tokenizer(VOCAB, seq2seq=True)
  model = _t5()
  report = recipes.TruncationReport()
  a = recipes.seq2seq_arrays(tok, PROMPTS, TARGETS, max_source_length=48, max_target_length=16,
                             decoder_start_id=0, report=report)
  assert report.prompts_truncated == 2 and a['input_ids'].shape[1] == 48
  assert a['loss_mask'].sum(1).tolist() == [len('the cat') + 1, 2, 1]
  assert (a['decoder_input_ids'][:, 0] == 0).all() and (a['decoder_input_ids'][0, 1:8] == a['targets'][0, :7]).all()
  loss, _ = recipes.seq2seq_loss_fn()(model, a, None)
  logits = np.asarray(model(a['input_ids'], a['attention_mask'], a['decoder_input_ids'],
                            a['loss_mask'].astype(np.int32)))
  assert float(loss) == pytest.approx(_reference_nll(logits, a['targets'], a['loss_mask']), rel=1e-5)


@pytest.mark.parametrize('kind', ['causal', 'seq2seq'])
def test_recipe_loss_falls_when_trained(tmp_path, kind):
  prompts_ = [f'question {i}: what is {i} plus one?' for i in range(8)]
  targets = [f'{i + 1}' for i in range(8)]
  if kind == 'causal':
    tok, model = char_tokenizer(VOCAB), _gemma()
    arrays = recipes.causal_lm_arrays(tok, prompts_, targets, max_length=64)
    loss_fn = recipes.causal_lm_loss_fn()
  else:
    tok, model = char_tokenizer(VOCAB, seq2seq=True), _t5()
    arrays = recipes.seq2seq_arrays(tok, prompts_, targets, max_source_length=48, max_target_length=8,
                                    decoder_start_id=0)
    loss_fn = recipes.seq2seq_loss_fn()
  first = float(loss_fn(model, jax.tree.map(np.asarray, arrays), None)[0])
  config = {'num_steps': 40, 'log_every': 40, 'checkpoint_every': 0, 'progress_bar': False,
            'optimizer': {'learning_rate': 3e-3, 'warmup_steps': 2}}
  result = train_lib.train(config, model, loss_fn, train_lib.ArrayIterator(arrays, 8, seed=0),
                           workdir=str(tmp_path))
  last = float(loss_fn(result.state.model(), arrays, None)[0])
  assert last < 0.5 * first, (first, last)


@pytest.mark.parametrize('section_epochs, steps', [(-1.0, 2), (3.0, 6)])
def test_finetune_section_epochs_override_train_epochs(tmp_path, section_epochs, steps):
  """A model section's own ``epochs`` (FILCO's filter model) replaces ``train.epochs`` for it alone."""
  from recomp_jax.pipelines.filco import default_config as filco_config
  from recomp_jax.training import finetune
  config = filco_config()
  config.train.batch_size, config.train.epochs, config.train.warmup_steps = 4, 1.0, 0
  config.train.checkpoint_every, config.train.log_every = 0, 100
  section = config.filter
  section.update(max_source_length=48, max_target_length=8, pack=False, microbatch=2, epochs=section_epochs)
  pairs = [(f'question {i}: what is {i} plus one?', f'{i + 1}') for i in range(8)]  # 8 rows, batch 4
  summary, _ = finetune.finetune(config, section, _gemma(), char_tokenizer(VOCAB), pairs, [], seed=0,
                                 directory=str(tmp_path), export=lambda model: None)
  assert summary['steps'] == steps
  assert summary['batch_size'] == 4


def test_read_evaluations_orders_by_step_and_keeps_a_reevaluated_steps_last_record(tmp_path):
  """A resumed fine-tune appends to the same file: a step evaluated twice keeps its later record."""
  from recomp_jax.training import finetune
  path = tmp_path / 'evaluations.jsonl'
  assert finetune.read_evaluations(str(path)) == []
  records = [{'step': 25, 'metrics': {'loss': 0.09}, 'seconds': {}},
             {'step': 50, 'metrics': {'loss': 0.08}, 'seconds': {}},
             {'step': 25, 'metrics': {'loss': 0.07}, 'seconds': {}}]
  path.write_text(''.join(json.dumps(r) + '\n' for r in records) + '{"step": 75, "metr')  # killed mid-write
  assert [(e['step'], e['metrics']['loss']) for e in finetune.read_evaluations(str(path))] == [(25, 0.07), (50, 0.08)]
