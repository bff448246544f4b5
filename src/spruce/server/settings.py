"""The server's own limits and their defaults (the engine's are in `Engine.limits`). Import-light: the CLI
reads the defaults for its help without loading FastAPI."""

from __future__ import annotations

from dataclasses import dataclass

MAX_BODY_BYTES = 4 << 20
MAX_QUEUED_REQUESTS = 256
REQUEST_TIMEOUT_S = 600.0
SHUTDOWN_GRACE_PERIOD_S = 30.0
HTTP_TIMEOUT_S = 30.0  # a request's line, headers and body must arrive within this; longer: 408, connection closed
KEEP_ALIVE_TIMEOUT_S = 5.0  # an idle kept-alive connection is closed after this (uvicorn's default)
MAX_CONNECTIONS = 1000  # open connections served at once; a request on one more gets 503 (below the common
# 1024-descriptor soft limit, beyond which accept() fails and the server stops taking connections)


@dataclass(frozen=True)
class ServingLimits:
    """What one server admits, and how long requests may take."""

    max_body_bytes: int = MAX_BODY_BYTES  # larger bodies: 413
    max_queued_requests: int = MAX_QUEUED_REQUESTS  # engine requests waiting beyond the running set; more: 503
    request_timeout: float | None = REQUEST_TIMEOUT_S  # seconds a request may run; longer: 504 (None: no limit)
    shutdown_grace_period: float = SHUTDOWN_GRACE_PERIOD_S  # seconds running requests get to finish on shutdown

    def __post_init__(self):
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds (or None: no limit), got {self.request_timeout}")
        if not self.shutdown_grace_period >= 0:
            raise ValueError(f"shutdown_grace_period must be >= 0 seconds, got {self.shutdown_grace_period}")
