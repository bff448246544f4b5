"""What train-draft writes: the draft in its published format, and the resumable trainer state.

--draft-arch eagle3:
<out>/config.json          LlamaForCausalLMEagle3 config (SGLang / vLLM / spruce read it)
<out>/model.safetensors    fc, midlayer.*, norm, lm_head (bf16 by default), d2t (int64), t2d (bool);
                           no embed_tokens: the target's is shared, as SGLang does
--draft-arch mtp (DeepSeek's layout, what speculative_algorithm="NEXTN" reads with draft_model=<out>):
<out>/config.json          the target's config.json plus "num_nextn_predict_layers": 1 (architectures unchanged)
<out>/model-mtp.safetensors model.layers.{L}.* (L = the target's num_hidden_layers): embed_tokens, enorm, hnorm,
                           eh_proj, the decoder layer's tensors, shared_head.norm / head (bf16 by default)
both:
<out>/trainer_state.pt     float32 weights, optimizer, step, training seconds, the run's settings
Files are written to a temporary name and renamed, so an interrupted save never leaves a torn file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from spruce.errors import SpruceError
from spruce.models.eagle import EAGLE3_ARCH
from spruce.models.hf_config import ModelConfig
from spruce.models.mtp import mtp_checkpoint_tensors
from spruce.train.head import Eagle3Head
from spruce.train.mtp_head import MTPHead

STATE_FILE = "trainer_state.pt"
# settings a resumed run must share with the saved one (they fix the head's shape or the data order)
RESUME_KEYS = ("draft_arch", "target_vocab_size", "target_hidden_size", "draft_vocab_size", "max_length",
               "batch_size", "ttt_length", "seed", "heldout_docs")
MTP_WEIGHTS = "model-mtp.safetensors"


def make_head(cfg: ModelConfig, num_aux: int, draft_vocab: int) -> Eagle3Head:
    """A head shaped like the target's layers (hidden, heads, intermediate), over a draft vocabulary."""
    return Eagle3Head(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.rms_norm_eps, cfg.hidden_size, num_aux, draft_vocab, cfg.vocab_size, cfg.rope_theta,
                      cfg.rope_scaling, cfg.max_position_embeddings)


def draft_config(cfg: ModelConfig, draft_vocab: int, dtype: str = "bfloat16") -> dict:
    """config.json of the published EAGLE-3 format for a head made by make_head (default aux layers)."""
    out = dict(architectures=[EAGLE3_ARCH], model_type="llama", hidden_size=cfg.hidden_size,
               intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.num_heads,
               num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, num_hidden_layers=1,
               hidden_act="silu", rms_norm_eps=cfg.rms_norm_eps, vocab_size=cfg.vocab_size,
               draft_vocab_size=draft_vocab, target_hidden_size=cfg.hidden_size,
               max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
               tie_word_embeddings=False, bias=False, torch_dtype=dtype)
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    return out


def _replace(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_checkpoint(head: Eagle3Head, cfg: ModelConfig, out: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json and model.safetensors (floating tensors cast to `dtype`)."""
    out.mkdir(parents=True, exist_ok=True)
    state = {name: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
             for name, t in head.state_dict().items()}
    _replace(out / "model.safetensors", lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    text = json.dumps(draft_config(cfg, head.lm_head.out_features, str(dtype).removeprefix("torch.")), indent=2)
    _replace(out / "config.json", lambda p: p.write_text(text + "\n"))


def save_mtp_checkpoint(head: MTPHead, target_dir, out: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json (the target's, with num_nextn_predict_layers = 1) and model-mtp.safetensors (the
    published names of `mtp_checkpoint_tensors`, floating tensors cast to `dtype`)."""
    out.mkdir(parents=True, exist_ok=True)
    state = {name: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
             for name, t in mtp_checkpoint_tensors(head.draft).items()}
    _replace(out / MTP_WEIGHTS, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    raw = json.loads((Path(target_dir) / "config.json").read_text())
    raw["num_nextn_predict_layers"] = head.draft.num_layers
    _replace(out / "config.json", lambda p: p.write_text(json.dumps(raw, indent=2) + "\n"))


def save_state(out: Path, head: Eagle3Head | MTPHead, opt: torch.optim.Optimizer, step: int, seconds: float,
               settings: dict) -> None:
    """The resumable state: float32 weights, optimizer moments, step, training seconds so far."""
    state = {"step": step, "seconds": seconds, "head": head.state_dict(), "optimizer": opt.state_dict(),
             "settings": settings}
    _replace(out / STATE_FILE, lambda p: torch.save(state, p))


def load_state(out: Path, head: Eagle3Head | MTPHead, opt: torch.optim.Optimizer,
               settings: dict) -> tuple[int, float]:
    """Restore head and optimizer from `out`; (step, seconds). SpruceError when the saved run's shape-defining
    settings differ from this one's (a state saved before draft_arch existed is an eagle3 one)."""
    state = torch.load(out / STATE_FILE, map_location=next(head.parameters()).device, weights_only=True)
    saved = {"draft_arch": "eagle3", **state["settings"]}
    for key in RESUME_KEYS:
        if saved.get(key) != settings.get(key):
            raise SpruceError(f"cannot resume {out}: it was trained with {key}={saved.get(key)!r}, "
                              f"this run asks for {settings.get(key)!r}")
    head.load_state_dict(state["head"])
    opt.load_state_dict(state["optimizer"])
    return int(state["step"]), float(state["seconds"])
