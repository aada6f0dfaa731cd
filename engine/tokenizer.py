"""Tokenizer (tokenizer.json through `tokenizers`) and chat template (jinja2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, path: str | Path):
        root = Path(path)
        file = root / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {root}")
        self._tok = _HFTokenizer.from_file(str(file))
        cfg_file = root / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        self.eos_token: str | None = _token_text(cfg.get("eos_token"))
        self.bos_token: str | None = _token_text(cfg.get("bos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._template = None
        if self.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self.chat_template)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role", "content"}]) with the checkpoint's template.

        Raises ValueError when the checkpoint has no template or a message is malformed.
        """
        if self._template is None:
            raise ValueError("this checkpoint has no chat_template in tokenizer_config.json")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} must be a dict with string 'role' and 'content'")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _token_text(tok: str | dict[str, Any] | None) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or {"content": ...}."""
    if isinstance(tok, dict):
        content = tok.get("content")
        return content if isinstance(content, str) else None
    return tok


def _raise(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)
