"""Reader scoring: target log-likelihoods against HF PyTorch, the chunked head, the shared-prefix
cache path, 1-vs-8-device parity, and exact-match scoring.

Tiny random models (Gemma 3 with a sliding window of 8 and prompts longer than it; T5 v1.0
and v1.1) are saved by transformers and loaded through ``load_pretrained``; a character-level
fast tokenizer makes every string boundary a token boundary. References are HF's teacher-forced
``log_softmax`` of each example alone (no padding), gathered at the target positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from recomp_jax import sharding
from recomp_jax.models import gemma, t5
from recomp_jax.pretrained import load_pretrained
from recomp_jax.reader import Reader, scoring
from recomp_jax.reader.prompts import FEW_SHOT_PREFIX, build_prompt

import tiny_models  # noqa: E402  (tests/ is on sys.path under pytest)
from multidevice import NUM_DEVICES, run_with_fake_devices  # noqa: E402

import torch
import transformers
VOCAB = 128
WINDOW = 8
TOL = 1e-4

CONTEXTS = ['Question: who?\nAnswer:', 'ab', 'The quick brown fox jumps over it.\nAnswer:',
            'x', 'Hello there, general', 'Q: where is the moon?\nA:']
TARGETS = [' Paris', ' c', ' yes', ' no way', '!', ' up there']
PREFIX = 'who is it?\nAnswer: me\n\n'  # 22 characters + BOS: longer than the window
SUFFIXES = ['Title: some evidence.\n\nwhere?\nAnswer:', '', 'short\nAnswer:',
            'a slightly longer piece of evidence text\nAnswer:', 'q\nAnswer:', 'z']


def _char_tokenizer(seq2seq: bool = False):
  return tiny_models.char_tokenizer(VOCAB, seq2seq=seq2seq)


def _randomize(model, scale: float = 0.3):
  """Weights large enough for peaked, input-dependent distributions."""
  torch.manual_seed(0)
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(0.0, 0.2 if 'norm' in name else scale)
  return model


@pytest.fixture(scope='module')
def gemma_pair(tmp_path_factory):
  """(HF Gemma3ForCausalLM, our GemmaModel loaded from its save_pretrained directory)."""
  sliding, full = gemma.SLIDING, gemma.FULL
  torch.manual_seed(0)
  config = transformers.Gemma3TextConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, head_dim=16,
      num_hidden_layers=4, num_key_value_heads=2, sliding_window=WINDOW, query_pre_attn_scalar=16,
      layer_types=[sliding, sliding, full, sliding], final_logit_softcapping=5.0,
      rope_parameters={sliding: {'rope_type': 'default', 'rope_theta': 100.0},
                       full: {'rope_type': 'default', 'rope_theta': 10000.0}},
      attn_implementation='eager')
  hf = _randomize(transformers.Gemma3ForCausalLM(config).eval())
  directory = str(tmp_path_factory.mktemp('gemma3_scoring'))
  hf.save_pretrained(directory)
  return hf, load_pretrained(directory).model


@pytest.fixture(scope='module', params=['v1_0', 'v1_1'])
def t5_pair(request, tmp_path_factory):
  """(HF T5ForConditionalGeneration, ours): v1.0 = relu, tied and scaled head; v1.1 = gated, untied."""
  relu = request.param == 'v1_0'
  torch.manual_seed(1)
  config = transformers.T5Config(
      vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
      relative_attention_num_buckets=8, relative_attention_max_distance=16,
      feed_forward_proj='relu' if relu else 'gated-gelu', tie_word_embeddings=relu,
      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
  hf = transformers.T5ForConditionalGeneration(config).eval()
  if not relu:
    hf.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 32) * 32 ** -0.5)
  _randomize(hf, 0.2)
  directory = str(tmp_path_factory.mktemp(f't5_scoring_{request.param}'))
  hf.save_pretrained(directory)
  ours = load_pretrained(directory).model
  assert (ours.lm_head is None) == relu
  return hf, ours


def _hf_causal(hf, context_ids, target_ids) -> list[np.ndarray]:
  """Per example, alone: log_softmax of HF's logits gathered at the target tokens."""
  out = []
  for c, t in zip(context_ids, target_ids):
    ids = torch.tensor([list(c) + list(t)])
    with torch.no_grad():
      log_p = torch.log_softmax(hf(ids).logits[0].double(), dim=-1).numpy()
    out.append(np.array([log_p[len(c) - 1 + k, tok] for k, tok in enumerate(t)]))
  return out


