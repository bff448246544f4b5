"""spruce's decoder equals transformers' on the same checkpoint (float32), for every supported variant.

Models run on a hand-driven paged cache (tests/checkpoints.PagedCache: shuffled pages, page_size 4) with the
torch attention backend: a prefill batch of prompts of different lengths (one of them chunked across two
forwards), then a decode step reading the cache; every logit row is compared with transformers' full forward.
"""

from __future__ import annotations

import json

import pytest
import torch

from spruce.attention.backend import create_backend
from spruce.models.hf_config import ModelConfig
from spruce.models.loader import load_target
from spruce.models.rope import inv_frequencies
from checkpoints import PagedCache, write_llama_checkpoint

transformers = pytest.importorskip("transformers")

TOL = 1e-4
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)
VARIANTS = [
    dict(variant="llama"),
    dict(variant="llama", tie=True, sharded=True),
    dict(variant="llama", rope_style="rope_parameters", rope_scaling=LLAMA3),
    dict(variant="llama", rope_style="rope_theta", rope_scaling=LLAMA3),
    dict(variant="llama", rope_scaling=dict(rope_type="linear", factor=2.0)),
    dict(variant="llama", attention_bias=True),
    dict(variant="llama", rope_style="rope_parameters",
         rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
    dict(variant="mistral"),
    dict(variant="qwen2", sharded=True),
    dict(variant="qwen3", tie=True, head_dim=32),
    dict(variant="qwen3", rope_style="rope_parameters"),
]


def load(path, aux_layers=(), page_size: int = 4):
    backend = create_backend("torch", page_size)
    return load_target(path, torch.float32, torch.device("cpu"), backend, aux_layers=aux_layers)


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def run_paged(model, prompts: list[list[int]]):
    """Prefill every prompt (the last one in two chunks), then decode one greedy token per prompt.

    Returns (prefill logits per prompt [len, V], next tokens, decode logits [n, V])."""
    cache = PagedCache.for_model(model, page_size=model.layers[0].self_attn.backend.page_size, rows=len(prompts))
    rows = [cache.add_row(len(p) + 1) for p in prompts]
    half = len(prompts[-1]) // 2

    def logits_of(batch):
        hidden, _ = model(batch, cache.kv, cache.table)
        return model.compute_logits(hidden)

    first = logits_of(cache.batch(rows, [0] * len(rows), prompts[:-1] + [prompts[-1][:half]]))
    second = logits_of(cache.batch(rows[-1:], [half], [prompts[-1][half:]]))
    out, start = [], 0
    for p in prompts[:-1]:
        out.append(first[start:start + len(p)])
        start += len(p)
    out.append(torch.cat([first[start:], second]))
    nxt = [int(o[-1].argmax()) for o in out]
    dec = logits_of(cache.batch(rows, [len(p) for p in prompts], [[t] for t in nxt]))
    return out, nxt, dec


def max_diff_vs_hf(hf, prompts, ours, nxt, dec) -> float:
    worst = 0.0
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = hf(torch.tensor([p + [nxt[i]]])).logits[0]  # [len + 1, V]
            worst = max(worst, (ours[i] - ref[:-1]).abs().max().item(), (dec[i] - ref[-1]).abs().max().item())
    return worst


def logit_diff_vs_hf(path) -> float:
    """Max abs logit difference, spruce vs transformers, over a chunked prefill of three random prompts and
    one decode step (the prompts' lengths 5, 17, 70)."""
    model = load(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 70)]
    with torch.no_grad():
        ours, nxt, dec = run_paged(model, prompts)
    return max_diff_vs_hf(hf_model(path), prompts, ours, nxt, dec)


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items())[:60])
def test_logits_equal_transformers(tmp_path, spec):
    worst = logit_diff_vs_hf(write_llama_checkpoint(tmp_path / "m", **spec))
    print(f"{spec}: max abs logit diff {worst:.2e}")
    assert worst < TOL


def test_aux_hidden_states_equal_transformers(tmp_path):
    """aux = inputs of the chosen layers (0 = embeddings, L = last layer's output); hidden = final-normed."""
    path = write_llama_checkpoint(tmp_path / "m", layers=5)
    model = load(path, aux_layers=(0, 2, 4))
    prompt = list(range(3, 40))
    cache = PagedCache.for_model(model)
    row = cache.add_row(len(prompt))
    with torch.no_grad():
        hidden, aux = model(cache.batch([row], [0], [prompt]), cache.kv, cache.table)
        ref = hf_model(path)(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    h = model.config.hidden_size
    assert aux.shape == (len(prompt), 3 * h)
    for j, layer in enumerate((0, 2, 4)):
        assert (aux[:, j * h:(j + 1) * h] - ref[layer][0]).abs().max().item() < TOL
    assert (hidden - ref[-1][0]).abs().max().item() < TOL


def test_empty_batch(tmp_path):
    path = write_llama_checkpoint(tmp_path / "m", layers=5)
    model = load(path, aux_layers=(2, 3))
    cache = PagedCache.for_model(model)
    with torch.no_grad():
        hidden, aux = model(cache.batch([], [], []), cache.kv, cache.table)
        assert model.compute_logits(hidden).shape == (0, model.config.vocab_size)
    assert hidden.shape == (0, 64) and aux.shape == (0, 128)


@pytest.mark.parametrize("scaling", [None, LLAMA3, dict(rope_type="linear", factor=4.0),
                                     dict(LLAMA3, original_max_position_embeddings=8192, factor=32.0)])
def test_inv_frequencies_equal_transformers(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128, max_position_embeddings=1024)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0, **(scaling or {})}
    if scaling is None:
        ref = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, torch.device("cpu"))
    assert torch.equal(inv_frequencies(128, 500000.0, scaling), ref)


def test_config_reads_both_rope_styles_and_merges_eos(tmp_path):
    a = write_llama_checkpoint(tmp_path / "a", rope_style="rope_theta", rope_scaling=LLAMA3, head_dim=32)
    b = write_llama_checkpoint(tmp_path / "b", rope_style="rope_parameters", rope_scaling=LLAMA3, head_dim=32)
    raw_a, raw_b = (json.loads((p / "config.json").read_text()) for p in (a, b))
    assert "rope_scaling" in raw_a and "rope_parameters" not in raw_a and "rope_parameters" in raw_b
    ca, cb = ModelConfig.from_dir(a), ModelConfig.from_dir(b)
    assert ca == cb
    assert ca.rope_scaling["rope_type"] == "llama3" and ca.rope_theta == 10000.0 and ca.head_dim == 32
    (a / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7, 9]}))
    assert ModelConfig.from_dir(a).eos_token_ids == (1, 7, 9)


def test_pycode19m_logits_equal_transformers(pycode19m, heldout_prompts):
    from spruce.models.tokenizer import Tokenizer

    model = load(pycode19m, page_size=16)
    tok = Tokenizer.from_dir(pycode19m, model.config)
    prompts = [tok.encode(t)[:n] for t, n in zip(heldout_prompts, (200, 9, 64))]
    with torch.no_grad():
        ours, nxt, dec = run_paged(model, prompts)
    worst = max_diff_vs_hf(hf_model(pycode19m), prompts, ours, nxt, dec)
    print(f"pycode-19m: max abs logit diff {worst:.2e}")
    assert worst < TOL
