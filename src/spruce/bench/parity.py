"""`spruce bench parity`: plain vs speculative greedy on the same prompts; is every divergence a near-tie?

Greedy speculative decoding must emit the target's argmax at every position, so it can part from the plain
engine only where two logits are so close that the two paths' rounding (bf16: different kernels and shapes
for decode and verify) orders them differently. For every prompt where a speculative config's tokens differ
from the plain engine's, this reports the first divergent output position d, both tokens and the target's
logits there.

Where the logits come from: a teacher-forced forward. The plain engine that produced the plain run (same
model, device, dtype and page size), idle after its run, prefills `prompt + output[:-1]` of a run through its
own paged EXTEND path (`target_logits`): row i of the result is what the target computes after
`prompt + output[:i]`, its prediction of output[i]. This is done along the plain run's tokens and along the
speculative run's tokens. Both sequences are identical up to d, so their logits at d agree (up to kernel
shapes); their largest difference is reported. Along each run, every emitted token's deficit (top logit minus
the token's logit) is measured too.

A divergence is a near-tie when, along both runs, every emitted token up to the end lies within `threshold`
logits of the top logit (so at d both tokens are, and the top-2 gap there is below it). A speculative token far
below the top logit is a token the target would not have chosen: a bug.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from spruce.bench.common import RESULTS_DIR, device_name, write_result

DEFAULT_THRESHOLD = 0.5  # logits, in the engine's dtype (bf16 logits of size ~10-20 are spaced 0.06-0.125 apart)
DEFAULT_SPECS = ("5,1,6", "5,4,16", "6,8,32")  # S,K,N: the README's K=1 S=5 N=6, K=4 S=5 N=16, K=8 S=6 N=32


def parse_spec(text: str) -> tuple[int, int, int]:
    """'S,K,N' (steps, topk, draft tokens; the order of `bench latency --spec`) -> (S, K, N)."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"--spec wants S,K,N (steps,topk,draft_tokens), e.g. 5,4,16; got {text!r}")
    s, k, n = (int(p) for p in parts)
    return s, k, n


def parse_int_list(text: str) -> list[int]:
    """'1,16,64' -> [1, 16, 64]."""
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def load_prompts(path: str | Path, tokenizer, num_prompts: int, prompt_tokens: int) -> list[list[int]]:
    """The first `num_prompts` {"text": ...} lines of a JSONL file, tokenized, each cut to `prompt_tokens`
    tokens (0: whole prompts)."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()][:num_prompts]
    ids = [tokenizer.encode(json.loads(line)["text"]) for line in lines]
    return [p[:prompt_tokens] if prompt_tokens else p for p in ids]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two token lists differ, else None. Both runs of a prompt stop at
    the same length (max_tokens, eos ignored; or the same context end), so only common positions count."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def target_logits(llm, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Teacher-forced float32 logits [len(output), V] of an idle plain `llm`: row i is what the target computes
    after `prompt + output[:i]` (its prediction of output[i])."""
    return llm.engine.next_token_logits(prompt + output[:-1], first=len(prompt) - 1)


