"""Test helper: a program of `bench/` (a script, not a package module) loaded as a module, so tests can call its
functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load(name: str) -> ModuleType:
    """bench/<name>.py as a module."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
