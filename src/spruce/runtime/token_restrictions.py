"""Token restrictions: `allowed_token_ids` and `bad_words` (vLLM's semantics), lossless under tree speculation.

Both set a restricted token's logit to -inf, before logit_bias, min_tokens and penalties (vLLM's order), at every
row that chooses a token: a request's plain decode row, its final prefill chunk, or each node of its verify tree.

allowed_token_ids: a [b, V] bool mask per request (True: allowed), broadcast over the request's rows.

bad_words (tokenized by SamplingParams.bad_words_token_ids): a sequence (t_1 .. t_l) forbids t_l where the tokens
generated before the position being chosen end with t_1 .. t_{l-1} (l = 1: always; the prompt does not count,
as in vLLM). What a row sees, its `recent` tokens: for plain decoding and a final prefill chunk, the request's
committed output; for a tree node, the committed output and then the node's path below the root (its ancestors
of depth >= 1 and itself: the root is the last committed token), so every node is masked exactly as plain
decoding masks that position.

    bad word "self.x" -> [294, 16, 90]: last token 90, prefix [16, 294] (most recent first)
    a row whose recent tokens are [16, 294, ...] (it just generated "self" then ".") may not choose 90

State on the device (`OutputTails`), per page-table row: the last T = MAX_BAD_WORD_TOKENS - 1 generated tokens,
most recent first, -1 where fewer were generated. A request's row is set from the host at its final prefill
chunk (from the output it kept through a preemption: normally none), then every step that includes it shifts in
its committed tokens, read from the step's result on the device, so the host never waits (overlap scheduling
works as without restrictions). Allocated when the first request with bad words arrives: rows x T x 8 bytes.
Nothing here runs for a batch whose requests set neither field.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spruce.errors import InvariantError
from spruce.limits import Limits
from spruce.sampling_params import MAX_BAD_WORD_TOKENS

NO_TOKEN = -1  # a tail entry before the first generated token: equal to no token id
TAIL_WIDTH = MAX_BAD_WORD_TOKENS - 1  # T: the longest prefix a bad word may have


def allowed_mask(allowed: list[tuple[int, ...] | None], vocab_size: int, device) -> torch.Tensor | None:
    """[b, V] bool: True where request i may choose the token (None in `allowed`: every token); None when no
    request restricts. Built on the device from the padded ids (one small copy, not b x V bytes)."""
    if all(a is None for a in allowed):
        return None
    width = max(len(a) for a in allowed if a is not None)
    ids = [list(a) + [a[0]] * (width - len(a)) if a else [0] * width for a in allowed]  # padding repeats an id
    host = torch.tensor(ids, dtype=torch.int64)
    free = torch.tensor([a is None for a in allowed])
    ids_d, free_d = host.to(device, non_blocking=True), free.to(device, non_blocking=True)
    mask = torch.zeros(len(allowed), vocab_size, dtype=torch.bool, device=device).scatter_(1, ids_d, True)
    return mask | free_d[:, None]


@dataclass
class BadWords:
    """A batch's bad words, per request (not per tree node): B sequences at most, P the longest prefix."""

    last: torch.Tensor  # [b, B] int64 each sequence's last token (padding: 0, never valid)
    prefix: torch.Tensor  # [b, B, P] int64 its other tokens, most recent first (padding: NO_TOKEN)
    needed: torch.Tensor  # [b, B, P] bool which prefix entries must match (False past a sequence's prefix)
    valid: torch.Tensor  # [b, B] bool real sequences

    @property
    def width(self) -> int:
        """P: how many recent tokens a row must show (the batch's longest prefix)."""
        return self.prefix.shape[2]

    @staticmethod
    def build(sequences: list[tuple[tuple[int, ...], ...]], device) -> "BadWords | None":
        """From each request's tokenized bad words (SamplingParams.bad_words_token_ids); None when none has any."""
        if not any(sequences):
            return None
        b, words = len(sequences), max(1, max(len(s) for s in sequences))
        width = max((len(w) - 1 for s in sequences for w in s), default=0)
        last, prefix, needed, valid = [], [], [], []
        for seqs in sequences:
            padded = list(seqs) + [()] * (words - len(seqs))
            last.append([w[-1] if w else 0 for w in padded])
            valid.append([bool(w) for w in padded])
            rev = [list(reversed(w[:-1])) for w in padded]
            prefix.append([r + [NO_TOKEN] * (width - len(r)) for r in rev])
            needed.append([[True] * len(r) + [False] * (width - len(r)) for r in rev])
        host = torch.tensor([last, valid], dtype=torch.int64).to(device, non_blocking=True)
        grid = torch.tensor([prefix, needed], dtype=torch.int64).view(2, b, words, width).to(device, non_blocking=True)
        return BadWords(last=host[0], prefix=grid[0], needed=grid[1].bool(), valid=host[1].bool())


def banned_by_bad_words(bad: BadWords, recent: torch.Tensor) -> torch.Tensor:
    """[n, B] bool: whether each row's (n = b x nodes) recent tokens [n, P] (most recent first) end with each of
    its request's prefixes, i.e. whether the sequence's last token is banned at that row."""
    b, words, width = bad.prefix.shape
    n = recent.shape[0]
    if recent.shape[1] != width or (b and n % b) or (not b and n):
        raise InvariantError(f"bad words of {b} requests x {words} x {width} do not fit recent tokens "
                             f"{tuple(recent.shape)}")
    nodes = n // b if b else 0
    seen = recent.view(b, nodes, 1, width)
    match = ((bad.prefix[:, None] == seen) | ~bad.needed[:, None]).all(-1) & bad.valid[:, None]  # [b, nodes, B]
    return match.view(n, words)


