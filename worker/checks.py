"""A worker's own checks of a request (defence in depth behind the gateway), as coded errors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.core import EngineCore
from engine.errors import ErrorCode, RequestError
from engine.params import SamplingParams
from engine.prefix_cache import cache_salt
from engine.request import Request
from worker.types import WorkerError

MAX_REQUEST_ID = 256
MAX_CACHE_SALT = 256         # characters of a request's cache_salt (the gateway's limit too)
RESERVED_ID_CHAR = "#"       # a colocated worker's prefill pages are owned by "<id>#prefill"


def check_request_id(request_id: str) -> None:
    """Raises WorkerError(INVALID_REQUEST) for an id that is empty, too long, or could name
    another request's pages."""
    if not request_id or len(request_id) > MAX_REQUEST_ID or RESERVED_ID_CHAR in request_id:
        raise WorkerError(ErrorCode.INVALID_REQUEST,
                          f"request id {request_id[:40]!r} must be 1..{MAX_REQUEST_ID} characters "
                          f"without {RESERVED_ID_CHAR!r}")


def new_request(core: EngineCore, owner: str, ids: list[int], params: SamplingParams, handoff: bool = False,
                generator: torch.Generator | None = None, salt: bytes = b"",
                generated: Sequence[int] = ()) -> Request:
    """The core's checked request (`core.make_request`) with prefix-cache salt `salt`
    (`request_salt`) and, for a migrated request, the tokens it `generated` before: raises
    WorkerError with the engine's code (INVALID_REQUEST, PROMPT_TOO_LONG) and message, having
    created nothing."""
    try:
        return core.make_request(ids, params, request_id=owner, handoff=handoff, generator=generator, salt=salt,
                                 generated=generated)
    except RequestError as e:
        raise WorkerError(e.code, str(e)) from None


def request_salt(secret: bytes, tenant: str, salt: str) -> bytes:
    """The prefix-cache salt of a request of `tenant` with the caller's optional `salt` (vLLM's
    cache_salt): keyed with the cluster secret, so no two tenants share a cached page (I10).
    Raises WorkerError(INVALID_REQUEST) for a salt over MAX_CACHE_SALT characters."""
    if len(salt) > MAX_CACHE_SALT:
        raise WorkerError(ErrorCode.INVALID_REQUEST,
                          f"cache_salt of {len(salt)} characters; at most {MAX_CACHE_SALT}")
    return cache_salt(secret, tenant, salt)


def check_cached_tokens(cached_tokens: int, prompt_len: int, page_size: int) -> None:
    """Raises WorkerError(INVALID_REQUEST) unless `cached_tokens` (the decode worker's cache
    boundary) is a multiple of the page size below the prompt's length (a cached prefix is
    whole pages and never holds the prompt's last token)."""
    if cached_tokens % page_size or cached_tokens >= prompt_len:
        raise WorkerError(ErrorCode.INVALID_REQUEST,
                          f"cached_tokens={cached_tokens} must be a multiple of the page size "
                          f"({page_size}) below the prompt's {prompt_len} tokens")
