"""Issue 16's bar pass by pass: where the adaptive server's shortfall against the better of plain and fixed comes
from, over many `spruce bench serving --launch` results (bench/device_serving_prefix.sh with CONTROL=1).

Per workload and concurrency the adaptive server's passes are grouped by whether its level ran any step of the losing
choice (plain steps where the fixed server is the better one, rounds where the plain server is: probes and switches)
and whether it was a run's first pass (where every load is learned). Each group: the adaptive server's tokens/s over
the better configuration's in the same pass (the level's better one, by its mean over the passes, its copies
averaged; bench/serving_bar.py takes the better one of each pass, the same configuration wherever the two differ by
more than the noise, as plain and fixed do on these workloads), mean and standard error over the passes. For the
passes that ran the better choice only, the engine's own counters per decode step (launch, resolve, outputs, the
engine process's step, ...: `engine.seconds` of each level) of the adaptive server less those of the better
configuration's copies, beside the same difference between the two copies (the control): what the adaptive machinery
costs the served engine's host when it decides nothing new. And for those passes, how it admitted requests against
the better configuration's copies (relative: prefill launches per request, TTFT p50, the mean prefill launch's
seconds where the servers report them), beside the copies' own: in session 39's shared-prefix runs the adaptive
server launched 15-18% fewer prefills at concurrency 32-64 in those passes, and prefill batching
(--scheduler-delay-factor) holds arrivals by the mean prefill launch. And, relative the same way, a request's decode
phase (first to last text chunk) and its stream's tail (`phase`), where the results have them: at concurrency 1
(eight runs at ae7007a/ff36abe) the adaptive server's decode phase was 1.5 +- 0.5% longer (control -0.1 +- 0.7%) with
its TTFT level, where its ITL mean read level (more chunks a request). And per group, the share of the adaptive
server's requests that joined detached (mean over its passes) and why the others joined with their drafts
(`adaptive_steps.attached`, summed), and the share of its plain steps that ran parked (`adaptive_steps.parked_steps`,
session 58: told steps cost the host bookkeeping), where the server reports them. And over the later passes that ran
the better choice only, the CPUs the adaptive server and the better one's copies kept busy (their engine and HTTP
processes' CPU seconds over the level, spruce.bench.serving.server_busy) against the CPUs each had: two CPUs a
server at concurrency 1 ran 1.65-1.7 busy on the H200 (session 59, /proc), where a little more host work queues.

And over every pass, each ratio adjusted for the host's speed in its level: the engines are host-bound from
concurrency 8 up, and the host's speed moves between the levels of one run (on the H100 x4, four runs at once, one
server's launch took 373-865 us a decode step at 64 from level to level, its resolve and outputs alike), which is
most of the passes' spread. The speed is read from the engine's output processing (`step.outputs` per request-step:
the same code in every server), and a pass's ratio is taken as if both servers had had one speed (tokens/s times the
ratio of their outputs seconds per request-step). Over the eight runs at c29a592 (2026-11-27) that part's ratio and
the tokens/s ratio correlated at -0.95 to -0.98 at 8-64, for the control copies as for the adaptive server, and the
adjustment took the control's standard error from 1.6-1.9% to 0.4-0.7%. It flatters a server whose process slows its
output processing more than the rest of its step: the outputs ratio is printed beside it (`outputs`), against the
control's, to judge that by. Every speculative process measured so far does: the skeleton experiment's server (a
plain engine's work in an adaptive process with the draft loaded, e64eb1c, four runs) ran that part 1.6-4.2% slower
than the plain servers at 8-64 while its tokens/s were 0.1-2.0% lower, so adjusted it read +0.9 to +1.7% ahead of
them; the adaptive servers' part ran 2-3.5% slower (19 runs at 4037e6d, 10ffd04, c29a592) against the controls' 0 +-
1.5% (not their CPUs: --pin-cpus rotates the sets between passes). Read adjusted figures as the adaptive server's
side of a band whose other side is the unadjusted one, not as a verdict. Printed where it narrows the control's
spread (not at concurrency 1, where a step is the device's and the adjustment only adds the outputs part's noise);
every level's figures go to the result.

And at each concurrency where the better configuration is the plain one, per run the score of the bucket-1 decode
graph each server kept of its draws (`cuda_graph_draws` in its server info, runtime/graph_draws.py: the adaptive
server's detached plain step, the plain copies' step) as the adaptive one's over the copies' mean, beside the run's
mean ratio there, and their correlation over the runs: whether what is left at concurrency 1 follows the placement
of the graphs the servers kept (four H200 x4 runs at 3f471b4: -0.82, the scores within 0.8% of each other; but -0.74
and -0.58 at 8 and 64, where no bucket-1 graph runs: there a correlation is the run's, not the graph's).

And per concurrency, the passes whose largest gap between two tokens of one request reached STALL_GAP_S, the
adaptive server's and the better configuration's copies': a stall is the client's or a server's, and it weighs on
whichever level it lands in (session 57, sixteen H200 x4 runs since ee99357: at concurrency 1, 2 of the adaptive
server's 64 passes and 2 of its rivals' 128 levels read 109-132 ms, the one whose server log was kept a client's
stall (every request served in 35 ms or less); at 32, 4 and 8 read 113-130 ms; at 8 and 64 none, the largest
ordinary gaps at 64 50-71 ms; bench serving's clients freeze their heaps before each level since).

Usage (repo root): python bench/serving_passes.py bench/results/serving-nvidia-h100-*.json [--out-dir DIR]
(results rebuilt from a journal by bench/serving_journal.py too)
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
from pathlib import Path

from spruce.bench.common import host_adjusted, mean_se, write_result
from spruce.bench.serving import bar_setting, mean_prefill_launch, server_busy
from spruce.bench.serving_launch import LaunchConfig

COUNTERS = ("step.launch", "step.resolve", "step.outputs", "process.messages", "process.step", "process.encode",
            "process.send")
ADMISSION = ("prefills_per_request", "ttft_p50", "prefill_launch")  # `admission`'s figures
PHASES = ("decode_phase", "stream_tail")  # `phase`'s figures
STALL_GAP_S = 0.1  # a gap between two tokens of one request this long is a stall (the client's or a server's): at
# concurrency 64 on the H200 x4 the largest gaps of ordinary levels read 50-71 ms


def per_decode(level: dict, counter: str) -> float | None:
    """A level's engine counter (seconds) per decode step, in microseconds (None: the level has no counters)."""
    engine = level.get("engine") or {}
    decodes = (engine.get("steps") or {}).get("decode")
    seconds = (engine.get("seconds") or {}).get(counter)
    return None if not decodes or seconds is None else seconds / decodes * 1e6


