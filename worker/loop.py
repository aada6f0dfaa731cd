"""The one thread that steps a worker's `EngineCore` for its role engines (prefill, decode:
the interface is `worker.role.RoleEngine`).  Every page ownership change of a worker happens on
this thread or under the worker's lock.

One iteration:

    for role in roles: role.handle_inbox()    # commits, aborts, pushes ended (other threads')
    batch  = core.schedule()                   # under the lock
    hook   = role.before_run(batch)            # prefill: start the pushes of finished prompts
    output = core.run(batch, hook)
    events = core.update(batch, output)        # the one token path (under the lock)
    for role in roles: role.after_run(events)  # stream tokens, send commits
"""

from __future__ import annotations

import logging
import threading

from engine.core import EngineCore, LayerHook
from worker.role import RoleEngine
from worker.stats import LoopWatch

log = logging.getLogger("tandem.worker")


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
            did = role.handle_inbox() or did
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
