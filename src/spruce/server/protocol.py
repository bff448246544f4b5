"""The OpenAI wire format: request models, their translation to SamplingParams, response chunks, error bodies.

Requests are validated in two layers: pydantic (strict types, shapes, server limits) and then
`SamplingParams` / `Engine.add_request` (ranges, prompt length). Both raise errors that name the offending
field, and both end up as OpenAI-style `{"error": {"message", "type", "param", "code"}}` bodies.

Every field of vLLM's completions and chat-completions requests is accepted (and SGLang's `regex`, `ebnf`, `rid`,
`no_stop_trim`); the ones spruce does not implement (`NOT_SUPPORTED_YET`) only at a value that changes nothing
(else a 400 naming the field). A top-level field neither knows is ignored with a log line, as vLLM does; inside
nested objects (messages, response_format, ...) unknown fields are refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Annotated, Any, Callable, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from spruce.errors import InvalidRequestError
from spruce.server.chat_parsers import ChatOutputParser
from spruce.sampling_params import MAX_LOGPROBS, SamplingParams

log = logging.getLogger("spruce.server")
MAX_N = 64  # choices per request
MAX_CHOICES = 256  # prompts x n per request
MAX_STOP = 16
MAX_STOP_CHARS = 256
TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,19}")  # a logit_bias key: a token id in ASCII digits (a bound on its length)
UNION_MESSAGES = {
    "prompt": "prompt must be a string, a list of token ids, or a list of strings or of token-id lists",
    "stop": "stop must be a string or a list of strings",
    "content": "content must be a string or a list of {'type': 'text', 'text': ...} parts",
}
SPECIFIC_ERRORS = ("invalid_text", "extra_forbidden")  # reported even when other union members failed too
UNION_TAGS = ("str", "int", "float", "bool", "list", "dict")


def _valid_text(text: str) -> str:
    """Refuse text the tokenizer cannot take: a lone UTF-16 surrogate, which a JSON escape such as "\\ud800"
    (without its pair) decodes to."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError(
            "invalid_text", "contains a lone surrogate ({char}) at character {index}: text must be valid "
            "Unicode (a character outside the BMP is escaped as a surrogate pair)",
            {"char": f"U+{ord(text[e.start]):04X}", "index": e.start}) from None
    return text


Text = Annotated[str, AfterValidator(_valid_text)]


class OpenAIError(Exception):
    """An error answered as an OpenAI-style error body with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = error_type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @staticmethod
    def from_invalid_request(e: InvalidRequestError, rename: dict[str, str] | None = None) -> "OpenAIError":
        param = (rename or {}).get(e.field, e.field)
        code = "context_length_exceeded" if e.status == 413 else None
        return OpenAIError(e.status, str(e), param=param, code=code)

    @staticmethod
    def from_validation(e: ValidationError) -> "OpenAIError":
        """The first error, naming its field. A value no member of a union accepts gets the union's own
        message, unless one member reported something specific (bad text, an unknown field)."""
        errors = e.errors()
        first = next((x for x in errors if x["type"] in SPECIFIC_ERRORS), errors[0])
        loc = list(first["loc"])
        param = _param_path(loc)
        if first["type"] == "extra_forbidden":
            return OpenAIError(400, f"{param}: unknown field; spruce does not accept it", param=param,
                               code="unknown_parameter")
        field = str(loc[0]) if loc else None
        leaf = next((str(p) for p in reversed(loc) if str(p) in UNION_MESSAGES), field)
        union = first["type"] not in SPECIFIC_ERRORS and sum(x["loc"][:1] == first["loc"][:1] for x in errors) > 1
        message = UNION_MESSAGES[leaf] if union and leaf in UNION_MESSAGES else f"{param}: {first['msg']}"
        return OpenAIError(400, message, param=param, code="invalid_value" if loc else None)


def _param_path(loc: list) -> str | None:
    """('messages', 0, 'content', 'list[TextPart]', 0, 'text') -> 'messages[0].content[0].text' (the tags
    naming union members are dropped)."""
    path = ""
    for i, p in enumerate(loc):
        if isinstance(p, int):
            path += f"[{p}]"
        elif i == 0 or (p.isidentifier() and p not in UNION_TAGS):
            path += ("." if path else "") + p
    return path or None


@dataclass(frozen=True)
class NotYet:
    """A field spruce does not implement yet: accepted only at a value that changes nothing."""

    allowed: str  # those values, in words
    neutral: Callable[[Any, Any], bool]  # (value, request) -> whether the value changes nothing


def _unset_or(*values) -> Callable[[Any, Any], bool]:
    """A neutrality test: the value is null or equal to one of `values`."""
    return lambda v, _req: v is None or v in values


def _show(value) -> str:
    """A field's value as JSON, cut to 80 characters, for error messages."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _TopLevel(BaseModel):
    """A request body: strict types; unknown fields are kept in `model_extra` and ignored (logged by
    parse_request), as vLLM does."""

    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


