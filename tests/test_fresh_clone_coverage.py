"""A fresh clone (no ../shared beside it) skips the tests that need the fixture model pycode-19m; each of them
must also run, as the same test function, in a tests/test_fresh_clone_*.py module on the bundled demo model."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def fresh_clone_tests() -> set:
    """Every test function of the tests/test_fresh_clone_*.py modules (those imported from other modules too)."""
    found = set()
    for path in TESTS.glob("test_fresh_clone_*.py"):
        module = importlib.import_module(path.stem)
        found |= {f for name, f in inspect.getmembers(module, inspect.isfunction) if name.startswith("test_")}
    return found


def test_every_fixture_model_test_has_a_fresh_clone_twin(request):
    """Checks the CPU tests collected in this session that need `pycode19m` (directly or through a fixture)."""
    twins = fresh_clone_tests()
    missing = sorted({item.nodeid.split("[")[0] for item in request.session.items
                      if "pycode19m" in getattr(item, "fixturenames", ()) and "gpu" not in item.keywords
                      and not item.module.__name__.startswith("test_fresh_clone_") and item.function not in twins})
    assert not missing, f"tests that a fresh clone skips, with no twin in tests/test_fresh_clone_*.py: {missing}"
