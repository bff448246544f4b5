"""Adaptive speculation against plain decoding (or a fixed round) in one process, engines alternated (issue 16): the
serving bar's workloads without the servers.

Served, two identical plain servers differ by up to 10-25% in a pass, and on the H200 an adaptive server trailed plain
at concurrency 1 by ~8% in three runs while this benchmark put the engines 1-2% apart. Here the engines are built side
by side in one process and driven by a closed-loop client in that process (`concurrency` requests in flight, the next
one added as soon as one finishes, one idle step when none is left, as a server's engine loop has; `--idle-gaps`: also
before each added request when none is in flight, as a server at concurrency 1 meets each request after an idle gap
(the client's round trip), which the adaptive policy's standing choices must survive), and every
repetition runs each engine once, in a rotating order, so that the machine's drift weighs on all of them alike:
- plain: the target alone;
- adaptive: `speculative_adaptive` over the (5, 4, 8) EAGLE-3 round, its own policy (probes included);
- forced (`--forced`): the adaptive engine with rounds priced out (bench.common.price_out), so its model always
  chooses plain steps: what the adaptive machinery costs when it never speculates;
- fixed (`--kinds`): the same (5, 4, 8) round, not adaptive;
- rounds (`--kinds`): the adaptive engine with plain steps priced out, so it runs rounds only: what the adaptive
  machinery costs when it always speculates (against fixed: on the H100, 2026-11-26, 128-token prompts, its
  launch +35 us and resolve +15 us a decode step at concurrency 8);
- fixed-S-K-N (`--shapes S,K,N ...`): a fixed round of another tree shape: which (S, K, N) wins at which load,
  the headroom a per-load choice of the shape would have over the (5, 4, 8) round;
- adaptive-N-N'... (`--widths N,N' ...`): adaptive speculation over (5, 4, N) rounds that may also verify the
  narrower trees N' (`speculative_adaptive_widths`; speculative/tree_width.py chooses per batch size).
`--workload prefix` (default): every request is one 1024-token shared prefix + its own held-out prompt (256 tokens);
`short`: its own 128-token prompt; 128 output tokens, greedy. The prompts are sent twice before measuring, so the
prefix cache holds them as in a serving run's later passes; `--warm-runs N`: before a concurrency's timed repetitions
every engine runs N closed loops of it unrecorded, so that the adaptive policy has settled the load (its first
requests at a load it never met run while it learns it; session 56 timed 64 twice for that, keeping the second).
`--scheduler-delay-factor F`: prefill batching as the servers of the serving bar run it (4;
runtime/prefill_batching.py), which holds arrivals back by the mean prefill launch: the in-process runs until session
39 admitted at once, and served, the adaptive server launched 15-18% fewer prefills than the plain ones at
concurrency 32-64 (H100 x2, session 39).
Per repetition and engine: output tokens/s, median TTFT (launch to first token), TPOT, and the engine's own step
counters over the repetition (prefill and decode steps, rounds, host seconds per part), the adaptive policy's
choices, probes and catch-ups. Medians over repetitions and their ratio to plain (and to fixed, if it ran) go into
the summary, and beside them each repetition's ratio to the base of that repetition, as measured and host speed
adjusted (`paired`; a profiled repetition left out). `--profile`: each engine's last repetition at each concurrency
runs under cProfile, whose top functions go to OUT_DIR/adaptive-inprocess-profile-KIND-CONCURRENCY.txt (and all of
them, pstats' dump, to .prof). `--per-request`: every request's end-to-end time, TTFT and the rounds run while it
was in flight, and per kind its excess over plain split by requests that saw rounds (a probe), the AFTER_ROUNDS
requests after them and the others (`per_request_excess`; at concurrency 1 the parts sum to the wall time's excess):
what a probe costs in all against what the policy priced and measured it at.

Usage (repo root): python bench/adaptive_inprocess.py --model DIR --draft DIR [--concurrency 1 8 32 64]
    [--repeats 6] [--requests 48] [--warm-runs N] [--forced] [--kinds KIND ...] [--shapes S,K,N ...]
    [--widths N,N' ...] [--workload prefix|short] [--idle-gaps] [--scheduler-delay-factor F] [--profile]
    [--per-request]
    [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch

from spruce import LLM, SamplingParams
from spruce.bench.common import host_adjusted, mean_se, price_out, write_result
from spruce.bench.serving import load_prompts
from spruce.server.heap import freeze_startup_objects
from spruce.speculative.adaptive_policy import PLAIN, SPECULATIVE

MAX_TOKENS = 128
WORKLOADS = {"prefix": (1024, 256), "short": (0, 128)}  # (shared prefix tokens, prompt tokens)
KINDS = ("plain", "adaptive", "forced", "fixed", "rounds")


def shape_kind(text: str) -> str:
    """`--shapes`' "S,K,N" as the kind name fixed-S-K-N (an error naming the value if it is not three integers)."""
    parts = text.split(",")
    if len(parts) != 3 or not all(part.strip().isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"a tree shape is S,K,N (three positive integers), got {text!r}")
    return "fixed-" + "-".join(part.strip() for part in parts)


