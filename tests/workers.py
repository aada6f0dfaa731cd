"""Starting real workers on loopback for tests, and reading a Generate stream."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from engine.options import build
from engine.params import SamplingParams
from kv_transfer import auth
from worker.client import generate
from worker.config import WorkerConfig
from worker.handoff import GenerateOrder
from worker.peers import KnownPeers
from worker.server import WorkerHandle

SECRET = b"tandem-test-cluster-secret-0123"
# the tests' stand-in for the registry: the decode transfer endpoints a test prefill worker may
# push to (start_decode announces each decode worker it starts)
DECODE_ENDPOINTS: set[str] = set()


def start_decode(cfg: WorkerConfig) -> WorkerHandle:
    """A decode worker, announced to the test prefill workers."""
    from decode_worker.server import start_decode_worker
    handle = start_decode_worker(cfg)
    assert handle.transfer_endpoint is not None
    DECODE_ENDPOINTS.add(handle.transfer_endpoint)
    return handle


def start_prefill(cfg: WorkerConfig) -> WorkerHandle:
    """A prefill worker that pushes to the decode workers `start_decode` announced (read again
    on every miss, as a Ray prefill worker reads the registry)."""
    from prefill_worker.server import start_prefill_worker
    return start_prefill_worker(cfg, KnownPeers(fetch=lambda: set(DECODE_ENDPOINTS), refresh_s=0.0))


def channel(address: str, secret: bytes = SECRET) -> grpc.Channel:
    """A channel to a test worker whose calls carry credentials for `secret`."""
    return auth.channel(address, secret)


def module_worker(start: Callable[[WorkerConfig], WorkerHandle], **kw: Any) -> Any:
    """A module-scoped fixture: a worker started by `start(config(**kw))`, stopped after the
    module's tests."""
    @pytest.fixture(scope="module")
    def worker() -> Iterator[WorkerHandle]:
        handle = start(config(**kw))
        yield handle
        handle.stop()
    return worker


def config(**kw: Any) -> WorkerConfig:
    """A test worker's config: WorkerConfig's fields, its engine's among them, by name."""
    kw.setdefault("kv_cache_tokens", 8192)
    return build(WorkerConfig, secret=SECRET, **kw)


@dataclass
class Result:
    token_ids: list[int]
    text: str                 # the streamed text deltas, concatenated
    deltas: list[str]
    finish: object | None     # wpb.Finish
    error: object | None      # wpb.Error
    reservation: object | None
    logprobs: list[dict[int, float]] = field(default_factory=list)   # per token: id -> logprob (chosen + top)


def generate_order(request_id: str, ids: Sequence[int], params: SamplingParams, generated: Sequence[int] = (),
                   timeout_s: float | None = 60.0) -> GenerateOrder:
    """A request of tenant "acme" as a caller orders it (worker.handoff): `.to_proto()` is its
    Generate call, `.prefill_order(reservation).to_proto()` the Prefill call that fills the
    reservation (`dataclasses.replace` it first for a Prefill that lies)."""
    return GenerateOrder(request_id=request_id, tenant="acme", prompt_token_ids=tuple(ids),
                         generated_token_ids=tuple(generated), params=params, cache_salt="", timeout_s=timeout_s)


def run(decode: grpc.Channel, prefill: grpc.Channel | None, rid: str, ids: list[int],
        params: SamplingParams, tenant: str = "acme", cache_salt: str = "",
        generated: Sequence[int] = ()) -> Result:
    """One request's stream, read to its end (`generated`: a migrated request's tokens)."""
    r = Result([], "", [], None, None, None)
    for msg in generate(decode, prefill, rid, tenant, ids, params, timeout_s=120, cache_salt=cache_salt,
                        generated=generated):
        kind = msg.WhichOneof("kind")
        if kind == "reservation":
            r.reservation = msg.reservation
        elif kind == "tokens":
            r.token_ids += list(msg.tokens.token_ids)
            r.deltas.append(msg.tokens.text)
            r.text += msg.tokens.text
            r.logprobs += [{t.token_id: t.logprob for t in lp.top} | {lp.token_id: lp.logprob}
                           for lp in msg.tokens.logprobs]
        elif kind == "finish":
            r.finish = msg.finish
        else:
            r.error = msg.error
    return r


def wait_idle(*handles: WorkerHandle, timeout_s: float = 10.0) -> None:
    """Every worker's pool intact and fully free (I6: cached pages unreferenced, so evictable;
    with kv_audit, every cached page as it was published), waiting for in-flight ends to land."""
    end = time.monotonic() + timeout_s
    for h in handles:
        pool = h.core.pool
        while pool.num_free != pool.num_pages and time.monotonic() < end:
            time.sleep(0.02)
        pool.check_integrity(contents=True)
        assert pool.num_free == pool.num_pages, \
            f"{h.role}: {pool.num_pages - pool.num_free} KV pages still in use"


def prefix_prompts(tokenizer: Any, topic: str, *tails: str) -> tuple[list[int], list[list[int]]]:
    """A long shared prefix about `topic` (unique per test, so no test finds another's cached
    pages) and one prompt per tail, as token ids."""
    prefix = tokenizer.encode(f"system: you answer questions about {topic}. " * 8)
    return prefix, [prefix + tokenizer.encode(t) for t in tails]


def worker_stats(handle: WorkerHandle) -> Any:
    """The worker's Stats reply (wpb.StatsReply), asked over its gRPC service."""
    from proto import worker_pb2 as wpb
    from proto import worker_pb2_grpc as wpb_grpc
    ch = channel(handle.address)
    stub = wpb_grpc.PrefillServiceStub(ch) if handle.role.value == "prefill" else wpb_grpc.DecodeServiceStub(ch)
    return stub.Stats(wpb.StatsRequest())
