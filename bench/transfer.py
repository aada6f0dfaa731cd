"""KV transfer throughput: one 64 MiB transfer through each transport, against raw memcpy
and a raw loopback TCP socket measured in the same run.

    python -m bench.transfer [--json] [--repeats 7] [--streams 1] [--message-kib 1024] [--device cuda]

The shape is a large model's cache (bench/transfer_shape.py: 32 layers, 8 KV heads, head
dim 128, bf16, 16-token pages, 512 prompt tokens = 64 MiB), sent in frames of 4 layers of
one page as prefill would produce them.  `local` runs in this process; `shm`, `grpc` and
`tcp` cross to a second process (bench/transfer_peer.py).  A transfer's time runs from
opening the stream to the commit's acknowledgement, and its bytes are checked: the
receiver's pages must hash as the sender's.  Each figure is the median of `--repeats`.

--device cuda: the sender's pool (and the `local` receiver's) lives on the GPU, so every frame
is staged through pinned host memory; `memcpy_gbps` is then the device-to-pinned-host copy of
the payload.  The receiving processes keep their pools in host memory.

grpc_tls_gbps: the same gRPC transfer over mutual TLS (both sides holding certificates of one
cluster CA, as `tandem serve` runs across nodes); grpc_tls_vs_grpc is its rate over plaintext
gRPC's, both measured in this run.

checksum_overhead: time spent on checksums and tags (sender checksums + the receiver's
verification and post-commit re-checksum, summed although the two processes run at the
same time) as a share of the gRPC transfer's wall time.  Rates are GB/s (10^9 bytes/s).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from bench.report import emit
from bench.transfer_shape import (
    LAYER_GROUP,
    PROMPT_TOKENS,
    SHAPE,
    bench_prompt_digest,
    make_pool,
    payload_bytes,
    pool_digest,
)
from engine.kv_pool import PagePool
from kv_transfer.frame import new_cluster_secret
from kv_transfer.receiver import TransferReceiver
from kv_transfer.sender import TransferSender, TransferTicket
from kv_transfer.tls import ClusterCA
from kv_transfer.transport import TransportConfig, connect
from kv_transfer.transport.local import LocalServer


class Peer:
    """The receiving process."""

    def __init__(self, kind: str, secret: bytes, config: dict, path: str = "") -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.transfer_peer", kind, secret.hex(),
                                      json.dumps(config), path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.endpoint = self._read()["endpoint"]

    def _read(self) -> dict:
        assert self.proc.stdout is not None   # stdout=PIPE
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"transfer peer exited with {self.proc.wait()}")
        return json.loads(line)

    def ask(self, **cmd: object) -> dict:
        assert self.proc.stdin is not None   # stdin=PIPE
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> None:
        assert self.proc.stdin is not None   # stdin=PIPE
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def push(src: PagePool, secret: bytes, endpoint: str, tid: bytes, rid: str,
         config: TransportConfig) -> tuple[float, float]:
    """One whole transfer; returns (seconds, sender checksum seconds)."""
    t0 = time.perf_counter()
    stream = connect(endpoint, tid, config, secret=secret)
    sender = TransferSender(stream, TransferTicket(tid, rid, "bench", bench_prompt_digest()), secret, src,
                            src.page_table("s"), PROMPT_TOKENS)
    for l0 in range(0, SHAPE["layers"], LAYER_GROUP):
        sender.send_layers(l0, l0 + LAYER_GROUP)
    reply = sender.commit(1, -0.5)
    dt = time.perf_counter() - t0
    assert reply.committed, reply
    return dt, sender.checksum_s


def run_memcpy(nbytes: int, repeats: int, device: str = "cpu") -> list[float]:
    """Host memcpy, or on a device a copy from device memory into pinned host memory."""
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).to(device)
    b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=a.is_cuda)
    b.copy_(a)
    times: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)          # synchronous for a device source
        times.append(time.perf_counter() - t0)
    return times


def run_tcp(secret: bytes, nbytes: int, repeats: int) -> list[float]:
    peer = Peer("tcp", secret, {})
    data = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20))
    times: list[float] = []
    try:
        for _ in range(repeats):
            port = peer.ask(cmd="sink", nbytes=nbytes)["port"]
            t0 = time.perf_counter()
            with socket.create_connection(("127.0.0.1", port)) as s:
                for off in range(0, nbytes, 1 << 20):
                    s.sendall(data[off:off + (1 << 20)])
                assert s.recv(1) == b"k"
            times.append(time.perf_counter() - t0)
    finally:
        peer.stop()
    return times


def run_local(src: PagePool, secret: bytes, want: int, config: TransportConfig, repeats: int) -> list[float]:
    dst = make_pool(seed=2, device=str(src.kv.device))
    recv = TransferReceiver(dst, secret)
    server = LocalServer(recv, "bench")
    times: list[float] = []
    for i in range(repeats):
        rid = f"r{i}"
        dst.allocate(rid, dst.pages_for(PROMPT_TOKENS))
        res = recv.reserve(rid, "bench", PROMPT_TOKENS, bench_prompt_digest())
        times.append(push(src, secret, server.endpoint, res.transfer_id, rid, config)[0])
        assert pool_digest(dst, dst.page_table(rid), PROMPT_TOKENS) == want, "local: bytes differ"
        recv.release(res.transfer_id)
        dst.free(rid)
    server.stop()
    return times


def run_remote(kind: str, src: PagePool, secret: bytes, want: int, config: TransportConfig, repeats: int,
               path: str = "") -> tuple[list[float], list[tuple[float, float, float]]]:
    settings = {k: v for k, v in config.__dict__.items() if k != "tls"}      # the TLS identity goes by `path`
    peer = Peer(kind, secret, settings if kind == "grpc" else {}, path)
    times: list[float] = []
    overhead: list[tuple[float, float, float]] = []
    try:
        for i in range(repeats):
            rid = f"r{i}"
            tid = bytes.fromhex(peer.ask(cmd="reserve", rid=rid, prompt_len=PROMPT_TOKENS)["transfer_id"])
            dt, send_ck = push(src, secret, peer.endpoint, tid, rid, config)
            got = peer.ask(cmd="digest", rid=rid)
            assert got["state"] == "COMMITTED" and got["xxh3"] == want, f"{kind}: bytes differ"
            times.append(dt)
            overhead.append(((send_ck + got["checksum_s"]) / dt, send_ck / dt, got["checksum_s"] / dt))
            peer.ask(cmd="release", rid=rid)
    finally:
        peer.stop()
    return times, overhead


def measure(device: str, repeats: int, config: TransportConfig, extras: bool = True) -> dict[str, Any]:
    """Every rate of the module doc (`extras`: raw TCP and gRPC over TLS too)."""
    secret = new_cluster_secret()
    src = make_pool(seed=1, device=device)
    src.allocate("s", src.pages_for(PROMPT_TOKENS))
    nbytes = payload_bytes(src)
    want = pool_digest(src, src.page_table("s"), PROMPT_TOKENS)
    gbps = lambda times: nbytes / statistics.median(times) / 1e9  # noqa: E731
    r: dict[str, Any] = {"payload_mib": nbytes / 2**20, "shape": SHAPE, "units": "GB/s (1e9 bytes/s)", "device": device,
         "streams": config.streams, "message_kib": config.message_bytes >> 10, "repeats": repeats}
    r["memcpy_gbps"] = gbps(run_memcpy(nbytes, repeats, device))
    if extras:
        r["tcp_gbps"] = gbps(run_tcp(secret, nbytes, repeats))
    r["local_gbps"] = gbps(run_local(src, secret, want, config, repeats))
    with tempfile.TemporaryDirectory() as tmp:
        r["shm_gbps"] = gbps(run_remote("shm", src, secret, want, config, repeats, os.path.join(tmp, "kv.sock"))[0])
    times, overhead = run_remote("grpc", src, secret, want, config, repeats)
    r["grpc_gbps"] = gbps(times)
    if extras:
        with tempfile.TemporaryDirectory() as tmp:     # certificates of a fresh cluster CA, written 0600
            ca = ClusterCA()
            ca.issue("bench-receiver", hosts=["127.0.0.1"]).write(os.path.join(tmp, "receiver"))
            tls_config = dataclasses.replace(config, tls=ca.issue("bench-sender"))
            r["grpc_tls_gbps"] = gbps(run_remote("grpc", src, secret, want, tls_config, repeats,
                                                 os.path.join(tmp, "receiver"))[0])
        r["grpc_tls_vs_grpc"] = r["grpc_tls_gbps"] / r["grpc_gbps"]
        r["grpc_vs_tcp"] = r["grpc_gbps"] / r["tcp_gbps"]
    r["checksum_overhead"] = statistics.median(o[0] for o in overhead)
    r["checksum_overhead_sender"] = statistics.median(o[1] for o in overhead)
    r["checksum_overhead_receiver"] = statistics.median(o[2] for o in overhead)
    r["shm_vs_memcpy"] = r["shm_gbps"] / r["memcpy_gbps"]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--streams", type=int, default=TransportConfig.streams)
    ap.add_argument("--message-kib", type=int, default=TransportConfig.message_bytes >> 10)
    ap.add_argument("--device", default="cpu", help="where the sender's KV pool lives (cpu, cuda)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = TransportConfig(streams=args.streams, message_bytes=args.message_kib << 10)
    emit(measure(args.device, args.repeats, config), args.json)

if __name__ == "__main__":
    main()
