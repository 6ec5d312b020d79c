"""K-COMP on MedQuAD (kcomp.txt §4): cached stages from the questions to BERTScore.

``python -m recomp_jax.main --config=configs/medquad_kcomp.py:PRESET`` runs, each stage cached
and resumable in ``{workdir}/stages/<name>/`` (:mod:`recomp_jax.stages`):

1. ``data`` (train / dev) and ``test_data`` (the test split): the MedQuAD questions, BM25 top
   ``kcomp.top_docs`` passages per question with the question's own answer left out
   (:func:`recomp_jax.data.medquad.retrieve_leaving_own_answer_out`); either stage fails if any
   retrieved passage is still the question's own. Apart so that a run on another test file (a dev
   probe, then the one held-out run) reuses every training stage: the model chosen on dev is the
   model evaluated;
2. ``knowledge`` (§4.2, Table 1): entities of each train / dev question that name a corpus title
   (a title gazetteer, or spaCy / ScispaCy with ``kcomp.entities=spacy``) with their descriptions;
   questions without a described entity are dropped and counted (test questions are only counted,
   in ``test_data``: at inference the question is not masked);
3. ``targets``: the summary each compressor learns: the reader's best sentences of the passages
   (beyond the paper, ``kcomp.targets=reader_sentence``) or Table 6's teacher summary
   (``kcomp.targets=teacher``, any OpenAI-compatible endpoint; offline our own server);
4. ``train_ft_seed<s>``: FT, the paper's key baseline: the same model fine-tuned on the summaries
   alone (trained when the ``ft`` row is requested); ``train_kcomp_seed<s>``: K-COMP with
   ``<ent>`` / ``<eom>`` and the knowledge-injection loss
   (:func:`recomp_jax.training.objectives.knowledge_injection`);
5. ``evaluate``: rows (Tables 2, 3, 5) read by the reader writing a long-form answer, scored by
   BERTScore F1 (our Flax BERT, :mod:`recomp_jax.evaluation.bertscore`) and ROUGE-L
   (``rouge-score``) against the reference answer, with the compressor's and the reader's seconds
   per question; a paired bootstrap of K-COMP against every other row.

MedQuAD is long-form QA scored against one reference, not exact match, so this task has its own
stages rather than the question-answering head of :mod:`recomp_jax.pipelines.runner`; it reuses
the reader, BM25, the stage runner, the fine-tuning path and the results schema.

``kcomp.variant=released`` follows the released code where it differs from the paper: the loss
on the whole sequence, prompt included (its ``train.py`` runs SFTTrainer without a
completion-only collator), and ``<eod>`` as the name of the description-end token.
"""

from __future__ import annotations

import json
import os
import time
from typing import Sequence

import numpy as np
from absl import logging

from recomp_jax import provenance, sharding
from recomp_jax.compressors import kcomp
from recomp_jax.config_fields import Field
from recomp_jax.data import medical_qa, medquad
from recomp_jax.data.entities import ENT, Gazetteer, Mention, SpacyEntities
from recomp_jax.data.schema import Example, FilterReport, Passage
from recomp_jax.data.stage_records import load_labels, read_examples, write_examples
from recomp_jax.evaluation import qa_metrics
from recomp_jax.evaluation.rows import truncated_documents
from recomp_jax.pipelines import defaults, shared
from recomp_jax.stages import ResumableJsonl, StageRunner, costs_table, map_resumable, read_records

ROW_NAMES = {
    'none': 'no retrieval',
    'top1': 'top-1 passage',
    'top5': 'top-5 passages',
    'ft': 'FT: the compressor fine-tuned on the summaries alone',
    'kcomp': 'K-COMP: prior knowledge and summary',
    'kcomp_no_prior': 'K-COMP -Prior: its summary only',
    'truncation': "truncation: the top passages cut to K-COMP's mean evidence tokens",
}
ROW_KEYS = tuple(ROW_NAMES)
COMPARED = ('kcomp',)
METRICS = ('bertscore_f1', 'rougeL')
SPLITS = ('train', 'dev', 'test')
TRAIN_SPLITS = ('train', 'dev')
DATA_CODE = ('recomp_jax.data', 'recomp_jax.retrieval')
KNOWLEDGE_CODE = ('recomp_jax.data', 'recomp_jax.compressors.kcomp')
TARGET_CODE = shared.READER_CODE + ('recomp_jax.compressors.kcomp', 'recomp_jax.teacher')
TRAIN_CODE = ('recomp_jax.compressors.kcomp', 'recomp_jax.training', 'recomp_jax.models', 'recomp_jax.pretrained',
              'recomp_jax.sharding')
EVAL_CODE = shared.READER_CODE + ('recomp_jax.compressors.kcomp', 'recomp_jax.evaluation', 'recomp_jax.models')
_TEACHER = ('kcomp.targets', ('teacher',))
_SENTENCES = ('kcomp.targets', ('reader_sentence',))
_DENSE = ('kcomp.retriever', ('dense_bm25',))
QUESTION_READERS = {'medquad': medquad.read_questions, 'mashqa': medical_qa.read_mashqa,
                    'bioasq': medical_qa.read_bioasq}
CORPUS_FORMATS = ('medquad', 'medcorp')

