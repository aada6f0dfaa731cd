"""Mutual TLS between the processes of a cluster (kv_transfer/tls.py): a transfer and a worker
RPC go through when both sides hold certificates of one cluster CA; a peer with a certificate
of another CA, without one, or in plaintext is refused at the handshake, before any call runs;
keys are written 0600 and never printed."""

from __future__ import annotations

import os
import stat

import grpc
import pytest

from kv_transfer.auth import channel
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.receiver import TransferReceiver
from kv_transfer.tls import ClusterCA, TlsIdentity
from kv_transfer.transport import TransportConfig, connect, grpc_stream
from kv_transfer.transport.grpc_server import GrpcTransferServer
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from tests.kv_helpers import SECRET, make_pool
from tests.workers import SECRET as WORKER_SECRET
from tests.workers import config, start_decode

CA = ClusterCA()
SERVER, CLIENT = CA.issue("decode-0", hosts=["127.0.0.1"]), CA.issue("prefill-0")
FOREIGN = ClusterCA().issue("prefill-0")          # same name, another CA


@pytest.fixture
def tls_receiver():
    dst = make_pool(16, seed=2)
    recv = TransferReceiver(dst, SECRET, timeout_s=30)
    server = GrpcTransferServer(recv, config=TransportConfig(tls=SERVER), secret=SECRET)
    yield server, recv, dst
    server.stop()
    grpc_stream.close_channels()
    assert dst.num_free == dst.num_pages


def test_a_sender_of_the_cluster_ca_completes_the_handshake(tls_receiver):
    server, recv, _ = tls_receiver
    stream = connect(server.endpoint, b"t" * 16, TransportConfig(tls=CLIENT), secret=SECRET)
    stream.close()
    assert server.auth.refused == 0


@pytest.mark.parametrize("client", ["foreign CA", "plaintext", "no client certificate"])
def test_a_sender_without_a_cluster_certificate_is_refused_at_the_handshake(tls_receiver, client):
    server, recv, dst = tls_receiver
    config = {"foreign CA": TransportConfig(tls=FOREIGN, deadline_s=5),
              "plaintext": TransportConfig(deadline_s=5)}.get(client)
    if config is None:        # trusts the cluster CA, presents nothing: the server requires a certificate
        target = server.endpoint.removeprefix("grpc://")
        creds = grpc.ssl_channel_credentials(root_certificates=CA.cert_pem)
        ch = grpc.secure_channel(target, creds, options=[("grpc.ssl_target_name_override", "tandem.cluster")])
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/tandem.kv.KvTransfer/Handshake")(b"", timeout=5)
        ch.close()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    else:
        with pytest.raises(TransferRefused) as e:
            connect(server.endpoint, b"t" * 16, config, secret=SECRET)
        assert e.value.reason == Refusal.TRANSPORT
    assert server.auth.refused == 0          # no call ever reached the interceptor
    assert recv.open_transfers == 0 and dst.num_free == dst.num_pages


def test_a_sender_refuses_a_receiver_of_another_ca():
    dst = make_pool(16, seed=2)
    recv = TransferReceiver(dst, SECRET, timeout_s=30)
    server = GrpcTransferServer(recv, config=TransportConfig(tls=ClusterCA().issue("decode-0")), secret=SECRET)
    try:
        with pytest.raises(TransferRefused) as e:
            connect(server.endpoint, b"t" * 16, TransportConfig(tls=CLIENT, deadline_s=5), secret=SECRET)
        assert e.value.reason == Refusal.TRANSPORT
    finally:
        server.stop()
        grpc_stream.close_channels()


def test_a_worker_with_a_certificate_serves_its_rpcs_over_mutual_tls_only():
    """The decode worker's RPC and transfer servers both run TLS: an authenticated call over a
    cluster certificate answers; the same credentials over plaintext or a foreign certificate
    never reach the service."""
    handle = start_decode(config(max_model_len=512, tls=CA.issue("decode-1", hosts=["127.0.0.1"])))
    try:
        assert handle.transfer_endpoint is not None and handle.transfer_endpoint.startswith("grpc://")
        with channel(handle.address, WORKER_SECRET, tls=CLIENT) as ch:
            reply = wpb_grpc.DecodeServiceStub(ch).Stats(wpb.StatsRequest(), timeout=30)
        assert reply.kv_tokens_capacity >= 512
        for tls in (None, FOREIGN):
            with channel(handle.address, WORKER_SECRET, tls=tls) as ch:
                with pytest.raises(grpc.RpcError) as e:
                    wpb_grpc.DecodeServiceStub(ch).Stats(wpb.StatsRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert handle.counts()["unauthenticated"] == 0
        with pytest.raises(TransferRefused):        # its transfer server: TLS as well
            connect(handle.transfer_endpoint, b"t" * 16, TransportConfig(deadline_s=5), secret=WORKER_SECRET)
    finally:
        handle.stop()
        grpc_stream.close_channels()


def test_identities_are_written_0600_and_keys_never_printed(tmp_path):
    ident = CA.issue("gateway-0")
    d = ident.write(tmp_path / "certs" / "gateway-0")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for name in ("ca.pem", "cert.pem", "key.pem"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600
    assert not [p for p in d.iterdir() if p.name.startswith(".")]      # no temporary file left
    loaded = TlsIdentity.load(d)
    assert loaded == ident and loaded.name == "gateway-0"
    assert b"PRIVATE KEY" in ident.key_pem and "PRIVATE" not in repr(ident) and "key_pem" not in repr(ident)
    os.chmod(d / "key.pem", 0o644)
    with pytest.raises(ValueError, match="must be 0600"):
        TlsIdentity.load(d)
    (d / "key.pem").unlink()
    with pytest.raises(ValueError, match="missing key.pem"):
        TlsIdentity.load(d)


def test_a_certificate_names_the_cluster_and_its_hosts():
    from cryptography import x509
    cert = x509.load_pem_x509_certificate(SERVER.cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "tandem.cluster" in san.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert cert.issuer == CA.cert.subject
    with pytest.raises(ValueError):
        CA.issue("")

