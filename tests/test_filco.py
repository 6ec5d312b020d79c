"""FILCO's measures and selection rules (paper and released-code variants), checked by hand,
and CXMI with the real Gemma 3 270M reader against HF PyTorch's two log-likelihoods."""

import math

import numpy as np
import pytest

from recomp_jax.compressors import filco
from recomp_jax.data.schema import Passage
from recomp_jax.evaluation import qa_metrics
from recomp_jax.reader import prompts


def test_strinc_paper_matches_whole_normalised_tokens_released_matches_raw_substrings():
  assert filco.strinc("The quarterback Brad Johnson's pass.", ['brad johnson'])
  assert not filco.strinc('The party started at noon.', ['art'])
  assert filco.strinc('The party started at noon.', ['art'], variant='released')
  assert not filco.strinc('Paris is in France.', ['Lyon'], variant='released')
  with pytest.raises(ValueError, match='variant'):
    filco.strinc('x', ['x'], variant='github')


def test_unigram_f1_counts_words_in_the_paper_and_characters_in_the_released_code():
  # words: {cat, sat} vs {cat}: P 1/2, R 1 -> 2/3.
  assert filco.unigram_f1('The cat sat', ['cat']) == pytest.approx(2 / 3)
  # characters of 'cat sat' (7, the space included) vs 'cat' (3): 3 shared, P 3/7, R 1 -> 0.6.
  assert filco.unigram_f1('The cat sat', ['cat'], variant='released') == pytest.approx(0.6)
  assert filco.unigram_f1('act', ['cat']) == 0.0
  assert filco.unigram_f1('act', ['cat'], variant='released') == 1.0
  assert filco.unigram_f1('', ['cat']) == 0.0
  assert filco.unigram_f1('dog cat', ['bird', 'cat']) == pytest.approx(2 / 3)  # the best reference


def test_released_exact_match_keeps_punctuation():
  assert qa_metrics.exact_match('U.S.', ['US']) == 1.0
  assert filco.released_exact_match('U.S.', ['US']) == 0.0
  assert filco.released_exact_match('The U.S.', ['u.s.']) == 1.0


def test_cxmi_is_a_log_ratio_in_the_paper_and_a_sigmoid_of_probability_products_when_released():
  np.testing.assert_allclose(filco.cxmi_from_logliks([-1.0, -3.0], -2.0), [1.0, -1.0])
  released = filco.cxmi_from_logliks([-1.0, -3.0], -2.0, variant='released')
  np.testing.assert_allclose(released, [1 / (1 + math.exp(-1)), 1 / (1 + math.exp(1))])
  # Raw products underflow for a long output: 0/0.
  assert np.isnan(filco.cxmi_from_logliks([-800.0], -800.0, variant='released')[0])
  assert filco.cxmi_from_logliks([-800.0], -801.0)[0] == pytest.approx(1.0)


def test_selection_rules_paper_vs_released():
  sentences = [['a0', 'a1'], ['b0', 'b1']]
  # STRINC: the first passing sentence in rank order vs every passing sentence.
  strinc = [[0, 1], [1, 0]]
  assert filco.select(sentences, strinc, 'strinc') == filco.Selection(((0, 1),), 'a1')
  assert filco.select(sentences, strinc, 'strinc', 'released').text == 'a1 b0'
  # LEXICAL: the best above 0.5 (strictly), else nothing; ties go to the earlier sentence.
  assert filco.select(sentences, [[0.5, 0.2], [0.3, 0.1]], 'lexical').empty
  assert filco.select(sentences, [[0.6, 0.9], [0.9, 0.1]], 'lexical').text == 'a1'
  # CXMI: the best above 0 in log space; the released threshold (>= 0 on a sigmoid) never filters.
  negative = [[-0.5, -2.0], [-0.1, -3.0]]
  assert filco.select(sentences, negative, 'cxmi').empty
  sig = [[1 / (1 + math.exp(-x)) for x in row] for row in negative]
  assert filco.select(sentences, sig, 'cxmi', 'released').text == 'a0 b0'
  assert filco.select(sentences, [[-0.5, 0.2], [0.7, 0.1]], 'cxmi').text == 'b0'
  assert filco.select([[], []], [[], []], 'cxmi').empty
  with pytest.raises(ValueError, match='measure'):
    filco.select(sentences, strinc, 'bleu')


