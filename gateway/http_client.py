"""A small asyncio HTTP/1.1 client for the gateway's API (no third-party HTTP library, no
torch): POST a JSON body on an open connection and read the response body piece by piece, as
it arrives, so a caller can time each server-sent event (bench) or hang up at any byte
(chaos).  The gateway itself does not use it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any


async def post_json(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, path: str,
                    body: dict[str, Any], api_key: str | None) -> tuple[int, AsyncIterator[bytes]]:
    """POST `body` as JSON on an open connection (closed by the server after the response).
    Returns the status and an async iterator over the body's pieces as they arrive.  Raises
    OSError or asyncio.IncompleteReadError when the connection breaks, ValueError or IndexError
    on a malformed status line."""
    payload = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
            f"Content-Length: {len(payload)}", "Accept: text/event-stream", "Connection: close"]
    if api_key:
        head.append(f"Authorization: Bearer {api_key}")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    chunked = headers.get("transfer-encoding", "").lower() == "chunked"
    return status, (read_chunked(reader) if chunked else read_plain(reader))


async def read_chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The pieces of a chunked HTTP/1.1 body, as they arrive."""
    while True:
        size = int((await reader.readline()).strip().split(b";")[0], 16)
        if size == 0:
            return
        data = await reader.readexactly(size)
        await reader.readline()
        yield data


async def read_plain(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """A body without chunking, read to the end of the connection."""
    while data := await reader.read(65536):
        yield data
