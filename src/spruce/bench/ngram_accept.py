"""N-gram (prompt-lookup) speculation on a prompt-copying workload: spruce's NGRAM against vLLM's `ngram` on the same
prompts, greedy, with the same num_speculative_tokens and prompt_lookup_min / _max.

    python -m spruce.bench.ngram_accept --model ../shared/models/pycode-19m --out ngram.json

The workload: each prompt is a held-out document's first `--body-chars` characters, three newlines, then the same
document's first `--head-chars` characters again, so the continuation repeats the prompt (the model's
heldout_prompts.jsonl; without one, the standard library's source). Prompts go to both engines as token ids.

Per engine it records the mean acceptance length, output tokens per second (one timed generate() of every prompt
after an untimed warm-up on two of them) and whether the greedy outputs equal plain decoding's:
- spruce: plain decoding once, then NGRAM for each `--spruce-topk` K (1: vLLM's chain; K > 1: a trie of the K best
  occurrences' continuations, N = 1 + K*S). Acceptance length = committed tokens / rounds, over every decode round.
- vLLM (when importable; in a child process, so the two never share GPU memory): `LLM(..., speculative_config=
  {"method": "ngram", ...}, disable_log_stats=False)`; from `llm.get_metrics()`: its own figure, 1 + accepted /
  drafts (over the steps that proposed a draft), and the all-steps figure comparable with spruce's: (T - R) /
  (T - R - accepted) for T output tokens of R requests (each request's first token comes from its prefill). Its
  outputs are compared with spruce's plain ones (and, with --vllm-plain, with vLLM's own plain run).
Runs on the CPU for spruce alone (vLLM is skipped when it is not importable or the device is the CPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_STDLIB = ("textwrap", "heapq", "bisect", "fractions", "shlex", "colorsys", "difflib", "argparse")


def load_documents(model: Path, count: int) -> list[str]:
    """`count` documents of Python: the model's heldout_prompts.jsonl ({"text": ...} per line), else standard library
    modules' source from their first top-level def or class (cycled)."""
    heldout = model / "heldout_prompts.jsonl"
    if heldout.exists():
        docs = [json.loads(line)["text"] for line in heldout.read_text().splitlines() if line.strip()]
    else:
        docs = []
        for name in DEFAULT_STDLIB:
            src = inspect.getsource(importlib.import_module(name))
            start = min(i for i in (src.find("\ndef "), src.find("\nclass ")) if i >= 0) + 1
            docs.append(src[start:])
    if not docs:
        raise SystemExit(f"no documents in {heldout}")
    return [docs[i % len(docs)] for i in range(count)]


def copy_prompt(doc: str, body_chars: int, head_chars: int) -> str:
    """The document's beginning, then its first `head_chars` characters again: the model goes on copying."""
    body = doc[:body_chars]
    return body + "\n\n\n" + body[:head_chars]


