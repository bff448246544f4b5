"""Presence, frequency and repetition penalties, lossless under tree speculation (DESIGN §19).

Semantics (vLLM's, OpenAI's for the first two), applied to the logits after logit_bias and min_tokens and before
temperature: `repetition_penalty` r divides the positive logits and multiplies the others of every token seen in
the prompt or generated so far; then `frequency_penalty` f times the token's count among the generated tokens
and `presence_penalty` p (once, if it was generated at all) are subtracted:
    x' = (x / r if x > 0 else x * r) if seen else x;   x'' = x' - f * count - p * (count > 0)

What a choice counts: the tokens generated before the position it chooses. For plain decoding (and prefill's
first token) that is the request's committed output. For a tree node it is the committed output plus the
node's own path below the root (its ancestors' draft tokens and its own token: the root is the last committed
token, already counted), so every node's distribution is plain decoding's at that position.

State on the device (`PenaltyState`), per page-table row: `output_counts` [rows, V] int32 and `in_prompt`
[rows, V] bool. A request's row is set from the host at its final prefill chunk (prompt mask, and the counts of
the output it kept through a preemption: normally none), then every step that includes it adds its committed
tokens (accept length + 1 of them, read from the step's result on the device), before the host reads the result:
overlap scheduling needs no sync. Memory: rows x V x 5 bytes, allocated when the first request with penalties
arrives. A row's state is meaningful only while a request with penalties holds it.

How a tree is penalised without a [nodes, V] count tensor: the dense pass applies each request's committed
counts to all its nodes (broadcast), then each node's at most S path tokens are recomputed from the
pre-penalty logits with their full count (committed + occurrences on the path) and scattered back. Both use
`penalize`, the one formula, so a node's values equal plain decoding's bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spruce.errors import InvariantError
from spruce.limits import Limits


@dataclass
class PenaltyParams:
    """Per selection row (request, or tree node) penalties on the device: each [n] float32."""

    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor

    @staticmethod
    def build(params: list, to_device) -> "PenaltyParams | None":
        """From SamplingParams (`to_device(values, dtype)` repeats them per tree node); None when no request of
        the batch uses penalties."""
        if not any(p.has_penalties for p in params):
            return None
        return PenaltyParams(presence=to_device([p.presence_penalty for p in params], torch.float32),
                             frequency=to_device([p.frequency_penalty for p in params], torch.float32),
                             repetition=to_device([p.repetition_penalty for p in params], torch.float32))


@dataclass
class TokenHistory:
    """What penalties count (and bad words match) at each selection row. `counts` / `in_prompt` [b, V] are the
    batch's requests' committed output counts and prompt masks (None when no request has penalties); each
    request owns n / b consecutive selection rows (1 for plain decoding, N for a tree), and `path` [n, W] (W = 0
    plain) holds each row's extra generated tokens, with `path_valid` [n, W] marking the real ones. `recent`
    [n, P]: each row's last P generated tokens, most recent first, for bad words (runtime/token_restrictions.py;
    None when no request has any)."""

    counts: torch.Tensor | None  # [b, V] int32
    in_prompt: torch.Tensor | None  # [b, V] bool
    path: torch.Tensor | None  # [n, W] int64
    path_valid: torch.Tensor | None  # [n, W] bool
    recent: torch.Tensor | None = None  # [n, P] int64


def penalize(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, presence: torch.Tensor,
             frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """The penalty formula, elementwise over broadcastable tensors (logits float32, counts int, in_prompt bool,
    penalties float32). Penalties (0, 0, 1) leave the logits unchanged bit for bit."""
    generated = counts > 0
    scale = torch.where(in_prompt | generated, repetition, 1.0)
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    return logits - frequency * counts.to(torch.float32) - presence * generated.to(torch.float32)


def apply_penalties(logits: torch.Tensor, params: PenaltyParams, history: TokenHistory | None) -> torch.Tensor:
    """Penalised float32 logits [n, V] (a new tensor); see the module docstring."""
    if history is None or history.counts is None:
        raise InvariantError("penalties were requested but the token selection got no TokenHistory to count")
    n, vocab = logits.shape
    b = history.counts.shape[0]
    if history.counts.shape[1] != vocab or b == 0 or n % b or history.path.shape[0] != n:
        raise InvariantError(f"penalty history of {b} requests x {history.counts.shape[1]} tokens with paths "
                             f"{tuple(history.path.shape)} does not fit logits {tuple(logits.shape)}")
    nodes = n // b
    per_node = [t.view(b, nodes, 1) for t in (params.presence, params.frequency, params.repetition)]
    out = penalize(logits.view(b, nodes, vocab), history.counts[:, None], history.in_prompt[:, None],
                   *per_node).view(n, vocab)
    if history.path.shape[1] == 0:
        return out
    tokens, valid = history.path, history.path_valid  # [n, W]
    request = (torch.arange(n, device=logits.device) // nodes)[:, None]  # [n, 1]
    # occurrences of each entry's token among the row's valid path tokens; an invalid entry whose token is not
    # on the path thus recomputes the dense value, and duplicates write equal values (a deterministic scatter)
    on_path = ((tokens[:, :, None] == tokens[:, None, :]) & valid[:, None, :]).sum(-1).to(torch.int32)  # [n, W]
    fixed = penalize(logits.gather(1, tokens), history.counts[request, tokens] + on_path,
                     history.in_prompt[request, tokens], params.presence[:, None], params.frequency[:, None],
                     params.repetition[:, None])
    return out.scatter_(1, tokens, fixed)


def node_paths(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
               max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tree node's generated tokens below the root: itself and its ancestors of depth >= 1.

    tokens, parents (-1 for the root), depths: [bs, N]. Returns (path [bs*N, max_depth] int64, valid [bs*N,
    max_depth] bool); entry j is the node's ancestor j generations up (j = 0: the node itself)."""
    bs, n = tokens.shape
    node = torch.arange(n, device=tokens.device)[None, :].expand(bs, n)
    up = parents.clamp(min=0)
    path, valid = [], []
    for _ in range(max_depth):
        path.append(tokens.gather(1, node))
        valid.append(depths.gather(1, node) >= 1)
        node = up.gather(1, node)
    if not path:
        empty = torch.zeros(bs * n, 0, dtype=torch.int64, device=tokens.device)
        return empty, empty.bool()
    return torch.stack(path, -1).view(bs * n, max_depth), torch.stack(valid, -1).view(bs * n, max_depth)


