"""Servers that `spruce bench serving --launch` starts itself: `spruce serve` as a child process on a free loopback
port, one configuration at a time, driven only through its HTTP API, then stopped (SIGTERM: the graceful drain)."""

from __future__ import annotations

import os
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


def physical_cores(cpus: set[int]) -> dict[tuple[int, int], list[int]]:
    """The logical CPUs of `cpus` grouped by physical core ((package, core) from Linux's sysfs topology; a CPU
    whose topology is unreadable is a core of its own)."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(cpus):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = (int((topology / "physical_package_id").read_text()), int((topology / "core_id").read_text()))
        except (OSError, ValueError):
            key = (-1, cpu)
        cores.setdefault(key, []).append(cpu)
    return cores


def plan_cpu_sets(num_servers: int, per_server: int = 2, min_client: int = 2,
                  available: set[int] | None = None) -> tuple[list[set[int]], set[int]]:
    """CPU sets for launched servers and for the benchmark's client: each server gets `per_server` CPUs (its
    HTTP process and its engine process), each the only CPU in use on its physical core (its SMT siblings are
    left idle), the client every CPU of the remaining cores. On the H100 machine the same server's tokens/s moved
    10-40% from pass to pass, in some levels with every part of one engine process's step ~45% slower at once
    (2026-11-23): processes sharing a physical core. Raises ValueError when the machine has too few cores."""
    available = set(os.sched_getaffinity(0)) if available is None else available
    cores = list(physical_cores(available).values())
    needed = num_servers * per_server
    if len(cores) - needed < min_client:
        raise ValueError(f"--pin-cpus: {len(available)} CPUs on {len(cores)} physical cores cannot give {num_servers} "
                         f"servers {per_server} cores each and the client {min_client} (it needs "
                         f"{needed + min_client} cores)")
    servers = [{cores[i * per_server + j][0] for j in range(per_server)} for i in range(num_servers)]
    client = {cpu for core in cores[needed:] for cpu in core}
    return servers, client


class LaunchedServer:
    """`with LaunchedServer(flags, log_path, timeout) as base_url:` a `spruce serve` child answering /health
    (`cpus`: the CPUs it and its engine process may run on; None: any)."""

    def __init__(self, flags: list[str], log_path: Path, timeout: float, cpus: set[int] | None = None):
        self.flags, self.log_path, self.timeout, self.cpus = flags, log_path, timeout, cpus
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "spruce.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *self.flags]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        cpus = self.cpus
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
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
