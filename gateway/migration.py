"""Forwarding one choice, and continuing its stream on another worker pair when the decode
worker fails after a token (migration).

A stream that broke after a token (`StreamBroken`: the worker died or was cut off, it drains or
shuts down, or its step failed) is submitted again with the original prompt, the tokens
already streamed to the client (`generated_token_ids`) and the seed of the reservation whose
stream gave the first token: the new decode worker replays them through its stop checks,
prefill computes their KV, and sampling continues with the generator advanced past the draws
already made, so the client's stream goes on with the next token, exactly.  The client sees
one stream: the same id, no token twice, none missing, usage counted once (the first stream's
cached prompt tokens).

Bounds: at most `max_migrations` per choice; the request's timeout from its start holds across
every attempt; a stream that cannot be continued (the bound, no worker that fits prompt +
max_tokens, the resumed request refused) ends with MIGRATION_FAILED.  Never migrated: a
timeout, a request the worker refused as invalid, a cancelled or aborted one.
"""

from __future__ import annotations

import logging
import time
from typing import AsyncIterator

from engine.errors import ErrorCode
from engine.params import SamplingParams
from gateway.choice import Choice, ForwardError, MigrationObserver, NoObserver, Prompt, StreamBroken
from gateway.forward import stream
from gateway.routing import WorkerPool
from proto import worker_pb2 as wpb
from worker.types import Role

log = logging.getLogger("tandem.gateway")
CAUSES = ("lost", "drain", "error")                    # tandem_migrations_total{cause}
REASONS = ("bound", "capacity", "no_worker", "refused")  # tandem_migrations_failed_total{reason}
# failures of a resumed stream before its first token that keep their own code (and are not
# counted as failed migrations): the request's, not the migration's
OWN_CODES = frozenset({ErrorCode.TIMEOUT, ErrorCode.CANCELLED, ErrorCode.ABORTED})
NO_ROOM = frozenset({ErrorCode.NO_WORKER, ErrorCode.KV_FULL, ErrorCode.DECODE_UNAVAILABLE,
                     ErrorCode.PREFILL_UNAVAILABLE, ErrorCode.DRAINING, ErrorCode.UNAVAILABLE})


async def forward(pool: WorkerPool, request_id: str, tenant: str, ids: list[int], params: SamplingParams,
                  timeout_s: float, max_attempts: int, capacity_wait_s: float = 30.0, prompt: Prompt = Prompt(),
                  max_migrations: int = 3, observer: MigrationObserver | None = None
                  ) -> AsyncIterator[wpb.GenerateResponse]:
    """Yields Tokens messages and a final Finish; raises ForwardError.

    Before the first token: when every decode worker is full (KV_FULL), drains or none is ready
    the request waits for room (up to `capacity_wait_s`) instead of failing; other failures are
    retried on another worker up to `max_attempts` times.  After a token, a broken stream
    migrates (module docstring), at most `max_migrations` times, all within `timeout_s`."""
    c = Choice(pool, request_id, tenant, ids, params, time.monotonic() + timeout_s, max_attempts,
               capacity_wait_s, prompt, observer or NoObserver())
    exclude: set[str] = set()
    migrations = 0
    last_token = 0.0                      # when the last token arrived
    broke = False                         # a migration's stream has not said anything yet
    while True:
        try:
            async for msg in stream(c, exclude):
                now = time.monotonic()
                if broke:
                    c.observer.gap(now - last_token)
                    broke = False
                if msg.WhichOneof("kind") == "tokens":
                    last_token = now
                elif migrations and c.cached_tokens is not None:
                    msg.finish.cached_tokens = c.cached_tokens     # usage: the first stream's
                yield msg
            return
        except StreamBroken as b:
            migrations += 1
            _check(c, b, migrations, max_migrations, exclude)
            c.observer.migrated(b.cause)
            log.warning("request %s: the stream broke after %d tokens (%s: %s); migration %d of at most %d",
                        request_id, len(c.generated), b.cause, b.error.message, migrations, max_migrations)
            exclude, broke = {b.address}, True
        except ForwardError as e:
            if not broke or e.code in OWN_CODES:
                raise
            reason = "no_worker" if e.code in NO_ROOM else "refused"
            c.observer.failed(reason)
            raise ForwardError(ErrorCode.MIGRATION_FAILED, f"the stream broke after {len(c.generated)} tokens and "
                               f"could not be continued ({reason}): {e.code.value}: {e.message}",
                               503 if reason == "no_worker" else 502) from None


def _check(c: Choice, b: StreamBroken, migrations: int, max_migrations: int, exclude: set[str]) -> None:
    """Raises MIGRATION_FAILED when the choice may not migrate again: past the bound, or when
    no decode worker left (other than the one that broke) can hold prompt + max_tokens."""
    if migrations > max_migrations:
        c.observer.failed("bound")
        bound = (f"at most {max_migrations} migrations per choice (--max-migrations)" if max_migrations
                 else "migration is off (--max-migrations 0)")
        raise ForwardError(ErrorCode.MIGRATION_FAILED, f"the stream broke after {len(c.generated)} tokens "
                           f"({b.cause}: {b.error.message}); {bound}", 502) from None
    fit = largest_decode_capacity(c.pool, exclude | {b.address} | c.leaving)
    if 0 < fit < c.need_tokens:
        c.observer.failed("capacity")
        raise ForwardError(ErrorCode.MIGRATION_FAILED, f"the stream broke after {len(c.generated)} tokens "
                           f"({b.cause}); prompt_tokens ({len(c.ids)}) + max_tokens ({c.params.max_tokens}) = "
                           f"{c.need_tokens} exceeds the KV capacity of every other decode worker "
                           f"(largest: {fit} tokens)", 503) from None


def largest_decode_capacity(pool: WorkerPool, exclude: set[str]) -> int:
    """The largest KV capacity (tokens) of a healthy decode-capable worker that is not draining
    and not in `exclude` (0: none known: one may come back, so the choice waits)."""
    return max((w.health.kv_capacity_tokens for w in pool.of(Role.DECODE, Role.COLOCATED)
                if w.health is not None and w.healthy and not w.draining and w.address not in exclude),
               default=0)