# The task's config: the shared run, reader, optimiser and mesh fields, and its own sections.
FIELDS = defaults.shared_fields(without=('data', 'retrieval', 'candidates', 'encoder', 'eval')) + (
    Field('kcomp.corpus_path', '', 'the MedQuAD passage corpus (corpus_medquad.jsonl.gz)'),
    Field('kcomp.corpus_format', 'medquad', "'medquad' or 'medcorp' (MedRAG's chunk JSONL: id, title, content)",
          choices=CORPUS_FORMATS),
    Field('kcomp.question_format', 'medquad', "the question files: 'medquad', 'mashqa' (SQuAD v2 JSON) or "
          "'bioasq' (its training JSON)", choices=tuple(QUESTION_READERS)),
    Field('kcomp.train_path', '', 'training questions (MedQuAD JSONL, own_passage_ids per question)'),
    Field('kcomp.dev_path', '', 'dev questions (checkpoint and target choice)'),
    Field('kcomp.test_path', '', 'held-out test questions'),
    Field('kcomp.max_train', 0, 'training questions read, the first of the file (0 = all)', minimum=0),
    Field('kcomp.max_dev', 0, 'dev questions read (0 = all)', minimum=0),
    Field('kcomp.max_test', 0, 'test questions read, the first N of the file (0 = all)', minimum=0),
    Field('kcomp.skip_test', 0, 'test questions skipped before the first one read (a demo or dev probe on the '
          'dev file, past the questions training reads as dev)', minimum=0),
    Field('kcomp.top_docs', 5, 'passages per question (own answer left out)', minimum=1),
    Field('kcomp.retriever', 'bm25', "'bm25' (the :shared default) or the paper's 'dense_bm25': the dense "
          "retriever's kcomp.dense_depth passages re-ranked by BM25 (§4.1)", choices=('bm25', 'dense_bm25')),
    Field('kcomp.dense_model', '', "the dense retriever ('' = MiniLM from PyPI; facebook/contriever in the paper)",
          read_when=_DENSE),
    Field('kcomp.dense_depth', 15, 'dense passages BM25 re-ranks (Fig. 2: 15)', minimum=1, read_when=_DENSE),
    Field('kcomp.bm25_k1', 0.9, 'BM25 k1 (Pyserini)', minimum=0.0),
    Field('kcomp.bm25_b', 0.4, 'BM25 b (Pyserini)', minimum=0.0),
    Field('kcomp.variant', 'paper', "'paper': loss on knowledge and summary, <eom>; 'released': the released "
          'code (loss on the whole sequence, prompt included; <eod>)', choices=('paper', 'released')),
    Field('kcomp.new_token_lr_scale', 1.0, "beyond the paper: the <ent>/<eom> embedding rows' updates times this "
          '(1 = the paper; a mean-initialised row barely moves at a fine-tuning rate)', minimum=0.0),
    Field('kcomp.entities', 'gazetteer', "question entities: corpus-title 'gazetteer' or the paper's 'spacy' "
          '(ScispaCy) finder, both kept only when they name a corpus title', choices=('gazetteer', 'spacy')),
    Field('kcomp.spacy_model', 'en_core_sci_sm', 'the spaCy / ScispaCy model', read_when=('kcomp.entities', ('spacy',))),
    Field('kcomp.targets', 'reader_sentence', "summary targets: 'teacher' (Table 6, the paper) or, beyond the "
          "paper, 'reader_sentence' (the passages' sentences under which the reader likes the reference best)",
          choices=('reader_sentence', 'teacher')),
    Field('kcomp.summary_sentences', 2, 'sentences of a reader-sentence summary', minimum=1, read_when=_SENTENCES),
    Field('kcomp.answer_tokens', 32, "reference tokens the sentence labels score", minimum=1, read_when=_SENTENCES),
    Field('kcomp.max_candidates', 20, 'sentences that compete for a reader-sentence summary (0 = all)', minimum=0,
          read_when=_SENTENCES),
    Field('kcomp.answer_stop', ('\n\n',), "the reader's long-form answer ends at these strings", element=str),
    Field('kcomp.bertscore_model', '', "BERTScore's encoder ('' = MiniLM from PyPI; roberta-large in the paper)"),
    Field('kcomp.bertscore_layers', 0, 'BERTScore layers (0 = all; roberta-large: 17)', minimum=0),
    Field('kcomp.rows', ('all',), "'all' or row keys: " + ', '.join(ROW_KEYS), element=str,
          choices=('all',) + ROW_KEYS),
    Field('teacher.temperature', 0.0, 'sampling temperature', minimum=0.0, read_when=_TEACHER),
    Field('teacher.max_tokens', 128, 'summary tokens', minimum=1, read_when=_TEACHER),
) + shared.teacher_fields(api='completions', read_when=_TEACHER) + shared.compressor_fields(
    model_help="'' = Gemma 3 270M from PyPI (Gemma-2B in the paper)", max_source_length=1024, max_target_length=256,
    max_new_tokens=192, source_help='prompt tokens (the passages lose their end, counted)',
    target_help='knowledge + summary tokens')


def eom(config) -> str:
  """The description-end token: ``<eom>`` (paper) or ``<eod>`` (released code)."""
  return kcomp.EOM_RELEASED if config.kcomp.variant == 'released' else kcomp.EOM


def requested_rows(config) -> list[str]:
  keys = list(ROW_KEYS) if 'all' in tuple(config.kcomp.rows) else [k for k in ROW_KEYS if k in config.kcomp.rows]
  if not shared.trains(config):
    keys = [k for k in keys if k not in ('ft', 'kcomp', 'kcomp_no_prior', 'truncation')]
  elif 'truncation' in keys and 'kcomp' not in keys:
    keys.remove('truncation')  # it matches K-COMP's tokens
  return keys


