"""The shared-memory transport accepts only its own user: the socket lies in a private 0700
directory removed at stop, segments are 0600 under unpredictable names, and a peer running as
another uid is closed before any message is read — its frames write nothing, and the server
keeps serving legitimate transfers."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
import time

import pytest
import torch

from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.frame import PROTOCOL_VERSION
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import State
from kv_transfer.transport import TransportConfig, connect, shm, shm_server
from kv_transfer.transport.shm_server import ShmTransferServer
from kv_transfer.transport.wire import _LEN
from proto import kv_transfer_pb2 as pb
from tests.kv_helpers import LAYERS, SECRET, make_pool, pages_equal, prepare
from tests.test_kv_transports import finish, start, wait_for

CONFIG = TransportConfig(shm_bytes=1 << 16)
NOBODY = 65534


@pytest.fixture(autouse=True)
def _close_cached_channels():
    yield
    shm.close_channels()


def _transfer(server: ShmTransferServer, recv: TransferReceiver, dst, rid: str) -> None:
    """A real transfer over shm that must arrive byte-exact."""
    src = make_pool(48, seed=1)
    res, sender, _ = start(src, dst, recv, rid, 21, server.endpoint, CONFIG)
    sender.send_layers(0, LAYERS)
    assert sender.commit(first_token_id=3, first_logprob=-0.5).committed
    assert res.state == State.COMMITTED and pages_equal(src, dst, rid, 21)
    finish(src, dst, recv, res, rid)


def test_the_socket_lies_in_a_private_directory_removed_at_stop():
    dst = make_pool(48, seed=2)
    recv = TransferReceiver(dst, SECRET, timeout_s=30)
    server = ShmTransferServer(recv)
    directory = os.path.dirname(server.path)
    try:
        assert os.path.basename(directory).startswith("tandem-kv-")
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
        assert os.stat(directory).st_uid == os.getuid()
        _transfer(server, recv, dst, "a")
    finally:
        shm.close_channels()
        server.stop()
    assert not os.path.exists(directory)
    dst.check_integrity()


def test_segments_are_private_and_unpredictably_named(monkeypatch, tmp_path):
    dst = make_pool(48, seed=2)
    recv = TransferReceiver(dst, SECRET, timeout_s=30)
    seen: list[tuple[str, int, int]] = []
    inner = shm_server._map_segment

    def recording(name: str):                  # the sender unlinks the name after the server's reply
        st = os.stat(f"/dev/shm/{name.lstrip('/')}")
        seen.append((name, stat.S_IMODE(st.st_mode), st.st_uid))
        return inner(name)

    monkeypatch.setattr(shm_server, "_map_segment", recording)
    server = ShmTransferServer(recv, str(tmp_path / "kv.sock"))
    try:
        _transfer(server, recv, dst, "a")
        shm.close_channels()
        _transfer(server, recv, dst, "b")       # a second channel, a second segment
    finally:
        server.stop()
    assert len(seen) == 2 and seen[0][0] != seen[1][0]
    for name, mode, uid in seen:
        assert name.startswith("tandem-kv-") and len(name) == len("tandem-kv-") + 32
        assert mode == 0o600 and uid == os.getuid()
        assert not os.path.exists(f"/dev/shm/{name}")


def test_a_segment_others_may_write_is_refused(monkeypatch, tmp_path):
    dst = make_pool(48, seed=2)
    recv = TransferReceiver(dst, SECRET, timeout_s=30)
    real = shm.shared_memory.SharedMemory

    def loose(*args, **kwargs):                 # a sender whose segment is group/other-writable
        seg = real(*args, **kwargs)
        os.fchmod(seg._fd, 0o666)
        return seg

    monkeypatch.setattr(shm.shared_memory, "SharedMemory", loose)
    server = ShmTransferServer(recv, str(tmp_path / "kv.sock"))
    try:
        with pytest.raises(TransferRefused) as e:
            connect(server.endpoint, b"t" * 16, CONFIG, secret=SECRET)
        assert e.value.reason == Refusal.TRANSPORT and "mode 666" in e.value.detail
    finally:
        server.stop()


def _frames_bytes(t, shm_name: str) -> tuple[bytes, bytes]:
    """The control messages of transfer `t` as a sender would send them (hello, the frames
    pointing into segment `shm_name`, the commit), and the segment's payload bytes."""
    ring, frames = bytearray(), []
    for header, payload in t.frames:
        frames.append(pb.Frame(header=header, payload_offset=len(ring), payload_length=len(payload)))
        ring += payload
    size = max(len(ring), 1 << 16)
    msgs = [pb.PushMessage(hello=pb.Hello(versions=[PROTOCOL_VERSION], sender="intruder", shm_name=shm_name,
                                          shm_size=size, transfer_id=t.res.transfer_id)),
            pb.PushMessage(frames=pb.Frames(frames=frames)),
            pb.PushMessage(commit=t.commit)]
    wire = b"".join(_LEN.pack(len(b := m.SerializeToString())) + b for m in msgs)
    return wire, bytes(ring) + bytes(size - len(ring))


