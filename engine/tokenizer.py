"""Tokenizer (tokenizer.json through `tokenizers`), chat template (jinja2), and the incremental
detokenizer that keeps a request's output text as it grows.

A checkpoint without tokenizer.json but with a TikToken `tiktoken.model` (Kimi-K2) gets the same
kind of `tokenizers` object built from it (engine/tokenizer_tiktoken.py).

The chat template is where transformers looks for it: a `chat_template.jinja` file beside
tokenizer_config.json (what newer transformers save; it wins, as in transformers), else
tokenizer_config.json's `chat_template` (a string, or a list of named templates: "default").
It renders as transformers renders it: a sandbox with trim_blocks/lstrip_blocks, loop controls,
`raise_exception`, `strftime_now` and a `tojson` that does not escape HTML.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from engine.chat_tokens import ControlTokens, RenderedChat, encode_rendered, render
from engine.tokenizer_tiktoken import (
    KIMI_BOS,
    KIMI_EOS,
    KIMI_RESERVED,
    TIKTOKEN_FILE,
    is_kimi,
    tiktoken_pattern,
    tiktoken_tokenizer,
    token_text,
)

REPLACEMENT = "\ufffd"   # what decoding shows for an incomplete (or invalid) UTF-8 sequence
MAX_PENDING_TOKENS = 8   # a UTF-8 character has at most 4 bytes: more pending ids than this are garbage
TEMPLATE_FILE = "chat_template.jinja"


class Tokenizer:
    def __init__(self, path: str | Path):
        root = Path(path)
        cfg_file = root / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        file, ranks = root / "tokenizer.json", root / TIKTOKEN_FILE
        kimi = False
        if file.is_file():
            self._tok = _HFTokenizer.from_file(str(file))
        elif ranks.is_file():
            kimi = is_kimi(root, cfg)
            self._tok = tiktoken_tokenizer(ranks, tiktoken_pattern(root, cfg), cfg,
                                           reserved=KIMI_RESERVED if kimi else 0)
        else:
            raise FileNotFoundError(f"no tokenizer.json (nor a TikToken {TIKTOKEN_FILE}) in {root}")
        self.chat_template: str | None = chat_template(root, cfg)
        self.eos_token: str | None = token_text(cfg.get("eos_token", KIMI_EOS if kimi else None))
        self.bos_token: str | None = token_text(cfg.get("bos_token", KIMI_BOS if kimi else None))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._template = None
        if self.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = _strftime_now
            env.filters["tojson"] = _tojson
            self._template = env.from_string(self.chat_template)

    @property
    def backend(self) -> _HFTokenizer:
        """The `tokenizers` object (from tokenizer.json, or built from tiktoken.model): what
        reads the tokenizer's spec or encodes off the GIL uses it, not tokenizer.json."""
        return self._tok

    @cached_property
    def control(self) -> ControlTokens:
        """The added tokens (control ids) and the encoding that reads their text as text."""
        return ControlTokens(self._tok)

    def encode(self, text: str) -> list[int]:
        """`text`'s ids as the tokenizer reads it: an added token's text is its control id.  For
        text the server wrote (a rendered template's structure, a marker); client text goes
        through `encode_plain` or `encode_chat`."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        """`text`'s ids with every character read as text: `<|im_end|>` is the ids of its
        characters, never the control id (client text).  ValueError if a control id results."""
        return self.control.encode_plain([text])[0]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def end_ids(self, model_eos: Iterable[int]) -> frozenset[int]:
        """The tokens that end a request: the model config's EOS ids and the tokenizer's own
        (the engine's stop checks and the grammars' EOS, on workers and gateway alike)."""
        ids = set(model_eos)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return frozenset(ids)

    def apply_chat_template(self, messages: list[dict], /, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: Any) -> str:
        """Render `messages` with the checkpoint's template, as transformers does: each message a
        dict with a string `role` and a string `content` (None for an assistant's message that
        only calls tools), and optionally `tool_calls`, `tool_call_id`, `name`; `tools` (OpenAI's
        [{"type": "function", "function": {...}}]) and `kwargs` (e.g. enable_thinking) become
        template variables.

        Raises ValueError when the checkpoint has no template, a message is malformed, or a
        keyword would replace one of the variables set here.
        """
        return self._renderer(messages, add_generation_prompt, kwargs)(messages, tools)

    def render_chat(self, messages: list[dict], /, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **kwargs: Any) -> RenderedChat:
        """`apply_chat_template`'s text with the spans of client text in it (engine/chat_tokens.py).
        Raises ValueError as it does, and where client text holds an added token's text that
        cannot be kept as text."""
        template = self._renderer(messages, add_generation_prompt, kwargs)
        return render(template, messages, tools, kwargs, self.control)

    def encode_chat(self, messages: list[dict], /, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **kwargs: Any) -> list[int]:
        """The conversation's token ids: control ids only from the template's own structure,
        client text (every message, tool and call) encoded as text.  Raises as `render_chat`."""
        rendered = self.render_chat(messages, add_generation_prompt, tools, **kwargs)
        return self.encode_rendered(rendered)

    def encode_rendered(self, rendered: RenderedChat) -> list[int]:
        """The token ids of a rendered conversation (see `encode_chat`)."""
        return encode_rendered(rendered, self._encode_offsets, self.control)

    def _encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def _renderer(self, messages: list[dict], add_generation_prompt: bool,
                  kwargs: dict[str, Any]) -> Callable[[list[dict], list[dict] | None], str]:
        """The template as a function of (messages, tools), the other variables fixed, once
        `messages` and `kwargs` are checked (ValueError)."""
        if self._template is None:
            raise ValueError(f"this checkpoint has no chat template ({TEMPLATE_FILE}, or chat_template in "
                             f"tokenizer_config.json)")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str | None) \
                    or not isinstance(m.get("tool_calls", []), list):
                raise ValueError(f"message {i} must be a dict with string 'role' and 'content'")
        fixed = {"add_generation_prompt": add_generation_prompt,
                 "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        if clash := sorted(set(kwargs) & {*fixed, "messages", "tools"}):
            raise ValueError(f"chat template variables cannot replace {', '.join(clash)}")
        template = self._template

        def run(msgs: list[dict], tools: list[dict] | None) -> str:
            return template.render(**kwargs, **fixed, messages=msgs, tools=tools)
        return run


class IncrementalDetokenizer:
    """The text of a growing sequence of token ids, decoding only a few recent ids per token
    (as vLLM's `detokenize_incrementally`), so that a token costs the same at any output length.

        ids:  [ ...... committed ...... | context | pending ]
                                        ^prefix   ^read

    ids[:read] are committed: their text is final.  Each `push` decodes ids[prefix:] and drops
    the text of the context ids[prefix:read] (decoded when they were committed): the context
    gives decoders whose output depends on the previous token (a leading space) what they need.
    The new ids are committed unless their text ends in an incomplete character (U+FFFD): then
    they stay pending, and `length`/`slice` show them decoded as they are, exactly as decoding
    every id at once would (its result is the committed text plus the pending ids' text).  After
    MAX_PENDING_TOKENS pending ids they are committed as they are (their bytes cannot complete a
    character; only output that is not UTF-8 at all gets there).

    The committed text is kept as chunks plus a tail of at least `keep` characters, so appending
    and reading the last `keep` characters cost O(keep), not O(output).  `decode_calls` and
    `decoded_ids` count the tokenizer's work (tests bound them per token)."""

    def __init__(self, tokenizer: Tokenizer, keep: int = 4096):
        self.tokenizer, self.keep = tokenizer, keep
        self.ids: list[int] = []
        self._prefix = self._read = 0
        self._prefix_len = 0            # len(decode(ids[prefix:read]))
        self._chunks: list[str] = []    # committed text before the tail
        self._tail, self._tail_start = "", 0
        self._pending = ""              # the text of ids[read:] (may end in U+FFFD)
        self.decode_calls = self.decoded_ids = 0

    def push(self, token: int) -> None:
        """Append one id and decode what it changes."""
        self.ids.append(token)
        text = self._decode(self.ids[self._prefix:])
        new = text[self._prefix_len:]
        if new.endswith(REPLACEMENT) and len(self.ids) - self._read < MAX_PENDING_TOKENS:
            self._pending = new
            return
        self._commit(new)
        self._prefix, self._read, self._pending = self._read, len(self.ids), ""
        self._prefix_len = len(self._decode(self.ids[self._prefix:self._read]))

    @property
    def length(self) -> int:
        """Characters of text (committed and pending)."""
        return self.committed + len(self._pending)

    @property
    def committed(self) -> int:
        """Characters of final text (the pending ids' text may still change)."""
        return self._tail_start + len(self._tail)

    def slice(self, start: int, end: int | None = None) -> str:
        """text[start:end]: O(length of the result) when `start` lies in the last `keep`
        committed characters or after (every read of the stop checks), O(output) otherwise."""
        if start < self._tail_start:
            return self.text()[start:end]
        s, e = start - self._tail_start, (self.length if end is None else end) - self._tail_start
        n = len(self._tail)
        if e <= n:
            return self._tail[s:e]
        return self._tail[s:] + self._pending[max(0, s - n):e - n]

    def text(self) -> str:
        """The whole text (O(output): for the end of a request)."""
        if self._chunks:
            self._tail, self._tail_start = "".join(self._chunks) + self._tail, 0
            self._chunks = []
        return self._tail + self._pending

    def _commit(self, new: str) -> None:
        self._tail += new
        if len(self._tail) > 2 * self.keep:        # move all but the last `keep` into a chunk
            cut = len(self._tail) - self.keep
            self._chunks.append(self._tail[:cut])
            self._tail, self._tail_start = self._tail[cut:], self._tail_start + cut

    def _decode(self, ids: list[int]) -> str:
        self.decode_calls += 1
        self.decoded_ids += len(ids)
        return self.tokenizer.decode(ids)


def chat_template(root: Path, cfg: dict[str, Any]) -> str | None:
    """The checkpoint's default chat template: `chat_template.jinja` in `root`, else
    tokenizer_config.json's (`cfg`) `chat_template`, a string or [{"name", "template"}] of which
    "default" is used.  None when there is none."""
    file = root / TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)
