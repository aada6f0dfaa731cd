"""The runs of `bench.transfer`: each moves the payload one way `repeats` times and returns its
timings; bench/transfer.py turns them into the report.  Every transfer's bytes are checked: the
receiving pool must hash as the sender's."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import xxhash

from bench.transfer_shape import KVShape
from engine.kv_pool import PagePool
from kv_transfer.frame import new_cluster_secret
from kv_transfer.pages import as_bytes, read_block
from kv_transfer.receiver import TransferReceiver
from kv_transfer.sender import TransferSender, TransferTicket
from kv_transfer.tls import ClusterCA
from kv_transfer.transport import TransportConfig, connect
from kv_transfer.transport.local import LocalServer


@dataclass
class Transfers:
    """One transport's transfers: per transfer its wall seconds and the seconds each side spent
    on checksums and tags (the sender's TransferSender.checksum_s, the receiver's
    TransferReceiver.checksum_s)."""
    seconds: list[float] = field(default_factory=list)
    sender_checksum_s: list[float] = field(default_factory=list)
    receiver_checksum_s: list[float] = field(default_factory=list)

    def add(self, seconds: float, sender_checksum_s: float, receiver_checksum_s: float) -> None:
        self.seconds.append(seconds)
        self.sender_checksum_s.append(sender_checksum_s)
        self.receiver_checksum_s.append(receiver_checksum_s)

    def checksum_share(self, sender: bool = True, receiver: bool = True) -> float:
        """The median over transfers of (checksum seconds of the sides asked for) / wall seconds."""
        return statistics.median((sender * s + receiver * r) / t for t, s, r in
                                 zip(self.seconds, self.sender_checksum_s, self.receiver_checksum_s))


@dataclass(frozen=True)
class Source:
    """The sending side of every run: a pool holding the prompt (request "s"), the cluster
    secret, and the digest the receiving pool must match."""
    shape: KVShape
    pool: PagePool
    secret: bytes
    want: int

    @classmethod
    def build(cls, shape: KVShape, device: str) -> Source:
        pool = shape.make_pool(seed=1, device=device)
        pool.allocate("s", shape.prompt_pages)
        return cls(shape, pool, new_cluster_secret(), shape.pool_digest(pool, pool.page_table("s")))

    def push(self, endpoint: str, tid: bytes, rid: str, config: TransportConfig) -> tuple[float, float]:
        """One whole transfer; returns (seconds, sender checksum seconds)."""
        t0 = time.perf_counter()
        stream = connect(endpoint, tid, config, secret=self.secret)
        sender = TransferSender(stream, TransferTicket(tid, rid, "bench", self.shape.bench_prompt_digest()),
                                self.secret, self.pool, self.pool.page_table("s"), self.shape.tokens)
        for l0, l1 in self.shape.layer_groups():
            sender.send_layers(l0, l1)
        reply = sender.commit(1, -0.5)
        dt = time.perf_counter() - t0
        assert reply.committed, reply
        return dt, sender.checksum_s

    def payload(self) -> torch.Tensor:
        """The payload gathered frame after frame, in the sender's order, into one host buffer."""
        out = torch.empty(self.shape.payload_bytes, dtype=torch.uint8)
        table, off = self.pool.page_table("s"), 0
        for l0, l1, i, n in self.shape.frames():
            size = self.shape.frame_nbytes(l0, l1, n)
            read_block(self.pool, table[i], l0, l1, n, out=out[off:off + size])
            off += size
        return out


class Peer:
    """The receiving process (bench/transfer_peer.py)."""

    def __init__(self, kind: str, src: Source, config: dict, path: str = "") -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.transfer_peer", kind, src.secret.hex(),
                                      json.dumps(config), src.shape.to_json(), path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
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


def peer_settings(config: TransportConfig) -> dict:
    """The transport settings a gRPC peer is started with (the TLS identity goes by its path)."""
    return {k: v for k, v in config.__dict__.items() if k != "tls"}


def run_memcpy(payload: torch.Tensor, repeats: int, device: str = "cpu") -> list[float]:
    """Host memcpy of the payload on one thread (as a receiver copies), or on a device a copy
    from device memory into pinned host memory."""
    a = payload.to(device)
    b = torch.empty(a.numel(), dtype=torch.uint8, pin_memory=a.is_cuda)
    b.copy_(a)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times: list[float] = []
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            b.copy_(a)          # synchronous for a device source
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return times


def run_checksum(payload: torch.Tensor, shape: KVShape, repeats: int) -> list[float]:
    """xxh3-64 over the payload, frame by frame as the sender hashes it (without the header)."""
    view = as_bytes(payload)
    bounds = list(itertools.accumulate((shape.frame_nbytes(l0, l1, n) for l0, l1, _, n in shape.frames()),
                                       initial=0))
    times: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for start, end in itertools.pairwise(bounds):
            xxhash.xxh3_64_intdigest(view[start:end])
        times.append(time.perf_counter() - t0)
    return times


