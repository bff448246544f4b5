"""Attention backend interface (plan / forward) and construction from the registry (DESIGN §13).

Backends are plugins: `spruce.attention.registry` holds each one's capability record and a lazy loader, and
`create_backend` imports an implementation only when one is built.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch

from spruce.attention.metadata import ForwardBatch
from spruce.attention.registry import BackendInfo, check_model, get_info
from spruce.errors import ConfigError, InvariantError

if TYPE_CHECKING:
    from spruce.limits import Limits

CACHE_ROW_ALIGN_BYTES = 16
"""An MLA latent cache's rows (`forward_latent`'s `cache`, [slots, Dk]) start on this boundary, the first row too:
the Triton kernel's pipelined copies move 16 bytes at a time wherever a tile row is 16 contiguous bytes (Triton
3.6 does so without checking the row stride), so an FP8 row of 56 bytes would read off its alignment
(`memory/kv_pool.py` pads the rows to it)."""


class AttentionBackend:
    """Stores the new tokens' K/V and computes attention per the contract in `spruce.attention.metadata`.

    The lifecycle, and where each call runs:

    * **construction** `cls(page_size, limits=None, device=None)`, then **`allocate(limits, device)`** once the
      `Limits` exist (the engine's runner derives them after the weights load, from the memory left, so it builds
      the backend first, hands it to the model layers, and allocates right after): a backend sizes every
      persistent buffer it needs (indptr / indices / work partition of a library kernel) from `Limits`, never
      from a batch, so a CUDA graph captured over them stays valid for every batch of its bucket.
    * **`plan(batch, page_table)`**: derives what the kernels need from the one `ForwardBatch`. It runs on the
      host, **outside any CUDA graph**: before every eager forward, and before every graph replay (again, with
      the replay's own batch) and capture. A phase's graph holds several forwards, and the batch of each is
      written by the metadata builder *inside* the graph, on the device; so at plan time only the batch's
      host-side fields (`ForwardBatch.layout`: phase, batch size, tokens, max query and kv lengths, scratch
      width, and the host lengths of an EXTEND batch) are its real values, and its device tensors are the
      persistent buffers the forward will read, not yet filled for a replay. `plan` therefore reads host fields
      only, never device memory (no synchronisation), and may write host state and device buffers it owns
      (e.g. copy a host-computed schedule into them, non-blocking). Equal layouts must get equal plans: the
      runner may skip re-planning a layout it has planned. What depends on the batch's device values (kv
      indices from the page table, per-token lengths) is derived on the device by `forward` itself, where a
      graph captures it.
    * **`forward` / `forward_latent`**: one call per attention layer, inside the graph when captured; no host
      synchronisation, shapes from host ints only. Must accept an empty batch (T == 0).

    Who calls plan: `ModelRunner.plan` (runtime/model_runner.py). A decode-time phase passes a plan callback to
    `BucketGraphs.run` / `capture` (runtime/cuda_graph.py), which calls it before the eager run or the replay;
    inside such a phase every forward's batch must match what was planned (an InvariantError otherwise). A
    forward outside any phase (prefill, scoring) is planned by the runner right before it.

    The torch and triton backends read the ForwardBatch directly: their plan is a no-op.
    """

    name = "base"

    def __init__(self, page_size: int, limits: Limits | None = None, device: torch.device | str | None = None):
        self.page_size = page_size
        self.limits: Limits | None = None
        self.device: torch.device | None = None
        if limits is not None:
            self.allocate(limits, device if device is not None else "cpu")

    @property
    def info(self) -> BackendInfo:
        """This backend's capability record."""
        return get_info(self.name)

    def check_model(self, *, head_dim: int | None = None, mla: bool = False, window: bool = False,
                    chunk: bool = False, what: str = "the model") -> None:
        """Refuse a model whose attention this backend cannot serve (ConfigError from the registry's record);
        the runner calls it for the target and the draft before `allocate`. `window`: the model has
        sliding-window layers or attention sinks (forward's `window` / `sinks`); `chunk`: chunked attention
        layers (forward's `chunk`)."""
        check_model(self.name, head_dim=head_dim, mla=mla, window=window, chunk=chunk, what=what)

    def describe(self) -> str:
        """How the engine's info (/metrics, the start-up log) names this backend: its name; a composite also
        names the backend of each phase."""
        return self.name

    def allocate(self, limits: Limits, device: torch.device | str) -> None:
        """Size persistent buffers from `limits` (called once, before any plan)."""
        if limits.page_size != self.page_size:
            raise InvariantError(f"attention backend {self.name!r} built for page_size {self.page_size}, "
                                 f"allocated with Limits of page_size {limits.page_size}")
        self.limits, self.device = limits, torch.device(device)

    @property
    def captures_prefill(self) -> bool:
        """Whether a prefill (EXTEND) forward may be captured in a CUDA graph: its plan and kernels need no host
        lengths, so one graph over a padded batch (`BatchBuilder.padded_extend`, which has none) serves every
        prefill that fits. False by default: a backend that plans prefills from host lengths runs them eagerly."""
        return False

    def plan(self, batch: ForwardBatch, page_table: torch.Tensor) -> None:
        """Host-side preparation for forwards over `batch` (see the class docstring); a no-op by default."""

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [slots, Hkv, D] (one layer of a KVPool)
        v_cache: torch.Tensor,  # [slots, Hkv, D]
        scratch_start: int,
        batch: ForwardBatch,
        page_table: torch.Tensor,  # [rows, max_pages] int32
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        raise NotImplementedError

    def forward_latent(
        self,
        q: torch.Tensor,  # [T, Hq, Dk]: absorbed query (q_nope @ W_UK, then the rotated rope part)
        latent: torch.Tensor,  # [T, Dk]: the new tokens' latent keys (normed compressed kv, then rotated k_rope)
        cache: torch.Tensor,  # [slots, Dk] (one layer of a LatentKVPool)
        value_dim: int,  # Dv: a key's first Dv values are its value (the compressed kv)
        scratch_start: int,
        batch: ForwardBatch,
        page_table: torch.Tensor,  # [rows, max_pages] int32
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, Dv]
        """MLA in absorbed form: multi-query attention over one shared latent per token (DeepSeek-V2/V3).

        Same contract as `forward` (slots, prefix, scratch bits), with a single KV head whose value is a prefix
        of its key: stores `latent` into cache[out_slots], then attends."""
        raise NotImplementedError(f"attention backend {self.name!r} has no MLA (latent) attention")


def load_backend_class(name: str) -> type[AttentionBackend]:
    """Import the implementation of a registered backend (ConfigError naming the choices for an unknown name,
    or the install hint when its package is missing)."""
    info = get_info(name)
    missing = info.missing_package()
    if missing is not None:
        raise ConfigError(f"attention_backend={name!r} {missing}")
    module, _, cls = info.loader.partition(":")
    return getattr(importlib.import_module(module), cls)


def create_backend(name: str, page_size: int, limits: Limits | None = None,
                   device: torch.device | str | None = None) -> AttentionBackend:
    """Build the backend registered as `name` (not 'auto': resolve it with the registry first)."""
    return load_backend_class(name)(page_size, limits, device)
