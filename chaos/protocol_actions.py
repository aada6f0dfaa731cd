"""The world `chaos.protocol_model` explores, and the actions it can take.

A real `PagePool` (float32, one head of width one: a page's layer is 2 * page_size * 4 bytes),
a real `TransferReceiver` in front of it, and requests r0, r1, ... that the pool owner admits
in order.  Admitting a request allocates its pages, reserves a transfer and has a real
`TransferSender` build its frames (one per page and layer) and its commit.  Every payload byte
of request r's logical page i is `Bounds.identity(r, i)`, so the bytes a page holds name the
reservation and page whose frame wrote them.

Actions (the pool owner's, the senders' and an adversary's):

    admit r        allocate r's pages (when enough are free) and reserve its transfer
    frame r.fK     send r's frame K: a first send, a duplicate, or a stale replay
    forge r.fK->s  r's frame K aimed at s's transfer (transfer id, request, tenant, prompt
                   digest: s's; ownership tag and payload: r's; checksum recomputed)
    end CALL       let a frame parked inside its page copy finish
    commit r       send r's commit (waits while writes into r's pages are running)
    close r        r's stream ends
    release r      the pool owner ends r (waits until no write into r's pages is running)
    free r         the pool owner frees r's pages, once its release returned
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from chaos.protocol_threads import DONE, PARKED, Board, Call, TracedCondition
from engine.kv_pool import PagePool
from engine.prefix_cache import CacheEventLog
from kv_transfer.frame import frame_checksum, prompt_digest
from kv_transfer.pages import Payload, pool_bytes, read_bytes
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import Reservation
from kv_transfer.sender import TransferSender, TransferTicket
from proto import kv_transfer_pb2 as pb

SECRET = b"protocol-model-cluster-secret-32"
TENANT = "acme"
MIXED = -1           # a page layer whose bytes are not all one identity

MakeReceiver = Callable[[PagePool, bytes], TransferReceiver]
Contents = tuple[tuple[int, ...], ...]     # [pool page][layer] -> identity byte, 0 or MIXED


@dataclass(frozen=True)
class Bounds:
    """How big a world the model explores (every field a bound of the search)."""
    requests: int = 2            # request ids r0, r1, ... admitted in this order
    pages_per_request: int = 2   # prompt pages of every request (all full)
    pool_pages: int = 3          # fewer than requests * pages_per_request: pages are reused
    layers: int = 1              # one frame per (page, layer)
    page_size: int = 2
    max_depth: int = 40          # actions on one path; deeper states are not expanded

    def __post_init__(self) -> None:
        if not 1 <= self.pages_per_request <= self.pool_pages:
            raise ValueError(f"pages_per_request={self.pages_per_request} must be in "
                             f"[1, pool_pages={self.pool_pages}]")
        if self.requests * self.pages_per_request >= 255:
            raise ValueError("identity bytes run out: requests * pages_per_request must be < 255")

    @property
    def prompt_len(self) -> int:
        return self.pages_per_request * self.page_size

    def identity(self, request: int, page_index: int) -> int:
        """The byte of every payload byte of request `request`'s page `page_index` (0: none)."""
        return 1 + request * self.pages_per_request + page_index

    def writer(self, identity: int) -> tuple[int, int]:
        """(request, page index) of an identity byte."""
        return divmod(identity - 1, self.pages_per_request)


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
        if self.kind == "frame":
            return f"frame r{self.request}.f{self.frame}"
        return f"{self.kind} r{self.request}"


class Frame(NamedTuple):
    """A frame as the sender built it, and the identity byte its payload carries."""
    header: pb.FrameHeader
    payload: bytes
    identity: int


class _Capture:
    """A SenderStream that keeps the frames and the commit."""

    def __init__(self) -> None:
        self.frames: list[tuple[pb.FrameHeader, bytes]] = []
        self.commits: list[pb.Commit] = []

    def stage(self, nbytes: int) -> None:
        return None

    def send(self, header: pb.FrameHeader, payload: Payload) -> None:
        h = pb.FrameHeader()
        h.CopyFrom(header)
        self.frames.append((h, bytes(payload)))

    def flush(self) -> None:
        pass

    def commit(self, commit: pb.Commit) -> pb.PushReply:
        self.commits.append(commit)
        return pb.PushReply(ok=True)

    def close(self) -> None:
        pass


@dataclass
class Request:
    index: int
    rid: str
    phase: str = "new"                   # new open releasing released freed
    res: Reservation | None = None
    frames: list[Frame] = field(default_factory=list)
    commit: pb.Commit | None = None

    @property
    def reservation(self) -> Reservation:
        """The transfer reserved when the request was admitted."""
        assert self.res is not None, f"{self.rid} is not admitted"
        return self.res


