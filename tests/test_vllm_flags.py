"""vLLM's flags beside SGLang's: each alias sets what its SGLang twin sets and takes effect in the engine built
from it; --speculative-config JSON, --config FILE.yaml, a positional model, case-insensitive algorithms; exact
flag names only; the defaults a GPU user expects (device, dtype, running requests)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from spruce import LLM, SamplingParams
from spruce.cli import build_parser
from spruce.cli_args import engine_kwargs
from spruce.config import (
    MAX_RUNNING_REQUESTS_BIG_GPU, MAX_RUNNING_REQUESTS_CPU, MAX_RUNNING_REQUESTS_GPU, builtin_draft_path,
    builtin_model_path, default_graph_max_bs, make_speculative_config, resolve_dtype, resolve_max_running_requests,
)

MODEL = str(builtin_model_path())
DRAFT = str(builtin_draft_path())


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def refused(capsys, *argv: str) -> str:
    """The argparse error parsing `spruce argv` exits with (exit code 2)."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("vllm,sglang,key,value", [
    (["--max-model-len", "64"], ["--context-length", "64"], "context_length", 64),
    (["--gpu-memory-utilization", "0.5"], ["--mem-fraction-static", "0.5"], "mem_fraction_static", 0.5),
    (["--max-num-seqs", "3"], ["--max-running-requests", "3"], "max_running_requests", 3),
    (["-tp", "2"], ["--tp-size", "2"], "tp_size", 2),
    (["--tensor-parallel-size", "2"], ["--tp-size", "2"], "tp_size", 2),
    (["--seed", "7"], ["--random-seed", "7"], "seed", 7),
    (["--enforce-eager"], ["--disable-cuda-graph"], "cuda_graph", False),
    (["--no-enable-prefix-caching"], ["--disable-radix-cache"], "disable_radix_cache", True),
    (["--tokenizer", "/t"], ["--tokenizer-path", "/t"], "tokenizer", "/t"),
    (["--dtype", "half"], ["--dtype", "float16"], "dtype", "float16"),
    (["--dtype", "float"], ["--dtype", "float32"], "dtype", "float32"),
    (["--max-num-batched-tokens", "512"], ["--chunked-prefill-size", "512"], "chunked_prefill_size", 512),
])
def test_each_vllm_flag_sets_what_its_sglang_twin_sets(vllm, sglang, key, value):
    ours, theirs = engine_kwargs(parse("--model", MODEL, *vllm)), engine_kwargs(parse("--model", MODEL, *sglang))
    resolved = {k: resolve_dtype(v, "cpu", MODEL) if k == "dtype" else v for k, v in ours.items()}
    assert resolved[key] == value
    assert {k: resolve_dtype(v, "cpu", MODEL) if k == "dtype" else v for k, v in theirs.items()} == resolved
    assert engine_kwargs(parse("--model", MODEL))[key] != value  # the flag changed something


