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

A grammar's failure is its request's, never the engine's. llguidance never raises for a grammar problem: a matcher
that cannot go on (a compile error, a budget exceeded, a state with no continuation) enters an error state for
good, and its mask then allows eos alone. So every matcher is checked after each mask and each consume:
- at admission (`GrammarBackend.request_grammar`) the grammar is compiled and its first mask computed, within
  `GRAMMAR_BUDGET` and `COMPILE_SECONDS`; a failure there is an InvalidRequestError (a 400) naming it;
- later (any mask, a tree node's forked matcher, a committed token's consume) the request's `RequestGrammar.error`
  is set and the engine ends the request with finish_reason "error" and that message, keeping only the tokens its
  grammar took before.
A committed token that the matcher's own (healthy) mask refuses is still an engine bug (InvariantError).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from spruce.errors import InvalidRequestError, InvariantError
from spruce.structured_output import StructuredOutput

INSTALL_HINT = "pip install llguidance (a dependency of spruce: reinstall spruce to get it)"
GRAMMAR_TEXT_CACHE = 256  # constraints whose llguidance grammar text is kept (least recently used dropped)
WORD_BITS = 32
# The grammar budget of one request: llguidance's LLParserLimits, its defaults written out so that the budget does not
# move with the library (llguidance documents ~50k initial fuel, ~14k step fuel and ~20k items per ms). Each request
# gets a matcher of its own: copies of one matcher share its lexer and so its fuel, so one request that spent it
# would fail every other request of the same constraint.
GRAMMAR_BUDGET = {
    "max_grammar_size": 500_000,  # symbols in the compiled grammar's productions
    "initial_lexer_fuel": 1_000_000,  # building the lexer's regexes at compile time
    "step_lexer_fuel": 200_000,  # lexer work of one mask
    "step_max_items": 50_000,  # Earley items of one mask
    "max_items_in_row": 2_000,  # Earley items in one parser row
    "max_lexer_states": 250_000,  # lexer states over the request's life
}
COMPILE_SECONDS = 2.0  # wall-clock budget of compiling a grammar and computing its first mask at admission
# Compiling recurses once per level of a grammar's rule nesting (llguidance 1.9.1 on the CPU: a chain of 2,500 rules
# fits an 8 MiB stack, one of 3,000 overflows it, a segfault that kills the process; a 60,000-rule chain, a 1 MiB
# grammar, compiles within 256 MiB); grammars compile on a thread with this much (virtual) stack.
COMPILE_STACK_BYTES = 512 << 20
BUDGET_WORDS = ("too many", "too big", "limit", "max is")  # llguidance's messages for an exceeded budget
MAX_REASON_CHARS = 600  # of llguidance's error message, in a request's error


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
    """One per engine: the tokenizer as llguidance sees it, the compile thread, the grammar texts of recent
    constraints (an LRU cache keyed by the constraint), the executor that computes a batch's masks in parallel,
    and tree statistics."""

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
        self.limits = self.llg.LLParserLimits(verbose_errors=False, **GRAMMAR_BUDGET)
        self._texts: OrderedDict[StructuredOutput, str] = OrderedDict()
        self._texts_lock = threading.Lock()
        self._compiler = _compile_thread()
        self.tree_nodes = 0  # draft nodes masked so far (root excluded)
        self.dead_nodes = 0  # of those, nodes whose own token the grammar refused
        self.mask_seconds = 0.0  # host time spent building masks

    def request_grammar(self, spec: StructuredOutput, timed: bool = True) -> "RequestGrammar":
        """A fresh matcher for a new request, compiled and its first mask computed (on the compile thread, within
        COMPILE_SECONDS unless not `timed`). InvalidRequestError naming the field when the constraint does not
        compile, exceeds the grammar budget, or fails at its first mask (an empty language, a schema that refers
        only to itself); a 503 when the compile thread is still busy with an earlier grammar after
        COMPILE_SECONDS."""
        text = self._grammar_text(spec)
        job = self._compiler.submit(self._compile, text)
        try:
            matcher = job.result(timeout=COMPILE_SECONDS if timed else None)
        except FutureTimeout:
            if job.cancel():  # never started: the thread is still on an earlier request's grammar
                raise InvalidRequestError(f"{spec.field}: the grammar compiler is busy; retry later",
                                          field=spec.field, status=503) from None
            raise InvalidRequestError(f"{spec.field} exceeds the grammar budget: it did not compile within "
                                      f"{COMPILE_SECONDS:g} s", field=spec.field) from None
        if matcher.is_error():
            raise InvalidRequestError(describe_error(spec, matcher, "cannot be used"), field=spec.field)
        return RequestGrammar(matcher, spec)

    def _grammar_text(self, spec: StructuredOutput) -> str:
        """llguidance's grammar text for the constraint (cached); a 400 when the library refuses it outright."""
        with self._texts_lock:
            text = self._texts.get(spec)
            if text is not None:
                self._texts.move_to_end(spec)
                return text
        try:
            text = grammar_text(self.llg, spec)
        except ValueError as e:
            raise InvalidRequestError(f"{spec.kind} is not valid: {e}", field=spec.field) from None
        with self._texts_lock:
            self._texts[spec] = text
            if len(self._texts) > GRAMMAR_TEXT_CACHE:
                self._texts.popitem(last=False)
        return text

    def _compile(self, text: str):
        """A new matcher for `text` with its first mask computed (the compile thread runs this): in error when
        the grammar does not compile or cannot produce a first token."""
        matcher = self.llg.LLMatcher(self.tokenizer, text, log_level=0, limits=self.limits)
        if not matcher.is_error():
            self.llg.torch.fill_next_token_bitmask(matcher, self.new_masks(1))
        return matcher

    def new_masks(self, rows: int) -> torch.Tensor:
        """[rows, words] int32 host masks allowing every token."""
        return torch.full((rows, self.words), -1, dtype=torch.int32)