# name -> how spruce accepts a field it does not implement yet (for both endpoints)
NOT_SUPPORTED_YET = {
    "best_of": NotYet("null, 1 or n", lambda v, req: v is None or v in (1, req.n)),
    "skip_special_tokens": NotYet("null or true (special tokens are always left out of the text)",
                                  _unset_or(True)),
    "guided_json": NotYet('null (vLLM removed it in 0.12: send structured_outputs: {"json": ...})', _unset_or()),
    "use_beam_search": NotYet("false (no beam search)", _unset_or(False)),
    "length_penalty": NotYet("1.0 (it applies to beam search only)", _unset_or(1.0)),
    "spaces_between_special_tokens": NotYet("true", _unset_or(True)),
    "priority": NotYet("0 (no priority scheduling)", _unset_or(0)),
    "logits_processors": NotYet("null (no custom logits processors)", _unset_or()),
    "cache_salt": NotYet("null", _unset_or()),
    "kv_transfer_params": NotYet("null (no disaggregated serving)", _unset_or()),
    "vllm_xargs": NotYet("null or {}", _unset_or({})),
    "max_repetition_pattern_size": NotYet("0", _unset_or(0)),
    "min_repetition_pattern_size": NotYet("0", _unset_or(0)),
    "repetition_min_count": NotYet("0", _unset_or(0)),
}


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema. `strict` is accepted either way: spruce always enforces the schema."""

    name: Text
    description: Text | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs (its current name for the guided_* fields): at most one constraint."""

    json_: dict | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


# SamplingParams field of each structured_outputs key
STRUCTURED_OUTPUTS_FIELDS = {"json_": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                             "json_object": "json_object"}