def admission(level: dict, figure: str) -> float | None:
    """A level's ADMISSION `figure`: prefill launches per completed request, TTFT p50 (seconds), or the mean prefill
    launch (seconds; None where the server does not report it)."""
    engine = level.get("engine") or {}
    if figure == "prefills_per_request":
        return engine.get("prefills_per_request")
    if figure == "ttft_p50":
        return (level.get("ttft_s") or {}).get("p50")
    return mean_prefill_launch(engine)


def phase(level: dict, figure: str) -> float | None:
    """A level's PHASES `figure`, per request on average (seconds): its decode phase (first to last text chunk: e2e
    less TTFT and the stream's tail) or its stream's tail (last text chunk to the stream's end); None where the
    result predates them (spruce bench serving, session 53). Not the ITL mean: servers chunk a request's tokens
    differently (at concurrency 1 the adaptive server's requests came in 124.9 chunks against the plain servers'
    123.3-123.6 at ae7007a), so a mean gap is no per-token figure."""
    tail = (level.get("stream_tail_s") or {}).get("mean")
    if tail is None:
        return None
    if figure == "stream_tail":
        return tail
    return level["e2e_s"]["mean"] - level["ttft_s"]["mean"] - tail


def relative(mine: dict, copies: list[dict], figures: tuple[str, ...], read) -> tuple[dict, dict]:
    """Per figure, `read(level, figure)` of the adaptive level `mine` over the mean of the better configuration's
    copies' levels, less 1, and (two copies) the second copy's over the first's, less 1: figures any level lacks are
    left out."""
    over, control = {}, {}
    for figure in figures:
        theirs = [read(level, figure) for level in copies]
        value = read(mine, figure)
        if value is not None and None not in theirs and all(theirs):
            over[figure] = value / statistics.fmean(theirs) - 1.0
            if len(theirs) == 2:
                control[figure] = theirs[1] / theirs[0] - 1.0
    return over, control


