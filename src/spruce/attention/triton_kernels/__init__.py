"""Triton kernels of the `triton` attention backend."""