def test_text_scores_canonical_output_and_precision():
  passages = [Passage('1', 'Lyon', 'Lyon is a city. It is not the capital.'),
              Passage('2', 'Paris', 'Paris is the capital of France. It has the Louvre.')]
  assert filco.canonical_output(['Marseille', 'Paris'], passages) == 'Paris'
  assert filco.canonical_output(['Berlin'], passages) == 'Berlin'
  assert filco.canonical_output([], passages) == ''
  sentences = filco.passage_sentences(passages)
  assert sentences == [['Lyon is a city.', 'It is not the capital.'],
                       ['Paris is the capital of France.', 'It has the Louvre.']]
  scores = filco.text_scores(sentences, 'Paris', ['Paris'], 'strinc')
  assert scores == [[0.0, 0.0], [1.0, 0.0]]
  assert filco.select(sentences, scores, 'strinc').text == 'Paris is the capital of France.'
  # Table 3's precision: output words / context words ('the' is dropped by normalisation).
  assert filco.unigram_precision('Paris is the capital of France.', 'Paris') == pytest.approx(1 / 5)
  assert filco.unigram_precision('', 'Paris') == 0.0


def test_fact_verification_lexical_compares_sentences_with_the_claim():
  """FEVER: the output is a label found in no passage, so LEXICAL against the output keeps
  nothing; against the claim (§2.2) it keeps the sentence that restates it."""
  from recomp_jax.data.schema import Example
  from recomp_jax.compressors.filco import silver_records
  claim = 'Nikolaj Coster-Waldau worked with the Fox Broadcasting Company.'
  passage = Passage('1', 'Nikolaj Coster-Waldau', 'He was born in Denmark. Coster-Waldau worked with '
                    'the Fox Broadcasting Company on the series New Amsterdam.')
  example = Example('75397', claim, ['SUPPORTS'], [passage])
  sentences = filco.passage_sentences([passage])
  by_label = filco.text_scores(sentences, 'SUPPORTS', ['SUPPORTS'], 'lexical')
  by_claim = filco.text_scores(sentences, 'SUPPORTS', ['SUPPORTS'], 'lexical', lexical_reference=claim)
  assert by_label == [[0.0, 0.0]]
  # SQuAD normalisation drops 'the' and the hyphen: {costerwaldau, worked, with, fox, broadcasting,
  # company} shared by the sentence's 10 words and the claim's 7: P 6/10, R 6/7.
  assert by_claim[0][0] == 0.0 and by_claim[0][1] == pytest.approx(2 * (6 / 10) * (6 / 7) / (6 / 10 + 6 / 7))
  common = dict(top_docs=1, measure='lexical', variant='paper', threshold=0.5)
  (against_output,) = silver_records(None, [example], **common)
  (against_query,) = silver_records(None, [example], lexical_against='query', **common)
  assert against_output['silver'] == ''
  assert against_query['silver'] == sentences[0][1]
  with pytest.raises(ValueError, match='lexical_against'):
    silver_records(None, [example], lexical_against='label', **common)


def test_generator_pairs_take_the_output_from_the_passages_and_full_needs_no_silver():
  """Every generator's target is the canonical output (the first gold answer found in the top
  passages, else the first gold answer); FULL's pairs are the same with or without silver
  records, so its stage depends on no measure. An example with no answer trains no generator."""
  from recomp_jax.data.schema import Example
  from recomp_jax.compressors.filco import silver_records
  from recomp_jax.pipelines.filco import generator_pairs
  paris = Passage('1', 'France', 'France is in Europe. Its capital is Paris.')
  examples = [Example('q1', 'capital of France?', ['Lutetia', 'Paris'], [paris]),
              Example('q2', 'where is France?', ['Europe'], [Passage('2', 'Maps', 'No answer here.')]),
              Example('q3', 'unanswerable?', [], [paris])]
  silver = {r['id']: r for r in silver_records(None, examples, top_docs=1, measure='strinc', variant='paper',
                                                 threshold=None)}
  full = generator_pairs('full', examples, None, 1)
  assert full == generator_pairs('full', examples, silver, 1)
  assert full == [('France\nFrance is in Europe. Its capital is Paris.\n\ncapital of France?\nAnswer:',
                   ' Paris'),
                  ('Maps\nNo answer here.\n\nwhere is France?\nAnswer:', ' Europe')]
  assert generator_pairs('filco', examples, silver, 1) == [
      ('Its capital is Paris.\n\ncapital of France?\nAnswer:', ' Paris'), ('where is France?\nAnswer:', ' Europe')]


