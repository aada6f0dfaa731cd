"""The one thread that runs a worker's engine steps (every page ownership change of a worker
happens on it or under the engines' shared lock)."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("tandem.worker")


class WorkerLoop:
    """Interleaves the engines: one prefill step (if any work), then one decode step."""

    def __init__(self, engines: list, idle_wait_s: float = 0.05):
        self.engines = engines
        self.wake = threading.Event()
        for e in engines:
            e.wake = self.wake
        self.idle_wait_s = idle_wait_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-loop", daemon=True)

    def start(self) -> "WorkerLoop":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            did = False
            for engine in self.engines:
                try:
                    did = engine.step() or did
                except Exception:
                    log.exception("engine step failed; its requests ended with an INTERNAL error")
                    did = True
            if not did:
                self.wake.wait(self.idle_wait_s)
                self.wake.clear()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self.wake.set()
        self._thread.join(timeout_s)