def validate(config) -> None:
  """Checks the paths before any work (``PipelineError`` naming the field)."""
  k = config.kcomp
  fields = [('kcomp.corpus_path', k.corpus_path), ('kcomp.test_path', k.test_path)]
  if shared.trains(config):
    fields += [('kcomp.train_path', k.train_path), ('kcomp.dev_path', k.dev_path)]
  for name, path in fields:
    if not path:
      raise shared.PipelineError(f'{name} is empty: set it to a MedQuAD file (../shared/data/medquad/)')
    if not os.path.exists(path):
      raise shared.PipelineError(f'{path}: no such file ({name})')


def split_paths(config) -> dict[str, tuple[str, int]]:
  k = config.kcomp
  out = {'test': (k.test_path, k.max_test)}
  if shared.trains(config):
    out.update(train=(k.train_path, k.max_train), dev=(k.dev_path, k.max_dev))
  return out


def data_stage(split: str) -> str:
  """The stage holding ``split``'s questions and passages."""
  return 'test_data' if split == 'test' else 'data'


# ----------------------------------------------------------------------------- data


def read_corpus(config) -> list[medquad.MedPassage]:
  """``kcomp.corpus_path`` in ``kcomp.corpus_format``."""
  reader = medical_qa.read_medcorp if config.kcomp.corpus_format == 'medcorp' else medquad.read_corpus
  return reader(config.kcomp.corpus_path)


def read_questions(config, path: str, limit: int, skip: int = 0, report: FilterReport | None = None
                   ) -> list[Example]:
  """Questions ``skip`` to ``skip + limit`` (0 = all) of ``path`` in ``kcomp.question_format``;
  ``report`` counts the MASH-QA / BioASQ questions dropped for want of an answer."""
  fmt = config.kcomp.question_format
  kwargs = {'report': report} if fmt != 'medquad' else {}
  return QUESTION_READERS[fmt](path, max_examples=skip + limit if limit else 0, **kwargs)[skip:]


def dense_search(config, corpus: Sequence[Passage], directory: str):
  """``(query, depth) -> passages`` of the dense retriever (``kcomp.dense_model``) over ``corpus``;
  the corpus embeddings are kept in ``{directory}/dense-<fingerprint>``."""
  # (lazy: the BM25 default loads no encoder)
  from recomp_jax.models.dual_encoder import Encoder  # pylint: disable=import-outside-toplevel
  from recomp_jax.retrieval.dense import DenseIndex  # pylint: disable=import-outside-toplevel
  encoder = Encoder.from_pretrained(shared.resolve_demo_model(config.kcomp.dense_model, 'encoder'))
  index = DenseIndex.build_or_load(corpus, encoder, directory)
  return lambda query, depth: index.search_batch(encoder, [query], depth)[0]


def stage_data(config, directory: str, splits: Sequence[str]) -> dict:
  """Questions of each of ``splits`` with their passages (BM25, or dense re-ranked by BM25), own answer
  left out -> ``{split}.jsonl``; for the test split also how many questions name an entity (Table 1;
  the question is not masked)."""
  from recomp_jax.retrieval.bm25 import BM25Config, BM25Index  # pylint: disable=import-outside-toplevel  (builds an index)
  records = read_corpus(config)
  corpus = [m.passage for m in records]
  index = BM25Index.build_or_load(corpus, os.path.join(directory, 'index'),
                                  BM25Config(k1=config.kcomp.bm25_k1, b=config.kcomp.bm25_b))
  search, rerank = index.search, None
  if config.kcomp.retriever == 'dense_bm25':
    search, rerank = dense_search(config, corpus, directory), index.rerank
  summary = {'corpus_passages': len(corpus)}
  paths = split_paths(config)
  for split in splits:
    path, limit = paths[split]
    skip = config.kcomp.skip_test if split == 'test' else 0
    unanswered = FilterReport(f'read/{split}')
    examples = read_questions(config, path, limit, skip, unanswered)
    report = FilterReport(f'retrieve/{split}')
    examples = medquad.retrieve_leaving_own_answer_out(search, examples, config.kcomp.top_docs, report,
                                                       rerank=rerank, depth=config.kcomp.dense_depth)
    leaks = [e.id for e in examples if {p.id for p in e.ctxs} & set(e.meta['own_passage_ids'])]
    if leaks:  # the reference would be in the evidence
      raise shared.PipelineError(f'{len(leaks)} {split} question(s) retrieved their own answer, e.g. {leaks[0]!r}')
    write_examples(os.path.join(directory, f'{split}.jsonl'), examples)
    summary[split] = {'questions': len(examples), 'left_out': report.to_dict()['dropped'],
                      'dropped_on_read': unanswered.to_dict()['dropped'],
                      'short_of_passages': sum(len(e.ctxs) < config.kcomp.top_docs for e in examples)}
    if split == 'test':
      finder = entity_finder(config, [m.passage.title for m in records])
      named = FilterReport('knowledge/test')
      for e in examples:
        if finder.find(e.question):
          named.keep()
        else:
          named.drop('no_entity', e.id)
      counts = named.to_dict()
      summary[split]['entities'] = {'questions': len(examples), 'kept': counts.get('kept', 0),
                                    'dropped': counts['dropped']}
  return summary


def examples_of(runner: StageRunner, split: str) -> list[Example]:
  path = os.path.join(runner.stage_dir(data_stage(split)), f'{split}.jsonl')
  return read_examples(path) if os.path.exists(path) else []


# ----------------------------------------------------------------------------- knowledge


def entity_finder(config, titles: Sequence[str]):
  gazetteer = Gazetteer(titles)
  return SpacyEntities(config.kcomp.spacy_model, gazetteer) if config.kcomp.entities == 'spacy' else gazetteer