def _assert_scores(scores: scoring.Scores, reference: list[np.ndarray]):
  np.testing.assert_array_equal(scores.num_tokens, [len(r) for r in reference])
  for ours, ref in zip(scores.token_log_probs, reference):
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)
  np.testing.assert_allclose(scores.total, [r.sum() for r in reference], atol=TOL, rtol=0)


# ----------------------------------------------------------------------------- chunked head


def test_chunked_head_equals_full_head(gemma_pair, t5_pair):
  """Chunk sizes dividing V, leaving a remainder, and larger than V; soft-cap, tied/untied, scaled."""
  rng = np.random.default_rng(0)
  for model, dim in ((gemma_pair[1], 32), (t5_pair[1], 32)):
    hidden = jnp.asarray(rng.normal(size=(2, 3, dim)) * 3.0, jnp.float32)
    targets = jnp.asarray(rng.integers(0, VOCAB, size=(2, 3)), jnp.int32)
    full = jax.nn.log_softmax(model.logits(hidden).astype(jnp.float32), axis=-1)
    ref = np.asarray(jnp.take_along_axis(full, targets[..., None], axis=-1)[..., 0])
    assert ref.std() > 0.5  # peaked, varied distributions: the comparison is not vacuous
    head = scoring.output_head(model)
    for chunk in (16, 48, 128, 1000):
      ours = np.asarray(scoring.target_log_probs(hidden, targets, head, vocab_chunk=chunk))
      np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)


def test_gemma_softcap_is_applied_per_chunk(gemma_pair):
  """Without the soft-cap inside the chunks the result differs (the test can fail)."""
  model = gemma_pair[1]
  hidden = jnp.asarray(np.random.default_rng(1).normal(size=(1, 2, 32)) * 3.0, jnp.float32)
  targets = jnp.asarray([[5, 9]], jnp.int32)
  head = scoring.output_head(model)
  assert head.softcap == 5.0
  capped = scoring.target_log_probs(hidden, targets, head, vocab_chunk=32)
  uncapped = scoring.target_log_probs(hidden, targets, dataclasses.replace(head, softcap=None),
                                      vocab_chunk=32)
  assert float(jnp.max(jnp.abs(capped - uncapped))) > 0.1


# ----------------------------------------------------------------------------- causal


def test_causal_scores_match_hf(gemma_pair):
  hf, model = gemma_pair
  tokenizer = _char_tokenizer()
  scorer = scoring.CausalScorer(model, tokenizer, batch_size=4)
  scores = scorer.score_details(CONTEXTS, TARGETS)
  context_ids = tokenizer(CONTEXTS)['input_ids']
  assert max(len(c) for c in context_ids) > 3 * WINDOW  # sliding layers really slide
  target_ids = tokenizer(TARGETS, add_special_tokens=False)['input_ids']
  reference = _hf_causal(hf, context_ids, target_ids)
  _assert_scores(scores, reference)
  assert np.ptp(scores.total) > 1.0
  np.testing.assert_allclose(scorer.score(CONTEXTS, TARGETS, reduction='mean'),
                             [r.mean() for r in reference], atol=TOL, rtol=0)
  # an example's score does not depend on its batch mates or the batch size
  alone = scoring.CausalScorer(model, tokenizer, batch_size=1).score(CONTEXTS[2:3], TARGETS[2:3])
  np.testing.assert_allclose(alone, scores.total[2:3], atol=1e-5, rtol=0)


def test_shared_prefix_equals_full_strings_and_hf(gemma_pair, monkeypatch):
  hf, model = gemma_pair
  tokenizer = _char_tokenizer()
  calls = []
  encode = scoring._prefix_jit
  monkeypatch.setattr(scoring, '_prefix_jit', lambda *a, **k: calls.append(1) or encode(*a, **k))
  scorer = scoring.CausalScorer(model, tokenizer, batch_size=4)
  targets = TARGETS
  shared = scorer.score_details_with_shared_prefix(PREFIX, SUFFIXES, targets)
  assert calls == [1]  # two candidate batches, one prefix encoding
  full = scorer.score_details([PREFIX + s for s in SUFFIXES], targets)
  np.testing.assert_allclose(shared.total, full.total, atol=TOL, rtol=0)
  np.testing.assert_array_equal(shared.num_tokens, full.num_tokens)
  context_ids = tokenizer([PREFIX + s for s in SUFFIXES])['input_ids']
  assert max(len(c) for c in context_ids) > 8 * WINDOW
  reference = _hf_causal(hf, context_ids, tokenizer(targets, add_special_tokens=False)['input_ids'])
  _assert_scores(shared, reference)


