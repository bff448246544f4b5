"""Tokenizer (the `tokenizers` library on tokenizer.json) with the model's chat template and special tokens.

Special tokens: tokenizer.json's post-processor decides what encode() adds (as in transformers 5); when
tokenizer_config.json sets `add_bos_token` and the post-processor does not add bos, bos is prepended (as
transformers 4's Llama tokenizers did; transformers 5 drops the flag).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from spruce.errors import InvalidRequestError, ModelLoadError
from spruce.models.hf_config import ModelConfig, read_json

_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class Tokenizer:
    """encode/decode text, render chat templates, and name the special tokens."""

    def __init__(self, tok, config: dict, model_config: ModelConfig, chat_template: str | None = None):
        self._tok = tok
        self.config = config
        self.chat_template = chat_template
        bos = self._token_id(config.get("bos_token"))
        self.bos_token_id: int | None = bos if bos is not None else model_config.bos_token_id
        eos = list(model_config.eos_token_ids)
        cfg_eos = self._token_id(config.get("eos_token"))
        if cfg_eos is not None and cfg_eos not in eos:
            eos.append(cfg_eos)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        probe = tok.encode("a", add_special_tokens=True).ids
        adds_bos = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]
        self._prepend_bos = bool(config.get("add_bos_token")) and self.bos_token_id is not None and not adds_bos
        self._cleanup = bool(config.get("clean_up_tokenization_spaces")) and type(tok.model).__name__ != "BPE"
        self._token_texts: dict[int, str] = {}  # token_text's cache
        # ids decode takes: the tokenizer's and the model's vocabulary (which may pad the tokenizer's)
        self.id_limit = max(self.vocab_size, model_config.vocab_size)

    @staticmethod
    def from_dir(path, model_config: ModelConfig) -> "Tokenizer | None":
        """The directory's tokenizer, or None when it ships no tokenizer.json (token-id prompts only)."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            return None
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a plain Exception on bad files
            raise ModelLoadError(f"cannot read tokenizer {file}: {e}") from e
        cfg_file = path / "tokenizer_config.json"
        config = read_json(cfg_file, "tokenizer config") if cfg_file.exists() else {}
        legacy = path / "special_tokens_map.json"  # older checkpoints name bos/eos here
        if legacy.exists():
            config = {**read_json(legacy, "special tokens map"), **config}
        return Tokenizer(tok, config, model_config, _find_chat_template(path, config))

    def _token_id(self, token) -> int | None:
        if isinstance(token, dict):  # serialized AddedToken
            token = token.get("content")
        return self._tok.token_to_id(token) if isinstance(token, str) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what the grammar library builds its token tables from)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; InvalidRequestError (field "prompt") for what is not text the tokenizer can take:
        a non-str, or a lone UTF-16 surrogate (e.g. "\\ud800" without its pair)."""
        check_text(text, "prompt")
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return [self.bos_token_id] + ids if add_special_tokens and self._prepend_bos else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; InvalidRequestError (field "tokens") for an id outside [0, id_limit) (the library
        raises OverflowError for a negative or huge id; an id it does not know, such as a padded vocabulary row
        of the model, decodes as "")."""
        ids = list(ids)
        limit = self.id_limit
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limit]
        if bad:
            raise InvalidRequestError(f"tokens must be token ids in [0, {limit}), got {bad[:5]}", field="tokens")
        return self._clean(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def text_widths(self, ids: list[int], context_ids: list[int] = ()) -> list[int]:
        """How many characters of `decode(context_ids + ids)` past the context's text each of `ids` adds, so
        that they sum to the length of the text `ids` decode to after the context: a special token that decode
        skips adds 0, and a character whose UTF-8 bytes span tokens is counted at the token that completes it.
        E.g. [<|begin_of_text|>, "def", " f"] -> [0, 3, 2]; "é" as two byte tokens -> [0, 1]."""
        detok = IncrementalDetokenizer(self, list(context_ids))
        widths = [len(detok.add([t])) for t in ids]
        if widths:
            widths[-1] += len(detok.flush())
        return widths

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: its longest vocabulary entry (a byte-level
        entry's characters are bytes, a Metaspace one's are the text's, "<0x0A>" stands for one byte), so a
        text of more than `n * max_token_chars` characters encodes to more than n tokens."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens included: how vLLM names tokens in logprobs (a byte-level
        BPE token holding part of a UTF-8 character decodes to U+FFFD). Cached per id."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    def decode_stream(self, context_ids: list[int], skip_special_tokens: bool = True):
        """A `tokenizers` DecodeStream primed with `context_ids` (`step(ids)` returns the text they complete, or
        None), or None where it would not decode as `decode` does (a tokenizer that cleans up spaces) or the
        library is too old to have one that takes lists."""
        if self._cleanup:
            return None
        try:
            from tokenizers.decoders import DecodeStream

            stream = DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
        except (ImportError, TypeError):
            return None
        tok = self._tok
        return lambda ids: stream.step(tok, ids)

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """`decode` of each sequence, in one call (the library decodes them in parallel)."""
        texts = self._tok.decode_batch([list(ids) for ids in sequences], skip_special_tokens=skip_special_tokens)
        return [self._clean(text) for text in texts]

    def _clean(self, text: str) -> str:
        if self._cleanup:
            for a, b in _CLEANUPS:
                text = text.replace(a, b)
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render the model's chat template (sandboxed jinja2, transformers' globals and filters).

        InvalidRequestError when the model has no template or the template rejects the messages."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template (tokenizer_config.json chat_template or "
                                      "chat_template.jinja); use the completions API", field="messages")
        import jinja2

        try:
            template = _compile(self.chat_template)
            special = {k: v if isinstance(v, str) else v.get("content", "")
                       for k, v in self.config.items() if k.endswith("_token") and isinstance(v, (str, dict))}
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **{**special, **kwargs})
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template error: {e}", field="messages") from e


