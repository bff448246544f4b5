"""Attention: the ForwardBatch contract, the backend interface, its registry and its implementations.

Attributes load lazily, so `spruce.attention.registry` (backend names and capabilities) imports without torch.
"""

__all__ = ["AttentionBackend", "ForwardBatch", "Phase", "create_backend"]


def __getattr__(name):
    if name in ("AttentionBackend", "create_backend"):
        from spruce.attention import backend

        return getattr(backend, name)
    if name in ("ForwardBatch", "Phase"):
        from spruce.attention import metadata

        return getattr(metadata, name)
    raise AttributeError(name)