def outputs_per_row(level: dict) -> float | None:
    """A level's output processing seconds per request-step (`step.outputs` over decode steps times their mean
    batch): the host's speed in that level, for `run_passes`' adjustment (None: no counters)."""
    engine = level.get("engine") or {}
    rows = (engine.get("steps") or {}).get("decode", 0) * (engine.get("mean_decode_batch") or 0)
    seconds = (engine.get("seconds") or {}).get("step.outputs")
    return seconds / rows if rows and seconds else None


def runs_of(result: dict) -> list[dict]:
    """A result's servers, each {"name", "prefix_cache", "levels" (in pass order)}: its `runs`, or, for one rebuilt
    from a journal (bench/serving_journal.py), its levels grouped by server, in the order of its launch list."""
    figures = result["figures"]
    if "runs" in figures:
        return figures["runs"]
    order = [LaunchConfig.parse(text).name for text in result["config"].get("launch") or []]
    runs: dict[tuple[str, bool], dict] = {}
    for level in sorted(figures.get("levels", []), key=lambda lv: lv.get("pass", 0)):
        key = (level["server"], level.get("prefix_cache", True))
        runs.setdefault(key, {"name": key[0], "prefix_cache": key[1], "levels": []})["levels"].append(level)
    return sorted(runs.values(), key=lambda run: order.index(run["name"]) if run["name"] in order else len(order))


def run_passes(result: dict) -> tuple[str, list[dict]] | None:
    """One result's adaptive passes: (workload, one record per pass and concurrency), None without plain, fixed and
    adaptive servers and a copy of the better one."""
    config = result["config"]
    workload = bar_setting(result)  # (pinned servers' CPU budgets apart)
    launch = {cfg.name: shlex.join(cfg.flags) for cfg in map(LaunchConfig.parse, config.get("launch") or [])}
    runs = {run["name"]: run for run in runs_of(result) if run.get("prefix_cache", True)}
    if not {"plain", "fixed", "adaptive"} <= set(runs) <= set(launch):
        return None
    records = []
    for concurrency in config.get("concurrency") or sorted({lv["concurrency"] for run in runs.values()
                                                            for lv in run["levels"]}):  # (a journal's: its levels')
        levels = {name: [lv for lv in run["levels"] if lv["concurrency"] == concurrency] for name, run in runs.items()}
        mean_tps = {name: statistics.fmean(lv["output_throughput_tok_s"] for lv in lvs) if lvs else 0.0
                    for name, lvs in levels.items()}
        better = max(("plain", "fixed"), key=lambda name: mean_tps[name])
        copies = [name for name in runs if launch[name] == launch[better]]
        losing_steps = "plain" if better == "fixed" else "speculative"
        passes = min(len(levels[name]) for name in ("adaptive", *copies))
        draws = draw_ratio(runs, copies) if better == "plain" else None
        for k in range(passes):
            adaptive = levels["adaptive"][k]
            better_tps = statistics.fmean(levels[name][k]["output_throughput_tok_s"] for name in copies)
            steps = adaptive.get("adaptive_steps") or {}
            record = {"concurrency": concurrency, "pass": k, "better": better,
                      "losing_steps": steps.get(losing_steps, 0),
                      "versus_better": adaptive["output_throughput_tok_s"] / better_tps - 1.0, "counters": {},
                      "control": {}, "detached": (steps["detached"] / adaptive["completed"]
                                                  if "detached" in steps and adaptive.get("completed") else None),
                      "attached": dict(steps.get("attached") or {}), "draw_ratio": draws,
                      "parked": (steps["parked_steps"] / steps["plain"]
                                 if steps.get("plain") and "parked_steps" in steps else None)}
            for counter in COUNTERS:
                theirs = [per_decode(levels[name][k], counter) for name in copies]
                mine = per_decode(adaptive, counter)
                if mine is not None and None not in theirs:
                    record["counters"][counter] = mine - statistics.fmean(theirs)
                    if len(theirs) == 2:
                        record["control"][counter] = theirs[1] - theirs[0]
            theirs = [outputs_per_row(levels[name][k]) for name in copies]
            record["host"] = host_adjusted(adaptive["output_throughput_tok_s"], better_tps, outputs_per_row(adaptive),
                                           None if None in theirs else statistics.fmean(theirs))
            record["host_control"] = None if len(copies) != 2 else host_adjusted(  # the second copy over the first
                *(levels[name][k]["output_throughput_tok_s"] for name in copies[::-1]), *theirs[::-1])
            theirs = [levels[name][k] for name in copies]
            record["admission"], record["admission_control"] = relative(adaptive, theirs, ADMISSION, admission)
            record["phases"], record["phases_control"] = relative(adaptive, theirs, PHASES, phase)
            record["gaps"] = {"adaptive": largest_gap(adaptive), "copies": [largest_gap(level) for level in theirs]}
            record["cpus_busy"] = {"adaptive": server_busy(adaptive), "copies": [server_busy(lv) for lv in theirs],
                                   "cpus": len(adaptive.get("cpus") or [])}
            records.append(record)
    return workload, records


