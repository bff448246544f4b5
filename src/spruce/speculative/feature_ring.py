"""The target's draft features of the positions a lagging draft has not consumed yet (adaptive speculation).

An adaptive plain step runs the target alone (DESIGN §16): the draft falls behind by one position per plain step.
A later catch-up runs the draft over the missing pairs (feature at p, token at p+1), so the feature of every
position a plain step committed must be kept until then. They live here, per page-table row, in a ring of
`Limits.draft_lag_window` slots: position p of row r is slot (r, p mod W). A request's draft never lags by more
than W (the adaptive strategy catches up before a plain step would overwrite a slot not yet consumed), so the ring
holds every feature a catch-up reads. `store` is device work only, so it runs inside the plain step's CUDA graph.
"""

from __future__ import annotations

import torch

from spruce.limits import Limits


class FeatureRing:
    """`aux`: the draft reads the target's EAGLE-3 aux features (each aux layer's input stream), else its final
    hidden state."""

    def __init__(self, limits: Limits, feature_width: int, dtype: torch.dtype, device: torch.device,
                 aux: bool = False):
        self.width = limits.draft_lag_window
        if self.width <= 0:
            raise ValueError(f"a feature ring needs Limits.draft_lag_window > 0 (adaptive speculation), got "
                             f"{self.width}")
        self.aux = aux
        self.features = torch.zeros(limits.num_rows, self.width, feature_width, dtype=dtype,
                                    device=device)  # [rows, W, F]

    def store(self, rows: torch.Tensor, positions: torch.Tensor, features: torch.Tensor) -> None:
        """Keep each row's feature [P, F] at its position [P] (padding rows write the dummy row's ring)."""
        self.features[rows, positions % self.width] = features.to(self.features.dtype)

    def keep_forward(self, target_forward, batch, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run `target_forward(batch, ...)` (ModelRunner.target_forward) over one token a row and keep what the
        draft consumes of it at each row's position [P]: EAGLE-3's aux features, which each aux layer's add-norm
        writes to the ring as it computes them (ops/fused.py StreamSink), else the final hidden [P, H]. Returns
        the hidden [P, H]."""
        if self.aux:
            return target_forward(batch, feature_ring=(self.features, rows, positions))[0]
        hidden, _ = target_forward(batch)
        self.store(rows, positions, hidden)
        return hidden

    def gather(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The kept features of (row, position) pairs ([n] each): [n, F]."""
        return self.features[rows, positions % self.width]