class World:
    """One run: fresh pool, receiver and senders; `apply` takes an action and settles."""

    def __init__(self, bounds: Bounds, make_receiver: MakeReceiver = TransferReceiver) -> None:
        self.bounds = bounds
        self.pool = self._pool(bounds.pool_pages)
        self.recv = make_receiver(self.pool, SECRET)
        self.recv._lock = TracedCondition()   # the same lock, reporting waits to the board
        self.board = Board()
        self.requests = [Request(i, f"r{i}") for i in range(bounds.requests)]
        self.free_order: list[int] = []

    def _pool(self, pages: int) -> PagePool:
        return PagePool(pages, self.bounds.page_size, self.bounds.layers, 1, 1, torch.float32)

    # ---- actions -------------------------------------------------------------------
    def enabled(self) -> list[Action]:
        acts: list[Action] = []
        waiting = [q for q in self.requests if q.phase == "new"]
        if waiting and self.pool.num_free >= self.bounds.pages_per_request:
            acts.append(Action("admit", waiting[0].index))
        admitted = [q for q in self.requests if q.phase != "new"]
        for q in admitted:
            frames = range(len(q.frames))
            acts += [Action("frame", q.index, k) for k in frames]
            acts += [Action("forge", q.index, k, t.index) for t in admitted if t is not q for k in frames]
            if not any(c.label == f"commit r{q.index}" for c in self.board.live()):
                acts.append(Action("commit", q.index))   # a sender awaits its commit's reply
            acts.append(Action("close", q.index))
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

    def _admit(self, a: Action) -> None:
        q = self.requests[a.request]
        self.pool.allocate(q.rid, self.bounds.pages_per_request)
        q.res = self.recv.reserve(q.rid, TENANT, self.bounds.prompt_len, self._digest(q))
        q.frames, q.commit = self._send_all(q)
        q.phase = "open"

    def _digest(self, q: Request) -> bytes:
        """The prompt digest of q's prompt (token ids q.index, q.index, ...: one per request)."""
        return prompt_digest([q.index] * self.bounds.prompt_len)

    def _send_all(self, q: Request) -> tuple[list[Frame], pb.Commit]:
        """The frames and commit a sender builds from a prefill pool holding q's identity bytes."""
        src = self._pool(self.bounds.pages_per_request)
        pages = src.allocate(q.rid, self.bounds.pages_per_request)
        for i, page in enumerate(pages):
            pool_bytes(src)[:, :, page] = self.bounds.identity(q.index, i)
        stream = _Capture()
        ticket = TransferTicket(q.reservation.transfer_id, q.rid, TENANT, self._digest(q))
        sender = TransferSender(stream, ticket, SECRET, src, pages, self.bounds.prompt_len)
        for layer in range(self.bounds.layers):
            sender.send_layers(layer, layer + 1)
        sender.commit(first_token_id=1, first_logprob=0.0)
        frames = [Frame(h, p, self.bounds.identity(q.index, h.page_index)) for h, p in stream.frames]
        return frames, stream.commits[0]

    def _frame(self, a: Action) -> None:
        f = self.requests[a.request].frames[a.frame]
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

    def _free(self, a: Action) -> None:
        q = self.requests[a.request]
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
        pages = tuple((self.pool.owner(p), self.pool.generation(p), self.pool.is_written(p))
                      for p in range(self.bounds.pool_pages))
        calls = tuple(sorted((c.label, c.status) for c in self.board.live()))
        return (tuple(map(_request_key, self.requests)), calls, pages, self.contents(),
                tuple(self.free_order))

    def clone(self) -> World:
        """A deep copy of this world, which has no call in flight: the same pool, receiver and
        requests, with a fresh board and receiver lock."""
        assert not self.board.live(), "only a settled world without calls in flight is copied"
        memo = {id(self.board): Board(), id(self.recv._lock): TracedCondition(),
                id(self.bounds): self.bounds,   # the cache's event log is no part of the state: a fresh one
                id(self.pool.events): CacheEventLog(self.bounds.page_size, epoch=self.pool.events.epoch)}
        for q in self.requests:   # frames and commits never change: shared, not copied
            memo.update({id(x): x for x in (q.commit, q.frames, *(f.header for f in q.frames))})
        return copy.deepcopy(self, memo)

    def close(self) -> None:
        """Let parked calls finish so no thread outlives this world."""
        self.board.drain()


def _request_key(q: Request) -> tuple:
    if q.res is None:
        return (q.phase,)
    frames = tuple(sorted((seq, r.page, r.header.ownership_tag == q.res.tag)
                          for seq, r in q.res.frames.items()))
    return (q.phase, q.res.state.value, tuple(map(bytes, q.res.layers_done)), frames, q.res.writers)


def _identity(block: bytes) -> int:
    return block[0] if block.count(block[0]) == len(block) else MIXED
