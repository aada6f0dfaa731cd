"""The body of Anthropic's Messages API (`POST /v1/messages`) the gateway accepts (pydantic, strict,
as gateway/protocol.py: a field of the wrong type answers 400 naming it), what it does with each
field, and the `ChatCompletionRequest` it becomes, which CompletionHandler serves like any chat
(admission, tool grammars, the output reader, migration).

- honoured: model, max_tokens, messages, system, stop_sequences, temperature, top_p, top_k, tools
  (client tools), tool_choice, stream, thinking (as far as `check_thinking` says);
- accepted, changing nothing: metadata, cache_control (the prefix cache works without hints),
  user_profile_id, workspace_id, service_tier auto or standard_only;
- refused with 400 naming it (`UNHONOURED`, unless its value is a neutral one): container,
  mcp_servers, context_management, diagnostics, inference_geo, speed fast, output_config,
  output_format, server tools, a thinking budget, max_tokens 0;
- any other field is ignored and named back in X-Tandem-Ignored-Fields (gateway/fields.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from gateway.admission import InvalidField
from gateway.chat import FunctionDef, Tool
from gateway.errors import shown
from gateway.fields import neutral
from gateway.messages_convert import conversation, count_blocks, ignored_block_fields
from gateway.protocol import INT32_MAX, ChatCompletionRequest

BLOCKS_PER_MESSAGE = 4              # content blocks in one request: at most this many x max_messages
NO_EFFECT = frozenset({"metadata", "cache_control", "user_profile_id", "workspace_id"})
UNHONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "container": ((None,), "container is not supported: this server runs no code-execution containers"),
    "mcp_servers": ((None, []), "mcp_servers is not supported: this server connects to no MCP servers"),
    "context_management": ((None,), "context_management is not supported: send the context you want read"),
    "diagnostics": ((None,), "diagnostics is not supported"),
    "inference_geo": ((None,), "inference_geo is not supported: this server runs where it was started"),
    "service_tier": ((None, "auto", "standard_only"), "service_tier other than auto or standard_only is not "
                     "supported"),
    "speed": ((None, "standard"), "speed other than standard is not supported"),
    "output_config": ((None, {}, {"effort": None}, {"format": None}, {"effort": None, "format": None}),
                      "output_config (effort, format) is not supported"),
    "output_format": ((None,), "output_format is not supported"),
}
TOOL_FIELDS = ("name", "description", "input_schema", "type", "strict", "cache_control")
# fields of a client tool that Tandem cannot honour, with their neutral values
TOOL_UNHONOURED: dict[str, tuple[Any, ...]] = {"input_examples": (None, []), "allowed_callers": (None, ["direct"]),
                                               "defer_loading": (None, False), "eager_input_streaming": (None, True)}
THINKING_FIELDS = ("type", "budget_tokens", "display")


class MessageTurn(BaseModel):
    """One message of `messages`: its content a string or content blocks (gateway/messages_convert.py
    reads them)."""
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class MessagesTool(BaseModel):
    """A tool definition; a server tool (another `type`) is refused by `chat_tools`."""
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    strict: bool | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoiceSpec(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    max_tokens: int
    messages: list[MessageTurn] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0, le=1)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=INT32_MAX)     # 0: off, as leaving it out
    tools: list[MessagesTool] | None = None
    tool_choice: ToolChoiceSpec | None = None
    stream: bool = False
    thinking: dict[str, Any] | None = None

    def ignored_fields(self) -> list[str]:
        """The fields of the body no one defines, as paths (`x`, `messages[].x`, `tools[].x`, ...)."""
        out = [k for k in self.model_extra or {} if k not in UNHONOURED and k not in NO_EFFECT]
        out += [f"messages[].{k}" for m in self.messages for k in m.model_extra or {}]
        out += ignored_block_fields(self)
        for t in self.tools or ():
            out += [f"tools[].{k}" for k in t.model_extra or {} if k not in TOOL_UNHONOURED]
        if self.tool_choice is not None:
            out += [f"tool_choice.{k}" for k in self.tool_choice.model_extra or {}]
        out += [f"thinking.{k}" for k in self.thinking or {} if k not in THINKING_FIELDS]
        return out


def chat_request(body: MessagesRequest, max_messages: int, reasoning: bool) -> ChatCompletionRequest:
    """The chat request that serves `body` (n is 1).  `max_messages`: the gateway's bound on
    messages, which also bounds the content blocks and the chat messages they become;
    `reasoning`: whether the served model's output is read for reasoning.  Raises
    Rejected/InvalidField (400) naming the field; contacts no worker."""
    check_fields(body, reasoning)
    if len(body.messages) > max_messages:
        raise InvalidField("messages", f"the request has {len(body.messages)} messages; at most {max_messages} "
                           "are allowed")
    blocks, limit = count_blocks(body), BLOCKS_PER_MESSAGE * max_messages
    if blocks > limit:
        raise InvalidField("messages", f"the request has {blocks} content blocks; at most {limit} are allowed "
                           f"({BLOCKS_PER_MESSAGE} per message of max_messages)")
    messages = conversation(body)
    if len(messages) > max_messages:
        raise InvalidField("messages", f"the conversation is {len(messages)} chat messages once each tool_result "
                           f"block is one of its own; at most {max_messages} are allowed")
    tools, choice, parallel = chat_tools(body)
    return ChatCompletionRequest(model=body.model, messages=messages, max_tokens=body.max_tokens,
                                 temperature=body.temperature, top_p=body.top_p, top_k=body.top_k or -1,
                                 stop=list(body.stop_sequences) if body.stop_sequences else None,
                                 stream=body.stream, tools=tools, tool_choice=choice, parallel_tool_calls=parallel)


def check_fields(body: MessagesRequest, reasoning: bool) -> None:
    """The top-level fields Tandem cannot honour, max_tokens and stop_sequences.  Raises InvalidField."""
    for name, value in (body.model_extra or {}).items():
        if name in UNHONOURED and not neutral(value, UNHONOURED[name][0]):
            raise InvalidField(name, UNHONOURED[name][1], "unsupported")
    if body.max_tokens == 0:
        raise InvalidField("max_tokens", "max_tokens=0 (warming the prompt cache without an answer) is not "
                           "supported: the prefix cache fills as requests run; send max_tokens >= 1", "unsupported")
    if body.max_tokens < 0:
        raise InvalidField("max_tokens", "max_tokens is out of range: it must be at least 1")
    stops = body.stop_sequences or []
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidField("stop_sequences", f"stop_sequences has {len(stops)} strings; at most {MAX_STOP_STRINGS} "
                           "are allowed")
    for s in stops:
        if not s or len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidField("stop_sequences", f"stop_sequences must be non-empty strings of at most "
                               f"{MAX_STOP_STRING_CHARS} characters, got one of {len(s)}")
    check_thinking(body.thinking, reasoning)


def check_thinking(thinking: dict[str, Any] | None, reasoning: bool) -> None:
    """`thinking`: absent, or adaptive (the model reasons when it does: its reasoning comes back as
    thinking blocks, whole, never summarized), or disabled for a model that does not reason.
    A budget (type enabled) cannot be kept apart from max_tokens, nor can reasoning be turned off
    here, nor its text omitted: refused."""
    if thinking is None:
        return
    kind, display = thinking.get("type"), thinking.get("display")
    if kind == "enabled":
        raise InvalidField("thinking", "thinking with a budget (type enabled, budget_tokens) is not supported: the "
                           "model's reasoning is not bounded apart from max_tokens; send type adaptive or leave it "
                           "out", "unsupported")
    if kind == "disabled" and reasoning:
        raise InvalidField("thinking", "thinking type disabled is not supported: this model's reasoning cannot be "
                           "turned off through the Messages API", "unsupported")
    if kind not in ("adaptive", "disabled"):
        raise InvalidField("thinking.type", f"thinking type {shown(str(kind))} is not one of enabled, adaptive, "
                           "disabled", "unsupported")
    if not neutral(display, (None, "summarized")):
        raise InvalidField("thinking.display", "thinking display other than summarized is not supported: the "
                           "reasoning comes back whole", "unsupported")


def chat_tools(body: MessagesRequest) -> tuple[list[Tool] | None, str | dict[str, Any] | None, bool]:
    """(tools, tool_choice, parallel_tool_calls) of the chat request.  Raises InvalidField naming the
    field: a server tool, a tool without input_schema, strict with tool_choice auto (only any and
    tool enforce the schema, by grammar; none offers no tool), a tool_choice naming an unknown tool."""
    spec = body.tool_choice or ToolChoiceSpec(type="auto")
    tools = []
    for i, t in enumerate(body.tools or ()):
        if t.type not in (None, "custom"):
            raise InvalidField(f"tools[{i}].type", f"tools[{i}]: the server tool {shown(t.type)} is not supported: "
                               "this server runs no tools; define client tools (name, description, input_schema)",
                               "unsupported")
        if t.input_schema is None or t.input_schema.get("type") != "object":
            raise InvalidField(f"tools[{i}].input_schema", f"tools[{i}].input_schema is required: a JSON schema "
                               'whose type is "object"', "schema")
        for name, ok in TOOL_UNHONOURED.items():
            if not neutral((t.model_extra or {}).get(name), ok):
                raise InvalidField(f"tools[{i}].{name}", f"tools[{i}].{name} is not supported", "unsupported")
        if t.strict and spec.type == "auto":
            raise InvalidField(f"tools[{i}].strict", "strict tools are enforced with tool_choice any or tool "
                               "(a grammar); with tool_choice auto the input is not", "unsupported")
        tools.append(Tool(function=FunctionDef(name=t.name, description=t.description, parameters=t.input_schema,
                                               strict=t.strict)))
    names = [t.function.name for t in tools]
    if spec.type in ("any", "tool") and not names:
        raise InvalidField("tool_choice", f"tool_choice {spec.type} needs tools", "invalid_request")
    parallel = not spec.disable_parallel_tool_use
    if spec.type == "tool":
        if spec.name not in names:
            raise InvalidField("tool_choice.name", f"tool_choice names the tool {shown(str(spec.name))}, which is "
                               f"not among the tools ({', '.join(names)[:200]})", "invalid_request")
        return tools, {"type": "function", "function": {"name": spec.name}}, parallel
    return tools or None, {"auto": None, "any": "required", "none": "none"}[spec.type], parallel