def cpus_busy(records: list[dict]) -> dict | None:
    """Over `records`, the mean CPUs the adaptive server and the better configuration's copies kept busy
    (spruce.bench.serving.server_busy) and the CPUs each had (0: not pinned); None where no pass reports them."""
    adaptive = [r["cpus_busy"]["adaptive"] for r in records if r["cpus_busy"]["adaptive"] is not None]
    copies = [busy for r in records for busy in r["cpus_busy"]["copies"] if busy is not None]
    if not adaptive or not copies:
        return None
    return {"adaptive": statistics.fmean(adaptive), "copies": statistics.fmean(copies),
            "cpus": max(r["cpus_busy"]["cpus"] for r in records)}


def largest_gap(level: dict) -> float | None:
    """A level's largest gap between two tokens of one request (seconds; None where the result has no ITLs)."""
    return (level.get("itl_s") or {}).get("max")


def stalls(records: list[dict]) -> dict | None:
    """The passes whose largest token gap reached STALL_GAP_S: the adaptive server's (and their gaps, seconds), and
    the better configuration's copies' over as many of their levels; None where no level reports its gaps."""
    mine = [r["gaps"]["adaptive"] for r in records if r["gaps"]["adaptive"] is not None]
    theirs = [gap for r in records for gap in r["gaps"]["copies"] if gap is not None]
    if not mine and not theirs:
        return None
    return {"adaptive": {"passes": len(mine), "stalled": sorted(g for g in mine if g >= STALL_GAP_S)},
            "copies": {"levels": len(theirs), "stalled": sorted(g for g in theirs if g >= STALL_GAP_S)}}


def kept_draw(server: dict, phase: str) -> float | None:
    """The score (us) of the draw a server kept of phase `phase`'s bucket-1 graph, from its info's
    `cuda_graph_draws` ("decode@1 kept 2 of 865.3,861.1,... in 0.41 s; ...", the seconds since session 56), None
    where it drew none."""
    for part in (server.get("cuda_graph_draws") or "").split("; "):
        name, _, rest = part.partition("@1 kept ")
        if name == phase and " of " in rest:
            kept, _, scores = rest.partition(" of ")
            return float(scores.partition(" in ")[0].split(",")[int(kept) - 1])
    return None


def draw_ratio(runs: dict, copies: list[str]) -> float | None:
    """The adaptive server's kept detached plain graph's score over the plain copies' kept graphs' (`kept_draw`)."""
    mine = kept_draw(runs["adaptive"].get("server") or {}, "decode_detached")
    theirs = [kept_draw(runs[name].get("server") or {}, "decode") for name in copies]
    return None if mine is None or None in theirs else mine / statistics.fmean(theirs) - 1.0


