"""FP8 weights in models: which checkpoints are FP8 and how (`Fp8Scheme`), the FP8 linear module, loading a
checkpoint's FP8 tensors and scales into spruce's fused parameters, and quantizing a bf16 model at load.

Supported `quantization_config`s (config.json):
    {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
        DeepSeek-V3/R1, Qwen3-FP8: `<m>.weight` float8_e4m3fn, `<m>.weight_scale_inv` [ceil(N/128), ceil(K/128)]
    {"quant_method": "fp8", "activation_scheme": "static" | "dynamic"} (no block size)
        per-tensor: `<m>.weight_scale` (one value), `<m>.input_scale` (static activations)
    {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {...}}
        every group 8-bit float weights, strategy "tensor" | "channel" | "block" (`block_structure`); input
        activations absent (weight-only), dynamic per token, or static per tensor (`input_scale`);
        `<m>.weight_scale` [N, 1] per channel, [1] or [] per tensor, [ceil(N/bn), ceil(K/bk)] per block
Which modules are FP8 is read from the tensors themselves (a module whose weight arrives as fp8, or whose scale
arrives, becomes FP8; `ignore` / `modules_to_not_convert` lists need no parsing). Dense linears, routed experts
and MLA projections may be FP8; MLA's kv_b_proj is dequantized after load (the absorbed attention multiplies by
its per-head slices), and the lm_head may not be.

Load-time quantization (`quantization="fp8"` on a bf16 / fp32 checkpoint): after the weights load, every linear
of the decoder layers (q/k/v, o, gate/up, down, MLA's projections but kv_b_proj; routed and shared experts) is
quantized per output channel (one scale per row: torch's scaled matmul with per-token activation scales on an
H100-class GPU); routers, norms, embeddings and the lm_head stay in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from spruce.errors import ModelLoadError
from spruce.ops.fp8 import (FP8_DTYPE, block_scale_rows, dequantize, fp8_linear, num_groups, quantize_blocks,
                            quantize_rows)
from spruce.ops.fp8_select import block_scales_t, choose

QUANTIZATIONS = ("fp8",)  # what `quantization=` accepts (vLLM's name)
CHECKPOINT_METHODS = ("fp8", "compressed-tensors")  # quant_method values whose FP8 checkpoints load
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")
_NEVER_FP8 = ("lm_head.weight", "shared_head.head.weight", "embed_tokens.weight")  # read as raw weights elsewhere


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's FP8 weights are laid out.

    group_k: K-group of the weight scales (128 for block checkpoints), None for one scale per row (per-channel,
    per-tensor); block_n: rows of a checkpoint scale block (None: the scale has one row per weight row or one
    value); at_load: the checkpoint is not FP8, the loaded model is quantized per channel."""

    method: str
    group_k: int | None = None
    block_n: int | None = None
    at_load: bool = False

    def describe(self) -> str:
        if self.at_load:
            return "fp8 (quantized at load, per-channel)"
        if self.group_k is not None:
            return f"{self.method} (block-wise {self.block_n}x{self.group_k})"
        return f"{self.method} (per-channel / per-tensor)"


