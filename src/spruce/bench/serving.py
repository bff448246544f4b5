"""`spruce bench serving`: drive a running OpenAI-compatible server (`spruce serve`) with N concurrent streaming
clients per level; report throughput, TTFT / inter-token / end-to-end latency percentiles, prompt tokens served
by the prefix cache, the speculative accept length and adaptive speculation's steps per choice (read from the
server's /metrics), write bench/results/serving-<device>-<time>.json and a PNG of latency vs concurrency (when
matplotlib is installed).

Workloads: each request is a held-out prompt cut to --prompt-tokens; with --shared-prefix-tokens N every request
is one common N-token prefix followed by its own prompt (a system prompt / few-shot header: what a prefix cache
serves).

`--launch NAME=FLAGS` (repeatable) starts `spruce serve` itself for each configuration in turn (common flags in
--server-args; --compare-prefix-cache runs each once more with --disable-radix-cache), drives each through its
HTTP API like any server, and writes all of them into one result: figures.runs[i] = {name, prefix_cache,
server, levels}, plus figures.summary (output tokens/s per prefix-cache mode, concurrency and run: one figure per
pass). `--passes N` runs the levels N times over on each server; every pass is reported. `--interleave` starts
every configuration at once and runs each level on each server in turn, so a comparison is side by side in time.
`--launch-src NAME=DIR` runs configuration NAME's server with spruce imported from the source tree DIR (e.g. another
commit's src/ from `git archive`): two versions of the code side by side in one run, each server otherwise alike.
A level's requests go out from `--client-processes` processes (default: one per 4 streams in flight), so that the
client's own parsing does not limit the levels of high concurrency (bench/serving_client.py).

No request waits forever: each has `--timeout` seconds in all (connect to last byte). A request that times out,
finds the server gone, or is refused because its engine failed stops the run: the level sends nothing more
(the requests it did not send count as failed, with the reason), later levels are skipped, the result is
written with `stopped` naming why, and the command exits 1 (as it does whenever a request failed)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from spruce.bench.serving_client import ClientPool, client_processes, send_level, stream_one
from spruce.runtime.step_counters import PARTS as STEP_PARTS
from spruce.server.engine_process import PROCESS_PARTS

PERCENTILES = (50, 90, 99)
METRICS_TIMEOUT_S = 30.0  # a scrape of /metrics (milliseconds on a live server)
LOG_TAIL_LINES = 80  # of a launched server's log, kept in the result when its run stopped early


def add_serving_parser(sub) -> None:
    """Register `spruce bench serving` on the `spruce bench` subparsers."""
    p = sub.add_parser("serving", help="online benchmark against a running server")
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("SPRUCE_API_KEY"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--num-requests", type=int, nargs="+", default=None,
                   help="requests per concurrency level: one count for every level, or one per --concurrency "
                        "level (default: max(16, 4 x concurrency))")
    p.add_argument("--prompts", default=None, help="JSONL of {'text': ...} lines (default: the fixture's held-out "
                   "prompts, ../shared/models/pycode-19m/heldout_prompts.jsonl)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="truncate each prompt to this many tokens")
    p.add_argument("--tokenizer", default=None, help="model dir whose tokenizer truncates prompts (default: the "
                   "served model's dir if it is local, else the fixture's)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-tokens-min", type=int, default=None,
                   help="draw each request's max_tokens uniformly from [this, --max-tokens] (request i draws the "
                        "same on every server and in every pass; default: every request --max-tokens). Equal "
                        "lengths make a level's requests end together, and the batch then swings with the "
                        "arrivals' prefills")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: fixed length)")
    p.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    p.add_argument("--device", default=None, help="device the server runs on, for the result's name "
                   "(default: cuda when this machine has one)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one request may take in all (connect to last byte); past it the request fails "
                        "and the run stops (default 600)")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--shared-prefix-tokens", type=int, default=0,
                   help="prepend one common prefix of this many tokens (cut from the prompt file's text) to "
                        "every request (default 0: none)")
    p.add_argument("--launch", action="append", default=[], metavar="NAME=FLAGS",
                   help="start `spruce serve --server-args FLAGS` for this configuration and benchmark it "
                        "(repeatable; one result for all); without it, the server at --base-url is measured")
    p.add_argument("--server-args", default="", help="engine/server flags every --launch configuration gets")
    p.add_argument("--launch-src", action="append", default=[], metavar="NAME=DIR",
                   help="run --launch configuration NAME's server with spruce imported from the source tree DIR "
                        "(holding spruce/, e.g. another commit's src/ from `git archive`): two versions side by side "
                        "in one run (repeatable; a configuration of other flags or another source is no copy)")
    p.add_argument("--compare-prefix-cache", action="store_true",
                   help="with --launch: run every configuration with the prefix cache and again without it")
    p.add_argument("--launch-timeout", type=float, default=900.0,
                   help="seconds a launched server may take to load and capture its graphs")
    p.add_argument("--passes", type=int, default=1,
                   help="run every concurrency level this many times in turn on the same server (each pass is "
                        "reported: levels[i]['pass']), to see how much a figure moves between passes")
    p.add_argument("--client-processes", type=int, default=0,
                   help="client processes that send a level's requests (0, the default: one per 4 streams in "
                        "flight, at most 8 and half the CPUs); one event loop parsing every chunk limits a level "
                        "at high concurrency (bench/serving_client.py)")
    p.add_argument("--interleave", action="store_true",
                   help="with several --launch configurations: start them all at once and run each level on each "
                        "server in turn, pass after pass, so that drifts of the machine weigh on every server "
                        "alike (needs the memory of all servers at once)")
    p.add_argument("--pin-cpus", action="store_true",
                   help="with --launch: run each server (its HTTP and engine processes) on CPUs of its own and the "
                        "client on the rest (bench/serving_launch.py cpu_sets), so that no server shares a core with "
                        "the client or another server; with --interleave the servers trade sets between passes "
                        "(each pass one further), so that a slower set is every server's in turn; each level "
                        "records its server's set")
    p.add_argument("--cpus-per-server", type=int, default=0, metavar="N",
                   help="with --pin-cpus: N CPUs for each server, the client the rest (0, the default: a quarter "
                        "of the CPUs per two servers, the client at least half): with two, a server's HTTP and "
                        "engine processes kept ~1.7 of them busy on the H200 (the serving bar's scripts give three)")
    p.add_argument("--rotation", type=int, default=0,
                   help="with --launch: this run's place in a set of runs of the same servers (0, 1, ...): the "
                        "servers start from the K-th (mod their number), and pass p takes the server order "
                        "(level_order) and CPU sets of pass p + K, so that runs given K = 0 .. n-1 give each server "
                        "the first start, the run's first level and each CPU set alike (a process started first, or "
                        "measured first, may run faster)")
    p.set_defaults(func=run_serving_bench)


def default_prompts_path() -> Path:
    import spruce

    root = Path(os.environ.get("SPRUCE_PYCODE_19M", Path(spruce.__file__).resolve().parents[3] / "shared" /
                               "models" / "pycode-19m"))
    return root / "heldout_prompts.jsonl"


def _load_tokenizer(candidates: list[str | None]):
    from spruce.models.hf_config import ModelConfig
    from spruce.models.tokenizer import Tokenizer

    for c in candidates:
        if c and (Path(c) / "tokenizer.json").exists() and (Path(c) / "config.json").exists():
            return Tokenizer.from_dir(c, ModelConfig.from_dir(c))
    return None


def load_prompts(path: Path, prompt_tokens: int, tokenizer, shared_prefix_tokens: int = 0) -> list[str | list[int]]:
    """Prompts from {"text"} JSONL, cut to `prompt_tokens` tokens (token ids), or ~4 chars/token without a
    tokenizer. `shared_prefix_tokens`: each prompt follows one common prefix of that many tokens, the start of
    the file's texts joined in reverse order (so that no request's own prompt starts it)."""
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    if not texts:
        raise SystemExit(f"no prompts in {path}")
    source = "\n".join(reversed(texts))
    if tokenizer is None:
        prefix = source[: 4 * shared_prefix_tokens]
        return [prefix + t[: 4 * prompt_tokens] for t in texts]
    prefix = tokenizer.encode(source)[:shared_prefix_tokens] if shared_prefix_tokens else []
    if len(prefix) < shared_prefix_tokens:
        raise SystemExit(f"{path} holds only {len(prefix)} tokens; --shared-prefix-tokens {shared_prefix_tokens} "
                         f"needs more text")
    return [prefix + tokenizer.encode(t)[:prompt_tokens] for t in texts]


def server_info(base_url: str, headers: dict) -> dict[str, str]:
    """Labels of the server's spruce_server_info metric (device, model, speculation, ...); {} if absent."""
    try:
        text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=30).text
    except httpx.HTTPError:
        return {}
    for line in text.splitlines():
        if line.startswith("spruce_server_info{"):
            body = line[line.index("{") + 1: line.rindex("}")]
            return dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', body))
    return {}


