"""Test helpers: a real uvicorn server on 127.0.0.1 (free port) in a background thread, serving the bundled
pycode-6m model with speculation on (a small random EAGLE-3 draft)."""

from __future__ import annotations

import re
import socket
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
    """LLM(...) kwargs for the bundled model with a random EAGLE-3 head written to `draft_dir`."""
    draft = write_eagle3_checkpoint(draft_dir, builtin_model_path(), seed=1)
    kw = dict(draft_model=str(draft), page_size=4, max_running_requests=8, **SPEC)
    kw.update(overrides)
    return kw


class ServerThread:
    """`create_app` + uvicorn on a pre-bound loopback socket, run in a daemon thread."""

    def __init__(self, engine, *, api_key: str | None = None, **app_kwargs):
        import uvicorn

        from spruce.server import EngineLoop, create_app

        self.engine = engine
        self.engine_loop = EngineLoop(engine)
        app = create_app(self.engine_loop, model_name=MODEL_NAME, api_key=api_key, **app_kwargs)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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


def metric(text: str, name: str) -> float:
    """A sample's value from Prometheus text (the first line named exactly `name`, labels included)."""
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert m, f"metric {name} not in /metrics"
    return float(m.group(1))


def wait_idle(base_url: str, timeout: float = 20.0) -> str:
    """Poll /metrics until no request runs or waits and no KV page is used; returns the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
        busy = sum(metric(text, n) for n in ("spruce_requests_running", "spruce_requests_waiting",
                                             "spruce_kv_pages_used"))
        if busy == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.05)
