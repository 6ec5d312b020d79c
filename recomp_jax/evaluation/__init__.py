"""Evaluation: QA metrics, evaluation rows and the result files.

``qa_metrics.py``  SQuAD EM / F1, answer matching, paired bootstrap intervals
``rows.py``        evidence rows read by the reader: shared rows, evaluation loop, seed folding
``report.py``      results.json -> markdown, README tables (``python -m recomp_jax.evaluation.report``)
"""
