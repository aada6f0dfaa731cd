"""The points where optional machinery (fault injection in chaos runs, tracing) plugs into a
KV transfer, as typed hooks with no-op defaults.  Production code calls them unconditionally;
`chaos/` supplies implementations and installs them on a running worker through
`WorkerHandle.install_transfer_hooks`.

    sender side    on_frame        a frame is ready: send it (or alter, hold, repeat, drop it)
                   before_commit   the commit is next: send anything still held
                   after_commit    the commit was answered
    receiver side  before_receive  a frame arrived, before anything is checked
                   skip_write      a verified frame's page copy is about to run
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kv_transfer.pages import Payload
from proto import kv_transfer_pb2 as pb

if TYPE_CHECKING:
    from kv_transfer.sender import SenderStream, TransferTicket


class SenderHooks(Protocol):
    def on_frame(self, ticket: TransferTicket, header: pb.FrameHeader, payload: Payload,
                 stream: SenderStream) -> bool:
        """Send the frame through `stream` (the default sends it as it is).  Returns True when
        the sender must commit now, sending no more frames.  May raise TransferRefused."""
        ...

    def before_commit(self, ticket: TransferTicket, stream: SenderStream) -> None:
        """The sender is about to commit `ticket`'s transfer on `stream`."""
        ...

    def after_commit(self, ticket: TransferTicket) -> None:
        """The commit of `ticket`'s transfer was answered (accepted or refused)."""
        ...


class ReceiverHooks(Protocol):
    def before_receive(self, header: pb.FrameHeader) -> None:
        """A frame arrived at the receiver; called before any check, outside its lock."""
        ...

    def skip_write(self, header: pb.FrameHeader, holds_payload: Callable[[], bool]) -> bool:
        """Called in place of a verified frame's page copy: True means mark it written but
        copy nothing (the commit's re-checksum must then refuse the transfer, unless the page
        already held exactly those bytes: `holds_payload()` says so, comparing the destination
        with the payload; call it only when deciding to skip, it reads the page)."""
        ...


class PlainSender:
    """The default sender hooks: every frame goes out as it is."""

    def on_frame(self, ticket: TransferTicket, header: pb.FrameHeader, payload: Payload,
                 stream: SenderStream) -> bool:
        stream.send(header, payload)
        return False

    def before_commit(self, ticket: TransferTicket, stream: SenderStream) -> None:
        pass

    def after_commit(self, ticket: TransferTicket) -> None:
        pass


class PlainReceiver:
    """The default receiver hooks: nothing happens."""

    def before_receive(self, header: pb.FrameHeader) -> None:
        pass

    def skip_write(self, header: pb.FrameHeader, holds_payload: Callable[[], bool]) -> bool:
        return False


PLAIN_SENDER = PlainSender()
PLAIN_RECEIVER = PlainReceiver()


@dataclass(frozen=True)
class TransferHooks:
    """What a worker installs: the hooks of the transfers it sends and of those it receives."""
    sender: SenderHooks = PLAIN_SENDER
    receiver: ReceiverHooks = PLAIN_RECEIVER
