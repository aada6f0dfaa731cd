"""The worker core's plain types, shared with the gateway (no torch, no grpc): the roles a
worker runs as and the coded error a worker raises (its codes: engine/errors.py)."""

from __future__ import annotations

import enum

from engine.errors import ErrorCode
from proto import worker_pb2 as wpb


class Role(enum.StrEnum):
    """What a worker process serves (its registry entry and `Health.role` say it as text)."""
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"      # prefill and decode in one process, over one KV pool


class WorkerError(Exception):
    """A request refused or ended by a worker, with a code the caller can act on."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{code.value}: {message}")
        self.code, self.message = code, message

    def to_proto(self) -> wpb.Error:
        return wpb.Error(code=self.code.value, message=self.message)