ADAPTIVE_STEPS = tuple(f'spruce_adaptive_steps_total{{choice="{c}"}}' for c in ("plain", "speculative"))
ADAPTIVE_COUNTERS = {"probes": "spruce_adaptive_probes_total",
                     "collapsed_steps": "spruce_adaptive_collapsed_steps_total",
                     "collapsed_requests": "spruce_adaptive_collapsed_requests_total"}
SERVING_COMPILES = 'spruce_triton_compiles_total{phase="serving"}'
ENGINE_STEPS = {kind: f'spruce_engine_steps_total{{kind="{kind}"}}'
                for kind in ("prefill", "decode", "round", "mixed")}
ENGINE_SECONDS = {f"{family}.{part}": f'spruce_engine_{family}_seconds_total{{part="{part}"}}'
                  for family, parts in (("step", STEP_PARTS), ("process", PROCESS_PARTS)) for part in parts}
ENGINE_CPU = "spruce_engine_process_cpu_seconds_total"
SERVER_CPU = "spruce_server_process_cpu_seconds_total"  # the HTTP process's
PREFILL_LAUNCH, PREFILL_HOLDS = "spruce_engine_prefill_launch_seconds_total", "spruce_prefill_holds_total"
COUNTERS = ("spruce_spec_accept_length_sum", "spruce_spec_accept_length_count", *ADAPTIVE_STEPS,
            *ADAPTIVE_COUNTERS.values(), SERVING_COMPILES, *ENGINE_STEPS.values(), "spruce_engine_decode_rows_total",
            *ENGINE_SECONDS.values(), ENGINE_CPU, SERVER_CPU, PREFILL_LAUNCH, PREFILL_HOLDS)
HELD_FRACTION = 0.9  # a level whose client held fewer than this fraction of its streams in flight is flagged
ADAPTIVE_TABLES = ("spruce_adaptive_step_seconds", "spruce_adaptive_accept_ema", "spruce_adaptive_choice")
WIDTH_ROUNDS = "spruce_adaptive_width_rounds_total"  # {width="N"}: rounds per verify width