def test_vllm_flags_take_effect_in_the_engine(monkeypatch):
    """One engine built from vLLM's flags alone (no --device, --dtype auto: on a machine without a GPU, the CPU in
    float32)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = parse(MODEL, "--max-num-seqs", "3", "--max-model-len", "64", "--enforce-eager", "--seed", "5",
                 "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5")
    llm = LLM(**{**engine_kwargs(args), "show_progress": False})
    cfg, lim = llm.config, llm.engine.limits
    assert (cfg.model, cfg.device, cfg.dtype, cfg.seed, cfg.disable_radix_cache, cfg.mem_fraction_static,
            cfg.cuda_graph) == (MODEL, "cpu", "float32", 5, True, 0.5, False)
    assert (lim.max_running_requests, lim.context_length) == (3, 64)
    assert llm.engine.stats()["prefix_cache"] is None
    llm.default_sampling_params = lambda: SamplingParams(max_tokens=2)
    assert len(llm.generate("def f(")[0].token_ids) == 2  # no sampling params: the model's defaults


def test_offline_sampling_defaults_come_from_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 0}))
    llm = LLM.__new__(LLM)
    llm.config = SimpleNamespace(model=str(tmp_path))
    assert llm.default_sampling_params() == SamplingParams(temperature=0.6, top_p=0.9)
    llm.config = SimpleNamespace(model=MODEL)  # the demo model's sets none: SamplingParams' own (greedy)
    assert llm.default_sampling_params() == SamplingParams()


def test_speculative_config_builds_the_engines_speculative_settings():
    spec = {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": 3}
    kw = engine_kwargs(parse(MODEL, "--speculative-config", json.dumps(spec)))
    cfg = make_speculative_config(kw["speculative_algorithm"], kw["draft_model"], kw["speculative_num_steps"],
                                  kw["speculative_eagle_topk"], kw["speculative_num_draft_tokens"], model=MODEL)
    assert (cfg.algorithm, cfg.draft_model, cfg.num_steps, cfg.eagle_topk, cfg.num_draft_tokens) == \
        ("EAGLE3", DRAFT, 3, 1, 4)  # vLLM's chain of num_speculative_tokens drafts


def test_prefixes_of_flags_are_refused(capsys):
    assert "--max-q" in refused(capsys, "serve", "--max-q", "3")
    assert "--max-tok" in refused(capsys, "generate", "--prompt", "x", "--max-tok", "3")
    assert "--mem-frac" in refused(capsys, "serve", "--mem-frac", "0.5")
    assert "--num-prom" in refused(capsys, "bench", "serving", "--num-prom", "3")  # a lazily registered parser


def test_positional_model():
    assert parse("/m/llama").model == "/m/llama"
    assert parse("/m/llama", "--model", "/m/llama").model == "/m/llama"
    assert parse().model is None  # the bundled demo model


def test_positional_model_and_a_different_model_flag_are_refused(capsys):
    err = refused(capsys, "serve", "/m/a", "--model", "/m/b")
    assert "'/m/a'" in err and "'/m/b'" in err


def test_speculative_algorithm_in_any_case():
    assert parse("--speculative-algorithm", "eagle3").speculative_algorithm == "EAGLE3"
    assert parse("--speculative-algorithm", "nextn").speculative_algorithm == "NEXTN"


def spec_kwargs(config: dict, *flags: str) -> dict:
    kw = engine_kwargs(parse("--model", MODEL, "--speculative-config", json.dumps(config), *flags))
    return {k.removeprefix("speculative_"): v for k, v in kw.items()
            if k.startswith("speculative_") or k == "draft_model"}


def test_speculative_config_with_vllms_keys_is_a_chain():
    kw = spec_kwargs({"method": "eagle3", "model": DRAFT, "num_speculative_tokens": 3})
    assert (kw["algorithm"], kw["draft_model"], kw["num_steps"], kw["eagle_topk"]) == ("EAGLE3", DRAFT, 3, 1)


def test_speculative_config_takes_spruce_tree_keys_and_synthetic_acceptance():
    kw = spec_kwargs({"method": "EAGLE", "model": DRAFT, "num_speculative_tokens": 4, "eagle_topk": 2,
                      "num_draft_tokens": 6})
    assert (kw["algorithm"], kw["num_steps"], kw["eagle_topk"], kw["num_draft_tokens"]) == ("EAGLE", 4, 2, 6)
    kw = spec_kwargs({"method": "eagle3", "model": DRAFT, "num_speculative_tokens": 3,
                      "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5})
    assert kw["synthetic_acceptance_length"] == 2.5
    kw = spec_kwargs({"method": "eagle3", "model": DRAFT, "num_speculative_tokens": 2,
                      "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.9, 0.5]})
    assert kw["synthetic_acceptance_rates"] == (0.9, 0.5)
    for method in ("mtp", "deepseek_mtp", "MTP"):
        assert spec_kwargs({"method": method})["algorithm"] == "NEXTN"


def test_an_explicit_topk_beside_vllms_chain_wins():
    kw = spec_kwargs({"method": "eagle3", "model": DRAFT, "num_speculative_tokens": 3}, "--speculative-eagle-topk", "2")
    assert kw["eagle_topk"] == 2


@pytest.mark.parametrize("config,words", [
    ({"method": "eagle3", "model": DRAFT, "num_lookahead_slots": 2}, ["'num_lookahead_slots'"]),
    ({"method": "medusa"}, ["'medusa'", "eagle3", "ngram"]),
    ({"method": "eagle3", "model": DRAFT, "draft_tensor_parallel_size": 2}, ["draft_tensor_parallel_size=2"]),
    ({"method": "eagle3", "model": DRAFT, "rejection_sample_method": "block"}, ["'block'"]),
    ({"method": "eagle3", "model": DRAFT, "rejection_sample_method": "synthetic"}, ["synthetic_acceptance_length"]),
    ({"method": "eagle3", "model": DRAFT, "synthetic_acceptance_length": 2.0}, ["'synthetic'"]),
    ([1, 2], ["JSON object"]),
])
def test_bad_speculative_configs_are_refused_naming_the_key(capsys, config, words):
    err = refused(capsys, "serve", "--speculative-config", json.dumps(config))
    assert all(w in err for w in words), err


def test_speculative_config_against_a_different_flag_is_refused(capsys):
    err = refused(capsys, "serve", "--speculative-config", json.dumps({"method": "eagle3", "model": DRAFT,
                                                                      "num_speculative_tokens": 3}),
                  "--speculative-num-steps", "5")
    assert "--speculative-num-steps" in err


def test_config_file_gives_flags_and_the_command_line_wins(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("max-model-len: 64\nenforce_eager: true\nport: 8000\nmodel: /m/from-file\n"
                    "speculative-config:\n  method: eagle3\n  model: /d\n  num_speculative_tokens: 2\n")
    args = parse("--config", str(path), "--port", "9000")
    assert (args.context_length, args.disable_cuda_graph, args.port, args.model) == (64, True, 9000, "/m/from-file")
    assert (args.speculative_algorithm, args.speculative_draft_model_path, args.speculative_num_steps) == \
        ("EAGLE3", "/d", 2)
    assert parse(f"--config={path}", "--max-model-len", "32").context_length == 32


def test_config_file_with_an_unknown_key_is_refused_naming_it(capsys, tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("max-model-len: 64\nmax-loras: 2\n")
    assert "'max-loras'" in refused(capsys, "serve", "--config", str(path))
    path.write_text("- just a list\n")
    assert "mapping" in refused(capsys, "serve", "--config", str(path))


# --- defaults ------------------------------------------------------------------------------------------------
def test_dtype_auto_is_the_checkpoints_on_cuda_and_float32_on_cpu(tmp_path):
    for torch_dtype, expected in (("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "bfloat16")):
        (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": torch_dtype}))
        assert resolve_dtype("auto", "cuda", tmp_path) == expected
        assert resolve_dtype("auto", "cpu", tmp_path) == "float32"
    assert resolve_dtype("half", "cuda", tmp_path) == "float16"
    assert resolve_dtype("bfloat16", "cpu", tmp_path) == "bfloat16"


@pytest.mark.parametrize("name,gib,expected", [
    ("NVIDIA H200", 141, MAX_RUNNING_REQUESTS_BIG_GPU), ("NVIDIA H100 80GB HBM3", 80, MAX_RUNNING_REQUESTS_BIG_GPU),
    ("NVIDIA A100-SXM4-80GB", 80, MAX_RUNNING_REQUESTS_GPU), ("NVIDIA L4", 24, MAX_RUNNING_REQUESTS_GPU),
])
def test_running_requests_default_to_vllms_by_gpu_memory(monkeypatch, name, gib, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda _d: SimpleNamespace(name=name, total_memory=gib << 30))
    assert resolve_max_running_requests(None, "cuda") == expected
    assert resolve_max_running_requests(12, "cuda") == 12
    assert default_graph_max_bs(expected) == min(expected, 512)


def test_running_requests_default_to_16_on_cpu():
    assert resolve_max_running_requests(None, "cpu") == MAX_RUNNING_REQUESTS_CPU == 16


def test_the_peer_benchmarks_parser_refuses_prefixes_too():
    from spruce.bench import peer

    assert peer.build_parser().parse_args(["--out", "x.json", "--concurrency", "1"]).concurrency
    with pytest.raises(SystemExit):
        peer.build_parser().parse_args(["--out", "x.json", "--concurr", "1"])


def test_generation_config_is_sampling_defaults_under_vllms_name(capsys):
    assert parse("--generation-config", "vllm").sampling_defaults == parse("--sampling-defaults", "openai") \
        .sampling_defaults == "openai"
    assert parse("--generation-config", "auto").sampling_defaults == parse().sampling_defaults == "model"
    assert "'/some/dir'" in refused(capsys, "serve", "--generation-config", "/some/dir")