def draws_line(records: list[dict]) -> dict | None:
    """Per run (records sharing a `run`), its `draw_ratio` and its passes' mean ratio; their correlation over the
    runs; None where fewer than three runs have a ratio."""
    runs: dict[str, list[dict]] = {}
    for record in records:
        if record.get("draw_ratio") is not None:
            runs.setdefault(record["run"], []).append(record)
    if len(runs) < 3:
        return None
    pairs = [(rs[0]["draw_ratio"], statistics.fmean(r["versus_better"] for r in rs)) for rs in runs.values()]
    spread = len({x for x, _ in pairs}) > 1 and len({y for _, y in pairs}) > 1
    return {"runs": [{"draw_ratio": x, "versus_better": y} for x, y in pairs],
            "correlation": statistics.correlation(*zip(*pairs)) if spread else None}


def host_speed(records: list[dict]) -> dict | None:
    """Over `records`, the adaptive server's and the control copy's ratios as measured and host speed adjusted
    (`host_adjusted`), mean +- standard error; None where fewer than two passes of each have counters. Over the first
    passes alone too: over the ten bar runs of session 54 the adaptive server read 4.3 +- 2.3% behind at concurrency 32
    in the first passes and +1.3 +- 0.6% adjusted, its output processing 6.4 +- 2.6% slower a request-step there."""
    adjusted = [r["host"] for r in records if r.get("host") is not None]
    controls = [r["host_control"] for r in records if r.get("host_control") is not None]
    if len(adjusted) < 2 or len(controls) < 2:
        return None
    return {who: {figure: mean_se([pair[figure] for pair in pairs]) for figure in ("unadjusted", "adjusted", "outputs")}
            for who, pairs in (("adaptive", adjusted), ("control", controls))}