def stage_knowledge(config, runner: StageRunner, directory: str) -> dict:
  """Table 1: per train / dev question its described entities -> ``{split}.jsonl`` (kept questions
  only: ``mentions`` ``[start, end, surface, title]`` and the ``pairs`` ``[surface, description]``)."""
  corpus = read_corpus(config)
  finder = entity_finder(config, [m.passage.title for m in corpus])
  descriptions = kcomp.Descriptions(corpus)
  summary = {}
  for split in TRAIN_SPLITS:
    examples = examples_of(runner, split)
    report = FilterReport(f'knowledge/{split}')
    with open(os.path.join(directory, f'{split}.jsonl'), 'w', encoding='utf-8') as f:
      for e in examples:
        mentions = finder.find(e.question)
        found = kcomp.knowledge_for(mentions, descriptions, e.meta['own_passage_ids'], report, e.id)
        if found is None:
          continue
        report.keep()
        kept, knowledge = found
        f.write(json.dumps({'id': e.id, 'mentions': [[m.start, m.end, m.surface, m.title] for m in kept],
                            'pairs': [list(p) for p in knowledge.pairs]}, ensure_ascii=False) + '\n')
    counts = report.to_dict()
    summary[split] = {'questions': len(examples), 'kept': counts.get('kept', 0), 'dropped': counts['dropped']}
  return summary


def load_knowledge(runner: StageRunner, split: str) -> dict[str, tuple[list[Mention], kcomp.Knowledge]]:
  directory = runner.stage_dir('knowledge')
  if not os.path.exists(os.path.join(directory, f'{split}.jsonl')):
    return {}
  return {i: ([Mention(*m) for m in r['mentions']], kcomp.Knowledge(tuple(tuple(p) for p in r['pairs'])))
          for i, r in load_labels(directory, split).items()}


# ----------------------------------------------------------------------------- targets


def stage_targets(config, runner: StageRunner, resources, directory: str) -> dict:
  """The summary target of every kept train / dev question -> ``{split}.jsonl`` (``summary``)."""
  summary = {'source': config.kcomp.targets}
  for split in ('train', 'dev'):
    knowledge = load_knowledge(runner, split)
    examples = [e for e in examples_of(runner, split) if e.id in knowledge]
    path = os.path.join(directory, f'{split}.jsonl')
    if config.kcomp.targets == 'reader_sentence':
      def label(part):
        return kcomp.reader_sentence_summaries(
            resources.reader, [e.question for e in part], [e.answers[0] for e in part], [e.ctxs for e in part],
            sentences=config.kcomp.summary_sentences, answer_tokens=config.kcomp.answer_tokens,
            max_candidates=config.kcomp.max_candidates)
      records = map_resumable(path, examples, label, chunk=config.reader.questions_per_call,
                              desc=f'reader sentences {split}')
    else:
      records = teacher_summaries(config, examples, knowledge, path, directory)
    texts = [records[e.id]['summary'] for e in examples]
    summary[split] = {'questions': len(examples), 'empty': sum(not t for t in texts),
                      'mean_words': float(np.mean([len(t.split()) for t in texts])) if texts else 0.0}
  return summary


def teacher_summaries(config, examples: Sequence[Example], knowledge: dict, path: str, directory: str) -> dict:
  """Table 6: the teacher extracts what the passages say of the entities (question left out);
  requests are cached in ``{directory}/teacher_cache.sqlite``, a failed one is an empty summary."""
  from recomp_jax.teacher import Sampling, Teacher  # pylint: disable=import-outside-toplevel  (openai client)
  t = config.teacher
  prompts = [kcomp.teacher_prompt(e.ctxs, [s for s, _ in knowledge[e.id][1].pairs]) for e in examples]
  with shared.teacher_endpoint(config, directory, start=bool(prompts)) as endpoint:
    teacher = Teacher(endpoint.model, base_url=endpoint.base_url, api_key_env=endpoint.api_key_env,
                      cache_path=os.path.join(directory, 'teacher_cache.sqlite'), api=t.api,
                      sampling=Sampling(temperature=t.temperature, max_tokens=t.max_tokens, stop=('\n\n',)),
                      concurrency=t.concurrency, max_retries=t.max_retries, timeout_s=t.timeout_s)
    completions = teacher.complete_all(kcomp.TEACHER_INSTRUCTION, prompts, samples=1, desc='teacher')
  out = ResumableJsonl(path)
  for e, (c,) in zip(examples, completions):
    if e.id not in out:
      out.append({'id': e.id, 'summary': (c.text or '').strip(), 'error': c.error})
  out.close()
  return out.records


# ----------------------------------------------------------------------------- training


def training_examples(config, tokenizer, runner: StageRunner, split: str, *, knowledge: bool) -> tuple[list, int]:
  """K-COMP's ``(prompt, knowledge, summary)`` or FT's ``(prompt, summary)`` per kept question,
  and how many prompts lost passage text to ``compressor.max_source_length``."""
  entities = load_knowledge(runner, split)
  targets = load_labels(runner.stage_dir('targets'), split)
  budget, mark = config.compressor.max_source_length, eom(config)
  out, cut = [], 0
  for e in examples_of(runner, split):
    if e.id not in entities or e.id not in targets:
      continue
    mentions, know = entities[e.id]
    summary = targets[e.id]['summary']
    if knowledge:
      prompt, was_cut = kcomp.fitted_prompt(tokenizer, kcomp.mask(e.question, mentions), e.ctxs, budget)
      if config.kcomp.variant == 'released':  # SFT over the whole text: the prompt carries loss too
        out.append(('', prompt + know.text(mark), summary))
      else:
        out.append((prompt, know.text(mark), summary))
    else:
      prompt, was_cut = kcomp.fitted_prompt(tokenizer, e.question, e.ctxs, budget, head='Summary')
      out.append((prompt, summary))
    cut += was_cut
  return out, cut