def token_deficits(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Top logit minus the logit of tokens[i], per row of logits [n, V]: [n] (0 where the token is the argmax)."""
    ids = torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None]  # [n, 1]
    return logits.max(dim=1).values - logits.gather(1, ids)[:, 0]


def run_view(logits: torch.Tensor, own: list[int], position: int, plain_token: int, spec_token: int) -> dict:
    """What one run's teacher-forced logits [n, V] say at the divergence `position` and along the run."""
    row = logits[position]  # [V]
    top = row.topk(2)
    return {
        "argmax": int(top.indices[0]),
        "top2_gap": float(top.values[0] - top.values[1]),
        "plain_token_deficit": float(top.values[0] - row[plain_token]),
        "spec_token_deficit": float(top.values[0] - row[spec_token]),
        "max_deficit_of_own_tokens": float(token_deficits(logits, own).max()),
    }


def divergence_record(plain: list[int], spec: list[int], plain_logits: torch.Tensor, spec_logits: torch.Tensor,
                      threshold: float) -> dict:
    """One divergent prompt: plain / spec output tokens and their teacher-forced logits [n, V] along each."""
    d = first_divergence(plain, spec)
    a, b = plain[d], spec[d]
    views = {"plain_run": run_view(plain_logits, plain, d, a, b), "spec_run": run_view(spec_logits, spec, d, a, b)}
    keys = ("plain_token_deficit", "spec_token_deficit", "max_deficit_of_own_tokens")
    worst = max(v[key] for v in views.values() for key in keys)
    return {
        "position": d, "plain_token": a, "spec_token": b, **views,
        "logits_max_abs_diff_at_position": float((plain_logits[d] - spec_logits[d]).abs().max()),
        "worst_deficit": worst, "near_tie": worst < threshold,
    }


def verdict(divergences: list[dict]) -> str:
    """'identical' (no divergence), 'near-ties' (every divergence one), else 'NOT near-tie: bug'."""
    if not divergences:
        return "identical"
    return "near-ties" if all(d["near_tie"] for d in divergences) else "NOT near-tie: bug"


def make_llm(args, page_size: int, prompts: list[list[int]], spec: tuple[int, int, int] | None):
    """An engine sized for these prompts: plain, or speculative with (S, K, N)."""
    from spruce import LLM

    longest = max(len(p) for p in prompts)
    kw = dict(model=args.model, device=args.device, dtype=args.dtype, page_size=page_size,
              attention_backend=args.attention_backend, cuda_graph=args.cuda_graph,
              max_running_requests=len(prompts),
              max_total_tokens=len(prompts) * (longest + args.max_tokens + 256 + page_size))
    if spec is not None:
        s, k, n = spec
        kw.update(draft_model=args.draft, speculative_num_steps=s, speculative_eagle_topk=k,
                  speculative_num_draft_tokens=n)
    return LLM(**kw)


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy output tokens per prompt (exactly max_tokens each: eos ignored)."""
    from spruce import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


def free_device_memory() -> None:
    """Collect dropped engines and hand their device memory back before the next one is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def spec_run(args, page_size: int, prompts: list[list[int]], spec: tuple[int, int, int]) -> tuple[list, dict]:
    """Greedy outputs and speculation statistics of one speculative config (its engine is dropped on return)."""
    llm = make_llm(args, page_size, prompts, spec)
    return greedy(llm, prompts, args.max_tokens), llm.engine.stats()["spec"]


def compare_config(args, plain_llm, prompts, plain_outs, page_size: int, spec: tuple[int, int, int]) -> dict:
    """Run one speculative config on the prompts and compare it with the plain outputs."""
    spec_outs, stats = spec_run(args, page_size, prompts, spec)
    free_device_memory()
    firsts = [first_divergence(a, b) for a, b in zip(plain_outs, spec_outs)]
    divergences = []
    for i, (prompt, a, b, d) in enumerate(zip(prompts, plain_outs, spec_outs, firsts)):
        if d is not None:
            rec = divergence_record(a, b, target_logits(plain_llm, prompt, a), target_logits(plain_llm, prompt, b),
                                    args.threshold)
            divergences.append({"prompt_index": i, "prompt_tokens": len(prompt), **rec})
    s, k, n = spec
    return {"page_size": page_size, "spec": {"num_steps": s, "eagle_topk": k, "num_draft_tokens": n},
            "num_prompts": len(prompts), "matched_prompts": len(prompts) - len(divergences),
            "tokens_before_first_divergence": sum(len(a) if d is None else d for a, d in zip(plain_outs, firsts)),
            "tokens": sum(len(a) for a in plain_outs), "spec_stats": stats, "divergences": divergences}


def run_parity(args) -> dict:
    """Every page size: the plain run, then every speculative config against it. Returns the figures."""
    prompts = load_prompts(args.prompts, model_tokenizer(args.model), args.num_prompts, args.prompt_tokens)
    runs = []
    for page_size in args.page_sizes:
        plain_llm = make_llm(args, page_size, prompts, None)
        plain_outs = greedy(plain_llm, prompts, args.max_tokens)
        for spec in args.spec:
            run = compare_config(args, plain_llm, prompts, plain_outs, page_size, spec)
            runs.append(run)
            _print_run(run)
        del plain_llm
        free_device_memory()
    divergences = [d for r in runs for d in r["divergences"]]
    return {"threshold": args.threshold, "threshold_units": f"logits ({args.dtype})", "runs": runs,
            "num_divergences": len(divergences),
            "max_worst_deficit": max((d["worst_deficit"] for d in divergences), default=0.0),
            "verdict": verdict(divergences)}


def model_tokenizer(model: str | None):
    """The tokenizer of `model` (None: the bundled demo model)."""
    from spruce.config import builtin_model_path
    from spruce.models.hf_config import ModelConfig
    from spruce.models.tokenizer import Tokenizer

    path = model or builtin_model_path()
    return Tokenizer.from_dir(path, ModelConfig.from_dir(path))


def _print_run(run: dict) -> None:
    sp = run["spec"]
    line = (f"page={run['page_size']:3d} S={sp['num_steps']} K={sp['eagle_topk']} N={sp['num_draft_tokens']}: "
            f"{run['matched_prompts']}/{run['num_prompts']} prompts identical")
    for d in run["divergences"]:
        line += (f"\n  prompt {d['prompt_index']} pos {d['position']}: plain {d['plain_token']} spec {d['spec_token']}"
                 f" top2 gap {d['plain_run']['top2_gap']:.3f}/{d['spec_run']['top2_gap']:.3f}"
                 f" worst deficit {d['worst_deficit']:.3f} {'near-tie' if d['near_tie'] else 'NOT A NEAR-TIE'}")
    print(line, flush=True)


def add_parity_parser(sub) -> None:
    p = sub.add_parser("parity", help="plain vs speculative greedy on the same prompts; divergences vs near-ties")
    p.add_argument("--model", default=None, help="HF model dir (default: the bundled demo model)")
    p.add_argument("--draft", default=None, help="EAGLE/EAGLE-3 draft dir (default with no --model: the bundled head)")
    p.add_argument("--prompts", required=True, help='JSONL of {"text": ...} prompts')
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompt-tokens", type=int, default=128, help="cut every prompt to this many tokens (0: whole)")
    p.add_argument("--spec", nargs="+", type=parse_spec, default=[parse_spec(s) for s in DEFAULT_SPECS],
                   metavar="S,K,N", help="speculative configs: steps,topk,draft_tokens (as in `bench latency`)")
    p.add_argument("--page-sizes", type=parse_int_list, default=[1, 16, 64], metavar="P[,P...]")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="default: on for cuda")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help="a divergence is a near-tie when every emitted token is within this many logits of the top")
    p.add_argument("--out", default=None, help=f"result JSON path (default: {RESULTS_DIR}/parity-<device>-<time>.json)")
    p.set_defaults(func=run_parity_bench)


def run_parity_bench(args) -> int:
    """Fill defaults, run, write the results JSON; exit status 1 when a divergence is not a near-tie."""
    from spruce.config import builtin_draft_path

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.draft is None:
        if args.model is not None:
            raise SystemExit("give --draft PATH (an EAGLE/EAGLE-3 head for --model)")
        args.draft = str(builtin_draft_path())
    figures = run_parity(args)
    config = {k: v for k, v in vars(args).items() if k != "func"}
    path = write_result("parity", args.device, config, figures, Path(args.out).parent if args.out else None)
    if args.out:
        path = path.replace(args.out)
    print(f"{figures['verdict']} ({figures['num_divergences']} divergences, threshold {args.threshold} logits); "
          f"wrote {path}  [{device_name(args.device)}]")
    return 0 if figures["verdict"] != "NOT near-tie: bug" else 1
