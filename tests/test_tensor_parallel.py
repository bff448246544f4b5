"""Tensor parallelism on the CPU (gloo, 2 processes: this one and one spawned worker): tp_size=2 gives the
same tokens as tp_size=1 in float32, greedy and seeded sampling in one batch, for plain decoding and EAGLE-3
tree speculation (K=4, page 16; an oracle on every rank so every accept length runs) on pycode-19m (Llama)
and for plain decoding and NEXTN (its own MTP layer) on pycode-mla (MLA + MoE). A worker that fails takes
the driver down with its error, and ranks that diverge are caught by the always-on state check.

Each tp_size=2 engine costs a process start (kept to one per configuration, few short prompts)."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import pytest
import torch

from spruce import LLM, SamplingParams
from spruce.config import EngineConfig, make_speculative_config
from spruce.runtime.launch import create_engine
from spruce.errors import ConfigError, InvariantError, WorkerFailedError
from spruce.speculative.registry import make_strategy
from checkpoints import python_source_prompts, write_eagle3_checkpoint
import tp_hooks

pytestmark = pytest.mark.slow  # scheduled first (conftest)

MAX_NEW = 20
PROMPT_TOKENS = [14, 22, 9]
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.8, top_p=0.95, seed=11)


def prompts_of(model: Path) -> list[list[int]]:
    """Held-out prompts cut to PROMPT_TOKENS tokens."""
    from spruce.models.hf_config import ModelConfig
    from spruce.models.tokenizer import Tokenizer

    model = Path(model)
    tok = Tokenizer.from_dir(model, ModelConfig.from_dir(model))
    held_out = model / "heldout_prompts.jsonl"  # the bundled demo model (fresh-clone twin) has none
    texts = ([json.loads(line)["text"] for line in held_out.read_text().splitlines()] if held_out.exists()
             else python_source_prompts())
    return [tok.encode(t)[:n] for t, n in zip(texts, PROMPT_TOKENS)]


def jobs(prompts):
    """Every prompt greedy, and the first two sampled with a seed too: one mixed batch."""
    return prompts + prompts[:2], [GREEDY] * len(prompts) + [SEEDED] * 2


def run(llm, prompts, params) -> tuple[list[list[int]], list[dict]]:
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], [o.spec_stats for o in outs]


def run_tp2(config: EngineConfig, prompts, params, rank_setup=None):
    llm = LLM.from_engine(create_engine(config, rank_setup, make_strategy=make_strategy))
    try:
        result = run(llm, prompts, params)
        llm.engine.check_no_leaks()
        return result
    finally:
        llm.shutdown()


def config(model, tp_size=1, **kw) -> EngineConfig:
    return EngineConfig(model=str(model), page_size=16, max_running_requests=4, tp_size=tp_size, **kw)


def spec(algorithm, draft, model, s, k, n):
    return make_speculative_config(algorithm, None if draft is None else str(draft), s, k, n, model=str(model))


def test_llama_plain_tp2_equals_tp1(pycode19m):
    """Plain decoding; then the other calls the driver forwards (scoring a sequence, flushing the cache)."""
    prompts, params = jobs(prompts_of(pycode19m))
    one = LLM.from_engine(create_engine(config(pycode19m), make_strategy=make_strategy))
    want, _ = run(one, prompts, params)
    sequence = prompts[0] + want[0]
    two = LLM.from_engine(create_engine(config(pycode19m, tp_size=2), make_strategy=make_strategy))
    try:
        got, _ = run(two, prompts, params)
        logits = two.engine.next_token_logits(sequence, first=len(prompts[0]))
        flushed = two.engine.flush_cache()
        two.engine.check_no_leaks()
    finally:
        two.shutdown()
    assert got == want
    assert got[0] != got[len(PROMPT_TOKENS)]  # the seeded run sampled (not the greedy text)
    torch.testing.assert_close(logits, one.engine.next_token_logits(sequence, first=len(prompts[0])),
                               rtol=1e-4, atol=1e-4)
    assert flushed == one.engine.flush_cache() > 0


def test_sharded_load_reads_only_the_ranks_part(tmp_path):
    """A split parameter takes its rank's rows / columns straight from the file (get_slice), never the whole."""
    from safetensors.torch import save_file

    from spruce.distributed.group import TPGroup
    from spruce.distributed.layers import RowParallelLinear, column_parallel_linear
    from spruce.models.loader import iter_tensor_slices
    from spruce.models.weights import load_named_tensors

    full = {"col.weight": torch.arange(48.0).view(8, 6), "row.weight": torch.arange(48.0).view(6, 8)}
    save_file(full, str(tmp_path / "model.safetensors"))
    rank1 = TPGroup(rank=1, size=2, device=torch.device("cpu"), device_group=None, control_group=None)
    module = torch.nn.Module()
    module.col = column_parallel_linear(6, 8, rank1, "columns")
    module.row = RowParallelLinear(8, 6, rank1, "rows")
    boxes = []

    def recorded(items):
        for name, part in items:
            read = part._read_box
            part._read_box = lambda box, read=read, name=name: boxes.append((name, box)) or read(box)
            yield name, part

    with torch.no_grad():
        load_named_tensors(module, recorded(iter_tensor_slices(tmp_path)))
    assert sorted(boxes) == [("col.weight", (slice(4, 8),)), ("row.weight", (slice(None), slice(4, 8)))]
    assert torch.equal(module.col.weight, full["col.weight"][4:])
    assert torch.equal(module.row.weight, full["row.weight"][:, 4:])


