"""Per-row decode state on the device: where the next decode step of each page-table row starts.

`committed[row]` counts the positions whose target KV is in the row's pages; `last_token[row]` is the token
at position `committed[row]`, which has no KV yet. Prefill sets them; every decode step reads them and
advances them on the device. A step can therefore be launched before the host has read the previous step's
results (overlap scheduling): the host knows rows, never the device's positions or tokens. The dummy row
(padding) always holds (0, 0).
"""

from __future__ import annotations

import torch

from spruce.limits import Limits


class RowState:
    def __init__(self, limits: Limits, device: torch.device):
        self.dummy_row = limits.dummy_row
        self.committed = torch.zeros(limits.num_rows, dtype=torch.int64, device=device)  # [rows]
        self.last_token = torch.zeros(limits.num_rows, dtype=torch.int64, device=device)  # [rows]

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(committed [P], last_token [P]) of `rows` [P] (padding rows read the dummy row's zeros)."""
        return self.committed[rows], self.last_token[rows]

    def set(self, rows: torch.Tensor, committed: torch.Tensor, last_token: torch.Tensor) -> None:
        """Write each real row's new state; padding rows (the dummy row) keep (0, 0). All [P], on the device."""
        real = rows != self.dummy_row
        self.committed[rows] = torch.where(real, committed, 0)
        self.last_token[rows] = torch.where(real, last_token, 0)