def _as_nobody(path: str, wire: bytes, segment: bytes, shm_name: str) -> int:
    """Fork a child that drops to uid nobody, writes `segment` to /dev/shm/`shm_name` and sends
    `wire` to the socket at `path`; its exit status: 0 refused (closed, no reply), 1 answered,
    2 could not connect or send, 3 anything else."""
    pid = os.fork()
    if pid == 0:                                # the child: syscalls only, then _exit
        code = 3
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fd = os.open(f"/dev/shm/{shm_name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.write(fd, segment)
            os.close(fd)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            code = 2
            s.connect(path)
            try:
                s.sendall(wire)
            except OSError:
                pass                            # the server may close before all is sent
            try:
                code = 1 if s.recv(1) else 0
            except ConnectionResetError:
                code = 0
        finally:
            os._exit(code)
    end = time.monotonic() + 15
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the child did not finish in time")
        time.sleep(0.01)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a peer as another uid")
def test_a_peer_with_another_uid_is_refused_and_writes_nothing():
    dst, src = make_pool(48, seed=2), make_pool(48, seed=1)
    recv = TransferReceiver(dst, SECRET, timeout_s=30)
    directory = tempfile.mkdtemp(prefix="tandem-kv-test-")
    os.chmod(directory, 0o755)                  # misconfigured on purpose: nobody can reach the socket
    refusals: list[int] = []
    server = ShmTransferServer(recv, os.path.join(directory, "kv.sock"), on_refused=lambda: refusals.append(1))
    os.chmod(server.path, 0o666)
    shm_name = f"tandem-kv-intruder-{os.getpid()}"
    try:
        t = prepare(src, dst, recv, "a", 21)   # valid frames for a live reservation (a replay)
        before = dst.kv.clone()
        wire, segment = _frames_bytes(t, shm_name)
        assert _as_nobody(server.path, wire, segment, shm_name) == 0
        wait_for(lambda: server.refused_peers == 1)
        assert refusals == [1]                  # what a worker adds to Stats.rpc_unauthenticated
        assert t.res.state == State.RESERVED and not t.res.frames
        assert torch.equal(dst.kv, before)
        assert not any(dst.is_written(p) for p in dst.page_table("a"))
        recv.release(t.res.transfer_id)
        dst.free("a")
        src.free("a")
        _transfer(server, recv, dst, "b")       # the server still serves its own user
        assert server.refused_peers == 1
    finally:
        shm.close_channels()
        server.stop()
        if os.path.exists(f"/dev/shm/{shm_name}"):
            os.unlink(f"/dev/shm/{shm_name}")
        os.rmdir(directory)
    dst.check_integrity()
    assert dst.num_free == dst.num_pages


def test_a_peer_outside_the_allowed_uids_is_refused(tmp_path):
    dst = make_pool(48, seed=2)
    recv = TransferReceiver(dst, SECRET, timeout_s=30)
    server = ShmTransferServer(recv, str(tmp_path / "kv.sock"), allowed_uids={os.getuid() + 4242})
    try:
        with pytest.raises(TransferRefused) as e:
            connect(server.endpoint, b"t" * 16, CONFIG, secret=SECRET)
        assert e.value.reason == Refusal.TRANSPORT
        assert server.refused_peers == 1
    finally:
        server.stop()
    server = ShmTransferServer(recv, str(tmp_path / "kv2.sock"), allowed_uids={os.getuid() + 4242, os.getuid()})
    try:
        _transfer(server, recv, dst, "a")
        assert server.refused_peers == 0
    finally:
        shm.close_channels()
        server.stop()
    dst.check_integrity()
