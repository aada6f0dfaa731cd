"""A decode request's record, the messages other threads post to the decode loop, and its
generator (decode_worker/engine.py)."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

import torch

from engine.errors import ErrorCode
from engine.params import SamplingParams
from engine.request import Request
from engine.sampling import request_generator
from kv_transfer.reservation import Reservation
from proto import worker_pb2 as wpb
from worker.handoff import GenerateOrder


@dataclass(frozen=True)
class Committed:
    """(receiver callback) the transfer of `request_id` committed: its KV is in place."""
    request_id: str
    transfer_id: bytes


@dataclass(frozen=True)
class TransferFailed:
    """(receiver callback) the transfer of `request_id` failed or expired."""
    request_id: str
    transfer_id: bytes


@dataclass(frozen=True)
class Abort:
    """(RPC thread) end `request_id` with an error: a cancelled stream or the Abort RPC."""
    request_id: str
    code: ErrorCode
    message: str


InboxItem = Committed | TransferFailed | Abort


@dataclass
class DecodeRequest:
    """A request reserved here: its order (with the seed: prefill samples with it), the core's
    request, its transfer's reservation, and the stream's events."""
    order: GenerateOrder
    req: Request
    reservation: Reservation
    events: queue.SimpleQueue[wpb.GenerateResponse] = field(default_factory=queue.SimpleQueue)
    done: bool = False
    reserved_pages: int = 0

    @property
    def cached_prompt_tokens(self) -> int:
        """Prompt tokens the prefix cache held (a migrated request's generated ones not counted)."""
        return min(self.reservation.cached_tokens, self.req.num_prompt_tokens)


def decode_generator(params: SamplingParams, generated: int = 0) -> torch.Generator:
    """The request's generator in the state it has after prefill drew the first token (after
    the `generated` tokens of a migrated request): the same seed, and one draw taken per token
    when the request samples (so seeded sampling continues the stream a single-process `LLM`
    would produce)."""
    assert params.seed is not None
    return request_generator(params.seed, 0 if params.greedy else generated + 1)
