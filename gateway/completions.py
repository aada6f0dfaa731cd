"""Serving one chat or text completion request: check its fields (400 naming the field),
tokenize once off the event loop, check it against the context and the decode workers' KV
capacity (400 before any worker is contacted), admit it through the queue, forward every
choice, and answer as JSON or as server-sent events.  A failure past the gateway reaches the
client as a code, a short message and the request id; its details go to the log."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.constraint import Constraint
from engine.params import SamplingParams
from gateway.admission import InvalidField, Rejected
from gateway.cache_view import PrefixKeys
from gateway.chat import render_chat
from gateway.choice import ForwardError, Prompt
from gateway.fairness import reserved_tokens, share_key
from gateway.fields import IGNORED_HEADER, IgnoredFields
from gateway.forward import cancelling
from gateway.migration import forward
from gateway.openai_format import ChoiceState, Formatter, error_body, prompt_tokens, public_message
from gateway.prompts import PromptTooLong
from gateway.protocol import REASONING_EFFORTS, ChatCompletionRequest, CompletionRequest, sampling_params
from gateway.reader import choice_reader
from gateway.streaming import DoneEvent, ErrorEvent, Event, EventStream, Generation, TokensEvent, sse
from gateway.structured import ignored_fields as structured_ignored
from gateway.tool_choice import check_tools
from worker.types import ErrorCode

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger("tandem.gateway")
DEFAULT_COMPLETION_TOKENS = 16      # OpenAI's default for /v1/completions
MAX_TEMPLATE_MESSAGE = 400          # of a chat template's refusal, as the client sees it
Body = ChatCompletionRequest | CompletionRequest


@dataclass
class Job:
    """One choice to generate."""
    state: ChoiceState
    ids: list[int]
    params: SamplingParams
    prompt: Prompt = Prompt()         # its cache salt and page keys (the n choices of a prompt share them)


class CompletionHandler:
    def __init__(self, gw: Gateway):
        self.gw = gw                  # the Gateway: config, tokenizer, pool, queue, metrics
        self.ignored_log = IgnoredFields()

    # ---- request -> jobs ------------------------------------------------------------
    def check(self, body: Body) -> None:
        """The cheap checks, on the event loop: model, options, integer ranges.  Raises
        Rejected (404, 400 naming the field)."""
        gw = self.gw
        if body.model != gw.config.served_model_name:
            raise Rejected(404, "model_not_found", f"the model {body.model!r} does not exist; this server "
                           f"serves {gw.config.served_model_name!r}")
        if (bad := body.out_of_range(gw.vocab_size)) is not None:
            raise InvalidField(bad[0], bad[1])
        self._check_counts(body)
        if (why := body.unsupported()) is not None:
            raise Rejected(400, "unsupported", why)
        if isinstance(body, ChatCompletionRequest):
            check_tools(body, gw.output_settings)

    def ignored(self, body: Body) -> str:
        """The request's ignored fields (gateway/fields.py), logged and counted, as the header's
        value ("" : none)."""
        names = list(dict.fromkeys(body.ignored_fields() + structured_ignored(body) + self._unread(body)))
        if names:
            self.gw.metrics.ignored_fields.inc()
        return self.ignored_log.report(names)

    def _unread(self, body: Body) -> list[str]:
        """Fields that only the chat template acts on, sent to a model whose template does not
        read them (gpt-oss's reads reasoning_effort; the shipped model's does not)."""
        if isinstance(body, ChatCompletionRequest) and body.reasoning_effort in REASONING_EFFORTS \
                and "reasoning_effort" not in (self.gw.tokenizer.chat_template or ""):
            return ["reasoning_effort"]
        return []

    def _check_counts(self, body: Body) -> None:
        """How many messages or prompts the request carries, before any is templated or
        tokenized (a 4 MiB body holds some 100,000 short ones)."""
        cfg = self.gw.config
        if isinstance(body, ChatCompletionRequest):
            if len(body.messages) > cfg.max_messages:
                raise InvalidField("messages", f"the request has {len(body.messages)} messages; at most "
                                   f"{cfg.max_messages} are allowed")
            return
        p = body.prompt
        count = 1 if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)) else len(p)
        if count * body.n > cfg.max_n:
            raise Rejected(400, "too_many_choices", f"{count} prompt(s) x n={body.n} choices exceeds "
                           f"the limit of {cfg.max_n} per request")

    def prompts(self, body: Body, context: int) -> list[list[int]]:
        """Token ids of each prompt; raises Rejected 400 for a prompt that cannot be tokenized,
        a conversation the chat template refuses (its message), or a prompt that is, from its
        length in bytes or tokens, longer than `context`."""
        try:
            return self._prompts(body, context)
        except PromptTooLong as e:
            raise Rejected(400, "context_length", str(e)) from None
        except (TypeError, ValueError, UnicodeError) as e:
            raise Rejected(400, "invalid_request", f"the prompt cannot be tokenized: {e}") from None
        except jinja2.TemplateSyntaxError:
            raise                   # the template itself is broken: the server's fault (500, logged)
        except jinja2.TemplateError as e:   # its raise_exception (roles must alternate, ...) or a missing key
            raise Rejected(400, "invalid_request", f"the chat template refused the conversation: "
                           f"{str(e)[:MAX_TEMPLATE_MESSAGE]}") from None

    def _prompts(self, body: Body, context: int) -> list[list[int]]:
        tok, enc = self.gw.tokenizer, self.gw.encoder
        if isinstance(body, ChatCompletionRequest):
            text = render_chat(tok, body)
            enc.check(text, context, "conversation")
            return [enc.encode(text)]
        p = body.prompt
        items: list[str | list[int]]
        if isinstance(p, str):
            items = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [[x for x in p if isinstance(x, int)]]
        else:
            items = [x for x in p if not isinstance(x, int)]
        out = []
        for x in items:
            if isinstance(x, str):
                enc.check(x, context)
                out.append(enc.encode(x))
            else:
                out.append(list(x))         # its length is checked with max_tokens (_max_tokens)
        return out

    def jobs(self, body: Body, context: int, capacity: int, tenant: str = "default",
             page_sizes: frozenset[int] = frozenset(), constraint: Constraint | None = None) -> list[Job]:
        """Tokenizes the prompts, builds each choice's sampling parameters (compiling its stop
        patterns; `constraint`: the request's structured output, already compiled) and, for
        prefix routing, each prompt's page keys for `page_sizes`: the expensive part, run on a
        preparation thread.  Raises Rejected (400) naming what is wrong; contacts no worker."""
        gw = self.gw
        prompts = self.prompts(body, context)
        if not prompts or len(prompts) * body.n > gw.config.max_n:
            raise Rejected(400, "too_many_choices", f"{len(prompts)} prompt(s) x n={body.n} choices exceeds "
                           f"the limit of {gw.config.max_n} per request")
        jobs: list[Job] = []
        for group, ids in enumerate(prompts):
            self._check_ids(ids)
            max_tokens = self._max_tokens(body, len(ids), context, capacity)
            prompt = self._prompt(body, tenant, ids, page_sizes)
            for j in range(body.n):
                seed = body.seed + j if body.seed is not None else None
                try:
                    params = sampling_params(body, max_tokens, seed, constraint)
                except ValueError as e:
                    raise Rejected(400, "invalid_request", str(e)) from None
                # one fresh reader per choice: its reasoning, content and tool calls (gateway/reader.py)
                reader = choice_reader(gw.output_settings, body) if isinstance(body, ChatCompletionRequest) \
                    else None
                jobs.append(Job(ChoiceState(len(jobs), len(ids), prompt_group=group, reader=reader), ids, params,
                                prompt))
        return jobs

    def _prompt(self, body: Body, tenant: str, ids: list[int], page_sizes: frozenset[int]) -> Prompt:
        """The prompt's cache salt, and its page keys when routing follows the workers' caches."""
        cfg = self.gw.config
        salt = body.cache_salt or ""
        if cfg.routing != "prefix":
            return Prompt(salt)
        keys = PrefixKeys(cfg.cluster_secret, tenant, salt, ids)
        for size in page_sizes:
            keys.get(size)            # computed here, off the event loop
        return Prompt(salt, keys)

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
        """The response to one request (JSON or a stream of server-sent events), naming the
        fields it ignored in the IGNORED_HEADER (a refusal names them too: `request.state`);
        raises Rejected before anything is admitted."""
        ignored = request.state.ignored_fields = self.ignored(body)
        response = await self._serve(body, request, tenant)
        if ignored:
            response.headers[IGNORED_HEADER] = ignored
        return response

    async def _serve(self, body: Body, request: Request, tenant: str) -> Response:
        gw = self.gw
        if gw.draining:
            raise Rejected(503, "draining", "the server is shutting down; retry on another replica")
        self.check(body)
        context, capacity = gw.context_len(), gw.pool.capacity_tokens()
        if capacity == 0:
            raise Rejected(503, "no_workers", "no decode worker is ready")
        share = share_key(request, tenant, bool(gw.keys))     # whom it counts against in the limits
        constraint = await gw.structured.constraint(body, gw.output_settings, share)
        jobs = await gw.prepare(self.jobs, body, context, capacity, tenant, frozenset(gw.pool.page_sizes()),
                                constraint)
        so = body.stream_options
        fmt = Formatter("chat" if isinstance(body, ChatCompletionRequest) else "text",
                        gw.config.served_model_name, gw.tokenizer, body.logprobs_n, body.return_token_ids,
                        continuous_usage=bool(body.stream and so and so.include_usage and so.continuous_usage_stats))
        slot = AsyncExitStack()
        await slot.enter_async_context(gw.queue.admit(share, reserved_tokens(jobs)))
        events: asyncio.Queue[Event] = asyncio.Queue()
        started = time.monotonic()
        tasks = [asyncio.create_task(self._run(fmt.id, tenant, job, events, started)) for job in jobs]
        generation = Generation(slot, tasks)      # the slot goes back when the tasks end
        watch = asyncio.create_task(_watch_disconnect(request, tasks, events))
        if body.stream:
            # until the first event nothing is written, so a client that left is noticed here
            try:
                first = await events.get()
            except BaseException:
                await generation.close()
                raise
            finally:
                watch.cancel()
            if isinstance(first, ErrorEvent) and first.state is None:     # failed before any token
                await generation.close()
                return self._error(first.error, fmt.id)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            states = [j.state for j in jobs]
            stream = sse(fmt, states, events, first, include_usage, lambda e: self._error_body(e, fmt.id),
                         lambda: self._count(jobs, "ok"))
            return EventStream(stream, on_close=generation.close)
        try:
            done = 0
            while done < len(jobs):
                event = await events.get()
                if isinstance(event, ErrorEvent):
                    return self._error(event.error, fmt.id)
                done += isinstance(event, DoneEvent)
        finally:
            watch.cancel()
            await generation.close()
        self._count(jobs, "ok")
        return JSONResponse(fmt.response([j.state for j in jobs]))

    async def _run(self, rid: str, tenant: str, job: Job, events: asyncio.Queue[Event], started: float) -> None:
        """Forward one choice, reporting each TokensEvent and then a DoneEvent or an ErrorEvent."""
        gw, state = self.gw, job.state
        last: float | None = None
        try:
            async for msg in forward(gw.pool, f"{rid}-{state.index}", tenant, job.ids, job.params,
                                     gw.config.request_timeout_s, gw.config.max_attempts,
                                     gw.config.queue_timeout_s, job.prompt, gw.config.max_migrations,
                                     gw.metrics.migration):
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
        except Exception:  # never leave the response waiting: a bug becomes an explicit 500
            log.exception("request %s: forwarding failed", rid)
            await events.put(ErrorEvent(ForwardError(ErrorCode.INTERNAL, "gateway error (logged)", 500),
                                        state if state.token_ids else None))

    def _count(self, jobs: list[Job], status: str) -> None:
        m = self.gw.metrics
        m.requests.labels(status).inc()
        m.prompt_tokens.inc(prompt_tokens([j.state for j in jobs]))
        m.generated.inc(sum(len(j.state.token_ids) for j in jobs))

    def _error_body(self, err: ForwardError, rid: str) -> dict[str, Any]:
        """The client's view of a failed request (gateway/openai_format.py PUBLIC_MESSAGES);
        the details go to the log under the request id."""
        self.gw.metrics.requests.labels("error").inc()
        log.warning("request %s failed: %s: %s", rid, err.code.value, err.message)
        return error_body(public_message(err.code, err.message, rid),
                          "server_error" if err.status >= 500 else "invalid_request_error", err.code.value)

    def _error(self, err: ForwardError, rid: str) -> JSONResponse:
        return JSONResponse(self._error_body(err, rid), status_code=err.status)


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
