"""`spruce bench latency`: tokens/s, accept length and time per phase, with and without speculation and
CUDA graphs, next to the HBM roofline measured in the same run (and, optionally, Hugging Face generate)."""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from spruce.bench.common import device_name, measure_copy_bandwidth, write_result
from spruce.bench.shapes import write_shape_dirs


def add_latency_parser(sub) -> None:
    p = sub.add_parser("latency", help="offline latency/throughput benchmark")
    p.add_argument("--model", default=None, help="HF model dir (default: --model-shape with random weights)")
    p.add_argument("--model-shape", default=None, help="named shape with random weights, e.g. llama-3.1-8b")
    p.add_argument("--draft", default=None, help="EAGLE/EAGLE-3 draft dir (with --model-shape: random EAGLE-3)")
    p.add_argument("--speculative-algorithm", default=None, choices=["EAGLE", "EAGLE3", "NEXTN", "NGRAM"],
                   help="NEXTN: draft with the model's own MTP layers; NGRAM: prompt lookup (neither needs --draft)")
    p.add_argument("--prompt-lookup-min", type=int, default=None, help="NGRAM: the shortest n-gram matched")
    p.add_argument("--prompt-lookup-max", type=int, default=None, help="NGRAM: the longest n-gram matched")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts", default=None, help="JSONL of {'text'} prompts (default: random token ids)")
    p.add_argument("--num-prompts", type=int, default=8,
                   help="prompts per measurement, run as consecutive batches of --batch-sizes (at least one batch)")
    p.add_argument("--spec", nargs="*", default=["5,4,8"], metavar="S,K,N",
                   help="speculative configs to run (steps,topk,draft_tokens); none: plain only")
    p.add_argument("--no-plain", action="store_true", help="skip the non-speculative runs")
    p.add_argument("--synthetic-acceptance-length", type=float, default=None, metavar="L",
                   help="BENCHMARK SETTING for every --spec run: accept drafts at mean acceptance length L instead "
                        "of verifying them (speculative/synthetic.py; outputs are not the target's)")
    p.add_argument("--synthetic-acceptance-rates", type=_rates, default=None, metavar="R1,R2,...",
                   help="as --synthetic-acceptance-length, per draft depth (one per step, non-increasing)")
    p.add_argument("--graphs", nargs="+", default=["on"], choices=["on", "off"])
    p.add_argument("--overlap", nargs="+", default=["on"], choices=["on", "off"],
                   help="overlap scheduling on (default) and/or off (--disable-overlap-schedule)")
    p.add_argument("--tp-size", type=int, nargs="+", default=[1],
                   help="tensor-parallel sizes to run (each its own engine); above 1 on cuda, the collectives a "
                        "decode step pays are measured alone too and added to the roofline")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="quantize the target's weights to FP8 at load (as `spruce serve --quantization`)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="the KV cache's dtype (as `spruce serve --kv-cache-dtype`)")
    p.add_argument("--compare-hf", action="store_true", help="also time transformers generate (plain, assisted)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="also list the device kernels of N decode steps (torch.profiler; CPU: the ops) per run: "
                        "launches and microseconds per step by kernel name")
    p.add_argument("--out-dir", default="bench/results")
    p.set_defaults(func=run_latency_bench)


def _rates(text: str) -> tuple[float, ...]:
    """argparse type: comma-separated numbers ('1,0.5,0.2'); argparse names a value that is not."""
    return tuple(float(r) for r in text.split(","))


