"""Attention backends by name: what each supports (a capability record) and where it lives (a lazy loader).

This module imports neither torch nor Triton nor FlashInfer: the config, the CLI's `--attention-backend`
choices and `spruce --help` list and validate backends from these records alone, and an implementation is
imported only when `spruce.attention.backend.create_backend` builds it. A backend plugs in by calling
`register(BackendInfo(...))` (DESIGN §13).

`auto` is not a backend but a choice. On CPU it is `torch`. On CUDA (the default there) it is a per-phase composite
(`attention/auto_backend.py`): each phase runs the backend a kernel table measured faster on this device
(`attention/kernel_table.py`), and `triton` (AUTO_FALLBACK) wherever there is no table, the faster backend is not
installed, or it cannot serve the config or the model. The config is checked against the fallback's record, so
`auto` accepts whatever `triton` accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from spruce.errors import ConfigError

AUTO = "auto"
AUTO_FALLBACK = "triton"  # what `auto` runs on CUDA in every phase the kernel table gives no runnable backend
AUTO_CPU_BACKEND = "torch"
ALL_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class BackendInfo:
    """One backend's capability record. Checked when the config is validated and when the model is known."""

    name: str
    loader: str  # "module:Class": imported by create_backend only
    summary: str
    cuda_graphs: bool = False  # its forwards may be captured in CUDA graphs (plan runs outside, DESIGN §13)
    mla: bool = True  # serves MLA (latent) attention: `forward_latent`
    dtypes: tuple[str, ...] = ALL_DTYPES  # model / KV-pool dtypes
    head_dims: tuple[int, ...] | None = None  # MHA/GQA head dims it serves; None: any
    windows: bool = False  # serves sliding-window attention and attention sinks (gpt-oss): forward(window, sinks)
    chunks: bool = False  # serves chunked attention (Llama 4): forward(chunk)
    needs_cuda: bool = False  # refuses device='cpu' (the triton backend accepts it under Triton's interpreter)
    requires: str | None = None  # optional package it imports; its install hint is the spruce extra of that name
    cpu_probe: Callable[[], str | None] | None = None  # needs_cuda backends: None when it may run on CPU anyway

    def missing_package(self) -> str | None:
        """Why its package cannot be imported ("needs triton, which is not installed: ..."), or None."""
        if self.requires is None or _importable(self.requires):
            return None
        return f"needs {self.requires}, which is not installed: pip install 'spruce[{self.requires}]'"

    def refusal(self, device: str) -> str | None:
        """Why this backend cannot run on `device` in this installation, or None."""
        missing = self.missing_package()
        if missing is not None:
            return missing
        if not self.needs_cuda or device.startswith("cuda"):
            return None
        why = self.cpu_probe() if self.cpu_probe is not None else ""
        if why is None:  # the probe allows CPU
            return None
        return f"needs a CUDA device, got device={device!r}" + (f" ({why})" if why else "")


_REGISTRY: dict[str, BackendInfo] = {}


def register(info: BackendInfo) -> None:
    """Add (or replace) a backend. Its name becomes a valid `attention_backend` and CLI choice."""
    if info.name == AUTO:
        raise ConfigError(f"attention backend name {AUTO!r} is reserved (it resolves to a backend per device)")
    _REGISTRY[info.name] = info


def backend_names() -> tuple[str, ...]:
    """Registered backends, in registration order."""
    return tuple(_REGISTRY)


def choices() -> tuple[str, ...]:
    """Every value `attention_backend` / `--attention-backend` accepts: the backends, then 'auto'."""
    return (*backend_names(), AUTO)


def graph_backends() -> tuple[str, ...]:
    """Backends whose forwards can be captured in CUDA graphs."""
    return tuple(n for n, i in _REGISTRY.items() if i.cuda_graphs)


def get_info(name: str) -> BackendInfo:
    """The record of a registered backend; ConfigError naming the value and the choices otherwise."""
    info = _REGISTRY.get(name) if isinstance(name, str) else None
    if info is None:
        raise ConfigError(f"attention_backend={name!r} is not supported; expected one of {_quoted(choices())}")
    return info


def resolve(name: str | None, device: str) -> str:
    """The registered backend whose record checks the config of `name` on `device`: None is the device's
    default ('auto' on CUDA, 'torch' on CPU); 'auto' is AUTO_CPU_BACKEND on CPU and, on CUDA, AUTO_FALLBACK (the
    backend every phase of the per-phase composite can fall back to: `is_auto` says the runner builds that)."""
    if name is None or name == AUTO:
        return AUTO_FALLBACK if device.startswith("cuda") else AUTO_CPU_BACKEND
    return get_info(name).name


def is_auto(name: str | None, device: str) -> bool:
    """Whether `name` on `device` runs the per-phase composite (`auto`, the default, on CUDA)."""
    return (name is None or name == AUTO) and device.startswith("cuda")


def describe_choice(name: str | None, device: str) -> str:
    """How errors name the user's choice: "attention_backend='triton' (the default on cuda: 'auto')"."""
    resolved = resolve(name, device)
    if name is None:
        default = AUTO if device.startswith("cuda") else AUTO_CPU_BACKEND
        tail = f" (the default on {device.partition(':')[0]}" + (f": {default!r})" if default != resolved else ")")
        return f"attention_backend={resolved!r}{tail}"
    if name == AUTO:
        return f"attention_backend='auto' (here {resolved!r})"
    return f"attention_backend={resolved!r}"


