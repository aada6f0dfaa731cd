"""Streaming an admitted request back: the events its forwarding tasks report, its
`Generation` (the tasks and the admission slot they hold), and the server-sent events of a
stream.

The slot belongs to the generation, not to the response: it goes back when the last task
ends, whether or not the client has read what they produced.  A client that reads slowly, or
not at all, holds only its connection and the text already generated, until it reads it or
`SendDeadline` (gateway/limits.py) closes the connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.choice import Choice
from gateway.errors import ForwardError
from gateway.openai_format import Formatter
from proto import worker_pb2 as wpb


# What a choice's forwarding task reports to the response, in order: TokensEvent..., then
# DoneEvent or ErrorEvent.
@dataclass(frozen=True)
class TokensEvent:
    choice: Choice
    tokens: wpb.Tokens


@dataclass(frozen=True)
class DoneEvent:
    choice: Choice


@dataclass(frozen=True)
class ErrorEvent:
    error: ForwardError
    choice: Choice | None             # None: the choice failed before any token was streamed


Event = TokensEvent | DoneEvent | ErrorEvent


class Generation:
    """The forwarding tasks of one admitted request and the admission slot they run under
    (`slot`: an exit stack holding the queue's `admit`).  The slot is released once, when the
    last task has ended: by itself, or cancelled by `close`."""

    def __init__(self, slot: AsyncExitStack, tasks: list[asyncio.Task[None]]) -> None:
        self.slot, self.tasks = slot, tasks
        self._released = asyncio.ensure_future(self._release_when_done())

    async def _release_when_done(self) -> None:
        try:
            await asyncio.wait(self.tasks)
        finally:
            await self.slot.aclose()

    async def close(self) -> None:
        """Cancel the tasks still running and wait until the slot is back.  Idempotent."""
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.shield(self._released)


class EventStream(StreamingResponse):
    """Server-sent events that run `on_close` however the response ends: complete, the client
    gone, its connection closed for not reading (`ClientStalled` from the send), or an error."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


async def sse(fmt: Formatter, choices: list[Choice], events: asyncio.Queue[Event], first: Event,
              include_usage: bool, on_error: Callable[[ForwardError], dict[str, object]],
              on_done: Callable[[], None]) -> AsyncIterator[str]:
    """The events of one stream: each choice's first chunk carries the role, then its text as it
    comes (or, read by its `ChoiceReader`, its reasoning, content and tool-call deltas: what
    became final by then), a final chunk with the finish reason; usage if asked; `[DONE]`.  A choice that fails
    ends the stream with the error body `on_error` makes (and no `[DONE]`); `on_done` runs when
    the stream completed."""
    sent_role: set[int] = set()
    offsets = {c.index: 0 for c in choices}
    item, done = first, 0
    while True:
        if isinstance(item, ErrorEvent):
            yield _event(on_error(item.error))
            return
        c = item.choice
        reader = c.reader
        if isinstance(item, TokensEvent) or c.index not in sent_role:
            tokens = item.tokens if isinstance(item, TokensEvent) else wpb.Tokens()
            yield _event(fmt.chunk(c, tokens.text, list(tokens.logprobs), first=c.index not in sent_role,
                                   offset=offsets[c.index], ids=list(tokens.token_ids),
                                   delta=reader.take() if reader else None))
            offsets[c.index] += len(tokens.text)
            sent_role.add(c.index)
        if isinstance(item, DoneEvent):
            done += 1
            if reader is not None:
                reader.finish()       # what it held back (a call block closed by the end) comes now
            yield _event(fmt.chunk(c, "", [], delta=reader.take() if reader else None, last=True))
            if done == len(choices):
                break
        item = await events.get()
    if include_usage:
        yield _event(fmt.usage_chunk(choices))
    yield "data: [DONE]\n\n"
    on_done()


def _event(body: dict[str, object]) -> str:
    return f"data: {json.dumps(body)}\n\n"
