"""Structured output on the host (llguidance): each request's grammar matcher, the token masks a step applies
to the target's logits, and the masking itself.

- A request's matcher (`RequestGrammar`) has consumed exactly its committed output tokens. The engine advances
  it when it resolves a step (accepted path + bonus) and ends the request once the grammar is complete.
- Plain decoding and the prefill's first token take one mask per request: its matcher's next-token mask.
- A verify tree takes one mask per node: node i's row of the verify logits chooses the token after the path
  root..i, so its mask is the matcher's after consuming the path's draft tokens. Each node's state is a copy
  of its parent's (the matcher forked per branch) advanced by the node's token; the request's own matcher is
  never touched, so nothing has to be rolled back when the branch is rejected. A node whose token the grammar
  refuses after its parent's path is dead: its parent's masked target can never choose it, so neither it nor
  its subtree can be accepted; it gets its parent's mask (any mask would do).
- Masks are llguidance's packed bitmask, int32 [rows, ceil(V / 32)], bit j of word w allowing token 32w + j.
  `apply_token_mask` sets the refused logits to -inf out of place: the raw logits stay what logprobs score.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from spruce.errors import InvalidRequestError, InvariantError
from spruce.structured_output import StructuredOutput

INSTALL_HINT = "pip install 'spruce[grammar]' (it adds the llguidance package)"
COMPILED_CACHE = 256  # compiled grammars kept (least recently used dropped)
WORD_BITS = 32


def import_llguidance(field: str | None = None):
    """The llguidance module, or an InvalidRequestError naming the request field that needs it."""
    try:
        import llguidance
        import llguidance.torch  # noqa: F401  (the bitmask helpers)
    except ImportError:
        raise InvalidRequestError(f"{field or 'structured output'} needs the llguidance package, which is not "
                                  f"installed: {INSTALL_HINT}", field=field) from None
    return llguidance


def mask_words(vocab_size: int) -> int:
    """int32 words per mask row."""
    return (vocab_size + WORD_BITS - 1) // WORD_BITS


class GrammarBackend:
    """One per engine: the tokenizer as llguidance sees it, compiled grammars (an LRU cache keyed by the
    constraint), the executor that computes a batch's masks in parallel, and tree statistics."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], field: str):
        self.llg = import_llguidance(field)
        try:
            self.tokenizer = self.llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                  eos_token=list(eos_token_ids) or None)
        except Exception as e:  # llguidance raises plain exceptions for tokenizers it cannot read
            raise InvalidRequestError(f"{field}: the grammar library cannot use this model's tokenizer: {e}",
                                      field=field) from None
        self.vocab_size = vocab_size
        self.words = mask_words(vocab_size)
        self.executor = self.llg.LLExecutor()
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()
        self.tree_nodes = 0  # draft nodes masked so far (root excluded)
        self.dead_nodes = 0  # of those, nodes whose own token the grammar refused
        self.mask_seconds = 0.0  # host time spent building masks

    def request_grammar(self, spec: StructuredOutput) -> "RequestGrammar":
        """A fresh matcher for a new request; InvalidRequestError (naming the field) when the constraint does
        not compile."""
        template = self._compiled.get(spec)
        if template is None:
            template = self._compile(spec)
            self._compiled[spec] = template
            if len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec)
        return RequestGrammar(template.deep_copy())

    def _compile(self, spec: StructuredOutput):
        kind = {"json_schema": "json_schema", "json_object": "json_schema", "regex": "regex",
                "grammar": "grammar", "choice": "choice"}[spec.kind]
        try:
            text = self.llg.grammar_from(kind, spec.text)
        except ValueError as e:
            raise InvalidRequestError(f"{spec.kind} is not valid: {e}", field=spec.field) from None
        matcher = self.llg.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{spec.kind} is not valid: {matcher.get_error()}", field=spec.field)
        return matcher

    def new_masks(self, rows: int) -> torch.Tensor:
        """[rows, words] int32 host masks allowing every token."""
        return torch.full((rows, self.words), -1, dtype=torch.int32)