def test_many_prefixes_equal_full_strings_and_hf(gemma_pair, monkeypatch):
  """Ragged groups (1, 6 > batch_size and 3 candidates; prefixes of different lengths, one
  longer than the window) give each candidate the score of its full string."""
  hf, model = gemma_pair
  tokenizer = _char_tokenizer()
  calls, rows = [], []
  encode, continue_ = scoring._prefix_jit, scoring._continuation_jit
  monkeypatch.setattr(scoring, '_prefix_jit', lambda *a, **k: calls.append(a[2].shape) or encode(*a, **k))
  monkeypatch.setattr(scoring, '_continuation_jit',
                      lambda *a, **k: rows.append(a[3]['input_ids'].shape) or continue_(*a, **k))
  prefixes = [PREFIX, 'ab', 'Q: where is the moon?\nA:']
  owners = [1, 0, 2, 0, 0, 2, 0, 0, 2, 0]
  suffixes = ['', 'x', ' the', '', 'q\nA:', '', 'zz', ' ok', '?', '']
  targets = [' c', ' me', ' up', ' you', ' no', ' there', ' yes', ' fine', ' no', '']
  scorer = scoring.CausalScorer(model, tokenizer, batch_size=4)
  prefix_ids = tokenizer(prefixes)['input_ids']
  grouped = scorer.score_ids_with_prefixes(prefix_ids, owners,
                                           tokenizer(suffixes, add_special_tokens=False)['input_ids'],
                                           tokenizer(targets, add_special_tokens=False)['input_ids'])
  # One window of 3 prefixes (4 slots), prefilled once; its 10 candidates, longest first, in
  # 3 calls of 4 rows whatever prefix each row continues.
  assert [shape[0] for shape in calls] == [4] and [shape[0] for shape in rows] == [4, 4, 4]
  assert [shape[1] for shape in rows] == sorted((shape[1] for shape in rows), reverse=True)
  full = scorer.score_details([prefixes[g] + a for g, a in zip(owners, suffixes)], targets)
  np.testing.assert_allclose(grouped.total, full.total, atol=TOL, rtol=0)
  np.testing.assert_array_equal(grouped.num_tokens, full.num_tokens)
  assert grouped.num_tokens[-1] == 0 and grouped.total[-1] == 0.0
  assert np.ptp(grouped.total) > 1.0
  reference = _hf_causal(hf, tokenizer([prefixes[g] + a for g, a in zip(owners, suffixes)])['input_ids'],
                         tokenizer(targets, add_special_tokens=False)['input_ids'])
  _assert_scores(grouped, reference)
  # two candidates per prefix: two prefixes share a call
  calls.clear()
  pairs = scorer.score_ids_with_prefixes(prefix_ids, [0, 1, 1, 2], [[], [], [], []],
                                         tokenizer(TARGETS[:4], add_special_tokens=False)['input_ids'])
  assert [shape[0] for shape in calls] == [4]  # 3 prefixes (4 slots) in one call
  np.testing.assert_allclose(pairs.total, scorer.score([prefixes[g] for g in (0, 1, 1, 2)], TARGETS[:4]),
                             atol=TOL, rtol=0)
  with pytest.raises(ValueError, match='owners must index'):
    scorer.score_ids_with_prefixes(prefix_ids, [3], [[]], [[5]])


