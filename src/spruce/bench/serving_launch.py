"""Servers that `spruce bench serving --launch` starts itself: `spruce serve` as a child process on a free loopback
port, one configuration at a time, driven only through its HTTP API, then stopped (SIGTERM: the graceful drain)."""

from __future__ import annotations

import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True)
class LaunchConfig:
    """One server configuration: a name and its `spruce serve` engine flags."""

    name: str
    flags: tuple[str, ...]

    @staticmethod
    def parse(text: str) -> "LaunchConfig":
        """'NAME=FLAGS' (FLAGS split as a shell would), e.g. 'adaptive=--speculative-adaptive'."""
        name, sep, flags = text.partition("=")
        if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"--launch {text!r}: expected NAME=FLAGS with NAME of letters, digits, - and _ "
                             f"(e.g. 'plain=--disable-speculative')")
        return LaunchConfig(name, tuple(shlex.split(flags)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """`with LaunchedServer(flags, log_path, timeout) as base_url:` a `spruce serve` child answering /health."""

    def __init__(self, flags: list[str], log_path: Path, timeout: float):
        self.flags, self.log_path, self.timeout = flags, log_path, timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "spruce.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *self.flags]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._close()
                raise RuntimeError(f"`{shlex.join(cmd)}` exited with {self.proc.returncode} before serving; "
                                   f"its log ({self.log_path}) ends:\n{self.log_tail()}")
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    return base_url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"`{shlex.join(cmd)}` did not answer /health within {self.timeout:g} s; its log "
                           f"({self.log_path}) ends:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close()

    def _close(self) -> None:
        if not self._log.closed:
            self._log.close()

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
