"""gRPC transport, receiving side: a `KvTransfer` service in front of a `TransferReceiver`."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Iterator

import grpc

from kv_transfer.auth import AuthInterceptor, Verifier
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.receiver import TransferReceiver
from kv_transfer.tls import add_port
from kv_transfer.transport import framing
from kv_transfer.transport.base import TransportConfig
from proto import kv_transfer_pb2 as pb
from proto import kv_transfer_pb2_grpc as pb_grpc


def server_options(config: TransportConfig) -> list[tuple[str, int]]:
    ms = int(config.keepalive_s * 1000)
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        # accept the client's pings at its keepalive interval, also on a stream that is
        # flow-controlled and sends no data for a while (a stalled reader is not a bad client)
        ("grpc.http2.min_recv_ping_interval_without_data_ms", ms // 2),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.lookahead_bytes", 4 * config.message_bytes),
        ("grpc.http2.bdp_probe", 1),
    ]


class _StreamWatch:
    """The receiver's live Push streams: at most `limit` at once, and each one cut (its call
    cancelled) once it has waited `idle_s` for its next message.  One thread checks them."""

    def __init__(self, limit: int, idle_s: float) -> None:
        self.limit, self.idle_s = limit, idle_s
        self._lock = threading.Lock()
        self._waiting: dict[grpc.ServicerContext, float | None] = {}   # stream -> waiting since
        self.refused = 0            # streams refused over the cap
        self.cut = 0                # streams cut for idling
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kv-recv-idle", daemon=True)
        self._thread.start()

    def admit(self, context: grpc.ServicerContext) -> bool:
        """Count the stream in; False (counting nothing) when `limit` streams are live."""
        with self._lock:
            if len(self._waiting) >= self.limit:
                self.refused += 1
                return False
            self._waiting[context] = None
            return True

    @property
    def live(self) -> int:
        with self._lock:
            return len(self._waiting)

    def leave(self, context: grpc.ServicerContext) -> None:
        with self._lock:
            self._waiting.pop(context, None)

    def read(self, context: grpc.ServicerContext, it: Iterator[bytes]) -> Iterator[bytes]:
        """The stream's messages; the time spent waiting for each counts towards its idling."""
        while True:
            with self._lock:
                self._waiting[context] = time.monotonic()
            try:
                data = next(it, None)
            finally:
                with self._lock:
                    self._waiting[context] = None
            if data is None:
                return
            yield data

    def _watch(self) -> None:
        while not self._stop.wait(min(self.idle_s / 4, 1.0)):
            now = time.monotonic()
            with self._lock:
                idle = [c for c, since in self._waiting.items()
                        if since is not None and now - since >= self.idle_s]
                for c in idle:
                    self._waiting[c] = None     # cut once
                self.cut += len(idle)
            for c in idle:
                c.cancel()                      # the blocked read raises; Push fails what it proved

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class _Servicer(pb_grpc.KvTransferServicer):
    def __init__(self, receiver: TransferReceiver, watch: _StreamWatch) -> None:
        self.receiver, self.watch = receiver, watch

    def Handshake(self, request: pb.Hello, context: grpc.ServicerContext) -> pb.HelloReply:
        try:
            return pb.HelloReply(version=self.receiver.hello(list(request.versions)))
        except TransferRefused as e:
            return pb.HelloReply(version=0, reason=e.detail)

    def Push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> pb.PushReply:
        if not self.watch.admit(context):         # refused before a byte of it is read
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"this receiver serves at most "
                          f"{self.watch.limit} Push streams at once (TransportConfig.max_push_streams)")
        try:
            return self._push(self.watch.read(context, request_iterator), context)
        finally:
            self.watch.leave(context)

    def _push(self, messages: Iterator[bytes], context: grpc.ServicerContext) -> pb.PushReply:
        """Serve one stream.  `proven`: the transfers this stream presented a verified frame
        for; only those fail when it ends without their commit (a bare Hello fails nothing)."""
        proven: set[bytes] = set()
        accepted = 0
        side = False
        try:
            data = next(messages, None)
            first = framing.decode(data)[0] if data is not None else None
            if first is None or first.WhichOneof("kind") != "hello":
                raise TransferRefused(Refusal.BAD_VERSION, "a stream must open with Hello")
            self.receiver.hello(list(first.hello.versions))
            side = first.hello.stream_index > 0
            for data in messages:
                msg, payloads = framing.decode(data)
                if msg.WhichOneof("kind") == "commit":
                    res = self.receiver.commit(msg.commit)
                    proven.discard(msg.commit.transfer_id)
                    return pb.PushReply(ok=True, committed=True, frames_accepted=len(res.frames))
                for f, payload in zip(framing.frames_of(msg), payloads):
                    self.receiver.receive(f.header, payload)     # raises unless the tag matched
                    proven.add(f.header.transfer_id)
                    accepted += 1
        except TransferRefused as e:
            self._close(proven)          # a stream that refused ends: its transfers with it
            return pb.PushReply(ok=False, reason=e.code, detail=e.detail, frames_accepted=accepted)
        except Exception as e:  # the client went away (cancelled, deadline, connection lost, idle cut)
            self._close(proven)
            return pb.PushReply(ok=False, reason=Refusal.TRANSPORT.value, detail=repr(e))
        if not side or not context.is_active():
            self._close(proven)
            return pb.PushReply(ok=False, reason=Refusal.STREAM_CLOSED.value,
                                detail="stream ended without a commit", frames_accepted=accepted)
        return pb.PushReply(ok=True, frames_accepted=accepted)

    def _close(self, transfer_ids: set[bytes]) -> None:
        for tid in transfer_ids:
            self.receiver.stream_closed(tid)


