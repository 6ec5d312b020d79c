"""Training: the sharded jitted loop and everything it needs, shared by every system.

``loop.py``          train state, jitted step factories, the loop (eval, best checkpoint, preemption)
``optim.py``         AdamW + warmup/decay schedules, gradient clipping
``checkpointer.py``  Orbax checkpoints: exact resume, best-k retention
``summaries.py``     TensorBoard scalars, running means, console formatting
``losses.py``        the pure jittable losses of all five systems
``recipes.py``       prompt-masked causal-LM and seq2seq fine-tuning arrays + losses
"""
