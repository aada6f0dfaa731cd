"""`RoleEngine`: the interface the worker loop drives (worker/loop.py) and a graceful drain
ends (worker/drain.py), and the base both role engines share (prefill_worker/engine.py,
decode_worker/engine.py; a colocated worker runs the two over one core, one lock, one loop).

Threads: RPC handlers admit requests (`submit`, `reserve`) under the worker's lock; everything
else other threads have to say — a commit, a failed transfer, an abort, a push that ended — is
posted to the role's inbox and handled on the loop's thread (`handle_inbox`).

Who frees which pages when (DESIGN I5, I6):
- the core's token path (`EngineCore.update`, `accept_token`) frees a request that finishes
  (stop, length, or a stop check past its budget) at once;
- a hand-off request (prefill for another worker) is detached after its first token with its
  pages kept: the prefill role releases them once its push has ended, acknowledged or failed
  (the pusher reports it through the inbox; it never frees a page itself);
- a decode reservation is made outside the scheduler (`EngineCore.allocate_for`): the decode
  role releases it when the request ends before it joined the decode batch, and any request it
  ends itself, always after `TransferReceiver.release` (no frame can still write its pages);
- a role releases pages only through `EngineCore.release(req)`, on the loop's thread or under
  the lock, and never calls the pool (it reads page tables).
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections import Counter
from typing import Generic, TypeVar

from engine.core import EngineCore, LayerHook, TokenEvent
from engine.errors import ErrorCode
from engine.scheduler import ScheduledBatch
from kv_transfer.hooks import TransferHooks
from worker.stats import CacheCounts
from worker.types import WorkerError

Item = TypeVar("Item")


class RoleEngine(ABC, Generic[Item]):
    """A worker role over a shared `EngineCore`, with an inbox of `Item`s."""

    def __init__(self, core: EngineCore, lock: threading.RLock, wake: threading.Event) -> None:
        self.core, self.lock, self.wake = core, lock, wake
        self.pool = core.pool                 # read only: page tables, sizes, cache events
        self.closing = False                  # set by the handle before stopping: new requests are refused
        self.draining = False                 # start_drain() .. undrain(): new requests are refused (DRAINING)
        self.counts: Counter[str] = Counter()  # requests by outcome (submitted, reserved, pushed,
        #                                        finished, failed, drained)
        self.cache = CacheCounts()            # its prefix-cache lookups (prompt tokens, hits)
        self._inbox: queue.SimpleQueue[Item] = queue.SimpleQueue()

    # ---- admission (RPC threads) -----------------------------------------------------
    def _check_admitting(self) -> None:
        """Raises WorkerError (UNAVAILABLE while closing, DRAINING while draining).  Admission
        calls it first and again under the lock, where a drain that began meanwhile is seen."""
        if self.closing:
            raise WorkerError(ErrorCode.UNAVAILABLE, "the worker is shutting down")
        if self.draining:
            raise WorkerError(ErrorCode.DRAINING, "the worker is draining: send the request to another worker")

    def start_drain(self) -> None:
        """Refuse every later request with DRAINING (one being admitted now holds the lock: it
        is admitted first, and listed by `live`)."""
        with self.lock:
            self.draining = True

    def undrain(self) -> None:
        """Admit requests again."""
        self.draining = False

    @abstractmethod
    def live(self) -> list[str]:
        """(Any thread) the request ids of its requests that have not ended."""

    @abstractmethod
    def end_live(self, code: ErrorCode, message: str) -> int:
        """(Any thread) end every live request with `code`: posted to the inbox, so its pages
        are released on the loop's thread, once no transfer can write them.  Returns how many
        it asked to end."""

    # ---- the inbox -------------------------------------------------------------------
    def _post(self, item: Item) -> None:
        """(Any thread) hand `item` to the loop's thread and wake it."""
        self._inbox.put(item)
        self.wake.set()

    def handle_inbox(self) -> bool:
        """(The loop's thread, first in every iteration, at least every `idle_wait_s` while
        idle) handle what other threads posted, in order.  Returns whether there was any."""
        did = False
        while not self._inbox.empty():
            self._handle(self._inbox.get())
            did = True
        return did

    @abstractmethod
    def _handle(self, item: Item) -> None:
        """(The loop's thread) one posted item; a request it ends has its pages released here."""

    def _count_failed(self, error: WorkerError) -> None:
        """Count a request that ended with `error`: failed, and drained too when a drain ended it
        (DRAINING).  A request that ended well is counted by its role, under its own name
        (finished, pushed)."""
        self.counts["failed"] += 1
        if error.code == ErrorCode.DRAINING:
            self.counts["drained"] += 1

    # ---- the loop's step ---------------------------------------------------------------
    def before_run(self, batch: ScheduledBatch) -> LayerHook | None:
        """Called before the forward pass of `batch`; may return a per-layer hook."""
        return None

    @abstractmethod
    def after_run(self, events: list[TokenEvent]) -> None:
        """Consume the token path's events for this role's requests (others' are ignored).  A
        finished request's pages are already free; a detached hand-off's are kept."""

    @abstractmethod
    def fail(self, batch: ScheduledBatch, error: BaseException) -> None:
        """The step over `batch` raised (anywhere from before_run to after_run): end this role's
        requests of it that are still live with an explicit error, whatever the token path did
        to them already; their pages are released once no transfer can write them."""

    @abstractmethod
    def shutdown(self) -> None:
        """(The loop has stopped) end every live request with an explicit error and release its
        pages."""

    @abstractmethod
    def install_hooks(self, hooks: TransferHooks) -> None:
        """Route this role's later transfers through `hooks` (its sending or receiving side)."""
