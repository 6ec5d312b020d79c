"""The fine-tuning hook: K-COMP's knowledge injection and CoLoR's ORPO through the one
``finetune`` path on a tiny random Gemma, with the tokens that carry loss checked one by one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recomp_jax.pipelines.filco import default_config as filco_config
from recomp_jax.training import finetune, losses, objectives, recipes
from tests.test_recipes import VOCAB, _gemma
from tests.tiny_models import char_tokenizer

# (passages + question with its entity masked, 'entity: description<eom>', summary)
KI = [('doc: aspirin thins blood. q: what does <ent> do?', 'aspirin: a drug;', 'it thins blood'),
      ('doc: flu is a virus. q: is <ent> a virus?', 'flu: an illness;', 'yes, a virus'),
      ('doc: the sun is hot. q: is <ent> hot?', 'sun: a star;', 'very hot')]
# (prompt, chosen = short and right, rejected = long)
PREFS = [('summarise: the cat sat on the mat.', 'cat sat', 'the cat sat on the mat today'),
         ('summarise: rain fell all day.', 'rain', 'it rained and rained all day long'),
         ('summarise: bob ate an apple.', 'bob ate', 'bob, a man, ate an apple at noon')]


def _config(steps: int):
  config = filco_config()
  config.train.update(batch_size=3, num_steps=steps, warmup_steps=0, learning_rate=1e-2, checkpoint_every=0,
                      log_every=100, eval_every=0)
  config.filter.update(max_source_length=64, max_target_length=40, pack=False, microbatch=3)
  return config


def _decode(tok, ids) -> str:
  return tok.decode([int(i) for i in ids])


def test_knowledge_injection_arrays_put_loss_on_knowledge_then_summary_never_the_prompt():
  tok = char_tokenizer(VOCAB)
  a = recipes.segmented_causal_lm_arrays(tok, [p for p, _, _ in KI], [(k, s) for _, k, s in KI], max_length=104)
  for i, (prompt, knowledge, summary) in enumerate(KI):
    seg, ids, pos = a['target_segments'][i], a['target_ids'][i], a['target_positions'][i]
    assert _decode(tok, ids[seg == 1]) == knowledge
    assert _decode(tok, ids[seg == 2][:-1]) == summary and ids[seg == 2][-1] == tok.eos_token_id
    n = int(a['target_mask'][i].sum())
    assert (seg[:n] > 0).all() and (seg[n:] == 0).all()
    row = a['input_ids'][i]
    # position p predicts token p + 1; the first predicted token is the first knowledge token,
    # right after BOS and the whole prompt
    assert pos[0] == len(prompt) and (row[pos[:n] + 1] == ids[:n]).all()
    assert _decode(tok, row[1:pos[0] + 1]) == prompt


def test_knowledge_injection_loss_fn_equals_the_full_sequence_loss():
  tok = char_tokenizer(VOCAB)
  a = recipes.segmented_causal_lm_arrays(tok, [p for p, _, _ in KI], [(k, s) for _, k, s in KI], max_length=104)
  model = _gemma()
  compact, metrics = recipes.knowledge_injection_loss_fn(knowledge_weight=2.0)(model, a, None)
  # the same loss from logits at every position and per-token segment ids
  segment_ids = np.zeros_like(a['input_ids'])
  for i in range(len(KI)):
    n = int(a['target_mask'][i].sum())
    segment_ids[i, a['target_positions'][i, :n] + 1] = a['target_segments'][i, :n]
  full, full_metrics = losses.knowledge_injection_loss(model(a['input_ids'], a['attention_mask']), a['input_ids'],
                                                       segment_ids, knowledge_weight=2.0)
  np.testing.assert_allclose(float(compact), float(full), rtol=1e-5)
  np.testing.assert_allclose(float(metrics['nll_summary']), float(full_metrics['nll_summary']), rtol=1e-5)
  assert float(metrics['num_tokens']) == float(a['target_mask'].sum())


def test_knowledge_injection_fine_tunes_through_the_shared_path(tmp_path):
  tok = char_tokenizer(VOCAB)
  objective = objectives.knowledge_injection()
  config = _config(steps=40)
  model = _gemma()
  arrays = objective.arrays(model, tok, KI, max_source_length=64, max_target_length=40,
                            report=recipes.TruncationReport(), pack=False)
  loss_fn = objective.loss_fn(model)
  before = loss_fn(model, arrays, None)[1]
  summary, trained = finetune.finetune(config, config.filter, model, tok, KI, [], seed=0, directory=str(tmp_path),
                                       export=lambda m: None, objective=objective)
  after = loss_fn(trained, arrays, None)[1]
  assert summary['objective'] == 'knowledge_injection' and summary['steps'] == 40
  assert float(after['nll_knowledge']) < 0.5 * float(before['nll_knowledge'])
  assert float(after['nll_summary']) < 0.5 * float(before['nll_summary'])


def test_preference_arrays_pair_the_chosen_and_rejected_responses_of_one_prompt():
  tok = char_tokenizer(VOCAB)
  a = recipes.preference_arrays(tok, [p for p, _, _ in PREFS], [c for _, c, _ in PREFS],
                                [r for _, _, r in PREFS], max_length=96)
  assert a['input_ids'].shape[:2] == (3, 2) and a['target_ids'].shape[:2] == (3, 2)
  for i, (prompt, chosen, rejected) in enumerate(PREFS):
    for j, response in enumerate((chosen, rejected)):
      ids = a['target_ids'][i, j][a['target_mask'][i, j] > 0]
      assert _decode(tok, ids[:-1]) == response and ids[-1] == tok.eos_token_id
      assert a['target_positions'][i, j, 0] == len(prompt)  # BOS + prompt carry no loss


def test_orpo_loss_fn_equals_orpo_loss_on_full_logits():
  tok = char_tokenizer(VOCAB)
  a = recipes.preference_arrays(tok, [p for p, _, _ in PREFS], [c for _, c, _ in PREFS],
                                [r for _, _, r in PREFS], max_length=96)
  model = _gemma()
  loss, metrics = recipes.orpo_loss_fn(orpo_lambda=2.5)(model, a, None)
  per_response = []
  for j in range(2):
    logits = model(a['input_ids'][:, j], a['attention_mask'][:, j])  # [B, L, V]
    picked = jnp.take_along_axis(logits, a['target_positions'][:, j, :, None], axis=1)
    per_response.append(losses.token_log_probs(picked, a['target_ids'][:, j]))
  ref, ref_metrics = losses.orpo_loss(per_response[0], a['target_mask'][:, 0], per_response[1],
                                      a['target_mask'][:, 1], orpo_lambda=2.5)
  np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
  # The log-odds ratio is a difference of two near-equal float32 log-probabilities, so its
  # relative error is large when it is near zero: compare it on an absolute scale too.
  np.testing.assert_allclose(float(metrics['log_odds_ratio']), float(ref_metrics['log_odds_ratio']),
                             rtol=1e-5, atol=1e-6)
  assert float(metrics[losses.LOSS_WEIGHT]) == 3.0


@pytest.mark.parametrize('length_mode', ['paper', 'released_code'])
def test_orpo_fine_tunes_through_the_shared_path_and_prefers_the_chosen(tmp_path, length_mode):
  tok = char_tokenizer(VOCAB)
  objective = objectives.orpo(orpo_lambda=2.5 if length_mode == 'paper' else 0.1, length_mode=length_mode)
  model = _gemma()
  arrays = objective.arrays(model, tok, PREFS, max_source_length=64, max_target_length=40,
                            report=recipes.TruncationReport(), pack=False)
  loss_fn = objective.loss_fn(model)
  before = jax.tree.map(float, loss_fn(model, arrays, None)[1])
  summary, trained = finetune.finetune(_config(steps=40), _config(steps=40).filter, model, tok, PREFS, [], seed=0,
                                       directory=str(tmp_path), export=lambda m: None, objective=objective)
  after = jax.tree.map(float, loss_fn(trained, arrays, None)[1])
  assert summary['objective'] == f'orpo_{length_mode}'
  assert after['sft'] < 0.5 * before['sft']
  assert after['log_odds_ratio'] > before['log_odds_ratio'] + 1.0
  assert after['preference_accuracy'] == 1.0


def test_an_objective_that_does_not_pack_refuses_pack(tmp_path):
  config = _config(steps=1)
  config.filter.pack = True
  with pytest.raises(ValueError, match='does not pack'):
    finetune.finetune(config, config.filter, _gemma(), char_tokenizer(VOCAB), PREFS, [], seed=0,
                      directory=str(tmp_path), export=lambda m: None, objective=objectives.orpo(orpo_lambda=1.0))


def test_new_token_rows_updates_are_scaled_and_nothing_else_changes():
  """``vocab_rows``: AdamW's update of the listed embedding rows times the scale, the rest as plain AdamW."""
  from flax import nnx
  from recomp_jax.training import optim
  model = _gemma()
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  abstract = nnx.state(model, nnx.Param)
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(p.size), p.shape, p.dtype), params)
  base = optim.OptimizerConfig(learning_rate=1e-3, warmup_steps=0, total_steps=10)
  rows = (5, 100)
  plain, scaled = (optim.make_optimizer(base if s == 1 else optim.OptimizerConfig(
      **{**vars(base), 'vocab_rows': rows, 'vocab_rows_lr_scale': s}), abstract) for s in (1, 30.0))
  for _ in range(2):  # a second step: the multiplier holds with Adam's moments under way
    u_plain, plain_state = plain.update(grads, plain.init(params) if _ == 0 else plain_state, params)
    u_scaled, scaled_state = scaled.update(grads, scaled.init(params) if _ == 0 else scaled_state, params)
  table_plain, table_scaled = (np.asarray(u['embedder']['embedding']) for u in (u_plain, u_scaled))
  np.testing.assert_allclose(table_scaled[list(rows)], 30.0 * table_plain[list(rows)], rtol=1e-6)
  others = np.setdiff1d(np.arange(VOCAB), rows)
  np.testing.assert_array_equal(table_scaled[others], table_plain[others])
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(u_plain), jax.tree_util.tree_leaves_with_path(u_scaled)):
    if 'embedder' not in jax.tree_util.keystr(path):
      np.testing.assert_array_equal(a, b)


def test_finetune_with_new_token_rows_frozen_leaves_them_and_trains_the_rest(tmp_path):
  """Through the shared path: scale 0 keeps the new rows exactly; the summary records the setting."""
  tok = char_tokenizer(VOCAB)
  config = _config(steps=2)
  model = _gemma()
  before = np.asarray(model.embedder.embedding[...])
  new = tuple(tok.convert_tokens_to_ids(['<', '>']))  # rows the batch's text uses: they get gradients
  other = tok.convert_tokens_to_ids('a')
  summary, trained = finetune.finetune(config, config.filter, model, tok, KI, [], seed=0, directory=str(tmp_path),
                                       export=lambda m: None, objective=objectives.knowledge_injection(),
                                       new_tokens=new, new_token_lr_scale=0.0)
  after = np.asarray(trained.embedder.embedding[...])
  np.testing.assert_array_equal(after[list(new)], before[list(new)])
  assert np.abs(after[other] - before[other]).max() > 1e-4
  assert summary['new_token_lr_scale'] == {'tokens': list(new), 'scale': 0.0}
