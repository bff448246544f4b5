"""Fixtures that stand the bundled demo model (pycode-6m) in for the pycode-19m fixture model, so that the
fresh-clone twins (tests/test_fresh_clone_*.py) rerun the fixture-model tests on a clone without ../shared."""

from __future__ import annotations

import pytest

from checkpoints import python_source_prompts
from spruce.config import builtin_model_path


@pytest.fixture(scope="session")
def pycode19m():
    return builtin_model_path()


@pytest.fixture(scope="session")
def heldout_prompts():
    return python_source_prompts()