def check_config(name: str | None, device: str, dtype: str, cuda_graph: bool | None) -> BackendInfo:
    """Refuse a backend that cannot run this config; returns the resolved backend's record."""
    info = get_info(resolve(name, device))
    chosen = describe_choice(name, device)
    why = info.refusal(device)
    if why is not None:
        others = [n for n in backend_names() if n != info.name and _REGISTRY[n].refusal(device) is None]
        raise ConfigError(f"{chosen} {why}" + (f"; choose attention_backend={_or(others)}" if others else ""))
    if dtype not in info.dtypes:
        raise ConfigError(f"{chosen} {_dtype_refusal(info, dtype)}")
    if cuda_graph and not info.cuda_graphs:
        raise ConfigError(f"cuda_graph=True needs an attention backend with CUDA graphs ({_quoted(graph_backends())}"
                          f"); {chosen} runs eagerly")
    return info


def config_refusal(name: str, device: str, dtype: str, cuda_graph: bool) -> str | None:
    """Why backend `name` cannot run a config on `device` ("needs flashinfer, which is not installed: ...",
    "does not support dtype='float32'; ...", "runs eagerly, and cuda graphs are on"), or None. `auto` asks this
    of every registered backend; `check_config` raises the same reasons for the chosen backend."""
    info = get_info(name)
    why = info.refusal(device)
    if why is not None:
        return why
    if dtype not in info.dtypes:
        return _dtype_refusal(info, dtype)
    if cuda_graph and not info.cuda_graphs:
        return "runs eagerly, and cuda graphs are on"
    return None


def model_refusal(name: str, *, head_dim: int | None = None, mla: bool = False, window: bool = False,
                  chunk: bool = False, what: str = "the model") -> str | None:
    """Why backend `name` cannot serve a model's attention (MHA head dim, MLA, sliding windows / sinks, chunked
    attention), or None."""
    info = get_info(name)
    if chunk and not info.chunks:
        served = [n for n, i in _REGISTRY.items() if i.chunks]
        return f"has no chunked attention, which {what} needs; backends with it: {_quoted(served)}"
    if window and not info.windows:
        served = [n for n, i in _REGISTRY.items() if i.windows]
        return (f"has no sliding-window attention or attention sinks, which {what} needs; backends with them: "
                f"{_quoted(served)}")
    if mla and not info.mla:
        served = [n for n, i in _REGISTRY.items() if i.mla]
        return f"has no MLA (latent) attention, which {what} needs; backends with MLA: {_quoted(served)}"
    if not mla and head_dim is not None and info.head_dims is not None and head_dim not in info.head_dims:
        return f"does not support head_dim={head_dim} ({what}); it supports {_quoted(info.head_dims)}"
    return None


def check_model(name: str, *, head_dim: int | None = None, mla: bool = False, window: bool = False,
                chunk: bool = False, what: str = "the model") -> None:
    """Refuse a backend that cannot serve a model's attention (MHA head dim, MLA, sliding windows / sinks, chunked
    attention)."""
    why = model_refusal(name, head_dim=head_dim, mla=mla, window=window, chunk=chunk, what=what)
    if why is not None:
        raise ConfigError(f"attention_backend={name!r} {why}")


def _dtype_refusal(info: BackendInfo, dtype: str) -> str:
    return f"does not support dtype={dtype!r}; it supports {_quoted(info.dtypes)}"


def _quoted(values) -> str:
    return ", ".join(repr(v) for v in values)


def _or(values) -> str:
    quoted = [repr(v) for v in values]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def _importable(package: str) -> bool:
    """Whether `package` imports (Triton: spruce's own guarded import, so a broken install counts as missing)."""
    if package == "triton":
        from spruce.ops.triton_support import HAS_TRITON

        return HAS_TRITON
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # in sys.modules without a spec
        return True


def _triton_on_cpu() -> str | None:
    """Triton runs on CPU only in its interpreter: None when it is on, else why not."""
    from spruce.ops.triton_support import interpreter_on

    if interpreter_on():
        return None
    return ("Triton runs on CPU only in its interpreter, TRITON_INTERPRET=1 set before spruce is imported: slow, "
            "for tests")


register(BackendInfo(
    "torch", "spruce.attention.torch_backend:TorchAttention",
    "reference: one masked float32 attention per query block; CPU and GPU, eager only",
    windows=True, chunks=True,
))
register(BackendInfo(
    "triton", "spruce.attention.triton_backend:TritonAttention",
    "spruce's kernels: paged prefix + tree scratch in one online softmax (MHA and MLA; sliding windows, "
    "sinks, chunks); CUDA graphs",
    cuda_graphs=True, needs_cuda=True, requires="triton", cpu_probe=_triton_on_cpu, windows=True, chunks=True,
))
register(BackendInfo(
    "torch-split", "spruce.attention.torch_split_backend:TorchSplitAttention",
    "reference for library kernels: paged prefix and tree scratch as two partial attentions merged by "
    "log-sum-exp (attention/merge.py); CPU and GPU, eager only",
))
register(BackendInfo(
    "flashinfer", "spruce.attention.flashinfer_backend:FlashInferAttention",
    "FlashInfer's paged kernels for the committed prefix (host-planned), spruce's Triton kernel for the tail and "
    "tree scratch, merged by log-sum-exp; MHA/GQA and MLA; CUDA graphs",
    cuda_graphs=True, mla=True, dtypes=("bfloat16", "float16"), head_dims=(64, 128, 256), needs_cuda=True,
    requires="flashinfer",
))
