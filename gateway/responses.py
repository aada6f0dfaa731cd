"""`POST /v1/responses`: a Responses request served as the chat completion request it becomes
(gateway/responses_input.py), through chat's door -- checks, admission, the tool grammar, the
output reader, structured outputs, migration (`CompletionHandler`) -- and answered as a
response object, or as its documented stream of events:

    response.created, response.in_progress,
    (each output item's events: gateway/responses_output.py)...,
    response.completed | response.incomplete (cut by max_output_tokens) | response.failed

each as `event: <type>` and `data: <json>` with a `sequence_number` from 0.  A failure before
the first token is an error body (as chat's); one after it ends the stream with
response.failed carrying the error."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.tokenizer import Tokenizer
from gateway.admission import Rejected
from gateway.choice import Choice
from gateway.completions import CompletionHandler, Running
from gateway.errors import ForwardError
from gateway.openai_format import Formatter, cached_tokens, prompt_tokens
from gateway.planner import Body
from gateway.responses_input import to_chat
from gateway.responses_output import REASONING, OutputItems
from gateway.responses_request import ResponsesChat, ResponsesRequest
from gateway.streaming import DoneEvent, ErrorEvent, Event, TokensEvent

# chat's names in the refusals of the shared checks, as a Responses client spells them
RENAMED = ((re.compile(r"\bresponse_format\b"), "text.format"),
           (re.compile(r"\bmax_(completion_)?tokens\b"), "max_output_tokens"),
           (re.compile(r"\breasoning_effort\b"), "reasoning.effort"))


class ResponsesFormatter(Formatter):
    """The bodies of one response: the response object (`response`, `envelope`) echoing the
    request's settings, and its usage."""

    def __init__(self, model: str, tok: Tokenizer, source: ResponsesRequest) -> None:
        super().__init__("chat", model, tok, None)
        self.id, self.source = f"resp_{uuid.uuid4().hex}", source

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        """The non-streamed answer of the request's one choice."""
        c = choices[0]
        if c.reader is not None:
            c.reader.finish()
        items = OutputItems()
        items.feed(c.reader.take() if c.reader is not None else {"content": c.text})
        items.close(item_status(c))
        return self.final(choices, items)

    def final(self, choices: list[Choice], items: OutputItems) -> dict[str, Any]:
        """The finished response: completed, or incomplete when max_output_tokens cut it."""
        cut = item_status(choices[0]) == "incomplete"
        return self.envelope("incomplete" if cut else "completed", items.output(), self.usage(choices, items),
                             incomplete="max_output_tokens" if cut else None)

    def usage(self, choices: list[Choice], items: OutputItems) -> dict[str, Any]:
        """OpenAI's usage; reasoning_tokens counts the reasoning items' text, encoded again."""
        prompt, output = prompt_tokens(choices), sum(len(c.token_ids) for c in choices)
        reasoning = items.text_of(REASONING)
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached_tokens(choices)},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": min(output, len(self.tok.encode(reasoning)))
                                          if reasoning else 0},
                "total_tokens": prompt + output}

    def envelope(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None, incomplete: str | None = None) -> dict[str, Any]:
        """The response object with `status`, `output` and the request's settings echoed."""
        s = self.source
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": s.instructions, "max_output_tokens": s.max_output_tokens,
                "max_tool_calls": s.max_tool_calls, "model": self.model, "output": output,
                "parallel_tool_calls": s.parallel_tool_calls is not False, "previous_response_id": None,
                "reasoning": {"effort": (s.reasoning or {}).get("effort"), "summary": None},
                "store": False, "temperature": 1.0 if s.temperature is None else s.temperature,
                "text": {"format": (s.text or {}).get("format") or {"type": "text"}, "verbosity": "medium"},
                "tool_choice": "auto" if s.tool_choice is None else s.tool_choice, "tools": s.tools or [],
                "top_p": 1.0 if s.top_p is None else s.top_p, "truncation": "disabled", "usage": usage,
                "user": s.user, "metadata": s.metadata or {}, "background": False, "service_tier": "default",
                "safety_identifier": s.safety_identifier, "prompt_cache_key": s.prompt_cache_key,
                "top_logprobs": 0}


