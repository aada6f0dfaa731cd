"""The `Stats` and `Health` replies of a worker, read from its engine, and the watch that tells
Health whether the worker's loop still makes progress."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from engine.core import EngineCore
from proto import worker_pb2 as wpb
from worker.config import STEP_DEADLINE_S
from worker.types import Role

log = logging.getLogger("tandem.worker")


class LoopWatch:
    """When the worker loop last began an iteration.  The loop (`worker.loop.WorkerLoop`) calls
    `beat` at the start of every iteration, before each role's `handle_inbox`, and iterates at
    least every `idle_wait_s` while idle, so the time since the last beat is how long the
    current iteration (one step) has run.  Longer than `deadline_s`, the worker is stalled (a
    step that does not end, or a loop that stopped) and Health says not ready, so the gateway
    stops routing to it; the next iteration makes it ready again."""

    def __init__(self, deadline_s: float = STEP_DEADLINE_S, clock: Callable[[], float] = time.monotonic):
        self.deadline_s, self.clock = deadline_s, clock
        self._last = clock()
        self._stalled = False

    def beat(self) -> None:
        """(the loop's thread) an iteration begins."""
        self._last = self.clock()
        if self._stalled:
            self._stalled = False
            log.warning("the worker loop makes progress again: ready")

    def stalled_s(self) -> float | None:
        """Seconds since the current iteration began when that is over the deadline, else None."""
        since = self.clock() - self._last
        if since <= self.deadline_s:
            return None
        if not self._stalled:
            self._stalled = True
            log.error("the worker loop has not finished a step for %.1f s (deadline %.1f s): not ready",
                      since, self.deadline_s)
        return since


class CacheCounts:
    """A role's prefix-cache lookups: prompt tokens looked up and tokens found cached.
    Thread-safe (RPC threads and the loop's count)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.query_tokens = 0
        self.hit_tokens = 0

    def count(self, prompt_tokens: int, cached_tokens: int) -> None:
        with self._lock:
            self.query_tokens += prompt_tokens
            self.hit_tokens += cached_tokens


def health(core: EngineCore, role: Role, stalled_s: float | None = None, draining: bool = False) -> wpb.HealthReply:
    """`stalled_s` (see `LoopWatch.stalled_s`): not None makes the reply not ready.  `draining`:
    the worker admits nothing new (worker/drain.py); callers route elsewhere."""
    # the checkpoint's directory name, not its path: Health tells callers nothing about the host
    return wpb.HealthReply(ready=stalled_s is None, role=role.value, model=Path(str(core.config.model)).name,
                           max_model_len=core.max_model_len, kv_capacity_tokens=core.pool.capacity_tokens,
                           paged_experts_num_resident=core.config.paged_experts_num_resident or 0,
                           kv_page_size=core.pool.page_size, prefix_cache=core.config.enable_prefix_cache,
                           draining=draining)


def stats(core: EngineCore, role: Role, running: int, waiting: int, waiting_tokens: int = 0,
          accepted: int = 0, refused: dict[str, int] | None = None, finished: int = 0,
          failed: int = 0, unauthenticated: int = 0, cache: CacheCounts | None = None,
          transfer_bytes: int = 0, draining: bool = False, drained: int = 0) -> wpb.StatsReply:
    """`cache`: the role's prefix-cache lookups (a colocated worker: its decode role's, one per
    request); `transfer_bytes`: KV payload bytes its receiver accepted (decode); `draining` and
    `drained` (requests a drain ended with DRAINING): worker/drain.py."""
    pool = core.pool
    size = pool.page_size
    reply = wpb.StatsReply(
        role=role.value, running=running, waiting=waiting, waiting_tokens=waiting_tokens,
        kv_pages_free=pool.num_free, kv_pages_used=pool.num_used, kv_pages_capacity=pool.num_pages,
        kv_tokens_free=pool.num_free * size, kv_tokens_used=pool.num_used * size,
        kv_tokens_capacity=pool.capacity_tokens, transfers_accepted=accepted,
        requests_finished=finished, requests_failed=failed, rpc_unauthenticated=unauthenticated,
        cache_query_tokens=cache.query_tokens if cache else 0, cache_hit_tokens=cache.hit_tokens if cache else 0,
        kv_pages_cached=pool.num_cached, kv_pages_evictable=pool.num_evictable, cache_evictions=pool.evictions,
        transfer_bytes_accepted=transfer_bytes, draining=draining, requests_drained=drained)
    reply.transfers_refused.update(refused or {})
    paged = core.expert_stats()
    for layer, fmt in core.expert_formats().items():    # every MoE layer; counters where paged
        c = paged.get(layer, {})
        reply.experts.append(wpb.ExpertLayerStats(layer=layer, hits=c.get("hits", 0), misses=c.get("misses", 0),
                                                  bytes_paged=c.get("bytes_paged", 0), waves=c.get("waves", 0),
                                                  format=fmt, paged=layer in paged))
    return reply