def check_text(text, field: str) -> None:
    """InvalidRequestError naming `field` unless `text` is a str the tokenizer can encode (valid Unicode: no lone
    UTF-16 surrogate, which a JSON escape such as "\\ud800" without its pair or a Python literal gives)."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"{field} must be text (str), got {type(text).__name__}", field=field)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{field} contains a lone surrogate (U+{ord(text[e.start]):04X}) at character "
                                  f"{e.start}: text must be valid Unicode", field=field) from None


def _find_chat_template(path: Path, config: dict) -> str | None:
    """chat_template.jinja, else chat_template.json, else tokenizer_config.json's (a string or a named list)."""
    if (path / "chat_template.jinja").exists():
        return (path / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if (path / "chat_template.json").exists():
        template = read_json(path / "chat_template.json", "chat template").get("chat_template", template)
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _compile(source: str):
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; chat templates expect plain JSON
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Streams text as token ids arrive: `add(ids)` returns the new text, `flush()` whatever is held back.

    Decodes only a short window of recent ids (prefix/read offsets, as vLLM does), so each call is O(window),
    and holds text back while it ends in U+FFFD (a character whose bytes span tokens). The concatenation of
    every add() and flush() equals tokenizer.decode(all ids). `context_ids` (e.g. the prompt's tail) are
    decoded for context only; none of their text is returned.

    `add` runs the same window algorithm in the `tokenizers` library (its DecodeStream, `Tokenizer.decode_stream`)
    where one decodes as `decode` does: about a quarter faster per add (every running request pays one a step). The
    offsets here follow it, for `flush`; a stream that fails (its window's text no longer starts with its
    prefix's) hands over to the Python windows for the rest of the request."""

    def __init__(self, tokenizer: Tokenizer, context_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(context_ids or [])[-6:]
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = len(self.ids)  # ids before this have had their text returned
        self._step = tokenizer.decode_stream(self.ids, skip_special_tokens)  # None: the Python windows

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Text that `new_ids` complete ("" while a multi-token character is unfinished)."""
        self.ids.extend(new_ids)
        if self._step is not None:
            try:
                text = self._step(list(new_ids))
            except Exception:  # the library's DecodeStreamError: decode the windows from here on
                self._step = None
            else:
                if text:
                    self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                return text or ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """Text of ids not yet returned (an unfinished character decodes as U+FFFD, as decode() would)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]
