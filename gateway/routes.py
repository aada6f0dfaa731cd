"""The gateway's API endpoints, each a body model and the handler that serves it: chat and text
completions (gateway/completions.py), the Responses API (gateway/responses.py), Anthropic's
Messages API (gateway/messages.py), /tokenize and /detokenize (gateway/tokenize.py); and, per
path, the body model a schema refusal names fields from and the shape of its error bodies."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from gateway.admission import Rejected
from gateway.errors import error_body
from gateway.messages_format import error_body as messages_error_body
from gateway.messages_request import MessagesRequest
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.responses_request import NOT_STORED, ResponsesRequest
from gateway.tokenize import DetokenizeRequest, TokenizeRequest, add_routes

if TYPE_CHECKING:
    from gateway.app import Gateway

BODY_MODELS: dict[str, type[BaseModel]] = {"/v1/chat/completions": ChatCompletionRequest,
                                           "/v1/completions": CompletionRequest, "/v1/responses": ResponsesRequest,
                                           "/v1/messages": MessagesRequest, "/tokenize": TokenizeRequest,
                                           "/detokenize": DetokenizeRequest}
# the error body of each path whose API has its own shape (every other path answers OpenAI's);
# each reads its code, status and type from the same table (gateway/errors.py)
ERROR_SHAPES: dict[str, Callable[..., dict[str, Any]]] = {"/v1/messages": messages_error_body}


def error_shape(path: str) -> Callable[..., dict[str, Any]]:
    """`error_body(code, message, param=None, status=None)` for a request to `path`."""
    return ERROR_SHAPES.get(path, error_body)


def add_api_routes(app: FastAPI, gw: Gateway, tenant: Callable[[Request], str]) -> None:
    """Register every API endpoint on `app`, each behind `tenant` (the API key's)."""

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request, tenant: str = Depends(tenant)) -> Response:
        return await gw.completions.serve(body, request, tenant)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, tenant: str = Depends(tenant)) -> Response:
        return await gw.completions.serve(body, request, tenant)

    add_routes(app, gw, tenant)      # /tokenize and /detokenize (gateway/tokenize.py)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request, tenant: str = Depends(tenant)) -> Response:
        return await gw.responses.respond(body, request, tenant)

    @app.api_route("/v1/responses/{path:path}", methods=["GET", "POST", "DELETE"], response_model=None)
    async def stored_response(path: str, tenant: str = Depends(tenant)) -> Response:
        """Retrieving, deleting, cancelling a response or listing its input items: none is kept."""
        raise Rejected("not_found", f"{NOT_STORED} (every response says store: false), so there is none to "
                       "retrieve, delete, cancel or list; this server serves POST /v1/responses only")

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request, tenant: str = Depends(tenant)) -> Response:
        """Anthropic's Messages API (gateway/messages.py); the anthropic-version header changes nothing."""
        return await gw.messages.serve_messages(body, request, tenant)