async def _metrics(base_url: str, headers: dict, timeout: float) -> tuple[dict[str, float], dict]:
    """The server's cumulative COUNTERS that it exposes (speculation off: none; not adaptive: no steps), and
    adaptive speculation's tables (step_seconds: {candidate: {bucket: s}}; accept_ema: {width: drafts}; choice:
    {bucket: candidate}; empty when not adaptive); nothing if it does not answer within `timeout` seconds. The
    counters include each width's rounds (WIDTH_ROUNDS)."""
    try:
        async with httpx.AsyncClient(base_url=base_url, headers=headers) as client:
            text = (await client.get("/metrics", timeout=timeout)).text
    except httpx.HTTPError:
        return {}, {}
    vals, tables = {}, {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in COUNTERS or name.startswith(WIDTH_ROUNDS + "{"):
            vals[name] = float(value)
        elif name.split("{")[0] in ADAPTIVE_TABLES:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', name))
            table = tables.setdefault(name.split("{")[0].removeprefix("spruce_adaptive_"), {})
            if "candidate" in labels:
                table.setdefault(labels["candidate"], {})[labels["bucket"]] = float(value)
            else:
                table[labels.get("bucket", labels.get("width"))] = float(value)
    return vals, tables


async def run_level(base_url: str, headers: dict, model: str, prompts: list, concurrency: int, num_requests: int,
                    args, pool=None, processes: int = 1) -> dict:
    """Send `num_requests` streaming requests with `concurrency` in flight (from this process, or dealt over
    `processes` client processes of `pool`: bench/serving_client.py); the level's figures. A fatal failure (see
    RequestResult.fatal) stops the level: the requests not sent yet fail with its reason (`stopped`)."""
    metrics_timeout = min(args.timeout, METRICS_TIMEOUT_S)
    before, _ = await _metrics(base_url, headers, metrics_timeout)
    started_at = time.time()
    cpu_before = machine_cpu_times()
    sent = await send_level(base_url, headers, model, prompts, concurrency, num_requests, args, pool, processes)
    cpu_after = machine_cpu_times()
    duration = sent.ended - sent.started
    results, stopped = sent.results, sent.stopped
    after, tables = await _metrics(base_url, headers, metrics_timeout)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    accept = None
    if delta.get("spruce_spec_accept_length_count", 0) > 0:
        accept = delta["spruce_spec_accept_length_sum"] / delta["spruce_spec_accept_length_count"]
    adaptive = {name.split('"')[1]: int(delta[name]) for name in ADAPTIVE_STEPS if name in delta}
    if adaptive:
        adaptive |= {key: int(delta.get(name, 0)) for key, name in ADAPTIVE_COUNTERS.items()}
        widths = {name.split('"')[1]: int(delta[name]) for name in delta if name.startswith(WIDTH_ROUNDS + "{")}
        if widths:
            adaptive["width_rounds"] = widths  # rounds per verify width during the level
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    engine = None
    if ENGINE_STEPS["decode"] in delta:
        steps = {kind: int(delta.get(name, 0)) for kind, name in ENGINE_STEPS.items()}
        rows = delta.get("spruce_engine_decode_rows_total", 0.0)
        engine = {"steps": steps, "mean_decode_batch": rows / steps["decode"] if steps["decode"] else None,
                  "prefills_per_request": steps["prefill"] / len(ok) if ok else None,
                  "seconds": {key: delta[name] for key, name in ENGINE_SECONDS.items() if name in delta},
                  "cpu_seconds": delta.get(ENGINE_CPU),  # the engine process's CPU seconds (None: not reported)
                  "server_cpu_seconds": delta.get(SERVER_CPU),  # the HTTP process's (None: not reported)
                  # the prefill launches' seconds, whose mean prices how long --scheduler-delay-factor holds arrivals
                  # back, and the admission rounds it held them (None: not reported)
                  "prefill_launch_seconds": delta.get(PREFILL_LAUNCH),
                  "prefill_holds": int(delta[PREFILL_HOLDS]) if PREFILL_HOLDS in delta else None}
    return {
        "concurrency": concurrency, "num_requests": num_requests, "started_at": started_at, "completed": len(ok),
        "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_throughput_tok_s": out_tokens / duration,
        "input_throughput_tok_s": sum(r.prompt_tokens for r in ok) / duration,
        "mean_output_tokens": out_tokens / len(ok) if ok else 0.0,
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "ttft_s": percentiles([r.ttft for r in ok]), "itl_s": percentiles([x for r in ok for x in r.itls]),
        "tpot_s": percentiles(tpot), "e2e_s": percentiles([r.e2e for r in ok]),
        "text_chunks_per_request": sum(len(r.itls) + 1 for r in ok) / len(ok) if ok else None,  # (TTFT + ITLs +
        # stream tail = e2e per request: where an e2e difference between servers sits)
        "stream_tail_s": percentiles([r.tail for r in ok]),  # last chunk with text to the stream's end
        "mean_accept_length": accept, "adaptive_steps": adaptive or None,
        "adaptive_costs": tables or None,  # the policy's step costs, acceptance and choices after the level
        "engine": engine,  # the server's engine during the level: launches by kind, its mean decode batch, and the
        # wall seconds of its step's parts and of its process loop's (runtime/step_counters.py); None: not exposed
        "stopped": stopped,  # why the level stopped sending requests (None: it did not)
        "client_processes": processes,
        "triton_compiles": int(delta[SERVING_COMPILES]) if SERVING_COMPILES in delta else None,  # in the server
        # during the level (each stalled a step); None: the server does not count them (no Triton)
        "client_cpu_fraction": sent.cpu_seconds / duration,  # the busiest client process's CPU seconds per second:
        # near 1, the client (one event loop per process) limits the level, not the server
        "mean_in_flight": sum(r.e2e for r in ok) / duration,  # streams the client held open on average (Little's
        # law); below HELD_FRACTION x concurrency the level did not measure the server at that concurrency
        "client_start_spread_s": sent.start_spread, "client_end_spread_s": sent.end_spread,  # first to last client
        # process start / end
        "machine_steal_fraction": _steal_fraction(cpu_before, cpu_after),  # of the machine's CPU time, what its
        # hypervisor gave to others (None: not Linux)
    }


def mean_prefill_launch(engine: dict) -> float | None:
    """A level's mean prefill launch in seconds, from its `engine` figures (None where the server does not report
    the launch seconds, or launched no prefill)."""
    prefills, seconds = (engine.get("steps") or {}).get("prefill"), engine.get("prefill_launch_seconds")
    return None if not prefills or seconds is None else seconds / prefills


def percentiles(values: list[float]) -> dict:
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None, "max": None}
    s = sorted(values)
    out = {f"p{p}": s[min(len(s), max(1, math.ceil(p / 100 * len(s)))) - 1] for p in PERCENTILES}  # nearest rank
    return out | {"mean": sum(s) / len(s), "max": s[-1]}