def restrict_tokens(logits: torch.Tensor, allowed: torch.Tensor | None, bad: BadWords | None,
                    recent: torch.Tensor | None) -> torch.Tensor:
    """float32 logits [n, V] (n = b x nodes rows, each request's rows consecutive) with -inf outside `allowed`
    [b, V] and at the last token of every bad word whose prefix `recent` [n, P] ends with (a new tensor)."""
    n, vocab = logits.shape
    if allowed is not None:
        b = allowed.shape[0]
        if b == 0 or n % b:
            raise InvariantError(f"allowed_token_ids of {b} requests do not fit logits {tuple(logits.shape)}")
        logits = logits.view(b, n // b, vocab).masked_fill(~allowed[:, None], float("-inf")).view(n, vocab)
    if bad is not None:
        if recent is None:
            raise InvariantError("bad words were requested but the token selection got no recent tokens to match")
        banned = banned_by_bad_words(bad, recent)  # [n, B]
        b, words = bad.last.shape
        last = bad.last[:, None].expand(b, n // b, words).reshape(n, words)
        logits = logits.scatter_add(1, last, torch.where(banned, float("-inf"), 0.0))
    return logits


def recent_tokens(tails: torch.Tensor, width: int, path: torch.Tensor | None = None,
                  path_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's last `width` generated tokens, most recent first: [n, width].

    tails [b, T]: the requests' committed output tails (OutputTails). Without `path`, n = b. With a tree's
    `path` / `path_valid` [n, S] (runtime/penalties.py's node_paths: entry j the node's ancestor j generations
    up, valid while its depth >= 1), n = b x nodes and a node of depth d sees its d path tokens, then its
    request's tail: e.g. d = 2, path [x2, x1, ...], tail [r, t1, ...] -> [x2, x1, r, t1, ...]."""
    if path is None:
        return tails[:, :width]
    n, steps = path.shape
    b = tails.shape[0]
    if b == 0 or n % b:
        raise InvariantError(f"tails of {b} requests do not fit tree paths {tuple(path.shape)}")
    rows_tail = tails.repeat_interleave(n // b, dim=0)  # [n, T]
    depth = path_valid.sum(dim=1, keepdim=True)  # [n, 1]
    k = torch.arange(width, device=path.device)[None, :]  # [1, width]
    idx = torch.where(k < depth, k, steps + k - depth)  # [n, width] into [path | tail]
    return torch.cat([path, rows_tail], dim=1).gather(1, idx)


class OutputTails:
    """Per page-table row, the last TAIL_WIDTH generated tokens on the device, most recent first (module
    docstring); allocated on first use."""

    def __init__(self, limits: Limits, device: torch.device):
        self.num_rows = limits.num_rows
        self.device = device
        self.tails: torch.Tensor | None = None  # [rows, T] int64

    def start(self, rows: list[int], outputs: list[list[int]]) -> None:
        """Requests take `rows` (at their final prefill chunk): each row's tail becomes the end of its output
        (the output kept through a preemption; empty otherwise). Host lists in, one non-blocking copy."""
        if self.tails is None:
            self.tails = torch.full((self.num_rows, TAIL_WIDTH), NO_TOKEN, dtype=torch.int64, device=self.device)
        if not rows:
            return
        tails = [(list(reversed(o[-TAIL_WIDTH:])) + [NO_TOKEN] * TAIL_WIDTH)[:TAIL_WIDTH] for o in outputs]
        host = torch.tensor([[r] + t for r, t in zip(rows, tails)], dtype=torch.int64)
        both = host.to(self.device, non_blocking=True)
        self.tails[both[:, 0]] = both[:, 1:]

    def commit(self, rows: list[int], batch_idx: list[int], result: torch.Tensor) -> None:
        """Shift a step's committed tokens into the tails of `rows` (host list), whose results are rows `batch_idx`
        of `result` [bs, 1 + W] (accept length a, then a + 1 committed tokens and padding), without reading it
        back."""
        if not rows:
            return
        host = torch.tensor([rows, batch_idx], dtype=torch.int64)
        rows_t, idx = host.to(self.device, non_blocking=True).unbind(0)
        self.tails[rows_t] = shifted_tails(self.tails[rows_t], result.index_select(0, idx))

    def recent(self, rows: torch.Tensor, width: int, path: torch.Tensor | None = None,
               path_valid: torch.Tensor | None = None) -> torch.Tensor:
        """`recent_tokens` of the requests in `rows` [b] (device)."""
        if self.tails is None:
            raise InvariantError("bad words were requested but no request with bad words has started (no state)")
        return recent_tokens(self.tails[rows], width, path, path_valid)


def shifted_tails(tails: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """tails [b, T] (most recent first) after result [b, 1 + W]'s a + 1 committed tokens: e.g. T = 3, tail
    [5, 4, 3], a = 1, tokens [6, 7, pad] -> [7, 6, 5]."""
    a = result[:, :1]  # [b, 1]
    width = result.shape[1] - 1
    k = torch.arange(tails.shape[1], device=tails.device)[None, :]  # [1, T]
    idx = torch.where(k <= a, 1 + a - k, 1 + width + k - a - 1)  # into [result | tails]
    return torch.cat([result, tails], dim=1).gather(1, idx)