def test_released_variant_lexical_takes_the_best_gold_answer_and_an_empty_context_reads_the_top_passage():
  """The released code (zorazrw/filco): LEXICAL is the best character F1 over every gold answer
  (eval.py calc_unigram_f1), and a generator whose filtered context is empty reads the top-1
  passage's text (get_inputs.py get_example_io -> get_context, one passage, no title)."""
  from recomp_jax.data.schema import Example
  from recomp_jax.compressors.filco import silver_records
  from recomp_jax.pipelines.filco import generator_pairs
  sentences = [['zzzz qqqq.', 'The capital is Lutetia.']]
  # The canonical output 'Paris' is the first answer; the second answer matches the sentence whole.
  paper = filco.text_scores(sentences, 'Paris', ['Paris', 'capital is Lutetia.'], 'lexical', 'paper')
  released = filco.text_scores(sentences, 'Paris', ['Paris', 'capital is Lutetia.'], 'lexical', 'released')
  assert released[0][1] == pytest.approx(max(filco.unigram_f1('The capital is Lutetia.', [a], 'released')
                                             for a in ('Paris', 'capital is Lutetia.')))
  assert released[0][1] > filco.unigram_f1('The capital is Lutetia.', ['Paris'], 'released')
  assert paper[0][1] == filco.unigram_f1('The capital is Lutetia.', ['Paris'], 'paper') == 0.0
  assert filco.filtered_context('', [Passage('1', 'T', 'Top text.'), Passage('2', 'U', 'Next.')], 'released') == 'Top text.'
  assert filco.filtered_context('', [Passage('1', 'T', 'Top text.')], 'paper') == ''
  assert filco.filtered_context('kept', [Passage('1', 'T', 'Top text.')], 'released') == 'kept'
  assert filco.filtered_context('', [], 'released') == ''
  maps = Passage('2', 'Maps', 'No answer here.')
  examples = [Example('q2', 'where is France?', ['Europe'], [maps])]
  silver = {r['id']: r for r in silver_records(None, examples, top_docs=1, measure='strinc', variant='released',
                                                 threshold=None)}
  assert silver['q2']['silver'] == ''
  assert generator_pairs('filco', examples, silver, 1, 'released') == [
      ('No answer here.\n\nwhere is France?\nAnswer:', ' Europe')]
  assert generator_pairs('filco', examples, silver, 1) == [('where is France?\nAnswer:', ' Europe')]


def test_prompts_keep_literal_braces_and_the_generator_reads_context_then_question():
  assert (filco.filter_prompt('q {docs}?', 'P {query}')
          == 'Question: q {docs}?\nPassage: P {query}\nMost helpful sentence:')
  assert filco.generator_prompt('who?', 'ctx') == 'ctx\n\nwho?\nAnswer:'
  assert filco.generator_prompt('who?', '') == 'who?\nAnswer:'


@pytest.mark.slow  # Gemma 3 real-weight parity beyond the one fast test (test_gguf logits)
def test_cxmi_with_the_real_reader_equals_hf_pytorch_log_likelihoods(gemma3_hf_dir, gemma3_torch):
  import torch
  from transformers import AutoTokenizer

  from recomp_jax.reader.reader import Reader
  reader = Reader(gemma3_hf_dir, score_batch_size=8)
  question = 'what is the capital of france'
  sentences = [['Paris is the capital and largest city of France.', 'Bananas are yellow.'],
               ['The Louvre is a museum.']]
  scores = filco.cxmi_scores(reader, [question], [sentences], ['Paris'])[0]
  tokenizer = AutoTokenizer.from_pretrained(gemma3_hf_dir)

  def loglik(prompt: str, target: str) -> float:
    p = tokenizer(prompt, return_tensors='pt')['input_ids']  # BOS + prompt
    t = tokenizer(target, add_special_tokens=False, return_tensors='pt')['input_ids']
    ids = torch.cat([p, t], dim=1)
    with torch.no_grad():
      logp = torch.log_softmax(gemma3_torch(ids).logits[0].double(), -1)
    return float(sum(logp[p.shape[1] - 1 + i, t[0, i]] for i in range(t.shape[1])))

  target = prompts.answer_target('Paris')
  base = loglik(prompts.build_prompt(question), target)
  flat = [s for row in sentences for s in row]
  expected = [loglik(prompts.build_prompt(question, s), target) - base for s in flat]
  np.testing.assert_allclose([x for row in scores for x in row], expected, atol=2e-3)
  assert scores[0][0] > 0 > scores[0][1]  # the answer-bearing sentence helps, the banana does not
  chosen = filco.select(sentences, scores, 'cxmi')
  assert chosen.text == flat[int(np.argmax(expected))]
  # No output: nothing scored, no reader call.
  assert filco.cxmi_scores(reader, [question], [sentences], ['']) == [[[0.0, 0.0], [0.0]]]


