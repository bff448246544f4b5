#!/usr/bin/env python3
"""Peer benchmark: gpt-fast (meta-pytorch/gpt-fast, formerly pytorch-labs/gpt-fast) decoding the same Hugging
Face Llama checkpoint on the same prompts as `spruce bench latency`, driven the way its generate.py main() does.

gpt-fast is not vendored: its model.py, generate.py and scripts/convert_hf_checkpoint.py are imported from a
directory given with --gpt-fast-dir (a git-ignored export of its repository, e.g. .carry/gpt-fast, with its
commit in a GPT_FAST_COMMIT file beside them or given with --gpt-fast-commit).

What it does, in gpt-fast's own code wherever gpt-fast has code for it:
  1. conversion: registers the checkpoint's dims (read from config.json) in gpt-fast's `transformer_configs`
     under the checkpoint's directory name, links the safetensors shards and their index into a staging
     directory of that name, and runs gpt-fast's `convert_hf_checkpoint()` there (its HF->gpt-fast name map,
     the q/k permutation from HF's half-split rotary layout to its interleaved one, wq|wk|wv fused into wqkv),
     which writes model.pth;
  2. loading: gpt-fast's `_load_model()` (Transformer.from_name on the meta device, mmap'd torch.load,
     load_state_dict(assign=True), .to(device, bf16)), then `setup_caches(1, longest prompt + output_len)`;
  3. decoding: gpt-fast's `generate()` per prompt (batch size 1), with `decode_one_token` replaced by
     `torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)` as main() does (prefill left
     eager unless --compile-prefill, main()'s default), temperature 0 (its --temperature 0: greedy up to exact
     logit ties) and main()'s default top_k=200, after warm-up runs that compile; each prompt is timed end to
     end (prefill + decode) between torch.cuda.synchronize() calls as main() times it.

Prompts are spruce's: the first --num-prompts texts of --prompts (JSONL with "text"), tokenized with the
checkpoint's tokenizer.json the way spruce's Tokenizer does (bos per the post-processor / add_bos_token) and
cut to --input-len tokens. --run-spruce writes spruce's greedy tokens for the same prompts to --spruce-tokens
(a separate process from the gpt-fast run); given --spruce-tokens, the gpt-fast run reports how far its greedy
tokens agree with them.

Figures: main()'s tokens/sec (output_len / end-to-end seconds, per prompt, and their mean as its "Average
tokens/sec"), end-to-end tokens/s over all prompts, decode tokens/s ((output_len - 1) per prompt over
end-to-end time less prefill time, as spruce's latency bench computes it; prefill is timed with CUDA events
recorded around gpt-fast's prefill()), per-prompt times, the generated token ids.

CPU check (no compile, a few tokens):  python bench/gpt_fast_peer.py --model /work/shared/models/pycode-19m \
    --gpt-fast-dir .carry/gpt-fast --device cpu --dtype float32 --no-compile --num-prompts 2 --output-len 8 \
    --check-spruce --out /tmp/gpt-fast-cpu.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

_SRC = Path(__file__).resolve().parents[1] / "src"
if _SRC.is_dir() and str(_SRC) not in sys.path:
    sys.path.append(str(_SRC))  # spruce (for device name, commit, --run-spruce) when not installed


# ---------------------------------------------------------------------------------------------- prompts

def load_prompt_ids(model_dir: Path, prompts: Path, num_prompts: int, input_len: int) -> list[list[int]]:
    """The ids `spruce bench latency --prompts` uses: tokenizer.json via `tokenizers` (bos added by the
    post-processor, or prepended when tokenizer_config.json sets add_bos_token and the post-processor does
    not, as spruce's Tokenizer does), cut to input_len; num_prompts of them, cycling through the file."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    cfg_file = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    bos_tok = cfg.get("bos_token")
    bos_tok = bos_tok.get("content") if isinstance(bos_tok, dict) else bos_tok
    bos = tok.token_to_id(bos_tok) if isinstance(bos_tok, str) else None
    if bos is None:
        bos = json.loads((model_dir / "config.json").read_text()).get("bos_token_id")
    adds_bos = bos is not None and tok.encode("a", add_special_tokens=True).ids[:1] == [bos]
    prepend = bool(cfg.get("add_bos_token")) and bos is not None and not adds_bos
    texts = [json.loads(line)["text"] for line in prompts.read_text().splitlines() if line.strip()]
    ids = []
    for t in texts:
        e = tok.encode(t, add_special_tokens=True).ids
        ids.append(([bos] + e if prepend else e)[:input_len])
    return [ids[i % len(ids)] for i in range(num_prompts)]


# ---------------------------------------------------------------------------------------------- gpt-fast

def import_gpt_fast(gf_dir: Path):
    """gpt-fast's model, generate and convert_hf_checkpoint modules, imported from gf_dir.

    generate.py imports gpt-fast's tokenizer module at the top, which needs sentencepiece and tiktoken;
    neither is used here (prompts are tokenized with tokenizer.json), so where they are missing a stand-in
    `tokenizer` module whose get_tokenizer() refuses is registered instead."""
    gf_dir = gf_dir.resolve()
    for f in ("model.py", "generate.py", "scripts/convert_hf_checkpoint.py"):
        if not (gf_dir / f).is_file():
            raise SystemExit(f"{gf_dir / f} is missing: export gpt-fast's sources there first")
    for name in ("model", "generate", "tokenizer"):
        mod = sys.modules.get(name)
        if mod is not None and Path(getattr(mod, "__file__", "") or "").resolve().parent != gf_dir:
            raise SystemExit(f"a module named {name!r} is already imported from {mod.__file__}")
    sys.path.insert(0, str(gf_dir))
    try:
        import tokenizer  # noqa: F401  gpt-fast's
    except ImportError as e:
        stub = types.ModuleType("tokenizer")
        reason = str(e)

        def get_tokenizer(*_a, **_k):
            raise RuntimeError(f"gpt-fast's tokenizer is not importable here ({reason}); prompts come as token ids")

        stub.get_tokenizer = get_tokenizer
        sys.modules["tokenizer"] = stub
    import generate as gf_generate
    import model as gf_model

    spec = importlib.util.spec_from_file_location("gpt_fast_convert_hf_checkpoint",
                                                  gf_dir / "scripts" / "convert_hf_checkpoint.py")
    gf_convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gf_convert)
    return gf_model, gf_generate, gf_convert


