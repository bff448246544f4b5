"""The server's log lines: text (default) or JSON (`--log-format json`: one JSON object per line, for log
collectors), for the server process, uvicorn's loggers and the engine process alike."""

from __future__ import annotations

import json
import logging
import time

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601 with milliseconds), level, logger, message, and the
    traceback as `exception` when there is one.

    e.g. {"time": "2026-01-02T03:04:05.678Z", "level": "INFO", "logger": "spruce.server", "message": "serving"}"""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        entry = {"time": f"{stamp}.{int(record.msecs):03d}Z", "level": record.levelname, "logger": record.name,
                 "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, log_format: str = "text") -> None:
    """The root logger at `level` ("info", ...) writing `log_format` lines to stderr (replacing its handlers)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def uvicorn_log_config(log_format: str) -> dict | None:
    """uvicorn.Config's log_config: uvicorn's own (coloured text) for text; for json none, so that its loggers
    (uvicorn.error, uvicorn.access) reach the root logger's JSON handler."""
    if log_format == "json":
        return None
    from uvicorn.config import LOGGING_CONFIG

    return LOGGING_CONFIG