def spruce_run(args, prompts: list[list[int]], algorithm: str | None, topk: int = 1) -> dict:
    """One spruce engine: warm-up, then every prompt in one timed generate(); tokens, acceptance, tokens/s."""
    import gc

    import torch

    from spruce import LLM, SamplingParams

    longest = max(map(len, prompts)) + args.max_tokens + 64  # + the lookahead a round's pages cover
    kw = dict(device=args.device, dtype=args.dtype, max_running_requests=len(prompts), seed=0,
              max_total_tokens=len(prompts) * longest)  # a KV cache for this workload, not most of the GPU
    if algorithm is not None:
        kw.update(speculative_algorithm=algorithm, speculative_num_steps=args.num_speculative_tokens,
                  speculative_eagle_topk=topk, speculative_prompt_lookup_min=args.prompt_lookup_min,
                  speculative_prompt_lookup_max=args.prompt_lookup_max)
    llm = LLM(args.model, **kw)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [o.token_ids for o in outs]
    result = {"tokens": tokens, "seconds": round(seconds, 4),
              "tokens_per_s": round(sum(map(len, tokens)) / seconds, 1)}
    if algorithm is not None:
        rounds = sum(o.spec_stats["rounds"] for o in outs)
        committed = sum(o.spec_stats["committed_tokens"] for o in outs)
        result.update(rounds=rounds, mean_acceptance_length=round(committed / max(rounds, 1), 4),
                      speculative=llm.engine.info()["speculative"])
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def vllm_child(spec_path: str, out_path: str) -> int:
    """In the child process: vLLM's ngram run (and its plain run if asked) on the token-id prompts of `spec_path`."""
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    out = {}
    runs = [("ngram", {"method": "ngram", "num_speculative_tokens": spec["k"],
                       "prompt_lookup_min": spec["min"], "prompt_lookup_max": spec["max"]})]
    if spec["plain"]:
        runs.append(("plain", None))
    for name, speculative_config in runs:
        llm = LLM(spec["model"], dtype=spec["dtype"], seed=0, max_num_seqs=len(prompts), disable_log_stats=False,
                  gpu_memory_utilization=spec["gpu_memory_utilization"], speculative_config=speculative_config,
                  enforce_eager=spec["eager"])
        llm.generate(prompts[:2], params, use_tqdm=False)
        before = _spec_counters(llm)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after = _spec_counters(llm)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        total = sum(map(len, tokens))
        run = {"tokens": tokens, "seconds": round(seconds, 4), "tokens_per_s": round(total / seconds, 1)}
        if speculative_config is not None:
            drafts = after["drafts"] - before["drafts"]
            accepted = after["accepted"] - before["accepted"]
            decode_tokens = total - len(tokens)  # each request's first token comes from its prefill
            run.update(num_drafts=drafts, num_accepted_tokens=accepted,
                       draft_tokens=after["draft_tokens"] - before["draft_tokens"],
                       mean_acceptance_length_per_draft=round(1 + accepted / max(drafts, 1), 4),
                       mean_acceptance_length=round(decode_tokens / max(decode_tokens - accepted, 1), 4))
        out[name] = run
        del llm
    Path(out_path).write_text(json.dumps(out))
    return 0


def _spec_counters(llm) -> dict:
    """vLLM's spec-decode counters from llm.get_metrics() (0 where absent)."""
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_accepted_tokens": "accepted",
             "vllm:spec_decode_num_draft_tokens": "draft_tokens"}
    found = {v: 0 for v in names.values()}
    for metric in llm.get_metrics():
        if metric.name in names:
            found[names[metric.name]] = int(metric.value)
    return found


def vllm_run(args, prompts: list[list[int]]) -> dict:
    """vLLM's runs in a child process (its own GPU memory, its own engine processes); a failure is recorded."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"model": str(args.model), "dtype": args.dtype, "prompts": prompts,
                                    "max_tokens": args.max_tokens, "k": args.num_speculative_tokens,
                                    "min": args.prompt_lookup_min, "max": args.prompt_lookup_max,
                                    "plain": args.vllm_plain, "eager": args.vllm_eager,
                                    "gpu_memory_utilization": args.vllm_gpu_memory_utilization}))
        proc = subprocess.run([sys.executable, "-m", "spruce.bench.ngram_accept", "--vllm-child", str(spec), str(out)],
                              capture_output=True, text=True, timeout=args.vllm_timeout)
        if proc.returncode != 0 or not out.exists():
            return {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
        return json.loads(out.read_text())


def summarize(run: dict, plain: list[list[int]]) -> dict:
    """A run's figures without its tokens: equal_to_plain, and how many prompts match where not all do."""
    figures = {k: v for k, v in run.items() if k != "tokens"}
    same = [a == b for a, b in zip(run["tokens"], plain)]
    figures["equal_to_plain"] = all(same) and len(run["tokens"]) == len(plain)
    figures["prompts_equal_to_plain"] = sum(same)
    return figures


