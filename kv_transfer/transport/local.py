"""In-process transport: frames go straight into the receiver (tests, the colocated worker)."""

from __future__ import annotations

import threading

import torch

from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.frame import SUPPORTED_VERSIONS
from kv_transfer.pages import Payload, payload_view
from kv_transfer.receiver import TransferReceiver
from kv_transfer.transport.base import StagingBuffer
from proto import kv_transfer_pb2 as pb

_ENDPOINTS: dict[str, TransferReceiver] = {}
_LOCK = threading.Lock()


class LocalServer:
    """Makes a receiver reachable as local://NAME inside this process."""

    def __init__(self, receiver: TransferReceiver, name: str) -> None:
        self.receiver, self.name = receiver, name
        with _LOCK:
            if name in _ENDPOINTS:
                raise ValueError(f"local transfer endpoint {name!r} is already served")
            _ENDPOINTS[name] = receiver

    @property
    def endpoint(self) -> str:
        return f"local://{self.name}"

    def stop(self) -> None:
        with _LOCK:
            _ENDPOINTS.pop(self.name, None)


class LocalStream:
    def __init__(self, name: str, transfer_id: bytes, sender: str = "",
                 versions: tuple[int, ...] = SUPPORTED_VERSIONS) -> None:
        with _LOCK:
            receiver = _ENDPOINTS.get(name)
        if receiver is None:
            raise TransferRefused(Refusal.TRANSPORT, f"no local transfer endpoint {name!r}")
        self._receiver = receiver
        self._receiver.hello(list(versions))          # raises BAD_VERSION when none is shared
        self._staging = StagingBuffer()
        self._open: set[bytes] = {transfer_id}
        self.closed = False

    def stage(self, nbytes: int) -> torch.Tensor:
        return self._staging.get(nbytes)

    def send(self, header: pb.FrameHeader, payload: Payload) -> None:
        if self.closed:
            raise TransferRefused(Refusal.TRANSPORT, "stream is closed")
        self._open.add(header.transfer_id)
        self._receiver.receive(header, payload_view(payload))

    def flush(self) -> None:
        pass                           # every frame was delivered when sent

    def commit(self, commit: pb.Commit) -> pb.PushReply:
        self._open.discard(commit.transfer_id)
        res = self._receiver.commit(commit)
        return pb.PushReply(ok=True, committed=True, frames_accepted=len(res.frames))

    def close(self) -> None:
        self.closed = True
        for tid in self._open:
            self._receiver.stream_closed(tid)
        self._open.clear()
