"""Test-only oracle draft: wraps a real draft model and forces its proposals to be right for a chosen
fraction of nodes, so that every accept length 0..S and every commit path gets exercised.

How it knows what is right: each request's reference continuation (prompt + the target's greedy output)
is registered by prompt. A draft row at position p (input pair: feature at p, token at p+1) predicts the
token at p+2. The wrapper runs the real draft (so its attention and KV paths still run), stamps
(position as 128 * f0 + f1, row) into the first three hidden features (exact in bf16), and `compute_logits` adds a large bonus to the
reference token at p+2 (right) or to another token while suppressing the reference one (wrong), decided
per (request, position) by a hash against `fraction`.
"""

from __future__ import annotations

import hashlib

import torch


class OracleDraft(torch.nn.Module):
    def __init__(self, draft, engine, fraction: float, salt: int = 0):
        super().__init__()
        self.draft = draft
        self.engine = engine
        self.fraction = fraction
        self.salt = salt
        self.references: dict[tuple[int, ...], list[int]] = {}
        self.hidden_size = draft.hidden_size
        self.num_layers, self.attention_config = draft.num_layers, draft.attention_config
        self.draft_vocab_size = draft.draft_vocab_size
        self.step_layer = draft.step_layer

    def add_reference(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        self.references[tuple(prompt_ids)] = list(prompt_ids) + list(output_ids)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return self.draft.draft_to_target(ids)

    def forward(self, input_ids, features, batch, kv, page_table, layer=None):
        h = self.draft(input_ids, features, batch, kv, page_table, layer).clone()
        # small integers only, so the stamp survives bf16 (exact up to 256): position = 128 * f0 + f1
        h[:, 0] = torch.div(batch.positions, 128, rounding_mode="floor").to(h.dtype)
        h[:, 1] = (batch.positions % 128).to(h.dtype)
        h[:, 2] = batch.token_rows.to(h.dtype)
        return h

    def _right(self, key: tuple, pos: int) -> bool:
        digest = hashlib.blake2b(repr((self.salt, key[:8], len(key), pos)).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2**64 < self.fraction

    def compute_logits(self, hidden: torch.Tensor, layer: int = 0) -> torch.Tensor:
        logits = self.draft.compute_logits(hidden, layer).clone()  # [n, Vd]
        row_to_ref = {q.row: (tuple(q.prompt_ids), self.references.get(tuple(q.prompt_ids)))
                      for q in self.engine.scheduler.running if q.row is not None}
        target_to_draft = self._target_to_draft(logits.shape[-1], logits.device)
        stamps = hidden[:, :3].float().round().long().tolist()
        for i, (hi, lo, row) in enumerate(stamps):
            key, ref = row_to_ref.get(row, (None, None))
            p = 128 * hi + lo + 2
            if ref is None or p >= len(ref):
                continue
            want = target_to_draft.get(ref[p])
            if self._right(key, p):
                if want is not None:
                    logits[i, want] += 100.0
            else:
                if want is not None:
                    logits[i, want] = -1e9
                other = (want + 1) % logits.shape[-1] if want is not None else 0
                logits[i, other] += 100.0
        return logits

    def _target_to_draft(self, vd: int, device) -> dict[int, int]:
        if not hasattr(self, "_t2d"):
            tgt = self.draft.draft_to_target(torch.arange(vd, device=device)).tolist()
            self._t2d = {t: d for d, t in enumerate(tgt)}
        return self._t2d


def install_oracle(llm, fraction: float, salt: int = 0) -> OracleDraft:
    """Swap the LLM's draft for an oracle around it; returns the oracle (register references on it). The oracle
    runs on the host: an engine that captured CUDA graphs would replay the unwrapped draft, so it is refused (build
    the LLM with cuda_graph=False)."""
    eng = llm.engine
    if eng.runner.graphs.count:
        raise AssertionError(f"the oracle draft cannot wrap an engine with {eng.runner.graphs.count} CUDA graphs "
                             f"captured (their replays run the unwrapped draft): build it with cuda_graph=False")
    oracle = OracleDraft(eng.runner.draft, eng, fraction, salt)
    eng.runner.draft = oracle
    return oracle