def widths_kind(text: str) -> str:
    """`--widths`' "N,N',..." as the kind name adaptive-N-N'-... (an error naming the value if it is not two or more
    integers)."""
    parts = text.split(",")
    if len(parts) < 2 or not all(part.strip().isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"verify widths are N,N',... (two or more positive integers), got {text!r}")
    return "adaptive-" + "-".join(part.strip() for part in parts)


def build(kind: str, args) -> LLM:
    """The engine named `kind`: plain, adaptive, forced (adaptive with rounds priced out), fixed, rounds
    (adaptive with plain steps priced out), fixed-S-K-N (a fixed round of that tree shape), or adaptive-N-N'...
    (adaptive over (5, 4, N) rounds with the narrower verify widths N')."""
    kw = dict(page_size=16, max_running_requests=64, device=args.device,
              scheduler_delay_factor=args.scheduler_delay_factor)
    if args.device == "cuda":
        kw["dtype"] = "bfloat16"
    if kind != "plain":
        steps, topk, tokens = map(int, kind.split("-")[1:]) if kind.startswith("fixed-") else (5, 4, 8)
        if kind.startswith("adaptive-"):
            tokens, *narrower = map(int, kind.split("-")[1:])
            kw.update(speculative_adaptive_widths=tuple(narrower))
        kw.update(draft_model=args.draft, speculative_num_steps=steps, speculative_eagle_topk=topk,
                  speculative_num_draft_tokens=tokens, speculative_adaptive=kind not in ("fixed", *args.shapes))
    llm = LLM(args.model, **kw)
    if kind in ("forced", "rounds"):
        price_out(llm, SPECULATIVE if kind == "forced" else PLAIN)
    return llm


