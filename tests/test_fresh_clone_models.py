"""test_models_vs_hf.py's fixture-model test, run again on the bundled demo model (pycode-6m, a trained
Llama) so that a fresh clone covers it: a real checkpoint's logits (paged prefill, chunked prefill, decode)
equal transformers' in float32.

The test is imported unchanged; in this module `pycode19m` is the bundled model and `heldout_prompts` are
prompts of real Python from the standard library.
"""

from __future__ import annotations

import pytest

from checkpoints import python_source_prompts
from spruce.config import builtin_model_path
from test_models_vs_hf import test_pycode19m_logits_equal_transformers  # noqa: F401  (collected again here)


@pytest.fixture(scope="session")
def pycode19m():
    return builtin_model_path()


@pytest.fixture(scope="session")
def heldout_prompts():
    return python_source_prompts()
