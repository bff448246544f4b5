"""Errors spruce raises. Each names the offending value and what was expected."""


class SpruceError(Exception):
    """Base class for every error spruce raises on purpose."""


class ConfigError(SpruceError, ValueError):
    """An engine setting (or a combination of settings) is not supported."""


class ModelLoadError(SpruceError):
    """A checkpoint is missing, corrupt, or of an unsupported architecture."""


class InvalidRequestError(SpruceError, ValueError):
    """A request (prompt or sampling parameters) is malformed or out of range.

    `field` names the offending parameter so that servers can report it.
    """

    def __init__(self, message: str, field: str | None = None, status: int = 400):
        super().__init__(message)
        self.field = field
        self.status = status


class InvariantError(SpruceError, AssertionError):
    """An always-on invariant failed: the engine refused to run a launch that would corrupt memory."""


class WorkerFailedError(SpruceError, RuntimeError):
    """A tensor-parallel worker process died or failed: the engine cannot go on (its message names the rank,
    its exit code and its last error)."""
