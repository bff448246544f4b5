"""Draft-head training (`spruce train-draft`): EAGLE-3 heads for Llama-family targets.

data.py (documents -> packed token windows), vocab.py (d2t / t2d), target.py (the frozen target's features and
distributions), head.py (the trainable head, TTT-unrolled), trainer.py (loss and loop), checkpoint.py (the
published checkpoint format, resumable state), evaluate.py (acceptance measured with spruce), cli.py.
"""
