"""test_models_vs_hf.py's fixture-model test, run again on the bundled demo model (pycode-6m, a trained
Llama) so that a fresh clone covers it: a real checkpoint's logits (paged prefill, chunked prefill, decode)
equal transformers' in float32.

The test is imported unchanged; in this module `pycode19m` is the bundled model and `heldout_prompts` are
prompts of real Python from the standard library.
"""

from __future__ import annotations

from bundled_fixtures import heldout_prompts, pycode19m  # noqa: F401  (the bundled model stands in)
from test_models_vs_hf import test_pycode19m_logits_equal_transformers  # noqa: F401  (collected again here)
