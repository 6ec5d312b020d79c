"""End-to-end pipelines: cached, resumable stages wiring data, models, training and evaluation."""
