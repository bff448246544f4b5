"""Mixed steps (plain decoding): prompt chunks and every decoding request's next token in one forward.

A prefill step and a decode step each stream all of the target's weights from memory; at the sizes users serve
(an 8B model: ~5 ms of weights a step) a prompt's prefill as a step of its own stalls the decode batch for that
long. A mixed step runs both in one EXTEND forward (vLLM's chunked prefill under `max_num_batched_tokens`):

    tokens  [ chunk a (prompt tokens) | chunk b | d0 | d1 | ... ]      one forward, weights read once
    samples         a's last token ^  b's ^      d0   d1  ...          (b's only if it is its prompt's final chunk)

A decode row is an extend of one token: the request's last token at its position `committed`, exactly what a
decode step feeds (runtime/row_state.py). Under overlap that token is not on the host yet (the step in flight
samples it), so it is gathered on the device from `RowState.last_token` into the batch's input ids
(`ModelRunner.prefill_forward(set_ids=...)`); the host knows its position all the same, because a plain decode
step commits exactly one token: the device's committed length is the host's plus one per decode step in flight
that includes the request (`decode_positions`). The host needs those positions: the EXTEND batch's page slots and
attention plan are built from them.

Each sampled row is chosen exactly as a separate step would choose it: by `select_tokens` at the position of the
token it chooses (a decode row's input position + 1; a final chunk's prompt length), with the request's seed, its
penalties' history and its grammar mask, so greedy and seeded outputs are the same with mixing on or off (up to
the arithmetic of a different kernel on a GPU: an EXTEND forward instead of a DECODE one). Result rows: the final
chunks' first, then the decode rows', each [accept length 0, token] (`Limits.plain_result_width`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from spruce.errors import InvariantError
from spruce.runtime.grammar import GrammarBatch, apply_token_mask
from spruce.runtime.logprobs import LogprobPlan, pack_prefill
from spruce.runtime.penalties import TokenHistory
from spruce.runtime.sampler import SamplingTensors, select_tokens

if TYPE_CHECKING:
    from spruce.runtime.model_runner import ModelRunner
    from spruce.runtime.request import Request
    from spruce.runtime.strategy import PrefillChunk


def decode_positions(reqs: list[Request], decoding_in_flight: Iterable[Request]) -> list[int]:
    """The position of each decoding request's input token (its last token, which has no KV yet) on the device
    when the next step runs: its host-known committed length, plus one if the step in flight decodes it (a plain
    decode row commits exactly one token). E.g. committed 12 on the host, decoded by the step in flight: 13."""
    ahead = {id(q) for q in decoding_in_flight}
    return [q.committed + (id(q) in ahead) for q in reqs]


def check_decode_positions(runner: ModelRunner, rows: list[int], positions: list[int]) -> None:
    """Debug check (reads the device): the host's positions are the rows' committed lengths on the device."""
    on_device = runner.row_state.committed[torch.tensor(rows, device=runner.device)].tolist()
    if on_device != positions:
        raise InvariantError(f"mixed step: decode rows {rows} are at positions {on_device} on the device, but the "
                             f"host planned {positions}")


def mixed_forward(runner: ModelRunner, chunks: list[PrefillChunk], decode_rows: list[int], positions: list[int],
                  sampling: SamplingTensors, history: Callable[[torch.Tensor], TokenHistory | None],
                  logprobs: LogprobPlan | None = None, grammar: GrammarBatch | None = None) -> torch.Tensor:
    """One forward over the prompt `chunks` and one token per decoding request (page-table `decode_rows`, input
    tokens at `positions`); samples after every final chunk and every decode row, and sets their rows' state.

    `sampling` (and `grammar`, if any) has one row per result row: the final chunks', then the decode rows';
    `history(rows)` is what penalties count for result rows on `rows` [n] (device). `logprobs`: score the sampled
    tokens of its result rows and the prompt rows of its chunks (their token rows lead the batch, as in a
    prefill). Returns [results, Limits.plain_result_width] on the device (module docstring); reads nothing back."""
    r = runner
    num_prompt = sum(len(c.tokens) for c in chunks)
    ends = [n - 1 for n in itertools.accumulate(len(c.tokens) for c in chunks)]  # each chunk's last token
    finals = [i for i, c in enumerate(chunks) if c.final]
    picked = [ends[i] for i in finals] + list(range(num_prompt, num_prompt + len(decode_rows)))  # [results]
    rows = [chunks[i].row for i in finals] + decode_rows
    chosen_at = [chunks[i].start + len(chunks[i].tokens) for i in finals] + [p + 1 for p in positions]
    host = torch.tensor([picked, rows, chosen_at], dtype=torch.int64)
    idx, rows_t, chosen_t = host.to(r.device, non_blocking=True).unbind(0)  # each [results]
    decoding = slice(len(finals), None)
    last_tokens = r.row_state.last_token[rows_t[decoding]]  # [decode rows]: after the step in flight wrote them
    hidden, _ = r.prefill_forward([c.row for c in chunks] + decode_rows, [c.start for c in chunks] + positions,
                                  [c.tokens for c in chunks] + [[0]] * len(decode_rows), aux=False,
                                  set_ids=(idx[decoding], last_tokens))
    logits = r.target.compute_logits(hidden[idx])  # [results, V]
    chosen_from = logits if grammar is None else apply_token_mask(logits, grammar.row_masks(r.device))
    tokens = select_tokens(chosen_from, sampling, chosen_t, history(rows_t))  # [results]
    r.row_state.set(rows_t, chosen_t, tokens)
    result = torch.zeros(len(rows), r.limits.plain_result_width, dtype=torch.int64, device=r.device)
    result[:, 1] = tokens
    if logprobs is not None:
        logprobs.pack = pack_prefill(logprobs, logits, tokens, hidden, r.target.compute_logits)
    return result
