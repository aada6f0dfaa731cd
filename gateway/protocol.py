"""The OpenAI request bodies the gateway accepts (pydantic, strict: schema violations answer
400 `schema`, gateway/body_errors.py), and their translation into the engine's sampling
parameters (bad values answer 400).

No field is dropped silently (gateway/fields.py): a field OpenAI or a vendor defines that
Tandem cannot honour is refused with 400 naming it (`unsupported`); a field nobody defines is
kept by pydantic (`extra="allow"`) and named by `ignored_fields`."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import fields
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from engine.constraint import Constraint
from engine.params import MAX_LOGIT_BIAS_TOKENS, MAX_LOGPROBS, SamplingParams
from gateway.chat import ChatMessage, Tool
from gateway.errors import shown
from gateway.fields import MESSAGE_NO_EFFECT, NO_EFFECT, UNHONOURED, neutral

INT32_MAX, UINT32_MAX = 2**31 - 1, 2**32 - 1
REASONING_EFFORTS = ("minimal", "low", "medium", "high")     # OpenAI's reasoning_effort values
CONTENT_PART_FIELDS = ("type", "text")      # a text part's (other kinds of parts are refused)
TOOL_CALL_FIELDS = ("id", "type", "function")   # an earlier call in an assistant message
MAX_COMPLETION_LOGPROBS = 5          # /v1/completions' logprobs, as OpenAI
MAX_CACHE_SALT_CHARS = 256           # vLLM's cache_salt: what one request may send
# integer fields of both endpoints and the values accepted (the worker protocol's types bound them)
INT_RANGES = {"max_tokens": (1, UINT32_MAX), "n": (1, INT32_MAX), "seed": (0, 2**63 - 1),
              "top_k": (-1, INT32_MAX), "min_tokens": (0, UINT32_MAX)}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False
    include_obfuscation: bool | None = None   # OpenAI's padding of stream chunks: no effect here
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage in every chunk too


class _Common(BaseModel):
    # unknown fields: named, never dropped silently; strict: "10" or true is not an integer, nor
    # "0.5" a number, nor 1 or "true" a boolean (an integer is a number); nested models (messages,
    # tools) keep their own config
    model_config = ConfigDict(extra="allow", strict=True)
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
        if (bad := self._bad_logit_bias(vocab_size)) is not None:
            return "logit_bias", bad
        for i, t in enumerate(self.stop_token_ids or ()):
            if not 0 <= t < vocab_size:
                return "stop_token_ids", (f"stop_token_ids[{i}]={_show(t)} is not a token of this model's "
                                          f"vocabulary (0..{vocab_size - 1})")
        return None

    def int_ranges(self) -> dict[str, tuple[int, int]]:
        """Field -> (lowest, highest) accepted."""
        return dict(INT_RANGES)

    def _bad_logit_bias(self, vocab_size: int) -> str | None:
        """What is wrong with logit_bias (keys: token ids as strings, values -100..100), or None."""
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS_TOKENS:
            return f"logit_bias has {len(bias)} tokens; at most {MAX_LOGIT_BIAS_TOKENS} are allowed"
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocab_size):
                return (f"logit_bias key {shown(key)} is not a token id of this model's vocabulary "
                        f"(0..{vocab_size - 1})")
            if not -100 <= value <= 100:
                return f"logit_bias[{key!r}]={value!r} is out of range: a bias must be in -100..100"
        return None

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs (checked by `out_of_range` first)."""
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @property
    def prompt_logprobs_n(self) -> int | None:
        """Prompt logprobs wanted per prompt token (None: none): /v1/completions' echo with
        logprobs, or vLLM's prompt_logprobs, the larger."""
        return None

    def unsupported(self) -> str | None:
        """A request option this server cannot honour, named (answered with 400)."""
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty and frequency_penalty are not supported (use 0)"
        for name, value in (self.model_extra or {}).items():
            if name in UNHONOURED and not neutral(value, UNHONOURED[name][0]):
                return UNHONOURED[name][1]
        return None

    def ignored_fields(self) -> list[str]:
        """The fields of the body that no one Tandem follows defines, as paths (`x`,
        `stream_options.x`, `messages[].x`): ignored, and named back to the client."""
        out = [k for k in self.model_extra or {} if k not in UNHONOURED and k not in NO_EFFECT]
        if self.stream_options is not None:
            if not self.stream:            # OpenAI's options of a stream: without one they change nothing
                out.append("stream_options")
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
        if (self.model_extra or {}).get("prompt_logprobs") is not None:
            return "prompt_logprobs is supported on /v1/completions only"
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
                    if not neutral(v, MESSAGE_NO_EFFECT.get(k, ()))]
            for part in m.content if isinstance(m.content, list) else ():
                out += [f"messages[].content[].{k}" for k in part if k not in CONTENT_PART_FIELDS]
            for tc in m.tool_calls or ():
                out += [f"messages[].tool_calls[].{k}" for k in tc if k not in TOOL_CALL_FIELDS]
                fn = tc.get("function")
                out += [f"messages[].tool_calls[].function.{k}" for k in fn if k not in ("name", "arguments")] \
                    if isinstance(fn, dict) else []
        for t in self.tools or ():
            out += [f"tools[].{k}" for k in t.model_extra or {}]
            out += [f"tools[].function.{k}" for k in t.function.model_extra or {}]
        return out

    @property
    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def int_ranges(self) -> dict[str, tuple[int, int]]:
        return {**INT_RANGES, "max_completion_tokens": (1, UINT32_MAX), "top_logprobs": (0, MAX_LOGPROBS)}

    def out_of_range(self, vocab_size: int) -> tuple[str, str] | None:
        effort = self.reasoning_effort
        if effort is not None and effort not in REASONING_EFFORTS:
            return "reasoning_effort", (f"reasoning_effort {shown(effort)} is not one of "
                                        f"{', '.join(REASONING_EFFORTS)}")
        return super().out_of_range(vocab_size)

    @property
    def logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False               # the prompt comes back before the completion (its logprobs too)
    prompt_logprobs: int | None = None   # vLLM's: the prompt tokens' logprobs, top N each
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.max_tokens == 0 and self.prompt_logprobs_n is None:     # echo alone counts (prompt_logprobs_n)
            return "max_tokens=0 generates nothing: it is accepted with echo=true or prompt_logprobs"
        if self.suffix:
            return "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of other than n is not supported"
        return super().unsupported()

    @property
    def wanted_max_tokens(self) -> int | None:
        return self.max_tokens

    def int_ranges(self) -> dict[str, tuple[int, int]]:
        # max_tokens 0: the prompt only (echo, prompt_logprobs), prefilled and nothing generated
        return {**INT_RANGES, "max_tokens": (0, UINT32_MAX), "logprobs": (0, MAX_COMPLETION_LOGPROBS),
                "prompt_logprobs": (0, MAX_LOGPROBS)}

    @property
    def logprobs_n(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_n(self) -> int | None:
        wanted = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        if not wanted:
            return 0 if self.echo and self.max_tokens == 0 else None   # echo only: prefill for nothing else
        return max(wanted)


# SamplingParams fields the request does not carry under the same name: the caller decides the
# first two per choice, each endpoint spells logprobs its own way (`logprobs_n`,
# `prompt_logprobs_n`), and logit_bias comes as {"token id": bias}.  Every other
# field is read from the request field of the same name (tests/test_convert.py checks they exist).
PER_CHOICE = ("max_tokens", "seed", "logprobs", "constraint", "prompt_logprobs", "logit_bias")


def _show(value: int) -> str:
    """An integer for a message, shortened when it is huge."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"


def sampling_params(req: _Common, max_tokens: int, seed: int | None,
                    constraint: Constraint | None = None) -> SamplingParams:
    """Raises ValueError with the engine's message on a bad combination.  `constraint`: the
    request's structured output, built by the caller (gateway/structured.py)."""
    same: dict[str, Any] = {f.name: getattr(req, f.name) for f in fields(SamplingParams) if f.name not in PER_CHOICE}
    # SamplingParams takes a str or list for stop / stop_regex, None for "none"
    return SamplingParams(**same, max_tokens=max_tokens, seed=seed, logprobs=req.logprobs_n,
                          constraint=constraint, prompt_logprobs=req.prompt_logprobs_n,
                          logit_bias=req.logit_bias_pairs)
