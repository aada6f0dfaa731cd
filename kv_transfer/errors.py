"""Why a frame or a transfer was refused.  Every refusal names one of these codes; the
codes are what metrics, logs and the chaos report count."""

from __future__ import annotations

from enum import Enum


class Refusal(str, Enum):
    BAD_VERSION = "BAD_VERSION"              # a protocol version the receiver does not speak
    UNKNOWN_TRANSFER = "UNKNOWN_TRANSFER"    # no reservation with this transfer id
    EXPIRED = "EXPIRED"                      # the reservation timed out or was released
    BAD_TAG = "BAD_TAG"                      # ownership tag / tenant / request do not match
    PROMPT_MISMATCH = "PROMPT_MISMATCH"      # a valid tag over another prompt's token ids
    OUT_OF_RANGE = "OUT_OF_RANGE"            # page index or layer range outside the reservation
    CACHED_PAGE = "CACHED_PAGE"              # a frame aimed at a page of the receiver's cached prefix
    BAD_GEOMETRY = "BAD_GEOMETRY"            # token positions, dtype, shape or payload size wrong
    DUPLICATE = "DUPLICATE"                  # this (page, layers) or seq was already received
    BAD_CHECKSUM = "BAD_CHECKSUM"            # header + payload do not hash to the checksum
    AFTER_COMMIT = "AFTER_COMMIT"            # the transfer is already committed
    AFTER_FAILURE = "AFTER_FAILURE"          # the transfer already failed
    STALE_PAGE = "STALE_PAGE"                # the reserved page changed owner or generation
    INCOMPLETE = "INCOMPLETE"                # commit before every prompt page was written
    BAD_COVERAGE = "BAD_COVERAGE"            # tokens covered or frame count differ
    BAD_DIGEST = "BAD_DIGEST"                # the digest over frame checksums differs
    RECHECK_FAILED = "RECHECK_FAILED"        # destination pages do not hash as sent
    CANCELLED = "CANCELLED"                  # the decode side ended the request
    STREAM_CLOSED = "STREAM_CLOSED"          # the stream ended without a commit
    TRANSPORT = "TRANSPORT"                  # the transport failed (peer gone, deadline, ...)


class TransferRefused(Exception):
    """Raised to the sender (or returned by the receiver) with the code and the detail."""

    def __init__(self, reason: Refusal | str, detail: str = "") -> None:
        self.reason = Refusal(reason) if reason in Refusal._value2member_map_ else reason
        self.detail = detail
        super().__init__(f"{self.code}: {detail}")

    @property
    def code(self) -> str:
        """The reason as its code string (a Refusal's value, or an unknown code as given)."""
        return getattr(self.reason, "value", str(self.reason))
