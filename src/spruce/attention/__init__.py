"""Attention: the ForwardBatch contract, the backend interface and its implementations."""

from spruce.attention.backend import AttentionBackend, create_backend
from spruce.attention.metadata import ForwardBatch, Phase

__all__ = ["AttentionBackend", "ForwardBatch", "Phase", "create_backend"]
