"""End-to-end pipelines: cached resumable stages, the shared head, one runner, one module per system.

``stages.py``     cached, fingerprinted, resumable stages (StageRunner, ResumableJsonl)
``shared.py``     data -> retrieve -> candidates, and the run's models (Resources)
``runner.py``     shared head -> the system's stages -> evaluation -> results.json / .md
``extractive.py`` RECOMP extractive: label / pairs / train stages and its rows
``defaults.py``   every config field at its default (configs/*.py build on it)
"""
