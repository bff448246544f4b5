"""Copy Hugging Face-named tensors into spruce modules, whose q/k/v and gate/up weights are fused.

HF name                               spruce parameter (rows)
<p>.self_attn.{q,k,v}_proj.{weight,bias}  <p>.self_attn.qkv.{weight,bias} (the q / k / v row range)
<p>.mlp.{gate,up}_proj.weight             <p>.mlp.gate_up.weight (first / second half)
<p>.mlp.down_proj.weight                  <p>.mlp.down.weight
anything else                             the same name
Every parameter (and every fused row range) must be written exactly once.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch

from spruce.errors import ModelLoadError
from spruce.models.layers import Attention, GatedMLP, fused_slices

_QKV = re.compile(r"(.*)\.self_attn\.([qkv]_proj)\.(weight|bias)$")
_GATE_UP = re.compile(r"(.*)\.mlp\.(gate|up)_proj\.weight$")


def map_name(module: torch.nn.Module, name: str) -> tuple[str, tuple[int, int] | None]:
    m = _QKV.match(name)
    if m:
        attn = _submodule(module, f"{m.group(1)}.self_attn")
        if isinstance(attn, Attention):
            return f"{m.group(1)}.self_attn.qkv.{m.group(3)}", fused_slices(attn)[m.group(2)]
    m = _GATE_UP.match(name)
    if m:
        mlp = _submodule(module, f"{m.group(1)}.mlp")
        if isinstance(mlp, GatedMLP):
            i = mlp.intermediate
            return f"{m.group(1)}.mlp.gate_up.weight", (0, i) if m.group(2) == "gate" else (i, 2 * i)
    return name.replace("mlp.down_proj.", "mlp.down."), None


def _submodule(module, path):
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def expected_writes(module: torch.nn.Module, skip: Iterable[str] = ()) -> set[str]:
    out = set()
    skip = set(skip)
    for pname, _ in module.named_parameters():
        if pname in skip:
            continue
        owner = _submodule(module, pname.rsplit(".", 2)[0])
        if pname.endswith((".qkv.weight", ".qkv.bias")) and isinstance(owner, Attention):
            out |= {f"{pname}[{a}:{b}]" for a, b in fused_slices(owner).values()}
        elif pname.endswith(".gate_up.weight") and isinstance(owner, GatedMLP):
            i = owner.intermediate
            out |= {f"{pname}[0:{i}]", f"{pname}[{i}:{2 * i}]"}
        else:
            out.add(pname)
    return out


def load_named_tensors(module: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                       rename=lambda n: n, optional: Iterable[str] = (), buffers: Iterable[str] = ()) -> set[str]:
    """Load tensors (names passed through `rename`; None drops a tensor). Parameters in `optional` may be
    absent; `buffers` names buffers that may be loaded too. Returns the set of names loaded."""
    params = dict(module.named_parameters())
    bufs = {n: b for n, b in module.named_buffers() if n in set(buffers)}
    written, loaded = set(), set()
    for raw, tensor in tensors:
        name = rename(raw)
        if name is None:
            continue
        if name in bufs:
            copy_into(bufs[name], tensor, None, raw)
            loaded.add(name)
            continue
        target, rows = map_name(module, name)
        if target not in params:
            raise ModelLoadError(f"checkpoint tensor {raw!r} has no place in {type(module).__name__}")
        copy_into(params[target], tensor, rows, raw)
        written.add(target if rows is None else f"{target}[{rows[0]}:{rows[1]}]")
        loaded.add(name)
    missing = sorted(expected_writes(module, skip=optional) - written)
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")
    return loaded


def copy_into(dst: torch.Tensor, tensor: torch.Tensor, rows: tuple[int, int] | None, name: str) -> None:
    """dst[rows] = tensor, checking the shape and naming both on mismatch."""
    view = dst.data if rows is None else dst.data[rows[0]:rows[1]]
    if tuple(view.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(view.shape)}")
    view.copy_(tensor.to(view.dtype))
