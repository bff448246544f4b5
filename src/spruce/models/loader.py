"""Load targets and drafts from local Hugging Face directories (single-file or sharded safetensors).

Models are constructed directly on the target device in the target dtype, then filled one checkpoint tensor
at a time (each read from a memory-mapped file), so peak memory is the model plus one tensor.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from spruce.models.checkpoint_files import checkpoint_names, iter_tensor_slices, iter_tensors
from spruce.models.hf_config import ModelConfig
from spruce.models.quantization import finish_fp8_load, fp8_scheme, quantize_model


def _build(module_fn, dtype: torch.dtype, device: torch.device):
    """Construct directly on `device` with `dtype` as the default float dtype (no float32 detour), skipping
    torch's default initialisation of Linear and Embedding weights: every parameter is then written by the
    checkpoint (load_named_tensors refuses a checkpoint that lacks one) or by dummy_init_ (load_format='dummy'),
    and a parameter a checkpoint may leave out is set explicitly where it is built (EagleDraft's fc.bias)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), _without_default_init():
            return module_fn()
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def _without_default_init():
    """nn.Linear / nn.Embedding construct with their storage uninitialised (their reset_parameters skipped)."""
    saved = {cls: cls.reset_parameters for cls in (torch.nn.Linear, torch.nn.Embedding)}
    for cls in saved:
        cls.reset_parameters = lambda self: None
    try:
        yield
    finally:
        for cls, reset in saved.items():
            cls.reset_parameters = reset


DUMMY_WEIGHT_RANGE = 1e-3


def dummy_init_(module: torch.nn.Module, seed: int = 0) -> None:
    """load_format='dummy' (speed, not values): every floating parameter uniform in [-1e-3, 1e-3], seeded, as vLLM
    fills its dummy weights, so that spruce and a vLLM server beside it run alike; e.g. an n-gram draft finds its
    matches in the outputs, which such weights make repetitive, and a MoE router's choices come from them."""
    g = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point():
                p.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=g)


def load_target(path, dtype: torch.dtype, device: torch.device, backend, aux_layers: tuple[int, ...] = (),
                show_progress: bool = False, load_format: str = "auto", tp=None, quantization: str | None = None,
                desc: str = "loading target"):
    """The target (its class from the model registry) with weights from `path` (random with load_format='dummy').

    aux_layers: input indices of the layers whose residual stream forward() also returns (EAGLE-3).
    tp: a tensor-parallel group; the model is then this rank's slice, read straight from the files.
    quantization: None, or "fp8" to quantize a bf16 checkpoint at load; an FP8 checkpoint loads as FP8 either
    way (models/quantization.py). `desc`: the progress bar's label."""
    from spruce.models.registry import target_class

    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    scheme = fp8_scheme(path, quantization)
    model_class = target_class(cfg)
    model = _build(lambda: model_class(cfg, backend, aux_layers, tp=tp), dtype, device)
    if load_format == "dummy":
        dummy_init_(model)
    else:
        reader = iter_tensors if tp is None else iter_tensor_slices
        _set_checkpoint_scheme(model, scheme)
        with torch.no_grad():
            model.load_weights(reader(path, show_progress, desc))
            _finish_quantization(model, scheme, cfg, dtype)
    if load_format == "dummy" and scheme is not None:  # random FP8 weights in the checkpoint's layout
        with torch.no_grad():
            quantize_model(model, scheme.group_k)
    model.weight_format = scheme.describe() if scheme is not None else str(dtype).removeprefix("torch.")
    return model.eval().requires_grad_(False)


def _set_checkpoint_scheme(model, scheme) -> None:
    """An FP8 checkpoint's layout, read by load_named_tensors while the tensors stream in."""
    if scheme is not None and not scheme.at_load:
        model.fp8_scheme = scheme


def _finish_quantization(model, scheme, cfg: ModelConfig, dtype: torch.dtype) -> None:
    """After the weights load: an FP8 checkpoint's MLA fix-ups, or the load-time quantization of a bf16 one."""
    if scheme is None:
        return
    if scheme.at_load:
        quantize_model(model)
    else:
        finish_fp8_load(model, cfg, dtype)



