"""The page frame: header fields, checksum, ownership tag and commit digest.

A frame carries one page of one request for a range of layers:

    payload = kv[layer_start:layer_end, :, page, :num_tokens]    # [Lr, 2, n, Hkv, D]

    checksum = xxh3_64(header_bytes(header) + payload)            # every field but checksum
    tag      = HMAC-SHA256(secret, tenant | request_id | transfer_id)[:16]
    digest   = xxh3_64(checksum_0 | checksum_1 | ... )            # in seq order, at commit

The canonical header encoding is fixed here (length-prefixed fields in a fixed order),
not left to a protobuf serializer, so both sides hash the same bytes on any version.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

import xxhash

from proto import kv_transfer_pb2 as pb

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
TRANSFER_ID_BYTES = 16
TAG_BYTES = 16
SECRET_MIN_BYTES = 16

Buffer = bytes | bytearray | memoryview


def new_transfer_id() -> bytes:
    """128 random bits."""
    return secrets.token_bytes(TRANSFER_ID_BYTES)


def new_cluster_secret() -> bytes:
    return secrets.token_bytes(32)


def check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < SECRET_MIN_BYTES:
        n = len(secret) if isinstance(secret, (bytes, bytearray)) else type(secret).__name__
        raise ValueError(f"cluster secret must be at least {SECRET_MIN_BYTES} bytes, got {n}")
    return bytes(secret)


def _field(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def ownership_tag(secret: bytes, tenant: str, request_id: str, transfer_id: bytes) -> bytes:
    """The keyed MAC that binds a frame to (tenant, request, transfer)."""
    msg = _field(tenant.encode()) + _field(request_id.encode()) + _field(transfer_id)
    return hmac.new(secret, msg, hashlib.sha256).digest()[:TAG_BYTES]


def header_bytes(h: pb.FrameHeader) -> bytes:
    """Canonical encoding of every header field except the checksum."""
    return b"".join((
        struct.pack("<I", h.protocol_version), _field(h.transfer_id),
        _field(h.request_id.encode()), _field(h.tenant.encode()), _field(h.ownership_tag),
        struct.pack("<6I", h.seq, h.layer_start, h.layer_end, h.page_index, h.first_token,
                    h.num_tokens),
        _field(h.dtype.encode()), struct.pack(f"<I{len(h.shape)}I", len(h.shape), *h.shape),
    ))


def frame_checksum(h: pb.FrameHeader, payload_parts: list[Buffer]) -> int:
    """xxh3-64 over the header fields and the payload (given as its parts, in order)."""
    x = xxhash.xxh3_64(header_bytes(h))
    for part in payload_parts:
        x.update(part)
    return x.intdigest()


def commit_digest(checksums: list[int]) -> int:
    """xxh3-64 over the frame checksums in seq order."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(checksums)}Q", *checksums))


def tags_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)
