"""The one thread that steps a worker's `EngineCore`, and the interface of the role engines
(prefill, decode) it serves.  Every page ownership change of a worker happens on this thread
or under the worker's lock.

One iteration:

    for role in roles: role.drain()           # commits, aborts, pushes ended (other threads')
    batch  = core.schedule()                   # under the lock
    hook   = role.before_run(batch)            # prefill: start the pushes of finished prompts
    output = core.run(batch, hook)
    events = core.update(batch, output)        # the one token path (under the lock)
    for role in roles: role.after_run(events)  # stream tokens, send commits
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Protocol

from engine.core import EngineCore, LayerHook, TokenEvent
from engine.scheduler import ScheduledBatch
from kv_transfer.hooks import TransferHooks
from worker.drain import Drainable
from worker.stats import LoopWatch

log = logging.getLogger("tandem.worker")


class RoleEngine(Drainable, Protocol):
    """A worker role over a shared `EngineCore` (one core and one lock per worker process).

    Pages: the core's token path frees a request's pages when it finishes; a role frees pages
    only of requests it took out of the scheduler (a reservation not yet admitted, a hand-off
    whose push ended), always on the loop's thread or under the lock, and only once no
    transfer can still write them (decode: after `TransferReceiver.release`)."""

    closing: bool               # set by the handle before stopping: new requests are refused
    counts: Counter[str]        # requests by outcome (submitted, reserved, pushed, finished, failed)

    def drain(self) -> bool:
        """Handle what other threads posted (commits, failures, aborts, ended pushes).  Runs on
        the loop's thread, first in every iteration (at least every `idle_wait_s` while idle).
        Returns whether it did anything."""
        ...

    def before_run(self, batch: ScheduledBatch) -> LayerHook | None:
        """Called before the forward pass of `batch`; may return a per-layer hook."""
        ...

    def after_run(self, events: list[TokenEvent]) -> None:
        """Consume the token path's events for this role's requests (others' are ignored)."""
        ...

    def fail(self, batch: ScheduledBatch, error: BaseException) -> None:
        """The step over `batch` raised (anywhere from before_run to after_run): end this role's
        requests of it that are still live with an explicit error, whatever the token path did
        to them already."""
        ...

    def shutdown(self) -> None:
        """(The loop has stopped) end every live request with an explicit error, free its pages."""
        ...

    def install_hooks(self, hooks: TransferHooks) -> None:
        """Route this role's later transfers through `hooks` (its sending or receiving side)."""
        ...


class WorkerLoop:
    """Steps `core` for `roles` until stopped; sleeps on `wake` (set by whoever posts work)."""

    def __init__(self, core: EngineCore, roles: list[RoleEngine], lock: threading.RLock,
                 wake: threading.Event, idle_wait_s: float = 0.05, watch: LoopWatch | None = None):
        """`watch`: beaten at the start of every iteration (Health reads it to tell a stalled
        loop: a step that does not end, or a loop that stopped)."""
        self.core, self.roles, self.lock, self.wake = core, roles, lock, wake
        self.idle_wait_s = idle_wait_s
        self.watch = watch or LoopWatch()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-loop", daemon=True)

    def start(self) -> WorkerLoop:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.watch.beat()
            try:
                did = self.step()
            except Exception:
                log.exception("engine step failed; its requests ended with an INTERNAL error")
                did = True
            if not did:
                self.wake.wait(self.idle_wait_s)
                self.wake.clear()

    def step(self) -> bool:
        """One iteration.  Returns whether it did any work."""
        did = False
        for role in self.roles:
            did = role.drain() or did
        with self.lock:
            batch = self.core.schedule()
        if batch is None:
            return did
        try:
            hooks = [h for h in (role.before_run(batch) for role in self.roles) if h is not None]
            output = self.core.run(batch, _chain(hooks))
            with self.lock:
                events = self.core.update(batch, output)
            for role in self.roles:
                role.after_run(events)
        except BaseException as e:      # every request of the batch still live ends explicitly
            for role in self.roles:
                role.fail(batch, e)
            raise
        return True

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop after the current step.  Returns whether the thread ended within `timeout_s`."""
        self._stop.set()
        self.wake.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def _chain(hooks: list[LayerHook]) -> LayerHook | None:
    if not hooks:
        return None
    if len(hooks) == 1:
        return hooks[0]

    def call_all(layer: int) -> None:
        for hook in hooks:
            hook(layer)
    return call_all
