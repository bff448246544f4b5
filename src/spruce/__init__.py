"""spruce: LLM inference with EAGLE tree speculative decoding on a paged KV cache."""

from spruce.errors import ConfigError, InvalidRequestError, InvariantError, ModelLoadError, SpruceError
from spruce.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "SpruceError", "ConfigError", "InvalidRequestError", "InvariantError",
           "ModelLoadError"]


def __getattr__(name):
    if name == "LLM":  # lazy: importing spruce stays cheap (no torch model code) until LLM is used
        from spruce.llm import LLM

        return LLM
    raise AttributeError(name)