def run_tcp(src: Source, repeats: int) -> list[float]:
    """The payload's size through a raw loopback socket, in 1 MiB writes."""
    nbytes, chunk = src.shape.payload_bytes, 1 << 20
    data = bytearray(os.urandom(chunk)) * -(-nbytes // chunk)
    del data[nbytes:]
    view = memoryview(data)
    peer = Peer("tcp", src, {})
    times: list[float] = []
    try:
        for _ in range(repeats):
            port = peer.ask(cmd="sink", nbytes=nbytes)["port"]
            t0 = time.perf_counter()
            with socket.create_connection(("127.0.0.1", port)) as s:
                for off in range(0, nbytes, chunk):
                    s.sendall(view[off:off + chunk])
                assert s.recv(1) == b"k"
            times.append(time.perf_counter() - t0)
    finally:
        peer.stop()
    return times


def run_grpc_bare(src: Source, config: TransportConfig, repeats: int) -> list[float]:
    """The payload's size through one bare gRPC stream (bench/transfer_peer.py BARE_PUSH) in
    messages of config.message_bytes, already made: gRPC's floor, without the transport's
    gather, checksums, framing, credentials or the receiver's writes."""
    import grpc

    from bench.transfer_peer import BARE_PUSH
    from kv_transfer.transport.grpc_stream import channel_options

    nbytes, size = src.shape.payload_bytes, config.message_bytes
    message = os.urandom(size)
    sizes = [min(size, nbytes - off) for off in range(0, nbytes, size)]
    peer = Peer("grpc_bare", src, peer_settings(config))
    times: list[float] = []
    try:
        with grpc.insecure_channel(peer.endpoint, options=channel_options(config, 0)) as ch:
            push = ch.stream_unary(BARE_PUSH)
            push(iter([message[:1]]))      # the connection, before any timing
            for _ in range(repeats):
                t0 = time.perf_counter()
                got = push(message if n == size else message[:n] for n in sizes)
                times.append(time.perf_counter() - t0)
                assert int.from_bytes(got, "little") == nbytes, "grpc_bare: bytes lost"
    finally:
        peer.stop()
    return times


def run_local(src: Source, config: TransportConfig, repeats: int) -> Transfers:
    dst = src.shape.make_pool(seed=2, device=str(src.pool.kv.device))
    recv = TransferReceiver(dst, src.secret)
    server = LocalServer(recv, "bench")
    out = Transfers()
    try:
        for i in range(repeats):
            rid = f"r{i}"
            dst.allocate(rid, src.shape.prompt_pages)
            res = recv.reserve(rid, "bench", src.shape.tokens, src.shape.bench_prompt_digest())
            recv.checksum_s = 0.0
            dt, send_ck = src.push(server.endpoint, res.transfer_id, rid, config)
            out.add(dt, send_ck, recv.checksum_s)
            assert src.shape.pool_digest(dst, dst.page_table(rid)) == src.want, "local: bytes differ"
            recv.release(res.transfer_id)
            dst.free(rid)
    finally:
        server.stop()
    return out


def run_remote(kind: str, src: Source, config: TransportConfig, repeats: int, path: str = "") -> Transfers:
    peer = Peer(kind, src, peer_settings(config) if kind == "grpc" else {}, path)
    out = Transfers()
    try:
        for i in range(repeats):
            rid = f"r{i}"
            tid = bytes.fromhex(peer.ask(cmd="reserve", rid=rid)["transfer_id"])
            dt, send_ck = src.push(peer.endpoint, tid, rid, config)
            got = peer.ask(cmd="digest", rid=rid)
            assert got["state"] == "COMMITTED" and got["xxh3"] == src.want, f"{kind}: bytes differ"
            out.add(dt, send_ck, got["checksum_s"])
            peer.ask(cmd="release", rid=rid)
    finally:
        peer.stop()
    return out


def run_shm(src: Source, config: TransportConfig, repeats: int) -> Transfers:
    with tempfile.TemporaryDirectory() as tmp:
        return run_remote("shm", src, config, repeats, os.path.join(tmp, "kv.sock"))


def run_nixl(src: Source, config: TransportConfig, repeats: int) -> Transfers:
    with tempfile.TemporaryDirectory() as tmp:
        return run_remote("nixl", src, config, repeats, os.path.join(tmp, "kv.sock"))


def run_grpc_tls(src: Source, config: TransportConfig, repeats: int) -> Transfers:
    """gRPC over mutual TLS: both sides hold certificates of a fresh cluster CA (written 0600)."""
    with tempfile.TemporaryDirectory() as tmp:
        ca = ClusterCA()
        ca.issue("bench-receiver", hosts=["127.0.0.1"]).write(os.path.join(tmp, "receiver"))
        tls_config = dataclasses.replace(config, tls=ca.issue("bench-sender"))
        return run_remote("grpc", src, tls_config, repeats, os.path.join(tmp, "receiver"))
