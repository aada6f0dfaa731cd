"""The worker core's plain types, shared with the gateway (no torch, no grpc): the roles a
worker runs as, the error codes a request can end with, and the coded error itself."""

from __future__ import annotations

import enum

from proto import worker_pb2 as wpb


class Role(enum.StrEnum):
    """What a worker process serves (its registry entry and `Health.role` say it as text)."""
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"      # prefill and decode in one process, over one KV pool


class ErrorCode(enum.StrEnum):
    """Why a request was refused or ended (`Error.code` on the wire)."""
    INVALID_REQUEST = "INVALID_REQUEST"          # a parameter or prompt token is wrong
    PROMPT_TOO_LONG = "PROMPT_TOO_LONG"          # prompt + max_tokens over the context or KV capacity
    KV_FULL = "KV_FULL"                          # no room for the reservation now: retry elsewhere
    UNAVAILABLE = "UNAVAILABLE"                  # the worker is shutting down
    DRAINING = "DRAINING"                        # the worker is draining: continue on another
                                                 # (before a token: retried; after: migrated)
    ABORTED = "ABORTED"                          # the caller's Abort
    CANCELLED = "CANCELLED"                      # the caller's stream or call went away
    INTERNAL = "INTERNAL"                        # a step failed
    TRANSFER_FAILED = "TRANSFER_FAILED"          # the KV transfer was refused or broke
    UNKNOWN_PEER = "UNKNOWN_PEER"                # the decode endpoint is not one of the deployment's
    PREFILL_UNAVAILABLE = "PREFILL_UNAVAILABLE"  # (client side) the prefill worker cannot be reached
    DECODE_UNAVAILABLE = "DECODE_UNAVAILABLE"    # (client side) the decode worker cannot be reached
    DECODE_FAILED = "DECODE_FAILED"              # (gateway) the decode stream broke after a token
    NO_WORKER = "NO_WORKER"                      # (gateway) no worker can take the request
    TIMEOUT = "TIMEOUT"                          # (gateway) the request ran past its deadline
    MIGRATION_FAILED = "MIGRATION_FAILED"        # (gateway) a broken stream could not be continued:
                                                 # the migration bound, or no worker fits it


class WorkerError(Exception):
    """A request refused or ended by a worker, with a code the caller can act on."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{code.value}: {message}")
        self.code, self.message = code, message

    def to_proto(self) -> wpb.Error:
        return wpb.Error(code=self.code.value, message=self.message)
