"""The error codes a request can end with, and the engine's coded refusal: a leaf module (no
torch, no grpc) that the engine, the workers and the gateway all import.  What each code means
to a client — retry, wait, migrate, HTTP status, public message — is the gateway's one table
(gateway/errors.py)."""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Why a request was refused or ended (`Error.code` on the wire)."""
    INVALID_REQUEST = "INVALID_REQUEST"          # a parameter or prompt token is wrong
    PROMPT_TOO_LONG = "PROMPT_TOO_LONG"          # prompt + max_tokens over the context or KV capacity
    KV_FULL = "KV_FULL"                          # no room now (KV pages, or every grammar checker
                                                 # busy): the request itself is fine, retry elsewhere
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


class RequestError(ValueError):
    """A request the engine refused: what is wrong (`code`: INVALID_REQUEST, PROMPT_TOO_LONG, or
    KV_FULL for no room now) and a message with the numbers."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