def grammar_text(llg, spec: StructuredOutput) -> str:
    """The llguidance grammar of a constraint. JSON is whitespace-free unless the schema's own
    `"x-guidance": {"whitespace_flexible": true}` asks for free whitespace: a small model otherwise spends its
    max_tokens on whitespace the grammar allows. ValueError when the library refuses the text."""
    if spec.kind in ("json_schema", "json_object"):
        return llg.LLMatcher.grammar_from_json_schema(spec.text, defaults={"whitespace_flexible": False})
    return llg.grammar_from({"regex": "regex", "grammar": "grammar", "choice": "choice"}[spec.kind], spec.text)


def describe_error(spec: StructuredOutput, matcher, what: str) -> str:
    """A client-facing message for a matcher in error: the constraint's field, `what` happened, llguidance's
    reason, and the budget when one was exceeded."""
    reason = matcher.get_error().replace("<non-verbose/>", "").strip() or matcher.stop_reason()
    if len(reason) > MAX_REASON_CHARS:  # llguidance quotes the grammar's text around the error
        reason = reason[:MAX_REASON_CHARS - 3] + "..."
    if reason in ("NoExtension", "NoExtensionBias"):
        return (f"{spec.field} {what}: no output can match it from here (llguidance: {reason}); a grammar whose "
                f"language is empty, such as a schema that only refers to itself, matches nothing")
    if any(w in reason for w in BUDGET_WORDS):
        budget = ", ".join(f"{k}={v:_}" for k, v in GRAMMAR_BUDGET.items())
        return f"{spec.field} {what}: it exceeds the grammar budget ({reason}; budget: {budget})"
    return f"{spec.field} {what}: {reason}"


