"""The body of OpenAI's Responses API (`POST /v1/responses`) as the gateway accepts it, and its
checks: every field is honoured (gateway/responses_input.py turns the request into a chat
completion request), refused with 400 naming it, or, where it changes nothing here, accepted.
A field nobody defines is kept (`extra="allow"`) and named back, as for chat (gateway/fields.py).

This server stores no responses: `store` is false in every response, and `store: true`,
`previous_response_id`, `conversation` and `background` are refused (docs/api.md says why)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.admission import InvalidField
from gateway.errors import shown
from gateway.fields import neutral
from gateway.protocol import REASONING_EFFORTS, UINT32_MAX, ChatCompletionRequest

NOT_STORED = "this server stores no responses"
# Fields OpenAI defines that are refused unless sent with a neutral value (what leaving them out means).
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((None, False), "background=true is not supported: responses are answered while the "
                   "request is open (stream it to read it as it comes)"),
    "background_options": ((None,), "background_options is not supported: background responses are not"),
    "conversation": ((None,), f"conversation is not supported: {NOT_STORED} or conversations; send the whole "
                     "conversation as input items"),
    "prompt": ((None,), "prompt (a stored prompt template) is not supported: send instructions and input"),
    "context_management": ((None, []), "context_management is not supported: a conversation longer than the "
                           "context is refused (400), never compacted"),
    "image": ((None,), "image is not supported: this server reads text input only"),
    "moderation": ((None,), "moderation is not supported: this server runs no moderation model"),
    "access_programs": ((None,), "access_programs is not supported"),
    "service_tier": ((None, "auto", "default"), "service_tier other than auto or default is not supported"),
    "top_logprobs": ((None, 0), "top_logprobs is not supported: /v1/responses returns no logprobs (use "
                     "/v1/chat/completions with logprobs)"),
}
# Fields OpenAI defines that change nothing in a response here (identifiers, cache hints, and
# max_tool_calls, which bounds calls to built-in tools, which are refused).
NO_EFFECT = frozenset({"prompt_cache_retention", "prompt_cache_options"})
REASONING_FIELDS = ("effort", "summary", "generate_summary")
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512      # OpenAI's limits


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`.  Strict like the chat body (gateway/protocol.py); items, tools and
    settings are read by gateway/responses_input.py, which names a bad one by its path."""
    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    # no effect: echoed back
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    def check(self) -> None:
        """Refuses (InvalidField, 400 naming the field) what this server cannot honour, and
        values out of range.  The input items and tools are checked as they are translated."""
        if self.store:
            raise InvalidField("store", f"store=true is not supported: {NOT_STORED}, so none could be retrieved "
                               "or continued later (send store=false or leave it out: every response says "
                               "store: false)", "unsupported")
        if self.previous_response_id is not None:
            raise InvalidField("previous_response_id", f"previous_response_id is not supported: {NOT_STORED}; "
                               "send the earlier turns, with the output items you received, as input items",
                               "unsupported")
        for name, value in (self.model_extra or {}).items():
            if name in REFUSED and not neutral(value, REFUSED[name][0]):
                raise InvalidField(name, REFUSED[name][1], "unsupported")
        if self.truncation not in (None, "disabled"):
            raise InvalidField("truncation", f"truncation={shown(self.truncation or '')} is not supported: a "
                               "conversation longer than the context is refused with 400 (context_length), never "
                               "cut (send truncation=disabled or leave it out)", "unsupported")
        if self.include:
            raise InvalidField("include", f"include {shown(str(self.include[0]))} is not supported: this server "
                               "returns no encrypted reasoning, logprobs or built-in tool results", "unsupported")
        n = self.max_output_tokens
        if n is not None and not 1 <= n <= UINT32_MAX:
            raise InvalidField("max_output_tokens", f"max_output_tokens={n} is out of range: it must be in "
                               f"1..{UINT32_MAX}")
        self._check_reasoning()
        self._check_metadata()

    def _check_reasoning(self) -> None:
        r = self.reasoning or {}
        effort = r.get("effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise InvalidField("reasoning.effort", f"reasoning.effort {shown(str(effort))} is not one of "
                               f"{', '.join(REASONING_EFFORTS)}")
        for key in ("summary", "generate_summary"):
            if r.get(key) is not None:
                raise InvalidField(f"reasoning.{key}", f"reasoning.{key} is not supported: no summary is "
                                   "written; a reasoning item carries the reasoning text itself (its content)",
                                   "unsupported")

    def _check_metadata(self) -> None:
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA_KEYS:
            raise InvalidField("metadata", f"metadata has {len(meta)} keys; at most {MAX_METADATA_KEYS} are allowed")
        for k, v in meta.items():
            if len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE:
                raise InvalidField("metadata", f"metadata key {shown(k)}: keys are at most {MAX_METADATA_KEY} "
                                   f"characters and values at most {MAX_METADATA_VALUE}")

    def ignored_fields(self) -> list[str]:
        """Fields of the body (outside input and tools) that no one Tandem follows defines."""
        out = [k for k in self.model_extra or {} if k not in REFUSED and k not in NO_EFFECT]
        out += [f"reasoning.{k}" for k in self.reasoning or {} if k not in REASONING_FIELDS]
        out += [f"stream_options.{k}" for k in self.stream_options or {} if k != "include_obfuscation"]
        if self.stream_options is not None and not self.stream:
            out.append("stream_options")
        return out


class ResponsesChat(ChatCompletionRequest):
    """The chat completion request a Responses request is served as (gateway/responses_input.py
    makes it): `source` is the request itself, whose settings the response echoes, and
    `unread` the paths of its fields that were ignored (named back to the client)."""
    source: ResponsesRequest
    unread: list[str] = Field(default_factory=list)
