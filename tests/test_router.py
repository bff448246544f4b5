"""Replicas behind SGLang's router (`sglang-router`, in the `[test]` extra): two `spruce serve` workers on the
bundled demo model behind `python -m sglang_router.launch_router --policy cache_aware`, started once for the module.

What the router reads from a worker (it registers one through /health, /server_info and /model_info, reports
loads through /get_load) and what it does with it: requests spread over both workers, a prompt whose prefix one
worker has cached goes to that worker (its prefix-cache hits say so), and a worker killed mid-load leaves every
request served by the other or failed with an error (none hangs), while the router's health view marks it down.
The killing test runs last: it takes a worker away from the module's fixture.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from server_util import ServeProcess
from spruce.config import builtin_model_path

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install -e '.[test]')")

MODEL = "pycode-6m"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RouterProcess:
    """SGLang's router on a free loopback port in front of `worker_urls`, checking their health every second (a
    worker is down after one failed check), its log in a file."""

    def __init__(self, log_path: Path, worker_urls: list[str]):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log_file = open(log_path, "w")
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
               "--worker-urls", *worker_urls, "--policy", "cache_aware",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--log-level", "warn"]
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT)

    def wait_ready(self, workers: int, timeout: float = 30.0) -> "RouterProcess":
        """Wait until the router has registered `workers` healthy workers (it registers them in the background)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = httpx.get(f"{self.base_url}/readiness", timeout=2)
                if r.status_code == 200 and r.json().get("healthy_workers") == workers:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the router did not register {workers} workers:\n{self.log_path.read_text()}")
            time.sleep(0.1)

    def workers(self) -> dict[str, dict]:
        """The router's view of its workers, by URL."""
        return {w["url"]: w for w in httpx.get(f"{self.base_url}/workers", timeout=5).json()["workers"]}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log_file.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """(router, [worker, worker]): two workers serving the bundled model plainly, the router in front."""
    logs = tmp_path_factory.mktemp("router")
    flags = ("--model", str(builtin_model_path()), "--served-model-name", MODEL, "--disable-engine-process",
             "--context-length", "512", "--max-running-requests", "8")
    workers = [ServeProcess(logs / f"worker{i}.log", *flags) for i in range(2)]  # both start now
    router = None
    try:
        for w in workers:
            w.start()
        # started once the workers answer: it registers them at once (a worker not up yet it retries after seconds)
        router = RouterProcess(logs / "router.log", [w.base_url for w in workers]).wait_ready(2)
        yield router, workers
    finally:
        if router is not None:
            router.kill()
        for w in workers:
            w.kill()


def scrape(worker, name: str) -> float:
    """The sum of a worker's Prometheus samples named `name` (over their labels)."""
    text = httpx.get(f"{worker.base_url}/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def finished(worker) -> float:
    return scrape(worker, "spruce_requests_finished_total")


def complete(router, prompt: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{router.base_url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True})


def all_at_once(router, prompts: list[str], max_tokens: int = 4) -> list[httpx.Response]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(router, p, max_tokens), prompts))


def module_source(i: int) -> str:
    """A Python module of about 250 tokens, different for each i (a prompt prefix)."""
    return f"# module {i}\n" + "\n".join(f"def f_{i}_{j}({WORDS[(i + j) % 18]}, {WORDS[(3 * i + j) % 18]}):\n"
                                         f"    return {WORDS[(j + 5) % 18]}" for j in range(12))


def test_the_router_registers_spruce_workers_with_their_model_and_loads(fleet):
    router, workers = fleet
    seen = router.workers()
    assert set(seen) == {w.base_url for w in workers}
    for w in seen.values():  # from /server_info and /model_info
        assert w["model_id"] == MODEL and w["is_healthy"]
        assert w["metadata"]["model_type"] == "llama"
        assert w["metadata"]["architectures"] == '["LlamaForCausalLM"]'
    loads = httpx.get(f"{router.base_url}/get_loads", timeout=10).json()["workers"]  # each worker's /get_load
    assert sorted(x["worker"] for x in loads) == sorted(seen) and all(x["load"] == 0 for x in loads)
    # the router merges its workers' /metrics, one of them idle: families must agree on their label names
    assert complete(router, "import os\n").status_code == 200
    merged = httpx.get(f"{router.base_url}/engine_metrics", timeout=10)
    assert merged.status_code == 200, merged.text
    for w in workers:
        assert f'spruce_requests_running{{worker_addr="{w.base_url}"}} ' in merged.text
    assert 'vllm_e2e_request_latency_seconds_count{' in merged.text