HANDSHAKE_THREADS = 4      # receiver threads kept free of Push streams, for Handshakes

class GrpcTransferServer:
    """Serves `receiver` at grpc://HOST:PORT (port 0 picks a free one).  Every call must carry
    credentials made with the cluster secret: `auth` checks them (the worker passes the one
    verifier its RPC server uses, so refusals are counted once per worker; by default one of
    its own over `secret`).  `max_workers` (default: `config.max_push_streams` +
    HANDSHAKE_THREADS) must stay above `config.max_push_streams`: the threads left over serve
    Handshakes however many Push streams stall."""

    def __init__(self, receiver: TransferReceiver, host: str = "127.0.0.1", port: int = 0,
                 config: TransportConfig | None = None, max_workers: int | None = None,
                 advertise_host: str | None = None, secret: bytes = b"",
                 auth: Verifier | None = None) -> None:
        self.config = config or TransportConfig()
        self.auth = auth or Verifier(secret)
        if max_workers is None:
            max_workers = self.config.max_push_streams + HANDSHAKE_THREADS
        if self.config.max_push_streams >= max_workers:
            raise ValueError(f"max_push_streams={self.config.max_push_streams} must be below "
                             f"max_workers={max_workers}, so a Handshake always finds a thread")
        self.watch = _StreamWatch(self.config.max_push_streams, self.config.stream_idle_s)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                             thread_name_prefix="kv-recv"),
                                  options=server_options(self.config),
                                  interceptors=[AuthInterceptor(self.auth)])
        servicer = _Servicer(receiver, self.watch)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tandem.kv.KvTransfer", {
            "Handshake": grpc.unary_unary_rpc_method_handler(
                servicer.Handshake, request_deserializer=pb.Hello.FromString,
                response_serializer=pb.HelloReply.SerializeToString),
            "Push": grpc.stream_unary_rpc_method_handler(      # framed bytes: see framing.py
                servicer.Push, request_deserializer=None,
                response_serializer=pb.PushReply.SerializeToString),
        }),))
        self.host = advertise_host or host       # what the endpoint tells senders
        self.port = add_port(self.server, f"{host}:{port}", self.config.tls)
        if self.port == 0:
            self.watch.stop()
            raise OSError(f"cannot bind the KV transfer server to {host}:{port}")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"grpc://{self.host}:{self.port}"

    def stop(self, grace_s: float = 1.0) -> None:
        self.server.stop(grace_s).wait()
        self.watch.stop()