@pytest.mark.parametrize('prefill_chunk,cache_bytes', [(None, None), (16, None), (None, 1)])
def test_queries_after_one_prefix_equal_full_strings_and_hf(gemma_pair, monkeypatch, prefill_chunk, cache_bytes):
  """Corpus-in-context scoring: one long prefix (several windows), ragged queries (5 > batch_size,
  so two windows of queries), each with its own candidates; every candidate equals its full
  string, the prefix is prefilled once and each query once. ``prefill_chunk=16``: the prefix
  prefilled 16 tokens at a time (a long corpus's path), the rings holding the query slack.
  ``cache_bytes=1``: no row's cache fits the budget, so one row per call (a 32k corpus's path)."""
  hf, model = gemma_pair
  if cache_bytes:
    monkeypatch.setattr(scoring, 'CONTINUATION_CACHE_BYTES', cache_bytes)
  if prefill_chunk:
    from recomp_jax.models import gemma
    monkeypatch.setattr(gemma, 'PREFILL_CHUNK', prefill_chunk)
    jax.clear_caches()  # the chunk is read at trace time: no compiled prefix of the other size
  tokenizer = _char_tokenizer()
  prefixes, extends = [], []
  encode, extend = scoring._slack_prefix_jit, scoring._extend_jit
  monkeypatch.setattr(scoring, '_slack_prefix_jit', lambda *a, **k: prefixes.append(a[2].shape) or encode(*a, **k))
  monkeypatch.setattr(scoring, '_extend_jit', lambda *a, **k: extends.append(a[3].shape) or extend(*a, **k))
  corpus = 'ID: 0 | a cat. END 0\nID: 1 | the moon is far. END 1\nID: 2 | dogs bark. END 2\n'
  queries = ['q: moon?\n', 'q: a pet that barks\nanswer ', 'x', 'q: cats\n', 'q: where is it, the moon?\n']
  owners = [0, 0, 0, 1, 1, 2, 3, 3, 3, 4, 4, 4, 4]
  targets = ['ID: 0', 'ID: 1', 'ID: 2', 'ID: 1', 'ID: 2', ' no', 'ID: 0', 'ID: 1', 'ID: 22', 'ID: 0', 'ID: 1',
             'ID: 2', '']
  scorer = scoring.CausalScorer(model, tokenizer, batch_size=4)
  prefix_ids = tokenizer([corpus])['input_ids'][0]
  assert len(prefix_ids) > 4 * WINDOW
  got = scorer.score_ids_after_queries(prefix_ids, tokenizer(queries, add_special_tokens=False)['input_ids'], owners,
                                       tokenizer(targets, add_special_tokens=False)['input_ids'])
  assert len(prefixes) == 1 and [shape[0] for shape in extends] == ([1] * 5 if cache_bytes else [4, 1])
  assert scorer.rows_within_cache_budget(10_000, 16) == (1 if cache_bytes else 4)
  full = scorer.score_details([corpus + queries[g] for g in owners], targets)
  np.testing.assert_allclose(got.total, full.total, atol=TOL, rtol=0)
  np.testing.assert_array_equal(got.num_tokens, full.num_tokens)
  assert got.total[-1] == 0.0 and np.ptp(got.total[:-1]) > 1.0
  reference = _hf_causal(hf, tokenizer([corpus + queries[g] for g in owners])['input_ids'],
                         tokenizer(targets, add_special_tokens=False)['input_ids'])
  _assert_scores(got, reference)
  with pytest.raises(ValueError, match='owners must index'):
    scorer.score_ids_after_queries(prefix_ids, [[5]], [1], [[5]])

def test_prefix_slots_are_powers_of_two():
  assert [scoring.prefix_slots(n, 16) for n in (1, 2, 3, 5, 9, 17)] == [1, 2, 4, 8, 16, 16]


@pytest.mark.parametrize('family', ['gemma', 't5'])
def test_reader_output_loglik_per_prompt_equals_pairs(gemma_pair, t5_pair, family):
  """Whole outputs (EOS included) of several prompts: per prompt (Gemma: each prompt encoded
  once) as on the repeated (prompt, output) pairs; a prompt may have no output."""
  model = gemma_pair[1] if family == 'gemma' else t5_pair[1]
  reader = Reader.from_model(model, _char_tokenizer(seq2seq=family == 't5'), score_batch_size=4)
  prompts_text = [PREFIX, 'ab', 'Q: where is the moon?\nA:']
  outputs = [['', ' me', ' you and me'], [], [' up', '']]
  per_prompt = reader.output_loglik_per_prompt(prompts_text, outputs)
  assert [len(x) for x in per_prompt] == [3, 0, 2]
  pairs = reader.output_loglik([p for p, group in zip(prompts_text, outputs) for _ in group],
                               [o for group in outputs for o in group])
  np.testing.assert_allclose(np.concatenate(per_prompt), pairs, atol=TOL, rtol=0)
  assert np.ptp(pairs) > 0.5
  with pytest.raises(ValueError, match='3 prompts for 2 output lists'):
    reader.output_loglik_per_prompt(prompts_text, outputs[:2])


# ----------------------------------------------------------------------------- seq2seq