def fp8_scheme(model_dir, quantization: str | None) -> Fp8Scheme | None:
    """The FP8 scheme of the checkpoint at `model_dir` under the user's `quantization` (None or "fp8"); None for
    a plain model. ModelLoadError naming the method for any quantization_config spruce cannot run."""
    from spruce.models.hf_config import read_json

    file = Path(model_dir) / "config.json"
    cfg = read_json(file, "model config")
    quant = cfg.get("quantization_config")
    if not quant:
        return Fp8Scheme("fp8", at_load=True) if quantization == "fp8" else None
    if not isinstance(quant, dict):
        raise ModelLoadError(f"{file}: quantization_config must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if method == "mxfp4" and "GptOssForCausalLM" in (cfg.get("architectures") or []):
        if quantization == "fp8":
            raise ModelLoadError(f"quantization='fp8' cannot run on the MXFP4 checkpoint {file.parent} (its experts "
                                 f"are dequantized at load to the model dtype); leave quantization unset")
        return None  # gpt-oss's MXFP4 experts are dequantized at load (models/gpt_oss.py)
    if method == "fp8":
        return _hf_fp8_scheme(quant, file)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(quant, file)
    raise ModelLoadError(f"{file} has quantization_config quant_method={method!r}: not supported; spruce loads FP8 "
                         f"checkpoints (quant_method {list(CHECKPOINT_METHODS)}: block-wise, per-channel or "
                         f"per-tensor float8_e4m3fn) and quantizes bf16 checkpoints at load (quantization='fp8')")


def _block(sizes, file: Path, key: str) -> tuple[int, int]:
    """A [rows, cols] block size; the K side must be a power of two >= 16 (the Triton GEMM's K steps)."""
    if (not isinstance(sizes, (list, tuple)) or len(sizes) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes)):
        raise ModelLoadError(f"{file}: {key} must be two positive integers [rows, cols], got {sizes!r}")
    bn, bk = sizes
    if bk < 16 or bk & (bk - 1):
        raise ModelLoadError(f"{file}: {key}={list(sizes)} is not supported: the column block must be a power of "
                             f"two >= 16 (published checkpoints use [128, 128])")
    return bn, bk


def _hf_fp8_scheme(quant: dict, file: Path) -> Fp8Scheme:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"{file}: FP8 format fmt={fmt!r} is not supported; supported: 'e4m3'")
    act = quant.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise ModelLoadError(f"{file}: activation_scheme={act!r} is not supported; expected 'dynamic' or 'static'")
    if quant.get("weight_block_size") is None:
        return Fp8Scheme("fp8")
    bn, bk = _block(quant["weight_block_size"], file, "weight_block_size")
    return Fp8Scheme("fp8", group_k=bk, block_n=bn)


def _compressed_tensors_scheme(quant: dict, file: Path) -> Fp8Scheme:
    fmt = quant.get("format")
    groups = quant.get("config_groups")
    if fmt != "float-quantized" or not isinstance(groups, dict) or not groups:
        raise ModelLoadError(f"{file}: compressed-tensors format={fmt!r} is not supported; spruce loads "
                             f"'float-quantized' (FP8) checkpoints with config_groups")
    schemes = set()
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ModelLoadError(f"{file}: compressed-tensors group {name!r} has weights {w!r}; supported: "
                                 f"8-bit float (FP8) weights")
        strategy = w.get("strategy")
        act = group.get("input_activations")
        if act is not None and (act.get("type") != "float" or act.get("num_bits") != 8):
            raise ModelLoadError(f"{file}: compressed-tensors group {name!r} has input_activations {act!r}; "
                                 f"supported: none, or 8-bit float")
        if strategy in ("tensor", "channel"):
            schemes.add(Fp8Scheme("compressed-tensors"))
        elif strategy == "block":
            bn, bk = _block(w.get("block_structure"), file, f"group {name!r} block_structure")
            schemes.add(Fp8Scheme("compressed-tensors", group_k=bk, block_n=bn))
        else:
            raise ModelLoadError(f"{file}: compressed-tensors weight strategy {strategy!r} (group {name!r}) is not "
                                 f"supported; supported: 'tensor', 'channel', 'block'")
    if len(schemes) > 1:
        raise ModelLoadError(f"{file}: compressed-tensors groups mix block and per-channel FP8 weights: not supported")
    return schemes.pop()


