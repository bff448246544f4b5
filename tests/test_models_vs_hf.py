"""spruce's decoder equals transformers' on the same checkpoint (float32), for every supported variant."""

from __future__ import annotations

import pytest
import torch

from spruce.config import EngineConfig
from spruce.limits import Limits
from spruce.memory import KVPool, PageTable
from spruce.models.hf_config import ModelConfig
from spruce.models.loader import load_target
from spruce.attention.backend import create_backend
from spruce.runtime.batch_builder import BatchBuilder
from checkpoints import write_llama_checkpoint

transformers = pytest.importorskip("transformers")

LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)
VARIANTS = [
    dict(variant="llama"),
    dict(variant="llama", tie=True, sharded=True),
    dict(variant="llama", rope_style="rope_parameters", rope_scaling=LLAMA3_SCALING),
    dict(variant="llama", rope_style="rope_theta", rope_scaling=LLAMA3_SCALING),
    dict(variant="llama", rope_scaling=dict(rope_type="linear", factor=2.0)),
    dict(variant="mistral"),
    dict(variant="qwen2"),
    dict(variant="qwen3", tie=True),
]


class PagedModel:
    """A target model on a paged cache, driven by hand: prefill prompts, then decode tokens."""

    def __init__(self, path, page_size: int = 4, rows: int = 4):
        cfg = ModelConfig.from_dir(path)
        self.config = cfg
        ec = EngineConfig(model=str(path), page_size=page_size, max_running_requests=rows, max_total_tokens=2048)
        self.limits = Limits.derive(ec, cfg.max_position_embeddings, 1, None)
        backend = create_backend("torch", page_size)
        self.model = load_target(path, torch.float32, torch.device("cpu"), backend)
        self.table = PageTable(self.limits, torch.device("cpu"))
        self.kv = KVPool(self.limits, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 0, torch.float32,
                         torch.device("cpu"))
        self.builder = BatchBuilder(self.limits, self.table, torch.device("cpu"))
        self.next_page = 1

    def add_row(self, length: int) -> int:
        row = self.table.alloc_row()
        n = self.limits.pages_for(length)
        pages = list(range(self.next_page + n - 1, self.next_page - 1, -1))  # reversed: non-contiguous order
        self.next_page += n
        self.table.append_pages(row, pages)
        return row

    def prefill(self, rows, prompts) -> list[torch.Tensor]:
        batch = self.builder.extend(rows, [0] * len(rows), prompts)
        hidden, _ = self.model(batch, self.kv, self.table.table)
        logits = self.model.compute_logits(hidden)
        out, start = [], 0
        for p in prompts:
            out.append(logits[start:start + len(p)])
            start += len(p)
        return out

    def decode(self, rows, positions, tokens) -> torch.Tensor:
        t = torch.tensor
        batch = self.builder.decode(t(rows), t(positions), t(tokens), max(positions) + 1)
        hidden, _ = self.model(batch, self.kv, self.table.table)
        return self.model.compute_logits(hidden)


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items())[:60])
def test_logits_equal_transformers(tmp_path, spec):
    path = write_llama_checkpoint(tmp_path / "m", **spec)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    m = PagedModel(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, m.config.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 70)]
    rows = [m.add_row(len(p) + 2) for p in prompts]
    ours = m.prefill(rows, prompts)
    nxt = [int(o[-1].argmax()) for o in ours]
    dec = m.decode(rows, [len(p) for p in prompts], nxt)
    worst = 0.0
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = hf(torch.tensor([p + [nxt[i]]])).logits[0]
            worst = max(worst, (ours[i] - ref[:-1]).abs().max().item(), (dec[i] - ref[-1]).abs().max().item())
    print(f"{spec}: max abs logit diff {worst:.2e}")
    assert worst < 2e-4


def test_pycode19m_logits_equal_transformers(pycode19m, heldout_prompts):
    from spruce.models.tokenizer import Tokenizer

    hf = transformers.AutoModelForCausalLM.from_pretrained(pycode19m, dtype=torch.float32).eval()
    m = PagedModel(pycode19m, page_size=16)
    tok = Tokenizer.from_dir(pycode19m, m.config)
    prompts = [tok.encode(t)[:n] for t, n in zip(heldout_prompts, (200, 64, 9))]
    rows = [m.add_row(len(p)) for p in prompts]
    worst = 0.0
    with torch.no_grad():
        for logits, p in zip(m.prefill(rows, prompts), prompts):
            worst = max(worst, (logits - hf(torch.tensor([p])).logits[0]).abs().max().item())
    print(f"pycode-19m: max abs logit diff {worst:.2e}")
    assert worst < 2e-4
