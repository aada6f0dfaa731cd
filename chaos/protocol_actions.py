"""The world `chaos.protocol_model` explores, and the actions it can take.

A real `PagePool` with its prefix cache (float32, one head of width one: a page's layer is
2 * page_size * 4 bytes; `audit` on, so every published page is hashed), a real
`TransferReceiver` in front of it, and requests r0, r1, ... of one tenant that the pool owner
admits in order.  Every prompt starts with the same `Bounds.shared_pages` pages of tokens, so a
later request finds the pages an earlier one published.  Admitting a request takes the longest
cached prefix of its page keys (`allocate_prefixed`, evicting least recently used unreferenced
cached pages when the free list is short), reserves a transfer for the rest
(`cached_tokens`) and has a real `TransferSender` build the frames from that boundary on (one
per page and layer) and the commit.  Every payload byte of request r's logical page i is
`Bounds.identity(r, i)`, so the bytes a page holds name the reservation and page whose frame
wrote them; a cached page keeps its publisher's bytes.

Actions (the pool owner's, the senders' and an adversary's):

    admit r        give r its cached prefix and pages for the rest (when they fit), reserve
    frame r.fK     send r's frame K: a first send, a duplicate, or a stale replay
    poison r.pK    r's sender ignores the boundary: a genuine frame (r's tag) for cached page K
    forge r.fK->s  r's frame K aimed at s's transfer (transfer id, request, tenant, prompt
                   digest: s's; ownership tag and payload: r's; checksum recomputed)
    end CALL       let a frame parked inside its page copy finish
    commit r       send r's commit (waits while writes into r's pages are running)
    close r        r's stream ends
    publish r      the pool owner publishes r's prompt pages, once r committed
    release r      the pool owner ends r (waits until no write into r's pages is running)
    free r         the pool owner frees r's pages once its release returned (publishing them
                   first if r committed): cached pages lose a reference, the rest go free
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from chaos.protocol_senders import SALT, SECRET, TENANT, Bounds, Frame, build_frames, model_pool
from chaos.protocol_threads import DONE, PARKED, Board, Call, TracedCondition
from engine.kv_pool import PagePool
from engine.prefix_cache import CacheEventLog, max_cached_pages, page_keys
from kv_transfer.frame import frame_checksum, prompt_digest
from kv_transfer.pages import read_bytes
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import Reservation, State
from kv_transfer.sender import TransferTicket
from proto import kv_transfer_pb2 as pb

MIXED = -1           # a page layer whose bytes are not all one identity

MakeReceiver = Callable[[PagePool, bytes], TransferReceiver]
Contents = tuple[tuple[int, ...], ...]     # [pool page][layer] -> identity byte, 0 or MIXED


class Action(NamedTuple):
    """One step of the model; `str(action)` names it in traces."""
    kind: str
    request: int = -1
    frame: int = -1
    target: int = -1     # forge: the request whose transfer the frame is aimed at
    label: str = ""      # end: the parked call to let finish

    def __str__(self) -> str:
        if self.kind == "end":
            return f"end {self.label}"
        if self.kind == "forge":
            return f"forge r{self.request}.f{self.frame}->r{self.target}"
        if self.kind == "poison":
            return f"poison r{self.request}.p{self.frame}"
        if self.kind == "frame":
            return f"frame r{self.request}.f{self.frame}"
        return f"{self.kind} r{self.request}"


@dataclass
class Request:
    index: int
    rid: str
    keys: list[bytes]                    # the prefix cache's key of each prompt page
    phase: str = "new"                   # new open releasing released freed
    res: Reservation | None = None
    frames: list[Frame] = field(default_factory=list)
    poison: list[Frame] = field(default_factory=list)   # genuine frames for its cached pages
    commit: pb.Commit | None = None
    published: bool = False
    evicted: int = 0                     # cached pages its admission evicted

    @property
    def reservation(self) -> Reservation:
        """The transfer reserved when the request was admitted."""
        assert self.res is not None, f"{self.rid} is not admitted"
        return self.res


class World:
    """One run: fresh pool, receiver and senders; `apply` takes an action and settles."""

    def __init__(self, bounds: Bounds, make_receiver: MakeReceiver = TransferReceiver) -> None:
        self.bounds = bounds
        self.pool = model_pool(bounds, bounds.pool_pages)
        self.recv = make_receiver(self.pool, SECRET)
        self.recv._lock = TracedCondition()   # the same lock, reporting waits to the board
        self.board = Board()
        self.requests = [Request(i, f"r{i}", page_keys(SALT, bounds.prompt(i), bounds.page_size))
                         for i in range(bounds.requests)]
        self.free_order: list[int] = []
        self.evicted: set[tuple[int, int]] = set()    # (page, generation) of cached pages evicted

    def _lookup(self, q: Request) -> list[bytes]:
        """The keys of q's pages a cache hit may cover (never the prompt's last token)."""
        return q.keys[:max_cached_pages(self.bounds.prompt_len, self.bounds.page_size)]

    def _fits(self, q: Request) -> bool:
        """Whether `allocate_prefixed` can admit q now: its private pages fit in the free and
        evictable pages, less the evictable pages its hits take off the LRU."""
        hits = self.pool.cache.match(self._lookup(q), SALT)
        taken = sum(self.pool.cache.refcount(p) == 0 for p in hits)
        return self.bounds.pages_per_request - len(hits) <= self.pool.num_free - taken

    # ---- actions -------------------------------------------------------------------
    def enabled(self) -> list[Action]:
        acts: list[Action] = []
        waiting = [q for q in self.requests if q.phase == "new"]
        if waiting and self._fits(waiting[0]):
            acts.append(Action("admit", waiting[0].index))
        admitted = [q for q in self.requests if q.phase != "new"]
        for q in admitted:
            frames = range(len(q.frames))
            acts += [Action("frame", q.index, k) for k in frames]
            acts += [Action("poison", q.index, k) for k in range(len(q.poison))]
            acts += [Action("forge", q.index, k, t.index) for t in admitted if t is not q for k in frames]
            if not any(c.label == f"commit r{q.index}" for c in self.board.live()):
                acts.append(Action("commit", q.index))   # a sender awaits its commit's reply
            acts.append(Action("close", q.index))
            if self._committed(q) and not q.published and q.phase != "freed":
                acts.append(Action("publish", q.index))
            acts += [Action(k, q.index) for k, p in (("release", "open"), ("free", "released"))
                     if q.phase == p]
        parked = sorted({c.label for c in self.board.calls if c.status == PARKED})
        return acts + [Action("end", label=label) for label in parked]

    def apply(self, action: Action) -> list[Call]:
        """Take `action` and wait until every call settles.  Returns the calls that finished
        during it.  Raises Hang if a call never settles."""
        getattr(self, f"_{action.kind}")(action)
        self.board.settle()
        done = [c for c in self.board.calls if c.status == DONE and not c.collected]
        for call in done:
            call.collected = True
            if call.action.kind == "release":
                self.requests[call.action.request].phase = "released"
        return done

    def _call(self, action: Action, fn: Callable[[], object], own_thread: bool, identity: int = 0) -> None:
        """Run a receiver call on its own thread, or to its end on this one when it cannot
        stop (a wait there raises Hang; a page copy there is recorded but does not park)."""
        call = Call(action, fn, self.board, identity)
        if own_thread:
            self.board.start(call)
        else:
            self.board.run_here(call)

    def _deliver(self, action: Action, h: pb.FrameHeader, payload: bytes, identity: int) -> None:
        """A frame for an open transfer may park in its page copy.  One for a transfer that is
        not open must be refused before any copy (a copy it made would be recorded all the same)."""
        res = self.recv.get(h.transfer_id)
        self._call(action, lambda: self.recv.receive(h, payload), res is not None and not res.terminal,
                   identity)

    def _busy(self, q: Request) -> bool:
        """Whether a write into q's pages is in flight (release and commit wait for it)."""
        res = self.recv.get(q.reservation.transfer_id)
        return res is not None and res.writers > 0

    def _committed(self, q: Request) -> bool:
        return q.res is not None and q.res.state == State.COMMITTED

    def _admit(self, a: Action) -> None:
        q = self.requests[a.request]
        evictable = [(p, self.pool.generation(p)) for p in range(self.bounds.pool_pages)
                     if p in self.pool.cache and self.pool.cache.refcount(p) == 0]
        hits = self.pool.allocate_prefixed(q.rid, self.bounds.pages_per_request, self._lookup(q), SALT)
        evicted = {(p, g) for p, g in evictable if self.pool.generation(p) != g}
        q.evicted, self.evicted = len(evicted), self.evicted | evicted
        q.res = self.recv.reserve(q.rid, TENANT, self.bounds.prompt_len, self._digest(q),
                                  cached_tokens=hits * self.bounds.page_size)
        ticket = TransferTicket(q.reservation.transfer_id, q.rid, TENANT, self._digest(q))
        q.frames, q.commit = build_frames(self.bounds, q.index, ticket, hits)
        q.poison = [f for f in build_frames(self.bounds, q.index, ticket, 0)[0] if f.header.page_index < hits]
        q.phase = "open"

    def _digest(self, q: Request) -> bytes:
        return prompt_digest(self.bounds.prompt(q.index))

    def _frame(self, a: Action) -> None:
        f = self.requests[a.request].frames[a.frame]
        self._deliver(a, f.header, f.payload, f.identity)

    def _poison(self, a: Action) -> None:
        f = self.requests[a.request].poison[a.frame]
        self._deliver(a, f.header, f.payload, f.identity)

    def _forge(self, a: Action) -> None:
        f, target = self.requests[a.request].frames[a.frame], self.requests[a.target]
        h = pb.FrameHeader()
        h.CopyFrom(f.header)
        h.transfer_id, h.request_id, h.tenant = target.reservation.transfer_id, target.rid, target.reservation.tenant
        h.prompt_digest = target.reservation.prompt_digest    # public: only the tag needs the secret
        h.checksum = frame_checksum(h, [f.payload])
        self._deliver(a, h, f.payload, f.identity)

    def _end(self, a: Action) -> None:
        call = next(c for c in self.board.calls if c.status == PARKED and c.label == a.label)
        self.board.resume(call)

    def _commit(self, a: Action) -> None:
        q = self.requests[a.request]
        self._call(a, lambda: self.recv.commit(q.commit), self._busy(q))

    def _close(self, a: Action) -> None:
        self.recv.stream_closed(self.requests[a.request].reservation.transfer_id)   # never waits

    def _release(self, a: Action) -> None:
        q = self.requests[a.request]
        q.phase = "releasing"
        self._call(a, lambda: self.recv.release(q.reservation.transfer_id), self._busy(q))

    def _publish(self, a: Action) -> None:
        q = self.requests[a.request]
        self.pool.publish(q.rid, q.keys, SALT)
        q.published = True

    def _free(self, a: Action) -> None:
        q = self.requests[a.request]
        if self._committed(q) and not q.published:
            self._publish(a)           # a request's end publishes what it computed, then releases
        self.pool.free(q.rid)
        q.phase = "freed"
        self.free_order.append(q.index)

    # ---- what the model looks at ------------------------------------------------------
    def contents(self) -> Contents:
        """[page][layer] -> the identity byte all its bytes hold, 0 if never written, or MIXED."""
        b = self.bounds
        return tuple(tuple(_identity(read_bytes(self.pool, p, layer, layer + 1, b.page_size))
                           for layer in range(b.layers)) for p in range(b.pool_pages))

    def fingerprint(self) -> tuple:
        """The abstract state: what decides every later outcome, without counters, reasons,
        transfer ids or deadlines."""
        cache = self.pool.cache
        pages = tuple((self.pool.owner(p), self.pool.generation(p), self.pool.is_written(p),
                       cache.key(p), cache.refcount(p)) for p in range(self.bounds.pool_pages))
        calls = tuple(sorted((c.label, c.status) for c in self.board.live()))
        lru = tuple(cache.evictable())        # the eviction order decides which page the next admission takes
        return (tuple(map(_request_key, self.requests)), calls, pages, self.contents(),
                tuple(self.free_order), lru)

    def clone(self) -> World:
        """A deep copy of this world, which has no call in flight: the same pool, receiver and
        requests, with a fresh board and receiver lock."""
        assert not self.board.live(), "only a settled world without calls in flight is copied"
        memo = {id(self.board): Board(), id(self.recv._lock): TracedCondition(),
                id(self.bounds): self.bounds,   # the cache's event log is no part of the state: a fresh one
                id(self.pool.events): CacheEventLog(self.bounds.page_size, epoch=self.pool.events.epoch)}
        for q in self.requests:   # frames and commits never change: shared, not copied
            memo.update({id(x): x for x in (q.commit, q.frames, q.poison, q.keys,
                                            *(f.header for f in q.frames + q.poison))})
        return copy.deepcopy(self, memo)

    def close(self) -> None:
        """Let parked calls finish so no thread outlives this world."""
        self.board.drain()


def _request_key(q: Request) -> tuple:
    if q.res is None:
        return (q.phase,)
    frames = tuple(sorted((seq, r.page, r.header.ownership_tag == q.res.tag)
                          for seq, r in q.res.frames.items()))
    return (q.phase, q.res.state.value, tuple(map(bytes, q.res.layers_done)), frames, q.res.writers,
            q.res.cached_tokens, q.published)


def _identity(block: bytes) -> int:
    return block[0] if block.count(block[0]) == len(block) else MIXED
