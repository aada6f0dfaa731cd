"""Stalled Push streams: what a worker that holds the cluster secret, gone bad, can do to a
decode worker's gRPC transfer receiver.  Runs inside a chaos worker process (the secret never
leaves it); the run drives it through `ChaosControl`'s `stall_*` operations.

Each stream is authenticated (so the receiver's auth interceptor lets it through and the
call takes one of the receiver's threads), says Hello for a transfer id nobody reserved,
then sends nothing until `close()` (or at most `HOLD_MAX_S`, so a run that dies never leaves
them behind).  The receiver admits `max_push_streams` of them and refuses the rest with
RESOURCE_EXHAUSTED before reading a byte; its spare threads still answer Handshakes.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc

from kv_transfer.auth import channel
from kv_transfer.frame import PROTOCOL_VERSION, new_transfer_id
from kv_transfer.transport import framing, grpc_stream
from proto import kv_transfer_pb2 as pb
from proto import kv_transfer_pb2_grpc as pb_grpc

HOLD_MAX_S = 50.0           # a stalled stream ends by itself after this (below the 60 s idle cut)
STREAMS_PER_CHANNEL = 64    # spread over connections: no HTTP/2 stream limit is what refuses them


class StalledStreams:
    """Push streams held open with nothing after their Hello.  Thread-safe."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._lock = threading.Lock()
        self._gate = threading.Event()
        self._channels: list[grpc.Channel] = []
        self._futures: list[grpc.Future] = []

    def open(self, endpoint: str, n: int) -> int:
        """Open `n` more stalled streams to `endpoint` (grpc://HOST:PORT); returns how many are
        open in all.  Does not wait for the receiver's answers (`status` reads them)."""
        target = endpoint.removeprefix("grpc://")
        hello = framing.encode(pb.PushMessage(hello=pb.Hello(
            versions=[PROTOCOL_VERSION], sender="chaos-stalled", transfer_id=new_transfer_id())))
        with self._lock:
            self._gate.clear()
            for i in range(n):
                if i % STREAMS_PER_CHANNEL == 0:
                    self._channels.append(channel(target, self._secret, options=[
                        ("grpc.use_local_subchannel_pool", 1)]))     # a connection of its own
                push = self._channels[-1].stream_unary(grpc_stream.PUSH, request_serializer=None,
                                                       response_deserializer=pb.PushReply.FromString)
                self._futures.append(push.future(self._messages(hello), timeout=HOLD_MAX_S + 10))
            return len(self._futures)

    def _messages(self, hello: bytes) -> Iterator[bytes]:
        yield hello
        self._gate.wait(HOLD_MAX_S)

    def status(self) -> dict[str, Any]:
        """{"open": streams still pending, "ended": {code: count} of those the receiver ended}."""
        with self._lock:
            futures = list(self._futures)
        return {"open": sum(not f.done() for f in futures), "ended": dict(_codes(f for f in futures if f.done()))}

    def handshake(self, endpoint: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """One authenticated Handshake to `endpoint`: {"version", "seconds"} or {"error"}."""
        t0 = time.monotonic()
        with channel(endpoint.removeprefix("grpc://"), self._secret,
                     options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            try:
                reply = pb_grpc.KvTransferStub(ch).Handshake(pb.Hello(versions=[PROTOCOL_VERSION]),
                                                             timeout=timeout_s)
            except grpc.RpcError as e:
                return {"error": e.code().name, "seconds": time.monotonic() - t0}
        return {"version": reply.version, "seconds": time.monotonic() - t0}

    def close(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """End every stream (each sends its end of stream; one that does not end within
        `timeout_s` is cancelled), close the channels.  Returns {"closed": streams that were
        still open, "ended": {code: count} over all of them}."""
        with self._lock:
            futures, channels = self._futures, self._channels
            self._futures, self._channels = [], []
            self._gate.set()
        still_open = sum(not f.done() for f in futures)
        end = time.monotonic() + timeout_s
        for f in futures:
            try:
                f.result(timeout=max(0.0, end - time.monotonic()))
            except grpc.FutureTimeoutError:
                f.cancel()
            except grpc.RpcError:
                pass
        for ch in channels:
            ch.close()
        return {"closed": still_open, "ended": dict(_codes(futures))}


def _codes(futures: Any) -> Counter[str]:
    """How each ended stream ended: a status code name, or the receiver's PushReply reason."""
    out: Counter[str] = Counter()
    for f in futures:
        if f.cancelled():
            out["CANCELLED_HERE"] += 1
            continue
        err = f.exception()
        if err is not None:
            out[err.code().name if isinstance(err, grpc.RpcError) else type(err).__name__] += 1
        else:
            reply = f.result()
            out["OK" if reply.ok else f"reply {reply.reason}"] += 1
    return out
