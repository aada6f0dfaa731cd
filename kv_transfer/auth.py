"""Authentication of every worker RPC (I9): a call proves knowledge of the cluster secret.

Each call carries three metadata entries:

    tandem-auth-ts     the caller's clock, milliseconds since the epoch
    tandem-auth-nonce  16 random bytes, hex
    tandem-auth-mac    HMAC-SHA256(rpc_key, method | ts | nonce), hex

where `rpc_key = HMAC-SHA256(cluster secret, "tandem-rpc-auth")`, a key of its own so that
an RPC credential and a frame's ownership tag (`frame.ownership_tag`) never share one.  The
server's interceptor (`AuthInterceptor`) checks the MAC, a clock skew of at most `skew_s`, and
that the nonce was not seen within the window; anything else is aborted with UNAUTHENTICATED
before the handler runs, so a refused call changes no state.  Torch-free: the gateway's
channels use `aio_interceptors`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import grpc
import grpc.aio

from kv_transfer.frame import check_secret
from kv_transfer.tls import TlsIdentity, open_channel

TS_KEY = "tandem-auth-ts"
NONCE_KEY = "tandem-auth-nonce"
MAC_KEY = "tandem-auth-mac"
SKEW_S = 30.0                 # the most a caller's clock may differ from the server's
REPLAY_CAP = 1 << 16          # nonces remembered at most (the oldest go first)


def rpc_key(secret: bytes) -> bytes:
    """The key RPC credentials are made with, derived from the cluster secret."""
    return hmac.new(check_secret(secret), b"tandem-rpc-auth", hashlib.sha256).digest()


def _mac(key: bytes, method: str, ts: str, nonce: str) -> str:
    return hmac.new(key, f"{method}|{ts}|{nonce}".encode(), hashlib.sha256).hexdigest()


def credentials(key: bytes, method: str, now_ms: int | None = None,
                nonce: str | None = None) -> list[tuple[str, str]]:
    """The metadata that authenticates one call of `method` ("/pkg.Service/Method")."""
    ts = str(int(time.time() * 1000) if now_ms is None else now_ms)
    nonce = nonce or secrets.token_hex(16)
    return [(TS_KEY, ts), (NONCE_KEY, nonce), (MAC_KEY, _mac(key, method, ts, nonce))]


class Verifier:
    """Checks credentials: MAC, clock skew, replay.  Thread-safe; bounded memory (nonces are
    kept for twice the skew, at most `cap` of them)."""

    def __init__(self, secret: bytes, skew_s: float = SKEW_S, cap: int = REPLAY_CAP) -> None:
        self._key = rpc_key(secret)
        self.skew_s = skew_s
        self._cap = cap
        self._seen: OrderedDict[str, float] = OrderedDict()   # nonce -> when it expires
        self._lock = threading.Lock()
        self.refused = 0

    def check(self, method: str, metadata: Any) -> str | None:
        """None when the call is authentic, else why not (and the refusal is counted)."""
        why = self._why(method, dict(metadata or ()))
        if why is not None:
            self.count_refusal()
        return why

    def count_refusal(self) -> None:
        """Count one refusal made elsewhere (a shared-memory peer refused for its uid)."""
        with self._lock:
            self.refused += 1

    def _why(self, method: str, md: dict[str, Any]) -> str | None:
        ts, nonce, mac = md.get(TS_KEY), md.get(NONCE_KEY), md.get(MAC_KEY)
        if not (isinstance(ts, str) and isinstance(nonce, str) and isinstance(mac, str)):
            return "missing credentials"
        if not hmac.compare_digest(mac, _mac(self._key, method, ts, nonce)):
            return "bad credentials"
        try:
            skew = abs(time.time() - int(ts) / 1000)
        except ValueError:
            return "bad credentials"
        if skew > self.skew_s:
            return f"credentials outside the {self.skew_s:.0f} s clock window"
        return self._remember(nonce)

    def _remember(self, nonce: str) -> str | None:
        now = time.monotonic()
        with self._lock:
            while self._seen and (len(self._seen) >= self._cap or next(iter(self._seen.values())) < now):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return "replayed credentials"
            self._seen[nonce] = now + 2 * self.skew_s
        return None


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call whose credentials `verifier` does not accept,
    before its handler runs."""

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        why = self.verifier.check(details.method, details.invocation_metadata)
        if why is None:
            return continuation(details)
        return _refusal(continuation(details), why)


def _refusal(handler: Any, why: str) -> Any:
    """A handler of the same kind as `handler` that aborts with UNAUTHENTICATED."""
    def abort(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


def _with_credentials(key: bytes, d: Any) -> _Details:
    md = list(d.metadata or ()) + credentials(key, d.method)
    return _Details(d.method, d.timeout, md, d.credentials, d.wait_for_ready, d.compression)


class ClientAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Attaches fresh credentials to every call of a synchronous channel."""

    def __init__(self, secret: bytes) -> None:
        self._key = rpc_key(secret)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_credentials(self._key, details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_credentials(self._key, details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(_with_credentials(self._key, details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(_with_credentials(self._key, details), request_iterator)


def _method(details: Any) -> str:
    m = details.method
    return m.decode() if isinstance(m, bytes) else str(m)


def _aio_details(key: bytes, d: Any) -> grpc.aio.ClientCallDetails:
    md = grpc.aio.Metadata(*(d.metadata or ()), *credentials(key, _method(d)))
    return grpc.aio.ClientCallDetails(d.method, d.timeout, md, d.credentials, d.wait_for_ready)


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, key: bytes) -> None:
        self._key = key

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_aio_details(self._key, details), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, key: bytes) -> None:
        self._key = key

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_aio_details(self._key, details), request)


def aio_interceptors(secret: bytes) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for `grpc.aio.insecure_channel(..., interceptors=...)` that attach fresh
    credentials to every unary-unary and unary-stream call (what the gateway makes)."""
    key = rpc_key(secret)
    return [_AioUnaryUnary(key), _AioUnaryStream(key)]


def channel(address: str, secret: bytes, options: Any = None, tls: TlsIdentity | None = None) -> grpc.Channel:
    """A synchronous channel to `address` whose every call carries credentials (over mutual
    TLS with `tls`, the caller's cluster certificate, when given)."""
    return grpc.intercept_channel(open_channel(address, tls, options), ClientAuth(secret))