def machine_cpu_times() -> tuple[int, int] | None:
    """(steal, total) CPU ticks of this machine so far (/proc/stat); None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])  # user .. steal (guest time is within user)


def _steal_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _headers(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def _bench(args, targets: list[tuple[str, str]], prompts,
                 on_level: Callable[[int, dict], None] | None = None,
                 before_pass: Callable[[int], list | None] | None = None) -> list[tuple[list[dict], str | None]]:
    """Measure every server in `targets` ((base_url, model) each): per server, the levels measured and why its
    run stopped early (None: it did not); `on_level(i, level)` is called as each level of server i completes;
    `before_pass(pass_index)` before each pass, which may return each server's CPUs for it (recorded per level).
    Each pass runs every level on each server in turn (level c on server 1, 2, ..., then the next level), so
    servers measured together see the same machine at the same time, in the order `level_order` gives."""
    headers = _headers(args)
    warning = unbalanced_passes(len(targets), args.passes)
    if warning:
        print(f"spruce bench serving: {warning}", file=sys.stderr)
    levels: list[list[dict]] = [[] for _ in targets]
    stopped: list[str | None] = [None] * len(targets)
    processes = {c: client_processes(args.client_processes, c) for c in args.concurrency}
    requests = requests_per_level(args)
    pool = ClientPool(max(processes.values())) if max(processes.values()) > 1 else None
    try:
        for i, (base_url, model) in enumerate(targets):
            async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=args.timeout) as client:
                for w in range(args.warmup):
                    res = await stream_one(client, model, prompts[w % len(prompts)], args)
                    if res.fatal:
                        print(f"spruce bench serving: the run stopped in the warm-up: {res.error}", file=sys.stderr)
                        stopped[i] = f"warm-up: {res.error}"
                        break
        for k in range(1, args.passes + 1):
            placed = before_pass(k - 1) if before_pass is not None else None
            for j, c in enumerate(args.concurrency):
                for i in level_order(len(targets), k - 1 + args.rotation, j):
                    base_url, model = targets[i]
                    if stopped[i]:
                        continue
                    level = await run_level(base_url, headers, model, prompts, c, requests[c], args, pool,
                                            processes[c]) | {"pass": k} | ({"cpus": placed[i]} if placed else {})
                    _print_level(level)
                    levels[i].append(level)
                    if on_level is not None:
                        on_level(i, level)
                    if level["stopped"]:
                        print(f"spruce bench serving: the run stopped: {level['stopped']}", file=sys.stderr)
                        stopped[i] = level["stopped"]
    finally:
        if pool is not None:
            pool.shutdown()
    return list(zip(levels, stopped))


def level_order(servers: int, pass_index: int, level_index: int) -> list[int]:
    """The order in which `servers` servers run level `level_index` of pass `pass_index` (both from 0): row
    pass_index + level_index of a Williams design, a crossover design balanced for first-order carryover. Its rows
    are the shifts of 0, 1, n-1, 2, n-2, ... (mod n servers), and for odd n also those shifts reversed: over any n
    passes in a row (2n for odd n) each server runs each level at each position, and right after each other server,
    equally often.
    The client process and the machine carry state from one server's level to the next. A plain rotation (0, 1, 2 /
    1, 2, 0 / ...) puts every server at every position, but always after the same one, so any trace that one left
    (its GPU's heat, caches) would weigh on its follower alone."""
    shift = (pass_index + level_index) % servers
    base = [0]
    for k in range(1, servers):
        base.append((k + 1) // 2 if k % 2 else servers - k // 2)
    order = [(b + shift) % servers for b in base]
    if servers % 2 and (pass_index + level_index) // servers % 2:
        order.reverse()
    return order


def launch_order(servers: int, rotation: int) -> list[int]:
    """The order in which `servers` launched servers start (their indices): from server `rotation` (mod their
    number) on, so that the runs of a set given rotations 0 .. n-1 start each server first once."""
    return [(rotation + k) % servers for k in range(servers)]


def order_cycle(servers: int) -> int:
    """Passes in a row over which `level_order` balances positions and predecessors: n servers, 2n for odd n
    (also a multiple of n, over which `rotated` deals each server every CPU set once)."""
    return servers if servers % 2 == 0 else 2 * servers


def unbalanced_passes(servers: int, passes: int) -> str | None:
    """Why `passes` passes over `servers` servers measure them unevenly (None: they do not): a pass count that is no
    multiple of `order_cycle` leaves some server never right after another, or (--pin-cpus) never on some CPU
    set."""
    cycle = order_cycle(servers)
    if servers < 2 or passes % cycle == 0:
        return None
    return (f"{passes} passes over {servers} servers leave their order (and, with --pin-cpus, their CPU sets) "
            f"unbalanced: a multiple of {cycle} puts every server at every position, right after every other one "
            f"and on every CPU set equally often")


def requests_per_level(args) -> dict[int, int]:
    """{concurrency: requests} from --num-requests (one count for all levels, or one per level)."""
    counts = args.num_requests or [max(16, 4 * c) for c in args.concurrency]
    if len(counts) == 1:
        counts = counts * len(args.concurrency)
    return dict(zip(args.concurrency, counts))


def last_pass(levels: list[dict]) -> list[dict]:
    """The levels of the last pass (what the plots show; results written before --passes have one)."""
    last = max((lv.get("pass", 1) for lv in levels), default=1)
    return [lv for lv in levels if lv.get("pass", 1) == last]


def server_busy(lv: dict) -> float | None:
    """The CPUs a level's server kept busy: its engine and HTTP processes' CPU seconds over the level's wall time
    (None where either is not reported)."""
    eng = lv.get("engine") or {}
    engine_cpu, server_cpu = eng.get("cpu_seconds"), eng.get("server_cpu_seconds")
    duration = lv.get("duration_s") or 0.0
    if engine_cpu is None or server_cpu is None or duration <= 0:
        return None
    return (engine_cpu + server_cpu) / duration


def server_load(lv: dict) -> str:
    """A pinned level's server CPUs kept busy (`server_busy`) against the CPUs it had: near them, a server's host work
    queues for a CPU and reaches its tokens (two CPUs a server at concurrency 1 on an H200 host: 1.65-1.7 busy).
    Empty where not pinned or not reported."""
    busy = server_busy(lv)
    if not lv.get("cpus") or busy is None:
        return ""
    return f", server CPUs busy {busy:.2f} of {len(lv['cpus'])}"


def _print_level(lv: dict) -> None:
    def ms(d, k):
        return "-" if d[k] is None else f"{1e3 * d[k]:.1f}"

    acc = "-" if lv["mean_accept_length"] is None else f"{lv['mean_accept_length']:.2f}"
    steps = lv["adaptive_steps"]
    adaptive = "" if not steps else (f" | adaptive steps plain/spec {steps.get('plain', 0)}/"
                                     f"{steps.get('speculative', 0)}, probes {steps['probes']}, collapsed "
                                     f"requests {steps['collapsed_requests']} (their plain steps "
                                     f"{steps['collapsed_steps']})"
                                     + (f", rounds by width {steps['width_rounds']}" if "width_rounds" in steps
                                        else ""))
    eng = lv.get("engine")
    engine = ""
    if eng and eng["steps"]["decode"]:
        sec, launches = eng["seconds"], eng["steps"]["decode"] + eng["steps"]["prefill"]
        per = {part: 1e3 * sec[key] / launches for key, part in (("process.step", "step"), ("step.wait", "wait"),
                                                                 ("process.encode", "encode"), ("process.send", "send"))
               if key in sec}
        busy = sum(sec.get(f"process.{part}", 0.0) for part in ("messages", "step", "encode", "send"))
        cpu = ("" if eng.get("cpu_seconds") is None or busy <= 0  # below 100%: the engine process waited for a CPU
               else f", CPU {100 * eng['cpu_seconds'] / busy:.0f}% of its busy time")
        per_request = eng["prefills_per_request"]  # None when no request completed
        mean_prefill = mean_prefill_launch(eng)
        prefill = ("" if mean_prefill is None
                   else f", prefill launch {1e3 * mean_prefill:.2f} ms ({eng.get('prefill_holds')} holds)")
        engine = (f" | engine: {eng['steps']['decode']} decodes (batch {eng['mean_decode_batch']:.1f}), "
                  + ("" if per_request is None else f"{per_request:.2f} prefills/request, ") + "ms per launch "
                  + " ".join(f"{part} {v:.3f}" for part, v in per.items()) + prefill + cpu + server_load(lv))
    cached = lv["cached_prompt_tokens"] / lv["prompt_tokens"] if lv["prompt_tokens"] else 0.0
    print(f"pass {lv['pass']} concurrency {lv['concurrency']:>3}: {lv['completed']}/{lv['num_requests']} ok, "
          f"{lv['output_throughput_tok_s']:.1f} tok/s, {lv['request_throughput']:.2f} req/s | "
          f"TTFT p50/p90/p99 {ms(lv['ttft_s'], 'p50')}/{ms(lv['ttft_s'], 'p90')}/{ms(lv['ttft_s'], 'p99')} ms | "
          f"ITL p50/p99 {ms(lv['itl_s'], 'p50')}/{ms(lv['itl_s'], 'p99')} ms | "
          f"E2E p50/p99 {ms(lv['e2e_s'], 'p50')}/{ms(lv['e2e_s'], 'p99')} ms | cached prompt {100 * cached:.0f}% | "
          f"client CPU {100 * lv['client_cpu_fraction']:.0f}% | accept length {acc}{adaptive}{engine}"
          + (f" | Triton compiled {lv['triton_compiles']} kernel(s) in the server" if lv["triton_compiles"] else ""))
    if lv["completed"] and lv["mean_in_flight"] < HELD_FRACTION * lv["concurrency"]:
        print(f"  warning: the client held only {lv['mean_in_flight']:.1f} of {lv['concurrency']} streams in flight "
              f"on average (client processes started over {lv['client_start_spread_s']:.2f} s, ended over "
              f"{lv['client_end_spread_s']:.2f} s): this level under-measures the server", file=sys.stderr)
    for err in lv["errors"]:
        print(f"  error: {err}", file=sys.stderr)


def plot(series: dict[str, list[dict]], path: Path) -> Path | None:
    """TTFT, inter-token latency (p50 solid, p99 dashed) and output throughput vs concurrency of one or more
    runs (label -> levels), each run one colour on the same axes, as a PNG (None without matplotlib). Levels
    that completed no request (a run that stopped) are left out."""
    series = {label: [lv for lv in levels if lv.get("completed") != 0] for label, levels in series.items()}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ticks: set[int] = set()
    for run, (label, levels) in enumerate(series.items()):
        xs = [lv["concurrency"] for lv in levels]
        ticks.update(xs)
        color = f"C{run}"
        for ax, key in ((axes[0], "ttft_s"), (axes[1], "itl_s")):
            for p, style in (("p50", "-o"), ("p99", "--x")):
                ys = [1e3 * lv[key][p] if lv[key][p] is not None else float("nan") for lv in levels]
                ax.plot(xs, ys, style, color=color, label=f"{label} {p}")
        axes[2].plot(xs, [lv["output_throughput_tok_s"] for lv in levels], "-o", color=color, label=label)
    for ax, title, ylabel in ((axes[0], "time to first token", "ms"), (axes[1], "inter-token latency", "ms"),
                              (axes[2], "throughput", "output tokens/s")):
        ax.set(xscale="log", xlabel="concurrency", ylabel=ylabel, title=title)
        if ylabel == "ms":
            ax.set_yscale("log")
        ax.set_xticks(sorted(ticks), labels=[str(x) for x in sorted(ticks)])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _prompts_for(args, model: str) -> tuple[Path, list]:
    """The benchmark's prompts (token ids when a tokenizer is found) for a server serving `model`."""
    from spruce.config import builtin_model_path

    prompts_path = Path(args.prompts) if args.prompts else default_prompts_path()
    if not prompts_path.exists():
        raise SystemExit(f"spruce bench serving: prompt file {prompts_path} not found (pass --prompts FILE.jsonl)")
    builtin = str(builtin_model_path()) if model == builtin_model_path().name else None
    tokenizer = _load_tokenizer([args.tokenizer, model, builtin, str(default_prompts_path().parent)])
    if tokenizer is None:
        print("spruce bench serving: no tokenizer found; truncating prompts to ~4 characters per token")
    return prompts_path, load_prompts(prompts_path, args.prompt_tokens, tokenizer, args.shared_prefix_tokens)


def _served_model(args, base_url: str) -> str:
    try:
        served = httpx.get(f"{base_url}/v1/models", headers=_headers(args), timeout=30).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        raise SystemExit(f"spruce bench serving: cannot list models at {base_url}/v1/models: {e}") from None
    return args.model or served[0]["id"]


def _device(args, info: dict) -> str:
    import torch

    return args.device or info.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")


def run_serving_bench(args: argparse.Namespace) -> int:
    from spruce.bench.common import write_result

    if args.shared_prefix_tokens < 0:
        print(f"spruce bench serving: --shared-prefix-tokens must be >= 0, got {args.shared_prefix_tokens}",
              file=sys.stderr)
        return 2
    if not args.timeout > 0:
        print(f"spruce bench serving: --timeout must be > 0 seconds, got {args.timeout}", file=sys.stderr)
        return 2
    if args.max_tokens < 1:
        print(f"spruce bench serving: --max-tokens must be >= 1, got {args.max_tokens}", file=sys.stderr)
        return 2
    if args.max_tokens_min is not None and not 1 <= args.max_tokens_min <= args.max_tokens:
        print(f"spruce bench serving: --max-tokens-min must be in 1..--max-tokens ({args.max_tokens}), got "
              f"{args.max_tokens_min}", file=sys.stderr)
        return 2
    if args.rotation < 0:
        print(f"spruce bench serving: --rotation must be >= 0, got {args.rotation}", file=sys.stderr)
        return 2
    if args.passes < 1:
        print(f"spruce bench serving: --passes must be >= 1, got {args.passes}", file=sys.stderr)
        return 2
    if args.num_requests is not None and (len(args.num_requests) not in (1, len(args.concurrency))
                                          or min(args.num_requests) < 1):
        print(f"spruce bench serving: --num-requests takes one count >= 1 or one per --concurrency level "
              f"({len(args.concurrency)}), got {args.num_requests}", file=sys.stderr)
        return 2
    if args.client_processes < 0:
        print(f"spruce bench serving: --client-processes must be >= 0 (0: automatic), got {args.client_processes}",
              file=sys.stderr)
        return 2
    from spruce.bench.serving_launch import check_cpus_per_server

    try:
        check_cpus_per_server(args.cpus_per_server)
    except ValueError as e:
        print(f"spruce bench serving: {e}", file=sys.stderr)
        return 2
    if args.cpus_per_server and not args.pin_cpus:
        print(f"spruce bench serving: --cpus-per-server {args.cpus_per_server} deals the CPUs of --pin-cpus; add "
              f"--pin-cpus (or drop it)", file=sys.stderr)
        return 2
    if args.launch:
        return _run_launched(args)
    if (args.server_args or args.compare_prefix_cache or args.interleave or args.pin_cpus or args.rotation
            or args.launch_src):
        print("spruce bench serving: --server-args, --compare-prefix-cache, --interleave, --pin-cpus, --rotation and "
              "--launch-src configure --launch servers; add --launch NAME=FLAGS (or drop them to measure the server "
              "at --base-url)", file=sys.stderr)
        return 2
    try:
        model = _served_model(args, args.base_url)
        prompts_path, prompts = _prompts_for(args, model)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    [(levels, stopped)] = asyncio.run(_bench(args, [(args.base_url, model)], prompts))
    info = server_info(args.base_url, _headers(args))
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")} | {
        "model": model, "prompts": str(prompts_path), "num_prompts": len(prompts), "server": info}
    path = write_result("serving", _device(args, info), config, {"levels": levels, "stopped": stopped},
                        Path(args.out_dir))
    print(f"results: {path}")
    _plot_and_print({"spruce": last_pass(levels)}, path.with_suffix(".png"))
    return 0 if stopped is None and all(lv["failed"] == 0 for lv in levels) else 1


def launch_sources(texts: list[str], names: list[str]) -> dict[str, str]:
    """`--launch-src` NAME=DIR entries as {name: dir}: ValueError naming the entry where NAME is no --launch
    configuration (of `names`), is given twice, or DIR holds no spruce package (serving_launch.check_source)."""
    from spruce.bench.serving_launch import check_source

    sources: dict[str, str] = {}
    for text in texts:
        name, sep, src = text.partition("=")
        if not sep or not src:
            raise ValueError(f"--launch-src {text!r}: expected NAME=DIR")
        if name not in names:
            raise ValueError(f"--launch-src {text!r}: {name!r} is no --launch configuration (they are {names})")
        if name in sources:
            raise ValueError(f"--launch-src {text!r}: {name!r} was given a source already ({sources[name]!r})")
        check_source(src)
        sources[name] = src
    return sources


def _run_launched(args: argparse.Namespace) -> int:
    """Start, measure and stop one server per configuration (x prefix cache on/off); one result for all."""
    from spruce.bench.common import write_result
    from spruce.bench.serving_launch import LaunchConfig, LaunchedServer, cpu_sets, rotated

    try:
        configs = [LaunchConfig.parse(text) for text in args.launch]
    except ValueError as e:
        print(f"spruce bench serving: {e}", file=sys.stderr)
        return 2
    if len({c.name for c in configs}) != len(configs):
        print(f"spruce bench serving: --launch names must differ, got {[c.name for c in configs]}", file=sys.stderr)
        return 2
    try:
        sources = launch_sources(args.launch_src, [c.name for c in configs])
    except ValueError as e:
        print(f"spruce bench serving: {e}", file=sys.stderr)
        return 2
    common = shlex.split(args.server_args)
    modes = (True, False) if args.compare_prefix_cache else (True,)
    out_dir = Path(args.out_dir)
    servers = [(cfg, cache) for cache in modes for cfg in configs]
    groups = [servers] if args.interleave else [[server] for server in servers]
    runs = []
    prompts_path, prompts = None, None
    out_dir.mkdir(parents=True, exist_ok=True)
    journal = out_dir / "levels.jsonl"  # each level as it completes, so a run cut short (a time limit) keeps what
    # it measured; the result JSON is written at the end
    journal.unlink(missing_ok=True)
    all_cpus = sorted(os.sched_getaffinity(0))  # before --pin-cpus narrows this process to the client's
    for group in groups:  # the servers of a group run at the same time, measured level by level in turn
        server_cpus = [None] * len(group)
        if args.pin_cpus:
            try:
                client_cpus, server_cpus = cpu_sets(len(group), all_cpus, per_server=args.cpus_per_server)
            except ValueError as e:
                print(f"spruce bench serving: {e}", file=sys.stderr)
                return 2
            os.sched_setaffinity(0, client_cpus)  # this process and the client processes it starts
            print(f"-- CPUs: client {client_cpus}, servers {server_cpus}")
        with contextlib.ExitStack() as stack:
            targets, launched, started = [None] * len(group), [None] * len(group), [None] * len(group)
            for start, i in enumerate(launch_order(len(group), args.rotation)):
                (cfg, cache), cpus = group[i], server_cpus[i]
                flags = [*common, *cfg.flags] + ([] if cache else ["--disable-radix-cache"])
                label = f"{cfg.name}{'' if cache else ', no prefix cache'}"
                src = sources.get(cfg.name)
                print(f"== {label}: spruce serve {shlex.join(flags)}" + (f" (spruce from {src})" if src else ""))
                log = out_dir / "server-logs" / f"{cfg.name}{'' if cache else '-no-cache'}.log"
                try:
                    launched[i] = LaunchedServer(flags, log, args.launch_timeout, cpus, src)
                    base_url = stack.enter_context(launched[i])
                    model = _served_model(args, base_url)
                except (RuntimeError, SystemExit) as e:
                    print(f"spruce bench serving: {label}: {e}", file=sys.stderr)
                    return 2
                if prompts is None:
                    prompts_path, prompts = _prompts_for(args, model)
                targets[i] = (base_url, model)
                started[i] = {"name": cfg.name, "prefix_cache": cache, "server_flags": flags, "log": str(log),
                              "cpus": cpus, "started": start} | ({"src": src} if src else {})
            runs.extend(started)
            keys = [{"server": run["name"], "prefix_cache": run["prefix_cache"]} for run in runs[-len(group):]]

            def journal_level(i: int, level: dict, keys=keys) -> None:
                with journal.open("a") as f:
                    f.write(json.dumps(keys[i] | level) + "\n")

            def place(pass_index: int, sets=server_cpus, servers=launched) -> list | None:
                """--pin-cpus: this pass's CPU set of each server (`rotated`), the servers moved there."""
                if not args.pin_cpus:
                    return None
                placed = rotated(sets, pass_index + args.rotation)
                for server, cpus in zip(servers, placed):
                    if server.cpus != cpus:
                        server.pin(cpus)
                return placed

            measured = asyncio.run(_bench(args, targets, prompts, journal_level, place))
            for run, server, (base_url, _), (levels, stopped) in zip(runs[-len(group):], launched, targets,
                                                                      measured):
                run |= {"server": server_info(base_url, _headers(args)), "levels": levels, "stopped": stopped}
                if stopped:  # the log's end goes into the result: a device run's logs may not come back
                    run["log_tail"] = server.log_tail(LOG_TAIL_LINES)
                    print(f"spruce bench serving: {run['name']}: stopped early; the server's log is {run['log']}",
                          file=sys.stderr)
    summary = {("prefix_cache" if cache else "no_prefix_cache"): {
        str(c): {r["name"]: [lv["output_throughput_tok_s"] for lv in r["levels"] if lv["concurrency"] == c]
                 for r in runs if r["prefix_cache"] == cache} for c in args.concurrency} for cache in modes}
    config_of = {cfg.name: shlex.join(cfg.flags) + (f" @{sources[cfg.name]}" if cfg.name in sources else "")
                 for cfg in configs}  # servers of equal flags and source are copies
    versus = {mode: {c: versus_best_other(per_run, config_of) for c, per_run in per_level.items()}
              for mode, per_level in summary.items()}
    paired = {mode: {c: paired_versus_best_other(per_run, config_of) for c, per_run in per_level.items()}
              for mode, per_level in summary.items()}
    twins = {mode: {c: paired_versus_twin(per_run, config_of) for c, per_run in per_level.items()}
             for mode, per_level in summary.items()}
    _print_summary(summary, versus, paired, twins)
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key", "base_url")} | {
        "prompts": str(prompts_path), "num_prompts": len(prompts)}
    path = write_result("serving", _device(args, runs[0]["server"]), config,
                        {"runs": runs, "summary": summary, "versus_best_other": versus,
                         "paired_versus_best_other": paired, "paired_versus_twin": twins}, out_dir)
    print(f"results: {path}")
    _plot_and_print({f"{r['name']}{'' if r['prefix_cache'] else ' (no cache)'}": last_pass(r["levels"])
                     for r in runs}, path.with_suffix(".png"))
    clean = all(r["stopped"] is None for r in runs) and all(lv["failed"] == 0 for r in runs for lv in r["levels"])
    return 0 if clean else 1