class PenaltyState:
    """Per page-table row generated-token counts and prompt masks on the device (allocated on first use)."""

    def __init__(self, limits: Limits, vocab_size: int, device: torch.device):
        self.num_rows = limits.num_rows
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts: torch.Tensor | None = None  # [rows, V] int32
        self.in_prompt: torch.Tensor | None = None  # [rows, V] bool

    @property
    def nbytes(self) -> int:
        """Device bytes the state takes once allocated: rows x V x (4 + 1)."""
        return self.num_rows * self.vocab_size * 5

    def start(self, rows: list[int], prompts: list[list[int]], outputs: list[list[int]]) -> None:
        """Requests take `rows` (at their final prefill chunk): each row's prompt mask becomes its prompt, its
        counts those of `outputs` (the output kept through a preemption; empty otherwise). Host lists in, one
        non-blocking copy."""
        if self.output_counts is None:
            self.output_counts = torch.zeros(self.num_rows, self.vocab_size, dtype=torch.int32, device=self.device)
            self.in_prompt = torch.zeros(self.num_rows, self.vocab_size, dtype=torch.bool, device=self.device)
        v = self.vocab_size
        prompt_idx = [r * v + t for r, p in zip(rows, prompts) for t in set(p)]
        output_idx = [r * v + t for r, o in zip(rows, outputs) for t in o]
        host = torch.tensor(rows + prompt_idx + output_idx, dtype=torch.int64)
        rows_t, prompt_t, output_t = host.to(self.device, non_blocking=True).split(
            [len(rows), len(prompt_idx), len(output_idx)])
        self.output_counts[rows_t] = 0
        self.in_prompt[rows_t] = False
        self.in_prompt.view(-1)[prompt_t] = True
        self.output_counts.view(-1).index_add_(0, output_t, torch.ones_like(output_t, dtype=torch.int32))

    def commit(self, rows: list[int], batch_idx: list[int], result: torch.Tensor) -> None:
        """Count a step's committed tokens for `rows` (host list), whose results are rows `batch_idx` of `result`
        [bs, 1 + W] (accept length a, then a + 1 committed tokens and padding), without reading it back."""
        host = torch.tensor([rows, batch_idx], dtype=torch.int64)
        rows_t, idx = host.to(self.device, non_blocking=True).unbind(0)
        self.count(rows_t, result.index_select(0, idx))

    def count(self, rows: torch.Tensor, result: torch.Tensor) -> None:
        """output_counts[rows[i], t] += 1 for each of the a_i + 1 committed tokens t of result[i] ([b, 1 + W])."""
        tokens = result[:, 1:]  # [b, W]
        committed = torch.arange(tokens.shape[1], device=tokens.device)[None, :] <= result[:, :1]  # [b, W]
        flat = rows[:, None] * self.vocab_size + tokens
        self.output_counts.view(-1).index_add_(0, flat.reshape(-1), committed.reshape(-1).to(torch.int32))

    def history(self, rows: torch.Tensor, path: torch.Tensor | None = None,
                path_valid: torch.Tensor | None = None) -> TokenHistory:
        """The history of the requests in `rows` [b] (device); `path`/`path_valid` [n, W] for tree nodes."""
        if self.output_counts is None:
            raise InvariantError("penalties were requested but no request with penalties has started (no state)")
        if path is None:
            path = torch.zeros(rows.shape[0], 0, dtype=torch.int64, device=rows.device)
            path_valid = path.bool()
        return TokenHistory(self.output_counts[rows], self.in_prompt[rows], path, path_valid)