@pytest.mark.parametrize('add_eos', [True, False])
def test_seq2seq_scores_match_hf(t5_pair, add_eos):
  hf, model = t5_pair
  tokenizer = _char_tokenizer(seq2seq=True)
  scores = scoring.Seq2SeqScorer(model, tokenizer, batch_size=4, add_eos=add_eos).score_details(
      CONTEXTS, TARGETS)
  reference = []
  for context, target in zip(CONTEXTS, TARGETS):
    enc = tokenizer([context], return_tensors='pt')
    labels = tokenizer(target, add_special_tokens=False)['input_ids'] + ([1] if add_eos else [])
    with torch.no_grad():
      logits = hf(**enc, labels=torch.tensor([labels])).logits[0].double()
    log_p = torch.log_softmax(logits, dim=-1).numpy()
    reference.append(log_p[np.arange(len(labels)), labels])
  _assert_scores(scores, reference)
  assert np.ptp(scores.total) > 1.0


def test_bfloat16_scores_track_float32(gemma_pair, tmp_path):
  hf, model = gemma_pair
  hf.save_pretrained(str(tmp_path))
  bf16 = load_pretrained(str(tmp_path), dtype=jnp.bfloat16,
                                     param_dtype=jnp.bfloat16).model
  tokenizer = _char_tokenizer()
  f32 = scoring.CausalScorer(model, tokenizer, batch_size=4).score(CONTEXTS[:4], TARGETS[:4])
  low = scoring.CausalScorer(bf16, tokenizer, batch_size=4).score(CONTEXTS[:4], TARGETS[:4])
  assert low.dtype == np.float32
  np.testing.assert_allclose(low, f32, atol=0.5, rtol=0.1)


# ----------------------------------------------------------------------------- exact match


def test_reader_exact_match_normalises_and_cuts_at_newline(t5_pair):
  outputs = [' Paris\nQuestion: next', 'The Eiffel Tower.', '\nParis', ' London']
  seen = {}

  def generator(prompts, *, max_new_tokens, stop_strings):
    seen.update(n=len(prompts), max_new_tokens=max_new_tokens, stop=tuple(stop_strings))
    return outputs

  reader = Reader.from_model(t5_pair[1], _char_tokenizer(seq2seq=True))
  reader._generator = generator  # the generator's texts are given; the reader's post-processing is tested
  result = reader.exact_match(['p'] * 4, [['Paris'], ['eiffel tower'], ['Paris'], ['London', 'UK']])
  assert seen == {'n': 4, 'max_new_tokens': 12, 'stop': ('\n',)}
  assert result['predictions'] == ['Paris', 'The Eiffel Tower.', '', 'London']
  np.testing.assert_array_equal(result['em_per_example'], [1, 1, 0, 1])
  assert result['em'] == pytest.approx(75.0) and result['n'] == 4


def test_seq2seq_exact_match_matches_hf_greedy(t5_pair):
  hf, model = t5_pair
  tokenizer = _char_tokenizer(seq2seq=True)
  enc = tokenizer(CONTEXTS[:4], padding=True, return_tensors='pt')
  with torch.no_grad():
    out = hf.generate(**enc, do_sample=False, max_new_tokens=12)
  expected = [tokenizer.decode(row.tolist(), skip_special_tokens=True).split('\n')[0].strip()
              for row in out]
  answers = [[expected[0]], ['not it'], [expected[2].upper() + '.'], ['nope']]
  result = Reader.from_model(model, tokenizer, generate_batch_size=4).exact_match(CONTEXTS[:4], answers)
  assert result['predictions'] == expected
  assert len(set(expected)) > 1 and all(len(e) > 0 for e in expected)
  np.testing.assert_array_equal(result['em_per_example'], [1, 0, 1, 0])  # SQuAD normalisation
  assert result['em'] == pytest.approx(50.0)


# ----------------------------------------------------------------------------- real Gemma 3 270M


def test_real_gemma3_answer_log_likelihood(gemma3_ours, gemma3_torch, gemma3_tokenizer):
  model, tokenizer = gemma3_ours.model, gemma3_tokenizer
  evidence = 'Paris: Paris is the capital and most populous city of France.'
  contexts = [build_prompt('what is the capital of france'),
              build_prompt('what is the capital of france', evidence),
              build_prompt('what is the capital of france', evidence)]
  targets = [' Paris', ' Paris', ' London']
  scorer = scoring.CausalScorer(model, tokenizer, batch_size=4)
  scores = scorer.score_details(contexts, targets)
  context_ids = tokenizer(contexts)['input_ids']
  assert context_ids[0][0] == tokenizer.bos_token_id
  reference = _hf_causal(gemma3_torch, context_ids,
                         tokenizer(targets, add_special_tokens=False)['input_ids'])
  np.testing.assert_array_equal(scores.num_tokens, [len(r) for r in reference])
  np.testing.assert_allclose(scores.total, [r.sum() for r in reference], atol=1e-3, rtol=0)
  assert scores.total[1] > scores.total[2]  # the evidence-supported answer wins
  assert scores.total[1] > -2.0
  # the few-shot block as a shared prefix, the evidence and question as candidates
  suffixes = [c[len(FEW_SHOT_PREFIX):] for c in contexts]
  assert all(c.startswith(FEW_SHOT_PREFIX) for c in contexts)
  shared = scorer.score_with_shared_prefix(FEW_SHOT_PREFIX, suffixes, targets)
  np.testing.assert_allclose(shared, scores.total, atol=1e-3, rtol=0)