def _plot_and_print(series: dict[str, list[dict]], path: Path) -> None:
    """Plot the runs (see `plot`) and say where, or why not."""
    if not any(lv["completed"] for levels in series.values() for lv in levels):
        print("no request completed: no latency plot")
        return
    png = plot(series, path)
    print(f"plot: {png}" if png else "matplotlib is not installed: skipping the latency plot")


def _over_best_other(values: dict[str, float], configs: dict[str, str] | None = None) -> dict[str, float]:
    """Each entry over the best of the other configurations, less 1 (none where they are all 0 or there are none).
    `configs`: each entry's configuration (its server flags); entries of one configuration are copies of one server
    (CONTROL=1's twin), each other configuration counts as the mean of its copies. Without it every entry is a
    configuration of its own."""
    configs = configs or {name: name for name in values}
    copies: dict[str, list[float]] = {}
    for name, value in values.items():
        copies.setdefault(configs[name], []).append(value)
    means = {config: statistics.fmean(vals) for config, vals in copies.items()}
    out = {}
    for name, value in values.items():
        others = [v for config, v in means.items() if config != configs[name]]
        if others and max(others) > 0:
            out[name] = value / max(others) - 1.0
    return out


def versus_best_other(per_run: dict[str, list[float]], configs: dict[str, str] | None = None) -> dict[str, float]:
    """Each run's median output tokens/s over the best median among the other configurations of its level (copies
    of one configuration averaged, `_over_best_other`), less 1 (+0.05: 5% ahead of the best other server; runs
    without figures left out). What a comparison run asks of its levels, e.g. issue 16's adaptive server against
    the better of plain and fixed."""
    return _over_best_other({name: statistics.median(tps) for name, tps in per_run.items() if tps}, configs)