class _GenerationRequest(_TopLevel):
    """Fields the completions and chat endpoints share (vLLM's, and SGLang's `regex` / `ebnf` / `rid` /
    `no_stop_trim`).

    Honoured beyond OpenAI's: `allowed_token_ids` and `bad_words` (vLLM's: SamplingParams), `prompt_logprobs`
    (not with stream, as vLLM), `truncate_prompt_tokens` (keep the prompt's last k tokens; -1: as many as a
    request holds), `return_token_ids` (`token_ids` per choice and `prompt_token_ids`), `add_special_tokens`,
    `request_id` (the response id is its endpoint prefix + it) and SGLang's `rid` (the response id itself), `regex`
    and `ebnf` (structured output, as structured_outputs' regex and grammar), `include_stop_str_in_output` and
    SGLang's `no_stop_trim` (keep_stop_string)."""

    not_supported_yet: ClassVar[dict[str, NotYet]] = NOT_SUPPORTED_YET

    model: Text | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: Text | None = None
    presence_penalty: float | None = None  # OpenAI's, in [-2, 2]
    frequency_penalty: float | None = None  # OpenAI's, in [-2, 2]
    logprobs: bool | int | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension, > 0 (1 = off)
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    # vLLM's sampling and extra parameters
    use_beam_search: bool = False
    length_penalty: float = 1.0
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[Text] | None = None
    add_special_tokens: bool | None = None  # null: the endpoint's default (completions true, chat false)
    priority: int = 0
    request_id: Text | None = None
    logits_processors: list | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: Text | None = None
    kv_transfer_params: dict | None = None
    vllm_xargs: dict | None = None
    max_repetition_pattern_size: int = 0
    min_repetition_pattern_size: int = 0
    repetition_min_count: int = 0
    # SGLang's
    regex: Text | None = None
    ebnf: Text | None = None
    rid: Text | None = None
    no_stop_trim: bool | None = None

    def check_supported(self) -> None:
        """Refuse what spruce does not implement instead of silently ignoring it, and the server's limits."""
        for name, rule in self.not_supported_yet.items():
            value = getattr(self, name)
            if not rule.neutral(value, self):
                raise OpenAIError(400, f"{name}={_show(value)} is not supported yet; send {rule.allowed}, or leave "
                                  f"it out", param=name, code="unsupported")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise OpenAIError(400, "prompt_logprobs are not available with stream: true (as in vLLM)",
                              param="prompt_logprobs")
        if self.truncate_prompt_tokens == 0:
            raise OpenAIError(400, "truncate_prompt_tokens must be -1 (keep as many as a request holds) or >= 1 "
                              "(keep the prompt's last k tokens), got 0", param="truncate_prompt_tokens",
                              code="invalid_value")
        self.check_logprobs()
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if len(stops) > MAX_STOP:
            raise OpenAIError(400, f"at most {MAX_STOP} stop strings are allowed, got {len(stops)}", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise OpenAIError(400, f"stop strings must be at most {MAX_STOP_CHARS} characters", param="stop")

    def structured_output(self) -> tuple[dict, dict[str, str]]:
        """SamplingParams kwargs of the request's structured output (response_format or structured_outputs),
        and the request parameter that names each kwarg in errors."""
        kwargs, names = {}, {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            kwargs["json_object"], names["json_object"] = True, "response_format"
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                param = "response_format.json_schema" + ("" if fmt.json_schema is None else ".schema")
                raise OpenAIError(400, f'{param} is required when response_format.type is "json_schema"',
                                  param=param)
            kwargs["json_schema"] = fmt.json_schema.schema_
            names["json_schema"] = "response_format.json_schema.schema"
        given = {key: getattr(self.structured_outputs, key) for key in STRUCTURED_OUTPUTS_FIELDS
                 if self.structured_outputs is not None and getattr(self.structured_outputs, key) not in (None, False)}
        if given and kwargs:
            raise OpenAIError(400, "response_format and structured_outputs both constrain the output; send one of "
                              "them", param="structured_outputs")
        for key, value in given.items():  # more than one: SamplingParams names the second
            field = STRUCTURED_OUTPUTS_FIELDS[key]
            kwargs[field], names[field] = value, f"structured_outputs.{key.rstrip('_')}"
        for param, field in (("regex", "regex"), ("ebnf", "grammar")):  # SGLang's top-level constraints
            value = getattr(self, param)
            if value is not None:  # with another constraint: SamplingParams refuses the second by name
                kwargs[field], names[field] = value, param
        return kwargs, names

    def truncated_prompt(self, ids: list[int], max_request_tokens: int) -> list[int]:
        """The prompt after `truncate_prompt_tokens` (vLLM's): its last k tokens; -1: the last
        `max_request_tokens`; k above `max_request_tokens` is refused."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k > max_request_tokens:
            raise OpenAIError(400, f"truncate_prompt_tokens={k} exceeds the {max_request_tokens} tokens a request "
                              f"holds on this server", param="truncate_prompt_tokens", code="invalid_value")
        return ids[-(max_request_tokens if k == -1 else k):]

    def response_id(self, prefix: str, generated: str) -> str:
        """The response's id: SGLang's `rid` as given, else the prefix + vLLM's `request_id`, else `generated`."""
        if self.rid is not None:
            return self.rid
        return prefix + self.request_id if self.request_id is not None else generated

    @property
    def param_names(self) -> dict[str, str]:
        """SamplingParams field -> this request's parameter, for errors raised after translation."""
        return self.structured_output()[1]

    @property
    def keep_stop_string(self) -> bool:
        """vLLM's include_stop_str_in_output or SGLang's no_stop_trim: the stop string that ended a choice stays
        at the end of its text."""
        return bool(self.include_stop_str_in_output or self.no_stop_trim)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_logprobs(self) -> None:
        """Refuse logprob fields of the wrong kind or out of range (each endpoint's own rules)."""

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per generated token (SamplingParams.logprobs); None: no logprobs."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top alternatives per prompt token (SamplingParams.prompt_logprobs); None: none."""
        return self.prompt_logprobs

    def penalties(self) -> dict[str, float]:
        """presence / frequency / repetition penalties as SamplingParams takes them (null: no penalty)."""
        return dict(presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                    repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty)

    def sampling_params(self, max_tokens: int, vocab_size: int) -> list[SamplingParams]:
        """One SamplingParams per choice; with a seed, choice i > 0 gets a distinct seed derived from it.
        Raises InvalidRequestError (SamplingParams' checks) or OpenAIError (stop token ids outside the vocab)."""
        top_k = self.top_k if self.top_k is not None else -1
        if top_k > vocab_size:
            top_k = -1  # no cut; also keeps huge values out of the device tensors
        bias = {}
        for key, value in (self.logit_bias or {}).items():  # JSON object keys are strings: token ids in text
            if not TOKEN_ID_KEY.fullmatch(key):
                raise OpenAIError(400, f"logit_bias keys must be token ids written in ASCII decimal digits (e.g. "
                                  f'"50256"), got {_show(key)}', param="logit_bias")
            bias[int(key)] = value
        outside = [t for t in bias if not 0 <= t < vocab_size]
        if outside:
            raise OpenAIError(400, f"logit_bias keys must be token ids in [0, {vocab_size}), got {outside[:5]}",
                              param="logit_bias")
        structured, _ = self.structured_output()
        out = []
        for i in range(self.n):
            out.append(SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=top_k, seed=choice_seed(self.seed, i),
                **self.penalties(),
                stop=self.stop if self.stop is not None else (), stop_token_ids=self.stop_token_ids or (),
                ignore_eos=self.ignore_eos, logprobs=self.num_logprobs, prompt_logprobs=self.num_prompt_logprobs,
                min_p=self.min_p or 0.0, logit_bias=bias, min_tokens=self.min_tokens or 0,
                allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words or (), **structured))
        out[0].check_vocab(vocab_size)
        return out


class CompletionRequest(_GenerationRequest):
    not_supported_yet: ClassVar[dict[str, NotYet]] = {
        **NOT_SUPPORTED_YET,
        "suffix": NotYet('null or ""', _unset_or("")),
        "prompt_embeds": NotYet("null (send text or token ids)", _unset_or()),
    }

    prompt: Text | list[int] | list[Text] | list[list[int]]
    echo: bool = False
    suffix: Text | None = None
    prompt_embeds: Any = None

    @property
    def special_tokens(self) -> bool:
        """Whether encoding a text prompt adds the tokenizer's special tokens (vLLM's default here: true)."""
        return self.add_special_tokens is not False

    def check_logprobs(self) -> None:
        """OpenAI's legacy `logprobs`: an integer, the number of top alternatives per token (false = none)."""
        if self.logprobs is True:
            raise OpenAIError(400, f"logprobs must be an integer between 0 and {MAX_LOGPROBS} for /v1/completions "
                              f"(the number of top alternatives per token), got true", param="logprobs")
        _check_logprobs_range("logprobs", self.num_logprobs)

    @property
    def num_logprobs(self) -> int | None:
        return None if self.logprobs is None or self.logprobs is False else self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """prompt_logprobs; unset, with echo, the prompt's logprobs too (as vLLM: the same count)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.num_logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) of a (possibly batched) request."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)

    def sampling_params(self, max_tokens: int, vocab_size: int) -> list[SamplingParams]:
        """As the base class's, after checking the token ids of token-id prompts (before anything decodes them:
        echo does)."""
        self.check_prompt_ids(vocab_size)
        return super().sampling_params(max_tokens, vocab_size)

    def check_prompt_ids(self, vocab_size: int) -> None:
        """OpenAIError naming the prompt unless every token id of a token-id prompt lies in [0, vocab_size)."""
        prompts = self.prompts()
        for i, prompt in enumerate(prompts):
            outside = [t for t in prompt if not 0 <= t < vocab_size] if isinstance(prompt, list) else []
            if outside:
                where = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
                raise OpenAIError(400, f"{where} must be token ids in [0, {vocab_size}), got {outside[:5]}",
                                  param="prompt", code="invalid_value")


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ToolCallFunction(_Strict):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """An assistant message's tool call in the history."""

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    """A message of the history. Assistant `tool_calls`, a tool message's `tool_call_id` and earlier reasoning
    (`reasoning_content`, vLLM's `reasoning`) are passed to the chat template as given."""

    role: Text
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    reasoning_content: Text | None = None
    reasoning: Text | None = None

    def as_dict(self) -> dict:
        """The message as the chat template reads it (content parts joined; the optional keys only when given;
        a tool call's arguments as a dict, as Hugging Face templates read them, when they are a JSON object)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        for key in ("name", "tool_call_id", "reasoning_content", "reasoning"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.tool_calls is not None:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        return message


def _arguments(text: str) -> dict | str:
    """A tool call's arguments text as a dict when it is a JSON object (what templates iterate), else as is."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class FunctionDefinition(_Strict):
    name: Text
    description: Text | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    """A chat request. Tools (vLLM's rules): `tools` go to the chat template; `tool_choice` "auto" (the default
    with tools) reads tool calls from the output with the server's --tool-call-parser (needs
    --enable-auto-tool-choice), "none" reads none, "required" and a named function force them with a JSON
    schema (structured output), so they cannot be combined with another constraint."""

    not_supported_yet: ClassVar[dict[str, NotYet]] = {
        **NOT_SUPPORTED_YET,
        "chat_template": NotYet("null (the server's template is used: --chat-template)", _unset_or()),
        "mm_processor_kwargs": NotYet("null or {} (no multimodal inputs)", _unset_or({})),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    include_reasoning: bool = True
    echo: bool = False
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    documents: list[dict] | None = None
    chat_template: Text | None = None
    chat_template_kwargs: dict | None = None
    mm_processor_kwargs: dict | None = None

    def model_post_init(self, _context) -> None:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens

    @property
    def special_tokens(self) -> bool:
        """Whether encoding the rendered template adds special tokens (vLLM's default here: false, the template
        writes its own)."""
        return bool(self.add_special_tokens)

    def template_kwargs(self) -> dict:
        """The chat template's variables beyond `messages` (vLLM's): chat_template_kwargs, then the request's
        add_generation_prompt, documents and reasoning_effort (the unset ones left out)."""
        if self.continue_final_message and self.add_generation_prompt:
            raise OpenAIError(400, "continue_final_message and add_generation_prompt cannot both be true: the "
                              "final message is either continued or followed by a new one",
                              param="continue_final_message")
        kwargs = dict(self.chat_template_kwargs or {})
        if "messages" in kwargs:
            raise OpenAIError(400, "chat_template_kwargs cannot set messages (send them as messages)",
                              param="chat_template_kwargs")
        generation_prompt = self.add_generation_prompt
        if generation_prompt is None:
            generation_prompt = kwargs.get("add_generation_prompt", not self.continue_final_message)
        kwargs["add_generation_prompt"] = bool(generation_prompt)
        for key in ("documents", "reasoning_effort"):
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        if self.tools:
            kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        return kwargs

    def echo_text(self) -> str:
        """vLLM's chat echo: the text the answer starts with, the last message's content when it is the
        assistant's (continued with continue_final_message), else nothing."""
        last = self.messages[-1].as_dict()
        return last["content"] if last["role"] == "assistant" else ""

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """tool_choice, unset: "auto" with tools, else "none" (OpenAI's and vLLM's default)."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def tool_schema(self) -> dict | None:
        """The JSON schema forcing the output for tool_choice "required" (an array of {name, parameters}) or a
        named function (its parameters); None otherwise."""
        choice = self.effective_tool_choice
        if choice in ("none", "auto"):
            return None
        tools = {t.function.name: t.function.parameters or {"type": "object"} for t in self.tools or ()}
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in tools:
                raise OpenAIError(400, f"tool_choice names the function {_show(choice.function.name)}, which is not "
                                  f"among the tools ({_show(sorted(tools))})", param="tool_choice")
            return tools[choice.function.name]
        if not tools:
            raise OpenAIError(400, 'tool_choice "required" needs tools', param="tool_choice")
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False} for name, schema in tools.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if self.parallel_tool_calls is False:
            array["maxItems"] = 1
        return array

    def structured_output(self) -> tuple[dict, dict[str, str]]:
        """As the base class's, plus the schema of a forced tool choice (which takes no other constraint)."""
        kwargs, names = super().structured_output()
        schema = self.tool_schema()
        if schema is None:
            return kwargs, names
        if kwargs:
            raise OpenAIError(400, f"tool_choice forces the output with a JSON schema; it cannot be combined with "
                              f"{next(iter(names.values()))}", param="tool_choice")
        return {"json_schema": schema}, {"json_schema": "tool_choice"}

    def output_parser(self, reasoning_parser: str | None, tool_call_parser: str | None,
                      auto_tool_choice: bool) -> ChatOutputParser:
        """How this request's output is read: the server's parsers and the request's tool choice; 400 for
        tool_choice "auto" on a server that reads no tool calls (as vLLM). Output a JSON schema forces from its
        first token (a forced tool choice, response_format json) is read without the reasoning parser."""
        choice = self.effective_tool_choice
        if choice == "auto" and not (auto_tool_choice and tool_call_parser):
            raise OpenAIError(400, '"auto" tool choice needs a server started with --enable-auto-tool-choice and '
                              '--tool-call-parser (send tool_choice "none", "required" or a named function)',
                              param="tool_choice")
        forced_json = choice not in ("none", "auto") or (
            self.response_format is not None and self.response_format.type != "text")
        return ChatOutputParser(  # output forced into JSON from its first token holds no reasoning
            reasoning_parser=None if forced_json else reasoning_parser,
            tool_parser=tool_call_parser if choice == "auto" else None,
            named_tool=choice.function.name if isinstance(choice, NamedToolChoice) else None,
            required=choice == "required", parallel=self.parallel_tool_calls is not False,
            include_reasoning=self.include_reasoning)

    def check_logprobs(self) -> None:
        """Chat's `logprobs` is a boolean; `top_logprobs` (0..20) needs it true."""
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise OpenAIError(400, f"logprobs must be true or false for chat completions, got {_show(self.logprobs)} "
                              f"(top_logprobs sets the number of alternatives)", param="logprobs")
        _check_logprobs_range("top_logprobs", self.top_logprobs)
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError(400, f"top_logprobs={self.top_logprobs} needs logprobs: true", param="top_logprobs")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _check_logprobs_range(name: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise OpenAIError(400, f"{name}={value} is out of range: it must be between 0 and {MAX_LOGPROBS} (the number "
                          f"of top alternatives per token)", param=name, code="invalid_value")


def parse_request(cls: type[_GenerationRequest], body: dict) -> _GenerationRequest:
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        raise OpenAIError.from_validation(e) from None
    if req.model_extra:
        log.warning("the following fields were present in the request but ignored: %s",
                    [name[:64] for name in sorted(req.model_extra)[:20]])
    req.check_supported()
    return req


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice 0 keeps the user's seed (so n=1 and n>1 agree on it); the others get distinct derived seeds."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.sha256(f"spruce-choice:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextDelta:
    """Turns one request's successive outputs into text increments that are safe to stream: while the request
    runs, a trailing U+FFFD (an incomplete UTF-8 character) and any tail that could start a stop string are
    held back. The increments concatenate to the final (stop-cut) text. (Should a tokenizer's decode ever
    rewrite text already sent, streaming resumes at the same character offset: sent text cannot be taken back.)"""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.sent = ""

    def feed(self, text: str, finished: bool) -> str:
        """The text to send now, given the request's whole output text so far."""
        if not finished:
            text = text.rstrip("\ufffd")
            text = text[:len(text) - stop_prefix_len(text, self.stops)]
        if len(text) <= len(self.sent):
            return ""
        if not text.startswith(self.sent):
            self.sent = text[:len(self.sent)]
        delta = text[len(self.sent):]
        self.sent = text
        return delta


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` counts prompt tokens served by the prefix
    cache (as OpenAI and vLLM report them)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def envelope(request_id: str, obj: str, model: str, choices: list, created: int | None = None, **extra) -> dict:
    """The fields every completion object and chunk carries."""
    return {"id": request_id, "object": obj, "created": created or int(time.time()), "model": model,
            "choices": choices, **extra}


def completion_choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def chat_choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def chat_delta(index: int, delta: dict, finish_reason: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


# --- logprobs in OpenAI's shapes (as vLLM's server writes them) ----------------------------------------------------
LOGPROB_FLOOR = -9999.0  # vLLM's floor for -inf (JSON has no infinity)


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def token_id_name(token_id: int) -> str:
    """vLLM's return_tokens_as_token_ids name of a token: "token_id:N". Passed as `token_text`, it names every
    token so (the decoded text of logprob entries is not used)."""
    return f"token_id:{token_id}"


def _token_name(token_id: int, logprob, token_text: Callable[[int], str | None]) -> str:
    """A token as text: its decoded text (vLLM: the token decoded alone), or "token_id:N" without a tokenizer or
    with `token_text` token_id_name."""
    if token_text is token_id_name:
        return token_id_name(token_id)
    text = logprob.decoded_token if logprob is not None else token_text(token_id)
    return text if text is not None else f"token_id:{token_id}"


def completion_logprobs(token_ids: list[int], entries: list, token_text: Callable[[int], str | None],
                        text_offset: int = 0, widths: list[int] | None = None) -> dict:
    """The legacy completions shape {tokens, token_logprobs, top_logprobs, text_offset} from RequestOutput-style
    entries ({token_id: Logprob} per token, the chosen first; None for a prompt's first token: null logprob).
    top_logprobs maps token text to logprob: the chosen token and its n alternatives (OpenAI: up to n + 1).
    text_offset: where each token's text starts in the choice's text, counted from `text_offset` (a stream's
    text sent before): `widths` are the characters each token adds to that text (Tokenizer.text_widths: 0 for
    a special token the text leaves out, such as an echoed prompt's <|begin_of_text|>, which vLLM counts); without
    them, the length of each token's name."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    if widths is None:
        widths = [None] * len(token_ids)
    for token_id, entry, width in zip(token_ids, entries, widths):
        if entry is None:
            name = _token_name(token_id, None, token_text)
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            name = _token_name(token_id, entry[token_id], token_text)
            token_logprobs.append(_lp(entry[token_id].logprob))
            top_logprobs.append({_token_name(t, lp, token_text): _lp(lp.logprob) for t, lp in entry.items()})
        tokens.append(name)
        offsets.append(text_offset)
        text_offset += len(name) if width is None else width
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], entries: list, top: int, token_text: Callable[[int], str | None]) -> dict:
    """Chat's shape {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}: top_logprobs
    are the `top` most likely tokens (OpenAI's meaning; the chosen token is among them only if it ranks there)."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        name = _token_name(token_id, entry[token_id], token_text)
        best = sorted(entry.items(), key=lambda kv: kv[1].rank)[:top]
        content.append({"token": name, "logprob": _lp(entry[token_id].logprob),
                        "bytes": list(name.encode("utf-8", errors="replace")),
                        "top_logprobs": [_top(t, lp, token_text) for t, lp in best]})
    return {"content": content}


def _top(token_id: int, logprob, token_text) -> dict:
    name = _token_name(token_id, logprob, token_text)
    return {"token": name, "logprob": _lp(logprob.logprob), "bytes": list(name.encode("utf-8", errors="replace"))}


# --- vLLM's tokenizer endpoints (/tokenize, /detokenize) -------------------------------------------------------
class TokenizeCompletionRequest(_Strict):
    """vLLM's text form of POST /tokenize."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool | None = None


class TokenizeChatRequest(_Strict):
    """vLLM's chat form of POST /tokenize: the messages rendered by the chat template, then encoded (the template
    writes its own special tokens, hence add_special_tokens defaults to false here)."""

    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool | None = None
    continue_final_message: bool | None = None
    chat_template: Text | None = None


class DetokenizeRequest(_Strict):
    """vLLM's POST /detokenize."""

    model: Text | None = None
    tokens: list[int]


TOKENIZE_NOT_SUPPORTED_YET = {
    "return_token_strs": NotYet("null or false", _unset_or(False)),
    "continue_final_message": NotYet("null or false", _unset_or(False)),
    "chat_template": NotYet("null (the model's own template is used)", _unset_or()),
}


def parse_tool_request(cls: type[BaseModel], body: dict) -> BaseModel:
    """Validate a /tokenize or /detokenize body (400 naming the field), refusing what is not implemented."""
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        raise OpenAIError.from_validation(e) from None
    for name, rule in TOKENIZE_NOT_SUPPORTED_YET.items():
        value = getattr(req, name, None)
        if not rule.neutral(value, req):
            raise OpenAIError(400, f"{name}={_show(value)} is not supported yet; send {rule.allowed}, or leave it "
                              f"out", param=name, code="unsupported")
    return req
