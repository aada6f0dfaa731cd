"""The OpenAI request bodies the gateway accepts (pydantic: schema violations answer 422),
and their translation into the engine's sampling parameters (bad values answer 400).

No field is dropped silently: a field OpenAI (or a vendor extension) defines that Tandem
cannot honour is refused with 400 naming it (`UNHONOURED`, `unsupported`); a field nobody
defines is kept by pydantic (`extra="allow"`), named by `ignored_fields`, logged, and listed
in the response's `X-Tandem-Ignored-Fields` header.  The vendor extensions Tandem honours
are listed in `VENDOR_EXTENSIONS`."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import fields
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from engine.constraint import Constraint
from engine.params import MAX_LOGPROBS, SamplingParams
from gateway.chat import ChatMessage, Tool

INT32_MAX, UINT32_MAX = 2**31 - 1, 2**32 - 1
MAX_COMPLETION_LOGPROBS = 5          # /v1/completions' logprobs, as OpenAI
MAX_CACHE_SALT_CHARS = 256           # vLLM's cache_salt: what one request may send
# integer fields of both endpoints and the values accepted (the worker protocol's types bound them)
INT_RANGES = {"max_tokens": (1, UINT32_MAX), "n": (1, INT32_MAX), "seed": (0, 2**63 - 1),
              "top_k": (-1, INT32_MAX), "min_tokens": (0, UINT32_MAX)}


# The extensions to OpenAI's request bodies that Tandem honours: field -> whose and what it does.
VENDOR_EXTENSIONS: dict[str, str] = {
    "top_k": "vLLM/SGLang: sample among the k most likely tokens (-1: off)",
    "min_tokens": "vLLM/SGLang: no stop before this many tokens",
    "stop_token_ids": "vLLM/SGLang: token ids that end the output",
    "stop_regex": "SGLang: regular expressions that end the output",
    "no_stop_trim": "SGLang: keep the matched stop text in the output",
    "ignore_eos": "vLLM/SGLang: generate past the end-of-sequence token",
    "return_token_ids": "vLLM: each choice and chunk also carries its token ids",
    "cache_salt": "vLLM: salts the prefix cache, so only requests with the same salt share pages",
    "chat_template_kwargs": "vLLM/SGLang: extra variables for the chat template (e.g. enable_thinking)",
    "stream_options.continuous_usage_stats": "vLLM: usage in every stream chunk",
    "response_format (on /v1/completions)": "vLLM/SGLang: json_object and json_schema for text completions",
    "structured_outputs": "vLLM: {json | regex | choice | grammar | json_object: true}, one of them",
    "guided_json": "vLLM (older spelling of structured_outputs.json): a JSON schema",
    "guided_regex": "vLLM (older): a regular expression the whole output matches",
    "guided_choice": "vLLM (older): the output is exactly one of these strings",
    "guided_grammar": "vLLM (older): a Lark (llguidance) or GBNF grammar",
    "json_schema": "SGLang: a JSON schema (as text or an object)",
    "regex": "SGLang: a regular expression the whole output matches",
    "ebnf": "SGLang: a GBNF grammar",
}
# Fields defined by OpenAI, vLLM or SGLang that Tandem cannot honour: sent with any value but
# the neutral ones listed (what leaving them out means), they are refused with 400 naming them.
UNHONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((None, []), "functions (deprecated by OpenAI) is not supported: send tools"),
    "function_call": ((None,), "function_call (deprecated by OpenAI) is not supported: send tool_choice"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), 'modalities other than ["text"] are not supported'),
    "prediction": ((None,), "prediction (predicted outputs) is not supported"),
    "web_search_options": ((None,), "web_search_options is not supported: this server does not search the web"),
    "store": ((None, False), "store=true is not supported: this server keeps no completions"),
    "service_tier": ((None, "auto", "default"), "service_tier other than auto or default is not supported"),
    "verbosity": ((None,), "verbosity is not supported"),
    "min_p": ((None, 0), "min_p is not supported (send 0 or leave it out)"),
    "repetition_penalty": ((None, 1), "repetition_penalty is not supported (send 1 or leave it out)"),
    "length_penalty": ((None, 1), "length_penalty is not supported"),
    "use_beam_search": ((None, False), "use_beam_search is not supported"),
    "include_stop_str_in_output": ((None, False), "include_stop_str_in_output is not supported: send "
                                   "no_stop_trim=true"),
    "skip_special_tokens": ((None, True), "skip_special_tokens=false is not supported"),
    "spaces_between_special_tokens": ((None, True), "spaces_between_special_tokens=false is not supported"),
    "prompt_logprobs": ((None,), "prompt_logprobs is not supported"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported: send a choice, regex or grammar"),
    "bad_words": ((None, []), "bad_words is not supported"),
    "truncate_prompt_tokens": ((None,), "truncate_prompt_tokens is not supported"),
    "logits_processors": ((None, []), "logits_processors is not supported"),
    "custom_logit_processor": ((None,), "custom_logit_processor is not supported"),
    "echo": ((None, False), "echo is not supported"),
    "add_generation_prompt": ((None, True), "add_generation_prompt=false is not supported"),
    "continue_final_message": ((None, False), "continue_final_message is not supported"),
    "chat_template": ((None,), "chat_template is not supported: the checkpoint's template is used"),
    "documents": ((None,), "documents is not supported"),
    "guided_whitespace_pattern": ((None,), "guided_whitespace_pattern is not supported"),
    "structural_tag": ((None,), "structural_tag is not supported"),
    "return_tokens_as_token_ids": ((None, False), "return_tokens_as_token_ids is not supported: send "
                                   "return_token_ids=true"),
    "lora_path": ((None,), "LoRA adapters are not supported"),
}
# Fields OpenAI defines that change nothing in a completion (identifiers, cache routing hints,
# stored-completion metadata): accepted without a word.
NO_EFFECT = frozenset({"metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"})
# Fields of an OpenAI chat message that the template does not render and that carry nothing
# when empty (an assistant message echoed back as the client received it).
MESSAGE_NO_EFFECT = {"refusal": (None, ""), "annotations": (None, []), "audio": (None,),
                     "function_call": (None,)}
MAX_IGNORED_NAMED = 16               # fields listed in the header; the rest are counted
MAX_IGNORED_NAME_CHARS = 64


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    include_obfuscation: bool | None = None   # OpenAI's padding of stream chunks: no effect here
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage in every chunk too


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")     # unknown fields: named, never dropped silently
    model: str
    max_tokens: int | None = None
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (as in vLLM / SGLang)
    top_k: int = -1
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    return_token_ids: bool = False   # each choice (and stream chunk) also carries its token ids
    # vLLM's: with the tenant it salts the prefix cache's keys, so only requests that send the
    # same salt (and tenant) share cached pages (engine/prefix_cache.py cache_salt)
    cache_salt: str | None = None
    # structured outputs (gateway/structured.py reads them; at most one per request)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    @abstractmethod
    def logprobs_n(self) -> int | None:
        """Logprobs wanted per token: None for none, N for the chosen token plus the top N
        (each endpoint spells it its own way)."""

    def out_of_range(self, vocab_size: int) -> tuple[str, str] | None:
        """The first field outside what the server accepts, as (field, message), answered with
        400 before anything else is done with the request: an integer past its wire type (32-bit),
        a cache_salt over MAX_CACHE_SALT_CHARS, a stop token not in the vocabulary."""
        for name, (low, high) in self.int_ranges().items():
            value = getattr(self, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and not low <= value <= high:
                return name, f"{name}={_show(value)} is out of range: it must be in {low}..{high}"
        if self.cache_salt is not None and len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            return "cache_salt", (f"cache_salt has {len(self.cache_salt)} characters; at most "
                                  f"{MAX_CACHE_SALT_CHARS} are allowed")
        for i, t in enumerate(self.stop_token_ids or ()):
            if not 0 <= t < vocab_size:
                return "stop_token_ids", (f"stop_token_ids[{i}]={_show(t)} is not a token of this model's "
                                          f"vocabulary (0..{vocab_size - 1})")
        return None

    def int_ranges(self) -> dict[str, tuple[int, int]]:
        """Field -> (lowest, highest) accepted."""
        return dict(INT_RANGES)

    def unsupported(self) -> str | None:
        """A request option this server cannot honour, named (answered with 400)."""
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty and frequency_penalty are not supported (use 0)"
        if self.logit_bias:
            return "logit_bias is not supported"
        for name, value in (self.model_extra or {}).items():
            if name in UNHONOURED and not _neutral(value, UNHONOURED[name][0]):
                return UNHONOURED[name][1]
        return None

    def ignored_fields(self) -> list[str]:
        """The fields of the body that no one Tandem follows defines, as paths (`x`,
        `stream_options.x`, `messages[].x`): ignored, and named back to the client."""
        out = [k for k in self.model_extra or {} if k not in UNHONOURED and k not in NO_EFFECT]
        if self.stream_options is not None:
            out += [f"stream_options.{k}" for k in self.stream_options.model_extra or {}]
        return out


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    # "none", "auto", "required", or {"type": "function", "function": {"name": ...}}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # vLLM's: extra variables for the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None      # OpenAI's; gpt-oss's template reads it

    def unsupported(self) -> str | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs needs logprobs=true"
        for i, m in enumerate(self.messages):
            for name, value in (m.model_extra or {}).items():
                if name in ("function_call", "audio") and value is not None:
                    return (f"messages[{i}].{name} is not supported" +
                            (": send tool_calls" if name == "function_call" else ""))
        return super().unsupported()

    def ignored_fields(self) -> list[str]:
        out = super().ignored_fields()
        for m in self.messages:
            out += [f"messages[].{k}" for k, v in (m.model_extra or {}).items()
                    if not _neutral(v, MESSAGE_NO_EFFECT.get(k, ()))]
        for t in self.tools or ():
            out += [f"tools[].{k}" for k in t.model_extra or {}]
            out += [f"tools[].function.{k}" for k in t.function.model_extra or {}]
        return out

    @property
    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def int_ranges(self) -> dict[str, tuple[int, int]]:
        return {**INT_RANGES, "max_completion_tokens": (1, UINT32_MAX), "top_logprobs": (0, MAX_LOGPROBS)}

    @property
    def logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo is not supported"
        if self.suffix:
            return "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of other than n is not supported"
        return super().unsupported()

    @property
    def wanted_max_tokens(self) -> int | None:
        return self.max_tokens

    def int_ranges(self) -> dict[str, tuple[int, int]]:
        return {**INT_RANGES, "logprobs": (0, MAX_COMPLETION_LOGPROBS)}

    @property
    def logprobs_n(self) -> int | None:
        return self.logprobs


# SamplingParams fields the request does not carry under the same name: the caller decides the
# first two per choice, and each endpoint spells logprobs its own way (`logprobs_n`).  Every other
# field is read from the request field of the same name (tests/test_convert.py checks they exist).
PER_CHOICE = ("max_tokens", "seed", "logprobs", "constraint")


def _show(value: int) -> str:
    """An integer for a message, shortened when it is huge."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """`value` is one of `neutral` (a bool equals only a bool: true is not the number 1)."""
    for n in neutral:
        if value is None or n is None:
            if value is n:
                return True
        elif isinstance(value, bool) or isinstance(n, bool):
            if type(value) is type(n) and value == n:
                return True
        elif value == n:
            return True
    return False


def header_value(names: list[str]) -> str:
    """The X-Tandem-Ignored-Fields header: distinct names in order, printable ASCII, at most
    MAX_IGNORED_NAMED of them (then how many more)."""
    distinct = list(dict.fromkeys(names))
    shown = ["".join(c if " " < c < "\x7f" and c != "," else "?" for c in n[:MAX_IGNORED_NAME_CHARS])
             for n in distinct[:MAX_IGNORED_NAMED]]
    more = len(distinct) - len(shown)
    return ", ".join(shown) + (f", (+{more} more)" if more else "")


def sampling_params(req: _Common, max_tokens: int, seed: int | None,
                    constraint: Constraint | None = None) -> SamplingParams:
    """Raises ValueError with the engine's message on a bad combination.  `constraint`: the
    request's structured output, built by the caller (gateway/structured.py)."""
    same: dict[str, Any] = {f.name: getattr(req, f.name) for f in fields(SamplingParams) if f.name not in PER_CHOICE}
    # SamplingParams takes a str or list for stop / stop_regex, None for "none"
    return SamplingParams(**same, max_tokens=max_tokens, seed=seed, logprobs=req.logprobs_n,
                          constraint=constraint)
