"""spruce: LLM inference with EAGLE tree speculative decoding on a paged KV cache."""

from spruce.errors import ConfigError, InvalidRequestError, InvariantError, ModelLoadError, SpruceError
from spruce.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "SpruceError", "ConfigError", "InvalidRequestError", "InvariantError",
           "ModelLoadError", "__version__"]


def __getattr__(name):
    """Lazy attributes: importing spruce stays cheap (no torch model code) until LLM is used."""
    if name == "LLM":
        from spruce.llm import LLM

        return LLM
    if name == "__version__":  # the installed distribution's version (pyproject.toml)
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("spruce")
        except PackageNotFoundError:  # run from a source tree on PYTHONPATH, not installed
            return "0+source"
    raise AttributeError(name)
