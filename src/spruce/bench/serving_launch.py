"""Servers that `spruce bench serving --launch` starts itself: `spruce serve` as a child process on a free loopback
port, driven only through its HTTP API, then stopped (SIGTERM: the graceful drain); optionally each on CPUs of its
own (`--pin-cpus`, `cpu_sets`), which its engine process inherits, the sets rotated between passes (`rotated`,
`pin_tree`)."""

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


def cpu_core(cpu: int) -> tuple[int, int]:
    """The physical core of logical CPU `cpu`: (package, core id) from Linux's sysfs topology, or (0, cpu) where
    that is not readable (each CPU then a core of its own)."""
    topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return int((topology / "physical_package_id").read_text()), int((topology / "core_id").read_text())
    except (OSError, ValueError):
        return 0, cpu


def check_cpus_per_server(per_server: int) -> None:
    """ValueError naming `per_server` unless it is a CPU count `cpu_sets` takes (>= 0; 0: automatic)."""
    if per_server < 0:
        raise ValueError(f"--cpus-per-server must be >= 0 (0: automatic), got {per_server}")


def cpu_sets(servers: int, cpus: list[int], core=cpu_core, per_server: int = 0) -> tuple[list[int], list[list[int]]]:
    """Split `cpus` (this process's affinity) into the client's CPUs and one disjoint set per server: each server
    `per_server` CPUs, or with 0 len(cpus) // (2 x servers) (a server is two busy processes, HTTP and engine), the
    client the rest (its processes parse every streamed chunk; with 0 at least half of `cpus`). The CPUs are dealt in
    the order of their physical cores (`core(cpu)`), so the hardware threads of one core go to one server or to the
    client: dealt in number order on a machine whose core k holds CPUs k and k + n/2, as Linux numbers them, every
    server's CPUs shared cores with the client's, whose load then took the server's cycles.

    The default gives a server of a 16-CPU machine shared by four two CPUs for its two processes, which keep ~1.7 of
    them busy on an H200 host; `--cpus-per-server` gives more, which keeps a server off a CPU queue.
    ValueError when the servers' CPUs leave the client none (or, by default, fewer than two CPUs a server)."""
    check_cpus_per_server(per_server)
    per = per_server or (len(cpus) // (2 * servers) if servers > 0 else 0)
    if per < 1 or per * servers >= len(cpus):
        need = per_server * servers + 1 if per_server else 2 * servers + 1
        raise ValueError(f"--pin-cpus needs at least {need} CPUs for {servers} servers"
                         + (f" of {per_server} CPUs" if per_server else "")
                         + f" and the client, this process may run on {len(cpus)} ({cpus})")
    cpus = sorted(cpus, key=lambda cpu: (core(cpu), cpu))
    return sorted(cpus[per * servers:]), [sorted(cpus[i * per:(i + 1) * per]) for i in range(servers)]


def rotated(sets: list[list[int]], pass_index: int) -> list[list[int]]:
    """The CPU sets of servers 0, 1, ... in pass `pass_index` (from 0): server i takes set (i + pass) mod n, so over
    any n passes in a row each server runs on every set once (`--pin-cpus`: sets of one machine's CPUs differ, and
    a server on a slower set would trail whichever engine it runs)."""
    n = len(sets)
    return [sets[(i + pass_index) % n] for i in range(n)]


def pin_tree(pid: int, cpus: list[int]) -> int:
    """Move process `pid`, every process it started and all their threads to `cpus` (Linux: /proc); returns the
    threads moved. A thread or process that ends meanwhile is skipped."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, moved = [pid], 0
    while tree:
        proc = tree.pop()
        tree.extend(parents.get(proc, ()))
        for task in Path(f"/proc/{proc}/task").glob("[0-9]*"):
            try:
                os.sched_setaffinity(int(task.name), cpus)
                moved += 1
            except (ProcessLookupError, FileNotFoundError):
                continue
    return moved


def start_process(cmd: list[str], log, cpus: list[int] | None = None,
                  env: dict[str, str] | None = None) -> subprocess.Popen:
    """`cmd` in a new session, its output to `log`; with `cpus`, it and every process it starts run only there;
    `env`: its environment (None: this process's)."""
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pin,
                            env=env)


def source_env(src: str | None) -> dict[str, str] | None:
    """The environment of a server that imports spruce from the source tree `src` (a directory holding spruce/,
    e.g. another commit's src/ from `git archive`) instead of this one's: this process's environment with `src`
    first on PYTHONPATH, which the server's engine process inherits (None: `src` None, this process's own)."""
    if src is None:
        return None
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(src).resolve()), env.get("PYTHONPATH")) if p)
    return env


def check_source(src: str) -> None:
    """ValueError naming `src` unless it is a source tree holding the spruce package (spruce/__init__.py)."""
    if not (Path(src) / "spruce" / "__init__.py").is_file():
        raise ValueError(f"--launch-src: {src!r} holds no spruce package (expected {src}/spruce/__init__.py, e.g. "
                         f"another commit's src/ from `git archive`)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """`with LaunchedServer(flags, log_path, timeout) as base_url:` a `spruce serve` child answering /health (with
    `cpus`: running only on those CPUs; with `src`: importing spruce from that source tree, `source_env`)."""

    def __init__(self, flags: list[str], log_path: Path, timeout: float, cpus: list[int] | None = None,
                 src: str | None = None):
        self.flags, self.log_path, self.timeout, self.cpus, self.src = flags, log_path, timeout, cpus, src
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "spruce.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *self.flags]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        self.proc = start_process(cmd, self._log, self.cpus, source_env(self.src))
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

    def pin(self, cpus: list[int]) -> None:
        """Move the running server (its HTTP and engine processes, every thread) to `cpus`."""
        if pin_tree(self.proc.pid, cpus) == 0:
            raise RuntimeError(f"could not move server process {self.proc.pid} to CPUs {cpus}: it is not running")
        self.cpus = cpus

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