def _prompt_batches(args, tokenizer, vocab: int, bs: int) -> list[list[list[int]]]:
    """ceil(num_prompts / bs) consecutive batches of bs prompts (token ids), the same for every engine."""
    n = -(-max(args.num_prompts, bs) // bs) * bs
    if args.prompts:
        texts = [json.loads(line)["text"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        ids = [tokenizer.encode(t)[: args.input_len] for t in texts]
        flat = [ids[i % len(ids)] for i in range(n)]
    else:
        g = torch.Generator().manual_seed(0)
        flat = torch.randint(10, vocab - 10, (n, args.input_len), generator=g).tolist()
    return [flat[i:i + bs] for i in range(0, n, bs)]


DRAFTLESS = ("NEXTN", "NGRAM")  # the model's own MTP layers; prompt lookup


def _run_one(args, model, draft, spec, graphs: bool, bs: int, load_format: str, overlap: bool = True,
             tp_size: int = 1) -> dict:
    from spruce import LLM, SamplingParams

    kw = dict(model=model, device=args.device, dtype=args.dtype, page_size=args.page_size,
              attention_backend=args.attention_backend, max_running_requests=max(bs, 1), cuda_graph=graphs,
              cuda_graph_max_bs=bs, context_length=args.input_len + args.output_len + 64,
              max_total_tokens=bs * (args.input_len + args.output_len + 80), load_format=load_format,
              disable_overlap_schedule=not overlap, tp_size=tp_size, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    if spec is not None:
        s, k, n = spec
        kw.update(draft_model=draft, speculative_algorithm=args.speculative_algorithm, speculative_num_steps=s,
                  speculative_eagle_topk=k, speculative_num_draft_tokens=n,
                  speculative_synthetic_acceptance_length=args.synthetic_acceptance_length,
                  speculative_synthetic_acceptance_rates=args.synthetic_acceptance_rates,
                  speculative_prompt_lookup_min=args.prompt_lookup_min,  # the engine refuses them but for NGRAM
                  speculative_prompt_lookup_max=args.prompt_lookup_max)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    init_s = time.perf_counter() - t0
    eng = llm.engine
    batches = _prompt_batches(args, llm.tokenizer, eng.vocab_size, bs)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    llm.generate(batches[0], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    best = None
    for _ in range(args.repeats):
        timer = eng.phase_timer
        timer.reset()
        eng.reset_stats()
        timer.enabled = True
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = [o for batch in batches for o in llm.generate(batch, params)]
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        total = time.perf_counter() - t0
        timer.enabled = False
        phases = timer.collect()
        prefill_ms = phases.get("prefill", {}).get("total_ms", 0.0)
        out_tokens = sum(len(o.token_ids) for o in outs)
        decode_s = max(total - prefill_ms / 1e3, 1e-9)
        gpu_ms = sum(v["total_ms"] for k, v in phases.items() if k != "sync")  # the device's phases, not waits
        run = {"total_s": total, "prefill_ms": prefill_ms, "output_tokens": out_tokens,
               "gpu_phase_ms": gpu_ms, "wall_over_gpu_phases": total * 1e3 / gpu_ms if gpu_ms else None,
               "tokens_per_s": out_tokens / total, "decode_tokens_per_s": (out_tokens - len(outs)) / decode_s,
               "num_prompts": len(outs),
               "phases": phases, "spec": eng.stats()["spec"] if spec else None,
               "synthetic_acceptance": eng.info()["synthetic_acceptance"]}
        if spec:
            round_ms = sum(phases[k]["mean_ms"] for k in ("draft", "verify", "accept", "extend", "sync") if k in phases)
            run["round_ms"] = round_ms
        else:
            run["decode_step_ms"] = phases.get("decode", {}).get("mean_ms")
        if best is None or run["total_s"] < best["total_s"]:
            best = run
    if args.profile_steps:
        best["kernels"] = kernel_census(llm, batches[0], args.profile_steps, args.device)
    best["weight_bytes"] = eng.weight_bytes()
    # what one plain decode step reads at least once, at the mean context of the decode phase
    best["decode_read_bytes"] = eng.decode_read_bytes(bs, args.input_len + args.output_len // 2)
    best["init_s"] = init_s
    best["model"] = eng.model_shape()
    llm.shutdown()  # tensor-parallel: the workers exit and free their GPUs
    del llm, eng
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return best


def kernel_census(llm, prompts: list[list[int]], steps: int, device: str, top: int = 40) -> dict:
    """Where `steps` decode steps (rounds, when speculating) of `prompts` spend device time, by kernel name: the
    kernels of a generate of steps + 1 tokens less those of a generate of 1 (its prefill), so
        {"steps": N, "launches_per_step": 310.0, "us_per_step": 4870.2,
         "kernels": [{"name": "_gate_up_kernel", "launches_per_step": 48.0, "us_per_step": 1650.3}, ...]}
    (the `top` costliest). CUDA graph replays show their kernels (CUPTI); on the CPU the names are torch ops."""
    from torch.profiler import ProfilerActivity, profile

    from spruce import SamplingParams

    cuda = device.startswith("cuda")

    def by_name(max_tokens: int) -> dict[str, tuple[int, float]]:
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            if cuda:
                torch.cuda.synchronize()
        out = {}
        for e in prof.key_averages():
            us = e.device_time_total if cuda else e.self_cpu_time_total
            if cuda and us <= 0:
                continue
            out[e.key] = (e.count, us)
        return out

    prefill, whole = by_name(1), by_name(steps + 1)
    rows = []
    for name, (count, us) in whole.items():
        c0, us0 = prefill.get(name, (0, 0.0))
        if count > c0:
            rows.append({"name": name, "launches_per_step": (count - c0) / steps,
                         "us_per_step": max(us - us0, 0.0) / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"steps": steps, "launches_per_step": sum(r["launches_per_step"] for r in rows),
            "us_per_step": sum(r["us_per_step"] for r in rows), "kernels": rows[:top]}


def _run_hf(args, model: str, bs: int) -> dict:
    """transformers generate on the same prompts: plain (greedy) and assisted (prompt lookup, bs=1)."""
    from transformers import AutoModelForCausalLM

    from spruce.models.hf_config import ModelConfig
    from spruce.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model, ModelConfig.from_dir(model))
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(args.device).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    res = {}
    modes = [("plain", {})] + ([("assisted_prompt_lookup", {"prompt_lookup_num_tokens": 10})] if bs == 1 else [])
    batches = _prompt_batches(args, tok, hf.config.vocab_size, bs)
    for name, extra in modes:
        gen = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
                   pad_token_id=pad, **extra)
        dt, n = 0.0, 0
        for i, prompts in enumerate(batches):
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=args.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=args.device)
            if i == 0:  # warm-up
                hf.generate(ids, attention_mask=mask, **{**gen, "max_new_tokens": 8, "min_new_tokens": 8})
            torch.cuda.synchronize() if args.device.startswith("cuda") else None
            t0 = time.perf_counter()
            out = hf.generate(ids, attention_mask=mask, **gen)
            torch.cuda.synchronize() if args.device.startswith("cuda") else None
            dt += time.perf_counter() - t0
            n += (out.shape[1] - width) * len(prompts)
        res[name] = {"total_s": dt, "output_tokens": n, "tokens_per_s": n / dt, "num_prompts": bs * len(batches)}
    del hf
    gc.collect()
    return res


def run_latency_bench(args) -> int:
    tmp = None
    model, draft, load_format = args.model, args.draft, "auto"
    if model is None:
        if args.model_shape is None:
            raise SystemExit("give --model PATH or --model-shape NAME")
        tmp = tempfile.TemporaryDirectory()
        model, shape_draft = write_shape_dirs(args.model_shape, Path(tmp.name))
        model, load_format = str(model), "dummy"
        if args.speculative_algorithm not in DRAFTLESS:
            draft = draft or str(shape_draft)
    specs = [tuple(int(x) for x in s.split(",")) for s in (args.spec or [])]
    if draft is None and args.speculative_algorithm not in DRAFTLESS:
        specs = []
    lookup = {"--prompt-lookup-min": args.prompt_lookup_min, "--prompt-lookup-max": args.prompt_lookup_max}
    given = [f"{flag} {value}" for flag, value in lookup.items() if value is not None]
    if given and (args.speculative_algorithm != "NGRAM" or not specs):
        raise SystemExit(f"{' / '.join(given)}: needs --speculative-algorithm NGRAM and a --spec run")
    figures: dict = {"runs": []}
    if args.device.startswith("cuda"):
        figures["copy_bandwidth_GBps"] = measure_copy_bandwidth(args.device) / 1e9
        figures["collectives"] = _measure_collectives(args, model)  # before any engine holds NCCL
    for tp_size in args.tp_size:
        for overlap in args.overlap:
            for graphs in args.graphs:
                for bs in args.batch_sizes:
                    configs = ([] if args.no_plain else [None]) + specs
                    for spec in configs:
                        run = _run_one(args, model, draft, spec, graphs == "on", bs, load_format, overlap == "on",
                                       tp_size)
                        run.update({"batch_size": bs, "cuda_graph": graphs == "on", "overlap": overlap == "on",
                                    "tp_size": tp_size, "spec": run["spec"],
                                    "spec_config": list(spec) if spec else None})
                        figures["runs"].append(run)
                        _print_run(run)
    _add_ratios(figures)
    if args.compare_hf and args.model:
        figures["hf"] = {str(bs): _run_hf(args, args.model, bs) for bs in args.batch_sizes}
        print("hf:", json.dumps(figures["hf"]))
    config = {k: v for k, v in vars(args).items() if k != "func"}
    path = write_result("latency", args.device, config, figures, Path(args.out_dir))
    print(f"wrote {path}")
    return 0


def _measure_collectives(args, model: str) -> dict:
    """{tp: {batch size: per-collective ms}} for every --tp-size above 1 (bench/collectives.py)."""
    from spruce.bench.collectives import measure_tp_collectives
    from spruce.models.hf_config import ModelConfig

    mc = ModelConfig.from_dir(model)
    dtype = getattr(torch, args.dtype)
    return {str(tp): {str(bs): v for bs, v in measure_tp_collectives(tp, mc.hidden_size, mc.vocab_size,
                                                                    args.batch_sizes, dtype).items()}
            for tp in args.tp_size if tp > 1}


def _add_ratios(figures: dict) -> None:
    """Roofline fraction of plain decode (bytes one GPU reads / measured copy bandwidth; tensor-parallel: plus
    the step's collectives, each measured alone), round-time / decode-step ratios and tp speedups, from this
    run's numbers."""
    from spruce.bench.collectives import collective_ms_per_step

    bw = figures.get("copy_bandwidth_GBps")
    runs = figures["runs"]
    for run in runs:
        tp = run.get("tp_size", 1)
        if bw and run.get("decode_step_ms"):
            floor_ms = run["decode_read_bytes"] / (bw * 1e9) * 1e3
            run["roofline_step_ms"] = floor_ms
            run["fraction_of_roofline"] = floor_ms / run["decode_step_ms"]
            coll = figures.get("collectives", {}).get(str(tp), {}).get(str(run["batch_size"]))
            if coll is not None:
                run["collective_ms_per_step"] = collective_ms_per_step(coll, run["model"]["layers"])
                run["roofline_plus_collectives_ms"] = floor_ms + run["collective_ms_per_step"]
                run["fraction_of_roofline_plus_collectives"] = run["roofline_plus_collectives_ms"] / run["decode_step_ms"]

        def same(p, **kw):
            return all(p.get(k, 1 if k == "tp_size" else None) == v for k, v in kw.items())

        key = dict(batch_size=run["batch_size"], cuda_graph=run["cuda_graph"], overlap=run["overlap"])
        plain = next((p for p in runs if p["spec_config"] is None and same(p, tp_size=tp, **key)), None)
        if run.get("round_ms") and plain and plain.get("decode_step_ms"):
            run["round_over_decode_step"] = run["round_ms"] / plain["decode_step_ms"]
            run["speedup_tokens_per_s"] = run["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
        tp1 = next((p for p in runs if p["spec_config"] == run["spec_config"] and same(p, tp_size=1, **key)), None)
        if tp > 1 and tp1 is not None:
            run["tp_speedup_tokens_per_s"] = run["decode_tokens_per_s"] / tp1["decode_tokens_per_s"]
            if run.get("decode_step_ms") and tp1.get("decode_step_ms"):
                run["tp_speedup_decode_step"] = tp1["decode_step_ms"] / run["decode_step_ms"]


def _print_run(run: dict) -> None:
    spec = run["spec_config"]
    line = (f"tp={run.get('tp_size', 1)} bs={run['batch_size']:3d} graphs={'on ' if run['cuda_graph'] else 'off'} "
            f"overlap={'on ' if run['overlap'] else 'off'} spec={spec or '-'} tok/s={run['tokens_per_s']:.1f} "
            f"decode_tok/s={run['decode_tokens_per_s']:.1f} wall/gpu={run['wall_over_gpu_phases'] or 0:.2f}")
    if run.get("decode_step_ms"):
        line += f" step={run['decode_step_ms']:.3f}ms"
    if run.get("round_ms"):
        line += f" round={run['round_ms']:.3f}ms accept_len={run['spec']['mean_accept_length']:.2f}"
    print(line, flush=True)
    if run.get("kernels"):
        k = run["kernels"]
        print(f"  kernels: {k['launches_per_step']:.0f} launches, {k['us_per_step']:.0f} us a step; "
              + ", ".join(f"{r['name'][:40]} x{r['launches_per_step']:.0f} {r['us_per_step']:.0f} us"
                          for r in k["kernels"][:12]), flush=True)


__all__ = ["add_latency_parser", "run_latency_bench", "device_name"]