def _compile_thread() -> ThreadPoolExecutor:
    """One thread that compiles grammars, with COMPILE_STACK_BYTES of stack."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spruce-grammar")
    with _STACK_LOCK:
        before = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            pool.submit(lambda: None).result()  # starts the pool's one thread with that stack
        finally:
            threading.stack_size(before)
    return pool


_STACK_LOCK = threading.Lock()


class RequestGrammar:
    """A request's matcher: it has consumed the request's committed output tokens and nothing else. `error`: the
    message of the grammar's failure (any of the request's matchers in error), after which the request ends with
    finish_reason "error"; None while the grammar is healthy."""

    def __init__(self, matcher, spec: StructuredOutput):
        self.matcher = matcher
        self.spec = spec
        self.error: str | None = None

    @property
    def stopped(self) -> bool:
        """The grammar is complete: it allows no token but eos (and the request ends)."""
        return self.matcher.is_stopped()

    def fail(self, matcher, what: str) -> None:
        """Record the grammar's failure (the first one stays) from `matcher`, one of this request's matchers in
        error."""
        if self.error is None:
            self.error = describe_error(self.spec, matcher, what)

    def advance(self, tokens: list[int]) -> int:
        """Consume a step's committed tokens up to the one that completes the grammar; returns how many were
        consumed (the rest are dropped: the request ends there). Once the grammar has failed (`error`, at this
        step's masks or at a token here) nothing more is consumed. Every committed token was chosen under this
        matcher's masks, so a refusal that leaves the matcher healthy is an engine bug: InvariantError."""
        consumed = 0
        for t in tokens:
            if self.error is not None or self.matcher.is_stopped():
                break
            if self.matcher.try_consume_tokens([t]) != 1:
                if not self._failed_at(t, f"failed at token {t} after {consumed} of this step's tokens {tokens}"):
                    raise InvariantError(f"committed token {t} is not allowed by the request's grammar after "
                                         f"{consumed} of this step's tokens {tokens}: the mask was not applied")
                break
            consumed += 1
        return consumed

    def _failed_at(self, token: int, what: str) -> bool:
        """After the matcher refused `token`: whether the grammar itself failed there (recorded in `error`). It did
        when its mask now fails (the matcher is in error, or a tree node's fork has spent the lexer, and its
        budget, that they share: the refusal then leaves this matcher's own error flag clear), or when its mask
        allows the token it refused. Otherwise its mask refuses the token: the mask was not applied."""
        probe = self.matcher.deep_copy()
        bits = probe.compute_bitmask()  # one bit per token: token t is bit t % 8 of byte t // 8
        if probe.is_error():
            self.fail(probe, what)
            return True
        if bits[token // 8] >> (token % 8) & 1:
            self.error = f"{self.spec.field} {what}: the grammar library refused a token its own mask allows"
            return True
        return False


class GrammarBatch:
    """The grammar side of one step: each batch row's request grammar (None: unconstrained row)."""

    def __init__(self, backend: GrammarBackend, grammars: list[RequestGrammar | None]):
        self.backend = backend
        self.grammars = grammars

    def row_masks(self, device) -> torch.Tensor:
        """One mask per batch row (plain decoding, the prefill's first token): [bs, words] int32 on `device`. A row
        whose matcher is in error afterwards fails its request's grammar (its step's tokens are then dropped)."""
        start = time.perf_counter()
        masks = self.backend.new_masks(len(self.grammars))
        live = [(g.matcher, i) for i, g in enumerate(self.grammars) if g is not None]
        self._fill(live, masks)
        for g in self.grammars:
            if g is not None and g.matcher.is_error():
                g.fail(g.matcher, "failed computing its next-token mask")
        self.backend.mask_seconds += time.perf_counter() - start
        return _to_device(masks, device)

    def tree_masks(self, tokens: torch.Tensor, parents: torch.Tensor, device) -> torch.Tensor:
        """One mask per tree node: [bs*N, words] int32 on `device`. tokens, parents [bs, N] (node 0 the root,
        parents before children). Reads the tree back to the host: the round's one mid-round sync. Any of a
        request's matchers (its own, a node's fork) in error after the masks fails the request's grammar: a fork
        shares its lexer, and with it the budget, with the request's matcher. A fork that fails at its draft
        token's consume is a dead node: should its parent's mask allow the token and the target choose it, the
        request's own matcher fails at that token when the step is resolved."""
        tokens_h, parents_h = tokens.tolist(), parents.tolist()
        start = time.perf_counter()
        bs, n = len(tokens_h), len(tokens_h[0]) if tokens_h else 0
        masks = self.backend.new_masks(bs * n)
        live, dead = [], []  # (matcher, mask row); (dead mask row, its parent's mask row)
        owner = {}  # mask row // n -> the request's grammar, for the rows in `live`
        for b, g in enumerate(self.grammars):
            if g is None:
                continue
            owner[b] = g
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
        for matcher, row in live:
            if matcher.is_error():
                owner[row // n].fail(matcher, "failed computing a next-token mask")
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