def stage_train(config, runner: StageRunner, seed: int, directory: str, *, knowledge: bool) -> dict:
  """Fine-tunes ``compressor.model`` (K-COMP or FT); the best dev loss goes to ``compressor_best``."""
  from recomp_jax.pretrained.special_tokens import add_special_tokens  # pylint: disable=import-outside-toplevel
  from recomp_jax.training import finetune, objectives  # pylint: disable=import-outside-toplevel
  cut = {}

  def examples(tokenizer):
    train, cut['train'] = training_examples(config, tokenizer, runner, 'train', knowledge=knowledge)
    dev, cut['dev'] = training_examples(config, tokenizer, runner, 'dev', knowledge=knowledge)
    if not train:
      raise shared.PipelineError('no training question kept an entity with a description and a summary target')
    return train, dev

  def prepare(pretrained, tokenizer):
    return add_special_tokens(pretrained, tokenizer, (ENT, eom(config)))

  section = config.compressor
  if knowledge and config.kcomp.variant == 'released':
    # the prompt is part of the target: room for it beside the knowledge and the summary
    section = section.copy_and_resolve_references()
    section.max_target_length = section.max_source_length + section.max_target_length
  summary = finetune.finetune_pretrained(
      config, section, examples, seed=seed, directory=directory, best_name='compressor_best',
      objective=objectives.knowledge_injection() if knowledge else objectives.prompt_target(),
      prepare=prepare if knowledge else None, new_token_lr_scale=config.kcomp.new_token_lr_scale)
  return {**summary, 'documents_cut': cut}


# ----------------------------------------------------------------------------- evaluation


def long_form_answers(reader, prompt_texts: Sequence[str], config) -> list[str]:
  """The reader's greedy long-form answers (up to ``reader.max_new_tokens``, cut at ``kcomp.answer_stop``),
  through the run's prediction cache: a row's prompts no compressor changes are decoded once across reruns."""
  return reader.answer(list(prompt_texts), max_new_tokens=config.reader.max_new_tokens,
                       stop_strings=tuple(config.kcomp.answer_stop), postprocess=False)


class Metrics:
  """BERTScore F1 (our Flax BERT) and ROUGE-L F (``rouge-score``, stemmed), per answer, 0-1."""

  def __init__(self, config):
    from rouge_score import rouge_scorer  # pylint: disable=import-outside-toplevel  (evaluation only)
    from recomp_jax.evaluation.bertscore import BertScore  # pylint: disable=import-outside-toplevel
    self.bertscore = BertScore(config.kcomp.bertscore_model, num_layers=config.kcomp.bertscore_layers or None)
    self.rouge = rouge_scorer.RougeScorer(['rougeL'], use_stemmer=True)

  def __call__(self, predictions: Sequence[str], references: Sequence[str]) -> dict[str, list[float]]:
    bert = self.bertscore.score(list(predictions), list(references))['f1']
    rouge = [self.rouge.score(r, p)['rougeL'].fmeasure for p, r in zip(predictions, references)]
    return {'bertscore_f1': [float(x) for x in bert], 'rougeL': [float(x) for x in rouge]}


def compressed(runner: StageRunner, config, name: str, seed: int, examples: Sequence[Example], directory: str
               ) -> dict[str, dict]:
  """A trained compressor's ``(knowledge, summary)`` per test question, with its seconds per
  question (``compressed_<name>_seed<s>.jsonl``, resumable)."""
  c = config.compressor
  model_dir = os.path.join(runner.stage_dir(f'train_{name}_seed{seed}'), 'compressor_best')
  compressor = kcomp.Compressor.load(model_dir, max_source_length=c.max_source_length, max_new_tokens=c.max_new_tokens,
                                     batch_size=c.generate_batch_size, knowledge=name == 'kcomp', eom=eom(config),
                                     top_docs=config.kcomp.top_docs)

  def run(part):
    start = time.perf_counter()
    outputs = compressor.generate([e.question for e in part], [e.ctxs for e in part])
    seconds = (time.perf_counter() - start) / len(part)
    return [{'knowledge': k, 'summary': s, 'seconds': seconds} for k, s in outputs]

  return map_resumable(os.path.join(directory, f'compressed_{name}_seed{seed}.jsonl'), examples, run,
                       chunk=4 * c.generate_batch_size, desc=f'compress {name}')


def row_evidence(key: str, examples: Sequence[Example], outputs: dict[str, dict] | None, config,
                 tokens: int | None = None, tokenizer=None) -> list[str]:
  """The evidence text of row ``key`` per test question (:func:`recomp_jax.compressors.kcomp.evidence_text`)."""
  if key == 'none':
    return [''] * len(examples)
  if key in ('top1', 'top5'):
    return [kcomp.passages_block(e.ctxs[:1 if key == 'top1' else 5]) for e in examples]
  if key == 'truncation':
    return truncated_documents(tokenizer, examples, k=tokens, top_docs=config.kcomp.top_docs)
  with_prior = key == 'kcomp'
  return [kcomp.evidence_text(outputs[e.id]['summary'], outputs[e.id]['knowledge'] if with_prior else '', eom(config))
          for e in examples]


