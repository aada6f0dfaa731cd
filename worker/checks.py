"""A worker's own checks of a request (defence in depth behind the gateway), as coded errors."""

from __future__ import annotations

import torch

from engine.core import EngineCore
from engine.params import SamplingParams
from engine.request import Request
from engine.validate import RequestError
from worker.types import ErrorCode, WorkerError

MAX_REQUEST_ID = 256
RESERVED_ID_CHAR = "#"       # a colocated worker's prefill pages are owned by "<id>#prefill"


def check_request_id(request_id: str) -> None:
    """Raises WorkerError(INVALID_REQUEST) for an id that is empty, too long, or could name
    another request's pages."""
    if not request_id or len(request_id) > MAX_REQUEST_ID or RESERVED_ID_CHAR in request_id:
        raise WorkerError(ErrorCode.INVALID_REQUEST,
                          f"request id {request_id[:40]!r} must be 1..{MAX_REQUEST_ID} characters "
                          f"without {RESERVED_ID_CHAR!r}")


def new_request(core: EngineCore, owner: str, ids: list[int], params: SamplingParams, handoff: bool = False,
                generator: torch.Generator | None = None) -> Request:
    """The core's checked request (`core.make_request`): raises WorkerError with the engine's
    code (INVALID_REQUEST, PROMPT_TOO_LONG) and message, having created nothing."""
    try:
        return core.make_request(ids, params, request_id=owner, handoff=handoff, generator=generator)
    except RequestError as e:
        raise WorkerError(ErrorCode(e.code.value), str(e)) from None