class RequestGrammar:
    """A request's matcher: it has consumed the request's committed output tokens and nothing else."""

    def __init__(self, matcher):
        self.matcher = matcher

    @property
    def stopped(self) -> bool:
        """The grammar is complete: it allows no token but eos (and the request ends)."""
        return self.matcher.is_stopped()

    def advance(self, tokens: list[int]) -> int:
        """Consume a step's committed tokens up to the one that completes the grammar; returns how many were
        consumed (the rest are dropped: the request ends there). Every committed token was chosen under this
        matcher's masks, so a refusal is an engine bug: InvariantError."""
        consumed = 0
        for t in tokens:
            if self.matcher.is_stopped():
                break
            if self.matcher.try_consume_tokens([t]) != 1:
                raise InvariantError(f"committed token {t} is not allowed by the request's grammar after "
                                     f"{consumed} of this step's tokens {tokens}: the mask was not applied")
            consumed += 1
        return consumed


class GrammarBatch:
    """The grammar side of one step: each batch row's request grammar (None: unconstrained row)."""

    def __init__(self, backend: GrammarBackend, grammars: list[RequestGrammar | None]):
        self.backend = backend
        self.grammars = grammars

    def row_masks(self, device) -> torch.Tensor:
        """One mask per batch row (plain decoding, the prefill's first token): [bs, words] int32 on `device`."""
        start = time.perf_counter()
        masks = self.backend.new_masks(len(self.grammars))
        live = [(g.matcher, i) for i, g in enumerate(self.grammars) if g is not None]
        self._fill(live, masks)
        self.backend.mask_seconds += time.perf_counter() - start
        return _to_device(masks, device)

    def tree_masks(self, tokens: torch.Tensor, parents: torch.Tensor, device) -> torch.Tensor:
        """One mask per tree node: [bs*N, words] int32 on `device`. tokens, parents [bs, N] (node 0 the root,
        parents before children). Reads the tree back to the host: the round's one mid-round sync."""
        tokens_h, parents_h = tokens.tolist(), parents.tolist()
        start = time.perf_counter()
        bs, n = len(tokens_h), len(tokens_h[0]) if tokens_h else 0
        masks = self.backend.new_masks(bs * n)
        live, dead = [], []  # (matcher, mask row); (dead mask row, its parent's mask row)
        for b, g in enumerate(self.grammars):
            if g is None:
                continue
            states = [g.matcher] + [None] * (n - 1)
            live.append((g.matcher, b * n))
            for i in range(1, n):
                parent = states[parents_h[b][i]]
                if parent is not None:
                    state = parent.deep_copy()
                    if state.try_consume_tokens([tokens_h[b][i]]) == 1:
                        states[i] = state
                        live.append((state, b * n + i))
                        continue
                dead.append((b * n + i, b * n + parents_h[b][i]))
            self.backend.tree_nodes += n - 1
        self._fill(live, masks)
        for row, parent_row in dead:  # in node order: a dead parent's row is filled before its children's
            masks[row] = masks[parent_row]
        self.backend.dead_nodes += len(dead)
        self.backend.mask_seconds += time.perf_counter() - start
        return _to_device(masks, device)

    def _fill(self, live: list, masks: torch.Tensor) -> None:
        if live:
            self.backend.llg.torch.fill_next_token_bitmask_par(self.backend.executor, live, masks)


def _to_device(masks: torch.Tensor, device) -> torch.Tensor:
    if torch.device(device).type == "cuda":  # page-locked, so the copy does not wait for queued device work
        return masks.pin_memory().to(device, non_blocking=True)
    return masks.to(device)


def allowed_tokens(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack masks [n, words] int32 into [n, vocab_size] bool (True: the grammar allows the token)."""
    shifts = torch.arange(WORD_BITS, dtype=torch.int32, device=masks.device)
    return ((masks[:, :, None] >> shifts) & 1).view(masks.shape[0], -1)[:, :vocab_size].bool()


def apply_token_mask(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """float32 logits [n, V] with the tokens `masks` [n, words] refuses set to -inf (a new tensor)."""
    return logits.float().masked_fill(~allowed_tokens(masks, logits.shape[-1]), float("-inf"))
