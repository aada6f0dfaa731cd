"""The page frame: header fields, checksum, ownership tag and commit digest.

A frame carries one page of one request for a range of layers:

    payload = kv[layer_start:layer_end, :, page, :num_tokens]    # [Lr, C, n, H, D] (the pool's geometry)

    checksum = xxh3_64(header_bytes(header) + payload)            # every field but checksum
    tag      = HMAC-SHA256(secret, tenant | request_id | transfer_id | prompt_digest)[:16]
    digest   = xxh3_64(checksum_0 | checksum_1 | ... )            # in seq order, at commit
    prompt_digest = SHA-256(u64 count | u32 id_0 | u32 id_1 | ... [| u64 generated])  # see below

The prompt digest binds a transfer to the tokens of the prompt it carries (I9): the decode
side records the digest of the prompt it reserved for, the prefill side states the digest of
the ids it computed, in every frame header and in the commit, and the tag is keyed over it.

The canonical header encoding is fixed here (length-prefixed fields in a fixed order),
not left to a protobuf serializer, so both sides hash the same bytes on any version.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Sequence

import xxhash

from proto import kv_transfer_pb2 as pb

# 2: the tag and the commit bind the prompt's digest (issue 15).  A version-1 peer sends no
# digest, so every transfer of its would be refused: the handshake refuses it once instead.
# 3: delta-only transfer (issue 18): the commit's cached_tokens counts the receiver's cached
# prefix as covered, and frames start after it.  A version-2 receiver would read a delta commit
# as a gap and a version-2 sender would send pages a version-3 receiver refuses as cached, so
# mixed clusters fail closed at the handshake.
PROTOCOL_VERSION = 3
SUPPORTED_VERSIONS = (3,)
TRANSFER_ID_BYTES = 16
TAG_BYTES = 16
PROMPT_DIGEST_BYTES = 32
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


def prompt_digest(ids: Sequence[int], generated: int = 0) -> bytes:
    """SHA-256 over the prompt's token ids: the count as a little-endian uint64, then each id
    as a little-endian uint32 (32 bytes).  A migrated request's transfer carries its prompt and
    the `generated` tokens after it (the last `generated` of `ids`): their count follows as a
    little-endian uint64, so moving tokens between prompt and generated changes the digest (the
    encodings of the two forms never collide: the leading count fixes the length of the ids).
    Raises ValueError for an id outside [0, 2**32) or `generated` outside 0..len(ids)."""
    if not 0 <= generated <= len(ids):
        raise ValueError(f"generated={generated} must be in 0..{len(ids)} (the tokens given)")
    try:
        packed = struct.pack(f"<Q{len(ids)}I", len(ids), *ids)
    except struct.error as e:
        raise ValueError(f"prompt token ids must lie in [0, 2**32): {e}") from None
    if generated:
        packed += struct.pack("<Q", generated)
    return hashlib.sha256(packed).digest()


def ownership_tag(secret: bytes, tenant: str, request_id: str, transfer_id: bytes,
                  prompt_digest: bytes) -> bytes:
    """The keyed MAC that binds a frame to (tenant, request, transfer, prompt tokens)."""
    msg = (_field(tenant.encode()) + _field(request_id.encode()) + _field(transfer_id)
           + _field(prompt_digest))
    return hmac.new(secret, msg, hashlib.sha256).digest()[:TAG_BYTES]


def header_bytes(h: pb.FrameHeader) -> bytes:
    """Canonical encoding of every header field except the checksum."""
    return b"".join((
        struct.pack("<I", h.protocol_version), _field(h.transfer_id),
        _field(h.request_id.encode()), _field(h.tenant.encode()), _field(h.ownership_tag),
        struct.pack("<6I", h.seq, h.layer_start, h.layer_end, h.page_index, h.first_token,
                    h.num_tokens),
        _field(h.dtype.encode()), struct.pack(f"<I{len(h.shape)}I", len(h.shape), *h.shape),
        _field(h.prompt_digest),
    ))


def frame_checksum(h: pb.FrameHeader, payload_parts: list[Buffer]) -> int:
    """xxh3-64 over the header fields and the payload (given as its parts, in order)."""
    return checksum_of(header_bytes(h), payload_parts)


def checksum_of(head: bytes, payload_parts: list[Buffer]) -> int:
    """frame_checksum for a header whose canonical bytes (header_bytes) are already known."""
    x = xxhash.xxh3_64(head)
    for part in payload_parts:
        x.update(part)
    return x.intdigest()


def commit_digest(checksums: list[int]) -> int:
    """xxh3-64 over the frame checksums in seq order."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(checksums)}Q", *checksums))


def tags_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)
