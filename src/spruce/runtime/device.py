"""The name of the device an engine runs on, as results and /metrics report it."""

from __future__ import annotations

import platform

import torch


def device_name(device: str) -> str:
    """Display name: the GPU's for "cuda[:i]", the processor's for "cpu", otherwise `device` itself (a name
    reported by a server, say)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    if device.startswith("cpu") or device.startswith("cuda"):
        return f"cpu ({platform.processor() or platform.machine()})"
    return device
