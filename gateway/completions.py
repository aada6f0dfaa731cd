"""Serving one chat or text completion request: tokenize once, check it against the context
and the decode workers' KV capacity (400 before any worker is contacted), admit it through
the queue, forward every choice, and answer as JSON or as server-sent events."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from engine.params import SamplingParams
from gateway.admission import Rejected
from gateway.fairness import reserved_tokens, share_key
from gateway.forward import ForwardError, cancelling, forward
from gateway.openai_format import ChoiceState, Formatter, error_body, prompt_tokens
from gateway.protocol import ChatCompletionRequest, CompletionRequest, sampling_params
from proto import worker_pb2 as wpb
from worker.types import ErrorCode

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger("tandem.gateway")
DEFAULT_COMPLETION_TOKENS = 16      # OpenAI's default for /v1/completions
Body = ChatCompletionRequest | CompletionRequest


@dataclass
class Job:
    """One choice to generate."""
    state: ChoiceState
    ids: list[int]
    params: SamplingParams


# What a choice's forwarding task reports to the response, in order: TokensEvent..., then
# DoneEvent or ErrorEvent.
@dataclass(frozen=True)
class TokensEvent:
    state: ChoiceState
    tokens: wpb.Tokens


@dataclass(frozen=True)
class DoneEvent:
    state: ChoiceState


@dataclass(frozen=True)
class ErrorEvent:
    error: ForwardError
    state: ChoiceState | None         # None: the choice failed before any token was streamed


Event = TokensEvent | DoneEvent | ErrorEvent


class CompletionHandler:
    def __init__(self, gw: Gateway):
        self.gw = gw                  # the Gateway: config, tokenizer, pool, queue, metrics

    # ---- request -> jobs ------------------------------------------------------------
    def prompts(self, body: Body) -> list[list[int]]:
        try:
            return self._prompts(body)
        except (TypeError, ValueError, UnicodeError) as e:
            raise Rejected(400, "invalid_request", f"the prompt cannot be tokenized: {e}") from None

    def _prompts(self, body: Body) -> list[list[int]]:
        tok = self.gw.tokenizer
        if isinstance(body, ChatCompletionRequest):
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            return [tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))]
        p = body.prompt
        if isinstance(p, str):
            return [tok.encode(p)]
        if p and all(isinstance(x, int) for x in p):
            return [[x for x in p if isinstance(x, int)]]
        return [tok.encode(x) if isinstance(x, str) else list(x) for x in p if not isinstance(x, int)]

    def jobs(self, body: Body) -> list[Job]:
        """Raises Rejected (400, 404) naming what is wrong; contacts no worker."""
        gw = self.gw
        if body.model != gw.config.served_model_name:
            raise Rejected(404, "model_not_found", f"the model {body.model!r} does not exist; this server "
                           f"serves {gw.config.served_model_name!r}")
        if (why := body.unsupported()) is not None:
            raise Rejected(400, "unsupported", why)
        prompts = self.prompts(body)
        if not prompts or len(prompts) * body.n > gw.config.max_n:
            raise Rejected(400, "too_many_choices", f"{len(prompts)} prompt(s) x n={body.n} choices exceeds "
                           f"the limit of {gw.config.max_n} per request")
        context, capacity = gw.context_len(), gw.pool.capacity_tokens()
        if capacity == 0:
            raise Rejected(503, "no_workers", "no decode worker is ready")
        jobs: list[Job] = []
        for group, ids in enumerate(prompts):
            self._check_ids(ids)
            max_tokens = self._max_tokens(body, len(ids), context, capacity)
            for j in range(body.n):
                seed = body.seed + j if body.seed is not None else None
                try:
                    params = sampling_params(body, max_tokens, seed)
                except ValueError as e:
                    raise Rejected(400, "invalid_request", str(e)) from None
                jobs.append(Job(ChoiceState(len(jobs), len(ids), prompt_group=group), ids, params))
        return jobs

    def _check_ids(self, ids: list[int]) -> None:
        vocab = self.gw.vocab_size
        if not ids:
            raise Rejected(400, "invalid_request", "the prompt is empty")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise Rejected(400, "invalid_request", f"prompt token {bad} is not in the vocabulary (0..{vocab - 1})")

    def _max_tokens(self, body: Body, prompt: int, context: int, capacity: int) -> int:
        limit = min(context, capacity)
        wanted = body.wanted_max_tokens
        if wanted is None:
            wanted = self.gw.config.default_max_tokens if isinstance(body, ChatCompletionRequest) \
                else DEFAULT_COMPLETION_TOKENS
            wanted = max(1, min(wanted, limit - prompt))
        total = prompt + wanted
        if total > context:
            raise Rejected(400, "context_length", f"prompt_tokens ({prompt}) + max_tokens ({wanted}) = {total} "
                           f"exceeds this model's context length of {context} tokens")
        if total > capacity:
            raise Rejected(400, "kv_capacity", f"prompt_tokens ({prompt}) + max_tokens ({wanted}) = {total} "
                           f"exceeds the KV capacity of every decode worker (largest: {capacity} tokens)")
        return wanted

    # ---- serving ------------------------------------------------------------------------
    async def serve(self, body: Body, request: Request, tenant: str) -> Response:
        """The response to one request (JSON or a stream of server-sent events); raises
        Rejected before anything is admitted."""
        gw = self.gw
        if gw.draining:
            raise Rejected(503, "draining", "the server is shutting down; retry on another replica")
        jobs = self.jobs(body)
        fmt = Formatter("chat" if isinstance(body, ChatCompletionRequest) else "text",
                        gw.config.served_model_name, gw.tokenizer, body.logprobs_n, body.return_token_ids)
        stack = AsyncExitStack()
        await stack.enter_async_context(gw.queue.admit(share_key(request, tenant, bool(gw.keys)),
                                                       reserved_tokens(jobs)))
        events: asyncio.Queue[Event] = asyncio.Queue()
        started = time.monotonic()
        tasks = [asyncio.create_task(self._run(fmt.id, tenant, job, events, started)) for job in jobs]
        stack.push_async_callback(_cancel, tasks)
        if body.stream:
            # until the first event nothing is written, so a client that left is noticed here
            watch = asyncio.create_task(_watch_disconnect(request, tasks, events))
            try:
                first = await events.get()
            except BaseException:
                await stack.aclose()
                raise
            finally:
                watch.cancel()
            if isinstance(first, ErrorEvent) and first.state is None:     # failed before any token
                await stack.aclose()
                return self._error(first.error)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = self._sse(fmt, jobs, events, first, include_usage, stack)
            return StreamingResponse(stream, media_type="text/event-stream",
                                     background=BackgroundTask(stack.aclose))
        watch = asyncio.create_task(_watch_disconnect(request, tasks, events))
        try:
            done = 0
            while done < len(jobs):
                event = await events.get()
                if isinstance(event, ErrorEvent):
                    return self._error(event.error)
                done += isinstance(event, DoneEvent)
        finally:
            watch.cancel()
            await stack.aclose()
        self._count(jobs, "ok")
        return JSONResponse(fmt.response([j.state for j in jobs]))

    async def _run(self, rid: str, tenant: str, job: Job, events: asyncio.Queue[Event], started: float) -> None:
        """Forward one choice, reporting each TokensEvent and then a DoneEvent or an ErrorEvent."""
        gw, state = self.gw, job.state
        last: float | None = None
        try:
            async for msg in forward(gw.pool, f"{rid}-{state.index}", tenant, job.ids, job.params,
                                     gw.config.request_timeout_s, gw.config.max_attempts,
                                     gw.config.queue_timeout_s):
                if msg.WhichOneof("kind") == "tokens":
                    now = time.monotonic()
                    (gw.metrics.itl.observe(now - last) if last is not None
                     else gw.metrics.ttft.observe(now - started))
                    last = now
                    state.add(msg.tokens)
                    await events.put(TokensEvent(state, msg.tokens))
                else:
                    state.finish = msg.finish
            gw.metrics.e2e.observe(time.monotonic() - started)
            await events.put(DoneEvent(state))
        except ForwardError as e:
            await events.put(ErrorEvent(e, state if state.token_ids else None))
        except asyncio.CancelledError:
            if cancelling():
                raise                         # the response itself was cancelled
            await events.put(ErrorEvent(ForwardError(ErrorCode.DECODE_FAILED, "the call was cut"),
                                        state if state.token_ids else None))
        except Exception as e:  # never leave the response waiting: a bug becomes an explicit 500
            log.exception("forwarding failed")
            await events.put(ErrorEvent(ForwardError(ErrorCode.INTERNAL, f"gateway error: {e!r}", 500),
                                        state if state.token_ids else None))

    async def _sse(self, fmt: Formatter, jobs: list[Job], events: asyncio.Queue[Event], first: Event,
                   include_usage: bool, stack: AsyncExitStack) -> AsyncIterator[str]:
        gw = self.gw
        sent_role: set[int] = set()
        offsets = {j.state.index: 0 for j in jobs}
        item, done = first, 0
        try:
            while True:
                if isinstance(item, ErrorEvent):
                    gw.metrics.requests.labels("error").inc()
                    yield _event(error_body(item.error.message, "server_error", item.error.code.value))
                    return
                state = item.state
                if isinstance(item, TokensEvent) or state.index not in sent_role:
                    tokens = item.tokens if isinstance(item, TokensEvent) else wpb.Tokens()
                    yield _event(fmt.chunk(_pending(state), tokens.text, list(tokens.logprobs),
                                           first=state.index not in sent_role, offset=offsets[state.index],
                                           ids=list(tokens.token_ids)))
                    offsets[state.index] += len(tokens.text)
                    sent_role.add(state.index)
                if isinstance(item, DoneEvent):
                    done += 1
                    yield _event(fmt.chunk(state, "", []))
                    if done == len(jobs):
                        break
                item = await events.get()
            if include_usage:
                yield _event(fmt.usage_chunk([j.state for j in jobs]))
            yield "data: [DONE]\n\n"
            self._count(jobs, "ok")
        finally:
            await stack.aclose()

    def _count(self, jobs: list[Job], status: str) -> None:
        m = self.gw.metrics
        m.requests.labels(status).inc()
        m.prompt_tokens.inc(prompt_tokens([j.state for j in jobs]))
        m.generated.inc(sum(len(j.state.token_ids) for j in jobs))

    def _error(self, err: ForwardError) -> JSONResponse:
        self.gw.metrics.requests.labels("error").inc()
        return JSONResponse(error_body(err.message, "server_error" if err.status >= 500 else "invalid_request_error",
                                       err.code.value), status_code=err.status)


def _pending(state: ChoiceState) -> ChoiceState:
    """The state as a chunk before the end: no finish reason yet."""
    return ChoiceState(state.index, state.prompt_tokens, prompt_group=state.prompt_group)


def _event(body: dict[str, object]) -> str:
    return f"data: {json.dumps(body)}\n\n"


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