def test_llama_eagle3_tree_tp2_equals_tp1(pycode19m, tmp_path):
    """EAGLE-3, K=4 S=3 N=8, page 16: same tokens and same accept lengths, request by request."""
    draft = write_eagle3_checkpoint(tmp_path / "eagle3", pycode19m, seed=3)  # every token draftable
    base = prompts_of(pycode19m)
    reference = run(LLM(str(pycode19m), page_size=16, max_running_requests=4), base, GREEDY)[0]
    setup = functools.partial(tp_hooks.install_oracle, fraction=0.8, references=list(zip(base, reference)))
    prompts, params = jobs(base)
    cfg = dict(speculative=spec("EAGLE3", draft, pycode19m, 3, 4, 8))
    want, want_stats = run(LLM.from_engine(create_engine(config(pycode19m, **cfg), setup, make_strategy=make_strategy)), prompts, params)
    got, got_stats = run_tp2(config(pycode19m, tp_size=2, **cfg), prompts, params, setup)
    assert got == want
    assert got[:len(base)] == reference
    assert got_stats == want_stats
    assert min(s["mean_accept_length"] for s in got_stats[:len(base)]) > 1.5  # the oracle steers greedy rows


@pytest.mark.parametrize("algorithm", [None, "NEXTN"])
def test_deepseek_mla_moe_tp2_equals_tp1(pycodemla, algorithm):
    """pycode-mla (MLA heads split, latent replicated; MoE experts cut by intermediate), plain and NEXTN (its
    trained MTP layer drafting a K=4 tree)."""
    prompts, params = jobs(prompts_of(pycodemla))
    cfg = {} if algorithm is None else dict(speculative=spec("NEXTN", None, pycodemla, 3, 4, 8))
    want, want_stats = run(LLM.from_engine(create_engine(config(pycodemla, **cfg), make_strategy=make_strategy)), prompts, params)
    got, got_stats = run_tp2(config(pycodemla, tp_size=2, **cfg), prompts, params)
    assert got == want
    assert got_stats == want_stats
    if algorithm is not None:
        assert min(s["mean_accept_length"] for s in got_stats[:len(PROMPT_TOKENS)]) > 1.5


def test_worker_failure_raises_naming_the_worker(pycode19m):
    """A worker failing mid-generation: the driver's call raises WorkerFailedError with the worker's error,
    promptly, and the engine refuses further calls."""
    llm = LLM.from_engine(create_engine(config(pycode19m, tp_size=2),
                                        functools.partial(tp_hooks.fail_at_step, victim=1, step=3),
                                        make_strategy=make_strategy))
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match=r"rank 1 .*exited with code 1: RuntimeError: injected failure"):
            llm.generate(prompts_of(pycode19m), GREEDY)
        assert time.monotonic() - t0 < 60
        with pytest.raises(WorkerFailedError, match="rank 1"):
            llm.generate([[5, 6, 7]], GREEDY)
    finally:
        llm.shutdown()


