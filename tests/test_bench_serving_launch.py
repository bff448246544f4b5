"""`spruce bench serving --launch`: the benchmark starts `spruce serve` itself for each configuration (here plain
and adaptive speculation on the bundled model, on the CPU), with and without the prefix cache, sends every request
a shared prefix, runs the level twice (two passes, both reported) with all four servers up at once and each level
run on each server in turn (--interleave), and writes one result holding every run, with adaptive speculation's
steps and cost tables (and each level to a journal as it completes). A tiny smoke configuration, so CI keeps it
working. Flags that configure launched servers are refused without --launch."""

from __future__ import annotations

import collections
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spruce.cli import main
from checkpoints import python_source_prompts

pytestmark = pytest.mark.slow  # scheduled first (conftest)


def test_launched_runs_with_a_shared_prefix_and_without_the_prefix_cache(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in python_source_prompts(400)))
    out = tmp_path / "results"
    rc = main(["bench", "serving", "--launch", "plain=--disable-speculative", "--launch",
               "adaptive=--speculative-adaptive --speculative-num-steps 2 --speculative-eagle-topk 2 "
               "--speculative-num-draft-tokens 3 --speculative-adaptive-widths 2",
               "--server-args", "--device cpu --page-size 4 --max-running-requests 2", "--compare-prefix-cache",
               "--shared-prefix-tokens", "24", "--prompt-tokens", "6", "--max-tokens", "4", "--concurrency", "2",
               "--num-requests", "3", "--warmup", "1", "--passes", "2", "--interleave", "--rotation", "1",
               "--prompts", str(prompts), "--out-dir", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    result = json.loads(next(out.glob("serving-*.json")).read_text())
    runs = result["figures"]["runs"]
    assert [(r["name"], r["prefix_cache"]) for r in runs] == [("plain", True), ("adaptive", True),
                                                              ("plain", False), ("adaptive", False)]
    assert result["git_commit"] and result["config"]["shared_prefix_tokens"] == 24
    for r in runs:
        assert [lv["pass"] for lv in r["levels"]] == [1, 2]
        lv = r["levels"][0]
        assert lv["completed"] == 3 and lv["mean_output_tokens"] == 4 and lv["prompt_tokens"] == 3 * 30
        assert lv["ttft_s"]["p99"] >= lv["ttft_s"]["p50"] > 0 and lv["e2e_s"]["p50"] > 0
        assert 0 < lv["client_cpu_fraction"] < 4  # the client's CPU seconds per second (threads may add up)
        assert lv["triton_compiles"] is None  # the CPU interpreter compiles nothing: the server counts nothing
        # the engine runs in its own process (the default), which reports its CPU seconds
        assert 0 < lv["engine"]["cpu_seconds"] and 0 <= lv["machine_steal_fraction"] < 1
        assert 0 < lv["engine"]["server_cpu_seconds"]  # and the HTTP process, its own
        # its prefills' launch seconds (part of the launch part) and the admission rounds prefill batching held
        # (none: no --scheduler-delay-factor)
        assert 0 < lv["engine"]["prefill_launch_seconds"] <= lv["engine"]["seconds"]["step.launch"]
        assert lv["engine"]["prefill_holds"] == 0
        # the 24-token prefix is 6 full pages: every request after the warm-up one finds them cached (the one
        # that repeats the warm-up's prompt finds more)
        cached = [level["cached_prompt_tokens"] for level in r["levels"]]
        if not r["prefix_cache"]:
            assert cached == [0, 0]
        else:
            assert all(3 * 24 <= n < 3 * 30 for n in cached), cached
        adaptive = r["name"] == "adaptive"
        assert ("adaptive" in r["server"]["speculative"]) == adaptive
        steps = lv["adaptive_steps"]
        assert (steps is not None and steps["plain"] + steps["speculative"] > 0) == adaptive
        assert (lv["adaptive_costs"] is not None) == adaptive
        if adaptive:  # what the policy compared, after the level: start-up step costs of plain and widths 2, 3
            assert {"step_seconds", "accept_ema"} <= set(lv["adaptive_costs"]) <= {"step_seconds", "accept_ema",
                                                                                   "choice"}
            assert set(lv["adaptive_costs"]["step_seconds"]) == {"0", "2", "3"}
            assert set(steps) == {"plain", "speculative", "probes", "collapsed_steps", "collapsed_requests",
                                  "width_rounds"}
            assert 0 <= steps["collapsed_steps"] <= steps["plain"]  # (a collapsed batch's steps are plain steps)
            assert sum(steps["width_rounds"].values()) == steps["speculative"]
    # --interleave: all four servers ran at once, each level on each server in turn, pass after pass, in the rows
    # of a Williams design (level_order): each pass starts one server later, and no server always follows another;
    # --rotation 1: the second server started first and the passes took the design's rows 1 and 2 (rows 0 and 1:
    # 0, 1, 3, 2, 1, 2, 0, 3)
    starts = sorted((lv["started_at"], k) for k, r in enumerate(runs) for lv in r["levels"])
    assert [k for _, k in starts] == [1, 2, 0, 3, 2, 3, 1, 0]
    assert [r["started"] for r in runs] == [3, 0, 1, 2]
    # each level went to the journal as it completed (what a run cut short by a time limit keeps)
    journal = [json.loads(line) for line in (out / "levels.jsonl").read_text().splitlines()]
    assert sorted((lv["started_at"], lv["server"], lv["prefix_cache"], lv["output_throughput_tok_s"])
                  for lv in journal) == sorted((lv["started_at"], r["name"], r["prefix_cache"],
                                                lv["output_throughput_tok_s"]) for r in runs for lv in r["levels"])
    summary = result["figures"]["summary"]
    assert set(summary) == {"prefix_cache", "no_prefix_cache"} and len(summary["prefix_cache"]["2"]["plain"]) == 2
    assert "concurrency   2: plain" in printed and "-- output tokens/s, no prefix cache" in printed
    assert "median vs the best other: plain " in printed
    assert set(result["figures"]["versus_best_other"]["prefix_cache"]["2"]) == set(summary["prefix_cache"]["2"])
    assert "pass by pass vs the best other of the pass (median): plain " in printed
    assert set(result["figures"]["paired_versus_best_other"]["prefix_cache"]["2"]) == set(summary["prefix_cache"]["2"])


def test_versus_best_other():
    """Each run's median against the best median of the others: the best run is ahead of the second, every other
    behind the best; a run without figures is left out."""
    from spruce.bench.serving import versus_best_other

    got = versus_best_other({"plain": [100.0, 120.0, 110.0], "fixed": [50.0, 60.0], "adaptive": [105.0, 99.0, 121.0],
                             "none": []})
    assert set(got) == {"plain", "fixed", "adaptive"}
    assert got["plain"] == pytest.approx(110 / 105 - 1) and got["adaptive"] == pytest.approx(105 / 110 - 1)
    assert got["fixed"] == pytest.approx(55 / 110 - 1)
    assert versus_best_other({"alone": [1.0]}) == {}


def test_paired_versus_best_other():
    """Pass by pass: a server ahead in every pass is ahead, though its median lies below the other's (the other's
    best pass came when the machine was fast); the passes every run has are the ones paired."""
    from spruce.bench.serving import paired_versus_best_other, versus_best_other

    per_run = {"plain": [100.0, 150.0, 90.0, 160.0, 95.0], "adaptive": [105.0, 155.0, 94.0, 99.0, 98.0]}
    assert versus_best_other(per_run)["adaptive"] < 0  # medians 99 against 100
    got = paired_versus_best_other(per_run)
    assert got["adaptive"] == pytest.approx(155 / 150 - 1)  # ahead in four passes of five: the median pass
    assert got["plain"] == pytest.approx(150 / 155 - 1)
    short = paired_versus_best_other({"a": [10.0, 20.0, 30.0], "b": [11.0], "none": []})
    assert short == {"a": pytest.approx(10 / 11 - 1), "b": pytest.approx(11 / 10 - 1)}


def test_copies_of_a_configuration_count_as_their_mean():
    """CONTROL=1 runs two copies of one configuration (equal flags): a third server is compared pass by pass with the
    mean of the copies, not with the better of the two (the better of two noisy draws, which put the adaptive
    server a median 3.7 points lower at concurrency 8-64); each copy is compared with the other configurations only,
    and with its twin in `paired_versus_twin`."""
    from spruce.bench.serving import paired_versus_best_other, paired_versus_twin, versus_best_other

    per_run = {"plain": [100.0, 150.0], "adaptive": [108.0, 141.0], "plain-again": [120.0, 130.0]}
    configs = {"plain": "", "plain-again": "", "adaptive": "--speculative-adaptive"}
    got = paired_versus_best_other(per_run, configs)
    assert got["adaptive"] == pytest.approx(statistics.median([108 / 110 - 1, 141 / 140 - 1]))
    assert got["plain"] == pytest.approx(statistics.median([100 / 108 - 1, 150 / 141 - 1]))
    assert paired_versus_best_other(per_run)["adaptive"] == pytest.approx(
        statistics.median([108 / 120 - 1, 141 / 150 - 1]))  # each copy a rival of its own: the better of two
    assert versus_best_other(per_run, configs)["adaptive"] == pytest.approx(124.5 / 125 - 1)  # medians 125, 125
    twins = paired_versus_twin(per_run, configs)
    assert set(twins) == {"plain", "plain-again"}
    assert twins["plain"] == pytest.approx(statistics.median([100 / 120 - 1, 150 / 130 - 1]))


def test_runs_on_different_cpu_budgets_are_pooled_apart():
    """`bar_setting`: a result's workload, and for pinned servers how many CPUs each had (from its levels, or a
    journal's), so that only runs of one CPU budget are pooled."""
    from spruce.bench.serving import bar_setting, server_cpus

    config = {"shared_prefix_tokens": 1024, "prompt_tokens": 256}

    def result(*cpu_sets):
        return {"config": config, "figures": {"runs": [{"name": f"s{i}", "levels": [{"cpus": cpus}]}
                                                       for i, cpus in enumerate(cpu_sets)]}}

    assert bar_setting(result([0, 1], [2, 3])) == "prefix1024+256, 2 CPUs a server"
    assert bar_setting(result([0, 1, 2], [3, 4, 5])) == "prefix1024+256, 3 CPUs a server"
    assert bar_setting(result(None, None)) == "prefix1024+256"  # not pinned
    assert server_cpus(result([0], [1, 2])) == [1, 2] and bar_setting(result([0], [1])).endswith(", 1 CPU a server")
    assert bar_setting({"config": {"prompt_tokens": 128}, "figures": {"levels": [{"cpus": [4, 5, 6, 7]}]}}) == \
        "prompt128, 4 CPUs a server"  # a journal's levels


@pytest.mark.parametrize("flag", [["--server-args", "--page-size 4"], ["--compare-prefix-cache"], ["--interleave"],
                                  ["--pin-cpus"], ["--rotation", "1"]])
def test_launch_only_flags_are_refused_without_launch(capsys, flag):
    """A flag that configures --launch servers is refused (exit 2, naming it) when no server is launched, rather
    than accepted and ignored against --base-url."""
    assert main(["bench", "serving", "--base-url", "http://127.0.0.1:9", *flag]) == 2
    assert flag[0] in capsys.readouterr().err


@pytest.mark.parametrize("servers,levels", [(4, 4), (4, 1), (3, 5), (2, 4), (5, 2)])
def test_level_order_balances_positions_and_predecessors(servers, levels):
    """Over any n passes in a row (2n for an odd number n of servers), each server runs each level at each position
    equally often, also when there are as many levels as servers (a rotation by level alone gave every pass the
    first pass's orders there), and right after each other server equally often (a plain rotation always put the
    adaptive server right after the fixed one)."""
    from spruce.bench.serving import level_order, order_cycle, unbalanced_passes

    window = order_cycle(servers)
    assert unbalanced_passes(servers, 2 * window) is None and unbalanced_passes(1, 3) is None
    assert f"a multiple of {window}" in unbalanced_passes(servers, window + 1)
    for first_pass in range(3):
        for level in range(levels):
            orders = [level_order(servers, k, level) for k in range(first_pass, first_pass + window)]
            assert all(sorted(order) == list(range(servers)) for order in orders)
            for position in range(servers):
                assert sorted(order[position] for order in orders) == sorted(list(range(servers)) * (window // servers))
            follows = collections.Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
            assert set(follows) == {(a, b) for a in range(servers) for b in range(servers) if a != b}
            assert len(set(follows.values())) == 1


def test_cpu_sets_give_each_server_cpus_of_its_own():
    """--pin-cpus: two CPUs per server when there are twice as many as servers, disjoint, the client the rest; too
    few CPUs is an error naming both counts."""
    from spruce.bench.serving_launch import cpu_sets

    client, servers = cpu_sets(4, list(range(16))[::-1])
    assert servers == [[0, 1], [2, 3], [4, 5], [6, 7]] and client == list(range(8, 16))
    client, servers = cpu_sets(3, list(range(16)))
    assert [len(s) for s in servers] == [2, 2, 2] and len(client) == 10
    assert cpu_sets(1, [3, 5]) == ([5], [[3]])
    with pytest.raises(ValueError, match=r"at least 9 CPUs for 4 servers.*on 7"):
        cpu_sets(4, list(range(7)))


def test_cpu_sets_with_cpus_per_server_give_the_client_the_rest():
    """--cpus-per-server N: N CPUs a server (whole cores first), the client the rest; servers that would leave the
    client no CPU, or a negative count, are errors naming the counts."""
    from spruce.bench.serving_launch import cpu_sets

    client, servers = cpu_sets(4, list(range(16)), per_server=3)
    assert servers == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]] and client == [12, 13, 14, 15]
    client, servers = cpu_sets(2, list(range(16)), core=lambda cpu: (0, cpu % 8), per_server=4)  # two cores each
    assert servers == [[0, 1, 8, 9], [2, 3, 10, 11]] and client == [4, 5, 6, 7, 12, 13, 14, 15]
    assert cpu_sets(4, list(range(16)), per_server=0) == cpu_sets(4, list(range(16)))
    with pytest.raises(ValueError, match=r"at least 17 CPUs for 4 servers of 4 CPUs.*on 16"):
        cpu_sets(4, list(range(16)), per_server=4)
    with pytest.raises(ValueError, match=r"must be >= 0.*-1"):
        cpu_sets(4, list(range(16)), per_server=-1)


def test_server_load_is_the_servers_cpu_seconds_over_the_level_against_its_cpus():
    """A pinned level's line reads how many of its server's CPUs its two processes kept busy; nothing where the
    server was not pinned or a process's CPU seconds were not reported."""
    from spruce.bench.serving import server_load

    level = {"cpus": [0, 1], "duration_s": 2.0, "engine": {"cpu_seconds": 1.9, "server_cpu_seconds": 1.4}}
    assert server_load(level) == ", server CPUs busy 1.65 of 2"
    assert server_load(level | {"cpus": None}) == ""
    assert server_load(level | {"engine": {"cpu_seconds": 1.9, "server_cpu_seconds": None}}) == ""
    assert server_load(level | {"engine": None}) == ""


@pytest.mark.parametrize("flags, message", [(["--cpus-per-server", "3"], "add --pin-cpus"),
                                            (["--pin-cpus", "--cpus-per-server", "-2"], "must be >= 0"),
                                            (["--pin-cpus", "--cpus-per-server", "5"], "at least 11 CPUs")])
def test_cpus_per_server_is_refused_where_it_cannot_apply(flags, message, monkeypatch, capsys, tmp_path):
    import spruce.bench.serving_launch as launch

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(launch.LaunchedServer, "__enter__", lambda self: pytest.fail("a server was started"))
    rc = main(["bench", "serving", "--launch", "a=", "--launch", "b=", "--interleave", *flags,
               "--out-dir", str(tmp_path)])
    assert rc == 2 and message in capsys.readouterr().err


def test_cpu_sets_keep_the_threads_of_a_core_together():
    """Two hardware threads per core, numbered as Linux does (core k holds CPUs k and k + 8): each server gets both
    threads of one core, and the client only cores no server has a thread of."""
    from spruce.bench.serving_launch import cpu_core, cpu_sets

    client, servers = cpu_sets(4, list(range(16)), core=lambda cpu: (0, cpu % 8))
    assert servers == [[0, 8], [1, 9], [2, 10], [3, 11]] and client == [4, 5, 6, 7, 12, 13, 14, 15]
    assert not {cpu % 8 for cpu in client} & {cpu % 8 for s in servers for cpu in s}
    client, servers = cpu_sets(2, list(range(8)), core=lambda cpu: (cpu // 4, cpu % 2))  # two packages
    assert servers == [[0, 2], [1, 3]] and client == [4, 5, 6, 7]
    assert isinstance(cpu_core(min(os.sched_getaffinity(0))), tuple)  # this machine's topology, or the fallback


def test_pin_cpus_with_too_few_cpus_is_refused_before_any_server_starts(monkeypatch, capsys, tmp_path):
    import spruce.bench.serving_launch as launch

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setattr(launch.LaunchedServer, "__enter__", lambda self: pytest.fail("a server was started"))
    rc = main(["bench", "serving", "--launch", "a=", "--launch", "b=", "--interleave", "--pin-cpus",
               "--out-dir", str(tmp_path)])
    assert rc == 2 and "at least 5 CPUs for 2 servers" in capsys.readouterr().err


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning to one CPU of one changes nothing")
def test_a_started_process_and_its_children_run_on_the_given_cpus(tmp_path):
    """What --pin-cpus relies on: the server process runs only on its CPUs, and so does the engine process it
    starts later (a grandchild here)."""
    from spruce.bench.serving_launch import start_process

    cpu = min(os.sched_getaffinity(0))
    show = "import os; print(sorted(os.sched_getaffinity(0)))"
    script = f"import subprocess, sys; {show}; sys.stdout.flush(); subprocess.run([sys.executable, '-c', {show!r}])"
    log_path = tmp_path / "log"
    with log_path.open("w") as log:
        start_process([sys.executable, "-c", script], log, [cpu]).wait(timeout=60)
    assert log_path.read_text().split("\n")[:2] == [f"[{cpu}]"] * 2


def test_runs_of_a_set_start_each_server_first_once():
    """--rotation K: the servers start from the K-th, so runs given 0 .. n-1 each start a different one first and
    every server is started at every place once."""
    from spruce.bench.serving import launch_order

    orders = [launch_order(4, k) for k in range(4)]
    assert orders[0] == [0, 1, 2, 3] and orders[1] == [1, 2, 3, 0] and launch_order(4, 5) == orders[1]
    for place in range(4):
        assert sorted(order[place] for order in orders) == [0, 1, 2, 3]


def test_cpu_sets_rotate_between_passes():
    """--pin-cpus with --interleave: each pass moves every server one set further, so over as many passes as
    servers each runs on every set once."""
    from spruce.bench.serving_launch import rotated

    sets = [[0, 1], [2, 3], [4, 5]]
    assert rotated(sets, 0) == sets
    assert rotated(sets, 1) == [[2, 3], [4, 5], [0, 1]]
    assert rotated(sets, 4) == rotated(sets, 1)
    for server in range(3):
        assert sorted(rotated(sets, k)[server] for k in range(3)) == sets


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="moving between CPUs needs two")
def test_a_running_process_tree_moves_to_other_cpus(tmp_path):
    """What the rotation relies on: a running server, every thread of it and the engine process it started (a
    grandchild here) move to the new CPUs."""
    from spruce.bench.serving_launch import pin_tree, start_process

    first, second = sorted(os.sched_getaffinity(0))[:2]
    ready = tmp_path / "ready"
    child = ("import pathlib, subprocess, sys, threading, time; "
             "threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); "
             "grand = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             f"pathlib.Path({str(ready)!r}).write_text(str(grand.pid)); time.sleep(60)")
    with (tmp_path / "log").open("w") as log:
        proc = start_process([sys.executable, "-c", child], log, [first])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        grand = int(ready.read_text())
        tasks = [int(t.name) for pid in (proc.pid, grand) for t in Path(f"/proc/{pid}/task").iterdir()]
        assert len(tasks) >= 3 and all(os.sched_getaffinity(t) == {first} for t in tasks)
        assert pin_tree(proc.pid, [second]) >= 3
        assert all(os.sched_getaffinity(t) == {second} for t in tasks)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_a_run_that_stops_early_keeps_its_servers_log_tail(monkeypatch, tmp_path):
    """A launched server whose run stops early (an engine failure mid-level, on a device whose logs may not come
    back) leaves the end of its log in the result."""
    import spruce.bench.serving as serving
    import spruce.bench.serving_launch as launch

    monkeypatch.setattr(launch.LaunchedServer, "__enter__", lambda self: "http://127.0.0.1:9")
    monkeypatch.setattr(launch.LaunchedServer, "__exit__", lambda self, *exc: None)
    monkeypatch.setattr(launch.LaunchedServer, "log_tail", lambda self, lines=20: f"tail of {self.log_path.name}")
    monkeypatch.setattr(serving, "_served_model", lambda args, base_url: "m")
    monkeypatch.setattr(serving, "_prompts_for", lambda args, model: (tmp_path / "p.jsonl", ["x"]))
    monkeypatch.setattr(serving, "server_info", lambda base_url, headers: {"device": "cpu"})

    async def bench(args, targets, prompts, on_level=None, before_pass=None):
        return [([], "ReadError: "), ([], None)]

    monkeypatch.setattr(serving, "_bench", bench)
    rc = main(["bench", "serving", "--launch", "a=", "--launch", "b=", "--interleave", "--concurrency", "1",
               "--out-dir", str(tmp_path)])
    result = json.loads(next(tmp_path.glob("serving-*.json")).read_text())
    runs = {run["name"]: run for run in result["figures"]["runs"]}
    assert rc == 1 and runs["a"]["stopped"] == "ReadError: " and runs["a"]["log_tail"] == "tail of a.log"
    assert runs["b"]["stopped"] is None and "log_tail" not in runs["b"]


def test_pin_cpus_with_interleave_moves_the_servers_between_passes(monkeypatch, tmp_path):
    """--pin-cpus --interleave: before each pass the servers are moved to that pass's rotation of the CPU sets
    (the first pass keeps the launch placement), and each level records the set its server ran on."""
    import spruce.bench.serving as serving
    import spruce.bench.serving_launch as launch

    pinned = []
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr("os.sched_setaffinity", lambda pid, cpus: None)
    monkeypatch.setattr(launch.LaunchedServer, "__enter__", lambda self: f"http://127.0.0.1:{self.cpus[0] + 9}")
    monkeypatch.setattr(launch.LaunchedServer, "__exit__", lambda self, *exc: None)
    monkeypatch.setattr(launch.LaunchedServer, "pin",
                        lambda self, cpus: (pinned.append((self.log_path.stem, cpus)), setattr(self, "cpus", cpus)))
    monkeypatch.setattr(serving, "_served_model", lambda args, base_url: "m")
    monkeypatch.setattr(serving, "_prompts_for", lambda args, model: (tmp_path / "p.jsonl", ["x"]))
    monkeypatch.setattr(serving, "server_info", lambda base_url, headers: {"device": "cpu"})

    async def bench(args, targets, prompts, on_level=None, before_pass=None):
        levels = [[], []]
        for k in range(args.passes):
            placed = before_pass(k)
            for i in range(2):
                levels[i].append({"concurrency": 1, "pass": k + 1, "cpus": placed[i], "output_throughput_tok_s": 1.0,
                                  "completed": 1, "failed": 0})
        return [(levels[0], None), (levels[1], None)]

    monkeypatch.setattr(serving, "_bench", bench)
    monkeypatch.setattr(serving, "_plot_and_print", lambda series, path: None)
    rc = main(["bench", "serving", "--launch", "a=", "--launch", "b=", "--interleave", "--pin-cpus",
               "--concurrency", "1", "--passes", "3", "--out-dir", str(tmp_path)])
    assert rc == 0
    assert pinned == [("a", [2, 3]), ("b", [0, 1]), ("a", [0, 1]), ("b", [2, 3])]  # passes 2 and 3
    result = json.loads(next(tmp_path.glob("serving-*.json")).read_text())
    runs = {run["name"]: run for run in result["figures"]["runs"]}
    assert [lv["cpus"] for lv in runs["a"]["levels"]] == [[0, 1], [2, 3], [0, 1]]


def _source_copy(tmp_path):
    """A copy of this checkout's spruce package (its assets left out) whose import says so on stderr."""
    import shutil
    import spruce

    src = tmp_path / "other-src"
    shutil.copytree(Path(spruce.__file__).parent, src / "spruce",
                    ignore=shutil.ignore_patterns("assets", "__pycache__"))
    init = src / "spruce" / "__init__.py"
    marker = "\nimport sys as _sys\nprint('spruce imported from the copy', file=_sys.stderr)\n"
    init.write_text(init.read_text() + marker)
    return src


def test_launch_src_runs_a_server_from_another_source_tree(tmp_path):
    """`--launch-src NAME=DIR` (LaunchedServer's `src`): the server, its engine process included, imports spruce
    from DIR (two versions side by side in one run); fails if it runs this checkout's instead."""
    from spruce.bench.serving_launch import LaunchedServer, source_env
    from spruce.config import builtin_model_path

    src = _source_copy(tmp_path)
    env = source_env(str(src))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(src.resolve()) and source_env(None) is None
    log = tmp_path / "server.log"
    with LaunchedServer(["--device", "cpu", "--model", str(builtin_model_path()), "--disable-speculative"], log, 300,
                        src=str(src)) as base_url:
        assert base_url.startswith("http://127.0.0.1:")
    assert log.read_text().count("spruce imported from the copy") >= 2  # the HTTP process and the engine process


def test_launch_src_entries_are_checked_and_keep_their_servers_apart(monkeypatch, tmp_path, capsys):
    """--launch-src: an entry naming no --launch configuration, one given twice, one whose directory holds no spruce
    package, or one without --launch is refused with the value named; a server given another source records it and
    is no copy of a server of the same flags (no twin figure), which without it it is."""
    import spruce.bench.serving as serving
    import spruce.bench.serving_launch as launch

    src = str(_source_copy(tmp_path))
    for entry, message in ((f"c={src}", "'c' is no --launch configuration"), (f"b={tmp_path}", "holds no spruce"),
                           ("b", "expected NAME=DIR")):
        assert main(["bench", "serving", "--launch", "a=", "--launch", "b=", "--launch-src", entry]) == 2
        assert message in capsys.readouterr().err
    assert main(["bench", "serving", "--launch", "a=", "--launch", "b=", "--launch-src", f"b={src}",
                 "--launch-src", f"b={src}"]) == 2
    assert "was given a source already" in capsys.readouterr().err
    assert main(["bench", "serving", "--launch-src", f"b={src}"]) == 2
    assert "--launch-src configure --launch servers" in capsys.readouterr().err
    sources = []
    monkeypatch.setattr(launch.LaunchedServer, "__enter__", lambda self: sources.append(self.src) or "http://h:9")
    monkeypatch.setattr(launch.LaunchedServer, "__exit__", lambda self, *exc: None)
    monkeypatch.setattr(serving, "_served_model", lambda args, base_url: "m")
    monkeypatch.setattr(serving, "_prompts_for", lambda args, model: (tmp_path / "p.jsonl", ["x"]))
    monkeypatch.setattr(serving, "server_info", lambda base_url, headers: {"device": "cpu"})
    monkeypatch.setattr(serving, "_plot_and_print", lambda series, path: None)

    async def bench(args, targets, prompts, on_level=None, before_pass=None):
        return [([{"concurrency": 1, "pass": 1, "output_throughput_tok_s": tps, "completed": 1, "failed": 0}], None)
                for tps in (1.0, 1.1)]

    monkeypatch.setattr(serving, "_bench", bench)
    for given, out in (([], tmp_path / "same"), (["--launch-src", f"b={src}"], tmp_path / "other")):
        assert main(["bench", "serving", "--launch", "a=", "--launch", "b=", "--interleave", "--concurrency", "1",
                     *given, "--out-dir", str(out)]) == 0
        result = json.loads(next(out.glob("serving-*.json")).read_text())
        runs = {run["name"]: run for run in result["figures"]["runs"]}
        twins = result["figures"]["paired_versus_twin"]["prefix_cache"]["1"]
        if given:
            assert runs["b"]["src"] == src and "src" not in runs["a"] and sources[-2:] == [None, src] and twins == {}
        else:
            assert set(twins) == {"a", "b"}  # one configuration's two copies
