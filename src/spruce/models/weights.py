"""Copy Hugging Face-named tensors into spruce modules, whose q/k/v and gate/up weights are fused.

HF name                                   spruce parameter (rows)
<p>.self_attn.{q,k,v}_proj.{weight,bias}  <p>.self_attn.qkv.{weight,bias} (the q / k / v row range)
<m>.{gate,up}_proj.weight                 <m>.gate_up.weight (first / second half), <m> a GatedMLP
<m>.down_proj.weight                      <m>.down.weight
<x>.{i}.{gate,up,down}_proj.weight        <x>.w13 / <x>.w2 (expert i's rows), <x> a RoutedExperts
<x>.b13, <x>.b2                           the same name (a RoutedExperts' biases, written whole)
anything else                             the same name
Every parameter (and every fused row range) must be written exactly once.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch

from spruce.distributed.checkpoint import take_shard, whole
from spruce.errors import ModelLoadError
from spruce.models import quantization
from spruce.models.layers import Attention, GatedMLP, fused_slices
from spruce.models.moe import RoutedExperts

_QKV = re.compile(r"(.*)\.self_attn\.([qkv]_proj)\.(weight|bias)$")
_MLP = re.compile(r"(.*)\.(gate|up|down)_proj\.weight$")
_EXPERT = re.compile(r"(.*)\.(\d+)\.(gate|up|down)_proj\.weight$")


def map_name(module: torch.nn.Module, name: str) -> tuple[str, tuple[int, int] | None]:
    m = _QKV.match(name)
    if m:
        attn = _submodule(module, f"{m.group(1)}.self_attn")
        if isinstance(attn, Attention):
            return f"{m.group(1)}.self_attn.qkv.{m.group(3)}", fused_slices(attn)[m.group(2)]
    m = _EXPERT.match(name)
    if m:
        experts = _submodule(module, m.group(1))
        if isinstance(experts, RoutedExperts):
            param, rows = experts.expert_rows(int(m.group(2)), m.group(3))
            return f"{m.group(1)}.{param}", rows
    m = _MLP.match(name)
    if m:
        mlp = _submodule(module, m.group(1))
        if isinstance(mlp, GatedMLP):
            i = mlp.intermediate
            if m.group(2) == "down":
                return f"{m.group(1)}.down.weight", None
            return f"{m.group(1)}.gate_up.weight", (0, i) if m.group(2) == "gate" else (i, 2 * i)
    return name, None


def _submodule(module, path):
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def expected_writes(module: torch.nn.Module, skip: Iterable[str] = ()) -> dict[str, str]:
    """Every write the checkpoint must provide: {parameter or "param[a:b]" row range: checkpoint-style name}."""
    out = {}
    skip = set(skip)
    for pname, _ in module.named_parameters():
        if pname in skip:
            continue
        owner_path, _, kind = pname.rpartition(".")  # e.g. "layers.0.self_attn.qkv", "weight"
        owner = _submodule(module, owner_path.rsplit(".", 1)[0])
        if owner_path.endswith(".qkv") and isinstance(owner, Attention):
            base = owner_path.removesuffix(".qkv")
            out |= {f"{pname}[{a}:{b}]": f"{base}.{proj}.{kind}" for proj, (a, b) in fused_slices(owner).items()}
        elif owner_path.endswith(".gate_up") and isinstance(owner, GatedMLP):
            base, i = owner_path.removesuffix(".gate_up"), owner.intermediate
            out |= {f"{pname}[0:{i}]": f"{base}.gate_proj.{kind}", f"{pname}[{i}:{2 * i}]": f"{base}.up_proj.{kind}"}
        elif owner_path.endswith(".down") and isinstance(owner, GatedMLP):
            out[pname] = f"{owner_path.removesuffix('.down')}.down_proj.{kind}"
        elif isinstance(_submodule(module, owner_path), RoutedExperts) and kind in ("b13", "b2"):
            out[pname] = pname  # gpt-oss's expert biases: written whole
        elif isinstance(_submodule(module, owner_path), RoutedExperts):
            experts = _submodule(module, owner_path)
            bank, scale = kind.removesuffix("_scale"), kind.endswith("_scale")  # an FP8 bank's scales: its rows
            for e in range(experts.num_experts):
                for proj in ("gate", "up", "down"):
                    param, (a, b) = experts.expert_rows(e, proj)
                    if param == bank:
                        out[f"{pname}[{a}:{b}]"] = f"{owner_path}.{e}.{proj}_proj.weight{'_scale' * scale}"
        else:
            out[pname] = pname
    return out


def load_named_tensors(module: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                       rename=lambda n: n, optional: Iterable[str] = (), buffers: Iterable[str] = ()) -> set[str]:
    """Load tensors (names passed through `rename`; None drops a tensor). Parameters in `optional` may be
    absent; `buffers` names buffers that may be loaded too. Returns the set of names loaded."""
    params = dict(module.named_parameters())
    bufs = {n: b for n, b in module.named_buffers() if n in set(buffers)}
    scheme = getattr(module, "fp8_scheme", None)  # set by the loader for an FP8 checkpoint (models/quantization.py)
    written, loaded = set(), set()
    for raw, tensor in tensors:
        name = rename(raw)
        if name is None:
            continue
        if name in bufs:
            copy_into(bufs[name], tensor, None, raw)
            loaded.add(name)
            continue
        if name.endswith(quantization.KV_SCALE_SUFFIXES):
            quantization.load_kv_scale(module, name, raw, tensor)
            loaded.add(name)
            continue
        if scheme is not None and quantization.is_scale_name(name):
            key = quantization.load_scale(module, name, raw, tensor, scheme, map_name)
            params = dict(module.named_parameters())
            written.update(() if key is None else (key,))
            loaded.add(name)
            continue
        target, rows = map_name(module, name)
        if scheme is not None and target in params and _dtype(tensor) == quantization.FP8_DTYPE:
            quantization.make_fp8(module, target, scheme, raw)
            params = dict(module.named_parameters())
        if target not in params:
            if quantization.is_scale_name(name) or _dtype(tensor) == quantization.FP8_DTYPE:
                raise ModelLoadError(f"checkpoint tensor {raw!r} is FP8 (or an FP8 scale) but config.json has no "
                                     f"supported quantization_config (quant_method 'fp8' or 'compressed-tensors')")
            raise ModelLoadError(f"checkpoint tensor {raw!r} has no place in {type(module).__name__}")
        copy_into(params[target], tensor, rows, raw)
        written.add(target if rows is None else f"{target}[{rows[0]}:{rows[1]}]")
        loaded.add(name)
    expected = expected_writes(module, skip=optional)
    missing = sorted(expected[k] for k in expected.keys() - written)
    if missing:
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensor(s) {type(module).__name__} needs: "
                             f"{missing[:6]}{more}")
    return loaded


def _dtype(tensor) -> torch.dtype | None:
    """A tensor's dtype, or a CheckpointSlice's when it says (None otherwise)."""
    return getattr(tensor, "dtype", None)


def copy_into(dst: torch.Tensor, tensor, rows: tuple[int, int] | None, name: str) -> None:
    """dst[rows] = tensor (rows of dst's [-1, cols] flattening), checking the shape and naming both on mismatch.

    `tensor` may be a CheckpointSlice (read here); a tensor-parallel parameter (`tp_shard`) takes only its
    rank's part of it (distributed/checkpoint.py)."""
    flat = dst.data.flatten(0, -2) if dst.dim() > 2 else dst.data
    view = dst.data if rows is None else flat[rows[0]:rows[1]]
    shard = getattr(dst, "tp_shard", None)
    tensor = whole(tensor) if shard is None else take_shard(tensor, tuple(view.shape), shard, name)
    if tuple(view.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(view.shape)}")
    view.copy_(tensor.to(view.dtype))


def export_named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The inverse of loading: every checkpoint-style tensor (module-relative name -> tensor), the fused
    parameters split back into their q/k/v, gate/up and per-expert pieces."""
    params = dict(module.named_parameters())
    out = {}
    for key, name in expected_writes(module).items():
        pname, _, rows = key.partition("[")
        tensor = params[pname].detach()
        if rows:
            a, b = (int(x) for x in rows.rstrip("]").split(":"))
            tensor = (tensor.flatten(0, -2) if tensor.dim() > 2 else tensor)[a:b]
        out[name] = tensor.contiguous()
    return out