def closed_loop(llm: LLM, prompts: list, first: int, concurrency: int, num_requests: int,
                idle_gaps: bool = False, per_request: bool = False) -> dict:
    """Send `num_requests` requests (prompts[first:], wrapping) with `concurrency` in flight; the figures of the
    run and the engine's counters over it. `idle_gaps`: whenever none is in flight, one idle step before the next
    request is added (else only after the last). `per_request`: also each request's [end-to-end ms, TTFT ms,
    rounds while it was in flight] in the order sent ("requests"; rounds None for an engine without an adaptive
    policy), read from the engine's stats after every step in which a request finished, as a server takes them
    when its engine goes idle."""
    engine = llm.engine
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    freeze_startup_objects()  # the engines, torch and earlier runs out of the collector's reach (a full collection
    # walking them is ~0.1 s inside whichever step it lands in: spruce/bench/serving_client.py)
    before = engine.stats()
    live: dict[str, list] = {}  # request id -> [added at, first token at, its index, rounds chosen when added]
    e2e, ttft, tokens, sent, idle_steps = [], [], 0, 0, 0
    records: list[list | None] = []  # per request sent: [e2e ms, TTFT ms, rounds in flight] once it finished
    rounds_chosen = _rounds_chosen(before)

    def submit() -> None:
        nonlocal sent
        rid = engine.add_request(prompts[(first + sent) % len(prompts)], params)
        live[rid] = [time.perf_counter(), None, sent, rounds_chosen]
        records.append(None)
        sent += 1

    start = time.perf_counter()
    while sent < min(concurrency, num_requests):
        submit()
    while live:
        outputs = engine.step()
        now = time.perf_counter()
        finished, done = 0, []
        for out in outputs:
            clock = live.get(out.request_id)
            if clock is None:
                continue
            if clock[1] is None and out.token_ids:
                clock[1] = now
            if out.finished:
                e2e.append(now - clock[0])
                ttft.append(clock[1] - clock[0])
                tokens += len(out.token_ids)
                del live[out.request_id]
                finished += 1
                done.append(clock)
        if per_request and done:  # the rounds each finished request saw: the count now less the one it met
            rounds_chosen = _rounds_chosen(engine.stats())
            for added, first_token, index, met in done:
                records[index] = [round((now - added) * 1e3, 3), round((first_token - added) * 1e3, 3),
                                  None if met is None else rounds_chosen - met]
        if not live and (idle_gaps or sent == num_requests):
            engine.step()  # nothing to launch: the engine goes idle, as between a server's requests
            idle_steps += 1
        for _ in range(min(finished, num_requests - sent)):
            submit()
    wall = time.perf_counter() - start
    after = engine.stats()
    steps_before, steps_after = before["steps"], after["steps"]
    adaptive = after.get("adaptive")
    return {
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_ms_median": round(statistics.median(ttft) * 1e3, 3),
        "tpot_us_median": round(statistics.median((a - b) / (MAX_TOKENS - 1) for a, b in zip(e2e, ttft)) * 1e6, 2),
        "wall_s": round(wall, 3),
        "steps": {k: steps_after[k] - steps_before[k] for k in ("prefills", "decodes", "rounds", "decode_rows")},
        "prefill_launch_ms": round(1e3 * (steps_after["prefill_launch"] - steps_before["prefill_launch"]), 1),
        "prefill_holds": after["prefill_holds"] - before["prefill_holds"],
        "step_host_ms": {k: round(1e3 * (steps_after["seconds"][k] - steps_before["seconds"][k]), 1)
                         for k in steps_after["seconds"]},
        "adaptive_total": None if adaptive is None else {k: adaptive[k] for k in ("chosen", "probes", "catch_ups",
                                                                                  "tree_width") if k in adaptive},
        "idle_steps": idle_steps,
    } | ({"requests": records} if per_request else {})


def _rounds_chosen(stats: dict) -> int | None:
    """The rounds an engine's adaptive policy has chosen so far (None: no policy)."""
    adaptive = stats.get("adaptive")
    return None if adaptive is None else adaptive["chosen"].get(SPECULATIVE, 0)