def pooled(records: list[dict], key: str, figures: tuple[str, ...]) -> dict:
    """Per figure, over `records`' `key` figures (`relative`): the adaptive server's over the better one and the
    control's, mean and standard error, where more than one pass has both."""
    control = key + "_control"
    return {figure: {"adaptive_over_better": mean_se([r[key][figure] for r in records if figure in r.get(key, {})]),
                     "control": mean_se([r[control][figure] for r in records if figure in r.get(control, {})])}
            for figure in figures if sum(figure in r.get(key, {}) and figure in r.get(control, {})
                                         for r in records) > 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    table: dict[str, dict[int, list[dict]]] = {}
    used, devices = [], set()
    for path in args.results:
        result = json.loads(path.read_text())
        if result.get("benchmark") != "serving" or not runs_of(result):
            continue
        parsed = run_passes(result)
        if parsed is None:
            continue
        workload, records = parsed
        used.append(path.name)
        devices.add(result["device"])
        for record in records:
            record["run"] = path.name
            table.setdefault(workload, {}).setdefault(record["concurrency"], []).append(record)
    summary = {}
    for workload, per_c in table.items():
        print(f"-- {workload}: adaptive vs the better server, pass by pass (mean +- standard error, passes)")
        for concurrency, records in sorted(per_c.items()):
            groups = {}
            for record in records:
                key = ("first" if record["pass"] == 0 else "later") + (
                    ", losing choice ran" if record["losing_steps"] else ", better choice only")
                groups.setdefault(key, []).append(record)
            cell = {key: mean_se([r["versus_better"] for r in group]) for key, group in sorted(groups.items())}
            clean = groups.get("later, better choice only", [])
            host = {counter: {"adaptive_less_better_us": mean_se([r["counters"][counter] for r in clean
                                                                  if counter in r["counters"]]),
                              "control_us": mean_se([r["control"][counter] for r in clean if counter in r["control"]])}
                    for counter in COUNTERS if sum(counter in r["counters"] and counter in r["control"]
                                                   for r in clean) > 1}
            admitted, phases = (pooled(clean, key, figures) for key, figures in (("admission", ADMISSION),
                                                                                 ("phases", PHASES)))
            joined = {}  # per group: the detached share of its requests (mean over passes) and why the others joined
            for key, group in sorted(groups.items()):
                shares = [r["detached"] for r in group if r.get("detached") is not None]
                reasons: dict[str, int] = {}
                for r in group:
                    for reason, n in r.get("attached", {}).items():
                        reasons[reason] = reasons.get(reason, 0) + n
                parked = [r["parked"] for r in group if r.get("parked") is not None]
                if shares:
                    joined[key] = {"detached": statistics.fmean(shares), "attached": dict(sorted(reasons.items())),
                                   "parked": statistics.fmean(parked) if parked else None}
            speed = host_speed(records)
            first_speed = host_speed([r for r in records if r["pass"] == 0])
            summary.setdefault(workload, {})[str(concurrency)] = {"passes": cell, "host_per_decode": host,
                                                                   "admission": admitted, "phases": phases,
                                                                   "requests": joined,
                                                                   "host_speed_adjusted": speed,
                                                                   "host_speed_adjusted_first": first_speed,
                                                                   "graph_draws": draws_line(records),
                                                                   "stalls": stalls(records)}
            print(f"   concurrency {concurrency:>3}: " + "; ".join(
                f"{key} {fig['mean']:+.1%}" + (f" +- {fig['se']:.1%}" if fig["se"] is not None else "")
                + f" ({fig['n']})" for key, fig in cell.items()))
            if speed is not None and speed["control"]["adjusted"]["se"] < speed["control"]["unadjusted"]["se"]:
                # (shown where the host's speed explains the control's spread: host-bound levels)
                for which, figures in (("every pass", speed), ("first passes", first_speed)):
                    if figures is not None:
                        print(f"      {which}, host speed adjusted: " + "; ".join(
                            f"{who} {fig['adjusted']['mean']:+.1%} +- {fig['adjusted']['se']:.1%} (unadjusted "
                            f"{fig['unadjusted']['mean']:+.1%} +- {fig['unadjusted']['se']:.1%}, outputs "
                            f"{fig['outputs']['mean']:+.1%} +- {fig['outputs']['se']:.1%}; {fig['adjusted']['n']})"
                            for who, fig in figures.items()))
            drawn = summary[workload][str(concurrency)]["graph_draws"]
            if drawn is not None:
                correlation = drawn["correlation"]
                print("      kept graph draws, adaptive over plain, per run: " + ", ".join(
                    f"{run['draw_ratio']:+.2%} ({run['versus_better']:+.1%})" for run in drawn["runs"])
                    + (f"; correlation {correlation:+.2f}" if correlation is not None else ""))
            stalled = summary[workload][str(concurrency)]["stalls"]
            if stalled is not None:
                print(f"      token gaps of {STALL_GAP_S * 1e3:.0f} ms or more: adaptive "
                      + f"{len(stalled['adaptive']['stalled'])} of {stalled['adaptive']['passes']} passes, better "
                      + f"copies {len(stalled['copies']['stalled'])} of {stalled['copies']['levels']} levels"
                      + "".join(f" ({who}: {', '.join(f'{g * 1e3:.0f}' for g in fig['stalled'])} ms)"
                                for who, fig in stalled.items() if fig["stalled"]))
            busy = cpus_busy(clean)
            summary[workload][str(concurrency)]["cpus_busy"] = busy
            if busy is not None:
                print(f"      server CPUs busy (later, better choice only): adaptive {busy['adaptive']:.2f}, better "
                      f"copies {busy['copies']:.2f}" + (f" of {busy['cpus']}" if busy["cpus"] else ""))
            for key, fig in joined.items():
                print(f"      {key}: {fig['detached']:.0%} of the requests detached; joined with their drafts: "
                      + (", ".join(f"{reason} {n}" for reason, n in fig["attached"].items()) or "none")
                      + ("" if fig["parked"] is None else f"; plain steps parked {fig['parked']:.0%}"))
            for counter, fig in host.items():
                mine, control = fig["adaptive_less_better_us"], fig["control_us"]
                print(f"      {counter:<17} adaptive - better {mine['mean']:+7.1f} +- {mine['se']:5.1f} us a decode"
                      f" step (control {control['mean']:+7.1f} +- {control['se']:5.1f})")
            for figure, fig in (admitted | phases).items():
                mine, control = fig["adaptive_over_better"], fig["control"]
                print(f"      {figure:<21} adaptive / better {mine['mean']:+.1%} +- {mine['se']:.1%} (control "
                      f"{control['mean']:+.1%} +- {control['se']:.1%})")
    device = next(iter(devices)) if len(devices) == 1 else "mixed"
    path = write_result("serving-passes", device, {"results": used, "devices": sorted(devices)}, summary,
                        args.out_dir)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
