"""The gateway: FastAPI on uvicorn, speaking the OpenAI API in front of the workers.

    app = create_app(GatewayConfig(decode_workers=("127.0.0.1:50052",), prefill_workers=(...)))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from engine.config import SHIPPED_MODEL, ModelConfig
from engine.errors import ErrorCode
from engine.tokenizer import Tokenizer
from gateway.admission import AdmissionQueue, Rejected
from gateway.body_errors import refusal, union_fields
from gateway.chat import output_settings
from gateway.completions import CompletionHandler
from gateway.config import GatewayConfig, KeyTable
from gateway.errors import HTTP_CODES, public, shown
from gateway.fairness import ClusterKv
from gateway.fields import IGNORED_HEADER
from gateway.limits import ABORT, BodyLimit, SendDeadline, connection_abort, quiet_idle_closes
from gateway.messages import MessagesHandler
from gateway.metrics import Metrics
from gateway.prompts import PromptEncoder
from gateway.responses import ResponsesHandler
from gateway.routes import BODY_MODELS, add_api_routes, error_shape
from gateway.routing import Worker, WorkerPool
from gateway.structured import StructuredOutputs
from worker.types import Role

log = logging.getLogger("tandem.gateway")
Discover = Callable[[], dict[str, list[str]]]     # () -> {role: [address]}: a worker registry
T = TypeVar("T")


class Gateway:
    """Everything one gateway process holds: settings, tokenizer, workers, queue, metrics."""

    def __init__(self, config: GatewayConfig, discover: Discover | None = None):
        self.config = config
        self.discover = discover              # a registry to follow
        self.draining = False
        path = config.model or SHIPPED_MODEL
        self.tokenizer = Tokenizer(path)
        self.encoder = PromptEncoder(self.tokenizer)
        # tokenising, chat templates and stop-pattern checks run here, never on the event loop
        self.executor = ThreadPoolExecutor(config.prepare_threads, thread_name_prefix="gateway-prepare")
        self.model_config = ModelConfig.from_path(path)
        self.vocab_size = self.model_config.vocab_size
        self.pool = WorkerPool(config.decode_workers, config.prefill_workers, config.colocated_workers,
                               config.cluster_secret, config.tls, config.routing)
        self.metrics = Metrics()
        self.queue = AdmissionQueue(config.max_queue, config.max_running, config.tenant_max_concurrency,
                                    config.queue_timeout_s, ClusterKv(self.pool, config, self.context_len),
                                    self.metrics.tenant_rejected)
        self.metrics.watch(self.queue)
        # how the model's output is read (reasoning, tool calls), and structured outputs' compiler
        self.output_settings = output_settings(config, self.tokenizer)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config, config.grammar_compile_timeout_s,
                                            self.metrics.grammar_compile.observe,
                                            max_pending=config.grammar_max_pending,
                                            tenant_max_pending=config.grammar_tenant_max_pending)
        self.completions = CompletionHandler(self)
        self.responses = ResponsesHandler(self)
        self.messages = MessagesHandler(self)
        self.keys = KeyTable(config.api_keys)
        self.admin_keys = KeyTable({k: "admin" for k in config.admin_keys})

    async def prepare(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a preparation thread (at most `prepare_threads` at once)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def admin(self, request: Request) -> None:
        """Raises Rejected 401 unless admin keys are configured and the request bears one."""
        if self.admin_keys.tenant(_api_key(request)) is None:
            raise Rejected("invalid_admin_key", "this endpoint needs an admin key "
                           "(send Authorization: Bearer ADMIN_KEY or x-api-key: ADMIN_KEY)")

    def context_len(self) -> int:
        """The context of the workers (their --max-model-len), else the model's."""
        lens = [w.health.max_model_len for w in self.pool.of(Role.DECODE, Role.COLOCATED)
                if w.healthy and w.health is not None]
        return min(lens) if lens else self.model_config.max_position_embeddings

    def tenant(self, request: Request) -> str:
        if not self.keys:
            return "default"
        tenant = self.keys.tenant(_api_key(request))
        if tenant is None:
            raise Rejected("invalid_api_key", "missing or unknown API key (send Authorization: Bearer KEY "
                           "or x-api-key: KEY)")
        return tenant

    async def refresh_forever(self) -> None:
        while True:
            if self.discover is not None:
                try:
                    found = await asyncio.get_running_loop().run_in_executor(None, self.discover)
                    self.pool.update(found)
                except Exception:
                    log.exception("could not read the worker registry; keeping the workers known")
            await self.pool.refresh()
            self.metrics.observe_workers(self.pool)
            await asyncio.sleep(self.config.refresh_s)


