"""Tensor parallelism (DESIGN §18), one idea per file:

group.py              the process groups and the collectives (device: NCCL / gloo; control: gloo)
layers.py             column-, row- and vocab-parallel layers; which dimensions a tp_size must divide
checkpoint.py         reading only a rank's part of a safetensors tensor

The engine that drives the ranks (runtime/replicated_engine.py) and starts them (runtime/launch.py) sit above
these, in runtime: this package imports nothing of spruce but its errors.
"""
