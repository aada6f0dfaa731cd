"""The receiving process of `bench.transfer`: a pool, a receiver and one server, driven by
one JSON command per line on stdin, answering one JSON line on stdout.

    {"cmd": "reserve", "rid": "r0", "prompt_len": 512}  -> {"transfer_id": "..."}
    {"cmd": "digest", "rid": "r0"}                       -> {"xxh3": ..., "checksum_s": ...}
    {"cmd": "release", "rid": "r0"}                      -> {"ok": true}
    {"cmd": "sink", "nbytes": N}   (raw TCP)             -> {"port": P}, then reads N bytes once
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from typing import TYPE_CHECKING

import torch

from bench.transfer_shape import SHAPE, bench_prompt_digest, make_pool, pool_digest
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import Reservation
from kv_transfer.tls import TlsIdentity
from kv_transfer.transport.base import TransportConfig

if TYPE_CHECKING:
    from kv_transfer.transport.grpc_server import GrpcTransferServer
    from kv_transfer.transport.shm_server import ShmTransferServer


def tcp_sink(nbytes: int) -> int:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def run() -> None:
        conn, _ = srv.accept()
        buf = bytearray(nbytes)
        view, got = memoryview(buf), 0
        while got < nbytes:
            got += conn.recv_into(view[got:got + (1 << 20)])
        conn.sendall(b"k")
        conn.close()
        srv.close()

    threading.Thread(target=run, daemon=True).start()
    return srv.getsockname()[1]


def main() -> None:
    kind, secret, arg = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    pool = make_pool(seed=2)
    recv = TransferReceiver(pool, secret, timeout_s=600)
    config = None
    if kind == "grpc":      # with a directory argument: mutual TLS with the identity written there
        tls = TlsIdentity.load(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] else None
        config = TransportConfig(**json.loads(arg), tls=tls)
    server: ShmTransferServer | GrpcTransferServer | None
    if kind == "shm":
        from kv_transfer.transport.shm_server import ShmTransferServer
        server = ShmTransferServer(recv, sys.argv[4])
    elif kind == "grpc":
        from kv_transfer.transport.grpc_server import GrpcTransferServer
        server = GrpcTransferServer(recv, config=config, secret=secret)
    else:
        server = None
    print(json.dumps({"endpoint": server.endpoint if server else None, "shape": SHAPE}), flush=True)
    res: dict[str, Reservation] = {}
    out: dict[str, object]
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "reserve":
            pool.allocate(cmd["rid"], pool.pages_for(cmd["prompt_len"]))
            res[cmd["rid"]] = recv.reserve(cmd["rid"], "bench", cmd["prompt_len"],
                                           bench_prompt_digest(cmd["prompt_len"]))
            out = {"transfer_id": res[cmd["rid"]].transfer_id.hex()}
        elif cmd["cmd"] == "digest":
            r = res[cmd["rid"]]
            out = {"xxh3": pool_digest(pool, pool.page_table(cmd["rid"]), r.prompt_len),
                   "state": r.state.value, "checksum_s": recv.checksum_s}
        elif cmd["cmd"] == "release":
            recv.release(res.pop(cmd["rid"]).transfer_id)
            pool.free(cmd["rid"])
            recv.checksum_s = 0.0
            out = {"ok": True}
        elif cmd["cmd"] == "sink":
            out = {"port": tcp_sink(cmd["nbytes"])}
        else:
            break
        print(json.dumps(out), flush=True)
    if server:
        server.stop()


if __name__ == "__main__":
    main()
