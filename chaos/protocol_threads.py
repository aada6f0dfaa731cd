"""Pausing the real receiver where concurrency matters, for `chaos.protocol_model`.

Receiver calls that can stop halfway run on their own threads, and two seams stop them:

    receive:         lock: check, claim | write_payload (gated) | lock: writers -= 1, notify
    release, commit: lock: ... wait_for(writers == 0)            (the receiver's condition, traced)

A call always runs until it settles: finished, parked at the write gate, or waiting on the
receiver's condition with its predicate false.  The model takes one action at a time and looks
at the world only once every call has settled, so the same actions always give the same world.
Calls that cannot stop (a frame for a transfer that is not open, a release or commit with no
write in flight) run to their end on the model's own thread; should one wait after all, the
traced condition raises Hang instead.  Threads are only a means to stop the real code at the
two seams: nothing is timed, HANG_S only bounds how long a broken receiver may stall the model.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator

import kv_transfer.receiver as receiver_module
from engine.kv_pool import PagePool
from kv_transfer.errors import TransferRefused
from kv_transfer.frame import Buffer

if TYPE_CHECKING:
    from chaos.protocol_actions import Action  # protocol_actions imports this module

HANG_S = 5.0
RUNNING, PARKED, WAITING, DONE = "running", "parked", "waiting", "done"
_local = threading.local()


class Hang(RuntimeError):
    """A receiver call neither finished nor settled within HANG_S."""


class Call:
    """One receiver call, on its own thread or the model's; its `status` is kept by the board."""

    def __init__(self, action: Action, fn: Callable[[], object], board: Board, identity: int = 0) -> None:
        self.action, self.label, self.board = action, str(action), board
        self.identity = identity            # frames: the identity byte of the payload
        self.status, self.collected = RUNNING, False
        self.parks = True                   # False: runs on the model's thread, never stops
        self.writes: list[tuple[int, int, int]] = []   # page copies: (pool page, l0, l1)
        self.go = threading.Event()
        self.result: object = None
        self.error: BaseException | None = None
        self._fn = fn

    def on_own_thread(self) -> None:
        _local.call = self
        self.run()

    def run_here(self) -> None:
        self.parks, _local.call = False, self
        try:
            self.run()
        finally:
            _local.call = None

    def run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as e:  # noqa: BLE001 - it is the call's outcome
            self.error = e
        finally:
            self.board.mark(self, DONE)

    @property
    def refused(self) -> bool:
        return isinstance(self.error, TransferRefused)

    @property
    def outcome(self) -> str:
        if self.status != DONE:
            return self.status
        if self.error is None:
            return "ok"
        if isinstance(self.error, TransferRefused):
            return str(getattr(self.error.reason, "value", self.error.reason))
        return f"raised {self.error!r}"


class Board:
    """Which calls are running, parked, waiting or done."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.calls: list[Call] = []

    def start(self, call: Call) -> None:
        self.calls.append(call)
        threading.Thread(target=call.on_own_thread, daemon=True, name=call.label).start()

    def run_here(self, call: Call) -> None:
        """Run `call` to its end on the calling thread (its page copy does not park)."""
        self.calls.append(call)
        call.run_here()

    def mark(self, call: Call, status: str) -> None:
        with self._cv:
            call.status = status
            self._cv.notify_all()

    def settle(self) -> None:
        """Wait until no call is running; raises Hang after HANG_S."""
        with self._cv:
            if not self._cv.wait_for(lambda: all(c.status != RUNNING for c in self.calls), HANG_S):
                running = [c.label for c in self.calls if c.status == RUNNING]
                raise Hang(f"calls {running} still running after {HANG_S}s")

    def live(self) -> list[Call]:
        return [c for c in self.calls if c.status != DONE]

    def resume(self, call: Call) -> None:
        """Let a parked call's page copy run, and wait until every call settles again."""
        self.mark(call, RUNNING)
        call.go.set()
        self.settle()

    def drain(self) -> None:
        """Let every parked call finish, so no thread outlives its world; raises Hang."""
        while parked := [c for c in self.calls if c.status == PARKED]:
            self.resume(parked[0])


class TracedCondition(threading.Condition):
    """The receiver's lock, telling the board when a call starts waiting and when it is woken."""

    def __init__(self) -> None:
        super().__init__()
        self._sleepers: list[Call] = []

    def wait(self, timeout: float | None = None) -> bool:
        call = getattr(_local, "call", None)
        if call is None or not call.parks:
            raise Hang("a call the model expected to finish at once waits: nothing could wake it")
        self._sleepers.append(call)
        call.board.mark(call, WAITING)
        woken = super().wait(timeout)
        if call in self._sleepers:      # timed out, not notified
            self._sleepers.remove(call)
        return woken

    def notify(self, n: int = 1) -> None:   # notify_all calls notify(all waiters)
        woken, self._sleepers = self._sleepers[:n], self._sleepers[n:]
        for call in woken:
            call.board.mark(call, RUNNING)
        super().notify(n)


@contextmanager
def gated_writes() -> Iterator[None]:
    """While open, a model call's page copy in `TransferReceiver.receive` parks until its
    `go` is set (on the call's own thread), and is recorded in `call.writes`."""
    real = receiver_module.write_payload

    def gated(pool: PagePool, page: int, l0: int, l1: int, n: int, payload: Buffer) -> None:
        call = getattr(_local, "call", None)
        if call is not None and call.parks:
            call.board.mark(call, PARKED)
            if not call.go.wait(HANG_S):
                raise Hang(f"{call.label}: write gate never opened")
        real(pool, page, l0, l1, n, payload)
        if call is not None:
            call.writes.append((page, l0, l1))

    receiver_module.write_payload = gated
    try:
        yield
    finally:
        receiver_module.write_payload = real
