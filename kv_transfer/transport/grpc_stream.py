"""gRPC transport, sending side: a transfer's frames over one or more client streams.

Frames are batched into messages of about `message_bytes`; with `streams > 1` they are
spread over that many streams, each on its own connection (a TCP connection per stream
keeps one slow socket from holding the others back).  Stream 0 carries the commit, after
every other stream has ended and reported its frames accepted.
"""

from __future__ import annotations

import queue
import threading
import time
from enum import Enum
from typing import Final, Iterator

import grpc

from kv_transfer.auth import ClientAuth
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.pages import Payload, payload_view
from kv_transfer.tls import open_channel
from kv_transfer.transport import framing
from kv_transfer.transport.base import TransportConfig
from proto import kv_transfer_pb2 as pb
from proto import kv_transfer_pb2_grpc as pb_grpc


class _End(Enum):
    """The sentinel that ends a lane's request iterator (an enum member, so types can name it)."""
    END = "end"


_END: Final = _End.END
PUSH = "/tandem.kv.KvTransfer/Push"
_CHANNELS: dict[tuple[str, int, TransportConfig, bytes], grpc.Channel] = {}
_CHANNELS_LOCK = threading.Lock()


def _channel(target: str, config: TransportConfig, lane: int, secret: bytes) -> grpc.Channel:
    """One long-lived channel per (target, lane, settings, secret): connections are reused
    across transfers, so a transfer pays no TCP, TLS or HTTP/2 set-up.  Every call on it
    carries credentials made with the cluster secret (kv_transfer/auth.py), over mutual TLS
    when the settings hold a certificate."""
    key = (target, lane, config, secret)
    with _CHANNELS_LOCK:
        ch = _CHANNELS.get(key)
        if ch is None:
            raw = open_channel(target, config.tls, channel_options(config, lane))
            ch = _CHANNELS[key] = grpc.intercept_channel(raw, ClientAuth(secret))
        return ch


def close_channels() -> None:
    """Close every cached channel (tests, shutdown)."""
    with _CHANNELS_LOCK:
        for ch in _CHANNELS.values():
            ch.close()
        _CHANNELS.clear()


def channel_options(config: TransportConfig, lane: int) -> list[tuple[str, object]]:
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", int(config.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.lookahead_bytes", 4 * config.message_bytes),
        ("grpc.http2.bdp_probe", 1),
        ("tandem.kv_lane", lane),     # a distinct argument: a connection of its own per lane
    ]


def _refused(reply: pb.PushReply) -> TransferRefused:
    return TransferRefused(reply.reason or Refusal.TRANSPORT.value, reply.detail)


class _Lane:
    """One client stream: a bounded queue of messages feeding `Push`."""

    def __init__(self, target: str, transfer_id: bytes, config: TransportConfig, index: int,
                 sender: str, secret: bytes) -> None:
        channel = _channel(target, config, index, secret)
        stub = pb_grpc.KvTransferStub(channel)
        if index == 0:
            try:
                reply = stub.Handshake(pb.Hello(versions=list(config.versions), sender=sender),
                                       timeout=config.deadline_s, wait_for_ready=False)
            except grpc.RpcError as e:
                raise TransferRefused(Refusal.TRANSPORT, f"{target}: {e.code().name} {e.details()}") from e
            if reply.version == 0:
                raise TransferRefused(Refusal.BAD_VERSION, reply.reason)
        self._q: queue.Queue[bytes | _End] = queue.Queue(maxsize=config.queue_messages)
        hello = pb.Hello(versions=list(config.versions), sender=sender, streams=config.streams,
                         stream_index=index, transfer_id=transfer_id)
        push = channel.stream_unary(PUSH, request_serializer=None,        # already framed bytes
                                    response_deserializer=pb.PushReply.FromString)
        self.future = push.future(self._messages(framing.encode(pb.PushMessage(hello=hello))),
                                  timeout=config.deadline_s)
        self.pending: list[pb.Frame] = []
        self.payloads: list[bytes] = []
        self.pending_bytes = 0

    def _messages(self, hello: bytes) -> Iterator[bytes]:
        yield hello
        while (msg := self._q.get()) is not _END:
            yield msg

    def put(self, msg: bytes | _End) -> None:
        """Enqueue, waiting for room (backpressure); raises if the server already answered."""
        while True:
            if self.future.done():
                raise self.failure()
            try:
                self._q.put(msg, timeout=0.05)
                return
            except queue.Full:
                continue

    def flush(self) -> None:
        if self.pending:
            self.put(framing.encode(pb.PushMessage(frames=pb.Frames(frames=self.pending)), self.payloads))
            self.pending, self.payloads, self.pending_bytes = [], [], 0

    def finish(self) -> pb.PushReply:
        self.flush()
        self.put(_END)
        try:
            return self.future.result()
        except grpc.RpcError as e:
            raise TransferRefused(Refusal.TRANSPORT, f"{e.code().name}: {e.details()}") from e

    def failure(self) -> TransferRefused:
        try:
            return _refused(self.future.result())
        except grpc.RpcError as e:
            return TransferRefused(Refusal.TRANSPORT, f"{e.code().name}: {e.details()}")
        except grpc.FutureCancelledError:
            return TransferRefused(Refusal.TRANSPORT, "stream cancelled")


class GrpcStream:
    def __init__(self, target: str, transfer_id: bytes, config: TransportConfig, secret: bytes,
                 sender: str = "") -> None:
        self.config = config
        # lane 0 shakes hands
        self._lanes = [_Lane(target, transfer_id, config, i, sender, secret) for i in range(config.streams)]
        self._next = 0
        self.closed = False

    def stage(self, nbytes: int) -> None:
        return None                  # payloads are gathered straight into bytes

    def send(self, header: pb.FrameHeader, payload: Payload) -> None:
        if self.closed:
            raise TransferRefused(Refusal.TRANSPORT, "stream is closed")
        if not isinstance(payload, bytes):
            payload = payload_view(payload).tobytes()
        lane = self._lanes[self._next]
        self._next = (self._next + 1) % len(self._lanes)
        lane.pending.append(pb.Frame(header=header))
        lane.payloads.append(payload)
        lane.pending_bytes += len(payload)
        if lane.pending_bytes >= self.config.message_bytes:
            lane.flush()

    def flush(self) -> None:
        if not self.closed:
            for lane in self._lanes:
                lane.flush()

    def settle(self, timeout_s: float) -> None:
        """Flush, then wait (at most `timeout_s`) until the receiver has answered on every lane:
        a writer that must know its frames arrived before it goes on (fault injection)."""
        self.flush()
        end = time.monotonic() + timeout_s
        for lane in self._lanes:
            while not lane.future.done() and time.monotonic() < end:
                time.sleep(0.01)

    def commit(self, commit: pb.Commit) -> pb.PushReply:
        try:
            for lane in self._lanes[1:]:
                reply = lane.finish()
                if not reply.ok:
                    raise _refused(reply)
            primary = self._lanes[0]
            primary.flush()
            primary.put(framing.encode(pb.PushMessage(commit=commit)))
            reply = primary.finish()
            if not reply.ok:
                raise _refused(reply)
            return reply
        except TransferRefused:
            self.close()
            raise
        finally:
            self.closed = True

    def close(self) -> None:
        """Cut every stream (the receiver fails the transfer: STREAM_CLOSED)."""
        if not self.closed:
            self.closed = True
            for lane in self._lanes:
                lane.future.cancel()
                try:
                    lane._q.put_nowait(_END)      # unblock the request iterator's thread
                except queue.Full:
                    pass
