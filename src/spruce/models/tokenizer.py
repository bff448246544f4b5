"""Tokenizer (tokenizers' tokenizer.json) with the model's chat template (jinja2) and special tokens."""

from __future__ import annotations

import json
from pathlib import Path

from spruce.errors import InvalidRequestError, ModelLoadError
from spruce.models.hf_config import ModelConfig


class Tokenizer:
    def __init__(self, tok, config: dict, model_config: ModelConfig):
        self._tok = tok
        self.config = config
        self.chat_template = config.get("chat_template")
        self.bos_token_id = self._token_id(config.get("bos_token")) or model_config.bos_token_id
        eos = list(model_config.eos_token_ids)
        cfg_eos = self._token_id(config.get("eos_token"))
        if cfg_eos is not None and cfg_eos not in eos:
            eos.append(cfg_eos)
        self.eos_token_ids = tuple(eos)
        self.add_bos = bool(config.get("add_bos_token", False))

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
        config = {}
        if cfg_file.exists():
            try:
                config = json.loads(cfg_file.read_text())
            except ValueError as e:
                raise ModelLoadError(f"{cfg_file} is not valid JSON: {e}") from e
        return Tokenizer(tok, config, model_config)

    def _token_id(self, token) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return self._tok.token_to_id(token) if isinstance(token, str) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render the model's chat template (sandboxed jinja2)."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; use the completions API", field="messages")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        special = {k: v if isinstance(v, str) else v.get("content", "")
                   for k, v in self.config.items() if k.endswith("_token") and isinstance(v, (str, dict))}
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **special)


class IncrementalDetokenizer:
    """Yields the new text as tokens arrive, never splitting a multi-byte character (held back while the
    decoded tail ends in U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        full = self.tokenizer.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return delta
