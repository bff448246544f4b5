"""`spruce bench structured`: the cost of structured output per decode round, with and without speculation.

For each engine (plain decoding, then each --spec config) and batch size, the same prompts run unconstrained
and under each constraint (JSON schemas, any JSON object, a regex). Each run records wall time, rounds (decode
steps), tokens, time per round minus prefill, the phase times (the `grammar` phase is the host's mask work:
step-0 pruning and the per-node tree masks; `accept` the eager masked selection), mean accept length, the
host seconds the grammar masks took and the fraction of tree nodes the grammar refused (dead). A step with a
constrained request is resolved at once (no overlap), so the unconstrained run with overlap on is the baseline.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from spruce.bench.common import device_name, write_result

SCHEMAS = [  # small, so that generations finish; a mix of the shapes tests/grammar_schemas.py covers
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["a", "b", "c"]}, "flag": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "maxItems": 3}},
     "required": ["kind", "flag", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1, "maxItems": 8},
]
REGEX = "[a-z]+( [a-z]+)*"
CONSTRAINTS = ("none", "json_schema", "json_object", "regex")


def add_structured_parser(sub) -> None:
    p = sub.add_parser("structured", help="structured output: cost per round with and without speculation")
    p.add_argument("--model", required=True, help="HF model dir")
    p.add_argument("--draft", default=None, help="EAGLE/EAGLE-3 draft dir (none: plain decoding only)")
    p.add_argument("--speculative-algorithm", default=None, choices=["EAGLE", "EAGLE3", "NEXTN"])
    p.add_argument("--spec", nargs="*", default=["5,4,8"], metavar="S,K,N", help="speculative configs to run")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--output-len", type=int, default=128, help="max_tokens (constrained requests may end sooner)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (cut from --prompts)")
    p.add_argument("--prompts", default=None, help="JSONL of {'text'} prompts (default: MODEL/heldout_prompts.jsonl)")
    p.add_argument("--constraints", nargs="+", default=list(CONSTRAINTS), choices=CONSTRAINTS)
    p.add_argument("--graphs", choices=["on", "off"], default="on")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=2, help="runs per measurement (the fastest is kept)")
    p.add_argument("--out-dir", default="bench/results")
    p.set_defaults(func=run_structured_bench)


def _params(constraint: str, i: int, max_tokens: int):
    from spruce import SamplingParams

    if constraint == "none":
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    kw = {"json_schema": dict(json_schema=SCHEMAS[i % len(SCHEMAS)]), "json_object": dict(json_object=True),
          "regex": dict(regex=REGEX)}[constraint]
    return SamplingParams(max_tokens=max_tokens, **kw)


def _measure(llm, prompts: list[list[int]], constraint: str, args, spec: bool) -> dict:
    eng = llm.engine
    params = [_params(constraint, i, args.output_len) for i in range(len(prompts))]
    timer = eng.phase_timer
    best = None
    for _ in range(args.repeats):
        eng.reset_stats()
        before = dict(eng.grammar_stats or {"tree_nodes": 0, "dead_nodes": 0, "mask_seconds": 0.0})
        timer.reset()
        timer.enabled = True
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        timer.enabled = False
        phases = timer.collect()
        after = eng.grammar_stats or before
        rounds = phases.get("extend" if spec else "decode", {}).get("count", 0)
        prefill_ms = phases.get("prefill", {}).get("total_ms", 0.0)
        tokens = sum(len(o.token_ids) for o in outs)
        nodes = after["tree_nodes"] - before["tree_nodes"]
        run = {"constraint": constraint, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
               "rounds": rounds, "ms_per_round": (wall * 1e3 - prefill_ms) / rounds if rounds else None,
               "finished_by_grammar_or_eos": sum(o.finish_reason == "stop" for o in outs),
               "grammar_host_ms_per_round": (1e3 * (after["mask_seconds"] - before["mask_seconds"]) / rounds
                                             if rounds else None),
               "dead_node_fraction": (after["dead_nodes"] - before["dead_nodes"]) / nodes if nodes else None,
               "phases": phases, "spec": eng.stats()["spec"] if spec else None}
        if best is None or run["wall_s"] < best["wall_s"]:
            best = run
    return best


def run_structured_bench(args) -> None:
    from spruce import LLM, SamplingParams
    from spruce.models.hf_config import ModelConfig
    from spruce.models.tokenizer import Tokenizer

    model = str(Path(args.model))
    tok = Tokenizer.from_dir(model, ModelConfig.from_dir(model))
    source = Path(args.prompts) if args.prompts else Path(model) / "heldout_prompts.jsonl"
    texts = [json.loads(line)["text"] for line in source.read_text().splitlines() if line.strip()]
    engines = [("plain", None)] + ([(f"spec {s}", tuple(int(x) for x in s.split(","))) for s in args.spec]
                                   if args.draft or args.speculative_algorithm else [])
    results = []
    for name, spec in engines:
        for bs in args.batch_sizes:
            kw = dict(model=model, device=args.device, dtype=args.dtype, page_size=args.page_size,
                      max_running_requests=bs, cuda_graph=args.graphs == "on" and args.device.startswith("cuda"),
                      cuda_graph_max_bs=bs, context_length=args.input_len + args.output_len + 64,
                      max_total_tokens=bs * (args.input_len + args.output_len + 80))
            if spec is not None:
                kw.update(draft_model=args.draft, speculative_algorithm=args.speculative_algorithm,
                          speculative_num_steps=spec[0], speculative_eagle_topk=spec[1],
                          speculative_num_draft_tokens=spec[2])
            llm = LLM(**kw)
            prompts = [tok.encode(texts[i % len(texts)])[: args.input_len] for i in range(bs)]
            llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
            llm.generate(prompts, SamplingParams(max_tokens=8, json_object=True))  # the grammar library too
            for constraint in args.constraints:
                run = _measure(llm, prompts, constraint, args, spec is not None)
                run.update(engine=name, batch_size=bs)
                results.append(run)
                dead = run["dead_node_fraction"]
                print(f"{name:>12} bs={bs:<3} {constraint:<11} ms/round={run['ms_per_round'] or 0:7.2f} "
                      f"tok/s={run['tokens_per_s']:8.1f} "
                      f"grammar_host_ms/round={run['grammar_host_ms_per_round'] or 0:6.2f} "
                      f"accept={(run['spec'] or {}).get('mean_accept_length', 1.0):.2f} "
                      f"dead={'-' if dead is None else f'{dead:.2f}'}")
            del llm
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    config = {k: v for k, v in vars(args).items() if k != "func"}
    path = write_result("structured", device_name(args.device), config, {"runs": results}, Path(args.out_dir))
    print(f"wrote {path}")
