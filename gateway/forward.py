"""Forwarding one choice: a loop over attempts, each on one worker pair (gateway/attempt.py),
until one ends with the choice's Finish.

Before a stream's first token a failed attempt is followed by another (`Picker` picks its
pair from what the earlier attempts said, the error table deciding, gateway/errors.py): after a
decode worker that had no room (KV_FULL: asked again after a wait) or is leaving (DRAINING,
UNAVAILABLE: never asked again for this choice), that could not be reached, a prefill worker
that could not be reached or is leaving, a push that broke (on another prefill worker if there
is one, else on the same).  While no worker can be picked (one restarting, none with room) the
choice waits, up to the queue timeout.  After a token, a stream that broke migrates
(gateway/migration.py): the next attempt continues it on another pair.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from engine.errors import ErrorCode
from gateway.attempt import Attempt
from gateway.choice import Choice
from gateway.errors import ForwardError, Next
from gateway.migration import migrate, resume_failed
from gateway.outcome import Broken, Failed, Retry
from gateway.prefill_only import PrefillOnlyAttempt
from gateway.route import Route
from gateway.routing import Worker
from proto import worker_pb2 as wpb
from worker.types import Role

CAPACITY_POLL_S = 0.05


async def forward(choice: Choice, route: Route) -> AsyncIterator[wpb.Tokens]:
    """Yields each Tokens message of `choice` as the decode workers stream it (recorded in the
    choice first), until its Finish (`choice.finish`); raises ForwardError.

    Before a stream's first token, failed attempts are retried on other pairs, up to
    `route.max_attempts`, waiting up to `route.capacity_wait_s` for a worker with room; after a
    token, a broken stream migrates, at most `route.max_migrations` times; all within the
    request's deadline."""
    picker, resuming = Picker(choice, route), False   # resuming: a migrated stream said nothing yet
    last_token = 0.0                                  # when the last token arrived
    while True:
        attempt = await _next_attempt(picker, resuming)
        async for msg in attempt.run():
            now = time.monotonic()
            if resuming:
                route.observer.gap(now - last_token)
                resuming = False
            if msg.WhichOneof("kind") == "tokens":
                last_token = now
                yield msg.tokens
        outcome = attempt.outcome
        if isinstance(outcome, Retry):
            picker.retry(attempt.decode, outcome)
        elif isinstance(outcome, Broken):
            migrate(choice, route, outcome)           # raises MIGRATION_FAILED when it may not
            picker, resuming = Picker(choice, route), True
        elif isinstance(outcome, Failed):
            raise resume_failed(choice, route, outcome.error) if resuming else outcome.error
        else:
            return                                    # Finished


async def _next_attempt(picker: Picker, resuming: bool) -> Attempt | PrefillOnlyAttempt:
    """The next attempt of the stream; raises ForwardError when none may succeed (after a
    migration, as MIGRATION_FAILED unless the request's own end)."""
    try:
        decode, prefill = await picker.pair()
        if decode.role == Role.PREFILL:           # a prefill-only choice on a prefill worker
            return PrefillOnlyAttempt(picker.choice, picker.route, decode, picker.route.remaining_s())
        return Attempt(picker.choice, picker.route, decode, prefill, picker.route.remaining_s())
    except ForwardError as e:
        if not resuming:
            raise
        raise resume_failed(picker.choice, picker.route, e) from None


class Picker:
    """The worker pairs of one stream's attempts before its first token, from what the earlier
    attempts said: the workers not to ask again (`tried`), those that had no room (`full`:
    asked again after a wait), the prefill workers whose push broke (`last_resort`), how many
    attempts failed, and until when the stream may wait for a worker."""

    def __init__(self, choice: Choice, route: Route) -> None:
        self.choice, self.route = choice, route
        self.tried = set(choice.leaving) | ({choice.broken_on} if choice.broken_on else set())
        self.full: set[str] = set()
        self.last_resort: set[str] = set()
        self.failures = 0
        self.last = ForwardError(ErrorCode.NO_WORKER, "no worker can take the request now")
        self.wait_until = time.monotonic() + route.capacity_wait_s
        self.waiting_since: float | None = None   # when no worker could be picked, since the last pick

    async def pair(self) -> tuple[Worker, Worker | None]:
        """The next attempt's decode worker and (unless it is colocated) prefill worker.  While
        none can be picked it waits, up to `capacity_wait_s`, after a failure that says the
        cluster has no worker or room now, or a broken push (`_may_wait`; after any, for a
        migrating choice: its new worker may have died during the re-prefill, and Ray starts it
        again at a new address).  Raises
        ForwardError: the last failure, NO_WORKER, or TIMEOUT."""
        while self.failures < self.route.max_attempts:
            self.route.remaining_s()
            decode, prefill = self._pick()
            if decode is not None:
                self.waiting_since = None
                return decode, prefill
            if not self._may_wait() or time.monotonic() > self.wait_until:
                break
            self.waiting_since = self.waiting_since or time.monotonic()
            self.tried -= self.full | (self._answered_since(self.waiting_since) - self.choice.leaving)
            self.full.clear()
            await asyncio.sleep(CAPACITY_POLL_S)
        raise self.last

    def _may_wait(self) -> bool:
        """Whether, with no pair to try now, the stream waits for one: after a failure that says
        the cluster has no worker or room now; after a broken push (the table's `excludes_decode`:
        the decode worker it went to may have died, and Ray starts it again); after any, for a
        migrating choice."""
        policy = self.last.policy
        return policy.no_room or policy.excludes_decode or bool(self.choice.token_ids)

    def retry(self, decode: Worker, retry: Retry) -> None:
        """An attempt on `decode` ended with `retry`."""
        self.last = retry.error
        self.tried |= retry.exclude
        if retry.last_resort is not None:
            self.last_resort.add(retry.last_resort)
        if retry.error.policy.before_token is Next.WAIT:
            self.full.add(decode.address)
        elif retry.error.policy.counts:
            self.failures += 1

    def _answered_since(self, since: float) -> set[str]:
        """Tried workers whose Health answered after `since`: one that failed a try and is up
        again (restarted at the same address) may be tried again while the choice waits."""
        return {w.address for w in self.route.pool.workers if w.address in self.tried and w.answered_at > since}

    def _pick(self) -> tuple[Worker | None, Worker | None]:
        """A decode worker and (unless it is colocated) a prefill worker, or (None, None) and
        `last` says why.  A prefill-only choice: a prefill worker alone (as the first), or a
        colocated worker."""
        c, pool = self.choice, self.route.pool
        prompt_tokens = len(c.prompt_ids) + len(c.token_ids)
        if c.params.prefill_only:                # a prefill worker alone, else a colocated one
            alone = pool.pick_prefill(self.tried, c.prompt.keys, prompt_tokens)
            if alone is not None:
                return alone, None
        decode = pool.pick_decode(c.need_tokens, self.tried, c.prompt.keys)
        if decode is None or decode.role != Role.DECODE:
            return decode, None
        prefill = (pool.pick_prefill(self.tried | self.last_resort, c.prompt.keys, prompt_tokens)
                   or pool.pick_prefill(self.tried, c.prompt.keys, prompt_tokens))
        if prefill is None:                      # none up (one restarting?): wait, as for KV room
            if self.last.code != ErrorCode.NO_WORKER:
                self.last = ForwardError(ErrorCode.NO_WORKER, f"no prefill worker is available (before: "
                                         f"{self.last.code}: {self.last.message})")
            return None, None
        return decode, prefill