def stage_evaluate(config, runner: StageRunner, resources, directory: str) -> dict:
  """Every requested row (per seed for the trained ones) -> ``rows.jsonl`` (resumable row by row)."""
  examples = examples_of(runner, 'test')
  reader = resources.reader
  metrics = None
  done = ResumableJsonl(os.path.join(directory, 'rows.jsonl'), key='row')
  plan = []
  for key in requested_rows(config):
    if key in ('ft', 'kcomp', 'kcomp_no_prior', 'truncation'):
      plan += [(f'{key}@{s}', key, s) for s in config.train.seeds]
    else:
      plan.append((key, key, None))
  for row_id, key, seed in plan:
    if row_id in done:
      continue
    outputs, k = None, None
    if key in ('ft', 'kcomp', 'kcomp_no_prior'):
      outputs = compressed(runner, config, 'ft' if key == 'ft' else 'kcomp', seed, examples, directory)
    if key == 'truncation':
      k = max(int(round(done.records[f'kcomp@{seed}']['tokens'])), 1)
    evidence = row_evidence(key, examples, outputs, config, k, reader.tokenizer)
    cache = reader.prediction_cache
    misses_before = cache.misses if cache is not None else 0
    start = time.perf_counter()
    predictions = long_form_answers(reader, [kcomp.reader_prompt_for_evidence(e.question, ev)
                                             for e, ev in zip(examples, evidence)], config)
    # Seconds per answer decoded here: answers read from the cache cost nothing and are counted apart.
    decoded = cache.misses - misses_before if cache is not None else len(examples)
    reader_seconds = (time.perf_counter() - start) / decoded if decoded else 0.0
    metrics = metrics or Metrics(config)
    scores = metrics(predictions, [e.answers[0] for e in examples])
    tokens = [reader.count_tokens(ev) for ev in evidence]
    compress_seconds = float(np.mean([outputs[e.id]['seconds'] for e in examples])) if outputs else 0.0
    done.append({'row': row_id, 'key': key, 'ids': [e.id for e in examples], 'predictions': predictions,
                 'evidence': evidence, 'tokens_per_example': tokens, 'tokens': float(np.mean(tokens)) if tokens else 0.0,
                 **{f'{m}_per_example': scores[m] for m in METRICS},
                 **{m: 100.0 * float(np.mean(scores[m])) if examples else 0.0 for m in METRICS},
                 'reader_seconds_per_question': reader_seconds, 'compressor_seconds_per_question': compress_seconds,
                 'reader_answers_cached': len(examples) - decoded,
                 'empty_summary': sum(not (outputs[e.id]['summary']) for e in examples) if outputs else 0})
    logging.info('kcomp row %-18s BERTScore F1 %5.1f ROUGE-L %5.1f tokens %6.1f', row_id,
                 done.records[row_id]['bertscore_f1'], done.records[row_id]['rougeL'], done.records[row_id]['tokens'])
  done.close()
  return {'rows': {r: {m: rec[m] for m in METRICS + ('tokens',)} for r, rec in done.records.items()},
          'test_questions': len(examples)}


# ----------------------------------------------------------------------------- run and results


def input_files(config) -> list[str]:
  k = config.kcomp
  return [p for p, _ in split_paths(config).values()] + [k.corpus_path]


