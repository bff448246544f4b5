"""The tensor-parallel process group: who this rank is, and the collectives the model and the engine use.

Two torch.distributed groups over the same ranks:
    device group   NCCL on CUDA, gloo on CPU: the model's all-reduces and all-gathers (captured inside CUDA
                   graphs on GPU), with a timeout (`SPRUCE_TP_TIMEOUT_S`, default 600 s) so a stuck peer
                   fails the collective instead of hanging it
    control group  gloo, on host memory: the engine's per-step exchange of commands and state digests
                   (runtime/replicated_engine.py). Workers wait here while the driver idles, so its timeout
                   is long; a dead peer closes its socket and the exchange fails at once (gloo), and the
                   liveness watchdogs (runtime/launch.py) cover the rest.
Nothing here runs when tp_size is 1: a single-process engine never initialises torch.distributed.
"""

from __future__ import annotations

import datetime
import inspect
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spruce.errors import ConfigError

TIMEOUT_ENV = "SPRUCE_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
CONTROL_TIMEOUT = datetime.timedelta(days=30)  # workers idle here while the driver has no work
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(eq=False)
class TPGroup:
    """This process's place in a tensor-parallel group of `size` ranks, and its collectives."""

    rank: int
    size: int
    device: torch.device
    device_group: object  # torch.distributed ProcessGroup (NCCL on CUDA, gloo on CPU)
    control_group: object  # gloo ProcessGroup for host-side objects

    # --- sizes -------------------------------------------------------------------------------------------------
    def shard(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, columns, vocabulary rows), which must divide evenly."""
        if total % self.size:
            raise ConfigError(f"tp_size={self.size} does not divide {what}={total}; choose a tp_size that "
                              f"divides it")
        return total // self.size

    # --- collectives on device tensors (inside CUDA graphs on GPU) -------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[n, c] on every rank -> [n, size * c]: the ranks' columns side by side, rank 0 first."""
        n, c = x.shape
        out = torch.empty(self.size * n, c, dtype=x.dtype, device=x.device)  # [size * n, c]
        _all_gather_single(out, x.contiguous(), group=self.device_group)
        return out.view(self.size, n, c).permute(1, 0, 2).reshape(n, self.size * c)

    # --- host-side collectives (control group) ---------------------------------------------------------------------
    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of int64 values (equal lengths on every rank), indexed by rank."""
        mine = torch.tensor(values, dtype=torch.int64)
        out = torch.empty(self.size * len(values), dtype=torch.int64)
        _all_gather_single(out, mine, group=self.control_group)
        return out.view(self.size, len(values)).tolist()

    def broadcast_bytes(self, payload: bytes | None, size: int) -> bytes:
        """Rank 0's `size` bytes on every rank (the others pass None and learn `size` beforehand)."""
        buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0
               else torch.empty(size, dtype=torch.uint8))
        dist.broadcast(buf, src=0, group=self.control_group)
        return buf.numpy().tobytes()

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. free KV memory: every rank must size alike)."""
        return min(row[0] for row in self.gather_ints([value]))


def collective_timeout() -> datetime.timedelta:
    """The device group's collective timeout: $SPRUCE_TP_TIMEOUT_S seconds (default 600)."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not seconds > 0:
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r} must be a number of seconds > 0")
    return datetime.timedelta(seconds=seconds)


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device a rank computes on: 'cpu', or CUDA device `local_rank` for 'cuda'."""
    return torch.device("cpu") if device == "cpu" else torch.device("cuda", local_rank)


def init_tp_group(rank: int, size: int, device: str, init_method: str, local_rank: int | None = None) -> TPGroup:
    """Join the group (blocks until all `size` ranks have joined). CUDA: NCCL with NVLink multicast off
    (NCCL_NVLS_ENABLE=0, which the device machines require), this rank's GPU made current; CPU: gloo."""
    dev = rank_device(device, rank if local_rank is None else local_rank)
    if dev.type == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # before NCCL initialises (spawned workers inherit it too)
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    # NCCL bound to this rank's GPU at once (torch >= 2.3), so the first collective is not inside a graph capture
    eager = dev.type == "cuda" and "device_id" in inspect.signature(dist.init_process_group).parameters
    kwargs = {"device_id": dev} if eager else {}
    check_no_group()
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=collective_timeout(), **kwargs)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(rank, size, dev, dist.group.WORLD, control)


def check_no_group() -> None:
    """ConfigError unless this process is free to join a new group: one process belongs to one group at a time
    (torch.distributed has one default group), so an engine still open must be shut down first."""
    if dist.is_initialized():
        raise ConfigError("this process already belongs to a tensor-parallel group: an LLM(tp_size > 1) or engine "
                          "built earlier is still open. Call its shutdown() first (or build it with `with "
                          "LLM(...) as llm:`, which shuts it down at the end of the block); an engine nothing "
                          "refers to any more is shut down when it is collected")


def destroy_tp_group() -> None:
    """Leave the group (this process may start another one later)."""
    if dist.is_initialized():
        dist.destroy_process_group()
