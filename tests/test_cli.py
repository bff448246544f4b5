"""The `spruce` command line: clean one-line errors for impossible settings, --version, and help that answers
at once (building the parser imports no torch)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import PackageNotFoundError, version

import pytest
import torch

import spruce
from spruce.cli import main
from spruce.config import EngineConfig, builtin_model_path
from spruce.errors import ConfigError

MODEL = str(builtin_model_path())
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """main(argv) -> (exit code, stdout, stderr); argparse exits become exit codes."""
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("flags,named", [
    (["--speculative-num-steps", "3"], "--speculative-num-steps"),
    (["--speculative-algorithm", "EAGLE3"], "--speculative-algorithm"),
    (["--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"],
     "--speculative-eagle-topk, --speculative-num-draft-tokens"),
    (["--speculative-adaptive"], "--speculative-adaptive"),
])
def test_speculative_flags_without_draft_are_refused(capsys, flags, named):
    """With --model and no --speculative-draft-model-path, speculation flags are an error, not plain decoding."""
    rc, out, err = run_cli(capsys, "generate", "--model", MODEL, "--prompt", "def f", *flags)
    assert rc == 2 and out == ""
    assert err.startswith(f"spruce: error: {named} given without a draft model")
    assert "--speculative-draft-model-path" in err and len(err.strip().splitlines()) == 1


def test_speculative_flags_conflict_with_disable_speculative(capsys):
    rc, _, err = run_cli(capsys, "generate", "--prompt", "def f", "--disable-speculative",
                         "--speculative-num-steps", "3")
    assert rc == 2 and "--speculative-num-steps conflicts with --disable-speculative" in err


@NO_CUDA
def test_cuda_device_without_cuda_is_a_one_line_error(capsys):
    rc, out, err = run_cli(capsys, "generate", "--device", "cuda", "--prompt", "def f", "--max-tokens", "2")
    assert rc == 2 and out == ""
    assert err.startswith("spruce: error: device='cuda' is not available") and "available: 'cpu'" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@NO_CUDA
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_config_refuses_a_missing_cuda_device(device):
    with pytest.raises(ConfigError, match=rf"device='{device}' is not available.*available: 'cpu'$"):
        EngineConfig(model="m", device=device)


def test_config_refuses_a_malformed_device():
    with pytest.raises(ConfigError, match="device='cudax' is not supported"):
        EngineConfig(model="m", device="cudax")


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    """LLM(attention_backend='triton') on CPU is refused when built, not at its first generate."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="attention_backend='triton' needs a CUDA device, got device='cpu'"):
        EngineConfig(model="m", attention_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert EngineConfig(model="m", attention_backend="triton").resolved_attention_backend == "triton"


def test_version(capsys):
    rc, out, _ = run_cli(capsys, "--version")
    assert rc == 0 and out.strip() == f"spruce {spruce.__version__}"
    try:
        assert spruce.__version__ == version("spruce")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed (the GPU runs)
        assert spruce.__version__ == "0+source"


HELP_IMPORTS = textwrap.dedent("""
    import contextlib, io, sys
    from spruce.cli import main

    for argv in (["--help"], ["--version"], ["generate", "--help"], ["serve", "--help"], ["bench", "--help"],
                 ["train-draft", "--help"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                main(argv)
            except SystemExit as e:
                assert e.code == 0, (argv, e.code)
        assert "usage: spruce" in out.getvalue() or argv == ["--version"], argv
    heavy = {"torch", "triton", "transformers", "fastapi", "uvicorn", "httpx", "safetensors", "tokenizers"}
    print(sorted(heavy & set(sys.modules)))
""")


def test_help_and_version_import_nothing_heavy():
    """`spruce --help`, `--version` and every subcommand's `--help` answer without importing torch."""
    run = subprocess.run([sys.executable, "-c", HELP_IMPORTS], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]"


@pytest.mark.parametrize("argv,flag", [(["bench", "latency", "--help"], "--model-shape"),
                                       (["bench", "serving", "--help"], "--base-url"),
                                       (["bench", "peer", "--help"], "--synthetic-length"),
                                       (["bench", "moe", "--help"], "--tokens"),
                                       (["bench", "fp8", "--help"], "--kv-context")])
def test_bench_subcommands_register_their_flags_when_chosen(capsys, argv, flag):
    rc, out, _ = run_cli(capsys, *argv)
    assert rc == 0 and flag in out


def test_engine_flags_reach_the_engine_config():
    """--disable-radix-cache and --speculative-algorithm NEXTN (no draft path: the model's own MTP layers) are
    passed on, not dropped."""
    from spruce.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["generate", "--model", MODEL, "--prompt", "x", "--disable-radix-cache",
                                      "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2"])
    kw = engine_kwargs(args)
    assert kw["disable_radix_cache"] is True
    assert (kw["draft_model"], kw["speculative_algorithm"], kw["speculative_num_steps"]) == (None, "NEXTN", 2)
    plain = engine_kwargs(build_parser().parse_args(["generate", "--model", MODEL, "--prompt", "x"]))
    assert plain["disable_radix_cache"] is False and plain["speculative_algorithm"] is None
    assert plain["speculative_adaptive"] is False and kw["speculative_adaptive"] is False
    adaptive = engine_kwargs(build_parser().parse_args(["serve", "--speculative-adaptive"]))  # the bundled head
    assert adaptive["speculative_adaptive"] is True and adaptive["draft_model"] is not None
    assert plain["tp_size"] == 1 and plain["scheduler_delay_factor"] == 0.0
    delayed = build_parser().parse_args(["serve", "--model", MODEL, "--scheduler-delay-factor", "4"])
    assert engine_kwargs(delayed)["scheduler_delay_factor"] == 4.0
    for flag in ("--tp-size", "--tensor-parallel-size"):
        served = build_parser().parse_args(["serve", "--model", MODEL, flag, "2"])
        assert engine_kwargs(served)["tp_size"] == 2