def paired_versus_best_other(per_run: dict[str, list[float]],
                             configs: dict[str, str] | None = None) -> dict[str, float]:
    """Each run's output tokens/s over the best other configuration's in the same pass (copies of one configuration
    averaged, `_over_best_other`), less 1, the median over the passes every run has (runs without figures left
    out). Runs measured together (--interleave) share each pass's machine: on an H200 host identical servers moved
    10-40% between passes, all of a slow pass's servers together more often than not, so a pass-by-pass ratio is
    less noisy than the ratio of medians (`versus_best_other`), which pairs one server's third-best pass with
    another's. Copies are averaged, not each taken as a rival: the better of two noisy copies in each pass would
    put a run's figure lower by a few points."""
    runs = {name: tps for name, tps in per_run.items() if tps}
    passes = min((len(tps) for tps in runs.values()), default=0)
    per_pass = [_over_best_other({name: tps[k] for name, tps in runs.items()}, configs) for k in range(passes)]
    return {name: statistics.median(ratios) for name in runs
            if (ratios := [ratio[name] for ratio in per_pass if name in ratio])}


def workload_name(config: dict) -> str:
    """A `bench serving` result's workload from its config: the shared-prefix one (prefix<tokens>+<prompt tokens>)
    or short prompts (prompt<tokens>)."""
    prefix = config.get("shared_prefix_tokens") or 0
    return f"prefix{prefix}+{config['prompt_tokens']}" if prefix else f"prompt{config['prompt_tokens']}"


