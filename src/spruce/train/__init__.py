"""Draft-head training (`spruce train-draft`): EAGLE-3 heads, or one MTP layer (NEXTN), for a target.

data.py (documents -> packed token windows), vocab.py (d2t / t2d), target.py (the frozen target's features and
distributions), head.py (the trainable EAGLE-3 head, TTT-unrolled), mtp_head.py (the trainable MTP layer, the
same unrolling), trainer.py (loss and loop), checkpoint.py (the published checkpoint formats, resumable state),
evaluate.py (acceptance measured with spruce), cli.py.
"""
