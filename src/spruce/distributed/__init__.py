"""Tensor parallelism (DESIGN §18), one idea per file:

group.py              the process groups and the collectives (device: NCCL / gloo; control: gloo)
layers.py             column-, row- and vocab-parallel layers; which dimensions a tp_size must divide
checkpoint.py         reading only a rank's part of a safetensors tensor
replicated_engine.py  one plan per step: rank 0 drives, every rank runs the same engine, digests compared
launch.py             spawned workers or torchrun, and failure handling (reports, watchdog, timeouts)
"""