def server_cpus(result: dict) -> list[int]:
    """How many CPUs each pinned server of a `bench serving` result had (--pin-cpus; sorted, distinct), from its
    levels (a journal's too); empty where the servers were not pinned."""
    figures = result["figures"]
    levels = [lv for run in figures.get("runs", []) for lv in run.get("levels", [])] + figures.get("levels", [])
    return sorted({len(lv["cpus"]) for lv in levels if lv.get("cpus")})


def bar_setting(result: dict) -> str:
    """What a bar result's figures may be pooled under: its workload (`workload_name`) and, for pinned servers, their
    CPUs each: a server's host time reaches its tokens at some CPU budgets and not at others, so runs on different
    CPU budgets are not one population."""
    name = workload_name(result["config"])
    cpus = server_cpus(result)
    return name + (f", {'/'.join(map(str, cpus))} CPU{'' if cpus == [1] else 's'} a server" if cpus else "")


def paired_versus_twin(per_run: dict[str, list[float]], configs: dict[str, str]) -> dict[str, float]:
    """Each run that has copies (runs of its configuration): its output tokens/s over the mean of its copies' in the
    same pass, less 1, the median over the passes they all have. How far one server's figure moves with nothing
    changed (CONTROL=1): the floor under any figure of `paired_versus_best_other`."""
    out = {}
    for name, tps in per_run.items():
        copies = [per_run[other] for other in per_run if other != name and configs[other] == configs[name]
                  and per_run[other]]
        passes = min([len(tps), *(len(c) for c in copies)])
        if copies and passes:
            out[name] = statistics.median(tps[k] / statistics.fmean(c[k] for c in copies) - 1.0
                                          for k in range(passes))
    return out