def test_requests_spread_over_both_workers(fleet):
    router, workers = fleet
    before = [finished(w) for w in workers]
    responses = all_at_once(router, [f"{WORDS[i]} = {i}\n" for i in range(8)])  # no two share a prefix
    assert [r.status_code for r in responses] == [200] * 8
    served = [finished(w) - b for w, b in zip(workers, before)]
    assert sum(served) == 8 and min(served) >= 1, served


def test_a_shared_prefix_goes_to_the_worker_that_cached_it(fleet):
    """Six prefixes, each sent once (they spread over both workers, so each is cached on one), then six prompts
    that extend them: each one's cached tokens say it reached the worker holding its prefix."""
    router, workers = fleet
    prefixes = [module_source(100 + i) for i in range(6)]
    before = [finished(w) for w in workers]
    first = all_at_once(router, [p + "\n# what does it return?\n" for p in prefixes])
    assert [r.status_code for r in first] == [200] * 6
    spread = [finished(w) - b for w, b in zip(workers, before)]
    assert min(spread) >= 1, f"the prefixes all went to one worker ({spread}): the test would prove nothing"
    hits_before = [scrape(w, "spruce_prefix_cache_hit_tokens_total") for w in workers]
    second = all_at_once(router, [p + "\n# another, longer question about it\n" for p in prefixes])
    assert [r.status_code for r in second] == [200] * 6
    prefix_tokens = [r.json()["usage"]["prompt_tokens"] for r in first]
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in second]
    page = 16  # the CPU page size: the prefix cache serves whole pages
    assert all(c >= n - 8 - page for c, n in zip(cached, prefix_tokens)), (cached, prefix_tokens)
    hits = sum(scrape(w, "spruce_prefix_cache_hit_tokens_total") for w in workers) - sum(hits_before)
    assert hits == sum(cached)


def test_a_worker_killed_mid_load_leaves_no_request_hanging_and_the_router_marks_it_down(fleet):
    router, (survivor, victim) = fleet
    prompts = [f"{WORDS[i]} = Node({i})\nclass Node:\n    def __init__(self" for i in range(8)]
    start = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as pool:
        calls = [pool.submit(complete, router, p, 32) for p in prompts]
        deadline = time.monotonic() + 20
        while True:  # the victim runs some of them (its own load report)
            load = httpx.get(f"{victim.base_url}/get_load", timeout=5).json()[0]
            if load["num_reqs"] >= 1:
                break
            assert time.monotonic() < deadline, "the router sent the victim no request"
            time.sleep(0.02)
        assert load["num_tokens"] >= load["num_reqs"] * 10  # each prompt is more than 10 tokens
        victim.kill()
        outcomes = [c.result() for c in calls]
    assert time.monotonic() - start < 45
    for r in outcomes:
        if r.status_code == 200:  # served whole, by the survivor (the victim's requests retried there)
            assert r.json()["usage"]["completion_tokens"] == 32
        else:  # or a clear error
            assert r.status_code >= 500 and r.text, r.status_code
    assert sum(r.status_code == 200 for r in outcomes) >= 1
    deadline = time.monotonic() + 15
    while router.workers()[victim.base_url]["is_healthy"]:
        assert time.monotonic() < deadline, "the router still calls the killed worker healthy"
        time.sleep(0.1)
    assert router.workers()[survivor.base_url]["is_healthy"]
    readiness = httpx.get(f"{router.base_url}/readiness", timeout=5).json()
    assert readiness["healthy_workers"] == 1 and readiness["total_workers"] == 2
    assert complete(router, "def after(x):\n").status_code == 200
