"""Triton when it is installed, and stand-ins that keep the kernel modules importable when it is not.

Triton is an optional dependency (`pip install 'spruce[triton]'`). Every module that defines kernels imports
`triton` and `tl` from here, never from Triton itself. Without Triton, `triton.jit` returns a `MissingKernel`
that refuses to launch, so importing spruce and running the torch reference paths (the CPU default) never
needs it; choosing the triton attention backend is refused earlier, when the config is validated.
"""

from __future__ import annotations

import os

from spruce.errors import ConfigError

INSTALL_HINT = "pip install 'spruce[triton]'"

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


def interpreter_on() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (TRITON_INTERPRET, read as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def missing_triton_error(what: str) -> ConfigError:
    """The error for using `what` (a kernel, a backend) without Triton installed."""
    return ConfigError(f"{what} needs Triton, which is not installed: {INSTALL_HINT}")


class MissingKernel:
    """What `@triton.jit` gives without Triton: a kernel that raises when launched (`kernel[grid](...)`)."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        raise missing_triton_error(f"the Triton kernel {self.fn.__name__}")


class _MissingTriton:
    """Stands in for the `triton` module: `jit` (bare or with options) defines a MissingKernel."""

    @staticmethod
    def jit(fn=None, **options):
        return MissingKernel if fn is None else MissingKernel(fn)

    def __getattr__(self, name):
        raise missing_triton_error(f"triton.{name}")


class _MissingLanguage:
    """Stands in for `triton.language`: `constexpr(v)` (for kernel globals) is v itself."""

    @staticmethod
    def constexpr(value):
        return value

    def __getattr__(self, name):
        raise missing_triton_error(f"triton.language.{name}")


if not HAS_TRITON:
    triton, tl = _MissingTriton(), _MissingLanguage()
