"""Chat messages, tools and what the gateway reads of a chat's output: the message and tool
models of a chat request, the conversation rendered through the chat template, and the
output settings (reasoning parser, tool-call parser) of the served model.

(Contract skeleton for issue 21: gateway/chat.py, gateway/tools.py and gateway/reasoning.py
are filled by the output-parsing work.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from gateway.protocol import ChatCompletionRequest


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None      # an assistant's earlier calls
    tool_call_id: str | None = None                     # a tool result: the call it answers
    reasoning_content: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content):
                raise ValueError("only text content parts are supported")
            return "".join(parts)
        return self.content or ""


@dataclass(frozen=True)
class OutputSettings:
    """How the served model's output is read: `reasoning` names the reasoning parser (None:
    off), `reasoning_end` the text that ends a reasoning section ("" when off; a constraint's
    `after`), `tool_parser` the tool-call syntax parser (None: tools are refused in auto mode)."""
    reasoning: str | None = None
    reasoning_end: str = ""
    tool_parser: str | None = None


def render_chat(tok: Tokenizer, body: ChatCompletionRequest) -> str:
    """The conversation as the chat template renders it, with the generation prompt."""
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    return tok.apply_chat_template(messages, add_generation_prompt=True)


def reasoning_end(settings: OutputSettings, body: ChatCompletionRequest) -> str:
    """The marker after which this request's constraint applies ("" : from the first token)."""
    return settings.reasoning_end if settings.reasoning else ""