class Fp8Linear(nn.Module):
    """A linear layer with FP8 weights: weight [N, K] float8_e4m3fn, weight_scale [N, G] float32 (ops/fp8.py's
    layout), an optional bias in the model dtype and an optional static activation scale `input_scale` [1]."""

    def __init__(self, in_features: int, out_features: int, group_k: int | None, bias: nn.Parameter | None,
                 device: torch.device):
        super().__init__()
        self.in_features, self.out_features, self.group_k = in_features, out_features, group_k
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, num_groups(in_features, group_k),
                                                    dtype=torch.float32, device=device), requires_grad=False)
        self.bias = bias
        self.input_scale = None
        self.kernels: dict = {}  # M bucket -> measured kernel choice (`tune_linears`), CUDA only
        self.block_scale = None  # the block-scaled matmul's scale layout, when a choice runs it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., K] -> [..., N] in x's dtype."""
        return fp8_linear(x, self.weight, self.weight_scale, self.group_k, self.bias, self.input_scale,
                          self.kernels, self.block_scale)

    def dequantized(self, dtype: torch.dtype) -> nn.Linear:
        """The plain nn.Linear this layer approximates (weights dequantized to `dtype`)."""
        layer = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=dtype,
                          device=self.weight.device)
        layer.weight.data.copy_(dequantize(self.weight, self.weight_scale, self.group_k, dtype))
        if self.bias is not None:
            layer.bias.data.copy_(self.bias.data)
        return layer.requires_grad_(False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_k={self.group_k}"


def _parent(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, child = path.rpartition(".")
    return (module.get_submodule(parent) if parent else module), child


def _refuse_tp(param: torch.Tensor, name: str) -> None:
    if getattr(param, "tp_shard", None) is not None:
        raise ModelLoadError(f"FP8 weights ({name}) with tensor parallelism (tp_size > 1) are not supported yet; "
                             f"serve FP8 models with tp_size=1")


def make_fp8(module: nn.Module, param_name: str, scheme: Fp8Scheme, raw: str) -> None:
    """Turn the owner of `param_name` (a module-relative weight: an nn.Linear's `weight`, a RoutedExperts bank)
    into its FP8 form, empty, before the checkpoint writes it (a no-op if it already is)."""
    from spruce.models.moe import RoutedExperts

    path, _, kind = param_name.rpartition(".")
    owner = module.get_submodule(path)
    if isinstance(owner, Fp8Linear) or (isinstance(owner, RoutedExperts) and owner.is_fp8):
        return
    if param_name.endswith(_NEVER_FP8) or not (
            (isinstance(owner, nn.Linear) and kind == "weight")
            or (isinstance(owner, RoutedExperts) and kind in ("w13", "w2"))):
        raise ModelLoadError(f"checkpoint tensor {raw!r} is FP8 (or its scale), but {param_name} cannot hold FP8 "
                             f"weights: spruce runs FP8 linears of the decoder layers, routed experts and MLA "
                             f"projections")
    _refuse_tp(getattr(owner, kind), raw)
    if isinstance(owner, RoutedExperts):
        owner.make_fp8(scheme.group_k)
        return
    parent, child = _parent(module, path)
    setattr(parent, child, Fp8Linear(owner.in_features, owner.out_features, scheme.group_k, owner.bias,
                                      owner.weight.device))


def is_scale_name(name: str) -> bool:
    return name.endswith(SCALE_SUFFIXES)


def split_scale_name(name: str) -> tuple[str, str]:
    """`x.q_proj.weight_scale_inv` -> ("x.q_proj.weight", "weight_scale_inv")."""
    base, _, suffix = name.rpartition(".")
    return f"{base}.weight", suffix


def scale_param_name(weight_param: str) -> str:
    """The module parameter a weight scale goes into: `qkv.weight` -> `qkv.weight_scale`; `experts.w13` ->
    `experts.w13_scale`."""
    path, _, kind = weight_param.rpartition(".")
    return f"{path}.weight_scale" if kind == "weight" else f"{path}.{kind}_scale"


def scale_rows(tensor: torch.Tensor, rows: int, cols: int, scheme: Fp8Scheme, name: str) -> torch.Tensor:
    """A checkpoint weight scale for a weight of `rows` rows -> spruce's per-row [rows, cols] (cols = G)."""
    t = tensor.float()
    if scheme.block_n is not None:
        want = (num_groups(rows, scheme.block_n), cols)
        if tuple(t.shape) != want:
            raise ModelLoadError(f"scale {name!r} has shape {tuple(t.shape)}, expected {want} ({scheme.describe()})")
        return block_scale_rows(t, rows, scheme.block_n)
    if t.numel() == 1:  # per-tensor
        return t.reshape(1, 1).expand(rows, 1)
    if tuple(t.shape) in ((rows, 1), (rows,)):  # per-channel
        return t.reshape(rows, 1)
    raise ModelLoadError(f"scale {name!r} has shape {tuple(t.shape)}, expected one value (per-tensor) or "
                         f"[{rows}, 1] (per-channel)")


def load_scale(module: nn.Module, name: str, raw: str, tensor, scheme: Fp8Scheme, map_name) -> str | None:
    """Write a checkpoint scale (`name` module-relative) into its parameter. Returns the write's key for the
    exactly-once bookkeeping (`param` or `param[a:b]`), None for an activation scale (folded by max)."""
    from spruce.distributed.checkpoint import whole

    weight, suffix = split_scale_name(name)
    target, rows = map_name(module, weight)
    try:
        make_fp8(module, target, scheme, raw)
    except AttributeError:
        raise ModelLoadError(f"checkpoint tensor {raw!r} has no place in {type(module).__name__}") from None
    tensor = whole(tensor)
    path, _, kind = target.rpartition(".")
    owner = module.get_submodule(path)
    if suffix == "input_scale":
        _fold_input_scale(owner, kind, tensor, raw)
        return None
    param = module.get_parameter(scale_param_name(target))
    flat = param.data.flatten(0, -2) if param.dim() > 2 else param.data
    a, b = rows if rows is not None else (0, flat.shape[0])
    flat[a:b].copy_(scale_rows(tensor, b - a, flat.shape[1], scheme, raw))
    return scale_param_name(target) + ("" if rows is None else f"[{a}:{b}]")


def _fold_input_scale(owner: nn.Module, kind: str, tensor: torch.Tensor, raw: str) -> None:
    """A static activation scale of a linear: fused shards (q/k/v, gate/up) share the largest. Routed experts run
    weight-only (ops/fp8.py), so their static activation scales are refused rather than ignored."""
    if kind != "weight":
        raise ModelLoadError(f"static activation scale {raw!r}: routed experts with static FP8 activation scales "
                             f"are not supported (their FP8 weights run with unquantized activations); use a "
                             f"checkpoint with dynamic activations")
    if tensor.numel() != 1:
        raise ModelLoadError(f"activation scale {raw!r} has shape {tuple(tensor.shape)}: only per-tensor static "
                             f"activation scales are supported")
    value = tensor.float().reshape(1).to(owner.weight_scale.device)
    owner.input_scale = value if owner.input_scale is None else torch.maximum(owner.input_scale, value)


def finish_fp8_load(model: nn.Module, cfg, dtype: torch.dtype) -> None:
    """After an FP8 checkpoint loads: MLA's scale rows follow the rope row permutation its weights got at load
    (interleaved rope), and kv_b_proj is dequantized to `dtype` (the absorbed form reads its per-head slices)."""
    from spruce.models.mla import MLAttention, rope_rows_to_rotate_half

    for m in model.modules():
        if not isinstance(m, MLAttention):
            continue
        for attr, weight_name in (("q_proj", ".q_proj.weight"), ("q_b_proj", ".q_b_proj.weight"),
                                  ("kv_a_proj_with_mqa", ".kv_a_proj_with_mqa.weight")):
            layer = getattr(m, attr, None)
            if isinstance(layer, Fp8Linear):
                layer.weight_scale.data = rope_rows_to_rotate_half(weight_name, layer.weight_scale.data, cfg)
        if isinstance(m.kv_b_proj, Fp8Linear):
            m.kv_b_proj = m.kv_b_proj.dequantized(dtype)
    tune_linears(model)


_QUANTIZE_SKIP = ("gate", "shared_expert_gate", "kv_b_proj", "lm_head")  # routers, MLA's absorbed kv_b, the head


def quantize_model(model: nn.Module, group_k: int | None = None) -> int:
    """Load-time quantization: every linear of the decoder layers (module doc) and every routed-expert bank to
    FP8 per output channel (`group_k`: the linears in group_k x group_k blocks, the experts per row and K group
    of that width, as random weights of a block-scaled checkpoint's shape get), in place; then each linear's
    kernels are chosen (ops/fp8_select.py, CUDA). Returns how many modules were quantized."""
    from spruce.models.moe import RoutedExperts

    count = 0
    for path, m in list(model.named_modules()):
        if ".layers." not in f".{path}":
            continue
        if isinstance(m, RoutedExperts) and not m.is_fp8:
            _refuse_tp(m.w13, path)
            m.quantize_fp8(group_k)
            count += 1
        elif type(m) is nn.Linear and path.rpartition(".")[2] not in _QUANTIZE_SKIP:
            _refuse_tp(m.weight, path)
            layer = Fp8Linear(m.in_features, m.out_features, group_k, m.bias, m.weight.device)
            if group_k is None:
                q, scale = quantize_rows(m.weight.data, None)
            else:
                q, blocks = quantize_blocks(m.weight.data, (group_k, group_k))
                scale = block_scale_rows(blocks, m.out_features, group_k)
            layer.weight.data.copy_(q)
            layer.weight_scale.data.copy_(scale)
            parent, child = _parent(model, path)
            setattr(parent, child, layer)
            count += 1
    tune_linears(model)
    return count


def tune_linears(model: nn.Module) -> int:
    """Choose the kernels of every CUDA Fp8Linear of `model` by measurement (ops/fp8_select.choose, activations in
    the embedding's dtype, the model's; modules sharing a key share it). Returns how many modules got choices; a
    no-op without CUDA or Triton (or under its interpreter)."""
    from spruce.ops.triton_support import HAS_TRITON, interpreter_on

    if not HAS_TRITON or interpreter_on():
        return 0
    dtype = next((m.weight.dtype for m in model.modules() if isinstance(m, nn.Embedding)), torch.bfloat16)
    count = 0
    for m in model.modules():
        if isinstance(m, Fp8Linear) and m.weight.is_cuda:
            with torch.no_grad():
                m.kernels = choose(m.weight, m.weight_scale, m.group_k, m.bias, m.input_scale is not None, dtype)
                m.block_scale = (block_scales_t(m.weight_scale, m.group_k)
                                 if any(c.kind == "scaled_mm_block" for c in m.kernels.values()) else None)
            count += 1
    if count:
        torch.cuda.empty_cache()  # the timing copies and graphs: the KV cache is sized from what is left
    return count


KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")  # an attention layer's FP8 KV cache scales


def load_kv_scale(module: nn.Module, name: str, raw: str, tensor) -> None:
    """A checkpoint's per-layer KV cache scale (`<layer>.self_attn.k_scale`, `.v_scale`, or one `.kv_scale` for
    both) onto its attention module; it scales the cache only when the cache is FP8 (kv_cache_dtype)."""
    from spruce.distributed.checkpoint import whole

    path, _, kind = name.rpartition(".")
    try:
        owner = module.get_submodule(path)
    except AttributeError:
        owner = None
    if owner is None or not hasattr(owner, "k_scale"):
        raise ModelLoadError(f"checkpoint tensor {raw!r} has no place in {type(module).__name__}")
    t = whole(tensor).float()
    if t.numel() != 1 or not (t.item() > 0 and t.isfinite().item()):
        raise ModelLoadError(f"KV cache scale {raw!r} must be one positive finite value, got shape "
                             f"{tuple(t.shape)} {t.flatten()[:4].tolist()}")
    for attr in (("k_scale", "v_scale") if kind == "kv_scale" else (kind,)):
        setattr(owner, attr, t.item())


def check_fp8_kv_cache(model: nn.Module, kv_cache_dtype: str) -> None:
    """Refuse an FP8 KV cache for a model whose attention does not scale what it stores (ConfigError naming it):
    spruce's Attention and MLAttention do (ops/fp8.py); attention layers with their own forward do not yet."""
    from spruce.errors import ConfigError
    from spruce.models.layers import Attention
    from spruce.models.mla import MLAttention

    for path, m in model.named_modules():
        if not hasattr(m, "backend") or not hasattr(m, "layer_id"):
            continue
        base = MLAttention if isinstance(m, MLAttention) else Attention
        if not isinstance(m, base) or type(m).forward is not base.forward:
            raise ConfigError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported for this model's attention "
                              f"({type(m).__name__} at {path}); use kv_cache_dtype='auto'")
