"""Mutual TLS between the processes of a cluster: a cluster CA made at start-up, one short-lived
certificate per process, and the gRPC credentials built from them.

    ca = ClusterCA()                              # `tandem serve` makes a new one at every start
    ident = ca.issue("decode-0", hosts=["10.0.0.7"])
    server.add_secure_port(addr, ident.server_credentials())    # or add_port(server, addr, ident)
    ch = open_channel(addr, ident)                 # refuses a server without a cluster certificate

Every certificate names `SERVER_NAME` as well as its hosts, and clients check that name rather
than the address they dialled (workers are reached by IP, sometimes through an advertised
address): what makes a peer a cluster member is the signature of this cluster's CA, which a
server checks of every client too (`require_client_auth`).  A peer with a certificate from any
other CA fails the handshake.

Keys are EC P-256, never printed (`TlsIdentity`'s repr leaves them out) and written only by
`TlsIdentity.write`, into files of mode 0600.  Torch-free (the gateway uses it).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAME = "tandem.cluster"          # in every certificate's SAN; what clients verify
VALIDITY_S = 30 * 24 * 3600             # a certificate's life: a serve restarted within it re-issues
CLOCK_SLACK_S = 300                     # not-before this far in the past: nodes' clocks differ a little
FILES = ("ca.pem", "cert.pem", "key.pem")


@dataclass(frozen=True)
class TlsIdentity:
    """What one process holds: the cluster CA's certificate (whom to trust), its own
    certificate and its private key (PEM)."""
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes = field(repr=False)

    def server_credentials(self) -> grpc.ServerCredentials:
        """A server's: presents this certificate and requires a client certificate of the CA."""
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A client's: trusts only the cluster CA and presents this certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)

    @property
    def name(self) -> str:
        """The certificate's common name (the worker id it was issued for)."""
        cert = x509.load_pem_x509_certificate(self.cert_pem)
        return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)

    def write(self, directory: str | Path) -> Path:
        """Write ca.pem, cert.pem and key.pem into `directory` (made 0700 if missing), each
        0600, each whole or not at all (written to a temporary name, then renamed)."""
        d = Path(directory)
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        for name, data in zip(FILES, (self.ca_pem, self.cert_pem, self.key_pem)):
            tmp = d / f".{name}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, d / name)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        return d

    @classmethod
    def load(cls, directory: str | Path) -> "TlsIdentity":
        """Read what `write` wrote.  Raises ValueError when a file is missing, is not PEM, or
        the key can be read by anyone but its owner (group or world bits set)."""
        d = Path(directory)
        missing = [n for n in FILES if not (d / n).is_file()]
        if missing:
            raise ValueError(f"TLS directory {d}: missing {', '.join(missing)} (make them with `tandem certs`)")
        mode = stat.S_IMODE((d / "key.pem").stat().st_mode)
        if mode & 0o077:
            raise ValueError(f"{d / 'key.pem'} has mode {mode:o}: a private key must be 0600 (chmod 600 it)")
        ca, cert, key = ((d / n).read_bytes() for n in FILES)
        for name, data in zip(FILES, (ca, cert, key)):
            if b"-----BEGIN " not in data:
                raise ValueError(f"{d / name} is not PEM")
        return cls(ca, cert, key)


class ClusterCA:
    """A certificate authority that lives as long as one deployment's start-up: it signs the
    processes' certificates and nothing else (path length 0).  Its key stays in memory."""

    def __init__(self, validity_s: float = VALIDITY_S, name: str = "tandem cluster CA") -> None:
        if not 0 < validity_s <= 366 * 24 * 3600:
            raise ValueError(f"validity_s={validity_s} must be in (0, one year]")
        self.validity_s = validity_s
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = _now()
        self.cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                     .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(seconds=CLOCK_SLACK_S))
                     .not_valid_after(now + datetime.timedelta(seconds=validity_s))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                                  key_encipherment=False, data_encipherment=False,
                                                  key_agreement=False, key_cert_sign=True, crl_sign=True,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self._key, hashes.SHA256()))
        self.cert_pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def __repr__(self) -> str:
        return f"ClusterCA(serial={self.cert.serial_number:x})"

    def issue(self, name: str, hosts: Iterable[str] = ()) -> TlsIdentity:
        """A certificate and key for the process `name` (a worker id, "gateway"), good as a
        server and as a client, naming SERVER_NAME and `hosts` (IP addresses or DNS names)."""
        if not name or len(name) > 64:
            raise ValueError(f"certificate name {name!r} must be 1..64 characters")
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(seconds=CLOCK_SLACK_S))
                .not_valid_after(now + datetime.timedelta(seconds=self.validity_s))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(_names([SERVER_NAME, *hosts])), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self._key, hashes.SHA256()))
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return TlsIdentity(self.cert_pem, cert.public_bytes(serialization.Encoding.PEM), key_pem)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for h in dict.fromkeys(hosts):              # each once, in order
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def _options(tls: TlsIdentity | None, options: Sequence[tuple[str, Any]] | None) -> list[tuple[str, Any]]:
    opts = list(options or ())
    if tls is not None:
        opts.append(("grpc.ssl_target_name_override", SERVER_NAME))
    return opts


def open_channel(address: str, tls: TlsIdentity | None,
                 options: Sequence[tuple[str, Any]] | None = None) -> grpc.Channel:
    """A synchronous channel to `address`: mutual TLS with `tls`, plaintext when it is None."""
    if tls is None:
        return grpc.insecure_channel(address, options=_options(None, options))
    return grpc.secure_channel(address, tls.channel_credentials(), options=_options(tls, options))


def open_aio_channel(address: str, tls: TlsIdentity | None, options: Sequence[tuple[str, Any]] | None = None,
                     interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None) -> grpc.aio.Channel:
    """The same for asyncio (the gateway's channels)."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=_options(None, options), interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=_options(tls, options),
                                   interceptors=interceptors)


def add_port(server: grpc.Server, address: str, tls: TlsIdentity | None) -> int:
    """Bind `server` to `address` (mutual TLS with `tls`, plaintext when None); the port, 0 when
    the bind failed."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())