def draft_aux_layers(spec, target_config: ModelConfig) -> tuple[int, ...]:
    """Target layers whose residual stream the draft reads (EAGLE-3's aux features; none for EAGLE, MTP and a
    draft LM)."""
    if spec.algorithm in ("NEXTN", "STANDALONE"):
        return ()
    from spruce.models.eagle import DraftConfig

    return DraftConfig.from_dir(spec.draft_model, target_config).target_aux_layers


def load_draft(spec, target_model, target_config: ModelConfig, dtype: torch.dtype, device: torch.device, backend,
               show_progress: bool = False, load_format: str = "auto"):
    """The draft `spec` (a SpeculativeConfig) names: MTP layers for NEXTN, a causal LM for STANDALONE, else an EAGLE
    or EAGLE-3 head."""
    if spec.algorithm == "NEXTN":
        return load_mtp_draft(spec.draft_model, target_config, dtype, device, backend, show_progress, load_format)
    if spec.algorithm == "STANDALONE":
        return load_standalone_draft(spec.draft_model, target_config, dtype, device, backend, show_progress,
                                     load_format)
    return load_eagle_draft(spec.draft_model, target_model, target_config, dtype, device, backend, show_progress,
                            load_format)


def load_mtp_draft(path, target_config: ModelConfig, dtype: torch.dtype, device: torch.device, backend,
                   show_progress: bool = False, load_format: str = "auto"):
    """The MTP layers stored in the checkpoint at `path` (the target's own, or trained for it)."""
    from spruce.models.mtp import MTPDraft, mtp_layout

    cfg, n, first = mtp_layout(path, target_config)
    model = _build(lambda: MTPDraft(cfg, backend, n, first), dtype, device)
    if load_format == "dummy":
        dummy_init_(model, seed=1)
    else:
        scheme = fp8_scheme(path, None)  # the draft runs as stored: FP8 MTP layers of an FP8 checkpoint
        _set_checkpoint_scheme(model, scheme)
        with torch.no_grad():
            model.load_weights(iter_tensors(path, show_progress, "loading MTP layers"), str(path))
            _finish_quantization(model, scheme, cfg, dtype)
    return model.eval().requires_grad_(False)


def load_standalone_draft(path, target_config: ModelConfig, dtype: torch.dtype, device: torch.device, backend,
                          show_progress: bool = False, load_format: str = "auto"):
    """A separate causal LM with the target's vocabulary (models/standalone.py), whole on every tensor-parallel
    rank; ConfigError if its vocabulary differs."""
    from spruce.models.standalone import StandaloneDraft, check_same_vocabulary

    check_same_vocabulary(ModelConfig.from_dir(path), target_config, path)
    model = load_target(path, dtype, device, backend, show_progress=show_progress, load_format=load_format,
                        desc="loading draft")
    return StandaloneDraft(model).eval().requires_grad_(False)


def load_eagle_draft(path, target_model, target_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                     backend, show_progress: bool = False, load_format: str = "auto"):
    """An EAGLE or EAGLE-3 head; its embedding (and lm_head, where allowed) come from the target if absent."""
    from spruce.models.eagle import DraftConfig, EagleDraft

    path = Path(path)
    cfg = DraftConfig.from_dir(path, target_config)
    if load_format == "dummy":
        own_embed = cfg.layer.hidden_size != target_config.hidden_size
        model = _build(lambda: EagleDraft(cfg, backend, own_embed=own_embed, own_lm_head=cfg.eagle3), dtype, device)
        dummy_init_(model, seed=1)
    else:
        names = {n.removeprefix("model.") for n in checkpoint_names(path)}
        own_embed = "embed_tokens.weight" in names
        own_lm_head = "lm_head.weight" in names or cfg.draft_vocab_size != target_config.vocab_size
        model = _build(lambda: EagleDraft(cfg, backend, own_embed=own_embed, own_lm_head=own_lm_head), dtype, device)
        with torch.no_grad():
            model.load_weights(iter_tensors(path, show_progress, "loading draft"))
    model.use_target_weights(target_model)
    return model.eval().requires_grad_(False)
