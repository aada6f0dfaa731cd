"""The chaos run's hand inside one worker process: arms that worker's injectors, reports what
they injected and what its receiver refused, and checks its pool at idle.

A `ChaosControl` exists only in a worker started for a chaos run (`chaos.cluster`'s worker
actor, `python -m chaos.worker`); otherwise no injector exists in the process at all.  It
reaches the worker only through its `WorkerHandle`: `attach` installs the injectors as the
worker's transfer hooks, and the ledger reads the handle's counters, receiver and engine core.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from typing import Any

from chaos.injectors import RECEIVER_POINTS, Pacer, ReceiverFaults, corrupt_expert
from chaos.sender_faults import POINTS as SENDER_POINTS
from chaos.sender_faults import FaultInjector
from chaos.siege import StalledStreams
from engine.kv_pool import CACHED, PagePool, PoolExhausted
from kv_transfer.hooks import PLAIN_RECEIVER, PLAIN_SENDER, TransferHooks
from worker.server import WorkerHandle
from worker.types import Role


class ChaosControl:
    """One worker's injectors: the sender's on a prefill (or colocated) worker, the receiver's
    on a decode (or colocated) worker.  Nothing fires until `arm`."""

    def __init__(self, role: Role, seed: int, secret: bytes = b"") -> None:
        """`secret`: the cluster secret this worker holds (what `misbind` and the stalled
        streams need to act as a worker gone bad; without it they do nothing)."""
        self.role = role
        self.rng = random.Random(seed)
        self.sender = FaultInjector(seed) if role in (Role.PREFILL, Role.COLOCATED) else None
        self.receiver = ReceiverFaults(seed) if role in (Role.DECODE, Role.COLOCATED) else None
        self.expert_log: list[tuple[str, str]] = []
        self.stalled = StalledStreams(secret)
        self._secret = secret
        self._handle: WorkerHandle | None = None
        self._pacer: Pacer | None = None
        self._hashes: dict[int, tuple[int, str]] = {}     # cached page -> (generation, digest) when last seen

    def attach(self, handle: WorkerHandle) -> None:
        """Install this control's injectors as `handle`'s transfer hooks (every later transfer
        passes through them) and keep the handle for the ledger and the idle check."""
        self._handle = handle
        if self.sender is not None and self._secret:
            self.sender.bind_prompts(self._secret, self._prompt_of)
        handle.install_transfer_hooks(TransferHooks(sender=self.sender or PLAIN_SENDER,
                                                    receiver=self.receiver or PLAIN_RECEIVER))

    def _prompt_of(self, request_id: str) -> Sequence[int] | None:
        """The prompt ids this worker is pushing for `request_id` (None when it pushes none).
        Reads the prefill role's job table: WorkerHandle offers no lookup of its own."""
        for role in self.handle.roles:
            for job in list(getattr(role, "jobs", {}).values()):
                if getattr(job, "request_id", None) == request_id:
                    ids: Sequence[int] = job.req.prompt_token_ids
                    return ids
        return None

    @property
    def handle(self) -> WorkerHandle:
        if self._handle is None:
            raise RuntimeError("ChaosControl.attach(handle) was not called: no worker to act on")
        return self._handle

    def arm(self, point: str, times: int = 1, after: int = 0, probability: float = 1.0,
            seconds: float = 0.0) -> int:
        """Arm `point` on this worker.  `corrupt_expert` is done at once (`times` slots); returns
        how many were corrupted (0 for the other points).  `pace` slows this worker's engine loop
        to one step per `seconds` until `disarm` (chaos.injectors.Pacer; not a fault: nothing is
        logged).  Raises ValueError for a point this role does not have, or a bad value."""
        if point == "corrupt_expert":
            return self._corrupt(times)
        if point == "pace":
            if self._pacer is None:
                self._pacer = Pacer(self.handle.lock, self._tokens)
            self._pacer.start(seconds)
            return 0
        if point in SENDER_POINTS and self.sender is not None:
            self.sender.arm(point, times=times, after=after, probability=probability, seconds=seconds)
        elif point in RECEIVER_POINTS and self.receiver is not None:
            self.receiver.arm(point, times=times, probability=probability, seconds=seconds)
        else:
            raise ValueError(f"a {self.role.value} worker has no fault point {point!r}")
        return 0

    def _corrupt(self, times: int) -> int:
        h = self.handle
        done = 0
        for _ in range(times):
            with h.lock:        # a running step may read the flipped slot: the guard checks after each compute
                hit = corrupt_expert(h.core, self.rng)
            if hit is None:
                break
            self.expert_log.append(("corrupt_expert", f"layer {hit[0]} slot {hit[1]} expert {hit[2]}"))
            done += 1
        return done

    def _transfer_log(self) -> list[tuple[str, str]]:
        """(point, victim transfer id hex) of every transfer fault injected here so far."""
        return [entry for injector in (self.sender, self.receiver) if injector is not None
                for entry in injector.log]

    def injected(self, point: str) -> list[str]:
        """Victim transfer ids of this worker's `point` injections so far (a cheap poll)."""
        return [tid for p, tid in self._transfer_log() if p == point]

    def disarm(self) -> None:
        for injector in (self.sender, self.receiver):
            if injector is not None:
                injector.disarm()
        if self._pacer is not None:
            self._pacer.stop()

    def ledger(self) -> dict[str, Any]:
        """What this worker injected and refused so far, and its counters."""
        h = self.handle
        out: dict[str, Any] = {
            "role": self.role.value, "pid": os.getpid(), "counts": dict(h.counts()),
            "injected": self._transfer_log() + self.expert_log,
            "corrupt_slots": sum(c["corrupt_slots"] for c in h.core.expert_stats().values()),
            "page_size": h.core.pool.page_size}
        if h.receiver is not None:
            out.update(refusals=list(h.receiver.refusal_log), failures=list(h.receiver.failure_log),
                       accepted_bytes=h.receiver.accepted_bytes)
        return out

    def _tokens(self) -> int:
        """The tokens this worker's live decode requests generated here, a count every engine
        step with live requests changes (the pacer's progress).  Read without the lock: copying
        a dict's values is one step under the GIL, and a count read mid-step is still a count."""
        return sum(len(getattr(getattr(d, "req", None), "output_token_ids", ()))
                   for role in self.handle.roles for d in list(getattr(role, "requests", {}).values()))

    def live_requests(self) -> list[dict[str, int]]:
        """The decode requests this worker holds now and has not ended, each as {"generated":
        tokens generated for its client so far (a migrated one's earlier ones included),
        "resumed": how many of those came before it arrived here (> 0: it migrated here),
        "left": how many it may still generate}.  Reads the decode role's request table:
        WorkerHandle offers no lookup of its own."""
        h = self.handle
        out = []
        with h.lock:
            for role in h.roles:
                for dreq in list(getattr(role, "requests", {}).values()):
                    req = getattr(dreq, "req", None)
                    if req is None or getattr(dreq, "done", False):
                        continue
                    resumed = int(getattr(req, "resumed", 0))
                    out.append({"generated": resumed + len(req.output_token_ids), "resumed": resumed,
                                "left": req.params.max_tokens - len(req.output_token_ids)})
        return out

    def push_streams(self) -> dict[str, Any]:
        """This worker's transfer receiver: {"endpoint"}, and for a gRPC one the Push stream
        cap and its live, refused (over the cap) and idle-cut stream counts."""
        server = transfer_server(self.handle)
        if server is None:
            return {"endpoint": None}
        out: dict[str, Any] = {"endpoint": server.endpoint}
        watch = getattr(server, "watch", None)
        if watch is not None:
            out.update(limit=watch.limit, live=watch.live, refused=watch.refused, cut=watch.cut)
        return out

    def stall_open(self, endpoint: str, n: int) -> int:
        """Open `n` stalled Push streams to `endpoint` from this worker (chaos.siege)."""
        return self.stalled.open(endpoint, n)

    def stall_status(self) -> dict[str, Any]:
        return self.stalled.status()

    def stall_handshake(self, endpoint: str) -> dict[str, Any]:
        return self.stalled.handshake(endpoint)

    def stall_close(self) -> dict[str, Any]:
        return self.stalled.close()

    def idle_check(self, contents: bool = False) -> dict[str, Any]:
        """The pool's accounting (I6 with the prefix cache): integrity, and the pages by state
        (`pool_state`).  `contents`: also re-hash every cached page and compare it with this
        control's last hash of it (the integrity problem names a page that changed)."""
        h = self.handle
        pool = h.core.pool
        with h.lock:
            try:
                pool.check_integrity(contents=contents)
                problem = ""
            except AssertionError as e:
                problem = str(e) or "check_integrity failed"
            changed = self._changed_pages(pool) if contents else []
            if changed and not problem:
                problem = f"cached pages {changed[:8]} changed while cached (same generation)"
            for experts in h.core.paged_experts().values():   # a flip no step read yet is counted here
                experts.slots.verify(range(experts.slots.num_slots))
            return {**self.pool_state(), "integrity": problem, "hashed": len(self._hashes) if contents else None}

    def pool_state(self) -> dict[str, int]:
        """The pool's pages by state now: `used` counts those a request holds (private ones, and
        cached ones some table references; at idle it must be 0), `free` what an allocation can
        get (free and evictable), and the cached, evictable and evicted counts."""
        h = self.handle
        pool = h.core.pool
        with h.lock:
            private = sum(1 for p in range(pool.num_pages) if pool.owner(p) not in (None, CACHED))
            return {"used": pool.num_pages - pool.num_free, "free": pool.num_free, "private": private,
                    "cached": pool.num_cached, "evictable": pool.num_evictable, "evictions": pool.evictions}

    def _changed_pages(self, pool: PagePool) -> list[int]:
        """Cached pages whose bytes differ from when this control last hashed them under the same
        generation (a page is read-only from its publishing until its eviction, and it is only
        written again after a new allocation, which bumps its generation)."""
        now = cached_page_digests(pool)
        changed = [p for p, (gen, digest) in now.items()
                   if p in self._hashes and self._hashes[p][0] == gen and self._hashes[p][1] != digest]
        self._hashes = now
        return changed

    def cache_pages(self) -> dict[int, tuple[int, str]]:
        """Every cached page of this worker's pool: page -> (generation, digest of its bytes)."""
        with self.handle.lock:
            return cached_page_digests(self.handle.core.pool)

    def squeeze(self, keep_pages: int) -> dict[str, int]:
        """Hold every page of the pool but `keep_pages` (free or evictable ones the requests
        may still get) as a request of this control's (`SQUEEZE_ID`), so the pool acts as a
        small one: allocating them evicts cached pages first.  Returns {"held", "kept"}."""
        h = self.handle
        with h.lock:
            take = max(0, h.core.pool.num_free - keep_pages)
            try:
                held = len(h.core.pool.allocate(SQUEEZE_ID, take)) if take else 0
            except PoolExhausted:         # the requests took pages meanwhile: hold what is left
                held = 0
            return {"held": held, "kept": h.core.pool.num_free}

    def unsqueeze(self) -> int:
        """Give back the pages `squeeze` held; returns how many."""
        with self.handle.lock:
            return self.handle.core.pool.free(SQUEEZE_ID)


SQUEEZE_ID = "chaos-squeeze"


def cached_page_digests(pool: PagePool) -> dict[int, tuple[int, str]]:
    """page -> (generation, blake2b of the page's bytes in every layer, K and V) of every cached
    page of `pool` (the caller holds the pool owner's lock)."""
    return {p: (pool.generation(p), pool.page_digest(p).hex())
            for p in range(pool.num_pages) if pool.owner(p) == CACHED}


def transfer_server(handle: WorkerHandle) -> Any | None:
    """The transfer server of a decode (or colocated) worker, None on a prefill worker.
    WorkerHandle does not name it; the server's `stop` is one of the handle's closers, so it
    is found as the object behind that bound method (an object with an `endpoint`)."""
    for close in handle.closers:
        server = getattr(close, "__self__", None)
        if server is not None and isinstance(getattr(server, "endpoint", None), str):
            return server
    return None