def _print_summary(summary: dict, versus: dict, paired: dict, twins: dict) -> None:
    """Output tokens/s per run at each concurrency (one figure per pass, then their median), each median against
    the best other configuration's (`versus`: `versus_best_other` of each level), each run pass by pass against the
    best other configuration of its pass (`paired`: `paired_versus_best_other`) and, where a configuration ran in
    copies, each copy pass by pass against the others (`twins`: `paired_versus_twin`), per prefix-cache mode."""
    for mode, per_level in summary.items():
        print(f"-- output tokens/s, {mode.replace('_', ' ')} (each pass; median)")
        for c, per_run in per_level.items():
            print(f"   concurrency {c:>3}: " + ", ".join(
                f"{name} {'/'.join(f'{t:.0f}' for t in tps)}" + (f" ({statistics.median(tps):.0f})" if tps else "")
                for name, tps in per_run.items()))
            if versus[mode][c]:
                print("      median vs the best other: " + ", ".join(f"{name} {v:+.1%}"
                                                                       for name, v in versus[mode][c].items()))
            if paired[mode][c]:
                print("      pass by pass vs the best other of the pass (median): " + ", ".join(
                    f"{name} {v:+.1%}" for name, v in paired[mode][c].items()))
            if twins[mode][c]:
                print("      copies, pass by pass vs their twins (median): " + ", ".join(
                    f"{name} {v:+.1%}" for name, v in twins[mode][c].items()))
