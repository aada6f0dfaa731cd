"""The receiving process of `bench.transfer`: a pool, a receiver and one server, driven by
one JSON command per line on stdin, answering one JSON line on stdout.

    python -m bench.transfer_peer KIND SECRET_HEX CONFIG_JSON SHAPE_JSON [PATH]

KIND is shm, nixl, grpc, grpc_bare or tcp; CONFIG_JSON the TransportConfig's fields (grpc,
grpc_bare; without `tls`);
SHAPE_JSON the KVShape of its pool (shm, grpc); PATH the shm or nixl socket, or for grpc the directory
of a TLS identity (then the server runs mutual TLS).

    {"cmd": "reserve", "rid": "r0"}            -> {"transfer_id": "..."}  (a prompt of shape.tokens)
    {"cmd": "digest", "rid": "r0"}             -> {"xxh3": ..., "state": ..., "checksum_s": ...}
    {"cmd": "release", "rid": "r0"}            -> {"ok": true}
    {"cmd": "sink", "nbytes": N}   (raw TCP)   -> {"port": P}, then reads N bytes once

grpc_bare serves one bare gRPC method, BARE_PUSH: a client stream of raw bytes messages (no
protobuf, no credentials, no Tandem code), answered with their total length as 8 bytes
little-endian; gRPC's own floor at the transport's message size and channel settings.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc
import torch

from bench.transfer_shape import KVShape
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import Reservation
from kv_transfer.tls import TlsIdentity
from kv_transfer.transport.base import TransportConfig

if TYPE_CHECKING:
    from kv_transfer.transport.grpc_server import GrpcTransferServer
    from kv_transfer.transport.nixl_server import NixlTransferServer
    from kv_transfer.transport.shm_server import ShmTransferServer


def tcp_sink(buf: bytearray) -> int:
    """Accept one connection and read len(buf) bytes of it into `buf` (allocated and zeroed by
    the caller, so no page is faulted in while the transfer is timed); returns the port."""
    nbytes = len(buf)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def run() -> None:
        conn, _ = srv.accept()
        view, got = memoryview(buf), 0
        while got < nbytes:
            got += conn.recv_into(view[got:got + (1 << 20)])
        conn.sendall(b"k")
        conn.close()
        srv.close()

    threading.Thread(target=run, daemon=True).start()
    return srv.getsockname()[1]


BARE_PUSH = "/bench.Sink/Push"


def bare_grpc_server(config: dict) -> tuple[grpc.Server, str]:
    """A gRPC server of BARE_PUSH alone, with the transport's server options; (server, endpoint)."""
    from concurrent import futures

    from kv_transfer.transport.grpc_server import server_options

    def push(messages: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        return sum(len(m) for m in messages).to_bytes(8, "little")

    handler = grpc.method_handlers_generic_handler("bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(push)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler],
                         options=server_options(TransportConfig(**config)))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def serve(kind: str, secret: bytes, config: dict, recv: TransferReceiver,
          path: str) -> ShmTransferServer | NixlTransferServer | GrpcTransferServer:
    if kind == "shm":
        from kv_transfer.transport.shm_server import ShmTransferServer
        return ShmTransferServer(recv, path)
    if kind == "nixl":
        from kv_transfer.transport.nixl_server import NixlTransferServer
        return NixlTransferServer(recv, path)
    from kv_transfer.transport.grpc_server import GrpcTransferServer
    tls = TlsIdentity.load(path) if path else None    # a directory: mutual TLS with the identity there
    return GrpcTransferServer(recv, config=TransportConfig(**config, tls=tls), secret=secret)


def main() -> None:
    kind, secret, config = sys.argv[1], bytes.fromhex(sys.argv[2]), json.loads(sys.argv[3])
    shape, path = KVShape.from_json(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else ""
    torch.set_num_threads(1)
    server = bare = None
    endpoint = None
    if kind == "grpc_bare":
        bare, endpoint = bare_grpc_server(config)
    elif kind != "tcp":               # the raw socket needs no pool
        pool = shape.make_pool(seed=2)
        recv = TransferReceiver(pool, secret, timeout_s=600)
        server = serve(kind, secret, config, recv, path)
        endpoint = server.endpoint
    print(json.dumps({"endpoint": endpoint}), flush=True)
    res: dict[str, Reservation] = {}
    sink = bytearray()                # raw TCP: one buffer for every sink
    out: dict[str, object]
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "reserve":
            pool.allocate(cmd["rid"], shape.prompt_pages)
            res[cmd["rid"]] = recv.reserve(cmd["rid"], "bench", shape.tokens, shape.bench_prompt_digest())
            out = {"transfer_id": res[cmd["rid"]].transfer_id.hex()}
        elif cmd["cmd"] == "digest":
            out = {"xxh3": shape.pool_digest(pool, pool.page_table(cmd["rid"])),
                   "state": res[cmd["rid"]].state.value, "checksum_s": recv.checksum_s}
        elif cmd["cmd"] == "release":
            recv.release(res.pop(cmd["rid"]).transfer_id)
            pool.free(cmd["rid"])
            recv.checksum_s = 0.0
            out = {"ok": True}
        elif cmd["cmd"] == "sink":
            if len(sink) != cmd["nbytes"]:
                sink = bytearray(cmd["nbytes"])
            out = {"port": tcp_sink(sink)}
        else:
            break
        print(json.dumps(out), flush=True)
    if server:
        server.stop()
    if bare is not None:
        bare.stop(1.0)


if __name__ == "__main__":
    main()
