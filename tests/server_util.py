"""Test helpers: a real uvicorn server on 127.0.0.1 (free port) in a background thread, serving the bundled
pycode-6m model with speculation on (a small random EAGLE-3 draft); `spruce serve` as a subprocess; log
capture; Prometheus scraping."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from checkpoints import write_eagle3_checkpoint
from spruce.config import builtin_model_path

MODEL_NAME = "pycode-6m"
SPEC = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=4)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Server tests run the engine, the event loop and the clients in one process: one intra-op thread keeps
    torch from oversubscribing the (2) cores, which otherwise slows this tiny model's steps many times over."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def engine_kwargs(draft_dir: Path, **overrides) -> dict:
    """LLM(...) kwargs for the bundled model with a random EAGLE-3 head written to `draft_dir`. The prefix cache
    is off unless asked for, so that an idle server holds no KV page (tests check that after every abort);
    tests/test_server_tooling.py serves with it on."""
    draft = write_eagle3_checkpoint(draft_dir, builtin_model_path(), seed=1)
    kw = dict(draft_model=str(draft), page_size=4, max_running_requests=8, disable_radix_cache=True, **SPEC)
    kw.update(overrides)
    return kw


class ServerThread:
    """`create_app` + uvicorn (spruce's GracefulServer, as `spruce serve` runs it) on a pre-bound loopback
    socket, run in a daemon thread. `exit_on_engine_failure`: shut down when the engine fails, as `spruce serve`
    does (default: keep answering 503, as with --keep-alive-on-engine-failure). `engine_loop`: what serves
    (default: an EngineLoop stepping `engine` in a thread; a ProcessEngineLoop serves from an engine process)."""

    def __init__(self, engine, *, api_key: str | None = None, exit_on_engine_failure: bool = False,
                 engine_loop=None, **app_kwargs):
        import uvicorn

        from spruce.server import EngineLoop, create_app
        from spruce.server.graceful import GracefulServer

        self.engine = engine
        self.engine_loop = engine_loop or EngineLoop(engine)
        app = create_app(self.engine_loop, model_name=MODEL_NAME, api_key=api_key, **app_kwargs)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = GracefulServer(config, app.state.drain,
                                     app.state.engine_failure if exit_on_engine_failure else None)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post_v1(self, path: str, body: dict, timeout: float = 60) -> "httpx.Response":
        """POST `body` as JSON to /v1/`path` (e.g. "completions")."""
        import httpx

        return httpx.post(f"{self.base_url}/v1/{path}", json=body, timeout=timeout)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def metric(text: str, name: str) -> float:
    """A sample's value from Prometheus text (the first line named exactly `name`, labels included)."""
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert m, f"metric {name} not in /metrics"
    return float(m.group(1))


def wait_idle(base_url: str, timeout: float = 20.0) -> str:
    """Poll /metrics until no request runs or waits and no KV page is used but the prefix cache's; returns the
    last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
        cached = metric(text, "spruce_prefix_cache_pages") if "spruce_prefix_cache_pages " in text else 0
        busy = sum(metric(text, n) for n in ("spruce_requests_running", "spruce_requests_waiting",
                                             "spruce_kv_pages_used")) - cached
        if busy == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def server_errors(text: str) -> dict[int, float]:
    """spruce_request_errors_total by HTTP status, from a /metrics scrape."""
    found = re.findall(r'^spruce_request_errors_total\{status="(\d+)"\} (\S+)$', text, re.MULTILINE)
    return {int(status): float(value) for status, value in found}


def five_xx(base_url: str) -> float:
    """How many requests the server has answered with a 5xx status so far."""
    errors = server_errors(httpx.get(f"{base_url}/metrics", timeout=10).text)
    return sum(v for status, v in errors.items() if status >= 500)


class LogRecorder(logging.Handler):
    """Collects the records of the server's loggers (uvicorn's do not propagate to the root, so pytest's caplog
    misses them) while used as a context manager."""

    LOGGERS = ("spruce", "uvicorn", "uvicorn.error", "uvicorn.access")

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> "LogRecorder":
        self.spruce_level = logging.getLogger("spruce").level
        logging.getLogger("spruce").setLevel(logging.DEBUG)
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)
        logging.getLogger("spruce").setLevel(self.spruce_level)

    def wait_for(self, text: str, timeout: float = 10.0) -> None:
        """Wait until a record's message contains `text`."""
        deadline = time.monotonic() + timeout
        while not any(text in r.getMessage() for r in list(self.records)):
            assert time.monotonic() < deadline, f"no log record containing {text!r}"
            time.sleep(0.02)

    def problems(self) -> list[str]:
        """Records at ERROR or above, or carrying a traceback."""
        return [f"{r.levelname} {r.name}: {r.getMessage()}" for r in self.records
                if r.levelno >= logging.ERROR or r.exc_info]


class ServeProcess:
    """`spruce serve` (the bundled demo model and its draft head) as a subprocess on a free loopback port,
    its log in a file."""

    def __init__(self, log_path: Path, *args: str):
        self.log_path = log_path
        self.log_file = open(log_path, "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "spruce.cli", "serve", "--port", "0", *args],
                                     stdout=self.log_file, stderr=subprocess.STDOUT, env=env)
        self.base_url = ""

    def start(self, timeout: float = 60.0) -> "ServeProcess":
        """Wait for uvicorn's "running on" line, logged once the app has started, and read the port from it."""
        deadline = time.monotonic() + timeout
        while not self.base_url:
            found = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", self.log())
            if found:
                self.base_url = found.group(1)
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"spruce serve did not start:\n{self.log()}")
            else:
                time.sleep(0.1)
        return self

    def log(self) -> str:
        return self.log_path.read_text()

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.log_file.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log_file.close()