def paired(rows: list[dict], base: list[dict]) -> dict | None:
    """Per repetition, a kind's tokens/s (`rows`, one per repetition) over the base kind's of the same repetition
    (`base`), less 1, mean +- standard error over the repetitions: as measured (`unadjusted`), and as if both had
    run on one host speed (`host_adjusted`: tokens/s times the ratio of their output processing seconds per
    decode row, which is the same code in every engine and so reads the host's speed; meaningful between kinds
    that run the same steps, e.g. plain against an adaptive engine choosing plain, at loads where the step is
    host-bound: at concurrency 1 it is the device's and the adjustment only adds the outputs' noise). On the H200
    (2026-11-28, concurrency 64, 1k shared prefix) the host's speed moved by up to half between repetitions ~2 s
    apart, every host part of the step with it, so that the adaptive engine's median came out 1-7% behind
    plain's, its pairs -2.4 +- 5.5% and -2.6 +- 5.8% as measured, +2.1 +- 1.2% and +2.4 +- 1.3% adjusted (two
    runs). None without two repetitions of each."""
    pairs = list(zip(rows, base))
    if len(pairs) < 2:
        return None

    def outputs_per_row(figures: dict) -> float:
        return figures["step_host_ms"]["outputs"] / max(figures["steps"]["decode_rows"], 1)

    each = [host_adjusted(mine["tokens_per_s"], theirs["tokens_per_s"], outputs_per_row(mine),
                          outputs_per_row(theirs)) for mine, theirs in pairs]
    return {"unadjusted": mean_se([pair["unadjusted"] for pair in each]),
            "host_adjusted": mean_se([pair["adjusted"] for pair in each]),
            "outputs": mean_se([pair["outputs"] for pair in each])}


AFTER_ROUNDS = 3  # requests sent after one that saw rounds that `per_request_excess` counts as its aftermath


