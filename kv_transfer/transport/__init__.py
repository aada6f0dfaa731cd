"""Transports behind one interface: `connect(endpoint) -> SenderStream` on the sending side,
a server that feeds a `TransferReceiver` on the receiving side.

    local://NAME          in-process (tests, the colocated worker)
    shm://PATH            same node: payloads in shared memory, headers over a Unix socket
    nixl://PATH           same node: NIXL one-sided writes into a staging ring the receiver
                          registered (never its pool), headers and commit over a Unix socket
                          (the `nixl` extra)
    grpc://HOST:PORT      across nodes: gRPC client streaming

`connect` picks the transport from the endpoint's scheme.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kv_transfer.transport.base import TransportConfig

if TYPE_CHECKING:
    from kv_transfer.sender import SenderStream


def connect(endpoint: str, transfer_id: bytes, config: TransportConfig | None = None,
            sender: str = "", secret: bytes = b"") -> SenderStream:
    """Open a stream for transfer `transfer_id` to the receiver at `endpoint` (`secret`: the
    cluster secret, which a grpc:// receiver requires of every call).  The capability
    handshake happens here: TransferRefused(BAD_VERSION) when the two sides share no protocol
    version, TransferRefused(TRANSPORT) when the receiver cannot be reached."""
    config = config or TransportConfig()
    scheme, _, rest = endpoint.partition("://")
    if scheme == "local":
        from kv_transfer.transport.local import LocalStream
        return LocalStream(rest, transfer_id, sender, config.versions)
    if scheme == "shm":
        from kv_transfer.transport.shm import ShmStream
        return ShmStream(rest, transfer_id, config, sender)
    if scheme == "nixl":
        from kv_transfer.transport.nixl import NixlStream
        return NixlStream(rest, transfer_id, config, sender)
    if scheme == "grpc":
        from kv_transfer.transport.grpc_stream import GrpcStream
        return GrpcStream(rest, transfer_id, config, secret, sender)
    raise ValueError(f"transfer endpoint {endpoint!r}: scheme must be local://, shm://, nixl:// or grpc://")


__all__ = ["TransportConfig", "connect"]