def create_app(config: GatewayConfig, discover: Discover | None = None) -> FastAPI:
    gw = Gateway(config, discover)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gw.pool.connect()
        await gw.pool.refresh()
        task = asyncio.create_task(gw.refresh_forever())
        try:
            yield
        finally:
            task.cancel()
            gw.executor.shutdown(wait=False, cancel_futures=True)
            gw.structured.close()
            await gw.pool.close()

    app = TandemApp(title="Tandem", lifespan=lifespan)
    app.state.gateway = gw

    def refused_body() -> None:
        gw.metrics.rejected.labels("body_too_large").inc()
        gw.metrics.requests.labels("rejected").inc()

    # outermost last: the deadline covers every send, the body limit comes before everything else
    app.add_middleware(BodyLimit, limit=config.max_body_bytes, on_refusal=refused_body,
                       body_for=lambda path, message: error_shape(path)("body_too_large", message))
    app.add_middleware(SendDeadline, timeout_s=config.stream_idle_timeout_s, registry=gw.metrics.registry)
    quiet_idle_closes()

    @app.exception_handler(Rejected)
    async def rejected(request: Request, e: Rejected) -> Response:
        response = _rejected(gw, e, request.url.path)
        if ignored := getattr(request.state, "ignored_fields", ""):
            response.headers[IGNORED_HEADER] = ignored
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> Response:
        # a body FastAPI could not read as the endpoint's model: 400, saying what was wrong
        model = BODY_MODELS.get(request.url.path)
        code, message, param = refusal(e.errors(), e.body, request.headers.get("content-type"),
                                       union_fields(model) if model is not None else frozenset())
        refused = Rejected(code, message)
        refused.param = param
        return _rejected(gw, refused, request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        # the framework's own refusals (no such route, a body it could not read) in the path's error shape
        code = HTTP_CODES.get(e.status_code, "invalid_request" if e.status_code < 500 else "internal")
        body = error_shape(request.url.path)(code, str(e.detail), status=e.status_code)
        return JSONResponse(body, status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception) -> Response:
        error_id = uuid.uuid4().hex
        log.exception("unhandled error %s in %s %s", error_id, request.method, request.url.path)
        shape = error_shape(request.url.path)
        body = shape(ErrorCode.INTERNAL, f"internal error in the gateway (error id {error_id})")
        return JSONResponse(body, status_code=500)

    def tenant(request: Request) -> str:
        return gw.tenant(request)

    add_api_routes(app, gw, tenant)  # chat, completions, responses, messages, tokenize (gateway/routes.py)

    def model_card() -> dict[str, Any]:
        return {"id": config.served_model_name, "object": "model", "created": 0, "owned_by": "tandem",
                "max_model_len": gw.context_len()}

    @app.get("/v1/models", response_model=None)
    async def models(tenant: str = Depends(tenant)) -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", response_model=None)
    async def model(model_id: str, tenant: str = Depends(tenant)) -> dict[str, Any]:
        """OpenAI's retrieve model (the openai client's `models.retrieve`)."""
        if model_id != config.served_model_name:
            raise Rejected("model_not_found", f"the model {shown(model_id)} does not exist; this server "
                           f"serves {config.served_model_name!r}")
        return model_card()

    @app.get("/health", response_model=None)
    async def health() -> dict[str, str] | Response:
        if gw.pool.ready:
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable", "detail": "needs one prefill and one decode worker "
                             "(or one colocated worker) answering"}, status_code=503)

    def admin(request: Request) -> None:
        if config.admin_keys:
            gw.admin(request)
        elif request.url.path != "/metrics":        # no admin keys: server_info as any API call
            gw.tenant(request)

    @app.get("/metrics", dependencies=[Depends(admin)])
    async def metrics() -> Response:
        gw.metrics.queue.set(gw.queue.waiting)
        gw.metrics.running.set(gw.queue.running)
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/server_info", response_model=None, dependencies=[Depends(admin)])
    async def server_info() -> dict[str, Any]:
        return {"model": config.served_model_name, "context_length": gw.context_len(), "routing": config.routing,
                "max_migrations": config.max_migrations,
                "workers": [{"address": w.address, "role": w.role, "healthy": w.healthy,
                             "draining": w.draining,
                             "kv_capacity_tokens": w.health.kv_capacity_tokens if w.health else None,
                             "paged_experts_num_resident": w.health.paged_experts_num_resident if w.health else None,
                             "prefix_cache": cache_info(w)}
                            for w in gw.pool.workers]}

    return app