def model_args_from_hf(cfg: dict) -> dict:
    """gpt-fast ModelArgs fields for an HF Llama config.json (refuses what gpt-fast's Llama cannot express)."""
    arch = cfg.get("architectures") or ["LlamaForCausalLM"]
    if cfg.get("model_type", "llama") != "llama" or arch[0] != "LlamaForCausalLM":
        raise SystemExit(f"not a Llama checkpoint: model_type={cfg.get('model_type')} architectures={arch}")
    if cfg.get("attention_bias") or cfg.get("mlp_bias") or cfg.get("hidden_act", "silu") != "silu":
        raise SystemExit("gpt-fast's Llama has no biases and uses SiLU")
    if cfg.get("tie_word_embeddings"):
        raise SystemExit("tied embeddings: gpt-fast's converter needs an lm_head.weight")
    dim, n_head = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("head_dim", dim // n_head) != dim // n_head:
        raise SystemExit(f"head_dim {cfg['head_dim']} != hidden/heads: gpt-fast derives head_dim = dim // n_head")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    args = dict(block_size=cfg.get("max_position_embeddings", 2048), vocab_size=cfg["vocab_size"],
                n_layer=cfg["num_hidden_layers"], n_head=n_head, dim=dim,
                intermediate_size=cfg["intermediate_size"],
                n_local_heads=cfg.get("num_key_value_heads", n_head), rope_base=float(theta),
                norm_eps=cfg.get("rms_norm_eps", 1e-5))
    if rope_type == "llama3":
        args["rope_scaling"] = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                     "original_max_position_embeddings")}
    elif rope_type != "default":
        raise SystemExit(f"rope_type {rope_type!r} has no gpt-fast equivalent")
    return args


