"""Continuing a choice's stream on another worker pair when it broke after a token (migration):
whether it may (`migrate`), and what a resumed stream that cannot go on ends with
(`resume_failed`).

A stream that broke after a token (`Broken`: the worker died or was cut off, it drains or
shuts down, or its step failed; the error table says which failures migrate, and why) is
submitted again with the original prompt, the tokens already streamed to the client
(`generated_token_ids`) and the seed of the reservation whose stream gave the first token: the
new decode worker replays them through its stop checks, prefill computes their KV, and
sampling continues with the generator advanced past the draws already made, so the client's
stream goes on with the next token, exactly.  The client sees one stream: the same id, no
token twice, none missing, usage counted once (the first stream's cached prompt tokens).

Bounds: at most `max_migrations` per choice; the request's timeout from its start holds across
every attempt; a stream that cannot be continued (the bound, no worker that fits prompt +
max_tokens, the resumed request refused) ends with MIGRATION_FAILED.  Never migrated: a
timeout, a request the worker refused as invalid, a cancelled or aborted one.
"""

from __future__ import annotations

import logging

from engine.errors import ErrorCode
from gateway.choice import Choice
from gateway.errors import ForwardError, MigrationFailure, policy
from gateway.outcome import Broken
from gateway.route import Route
from gateway.routing import WorkerPool
from worker.types import Role

log = logging.getLogger("tandem.gateway")


def migrate(choice: Choice, route: Route, broken: Broken) -> None:
    """Counts and reports the migration of `choice` after `broken`; raises MIGRATION_FAILED
    when the choice may not migrate again: past the bound, or when no decode worker left
    (other than the ones its stream broke on) can hold prompt + max_tokens."""
    choice.migrations += 1
    _check_bound(choice, route, broken)
    _check_capacity(choice, route, broken)
    route.observer.migrated(broken.cause)
    log.warning("request %s: the stream broke after %d tokens (%s: %s); migration %d of at most %d",
                route.choice_id(choice), len(choice.token_ids), broken.cause, broken.error.message,
                choice.migrations, route.max_migrations)
    choice.broken_on = broken.address


def resume_failed(choice: Choice, route: Route, error: ForwardError) -> ForwardError:
    """What a resumed stream that failed before its first message ends with: the request's own
    end (timeout, cancel, abort) keeps its code; anything else is MIGRATION_FAILED, counted by
    reason: NO_WORKER (no worker or no room now: 503) or REFUSED (502)."""
    if error.policy.own:
        return error
    reason = MigrationFailure.NO_WORKER if error.policy.no_room else MigrationFailure.REFUSED
    route.observer.failed(reason)
    return _migration_failed(f"the stream broke after {len(choice.token_ids)} tokens and could not be continued "
                             f"({reason}): {error.code.value}: {error.message}", no_room=error.policy.no_room)


def _check_bound(choice: Choice, route: Route, broken: Broken) -> None:
    if choice.migrations <= route.max_migrations:
        return
    route.observer.failed(MigrationFailure.BOUND)
    bound = (f"at most {route.max_migrations} migrations per choice (--max-migrations)" if route.max_migrations
             else "migration is off (--max-migrations 0)")
    raise _migration_failed(f"the stream broke after {len(choice.token_ids)} tokens ({broken.cause}: "
                            f"{broken.error.message}); {bound}")


def _check_capacity(choice: Choice, route: Route, broken: Broken) -> None:
    exclude = {broken.address} | choice.leaving | ({choice.broken_on} if choice.broken_on else set())
    fit = largest_decode_capacity(route.pool, exclude)
    if not 0 < fit < choice.need_tokens:
        return
    route.observer.failed(MigrationFailure.CAPACITY)
    raise _migration_failed(f"the stream broke after {len(choice.token_ids)} tokens ({broken.cause}); "
                            f"prompt_tokens ({choice.prompt_tokens}) + max_tokens ({choice.params.max_tokens}) = "
                            f"{choice.need_tokens} exceeds the KV capacity of every other decode worker "
                            f"(largest: {fit} tokens)", no_room=True)


def _migration_failed(message: str, no_room: bool = False) -> ForwardError:
    """MIGRATION_FAILED; one for want of room is answered as NO_WORKER is (503, retry later)."""
    return ForwardError(ErrorCode.MIGRATION_FAILED, message, policy(ErrorCode.NO_WORKER).status if no_room else None)


def largest_decode_capacity(pool: WorkerPool, exclude: set[str]) -> int:
    """The largest KV capacity (tokens) of a healthy decode-capable worker that is not draining
    and not in `exclude` (0: none known: one may come back, so the choice waits)."""
    return max((w.health.kv_capacity_tokens for w in pool.of(Role.DECODE, Role.COLOCATED)
                if w.health is not None and w.healthy and not w.draining and w.address not in exclude),
               default=0)
