"""gRPC transport, receiving side: a `KvTransfer` service in front of a `TransferReceiver`."""

from __future__ import annotations

from concurrent import futures
from typing import Iterator

import grpc

from kv_transfer.auth import AuthInterceptor, Verifier
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.receiver import TransferReceiver
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


class _Servicer(pb_grpc.KvTransferServicer):
    def __init__(self, receiver: TransferReceiver) -> None:
        self.receiver = receiver

    def Handshake(self, request: pb.Hello, context: grpc.ServicerContext) -> pb.HelloReply:
        try:
            return pb.HelloReply(version=self.receiver.hello(list(request.versions)))
        except TransferRefused as e:
            return pb.HelloReply(version=0, reason=e.detail)

    def Push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> pb.PushReply:
        seen: set[bytes] = set()
        accepted = 0
        side = False
        try:
            data = next(request_iterator, None)
            first = framing.decode(data)[0] if data is not None else None
            if first is None or first.WhichOneof("kind") != "hello":
                raise TransferRefused(Refusal.BAD_VERSION, "a stream must open with Hello")
            self.receiver.hello(list(first.hello.versions))
            side = first.hello.stream_index > 0
            seen.add(first.hello.transfer_id)
            for data in request_iterator:
                msg, payloads = framing.decode(data)
                if msg.WhichOneof("kind") == "commit":
                    res = self.receiver.commit(msg.commit)
                    seen.discard(msg.commit.transfer_id)
                    return pb.PushReply(ok=True, committed=True, frames_accepted=len(res.frames))
                for f, payload in zip(framing.frames_of(msg), payloads):
                    seen.add(f.header.transfer_id)
                    self.receiver.receive(f.header, payload)
                    accepted += 1
        except TransferRefused as e:
            self._close(seen)            # a stream that refused ends: its transfers with it
            return pb.PushReply(ok=False, reason=e.code, detail=e.detail, frames_accepted=accepted)
        except Exception as e:  # the client went away (cancelled, deadline, connection lost)
            self._close(seen)
            return pb.PushReply(ok=False, reason=Refusal.TRANSPORT.value, detail=repr(e))
        if not side or not context.is_active():
            self._close(seen)
            return pb.PushReply(ok=False, reason=Refusal.STREAM_CLOSED.value,
                                detail="stream ended without a commit", frames_accepted=accepted)
        return pb.PushReply(ok=True, frames_accepted=accepted)

    def _close(self, transfer_ids: set[bytes]) -> None:
        for tid in transfer_ids:
            self.receiver.stream_closed(tid)


class GrpcTransferServer:
    """Serves `receiver` at grpc://HOST:PORT (port 0 picks a free one).  Every call must carry
    credentials made with the cluster secret: `auth` checks them (the worker passes the one
    verifier its RPC server uses, so refusals are counted once per worker; by default one of
    its own over `secret`)."""

    def __init__(self, receiver: TransferReceiver, host: str = "127.0.0.1", port: int = 0,
                 config: TransportConfig | None = None, max_workers: int = 16,
                 advertise_host: str | None = None, secret: bytes = b"",
                 auth: Verifier | None = None) -> None:
        self.config = config or TransportConfig()
        self.auth = auth or Verifier(secret)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                             thread_name_prefix="kv-recv"),
                                  options=server_options(self.config),
                                  interceptors=[AuthInterceptor(self.auth)])
        servicer = _Servicer(receiver)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tandem.kv.KvTransfer", {
            "Handshake": grpc.unary_unary_rpc_method_handler(
                servicer.Handshake, request_deserializer=pb.Hello.FromString,
                response_serializer=pb.HelloReply.SerializeToString),
            "Push": grpc.stream_unary_rpc_method_handler(      # framed bytes: see framing.py
                servicer.Push, request_deserializer=None,
                response_serializer=pb.PushReply.SerializeToString),
        }),))
        self.host = advertise_host or host       # what the endpoint tells senders
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind the KV transfer server to {host}:{port}")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"grpc://{self.host}:{self.port}"

    def stop(self, grace_s: float = 1.0) -> None:
        self.server.stop(grace_s).wait()
