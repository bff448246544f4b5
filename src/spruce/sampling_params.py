"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from spruce.errors import InvalidRequestError
from spruce.models.tokenizer import check_text
from spruce.structured_output import StructuredOutput, structured_output_of

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20  # most top alternatives per position (vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit)
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
# repetition_penalty lies in [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY]: SGLang's (0, 2] (vLLM: > 0), cut
# at 0.01 below, since a logit divided by a penalty near 0 (1e-300 is 0.0 in float32) is infinite
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 2.0
MAX_ALLOWED_TOKEN_IDS = 2**18  # allowed_token_ids entries per request (the largest vocabularies: 262144 tokens)
MAX_BAD_WORDS = 128  # bad_words per request, and token sequences after tokenization (vLLM's VLLM_MAX_NUM_BAD_WORDS)
MAX_BAD_WORD_CHARS = 256  # characters per bad word
MAX_BAD_WORD_TOKENS = 32  # tokens per tokenized bad word: the last MAX_BAD_WORD_TOKENS - 1 outputs are matched
MAX_BAD_WORDS_TOTAL_TOKENS = 1024  # tokens of all tokenized bad words of a request (vLLM's limit)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    temperature == 0 means greedy; a temperature below SAMPLING_EPS (1e-5) is normalised to 0 (greedy, vLLM's
    convention): it differs from greedy only on near-exact logit ties, and dividing float32 logits by, say,
    1e-39 gives inf and a NaN softmax.
    top_k <= 0 (or -1) means no top-k cut; top_p == 1 means no nucleus cut.
    `seed` makes sampling reproducible per request, independent of what else is in the batch.
    `stop` strings end generation; the text is cut before the stop string. `stop_token_ids` (at most
    MAX_STOP_TOKEN_IDS, each >= 0; the engine's vocabulary bounds them above) end it too.
    `logprobs` (vLLM's meaning): None = none; n in [0, MAX_LOGPROBS] = each generated token's logprob plus its
    n most likely alternatives (0: the chosen token's alone). `prompt_logprobs` likewise for the prompt tokens
    (the first has none). Logprobs are the target's raw distribution: float32 log-softmax of its logits, before
    temperature, top-k and top-p (vLLM v1's default "raw logprobs"), identical with and without speculation.
    Logit processors, applied to the target's logits at every position it chooses (every tree node too):
    `logit_bias` {token id: bias in [-100, 100]} is added to the logits; `min_tokens` masks the stop tokens (eos
    unless ignored, and stop_token_ids) until that many tokens are generated; then, after temperature, `min_p`
    drops tokens whose probability is below min_p times the top one (vLLM's order: processors, temperature,
    min_p, top-k, top-p). Greedy requests take the argmax of the processed logits.
    Structured output (at most one; the `llguidance` package, a dependency): `json_schema` (a dict
    or its JSON text), `json_object` (any JSON object), `regex`, `grammar` (Lark-style EBNF or GBNF) or
    `choice` (a list of strings). The output is constrained to match it: at every position the target's logits
    are masked (-inf) to the tokens the grammar allows, before the processors and temperature (logprobs stay
    the raw distribution). Generation ends when the grammar is complete and allows nothing but eos, or with
    eos where the grammar may end; `min_tokens` cannot be combined with it (the grammar decides the end).

    Token restrictions (vLLM's, applied before the processors above; a restricted token gets -inf):
    `allowed_token_ids` (None: all; else a non-empty list of ids, stored sorted without repeats): only these may
    be chosen. `bad_words` (strings, stored without repeats): each is tokenized twice, as written (leading
    spaces stripped) and with one leading space, without special tokens; the spaced form is kept only when it
    starts with another token and has as many tokens (vLLM's rule: the word inside a text). A bad word of one
    token is never chosen; of several, its last token is not chosen where the generated tokens (the output, not
    the prompt) end with its other tokens. `bad_words_token_ids` does the tokenization (the engine calls it).

    Penalties (vLLM's semantics, after logit_bias and min_tokens, before temperature; runtime/penalties.py):
    `repetition_penalty` in [0.01, 2] (1 = off; SGLang's range, vLLM takes any value > 0) divides the positive logits and multiplies the negative ones of every
    token in the prompt or generated so far; `frequency_penalty` in [-2, 2] times a token's count among the
    generated tokens and `presence_penalty` in [-2, 2] (once, if it was generated) are subtracted.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # a dict {token id: bias} is accepted and stored sorted
    min_tokens: int = 0
    # structured output (structured_output.py): at most one of these
    json_schema: str | dict | None = None  # stored as its JSON text
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str)
                           else _as_tuple("stop", self.stop, "a string or a list of strings"))
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids,
                                                             "a list of token ids"))
        for name in ("ignore_eos", "json_object"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be True or False, got {getattr(self, name)!r}", field=name)
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}", field="max_tokens")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", field="temperature")
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)
        _check_number("top_p", self.top_p)
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", field="top_p")
        _check_int("top_k", self.top_k)
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be >= 1, or -1/0 for no limit, got {self.top_k}", field="top_k")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not (0 <= self.seed < 2**63):
                raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed}", field="seed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}", field="stop")
            check_text(s, "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got "
                                      f"{len(self.stop_token_ids)}", field="stop_token_ids")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
            if t < 0:
                raise InvalidRequestError(f"stop_token_ids must be >= 0, got {t}", field="stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _check_int(name, value)
            if not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"{name}={value} is out of range: it must be between 0 and {MAX_LOGPROBS} (the number of top "
                    f"alternatives returned per token; 0 = only the chosen token's logprob)", field=name)

        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", field="min_p")
        bias = self.logit_bias if self.logit_bias is not None else ()
        if isinstance(bias, dict):
            bias = bias.items()
        elif not isinstance(bias, (list, tuple)):
            raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}",
                                      field="logit_bias")
        try:
            pairs = tuple(sorted((int(t) if not isinstance(t, bool) else t, b) for t, b in bias))
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}",
                                      field="logit_bias") from None
        if len(pairs) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias has {len(pairs)} entries; at most {MAX_LOGIT_BIAS} are allowed",
                                      field="logit_bias")
        for t, b in pairs:
            _check_int("logit_bias", t)
            _check_number("logit_bias", b)
            if t < 0 or not -100.0 <= b <= 100.0:
                raise InvalidRequestError(f"logit_bias entries must be token id >= 0: bias in [-100, 100], got "
                                          f"{t}: {b}", field="logit_bias")
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in pairs))
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                                      f"{self.min_tokens}", field="min_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidRequestError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}", field=name)
            object.__setattr__(self, name, float(value))
        _check_number("repetition_penalty", self.repetition_penalty)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}] (1 = no penalty, "
                f"above 1 discourages repeats; SGLang's range, cut at {MIN_REPETITION_PENALTY}: a logit divided by a "
                f"penalty near 0 is infinite), got {self.repetition_penalty}", field="repetition_penalty")
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))
        self._check_token_restrictions()
        self._check_structured_output()

    def _check_token_restrictions(self) -> None:
        """allowed_token_ids: None or 1..MAX_ALLOWED_TOKEN_IDS ints >= 0 (the vocabulary bounds them above:
        check_vocab); bad_words: at most MAX_BAD_WORDS non-empty strings of at most MAX_BAD_WORD_CHARS."""
        if self.allowed_token_ids is not None:
            ids = _as_tuple("allowed_token_ids", self.allowed_token_ids, "a list of token ids")
            if not ids:
                raise InvalidRequestError("allowed_token_ids is empty: give at least one token id, or leave it out "
                                          "(null: every token is allowed)", field="allowed_token_ids")
            if len(ids) > MAX_ALLOWED_TOKEN_IDS:
                raise InvalidRequestError(f"allowed_token_ids has {len(ids)} entries; at most {MAX_ALLOWED_TOKEN_IDS} "
                                          f"are allowed", field="allowed_token_ids")
            for t in ids:
                _check_int("allowed_token_ids", t)
            negative = [t for t in ids if t < 0]
            if negative:
                raise InvalidRequestError(f"allowed_token_ids must be token ids >= 0, got {negative[:5]}",
                                          field="allowed_token_ids")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(ids))))
        words = _as_tuple("bad_words", self.bad_words, "a list of strings")
        if len(words) > MAX_BAD_WORDS:
            raise InvalidRequestError(f"bad_words has {len(words)} entries; at most {MAX_BAD_WORDS} are allowed",
                                      field="bad_words")
        for w in words:
            if not isinstance(w, str) or not w.strip():
                raise InvalidRequestError(f"bad_words must be non-empty strings (not only spaces), got {w!r}",
                                          field="bad_words")
            if len(w) > MAX_BAD_WORD_CHARS:
                raise InvalidRequestError(f"bad_words entries must be at most {MAX_BAD_WORD_CHARS} characters, got "
                                          f"{len(w)} ({w[:40]!r}...)", field="bad_words")
            check_text(w, "bad_words")
        object.__setattr__(self, "bad_words", tuple(dict.fromkeys(words)))

    def bad_words_token_ids(self, tokenizer, vocab_size: int) -> tuple[tuple[int, ...], ...]:
        """The token sequences `bad_words` forbid (class docstring; vLLM's update_from_tokenizer): per word its
        own tokens, then its spaced form's when that starts with another token and is as long. E.g. with a
        tokenizer where "def" -> [328] and " def" -> [377]: ((328,), (377,)). InvalidRequestError naming
        bad_words without a tokenizer, for a word of no tokens or more than MAX_BAD_WORD_TOKENS, more than
        MAX_BAD_WORDS sequences or MAX_BAD_WORDS_TOTAL_TOKENS tokens, or an id outside [0, vocab_size)."""
        if not self.bad_words:
            return ()
        if tokenizer is None:
            raise InvalidRequestError("bad_words needs the model's tokenizer (tokenizer.json), which this model does "
                                      "not ship", field="bad_words")
        sequences: list[tuple[int, ...]] = []
        for word in self.bad_words:
            plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not plain:
                raise InvalidRequestError(f"bad_words entry {word!r} encodes to no tokens", field="bad_words")
            if len(plain) > MAX_BAD_WORD_TOKENS:
                raise InvalidRequestError(f"bad_words entry {word[:40]!r} is {len(plain)} tokens long; at most "
                                          f"{MAX_BAD_WORD_TOKENS} are allowed", field="bad_words")
            sequences.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        total = sum(len(s) for s in sequences)
        if len(sequences) > MAX_BAD_WORDS or total > MAX_BAD_WORDS_TOTAL_TOKENS:
            raise InvalidRequestError(f"bad_words tokenize to {len(sequences)} sequences of {total} tokens; at most "
                                      f"{MAX_BAD_WORDS} sequences and {MAX_BAD_WORDS_TOTAL_TOKENS} tokens are allowed",
                                      field="bad_words")
        outside = sorted({t for s in sequences for t in s if not 0 <= t < vocab_size})
        if outside:
            raise InvalidRequestError(f"bad_words tokenize to ids {outside[:5]} outside the model's vocabulary "
                                      f"[0, {vocab_size})", field="bad_words")
        return tuple(sequences)

    def _check_structured_output(self) -> None:
        spec = structured_output_of(self.json_schema, self.json_object, self.regex, self.grammar, self.choice)
        if spec is not None and spec.kind == "json_schema":
            object.__setattr__(self, "json_schema", spec.text)
        if spec is not None and spec.kind == "choice":
            object.__setattr__(self, "choice", tuple(self.choice))
        if spec is not None and self.min_tokens:
            raise InvalidRequestError(f"min_tokens={self.min_tokens} cannot be combined with {spec.kind}: the "
                                      f"grammar decides where the output ends", field="min_tokens")
        object.__setattr__(self, "_structured_output", spec)

    def check_vocab(self, vocab_size: int) -> None:
        """InvalidRequestError unless every token id the parameters name (stop_token_ids, logit_bias keys,
        allowed_token_ids) lies in the model's vocabulary [0, vocab_size) (construction checks them >= 0 only: it
        does not know the model)."""
        named = (("stop_token_ids", "stop_token_ids", self.stop_token_ids),
                 ("logit_bias", "logit_bias keys", [t for t, _ in self.logit_bias]),
                 ("allowed_token_ids", "allowed_token_ids", self.allowed_token_ids or ()))
        for field, what, ids in named:
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise InvalidRequestError(f"{what} must be token ids in [0, {vocab_size}), got {outside[:5]}",
                                          field=field)

    @property
    def structured_output(self) -> StructuredOutput | None:
        """The constraint the output must match (json_schema, json_object, regex, grammar or choice), or None."""
        return self._structured_output

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_logit_processors(self) -> bool:
        """Whether the chosen token depends on more than the argmax / the plain sampling distribution."""
        return (bool(self.logit_bias) or self.min_tokens > 0 or self.min_p > 0.0 or self.has_penalties
                or self.allowed_token_ids is not None or bool(self.bad_words))

    @property
    def has_penalties(self) -> bool:
        """Whether a presence, frequency or repetition penalty applies (they count earlier tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _as_tuple(name: str, value, allowed: str) -> tuple:
    """A sequence parameter (list, tuple, range) as a tuple (None: empty); InvalidRequestError naming `allowed` for
    anything else (a number, a dict, a set: iterating them would silently mean something else)."""
    if value is None:
        return ()
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise InvalidRequestError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}", field=name)
    return tuple(value)


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", field=name)


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", field=name)