def item_status(c: Choice) -> str:
    """How the last output item ended: "incomplete" when the choice ran to its token limit."""
    return "incomplete" if c.finish is not None and c.finish.finish_reason == "length" else "completed"


def failure(error: dict[str, Any], status: int) -> dict[str, Any]:
    """A failed response's `error`: OpenAI's codes there are few (server_error,
    rate_limit_exceeded, invalid_prompt, ...), so the gateway's own code goes in the message."""
    code = "rate_limit_exceeded" if status == 429 else "invalid_prompt" if status == 400 else "server_error"
    return {"code": code, "message": f"{error['message']} ({error['code']})", "type": error["type"], "param": None}


async def response_events(fmt: ResponsesFormatter, choice: Choice, events: asyncio.Queue[Event], first: Event,
                          on_error: Callable[[ForwardError], dict[str, Any]],
                          on_done: Callable[[], None]) -> AsyncIterator[str]:
    """The event stream of one response (module docstring): `on_error` makes the error body of
    a failure, `on_done` runs when the response completed."""
    numbers = itertools.count()

    def sse(event: dict[str, Any]) -> str:
        event["sequence_number"] = next(numbers)
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    items, reader = OutputItems(), choice.reader
    for kind in ("response.created", "response.in_progress"):
        yield sse({"type": kind, "response": fmt.envelope("in_progress", [])})
    event = first
    while True:
        if isinstance(event, ErrorEvent):
            items.cut()                  # the item it cut is in the failed response, as far as it got
            yield sse({"type": "response.failed", "response": fmt.envelope(
                "failed", items.output(), error=failure(on_error(event.error)["error"], event.error.status))})
            return
        if isinstance(event, TokensEvent):
            for e in items.feed(reader.take() if reader is not None else {"content": event.tokens.text}):
                yield sse(e)
        if isinstance(event, DoneEvent):
            if reader is not None:
                reader.finish()       # what it held back comes now
                for e in items.feed(reader.take()):
                    yield sse(e)
            for e in items.close(item_status(choice)):
                yield sse(e)
            body = fmt.final([choice], items)
            yield sse({"type": f"response.{body['status']}", "response": body})
            on_done()
            return
        event = await events.get()


class ResponsesHandler(CompletionHandler):
    """Serves `POST /v1/responses` through chat's door, answering in the Responses shapes."""

    async def respond(self, body: ResponsesRequest, request: Request, tenant: str) -> Response:
        """The response (JSON or events); raises Rejected (400 naming the field, as a Responses
        client spells it) before anything is admitted."""
        try:
            return await self.serve(to_chat(body, self.gw.config.max_messages), request, tenant)
        except Rejected as e:
            for pattern, name in RENAMED:
                e.message = pattern.sub(name, e.message)
                e.param = pattern.sub(name, e.param) if e.param is not None else None
            raise

    def ignored(self, body: Body) -> str:
        """The Responses request's ignored fields, by their paths in it."""
        if not isinstance(body, ResponsesChat):
            return super().ignored(body)
        names = list(dict.fromkeys(body.unread + ["reasoning.effort" for _ in self._unread(body)]))
        if names:
            self.gw.metrics.ignored_fields.inc()
        return self.ignored_log.report(names)

    def _formatter(self, body: Body) -> Formatter:
        if not isinstance(body, ResponsesChat):
            return super()._formatter(body)
        return ResponsesFormatter(self.gw.config.served_model_name, self.gw.tokenizer, body.source)

    def _events(self, body: Body, run: Running, first: Event) -> AsyncIterator[str]:
        fmt = run.fmt
        if not isinstance(fmt, ResponsesFormatter):
            return super()._events(body, run, first)
        return response_events(fmt, run.choices[0], run.events, first, lambda e: self._error_body(e, fmt.id),
                               lambda: self._count(run.choices, "ok"))

