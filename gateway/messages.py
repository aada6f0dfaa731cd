"""Serving `POST /v1/messages`, Anthropic's Messages API, through the chat path: the body becomes a
`ChatCompletionRequest` (gateway/messages_request.py) that `CompletionHandler` serves as it
serves any chat, through the same admission, tenant limits, tool grammars, output reader and
migration; only what the client reads is Anthropic's: the message, its named stream events and
the error bodies (gateway/messages_format.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from gateway.completions import CompletionHandler, Running
from gateway.errors import ForwardError
from gateway.fields import IGNORED_HEADER
from gateway.messages_format import MessagesFormatter, error_body, message_events
from gateway.messages_request import MessagesRequest, chat_request
from gateway.planner import Body
from gateway.streaming import Event


class MessagesHandler(CompletionHandler):
    """CompletionHandler answering in the Messages API's shapes."""

    async def serve_messages(self, body: MessagesRequest, request: Request, tenant: str) -> Response:
        """The response to one Messages request (JSON or named server-sent events), naming the
        fields it ignored in the IGNORED_HEADER (a refusal names them too: `request.state`);
        raises Rejected (400 naming the field) before anything is admitted."""
        names = list(dict.fromkeys(body.ignored_fields()))
        if names:
            self.gw.metrics.ignored_fields.inc()
        ignored = request.state.ignored_fields = self.ignored_log.report(names)
        chat = chat_request(body, self.gw.config.max_messages, self.gw.output_settings.reasoning is not None)
        response = await self._serve(chat, request, tenant)
        if ignored:
            response.headers[IGNORED_HEADER] = ignored
        return response

    def _formatter(self, body: Body) -> MessagesFormatter:
        return MessagesFormatter(self.gw.config.served_model_name, self.gw.tokenizer)

    def _events(self, body: Body, run: Running, first: Event) -> AsyncIterator[str]:
        fmt = run.fmt
        assert isinstance(fmt, MessagesFormatter) and len(run.choices) == 1
        return message_events(fmt, run.choices[0], run.events, first, lambda e: self._error_body(e, fmt.id),
                              lambda: self._count(run.choices, "ok"))

    def _error_body(self, err: ForwardError, rid: str) -> dict[str, Any]:
        """The error table's answer (counted and logged as for chat) in Anthropic's shape."""
        e = super()._error_body(err, rid)["error"]
        return error_body(e["code"], e["message"], e["param"], err.status)