def per_request_excess(rows: list[dict], base: list[dict]) -> dict | None:
    """Where a kind's time went against the base kind's, request by request (`--per-request`; at concurrency 1,
    where a repetition's wall time is the sum of its requests' and both kinds ran the same prompts in the same
    order): each request's end-to-end time less the base's request of the same index, summed over the
    repetitions per class of request: "rounds" (rounds ran while it was in flight: a probe, or the cold start),
    "after" (one of the AFTER_ROUNDS requests sent after such a request, which may pay what the rounds left: a
    catch-up, a prompt recomputed with its draft, a park not yet regained) and "other"; milliseconds in all and
    microseconds a request. None without per-request records of both."""
    classes = {name: {"requests": 0, "excess_ms": 0.0} for name in ("rounds", "after", "other")}
    for mine, theirs in zip(rows, base):
        records, base_records = mine.get("requests"), theirs.get("requests")
        if not records or not base_records or records[0][2] is None:
            return None
        since_rounds = AFTER_ROUNDS + 1
        for record, base_record in zip(records, base_records):
            if record[2]:
                name, since_rounds = "rounds", 0
            else:
                since_rounds += 1
                name = "after" if since_rounds <= AFTER_ROUNDS else "other"
            classes[name]["requests"] += 1
            classes[name]["excess_ms"] += record[0] - base_record[0]
    for figures in classes.values():
        figures["excess_ms"] = round(figures["excess_ms"], 3)
        figures["us_a_request"] = round(1e3 * figures["excess_ms"] / max(figures["requests"], 1), 1)
    return classes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--requests", type=int, default=48,
                    help="requests per repetition at concurrency 1 (16 x concurrency when that is more)")
    ap.add_argument("--warm-runs", type=int, default=0,
                    help="closed loops each engine runs at a concurrency, unrecorded, before its timed repetitions "
                         "(the adaptive policy learns a new load meanwhile)")
    ap.add_argument("--forced", action="store_true", help="also the adaptive engine with rounds priced out")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=["plain", "adaptive"],
                    help="the engines to alternate (--forced adds forced)")
    ap.add_argument("--shapes", nargs="+", type=shape_kind, default=[], metavar="S,K,N",
                    help="fixed rounds of these tree shapes too (kinds fixed-S-K-N)")
    ap.add_argument("--widths", nargs="+", type=widths_kind, default=[], metavar="N,N'",
                    help="adaptive engines over (5, 4, N) rounds that may verify the narrower trees N' too (kinds "
                         "adaptive-N-N'...)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="prefix")
    ap.add_argument("--scheduler-delay-factor", type=float, default=0.0,
                    help="prefill batching, as the servers' --scheduler-delay-factor (the serving bar's: 4)")
    ap.add_argument("--idle-gaps", action="store_true",
                    help="an idle step before each request added while none is in flight (a server at concurrency 1)")
    ap.add_argument("--profile", action="store_true", help="each engine's last repetition under cProfile")
    ap.add_argument("--per-request", action="store_true",
                    help="record every request's times and rounds, and split each kind's excess over plain by "
                         "requests that saw rounds, the few after them, and the others (per_request_excess)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    kinds = list(dict.fromkeys(args.kinds + (["forced"] if args.forced else []) + args.shapes + args.widths))
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    llms = {kind: build(kind, args) for kind in kinds}
    shared_prefix_tokens, prompt_tokens = WORKLOADS[args.workload]
    prompts = load_prompts(Path(args.model) / "heldout_prompts.jsonl", prompt_tokens,
                           llms[kinds[0]].engine.tokenizer, shared_prefix_tokens)
    for llm in llms.values():  # every prompt twice: the cache holds them (an adaptive engine inserts a prompt's
        closed_loop(llm, prompts, 0, 1, len(prompts))  # pages the second time, speculative/adaptive.py)
        closed_loop(llm, prompts, 0, 8, len(prompts))
    runs, summary = {}, {}
    for concurrency in args.concurrency:
        num_requests = max(args.requests, 16 * concurrency)
        per_kind = {kind: [] for kind in kinds}
        for warm in range(args.warm_runs):  # (offsets past the timed ones: other prompts first)
            for kind in kinds:
                closed_loop(llms[kind], prompts, (args.repeats + warm) * num_requests, concurrency, num_requests,
                            args.idle_gaps)
        for rep in range(args.repeats):
            for kind in kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]:
                profile = cProfile.Profile() if args.profile and rep == args.repeats - 1 else None
                if profile is not None:
                    profile.enable()
                figures = closed_loop(llms[kind], prompts, rep * num_requests, concurrency, num_requests,
                                      args.idle_gaps, args.per_request)
                if profile is not None:
                    profile.disable()
                    report = io.StringIO()
                    pstats.Stats(profile, stream=report).sort_stats("tottime").print_stats(60)
                    stem = Path(args.out_dir) / f"adaptive-inprocess-profile-{kind}-{concurrency}"
                    stem.with_suffix(".txt").write_text(report.getvalue())
                    profile.dump_stats(stem.with_suffix(".prof"))  # every function, for a diff between kinds
                per_kind[kind].append(figures)
                shown = {k: v for k, v in figures.items() if k != "requests"}
                print(f"concurrency {concurrency} rep {rep} {kind}: {shown}", flush=True)
        runs[str(concurrency)] = per_kind
        medians = {kind: {f: statistics.median(r[f] for r in rows)
                          for f in ("tokens_per_s", "ttft_ms_median", "tpot_us_median")}
                   for kind, rows in per_kind.items()}
        timed = {kind: rows[:-1] if args.profile else rows for kind, rows in per_kind.items()}  # (not profiled)
        for kind, med in medians.items():
            for base in ("plain", "fixed"):
                if base in medians:
                    med[f"vs_{base}"] = round(med["tokens_per_s"] / medians[base]["tokens_per_s"] - 1, 4)
                    if kind != base:
                        med[f"paired_vs_{base}"] = paired(timed[kind], timed[base])
                        if args.per_request:
                            med[f"per_request_vs_{base}"] = per_request_excess(timed[kind], timed[base])
            print(f"concurrency {concurrency} {kind}: {med}", flush=True)
        summary[str(concurrency)] = medians
    config = vars(args) | {"kinds": kinds, "max_tokens": MAX_TOKENS, "shared_prefix_tokens": shared_prefix_tokens,
                           "prompt_tokens": prompt_tokens, "num_prompts": len(prompts),
                           "speculative": {kind: llm.engine.info()["speculative"] for kind, llm in llms.items()}}
    path = write_result("adaptive-inprocess", args.device, config, {"summary": summary, "runs": runs},
                        Path(args.out_dir))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
