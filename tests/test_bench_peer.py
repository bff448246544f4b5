"""spruce.bench.peer's logic without a GPU: its commands, the JSON it assembles from the client's result files
(with fake servers and a fake client), the ratios, the roofline, the deadline; and peer_client's level loop against a
stand-in `vllm` package."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spruce.bench import peer, peer_client
from spruce.bench.peer import Hooks, Shape

BASE_TOK_S = {"vllm": 100.0, "spruce": 110.0, "spruce-control": 105.0, "spruce-tree-5-4-6": 120.0}
WEIGHTS, KV = 16e9, 131072


def parse(*extra: str, tmp: Path) -> object:
    args = peer.build_parser().parse_args(["--out", str(tmp / "res" / "peer.json"), "--concurrency", "1,4,16",
                                           *extra])
    peer.check_args(args)
    return args


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


class FakeServer:
    started: list[str] = []

    def __init__(self, name, command, port, log):
        self.name, self.command = name, command
        FakeServer.started.append(name)

    def wait_up(self, timeout):
        return self.name != "broken"

    def facts(self):
        return {"version": {"version": "fake"}}

    def stop(self):
        pass

    def tail(self):
        return "fake log tail"


def fake_client(argvs, log):
    """Writes what `vllm bench serve --save-result` would: output tok/s = BASE[engine] * concurrency."""
    for argv in argvs:
        prefix = option(argv, "--request-id-prefix")  # ENGINE-cC-...
        engine = prefix[:prefix.rindex("-c")]
        c = int(option(argv, "--max-concurrency"))
        saved = {"output_throughput": BASE_TOK_S[engine] * c, "median_tpot_ms": 5.0 + c / 10, "mean_tpot_ms": 6.0,
                 "median_ttft_ms": 20.0, "mean_ttft_ms": 25.0, "completed": int(option(argv, "--num-prompts"))}
        Path(option(argv, "--result-dir"), option(argv, "--result-filename")).write_text(json.dumps(saved))
    return 0


def hooks(clock_step: float = 1.0) -> Hooks:
    t = [0.0]

    def clock():
        t[0] += clock_step
        return t[0]

    return Hooks(start_server=FakeServer, run_client=fake_client, clock=clock,
                 bandwidth=lambda: {"gpu": "Fake GPU", "copy_bandwidth_bytes_per_s": 4.0e12},
                 model_bytes=lambda target, quantization, kv_dtype: (lambda batch: WEIGHTS, KV))


@pytest.fixture
def shape(tmp_path):
    return Shape(tmp_path / "target", tmp_path / "draft")


def test_commands_name_dummy_weights_and_synthetic_acceptance_on_both_engines(tmp_path, shape):
    args = parse("--mode", "eagle3", "--synthetic-length", "3.5", "--trees", "5,4,6", tmp=tmp_path)
    vllm = peer.server_command("vllm", args, shape, 8000)
    assert vllm[vllm.index("serve") + 1] == str(shape.target) and option(vllm, "--load-format") == "dummy"
    assert json.loads(option(vllm, "--speculative-config")) == {
        "method": "eagle3", "model": str(shape.draft), "num_speculative_tokens": 5,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 3.5}
    assert option(vllm, "--max-num-seqs") == "16" and option(vllm, "--max-model-len") == "1344"
    chain = peer.server_command("spruce", args, shape, 8000)
    assert option(chain, "--load-format") == "dummy" and option(chain, "--speculative-eagle-topk") == "1"
    assert option(chain, "--speculative-num-draft-tokens") == "6"
    assert option(chain, "--speculative-synthetic-acceptance-length") == "3.5"
    assert peer.server_command("spruce-control", args, shape, 8000) == chain
    tree = peer.server_command("spruce-tree-5-4-6", args, shape, 8000)
    assert [option(tree, f"--speculative-{f}") for f in ("num-steps", "eagle-topk", "num-draft-tokens")] == \
        ["5", "4", "6"]
    assert peer.engine_names(args) == ["vllm", "spruce", "spruce-control", "spruce-tree-5-4-6"]
    plain = peer.server_command("spruce", parse(tmp=tmp_path), shape, 8000)
    assert not any(a.startswith("--speculative") for a in plain)
    from spruce.cli import build_parser

    for command in (chain, tree, plain):  # `spruce serve` takes every flag the benchmark gives it
        assert command[1:4] == ["-m", "spruce.cli", "serve"]
        served = build_parser().parse_args(command[3:])
        assert served.load_format == "dummy" and served.model == str(shape.target)
    assert build_parser().parse_args(chain[3:]).speculative_synthetic_acceptance_length == 3.5
    client = peer.client_argv(args, shape, "spruce", 4, 8000, tmp_path)
    assert "--ignore-eos" in client and option(client, "--dataset-name") == "random"
    assert (option(client, "--random-input-len"), option(client, "--random-output-len")) == ("512", "256")
    assert option(client, "--num-prompts") == "8" and option(client, "--max-concurrency") == "4"
    assert option(client, "--temperature") == "0.0"


def test_ngram_commands_match_lookup_and_acceptance_on_both_engines(tmp_path, shape):
    args = parse("--mode", "ngram", "--synthetic-length", "2.5", "--prompt-lookup-min", "1", "--trees", "5,2,11",
                 tmp=tmp_path)
    vllm = peer.server_command("vllm", args, shape, 8000)
    assert json.loads(option(vllm, "--speculative-config")) == {
        "method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4, "num_speculative_tokens": 5,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5}
    from spruce.cli import build_parser

    for name, tree in (("spruce", ("5", "1", "6")), ("spruce-tree-5-2-11", ("5", "2", "11"))):
        command = peer.server_command(name, args, shape, 8000)
        served = build_parser().parse_args(command[3:])
        assert served.speculative_algorithm == "NGRAM" and served.speculative_draft_model_path is None
        assert (served.speculative_prompt_lookup_min, served.speculative_prompt_lookup_max) == (1, 4)
        assert served.speculative_synthetic_acceptance_length == 2.5
        assert [option(command, f"--speculative-{f}") for f in ("num-steps", "eagle-topk", "num-draft-tokens")] \
            == list(tree)
    assert not any(a.startswith("--speculative") for a in peer.server_command("spruce-plain", args, shape, 8000))


@pytest.mark.parametrize("argv, words", [
    (["--mode", "ngram", "--prompt-lookup-min", "5"], "need 1 <= min <= max"),
    (["--mode", "ngram", "--engines", "spruce-adaptive"], "needs --mode eagle3"),
    (["--mode", "ngram", "--draft-dir", "d"], "--draft-dir d needs --mode eagle3"),
    (["--mode", "ngram", "--synthetic-length", "7"], "must be in [1, steps + 1 = 6]"),
])
def test_bad_ngram_arguments_are_refused_naming_them(tmp_path, argv, words):
    with pytest.raises(SystemExit, match=r".") as e:
        parse(*argv, tmp=tmp_path)
    assert words in str(e.value)


@pytest.mark.parametrize("argv, words", [
    (["--engines", "vllm,sglang"], "--engines"),
    (["--trees", "5,4,6"], "needs --mode eagle3"),
    (["--mode", "eagle3", "--synthetic-length", "7"], "must be in [1, steps + 1 = 6]"),
    (["--mode", "eagle3", "--synthetic-length", "4", "--trees", "2,4,6"], "must be in [1, 3]"),
])
def test_bad_arguments_are_refused_naming_them(tmp_path, argv, words):
    with pytest.raises(SystemExit, match=r".") as e:
        parse(*argv, tmp=tmp_path)
    assert words in str(e.value)


def test_the_json_holds_every_engine_the_ratios_and_the_roofline(tmp_path, shape):
    args = parse("--mode", "eagle3", "--trees", "5,4,6", tmp=tmp_path)
    result = peer.run(args, hooks(), shape)
    assert json.loads(args.out.read_text()) == result
    assert result["synthetic_acceptance"]["chain_rates"] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert "not the target's" in result["synthetic_acceptance"]["note"]
    for name, base in BASE_TOK_S.items():
        levels = result["engines"][name]["levels"]
        assert {c: v["output_tok_s"] for c, v in levels.items()} == {"1": base, "4": 4 * base, "16": 16 * base}
        assert levels["4"]["tpot_p50_ms"] == 5.4 and levels["4"]["ttft_mean_ms"] == 25.0
    r = result["ratios"]
    assert set(r) == {"spruce/vllm", "spruce-control/vllm", "spruce-tree-5-4-6/vllm", "spruce-control/spruce",
                      "spruce-tree-5-4-6/spruce"}
    assert r["spruce/vllm"]["16"]["output_tok_s"] == pytest.approx(1.1)
    assert r["spruce-control/spruce"]["1"]["output_tok_s"] == pytest.approx(105 / 110)
    assert r["spruce/vllm"]["4"]["tpot_p50_ms"] == pytest.approx(1.0)
    ctx = 512 + 128
    roof = result["roofline"]["16"]
    step = (WEIGHTS + KV * 16 * ctx) / 4.8e12
    assert roof["step_ms_nominal"] == pytest.approx(step * 1e3) and roof["tok_s_nominal"] == pytest.approx(16 / step)
    assert roof["step_ms_measured"] == pytest.approx((WEIGHTS + KV * 16 * ctx) / 4.0e12 * 1e3)
    fraction = result["engines"]["spruce"]["levels"]["16"]["roofline_fraction"]
    assert fraction == pytest.approx(roof["step_ms_measured"] / 6.6)
    assert result["hbm"]["measured"]["gpu"] == "Fake GPU" and result["gpu"] == "Fake GPU"
    assert result["engines"]["vllm"]["client_argv"][0][-1] == "vllm-c16-warmup.json"  # the warm-up level first


def test_a_server_that_does_not_start_is_recorded_and_the_rest_run(tmp_path, shape):
    args = parse("--engines", "vllm,spruce", tmp=tmp_path)
    class Broken(FakeServer):
        def wait_up(self, timeout):
            return self.name != "vllm"

    h = hooks()
    h.start_server = Broken
    result = peer.run(args, h, shape)
    assert "did not start" in result["engines"]["vllm"]["error"] and "fake log tail" in result["engines"]["vllm"][
        "error"]
    assert result["engines"]["spruce"]["levels"]["1"]["output_tok_s"] == 110.0
    assert result["ratios"] == {}


def test_engines_past_the_deadline_are_skipped(tmp_path, shape):
    args = parse("--deadline-s", "200", tmp=tmp_path)
    result = peer.run(args, hooks(clock_step=30.0), shape)  # each engine spends ~150 s of the fake clock
    assert result["engines"]["vllm"]["levels"]
    assert "deadline" in result["engines"]["spruce"]["skipped"]
    assert "deadline" in result["engines"]["spruce-control"]["skipped"]


def test_a_slow_vllm_start_does_not_skip_spruce(tmp_path, shape):
    """Each kind of server is guessed from its own kind: after vLLM took ~150 s, spruce's first server is guessed
    at spruce's start estimate (and runs), the control at what spruce's server then took (and is skipped)."""
    args = parse("--deadline-s", "260", tmp=tmp_path)
    result = peer.run(args, hooks(clock_step=30.0), shape)
    assert result["engines"]["vllm"]["levels"] and result["engines"]["spruce"]["levels"]
    assert "deadline" in result["engines"]["spruce-control"]["skipped"]


def test_acceptance_from_metrics():
    vllm = "# HELP x\nvllm:spec_decode_num_drafts_total{model_name=\"m\"} 100.0\n" \
           "vllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 200.0\n"
    assert peer.acceptance_from_metrics(vllm)["mean_accept_length"] == 3.0
    assert "tokens_per_step" not in peer.acceptance_from_metrics(vllm)  # no generation counter
    # 1000 tokens, 600 of them accepted drafts: 400 steps, whether 250 or 400 of them proposed drafts
    for drafts in (250, 400):
        text = vllm.replace("100.0", f"{drafts}.0").replace("200.0", "600.0") + \
            "vllm:generation_tokens_total{model_name=\"m\"} 1000.0\n"
        got = peer.acceptance_from_metrics(text)
        assert got["tokens_per_step"] == 2.5 and got["mean_accept_length"] == 1 + 600 / drafts
    assert peer.acceptance_from_metrics("spruce_spec_mean_accept_length 3.5\n") == {"mean_accept_length": 3.5}
    assert peer.acceptance_from_metrics("other 1\n") == {}


def test_plain_decode_bytes_of_the_8b_shape(tmp_path):
    from spruce.bench.shapes import write_shape_dirs

    target, _ = write_shape_dirs("llama-3.1-8b", tmp_path)
    weight_bytes, kv = peer.model_bytes(target)
    assert kv == 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head dim x bf16
    params = 8_030_261_248 - 128256 * 4096  # Llama-3.1-8B less its embedding table (rows gathered, not read)
    assert weight_bytes(1) == 2 * params


def test_fp8_decode_bytes_of_the_8b_shape(tmp_path):
    """--quantization fp8 --kv-cache-dtype fp8_e4m3: the roofline reads the decoder's linears at one byte a weight
    plus a float32 scale per output row, the lm_head and norms in bf16, and one byte a KV value."""
    from spruce.bench.shapes import write_shape_dirs

    target, _ = write_shape_dirs("llama-3.1-8b", tmp_path)
    weight_bytes, kv = peer.model_bytes(target, "fp8", "fp8_e4m3")
    assert kv == 32 * 2 * 8 * 128  # layers x (K, V) x KV heads x head dim x one byte
    linear = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)  # q, o; k, v; gate, up, down
    rows = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)  # their output rows, one scale each
    bf16 = 2 * (8_030_261_248 - 128256 * 4096)
    assert weight_bytes(1) == bf16 - 2 * linear + linear + 4 * rows


def test_precision_flags_reach_both_engines_and_only_through_peer(tmp_path, shape):
    args = parse("--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3", tmp=tmp_path)
    for engine in ("vllm", "spruce"):
        cmd = peer.server_command(engine, args, shape, 8000)
        assert option(cmd, "--quantization") == "fp8" and option(cmd, "--kv-cache-dtype") == "fp8_e4m3", engine
    plain = parse(tmp=tmp_path)
    assert "--quantization" not in peer.server_command("spruce", plain, shape, 8000)
    for flags in ("--spruce-flags=--quantization fp8", "--vllm-flags=--kv-cache-dtype=fp8_e4m3"):
        with pytest.raises(SystemExit, match="to `spruce bench peer` itself"):
            parse(flags, tmp=tmp_path)


FAKE_VLLM = '''
import json, os, sys
def add_cli_args(parser):
    parser.add_argument("--result-dir"); parser.add_argument("--result-filename"); parser.add_argument("--fail")
def main(args):
    if args.fail == "in-process" and "FAKE_VLLM_COMMAND" not in os.environ:
        raise RuntimeError("in-process failure")
    path = os.path.join(args.result_dir, args.result_filename)
    open(path, "w").write(json.dumps({"how": os.environ.get("FAKE_VLLM_COMMAND", "in-process")}))
'''
FAKE_CLI = '''
import argparse, os, sys
os.environ["FAKE_VLLM_COMMAND"] = "command"
from vllm.benchmarks.serve import add_cli_args, main
p = argparse.ArgumentParser(); add_cli_args(p)
assert sys.argv[1:3] == ["bench", "serve"]
main(p.parse_args(sys.argv[3:]))
'''


def test_peer_client_runs_every_level_in_one_process_and_falls_back_to_the_command(tmp_path):
    pkg = tmp_path / "site" / "vllm"
    for sub, text in (("", ""), ("benchmarks", ""), ("entrypoints", ""), ("entrypoints/cli", "")):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / "__init__.py").write_text(text)
    (pkg / "benchmarks" / "serve.py").write_text(textwrap.dedent(FAKE_VLLM))
    (pkg / "entrypoints" / "cli" / "main.py").write_text(textwrap.dedent(FAKE_CLI))
    levels = [["--result-dir", str(tmp_path), "--result-filename", f"l{i}.json"] + (["--fail", "in-process"]
                                                                                      if i == 1 else [])
              for i in range(3)]
    spec = tmp_path / "levels.json"
    spec.write_text(json.dumps(levels))
    src = Path(peer.__file__).resolve().parents[2]
    env = {"PYTHONPATH": f"{tmp_path / 'site'}:{src}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "spruce.bench.peer_client", str(spec)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    how = [json.loads((tmp_path / f"l{i}.json").read_text())["how"] for i in range(3)]
    assert how == ["in-process", "command", "command"]
    assert peer_client.__doc__


def test_context_leaves_room_for_prompts_that_encode_longer():
    """A random prompt re-encoded by the server can exceed --input-len tokens: both servers get room for twice it."""
    from spruce.bench.peer import build_parser, context_length

    args = build_parser().parse_args(["--out", "x.json", "--input-len", "512", "--output-len", "256"])
    assert context_length(args) >= 2 * 512 + 256
    assert context_length(args) % 64 == 0


# --- the adaptive A/B: spruce-plain, spruce (fixed), spruce-adaptive, spruce-control at several lengths ----------
AB = ("--mode", "eagle3", "--engines", "spruce-plain,spruce,spruce-adaptive,spruce-control",
      "--synthetic-length", "1.5,4.5", "--control-lengths", "4.5", "--concurrency", "1,16,64",
      "--input-len", "256", "--output-len", "128")
AB_TOK_S = {"spruce-plain": 100.0, "spruce@1.5": 80.0, "spruce@4.5": 150.0, "spruce-adaptive@1.5": 97.0,
            "spruce-adaptive@4.5": 140.0, "spruce-control@4.5": 147.0}


def test_the_ab_runs_plain_once_and_each_drafting_engine_per_length(tmp_path, shape):
    args = peer.build_parser().parse_args(["--out", str(tmp_path / "ab.json"), *AB])
    peer.check_args(args)
    assert [(r.engine, r.length, r.name) for r in peer.engine_runs(args)] == [
        ("spruce-plain", None, "spruce-plain"), ("spruce", 1.5, "spruce@1.5"), ("spruce", 4.5, "spruce@4.5"),
        ("spruce-adaptive", 1.5, "spruce-adaptive@1.5"), ("spruce-adaptive", 4.5, "spruce-adaptive@4.5"),
        ("spruce-control", 4.5, "spruce-control@4.5")]
    fixed = peer.server_command("spruce", args, shape, 8000, 4.5)
    assert option(fixed, "--speculative-synthetic-acceptance-length") == "4.5"
    assert peer.server_command("spruce-adaptive", args, shape, 8000, 4.5) == fixed + ["--speculative-adaptive"]
    assert peer.server_command("spruce-control", args, shape, 8000, 4.5) == fixed
    plain = peer.server_command("spruce-plain", args, shape, 8000)
    assert not any(a.startswith("--speculative") for a in plain)
    assert plain == fixed[:fixed.index("--speculative-algorithm")]
    from spruce.cli import build_parser

    served = build_parser().parse_args(peer.server_command("spruce-adaptive", args, shape, 8000, 1.5)[3:])
    assert served.speculative_adaptive and served.speculative_synthetic_acceptance_length == 1.5
    tree = peer.build_parser().parse_args(["--out", "x", *AB, "--spruce-tree", "4,2,6"])
    adaptive = peer.server_command("spruce-adaptive", tree, shape, 8000, 4.5)
    assert [option(adaptive, f"--speculative-{f}") for f in ("num-steps", "eagle-topk", "num-draft-tokens")] == \
        ["4", "2", "6"]
    single = parse("--mode", "eagle3", "--synthetic-length", "2.5", tmp=tmp_path)  # one length: names as they were
    assert [r.name for r in peer.engine_runs(single)] == ["vllm", "spruce", "spruce-control"]


@pytest.mark.parametrize("argv, words", [
    (["--engines", "spruce-adaptive"], "needs --mode eagle3"),
    (["--mode", "eagle3", "--synthetic-length", "1.5,7"], "--synthetic-length 7 must be in [1, steps + 1 = 6]"),
    (["--mode", "eagle3", "--synthetic-length", "1.5,4.5", "--spruce-tree", "3,2,4"], "tree 3,2,4"),
    (["--mode", "eagle3", "--synthetic-length", "1.5,4.5", "--control-lengths", "3"], "[3.0] are not among"),
    (["--mode", "eagle3", "--target-dir", "t"], "--target-dir and --draft-dir go together"),
    (["--control-lengths", "3"], "--control-lengths (3.0,) needs --mode eagle3"),
])
def test_bad_ab_arguments_are_refused_naming_them(tmp_path, argv, words):
    with pytest.raises(SystemExit) as e:
        parse(*argv, tmp=tmp_path)
    assert words in str(e.value)


def test_repeated_lengths_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse("--mode", "eagle3", "--synthetic-length", "1.5,1.5", tmp=tmp_path)
    assert "distinct lengths" in capsys.readouterr().err


def ab_client(argvs, log):
    """`fake_client` for the A/B: output tok/s = AB_TOK_S[run] * concurrency."""
    for argv in argvs:
        prefix = option(argv, "--request-id-prefix")
        c = int(option(argv, "--max-concurrency"))
        saved = {"output_throughput": AB_TOK_S[prefix[:prefix.rindex("-c")]] * c, "median_tpot_ms": 5.0}
        Path(option(argv, "--result-dir"), option(argv, "--result-filename")).write_text(json.dumps(saved))
    return 0


def test_the_ab_json_gives_adaptive_over_the_better_of_plain_and_fixed(tmp_path, shape):
    args = peer.build_parser().parse_args(["--out", str(tmp_path / "ab.json"), *AB])
    h = hooks()
    h.run_client = ab_client
    result = peer.run(args, h, shape)
    assert json.loads(args.out.read_text()) == result
    assert result["engines"]["spruce@4.5"]["synthetic_length"] == 4.5
    assert result["engines"]["spruce-plain"]["synthetic_length"] is None
    assert result["synthetic_acceptance"]["chain_rates"]["1.5"] == [0.5, 0.0, 0.0, 0.0, 0.0]
    bar = result["adaptive_bar"]
    low, high = bar["points"]["1.5"]["16"], bar["points"]["4.5"]["64"]
    assert (low["plain"], low["fixed"], low["adaptive"]) == (1600.0, 1280.0, 1552.0)
    assert low["ratio"] == pytest.approx(0.97) and low["pass"] and low["control"] is None
    assert high["ratio"] == pytest.approx(140 / 150) and high["pass"] is False
    assert high["control_over_fixed"] == pytest.approx(0.98)
    assert bar["pass"] is False and bar["bar"] == 0.95
    assert set(result["ratios"]) == {"spruce-control@4.5/spruce@4.5"}  # the control against its own length
    assert result["estimate"]["servers"] == 6
    per_server = 60 + 2 * 128 * sum(w * result["roofline"][c]["step_ms_nominal"] for c, w in
                                    (("1", 6), ("16", 2), ("64", 2))) / 1e3 \
        + 2 * 16 * result["roofline"]["16"]["step_ms_nominal"] / 1e3
    assert result["estimate"]["seconds"] == round(6 * per_server)


def test_the_bar_fails_where_a_point_is_missing(tmp_path):
    engines = {"spruce-adaptive": {"engine": "spruce-adaptive", "synthetic_length": 2.0,
                                   "levels": {"1": {"output_tok_s": 10.0}}},
               "spruce": {"engine": "spruce", "synthetic_length": 2.0, "levels": {"1": {"output_tok_s": 10.0}}}}
    bar = peer.adaptive_bar(engines, (2.0,), (1, 4))
    assert bar["points"]["2"]["1"]["pass"] is True and bar["points"]["2"]["4"]["pass"] is None
    assert bar["pass"] is False
    assert peer.adaptive_bar({}, (2.0,), (1,))["pass"] is None


# --- spruce's own client ------------------------------------------------------------------------------------------
def test_the_spruce_client_reads_the_level_argv_and_writes_vllms_names(tmp_path, shape, monkeypatch):
    from spruce.bench import serving_client
    from spruce.bench.serving_client import RequestResult, Sent

    args = peer.build_parser().parse_args(["--out", str(tmp_path / "ab.json"), *AB])
    shape.target.mkdir()
    (shape.target / "config.json").write_text(json.dumps({"vocab_size": 50}))
    argv = peer.client_argv(args, shape, "spruce", 16, 8000, tmp_path)
    seen = {}

    async def fake_send(base_url, headers, model, prompts, concurrency, num_requests, sampling, pool, processes):
        seen.update(base_url=base_url, model=model, prompts=prompts, concurrency=concurrency, n=num_requests,
                    max_tokens=sampling.max_tokens, ignore_eos=not sampling.no_ignore_eos, processes=processes)
        ok = [RequestResult(ok=True, ttft=0.1, e2e=1.1, itls=[0.1] * 10, output_tokens=11) for _ in range(2)]
        return Sent(ok + [RequestResult(ok=False, error="HTTP 400")], None, 10.0, 11.2, 0.5)

    monkeypatch.setattr(serving_client, "send_level", fake_send)
    assert peer_client.run_spruce_level(argv) == 1  # one request failed
    saved = json.loads((tmp_path / peer.level_file("spruce", 16)).read_text())
    assert seen["base_url"] == "http://127.0.0.1:8000" and seen["model"] == peer.SERVED_NAME
    assert (seen["concurrency"], seen["n"], seen["max_tokens"], seen["ignore_eos"]) == (16, 32, 128, True)
    assert len(seen["prompts"]) == 32 and {len(p) for p in seen["prompts"]} == {256}
    assert max(max(p) for p in seen["prompts"]) < 50 and seen["processes"] == 1
    assert saved["output_throughput"] == pytest.approx(22 / 1.2) and saved["median_tpot_ms"] == pytest.approx(100)
    assert saved["median_ttft_ms"] == pytest.approx(100) and saved["median_itl_ms"] == pytest.approx(100)
    assert (saved["completed"], saved["failed"], saved["errors"]) == (2, 1, ["HTTP 400"])
    level = peer.level_result(saved)
    assert level["output_tok_s"] == pytest.approx(22 / 1.2) and level["duration_s"] == pytest.approx(1.2)
    assert peer_client.random_prompts(2, 3, 50, 0) == peer_client.random_prompts(2, 3, 50, 0)


def test_auto_picks_spruces_client_without_vllm(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert peer_client.chosen_client("auto") == "spruce" and peer_client.chosen_client("vllm") == "vllm"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert peer_client.chosen_client("auto") == "vllm"
    assert peer_client.parse_cli(["l.json", "--client", "spruce"]).client == "spruce"