def test_ranked_filter_keeps_the_filter_models_most_likely_whole_output(gemma3_hf_dir, gemma3_torch):
  """Each candidate (nothing, or one passage sentence) is scored with its EOS, as HF PyTorch
  scores it, and the most likely one is the context."""
  import torch
  from transformers import AutoTokenizer

  from recomp_jax.reader.reader import Reader
  reader = Reader(gemma3_hf_dir, score_batch_size=4)
  sentences = [[['Paris is the capital and largest city of France.', 'Bananas are yellow.'],
                ['The Louvre is a museum.']],
               [['Rain falls.']]]
  prompts_text = [filco.filter_prompt('what is the capital of france', 'France\nParis is the capital.'),
                  filco.filter_prompt('is it raining', 'Weather\nRain falls.')]
  scores = filco.ranked_filter(reader, prompts_text, sentences)
  tokenizer = AutoTokenizer.from_pretrained(gemma3_hf_dir)

  def loglik(prompt: str, output: str) -> float:
    p = tokenizer(prompt, return_tensors='pt')['input_ids']
    t = tokenizer(output, add_special_tokens=False)['input_ids'] + [tokenizer.eos_token_id]
    ids = torch.cat([p, torch.tensor([t])], dim=1)
    with torch.no_grad():
      logp = torch.log_softmax(gemma3_torch(ids).logits[0].double(), -1)
    return float(sum(logp[p.shape[1] - 1 + i, tok] for i, tok in enumerate(t)))

  for prompt, rows, mine in zip(prompts_text, sentences, scores):
    flat = [s for row in rows for s in row]
    expected = [loglik(prompt, '')] + [loglik(prompt, ' ' + s) for s in flat]
    np.testing.assert_allclose(mine, expected, atol=2e-3)
    best = int(np.argmax(expected))
    assert filco.ranked_context(mine, rows, keep=1, allow_empty=True) == ([''] + flat)[best]
  # each prompt encoded once: the same numbers as scoring every (prompt, output) pair whole
  pairs = reader.output_loglik([p for p, rows in zip(prompts_text, sentences) for _ in range(1 + sum(map(len, rows)))],
                               [c for rows in sentences for c in [''] + [' ' + s for row in rows for s in row]])
  np.testing.assert_allclose(np.concatenate(scores), pairs, atol=2e-4)
  with pytest.raises(ValueError, match='2 prompts for 1'):
    filco.ranked_filter(reader, prompts_text, sentences[:1])


def test_ranked_context_keeps_the_most_likely_sentences_in_reading_order():
  sentences = [['a0.', 'a1.', 'a2.'], ['b0.']]
  loglik = [-1.0, -3.0, -0.5, -2.0, -0.5]  # empty, a0, a1, a2, b0
  assert filco.ranked_context(loglik, sentences, keep=1, allow_empty=False) == 'a1.'  # tie: earlier
  assert filco.ranked_context(loglik, sentences, keep=2, allow_empty=False) == 'a1. b0.'
  assert filco.ranked_context(loglik, sentences, keep=3, allow_empty=True) == 'a1. a2. b0.'
  assert filco.ranked_context([0.0, -3.0, -0.5, -2.0, -0.5], sentences, keep=2, allow_empty=True) == ''
  assert filco.ranked_context([0.0, -3.0, -0.5, -2.0, -0.5], sentences, keep=1, allow_empty=False) == 'a1.'
  assert filco.ranked_context([-1.0], [[]], keep=1, allow_empty=False) == ''  # no sentence
  with pytest.raises(ValueError, match='2 scores for the empty context and 4 sentences'):
    filco.ranked_context([0.0, 1.0], sentences, keep=1, allow_empty=False)
  with pytest.raises(ValueError, match='at least 1'):
    filco.ranked_context(loglik, sentences, keep=0, allow_empty=False)
