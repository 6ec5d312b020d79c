"""The length-matched truncation baseline: the method on its own, then its :ci run end to end
(the shared head; a tiny random reader in the fast tier, the real Gemma 3 270M in the slow one)
with k matched to another results file."""

import json
import os

import pytest

from recomp_jax import inference
from recomp_jax.compressors import truncation
from recomp_jax.data import stage_records
from recomp_jax.data.schema import Example, Passage
from recomp_jax.evaluation import report
from recomp_jax.pipelines import runner
from recomp_jax.reader import prompts
from tests.tiny_models import char_tokenizer, check_export_reproduces_the_trained_row

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_truncate_keeps_exactly_the_first_k_tokens():
  tok = char_tokenizer(128)  # one token per character
  assert truncation.truncate(tok, 'abcdefgh', 3) == 'abc'
  assert truncation.truncate(tok, 'abc', 8) == 'abc'
  example = Example(id='q', question='?', answers=['x'],
                    ctxs=[Passage(id='1', title='A', text='one two'), Passage(id='2', title='B', text='three')])
  compress = lambda k, n: truncation.TruncationCompressor(tok, k=k, top_docs=n).compress(['?'], [example.ctxs])  # noqa: E731
  # the best document first: its start survives the cut (the reader's format puts it last)
  assert compress(4, 2) == ['A\non']
  assert compress(14, 2) == ['A\none two\nB\nth']
  assert compress(1000, 1) == [prompts.format_documents(example.ctxs[:1])] == ['A\none two']


def test_matched_tokens_reads_the_row_of_a_results_file(tmp_path):
  path = tmp_path / 'results.json'
  path.write_text(json.dumps({'rows': [{'key': 'top1', 'tokens': 110.0}, {'key': 'trained', 'tokens': 20.6}]}))
  assert truncation.matched_tokens(str(path)) == 21
  assert truncation.matched_tokens(str(path), 'top1') == 110
  with pytest.raises(ValueError, match="no row 'oracle'"):
    truncation.matched_tokens(str(path), 'oracle')


@pytest.mark.end_to_end
@pytest.mark.parametrize('reader', ['tiny_gemma', pytest.param('gemma3_270m', marks=pytest.mark.slow)])
def test_ci_run_end_to_end_with_k_matched_to_another_run(tmp_path, monkeypatch, gemma3_gguf_path, gemma3_hf_dir,
                                                        tiny_gemma_dir, reader):
  monkeypatch.syspath_prepend(REPO)
  from configs.nq_truncation import get_config
  other = tmp_path / 'other_results.json'
  other.write_text(json.dumps({'rows': [{'key': 'trained', 'tokens': 12.2}]}))
  config = get_config('ci')
  config.workdir = str(tmp_path / 'run')
  if reader == 'tiny_gemma':  # the real tokenizer, so k counts the same tokens
    config.reader.model = tiny_gemma_dir
  config.truncation.match_results = str(other)
  results = runner.run(config, config.workdir)
  report.validate_results(json.loads(open(os.path.join(config.workdir, 'results.json')).read()))
  rows = {r['key']: r for r in results['rows']}
  assert set(rows) == {'none', 'top1', 'top5', 'truncated'} and all(r['n'] == 6 for r in rows.values())
  assert rows['truncated']['name'] == 'first 12 tokens of the top-5 documents'
  assert rows['truncated']['tokens'] < rows['top1']['tokens']
  predictions = [json.loads(line) for line in open(os.path.join(config.workdir, 'predictions.jsonl'))]
  top1 = {p['id']: p['evidence'] for p in predictions if p['row'] == 'top1'}
  from transformers import AutoTokenizer
  tokenizer = AutoTokenizer.from_pretrained(gemma3_hf_dir)  # the reader's
  retrieved = {e.id: e for e in stage_records.read_examples(os.path.join(config.workdir, 'stages', 'retrieve', 'test.jsonl'))}
  for p in predictions:
    if p['row'] == 'truncated':  # 12 tokens: the start of the top document
      assert p['evidence'] == truncation.truncate(tokenizer, truncation.in_rank_order(retrieved[p['id']].ctxs[:5]), 12)
      assert top1[p['id']].startswith(p['evidence']) and p['evidence']
  assert {(b['a'], b['b']) for b in results['bootstrap']} == {('truncated', k) for k in ('none', 'top1', 'top5')}
  assert results['notes'] == [f"Truncation budget k = 12 reader tokens, from the mean evidence tokens of row "
                              f"'trained' in {other}."]
  # The export: the same evidence through recomp_jax.load_compressor, and through the command line
  # (documents as plain {title, text} objects).
  evidence = check_export_reproduces_the_trained_row(config.workdir, 'truncated')
  examples = stage_records.read_examples(os.path.join(config.workdir, 'stages', 'retrieve', 'test.jsonl'))
  requests = tmp_path / 'requests.jsonl'
  requests.write_text(''.join(json.dumps({'id': e.id, 'question': e.question,
                                          'ctxs': [{'title': p.title, 'text': p.text} for p in e.ctxs]}) + '\n'
                              for e in examples))
  out = tmp_path / 'evidence.jsonl'
  assert inference.main(['--compressor', os.path.join(config.workdir, 'compressor'), '--input', str(requests),
                         '--output', str(out), '--batch_size', '4']) == 0
  assert [json.loads(line) for line in open(out)] == [{'id': e.id, 'evidence': ev} for e, ev in zip(examples, evidence)]
  config.truncation.tokens = 0
  config.truncation.match_results = ''
  from recomp_jax.config_fields import ConfigError
  with pytest.raises(ConfigError, match='config.truncation.tokens must be at least 1, got 0'):
    runner.run(config, config.workdir)


def test_the_command_line_names_the_line_of_a_bad_request_and_a_missing_export(tmp_path, capsys):
  bad = tmp_path / 'requests.jsonl'
  bad.write_text(json.dumps({'question': 'q?', 'ctxs': []}) + '\n' + json.dumps({'ctxs': []}) + '\n')
  assert inference.main(['--compressor', str(tmp_path), '--input', str(bad), '--output', str(tmp_path / 'o')]) == 2
  assert f"{bad}:2: field 'question'" in capsys.readouterr().err
  good = tmp_path / 'good.jsonl'
  good.write_text(json.dumps({'question': 'q?', 'ctxs': []}) + '\n')
  assert inference.main(['--compressor', str(tmp_path), '--input', str(good), '--output', str(tmp_path / 'o')]) == 2
  assert f"{tmp_path}/compressor.json:?: no such file" in capsys.readouterr().err