def run(args) -> dict:
    from spruce.config import resolve_device
    from spruce.models.tokenizer import Tokenizer
    from spruce.runtime.request import prompt_token_ids
    from spruce.models.hf_config import ModelConfig

    args.device = resolve_device(args.device)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    cfg = ModelConfig.from_dir(args.model)
    tokenizer = Tokenizer.from_dir(args.model, cfg)
    texts = [copy_prompt(d, args.body_chars, args.head_chars) for d in load_documents(args.model, args.num_prompts)]
    budget = min(cfg.max_position_embeddings, args.context_tokens) - args.max_tokens - 8  # room for the output
    prompts = [prompt_token_ids(t, tokenizer, cfg.vocab_size)[-budget:] for t in texts]
    with_vllm = args.device != "cpu" and importlib.util.find_spec("vllm") is not None and not args.skip_vllm
    result = vllm_run(args, prompts) if with_vllm else None  # first: before this process holds any GPU memory
    plain = spruce_run(args, prompts, None)
    engines = {"spruce_plain": summarize(plain, plain["tokens"])}
    for k in args.spruce_topk:
        engines[f"spruce_ngram_k{k}"] = summarize(spruce_run(args, prompts, "NGRAM", k), plain["tokens"])
    if result is not None:
        if "error" in result:
            engines["vllm_ngram"] = result
        else:
            engines["vllm_ngram"] = summarize(result["ngram"], plain["tokens"])
            if "plain" in result:
                engines["vllm_plain"] = summarize(result["plain"], plain["tokens"])
                engines["vllm_ngram"]["equal_to_vllm_plain"] = result["ngram"]["tokens"] == result["plain"]["tokens"]
    else:
        engines["vllm_ngram"] = {"skipped": "vllm is not importable" if importlib.util.find_spec("vllm") is None
                                 else "cpu device or --skip-vllm"}
    return {"benchmark": "ngram_accept", "config": {
        "model": str(args.model), "device": args.device, "dtype": args.dtype, "num_prompts": len(prompts),
        "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1), "max_tokens": args.max_tokens,
        "num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max, "body_chars": args.body_chars, "head_chars": args.head_chars},
        "engines": engines}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spruce.bench.ngram_accept", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    from spruce.config import builtin_model_path

    p.add_argument("--model", type=Path, default=builtin_model_path(),
                   help="HF model dir with a tokenizer (default: the bundled demo model)")
    p.add_argument("--out", type=Path, required=True, help="the result JSON")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu (both engines)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--body-chars", type=int, default=1200, help="characters of each document in its prompt")
    p.add_argument("--head-chars", type=int, default=80, help="characters repeated at the prompt's end")
    p.add_argument("--context-tokens", type=int, default=4096, help="cut prompts to leave the output room within this")
    p.add_argument("--num-speculative-tokens", type=int, default=5, help="k: drafts per round (spruce's steps)")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--spruce-topk", type=int, nargs="+", default=[1, 4], metavar="K",
                   help="spruce NGRAM runs: 1 is vLLM's chain, K > 1 a trie of K continuations")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--vllm-plain", action="store_true", help="also run vLLM without speculation (equality check)")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager (a faster start)")
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--vllm-timeout", type=float, default=400.0, help="seconds the vLLM child may take")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--vllm-child"]:
        return vllm_child(argv[1], argv[2])
    return run_main(build_parser().parse_args(argv))


def run_main(args) -> int:
    """Run, write the JSON to --out, print each engine's headline figures."""
    from spruce.bench.common import git_commit

    result = run(args)
    result.update(git_commit=git_commit(), time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, figures in result["engines"].items():
        shown = {k: figures.get(k) for k in ("mean_acceptance_length", "tokens_per_s", "equal_to_plain", "skipped",
                                             "error") if k in figures}
        print(f"{name}: {shown}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
