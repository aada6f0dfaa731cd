"""The chaos run's hand inside one worker process: arms that worker's injectors, reports what
they injected and what its receiver refused, and checks its pool at idle.

A worker actor holds one `ChaosControl` only when the deployment was started with a
`chaos_seed`; otherwise no injector exists in the process at all.
"""

from __future__ import annotations

import os
import random

from chaos.injectors import RECEIVER_POINTS, ReceiverFaults, corrupt_expert
from kv_transfer.faults import POINTS as SENDER_POINTS
from kv_transfer.faults import FaultInjector


class ChaosControl:
    def __init__(self, role: str, seed: int):
        self.role = role
        self.rng = random.Random(seed)
        self.sender = FaultInjector(seed) if role == "prefill" else None
        self.receiver = ReceiverFaults(seed) if role == "decode" else None
        self.expert_log: list[tuple[str, str]] = []
        self.handle = None                      # the running worker, set once it started

    @property
    def faults(self):
        """What the worker's start function takes as `faults=`."""
        return self.sender if self.role == "prefill" else self.receiver

    def arm(self, point: str, **kw) -> int:
        """Arm `point` on this worker.  `corrupt_expert` is done at once (`times` slots); returns
        how many were corrupted.  Raises ValueError for a point this role does not have."""
        if point == "corrupt_expert":
            return self._corrupt(kw.get("times", 1))
        if point in SENDER_POINTS and self.sender is not None:
            self.sender.arm(point, **kw)
        elif point in RECEIVER_POINTS and self.receiver is not None:
            self.receiver.arm(point, **kw)
        else:
            raise ValueError(f"a {self.role} worker has no fault point {point!r}")
        return 0

    def _corrupt(self, times: int) -> int:
        llm, lock = self.handle.llm, self.handle.engines[0].lock
        done = 0
        for _ in range(times):
            with lock:                          # not in the middle of a step's page-in
                hit = corrupt_expert(llm, self.rng)
            if hit is None:
                break
            self.expert_log.append(("corrupt_expert", f"layer {hit[0]} slot {hit[1]} expert {hit[2]}"))
            done += 1
        return done

    def injected(self, point: str) -> list[str]:
        """Victim transfer ids of this worker's `point` injections so far (a cheap poll)."""
        return [tid for p, tid in self.faults.log if p == point] if self.faults else []

    def disarm(self) -> None:
        for injector in (self.sender, self.receiver):
            if injector is not None:
                injector.disarm()

    def ledger(self) -> dict:
        """What this worker injected and refused so far, and its counters."""
        h = self.handle
        engine = h.engines[0]
        out = {"role": self.role, "pid": os.getpid(), "counts": dict(engine.counts),
               "injected": list(self.faults.log) + self.expert_log if self.faults else list(self.expert_log),
               "corrupt_slots": sum(c["corrupt_slots"] for c in h.llm.expert_stats().values())}
        receiver = getattr(engine, "receiver", None)
        if receiver is not None:
            out.update(refusals=list(receiver.refusal_log), failures=list(receiver.failure_log),
                       accepted_bytes=receiver.accepted_bytes)
        return out

    def idle_check(self) -> dict:
        """The pool's accounting (I6): integrity, and whether every page is free."""
        h = self.handle
        pool = h.llm.pool
        with h.engines[0].lock:
            try:
                pool.check_integrity()
                problem = ""
            except AssertionError as e:
                problem = str(e) or "check_integrity failed"
            for e in h.llm.paged_experts().values():      # a flip no step read yet is counted here
                e.slots.verify(range(e.slots.num_slots))
            return {"used": pool.num_used, "integrity": problem}