def convert_checkpoint(hf_dir: Path, ckpt_root: Path, gf_model, gf_convert) -> Path:
    """Run gpt-fast's convert_hf_checkpoint() on hf_dir (through a staging directory of links named like
    hf_dir, so the checkpoint directory is never written); returns the model.pth path."""
    name = hf_dir.resolve().name
    cfg = json.loads((hf_dir / "config.json").read_text())
    gf_model.transformer_configs[name] = model_args_from_hf(cfg)  # ModelArgs.from_name(name) finds it
    args = gf_model.ModelArgs.from_name(name)
    assert args.head_dim == cfg.get("head_dim", args.head_dim), (args.head_dim, cfg.get("head_dim"))
    stage = ckpt_root / name
    stage.mkdir(parents=True, exist_ok=True)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        links = ["model.safetensors.index.json", *shards]
    elif (hf_dir / "model.safetensors").is_file():  # gpt-fast's converter wants an index: write one
        from safetensors import safe_open
        with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
            wm = {k: "model.safetensors" for k in f.keys()}
        (stage / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
        links = ["model.safetensors"]
    else:
        raise SystemExit(f"no safetensors in {hf_dir}")
    for f in links:
        dst = stage / f
        if dst.is_symlink() or dst.exists():
            dst.unlink()
        dst.symlink_to((hf_dir / f).resolve())
    gf_convert.convert_hf_checkpoint(checkpoint_dir=stage, model_name=name)
    return stage / "model.pth"


# ---------------------------------------------------------------------------------------------- timing

class PrefillClock:
    """Wraps gpt-fast's prefill (a module global that generate() calls) to time it: CUDA events recorded
    around it (no synchronization added), or the wall clock on CPU."""

    def __init__(self, gf_generate, cuda: bool):
        self.inner, self.cuda, self.marks = gf_generate.prefill, cuda, None
        gf_generate.prefill = self

    def __call__(self, *a, **k):
        if self.cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = self.inner(*a, **k)
            e.record()
            self.marks = (s, e)
        else:
            t0 = time.perf_counter()
            out = self.inner(*a, **k)
            self.marks = (t0, time.perf_counter())
        return out

    def last_ms(self) -> float:
        s, e = self.marks
        return s.elapsed_time(e) if self.cuda else (e - s) * 1e3


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def run_gpt_fast(args, gf_generate, ckpt: Path, prompts: list[list[int]]) -> dict:
    device, cuda = args.device, args.device.startswith("cuda")
    precision = getattr(torch, args.dtype)
    torch.manual_seed(1234)  # as main()
    t0 = time.perf_counter()
    model = gf_generate._load_model(ckpt, device, precision, False)
    _sync(device)
    load_s = time.perf_counter() - t0
    with torch.device(device):  # one cache for every prompt, so no prompt re-allocates it (or re-records)
        model.setup_caches(max_batch_size=1, max_seq_length=max(map(len, prompts)) + args.output_len)
    if args.compile:  # main(): decode_one_token always, prefill with --compile_prefill
        gf_generate.decode_one_token = torch.compile(gf_generate.decode_one_token, mode="reduce-overhead",
                                                     fullgraph=True)
        if args.compile_prefill:
            gf_generate.prefill = torch.compile(gf_generate.prefill, fullgraph=True, dynamic=True)
    else:  # eager everywhere: also undo the torch.compile generate.py wraps create_block_mask in at import
        from torch.nn.attention.flex_attention import create_block_mask
        gf_generate.create_block_mask = create_block_mask
    clock = PrefillClock(gf_generate, cuda)
    sampling = dict(temperature=args.temperature, top_k=args.top_k)

    def one(ids: list[int], n: int):
        encoded = torch.tensor(ids, dtype=torch.int, device=device)  # encode_tokens()'s dtype
        _sync(device)
        t = time.perf_counter()
        y, _ = gf_generate.generate(model, encoded, n, batch_size=1, draft_model=None, speculate_k=5,
                                    interactive=False, callback=lambda x: x, **sampling)
        _sync(device)
        return y[0, len(ids):].tolist(), time.perf_counter() - t

    # warm-up (compile, CUDA-graph recording): main() runs one generate before timing; prompts of other
    # lengths re-trace the compiled create_block_mask in prefill, so each distinct length runs once too
    t0 = time.perf_counter()
    longest = max(prompts, key=len)
    for _ in range(max(args.warmup, 1 if args.compile else 0)):
        one(longest, args.output_len)
    seen = {len(longest)}
    for p in prompts:
        if args.warmup and len(p) not in seen:
            seen.add(len(p))
            one(p, args.output_len)
    warmup_s = time.perf_counter() - t0

    best = None
    for _ in range(args.repeats):
        runs = []
        for ids in prompts:
            out, t = one(ids, args.output_len)
            prefill_ms = clock.last_ms()
            n = len(out)
            decode_s = max(t - prefill_ms / 1e3, 1e-9)
            runs.append({"prompt_tokens": len(ids), "output_tokens": n, "total_s": t, "prefill_ms": prefill_ms,
                         "decode_s": decode_s, "tokens_per_s": n / t, "decode_tokens_per_s": (n - 1) / decode_s,
                         "token_ids": out})
        total = sum(r["total_s"] for r in runs)
        if best is None or total < best[0]:
            best = (total, runs)
    total, runs = best
    out_tokens = sum(r["output_tokens"] for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    model_size, params = gf_generate._get_model_size(model)
    avg_main = statistics.mean(r["tokens_per_s"] for r in runs)
    figures = {
        "main_average_tokens_per_s": avg_main,  # main()'s "Average tokens/sec" (prefill included)
        "tokens_per_s": out_tokens / total,  # end to end, all prompts
        "decode_tokens_per_s": (out_tokens - len(runs)) / decode_s,
        "decode_step_ms": 1e3 * decode_s / (out_tokens - len(runs)),
        "prefill_ms_mean": statistics.mean(r["prefill_ms"] for r in runs),
        "total_s": total, "output_tokens": out_tokens, "num_prompts": len(runs),
        "main_bandwidth_GBps": model_size * avg_main / 1e9,  # main()'s "Bandwidth achieved", averaged
        "weight_bytes_excl_embedding": model_size, "params_excl_embedding": params,
        "load_s": load_s, "warmup_s": warmup_s, "warmup_lengths": sorted(seen),
        "max_memory_reserved_GB": torch.cuda.max_memory_reserved() / 1e9 if cuda else None,
        "per_prompt": runs,
    }
    return figures


# ---------------------------------------------------------------------------------------------- spruce

def run_spruce(args, prompts: list[list[int]]) -> list[list[int]]:
    """spruce's greedy tokens for the prompts (ignore_eos, as its latency bench), bs 1 and cuda graphs as
    `spruce bench latency --batch-sizes 1` runs it."""
    from spruce import LLM, SamplingParams

    kw = dict(device=args.device, dtype=args.dtype, max_running_requests=1,
              context_length=args.input_len + args.output_len + 64,
              max_total_tokens=args.input_len + args.output_len + 80)
    if args.device.startswith("cuda"):
        kw.update(cuda_graph=True, cuda_graph_max_bs=1)
    llm = LLM(str(args.model), **kw)
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    return [llm.generate([ids], sp)[0].token_ids for ids in prompts]


def spruce_ids_agree(args, prompts: list[list[int]]) -> bool:
    """Whether spruce's own tokenizer gives the same prompt ids (a check of load_prompt_ids)."""
    from spruce.models.hf_config import ModelConfig
    from spruce.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(args.model, ModelConfig.from_dir(args.model))
    texts = [json.loads(line)["text"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    theirs = [tok.encode(texts[i % len(texts)])[: args.input_len] for i in range(len(prompts))]
    return theirs == prompts


def compare(ours: list[list[int]], ref: list[list[int]]) -> dict:
    """Agreement with reference greedy tokens: identical prompts, common prefix, position-wise match."""
    prefixes, same, total = [], 0, 0
    for a, b in zip(ours, ref):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefixes.append(k)
        same += sum(x == y for x, y in zip(a, b))
        total += max(len(a), len(b))
    n = len(prefixes)
    return {"prompts_compared": n, "prompts_identical": sum(p == len(a) == len(b) for p, a, b in
                                                          zip(prefixes, ours, ref)),
            "common_prefix": prefixes, "prefix_match_rate": sum(prefixes) / max(total, 1),
            "positionwise_match_rate": same / max(total, 1)}


def _read_tokens(path: Path) -> list[list[int]]:
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data = data.get("token_ids") or data.get("outputs") or data["figures"]["token_ids"]
    return [d["token_ids"] if isinstance(d, dict) else d for d in data]


# ---------------------------------------------------------------------------------------------- main

def _commit(args) -> str | None:
    if args.gpt_fast_commit:
        return args.gpt_fast_commit
    f = Path(args.gpt_fast_dir) / "GPT_FAST_COMMIT"
    if f.is_file():
        return f.read_text().strip()
    return None


def _repo(args) -> str:
    f = Path(args.gpt_fast_dir) / "GPT_FAST_REPO"
    return f.read_text().strip() if f.is_file() else "meta-pytorch/gpt-fast"


def _spruce_commit() -> str:
    try:
        from spruce.bench.common import git_commit
        return git_commit()
    except ImportError:
        if os.environ.get("SPRUCE_GIT_COMMIT"):
            return os.environ["SPRUCE_GIT_COMMIT"]
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
        return r.stdout.strip() or "unknown"


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    import platform
    return f"cpu ({platform.processor() or platform.machine()})"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="HF Llama checkpoint dir (safetensors + tokenizer.json)")
    p.add_argument("--gpt-fast-dir", type=Path, default=Path(".carry/gpt-fast"),
                   help="directory holding gpt-fast's model.py, generate.py, scripts/convert_hf_checkpoint.py")
    p.add_argument("--gpt-fast-commit", default=None, help="gpt-fast's commit (default: <dir>/GPT_FAST_COMMIT)")
    p.add_argument("--ckpt-root", type=Path, default=None,
                   help="where the converted <model name>/model.pth goes (default: a temporary directory)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="JSONL of {'text'} (default: <model>/heldout_prompts.jsonl)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="gpt-fast main() uses bfloat16")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager (CPU checks)")
    p.add_argument("--compile-prefill", action="store_true", help="main()'s --compile_prefill (off by default)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (gpt-fast clamps it to 1e-5)")
    p.add_argument("--top-k", type=int, default=200, help="main()'s default")
    p.add_argument("--warmup", type=int, default=1, help="warm-up generates of the longest prompt (main(): 1)")
    p.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts; the fastest is kept")
    p.add_argument("--spruce-tokens", type=Path, default=None,
                   help="spruce's greedy tokens (JSON list of id lists) to compare with; with --run-spruce: written")
    p.add_argument("--run-spruce", action="store_true",
                   help="only generate spruce's greedy tokens for the prompts into --spruce-tokens, then exit")
    p.add_argument("--check-spruce", action="store_true",
                   help="also run spruce in this process afterwards and compare (CPU checks)")
    p.add_argument("--out", type=Path, default=None,
                   help="result JSON file, or a directory for gpt-fast-<device>-<time>.json")
    args = p.parse_args(argv)
    args.prompts = args.prompts or args.model / "heldout_prompts.jsonl"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts = load_prompt_ids(args.model, args.prompts, args.num_prompts, args.input_len)
    if args.run_spruce:
        if args.spruce_tokens is None:
            raise SystemExit("--run-spruce needs --spruce-tokens PATH to write")
        t0 = time.perf_counter()
        toks = run_spruce(args, prompts)
        args.spruce_tokens.parent.mkdir(parents=True, exist_ok=True)
        args.spruce_tokens.write_text(json.dumps({"git_commit": _spruce_commit(), "prompt_ids": prompts,
                                                  "token_ids": toks}) + "\n")
        print(f"spruce: {len(toks)} prompts x {args.output_len} tokens in {time.perf_counter() - t0:.1f}s "
              f"-> {args.spruce_tokens}")
        return 0

    gf_model, gf_generate, gf_convert = import_gpt_fast(args.gpt_fast_dir)
    tmp = None
    if args.ckpt_root is None:
        tmp = tempfile.TemporaryDirectory(prefix="gpt-fast-ckpt-")
        args.ckpt_root = Path(tmp.name)
    t0 = time.perf_counter()
    ckpt = convert_checkpoint(args.model, args.ckpt_root, gf_model, gf_convert)
    convert_s = time.perf_counter() - t0
    figures = run_gpt_fast(args, gf_generate, ckpt, prompts)
    figures["convert_s"] = convert_s
    ours = [r["token_ids"] for r in figures["per_prompt"]]
    if args.spruce_tokens is not None:
        figures["vs_spruce"] = compare(ours, _read_tokens(args.spruce_tokens))
    if args.check_spruce:
        figures["prompt_ids_match_spruce_tokenizer"] = spruce_ids_agree(args, prompts)
        figures["vs_spruce"] = compare(ours, run_spruce(args, prompts))

    model_args = gf_model.ModelArgs.from_name(args.model.resolve().name)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    compiled = "none"
    if args.compile:
        compiled = "decode_one_token (reduce-overhead, fullgraph)" + (" + prefill" if args.compile_prefill else "")
    config.update(batch_size=1, gpt_fast_model_args=dict(vars(model_args)), compiled=compiled)
    dev = _device_name(args.device)
    payload = {"benchmark": "gpt-fast-peer", "device": dev, "git_commit": _spruce_commit(),
               "gpt_fast_commit": _commit(args), "gpt_fast_repo": _repo(args), "torch": torch.__version__,
               "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": config, "figures": figures}
    summary = {k: figures[k] for k in ("main_average_tokens_per_s", "tokens_per_s", "decode_tokens_per_s",
                                       "decode_step_ms", "prefill_ms_mean", "warmup_s")}
    print(f"gpt-fast on {dev}: " + json.dumps({k: round(v, 3) for k, v in summary.items()}))
    if "vs_spruce" in figures:
        v = figures["vs_spruce"]
        print(f"vs spruce: {v['prompts_identical']}/{v['prompts_compared']} prompts identical, prefix match "
              f"{v['prefix_match_rate']:.3f}, common prefixes {v['common_prefix']}")
    if args.out is not None:
        out = args.out
        if out.is_dir() or str(out).endswith("/"):
            slug = "".join(c if c.isalnum() else "-" for c in dev.lower()).strip("-")
            out = out / f"gpt-fast-{slug}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {out}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
