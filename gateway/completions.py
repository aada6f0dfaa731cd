"""Serving one chat or text completion request: check its fields (400 naming the field),
tokenize once off the event loop, check it against the context and the decode workers' KV
capacity (400 before any worker is contacted), admit it through the queue, forward every
choice, and answer as JSON or as server-sent events.  A failure past the gateway reaches the
client as a code, a short message and the request id; its details go to the log."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.errors import ErrorCode
from gateway.admission import Rejected
from gateway.attempt import cancelling
from gateway.choice import Choice
from gateway.errors import ForwardError, error_body, public, public_message
from gateway.fairness import reserved_tokens, share_key
from gateway.fields import IGNORED_HEADER
from gateway.forward import forward
from gateway.openai_format import Formatter, prompt_tokens
from gateway.planner import Body, RequestPlanner
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.route import Route
from gateway.streaming import DoneEvent, ErrorEvent, Event, EventStream, Generation, TokensEvent, sse

log = logging.getLogger("tandem.gateway")


@dataclass(frozen=True)
class Running:
    """An admitted request being forwarded: its choices, how they are formatted, the events
    their tasks report, the tasks with their admission slot, and the task that watches for a
    non-streaming client that leaves."""
    choices: list[Choice]
    fmt: Formatter
    events: asyncio.Queue[Event]
    generation: Generation
    watch: asyncio.Task[None]


class CompletionHandler(RequestPlanner):
    """Serves a request's choices (`RequestPlanner`, gateway/planner.py, makes them): admission,
    forwarding every choice, the JSON or event-stream answer."""

    async def serve(self, body: Body, request: Request, tenant: str) -> Response:
        """The response to one request (JSON or a stream of server-sent events), naming the
        fields it ignored in the IGNORED_HEADER (a refusal names them too: `request.state`);
        raises Rejected before anything is admitted."""
        ignored = request.state.ignored_fields = self.ignored(body)
        response = await self._serve(body, request, tenant)
        if ignored:
            response.headers[IGNORED_HEADER] = ignored
        return response

    async def _serve(self, body: Body, request: Request, tenant: str) -> Response:
        """Check the request, admit it, forward every choice; answer as a stream or as JSON."""
        choices, share = await self._prepare(body, request, tenant)
        fmt = self._formatter(body)
        slot = AsyncExitStack()
        await slot.enter_async_context(self.gw.queue.admit(share, reserved_tokens(choices)))
        run = self._start(choices, fmt, tenant, slot, request)
        if body.stream:
            return await self._streamed(body, run)
        return await self._collected(run)

    async def _prepare(self, body: Body, request: Request, tenant: str) -> tuple[list[Choice], str]:
        """The request's choices, tokenized and checked against the context and the decode
        workers' KV capacity, and whom it counts against in the limits; raises Rejected."""
        gw = self.gw
        if gw.draining:
            raise Rejected("draining", "the server is shutting down; retry on another replica")
        self.check(body)
        context, capacity = gw.context_len(), gw.pool.capacity_tokens()
        if capacity == 0:
            raise Rejected("no_worker", "no decode worker is ready; retry later")
        share = share_key(request, tenant, bool(gw.keys))
        constraint = await gw.structured.constraint(body, gw.output_settings, share)
        choices = await gw.prepare(self.choices, body, context, capacity, tenant,
                                   frozenset(gw.pool.page_sizes()), constraint)
        return choices, share

    def _formatter(self, body: Body) -> Formatter:
        so = body.stream_options
        return Formatter("chat" if isinstance(body, ChatCompletionRequest) else "text",
                         self.gw.config.served_model_name, self.gw.tokenizer, body.logprobs_n, body.return_token_ids,
                         continuous_usage=bool(body.stream and so and so.include_usage and so.continuous_usage_stats),
                         prompt_logprobs=isinstance(body, CompletionRequest) and body.prompt_logprobs is not None)

    def _start(self, choices: list[Choice], fmt: Formatter, tenant: str, slot: AsyncExitStack,
               request: Request) -> Running:
        """One forwarding task per choice, under the admission `slot` (it goes back when the
        tasks end), and the watch for a client that leaves."""
        events: asyncio.Queue[Event] = asyncio.Queue()
        started = time.monotonic()
        route = self._route(fmt.id, tenant, started)
        tasks = [asyncio.create_task(self._run(choice, route, events, started)) for choice in choices]
        watch = asyncio.create_task(_watch_disconnect(request, tasks, events))
        return Running(choices, fmt, events, Generation(slot, tasks), watch)

    async def _streamed(self, body: Body, run: Running) -> Response:
        """The event stream, once its first event is in: until then nothing is written, so a
        client that left is noticed here, and a failure before any token is a JSON error."""
        try:
            first = await run.events.get()
        except BaseException:
            await run.generation.close()
            raise
        finally:
            run.watch.cancel()
        fmt = run.fmt
        if isinstance(first, ErrorEvent) and first.choice is None:     # failed before any token
            await run.generation.close()
            return self._error(first.error, fmt.id)
        return EventStream(self._events(body, run, first), on_close=run.generation.close)

    def _events(self, body: Body, run: Running, first: Event) -> AsyncIterator[str]:
        """The server-sent events of an admitted stream whose first event is `first`: OpenAI's
        chunks (an endpoint that answers in another shape overrides this)."""
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse(run.fmt, run.choices, run.events, first, include_usage,
                   lambda e: self._error_body(e, run.fmt.id), lambda: self._count(run.choices, "ok"))

    async def _collected(self, run: Running) -> Response:
        """The JSON answer once every choice is done, or the first error."""
        try:
            done = 0
            while done < len(run.choices):
                event = await run.events.get()
                if isinstance(event, ErrorEvent):
                    return self._error(event.error, run.fmt.id)
                done += isinstance(event, DoneEvent)
        finally:
            run.watch.cancel()
            await run.generation.close()
        self._count(run.choices, "ok")
        return JSONResponse(run.fmt.response(run.choices))

    def _route(self, rid: str, tenant: str, started: float) -> Route:
        """How the request's choices are forwarded: its id, tenant and deadline, the gateway's
        workers and bounds."""
        cfg = self.gw.config
        return Route(self.gw.pool, rid, tenant, started + cfg.request_timeout_s, cfg.max_attempts,
                     cfg.queue_timeout_s, cfg.max_migrations, self.gw.metrics.migration)

    async def _run(self, choice: Choice, route: Route, events: asyncio.Queue[Event], started: float) -> None:
        """Forward one choice, reporting each TokensEvent and then a DoneEvent or an ErrorEvent."""
        gw = self.gw
        last: float | None = None
        try:
            async for tokens in forward(choice, route):
                now = time.monotonic()
                gw.metrics.itl.observe(now - last) if last is not None else gw.metrics.ttft.observe(now - started)
                last = now
                await events.put(TokensEvent(choice, tokens))
            gw.metrics.e2e.observe(time.monotonic() - started)
            await events.put(DoneEvent(choice))
        except ForwardError as e:
            await events.put(ErrorEvent(e, choice if choice.token_ids else None))
        except asyncio.CancelledError:
            if cancelling():
                raise                         # the response itself was cancelled
            await events.put(ErrorEvent(ForwardError(ErrorCode.DECODE_FAILED, "the call was cut"),
                                        choice if choice.token_ids else None))
        except Exception:  # never leave the response waiting: a bug becomes an explicit 500
            log.exception("request %s: forwarding failed", route.request_id)
            await events.put(ErrorEvent(ForwardError(ErrorCode.INTERNAL, "gateway error (logged)", 500),
                                        choice if choice.token_ids else None))

    def _count(self, choices: list[Choice], status: str) -> None:
        m = self.gw.metrics
        m.requests.labels(status).inc()
        m.prompt_tokens.inc(prompt_tokens(choices))
        m.generated.inc(sum(len(c.token_ids) for c in choices))
        m.prompt_logprobs.inc(sum(len(e.top) + 1 for c in choices for e in c.prompt_logprobs or ()))

    def _error_body(self, err: ForwardError, rid: str) -> dict[str, Any]:
        """The client's view of a failed request, as a response or a stream's last event: its
        code as the error table spells it and its public message (gateway/errors.py); the
        details go to the log under the request id."""
        self.gw.metrics.requests.labels("error").inc()
        log.warning("request %s failed: %s: %s", rid, err.code.value, err.message)
        return error_body(err.code, public_message(err.code, err.message, rid), status=err.status)

    def _error(self, err: ForwardError, rid: str) -> JSONResponse:
        return JSONResponse(self._error_body(err, rid), status_code=err.status,
                            headers=public(err.code).headers())


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _watch_disconnect(request: Request, tasks: list[asyncio.Task[None]], events: asyncio.Queue[Event]) -> None:
    """A non-streaming client that goes away cancels its generations (and their pages)."""
    while True:
        await asyncio.sleep(0.25)
        if await request.is_disconnected():
            await _cancel(tasks)
            await events.put(ErrorEvent(ForwardError(ErrorCode.CANCELLED, "the client disconnected", 499), None))
            return
