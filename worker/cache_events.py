"""The `CacheEvents` stream of a worker (both roles): what its prefix cache stored and evicted,
for the gateway's prefix-aware routing.

Each message is one msgpack batch of `pool.events` (engine/prefix_cache.CacheEventLog; the
format is in proto/worker.proto): the first is a reset carrying every key cached now, the
rest are deltas (a reset again if the subscriber fell out of the log).  A reset of more than
`max_keys` keys goes out as a reset with the first of them followed by batches that store the
rest, so no message nears gRPC's size limit.  A read waits at most
`wait_s`; when nothing changed for `heartbeat_s` an empty batch goes out, so a subscriber
knows the stream is alive.  The stream ends when the worker stops or the caller cancels.
Every subscriber holds an RPC thread for its whole life: at most `max_subscribers` at once,
more are refused with RESOURCE_EXHAUSTED.  The server's interceptor authenticates the call
like every other RPC (I9).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import msgpack

from engine.prefix_cache import CacheEventLog
from proto import worker_pb2 as wpb

MAX_SUBSCRIBERS = 16     # concurrent CacheEvents streams per worker
WAIT_S = 1.0             # the longest one read of the log blocks (then closing/cancel are checked)
HEARTBEAT_S = 5.0        # an empty batch after this long without changes
MAX_EVENTS = 4096        # events per batch (a larger backlog goes out in several)
MAX_KEYS = 32768         # keys per message (~0.6 MB): a larger reset goes out as the reset and
                         # then batches that store the rest (well under gRPC's 4 MB message limit)


class CacheEventStreams:
    """Serves `CacheEvents` calls from one event log.  Thread-safe."""

    def __init__(self, events: CacheEventLog, closing: Callable[[], bool],
                 max_subscribers: int = MAX_SUBSCRIBERS, wait_s: float = WAIT_S,
                 heartbeat_s: float = HEARTBEAT_S, max_events: int = MAX_EVENTS, max_keys: int = MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`closing()`: True once the worker stops (every stream then ends within `wait_s`, at
        once when the log is closed)."""
        self.events, self.closing = events, closing
        self.max_subscribers = max_subscribers
        self.wait_s, self.heartbeat_s, self.max_events, self.max_keys = wait_s, heartbeat_s, max_events, max_keys
        self.clock = clock
        self._slots = threading.BoundedSemaphore(max_subscribers)
        self._lock = threading.Lock()
        self.subscribers = 0                 # streams open now

    def stream(self, context: grpc.ServicerContext) -> Iterator[wpb.CacheEventBatch]:
        """The batches of one subscriber; aborts with RESOURCE_EXHAUSTED (sending nothing)
        when `max_subscribers` streams are open already."""
        if not self._slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"at most {self.max_subscribers} CacheEvents subscribers per worker")
        with self._lock:
            self.subscribers += 1
        try:
            yield from self._batches(context)
        finally:
            with self._lock:
                self.subscribers -= 1
            self._slots.release()

    def _batches(self, context: grpc.ServicerContext) -> Iterator[wpb.CacheEventBatch]:
        batch, cursor = self.events.since(None, self.max_events)       # the reset
        yield from self._split(batch)
        sent = self.clock()
        while context.is_active():
            changed = self.events.wait(cursor, self.wait_s)
            if self.closing() or self.events.closed:
                return
            if not changed and self.clock() - sent < self.heartbeat_s:
                continue
            batch, cursor = self.events.since(cursor, self.max_events)  # empty: a heartbeat
            yield from self._split(batch)
            sent = self.clock()

    def _split(self, batch: dict) -> Iterator[wpb.CacheEventBatch]:
        """`batch` as messages of at most `max_keys` stored keys: the first keeps its reset
        flag and evictions, the others store the rest (applied in order, the same view)."""
        stored = batch["stored"]
        yield _message({**batch, "stored": stored[:self.max_keys]})
        for i in range(self.max_keys, len(stored), self.max_keys):
            yield _message({**batch, "reset": False, "stored": stored[i:i + self.max_keys], "evicted": []})


def _message(batch: dict) -> wpb.CacheEventBatch:
    return wpb.CacheEventBatch(events=msgpack.packb(batch, use_bin_type=True))