def run(config, workdir: str) -> dict | None:
  """Runs (or resumes) K-COMP's pipeline into ``workdir``; returns the results (process 0)."""
  validate(config)
  os.makedirs(workdir, exist_ok=True)
  runner = StageRunner(workdir, force=tuple(s for s in str(config.force_stages).split(',') if s))
  resources = shared.Resources(config, workdir)
  cfg = config.to_dict()
  k = cfg['kcomp']
  summaries = {}
  retrieval = {f: k[f] for f in ('corpus_path', 'top_docs', 'bm25_k1', 'bm25_b')}
  for f in ('corpus_format', 'question_format'):  # (absent for MedQuAD: earlier runs keep their stages)
    if k[f] != 'medquad':
      retrieval[f] = k[f]
  if k['retriever'] != 'bm25':  # (absent for BM25: runs made before the field keep their stages)
    retrieval.update({f: k[f] for f in ('retriever', 'dense_depth')},
                     dense=shared.model_fingerprint(k['dense_model'], 'encoder'))
  entities = {'entities': k['entities'], 'spacy_model': k['spacy_model'] if k['entities'] == 'spacy' else ''}
  # The training side never reads the test split, so a run on another test file keeps its stages.
  test_inputs = {**retrieval, 'test_path': k['test_path'], 'max_test': k['max_test']}
  if k['skip_test']:  # (absent at 0: runs made before the field keep their stages)
    test_inputs['skip_test'] = k['skip_test']
  summaries['test_data'] = runner.run(
      'test_data', {'kcomp': test_inputs, **entities, 'files': provenance.data_hashes([k['test_path'], k['corpus_path']])},
      lambda d: stage_data(config, d, ('test',)), code=DATA_CODE, collective=False)
  deps = ['test_data']
  if shared.trains(config):
    summaries['data'] = runner.run(
        'data', {'kcomp': {**retrieval, **{f: k[f] for f in ('train_path', 'dev_path', 'max_train', 'max_dev')}},
                 'files': provenance.data_hashes([k['train_path'], k['dev_path'], k['corpus_path']])},
        lambda d: stage_data(config, d, TRAIN_SPLITS), code=DATA_CODE, collective=False)
    summaries['knowledge'] = runner.run(
        'knowledge', entities,
        lambda d: stage_knowledge(config, runner, d), deps=('data',), code=KNOWLEDGE_CODE, collective=False)
    target_inputs = {'targets': k['targets']}
    if k['targets'] == 'reader_sentence':
      target_inputs.update(shared.reader_inputs(config), sentences=k['summary_sentences'],
                           answer_tokens=k['answer_tokens'], max_candidates=k['max_candidates'])
    else:
      teacher = {f: v for f, v in cfg['teacher'].items() if f not in ('concurrency', 'max_retries', 'timeout_s',
                                                                         'server_max_batch', 'api_key_env')}
      if not config.teacher.base_url:
        teacher['served_weights'] = shared.model_fingerprint(config.teacher.model, 'reader')
      target_inputs['teacher'] = teacher
    summaries['targets'] = runner.run(
        'targets', target_inputs, lambda d: stage_targets(config, runner, resources, d), deps=('knowledge',),
        code=TARGET_CODE, resumable=True, collective=k['targets'] == 'reader_sentence')
    from recomp_jax.training.finetune import finetune_inputs  # pylint: disable=import-outside-toplevel
    train_fields, compressor_fields = finetune_inputs(config, 'compressor')
    # FT is an ablation row: trained only when it is requested (K-COMP is the export).
    for name in ('ft', 'kcomp') if 'ft' in requested_rows(config) else ('kcomp',):
      for seed in config.train.seeds:
        stage = f'train_{name}_seed{seed}'
        inputs = {'train': train_fields, 'compressor': compressor_fields, 'mesh': cfg['mesh'], 'seed': seed}
        if name == 'kcomp':
          inputs['variant'] = k['variant']
          if k['new_token_lr_scale'] != 1.0:  # (absent at 1: runs made before the field keep their stages)
            inputs['new_token_lr_scale'] = k['new_token_lr_scale']
        summaries[stage] = runner.run(
            stage, inputs, lambda d, seed=seed, name=name: stage_train(config, runner, seed, d, knowledge=name == 'kcomp'),
            deps=('knowledge', 'targets'), code=TRAIN_CODE, resumable=True)
        deps.append(stage)
    deps += ['data', 'knowledge', 'targets']
  eval_inputs = {**shared.reader_inputs(config), 'rows': requested_rows(config), 'seeds': list(config.train.seeds),
                 'answer_stop': list(k['answer_stop']), 'bertscore': [k['bertscore_model'], k['bertscore_layers']],
                 'generation': {f: cfg['compressor'][f] for f in ('max_source_length', 'max_new_tokens')},
                 'variant': k['variant']}
  summaries['evaluate'] = runner.run('evaluate', eval_inputs, lambda d: stage_evaluate(config, runner, resources, d),
                                     deps=tuple(deps), code=EVAL_CODE, resumable=True)
  results = write_results(config, runner, workdir, summaries)
  if shared.trains(config) and sharding.is_main_process():
    export(config, runner, os.path.join(workdir, 'compressor'))
  return results


def export(config, runner: StageRunner, directory: str) -> str:
  """``{directory}/compressor.json`` of the first seed's K-COMP (``recomp_jax.load_compressor``)."""
  from recomp_jax.compressors.base import write_export  # pylint: disable=import-outside-toplevel
  c = config.compressor
  seed = min(config.train.seeds)
  model = os.path.join(runner.stage_dir(f'train_kcomp_seed{seed}'), 'compressor_best')
  return write_export(directory, kcomp.export_spec(model, top_docs=config.kcomp.top_docs,
                                                   max_source_length=c.max_source_length,
                                                   max_new_tokens=c.max_new_tokens,
                                                   batch_size=c.generate_batch_size, eom=eom(config)))


def aggregate(records: dict[str, dict]) -> tuple[list[dict], dict[str, dict]]:
  """Schema rows (trained rows: the mean over seeds of each question's scores) and per row key
  the per-question scores for the bootstrap."""
  rows, per_question = [], {}
  for key in ROW_KEYS:
    recs = [r for rid, r in sorted(records.items()) if rid.split('@')[0] == key]
    if not recs:
      continue
    ids = recs[0]['ids']
    scores = {m: np.mean([r[f'{m}_per_example'] for r in recs], axis=0) for m in METRICS}
    row = {'key': key, 'name': ROW_NAMES[key], **{m: 100.0 * float(scores[m].mean()) for m in METRICS},
           'tokens': float(np.mean([r['tokens'] for r in recs])), 'n': len(ids),
           'reader_seconds_per_question': float(np.mean([r['reader_seconds_per_question'] for r in recs])),
           'compressor_seconds_per_question': float(np.mean([r['compressor_seconds_per_question'] for r in recs])),
           'reader_answers_cached': int(sum(r.get('reader_answers_cached', 0) for r in recs))}
    if '@' in next(iter(r['row'] for r in recs)):
      row['seeds'] = [int(r['row'].split('@')[1]) for r in recs]
      row.update({f'{m}_per_seed': [r[m] for r in recs] for m in METRICS})
      row['empty_summary_pct'] = 100.0 * float(np.mean([r['empty_summary'] for r in recs])) / max(len(ids), 1)
    rows.append(row)
    per_question[key] = {'ids': ids, **scores}
  return rows, per_question


def bootstrap(per_question: dict[str, dict], seed: int) -> list[dict]:
  """K-COMP minus every other row, per metric (percentage points, 95% interval)."""
  out = []
  for a in COMPARED:
    if a not in per_question:
      continue
    for b, other in per_question.items():
      if b == a:
        continue
      for m in METRICS:
        r = qa_metrics.paired_bootstrap(per_question[a][m], other[m], seed=seed)
        out.append({'a': a, 'b': b, 'metric': m, 'delta': 100 * r.diff, 'lo': 100 * r.low, 'hi': 100 * r.high,
                    'p_value': r.p_value, 'n': len(other['ids'])})
  return out