def test_diverging_ranks_are_caught(pycode19m):
    """A rank whose tokens differ (its logits skewed): the next call fails with the ranks' digests."""
    llm = LLM.from_engine(create_engine(config(pycode19m, tp_size=2),
                                        functools.partial(tp_hooks.skew_logits, victim=1, token=77),
                                        make_strategy=make_strategy))
    try:
        with pytest.raises(InvariantError, match="tensor-parallel ranks diverged .*rank 0: .*rank 1: "):
            llm.generate(prompts_of(pycode19m)[:1], GREEDY)
    finally:
        llm.shutdown()


def test_tp_size_must_divide_the_heads(pycode19m):
    """pycode-19m has 6 heads and 2 KV heads (the bundled model 4 and 2): tp_size=4 is refused, naming the field."""
    with pytest.raises(ConfigError, match=r"tp_size=4 does not divide (num_attention_heads=6, )?num_key_value_heads=2"):
        run_tp2(config(pycode19m, tp_size=4), [[1, 2]], GREEDY)


@pytest.mark.parametrize("kw, match", [
    (dict(tp_size=0), "tp_size must be an integer >= 1, got 0"),
    (dict(tp_size=2.0), "tp_size must be an integer >= 1"),
])
def test_bad_tp_size(kw, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(model="m", **kw)


def _descendant(pid: int, name: str) -> int:
    """The one process under `pid` (children, their children...) named `name` (/proc/PID/comm)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            comm = text[text.index("(") + 1:text.rindex(")")]
            ppid = int(text.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append((int(stat.parent.name), comm))
    found, todo = [], [pid]
    while todo:
        for child, comm in children.get(todo.pop(), []):
            todo.append(child)
            if comm == name:
                found.append(child)
    (one,) = found
    return one


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "engine-thread"])
def test_server_exits_when_a_worker_dies(tmp_path, engine_process):
    """`spruce serve --tp-size 2`: killing the worker ends the server with an error naming it. With the engine in
    its own process (the default) that process started the worker: its death ends the engine process, and the
    server fails every request and exits 70 (DESIGN §20, §21); with --disable-engine-process it ends the server
    itself (exit 1)."""
    import os
    import signal

    import httpx
    from server_util import ServeProcess

    flags = [] if engine_process else ["--disable-engine-process"]
    server = ServeProcess(tmp_path / "serve.log", "--tp-size", "2", "--device", "cpu", *flags).start(120)
    try:
        reply = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                           json={"model": "pycode-6m", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        worker = _descendant(server.proc.pid, "spruce-tp-rank1")
        os.kill(worker, signal.SIGKILL)
        assert server.wait(30) == (70 if engine_process else 1)
        assert f"tensor-parallel worker rank 1 (pid {worker}) exited with code -9" in server.log()
        if engine_process:
            assert "the engine process exited with code 1" in server.log()
    finally:
        server.kill()


def test_a_worker_exits_when_its_driver_dies():
    """A driver killed without shutting down (no atexit, no goodbye) leaves no worker behind: the worker's wait
    for the driver's next command fails, and it watches its parent, the fork server, which exits with the driver
    (runtime/launch.py `_watch_parent`)."""
    import os
    import subprocess
    import sys

    driver = subprocess.Popen(
        [sys.executable, "-c", "import os, sys\nfrom spruce import LLM\nfrom spruce.config import builtin_model_path\n"
         "llm = LLM(str(builtin_model_path()), tp_size=2, device='cpu')\nprint('ready', flush=True)\n"
         "sys.stdin.readline()\nos._exit(3)\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "ready"
        worker = _descendant(driver.pid, "spruce-tp-rank1")
        driver.stdin.write("\n")
        driver.stdin.flush()
        assert driver.wait(30) == 3
        deadline = time.monotonic() + 15
        while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not Path(f"/proc/{worker}").exists(), f"worker {worker} outlived its driver"
    finally:
        driver.kill()