class TandemApp(FastAPI):
    """FastAPI that puts in each request's scope what resets its connection (limits.ABORT), read
    from the server's own `send` before any middleware wraps it (SendDeadline uses it)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[ABORT] = connection_abort(send)
        await super().__call__(scope, receive, send)


def cache_info(w: Worker) -> dict[str, Any] | None:
    """A worker's prefix cache for /v1/server_info: on or off, its pages and counters (its last
    Stats) and the pages this gateway's router believes it holds; None: not known yet."""
    if w.health is None:
        return None
    info: dict[str, Any] = {"enabled": w.health.prefix_cache, "page_size": w.health.kv_page_size,
                            "routing_view_pages": len(w.cache) if w.cache is not None else None}
    if w.stats is not None:
        s = w.stats
        info.update(cached_pages=s.kv_pages_cached, evictable_pages=s.kv_pages_evictable,
                    query_tokens=s.cache_query_tokens, hit_tokens=s.cache_hit_tokens,
                    hit_rate=s.cache_hit_tokens / s.cache_query_tokens if s.cache_query_tokens else None,
                    evictions=s.cache_evictions, transfer_bytes_accepted=s.transfer_bytes_accepted)
    return info


def _rejected(gw: Gateway, e: Rejected, path: str) -> JSONResponse:
    """The answer to a refusal of a request to `path`: its code's spelling and type from the error
    table (gateway/errors.py), a retryable one with Retry-After (unless the refusal sets its own)."""
    gw.metrics.rejected.labels(e.reason).inc()
    gw.metrics.requests.labels("rejected").inc()
    entry = public(e.reason, e.status)
    return JSONResponse(error_shape(path)(e.reason, e.message, e.param, e.status), status_code=e.status,
                        headers=e.headers or entry.headers())


def _api_key(request: Request) -> str:
    """The API key a request presents, as `Authorization: Bearer KEY` or as `x-api-key: KEY`
    (Anthropic's header), on every API endpoint ("" for none).  Raises Rejected 401 when it
    presents two different keys (both headers, or one twice): the gateway never picks one."""
    keys = {a[7:].strip() for a in request.headers.getlist("authorization") if a.lower().startswith("bearer ")}
    keys |= {k.strip() for k in request.headers.getlist("x-api-key")}
    keys.discard("")
    if len(keys) > 1:
        raise Rejected("invalid_api_key", "the request presents more than one API key (Authorization: Bearer and "
                       "x-api-key differ); send one")
    return next(iter(keys), "")