def notes(config, summaries: dict) -> list[str]:
  out = []
  data = {**summaries.get('data', {}), **summaries['test_data']}
  left = {s: data[s].get('left_out', {}) for s in SPLITS if data.get(s, {}).get('questions')}
  out.append(f"Retrieval: BM25 top-{config.kcomp.top_docs} over {data['corpus_passages']} MedQuAD passages, each "
             f"question's own answer left out (passages removed above the last one kept, per split: {left}).")
  if 'knowledge' in summaries:
    k = {**summaries['knowledge'], 'test': data['test']['entities']}
    out.append('Table 1 (entities named by a corpus title, each with a description outside the question\'s own '
               f"answer; the test questions are only counted; finder: {config.kcomp.entities}): " + '; '.join(
                   f"{s}: {v['kept']} of {v['questions']} kept, dropped {v['dropped']}" for s, v in k.items()) + '.')
  if 'targets' in summaries:
    t = summaries['targets']
    source = ("the teacher's summaries (Table 6)" if t['source'] == 'teacher' else
              f"beyond the paper, the {config.kcomp.summary_sentences} sentences (of the first "
              f"{config.kcomp.max_candidates or 'all'} of the passages) under which the reader gives the reference "
              f"answer's first {config.kcomp.answer_tokens} tokens the highest log-likelihood (reader_sentence)")
    out.append(f'Summary targets: {source}; ' + '; '.join(
        f"{s}: {v['questions']} questions, {v['empty']} empty, {v['mean_words']:.1f} words on average"
        for s, v in t.items() if isinstance(v, dict)) + '.')
  out.append(f'Variant: {config.kcomp.variant}; reader: long-form greedy answers of at most '
             f'{config.reader.max_new_tokens} tokens, cut at {list(config.kcomp.answer_stop)}. UniEval is not '
             'available offline and is not reported.')
  return out


def write_results(config, runner: StageRunner, workdir: str, summaries: dict) -> dict | None:
  """``results.json`` (rows carry ``bertscore_f1`` and ``rougeL`` in place of EM / F1),
  ``predictions.jsonl`` (every row's answer and scores per question) and ``results.md``."""
  if not sharding.is_main_process():
    return None
  from recomp_jax.evaluation import report  # pylint: disable=import-outside-toplevel
  records = read_records(os.path.join(runner.stage_dir('evaluate'), 'rows.jsonl'), key='row')
  rows, per_question = aggregate(records)
  costs = runner.costs()
  trained = next((v for name, v in summaries.items() if name.startswith('train_kcomp_seed')), {})
  results = {
      'system': 'kcomp', 'dataset': config.dataset, 'preset': config.preset, **provenance.git_state(),
      'source_hash': provenance.source_hash(), 'data_hashes': provenance.data_hashes(input_files(config)),
      'versions': provenance.versions(), 'config': config.to_dict(),
      'train_questions': int(trained.get('examples', 0)), 'seeds': list(config.train.seeds) if trained else [],
      'n': int(summaries['evaluate']['test_questions']), 'rows': rows,
      'bootstrap': bootstrap(per_question, config.seed), 'main_metric': 'bertscore_f1',
      'stage_seconds': dict(runner.timings), 'stage_costs': costs, 'stages': summaries,
      'notes': notes(config, summaries),
      'extra_tables': [{'title': 'Table 5: seconds per question (compressor: generating the knowledge and the '
                                 'summary; reader: the long-form answer, per answer decoded in this run)',
                        'header': ['row', 'compressor s/question', 'reader s/question', 'answers from the cache'],
                        'rows': [[r['key'], f"{r['compressor_seconds_per_question']:.2f}",
                                  f"{r['reader_seconds_per_question']:.2f}", str(r['reader_answers_cached'])]
                                 for r in rows]},
                       costs_table(costs)],
  }
  with open(os.path.join(workdir, 'results.json'), 'w') as f:
    json.dump(results, f, indent=2, default=str)
  with open(os.path.join(workdir, 'predictions.jsonl'), 'w', encoding='utf-8') as f:
    for row_id, r in records.items():
      for i, qid in enumerate(r['ids']):
        f.write(json.dumps({'row': row_id, 'id': qid, 'prediction': r['predictions'][i],
                            **{m: r[f'{m}_per_example'][i] for m in METRICS},
                            'tokens': r['tokens_per_example'][i], 'evidence': r['evidence'][i]},
                           ensure_ascii=False) + '\n')
  text = report.render_markdown(results, source=os.path.join(workdir, 'results.json'))
  with open(os.path.join(workdir, 'results.md'), 'w') as f:
    f.write(text)
  print(text, flush=True)
  return results


# ----------------------------------------------------------------------------- config


def default_config():
  """K-COMP at the paper's training setting (§4.3: 3 epochs, AdamW, peak lr 1e-4, 3% warm-up, linear decay)."""
  c = defaults.config_for('kcomp', FIELDS, shared=())
  c.dataset = 'medquad'
  c.train.epochs = 3.0
  c.train.learning_rate = 1e-4
  c.train.schedule = 'linear'
  c.reader.max_new_tokens = 128
  return c


__all__ = ['FIELDS', 'ROW_KEYS', 'ROW_NAMES', 'aggregate', 'bootstrap', 'data_stage', 'default_config', 'run', 'stage_data', 'stage_evaluate', 'stage_knowledge', 'stage_targets', 'stage_train',
           'training_examples', 'validate', 'write_results']