# ----------------------------------------------------------------------------- 8 fake devices


def _tiny_gemma(seed: int) -> gemma.GemmaModel:
  config = gemma.GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=3,
                             num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=WINDOW,
                             query_pre_attn_scalar=16, final_logit_softcapping=5.0,
                             layer_types=(gemma.SLIDING, gemma.FULL, gemma.SLIDING))
  return gemma.GemmaModel(config, rngs=nnx.Rngs(seed))


def _tiny_t5(seed: int) -> t5.T5Model:
  config = t5.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                       num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
                       relative_attention_max_distance=16, feed_forward_proj='gated-gelu',
                       tie_word_embeddings=False, scale_decoder_outputs=False)
  return t5.T5Model(config, rngs=nnx.Rngs(seed))


def _ragged(seed: int, n: int, low: int, high: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(3, VOCAB, size=int(rng.integers(low, high + 1))).tolist() for _ in range(n)]


def _all_scores(mesh) -> dict[str, np.ndarray]:
  """Full-string, shared-prefix and seq2seq totals of fixed random token rows (on ``mesh``)."""
  contexts = [[2] + row for row in _ragged(0, 8, 1, 30)]
  targets = _ragged(1, 8, 0, 5)
  suffixes = _ragged(2, 8, 0, 12)
  causal = scoring.CausalScorer(_tiny_gemma(0), batch_size=8, mesh=mesh, vocab_chunk=48)
  seq2seq = scoring.Seq2SeqScorer(_tiny_t5(0), batch_size=8, mesh=mesh, vocab_chunk=48)
  out = {'full': causal.score_ids(contexts, targets).total,
         'prefix': causal.score_ids_with_shared_prefix([2] + list(range(40, 60)), suffixes,
                                                       targets).total,
         'prefixes': causal.score_ids_with_prefixes(contexts[:3], [0, 2, 1, 1, 0, 2, 2, 1], suffixes,
                                                    targets).total,  # 2 prefixes a call: replicated
         'prefixes_split': causal.score_ids_with_prefixes(contexts, list(range(8)), suffixes,
                                                          targets).total,  # 8 a call: split over devices
         'queries': causal.score_ids_after_queries([2] + list(range(40, 70)), [[9] + s for s in suffixes[:5]] + [[7]],
                                                   [0, 1, 2, 3, 4, 5, 5, 0], targets).total,
         'seq2seq': seq2seq.score_ids(contexts, [t + [1] for t in targets]).total}
  if mesh is not None:
    out['embedding_spec'] = causal.model.embedder.embedding.get_value().sharding.spec
  return out


if jax.device_count() < NUM_DEVICES:

  def test_multidevice_in_subprocess():
    """Runs ``TestMultiDevice`` with 8 fake CPU devices in a fresh interpreter."""
    run_with_fake_devices(__file__, 'TestMultiDevice', timeout=600)

else:

  class TestMultiDevice:

    def test_mesh_2x2x2_matches_one_device(self):
      one = _all_scores(None)
      many = _all_scores(sharding.make_mesh(2, 2, 2, devices=jax.devices()[:NUM_DEVICES]))
      assert many.pop('embedding_spec') == P('tensor', 'fsdp')
      for key in one:
        assert np.ptp(one[key]) > 0.5, key
        np.testing.assert_allclose(many[key], one[key], atol=1e-5, rtol=0, err_msg=key)

    def test_batch_size_must_divide_over_the_mesh(self):
      mesh = sharding.make_mesh(2, 2, 2, devices=jax.devices()[:NUM_DEVICES])
      with pytest.raises(ValueError, match='batch shards'):
        scoring.CausalScorer(_tiny_gemma(0), batch_size=6, mesh=mesh)
