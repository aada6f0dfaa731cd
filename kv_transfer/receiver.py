"""The receiving side of KV transfers, in front of a decode worker's `PagePool`.

The pool's owner allocates a request's pages and calls `reserve`; transports hand every
frame to `receive` and the closing commit to `commit`; the owner calls `release` when the
request ends and only then frees the pages.  The receiver writes page bytes and marks pages
written, and never allocates or frees a page.

Thread safety: one lock guards the reservation table; checksums and page copies run
outside it.  A write claims its (page, layers) under the lock first, and `release` waits
until no claimed write is still running (I5: freed only when no writer can still write).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict, deque
from time import perf_counter
from typing import Callable, NoReturn

from engine.kv_pool import CACHED, PagePool, PageRef
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.frame import (
    PROMPT_DIGEST_BYTES,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Buffer,
    check_secret,
    checksum_of,
    header_bytes,
    new_transfer_id,
    ownership_tag,
    tags_equal,
)
from kv_transfer.hooks import PLAIN_RECEIVER, ReceiverHooks
from kv_transfer.pages import block_parts, holds_block, write_payload
from kv_transfer.reservation import TRANSFER_TIMEOUT_S, Reservation, State, prompt_pages
from proto import kv_transfer_pb2 as pb

TOMBSTONES = 65536   # released transfer ids remembered so late frames read EXPIRED
REFUSAL_LOG = 65536  # (transfer id hex, reason) of the latest refusals, for the chaos report


class TransferReceiver:
    def __init__(self, pool: PagePool, secret: bytes, timeout_s: float = TRANSFER_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic,
                 on_failed: Callable[[Reservation], None] | None = None,
                 on_committed: Callable[[Reservation], None] | None = None):
        if timeout_s <= 0:
            raise ValueError(f"transfer timeout_s={timeout_s} must be > 0")
        self.pool = pool
        self._secret = check_secret(secret)
        self.timeout_s = timeout_s
        self._clock = clock
        self._on_failed = on_failed          # both callbacks must not block: the owner
        self._on_committed = on_committed    # schedules its reaction on its own thread
        self._lock = threading.Condition()
        self._live: dict[bytes, Reservation] = {}
        self._gone: OrderedDict[bytes, str] = OrderedDict()
        self.refused: Counter[str] = Counter()
        self.refusal_log: deque[tuple[str, str]] = deque(maxlen=REFUSAL_LOG)
        self.failure_log: deque[tuple[str, str]] = deque(maxlen=REFUSAL_LOG)  # transfers failed, and why
        self.hooks: ReceiverHooks = PLAIN_RECEIVER     # see install_hooks
        self.accepted_frames = 0
        self.accepted_bytes = 0
        self.committed = 0
        self.checksum_s = 0.0   # time spent verifying and re-checksumming (benchmark figure)

    def install_hooks(self, hooks: ReceiverHooks) -> None:
        """Route every later frame through `hooks` (kv_transfer.hooks; chaos runs install fault
        injectors this way)."""
        self.hooks = hooks

    # ---- the pool owner's side ---------------------------------------------------
    def reserve(self, request_id: str, tenant: str, prompt_len: int, prompt_digest: bytes,
                timeout_s: float | None = None, cached_tokens: int = 0) -> Reservation:
        """Open a transfer into the first ceil(prompt_len / page_size) pages the pool already
        gave `request_id`, bound to the prompt whose token ids hash to `prompt_digest`
        (kv_transfer.frame.prompt_digest).  The first `cached_tokens` (a multiple of the page
        size, below prompt_len) are the request's cached prefix, exactly the leading pages the
        pool holds for it as cached (`PagePool.cached_pages`): frames may only write the pages
        after it.  `timeout_s` (default: the receiver's) ends it when no frame arrives
        for that long.  Returns the reservation (its `transfer_id` goes to the sender); raises
        ValueError, reserving nothing, on a bad argument."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if timeout_s <= 0:
            raise ValueError(f"transfer timeout_s={timeout_s} must be > 0")
        pages = prompt_pages(self.pool, request_id, prompt_len, cached_tokens)
        if len(prompt_digest) != PROMPT_DIGEST_BYTES:
            raise ValueError(f"prompt digest of {len(prompt_digest)} bytes, expected {PROMPT_DIGEST_BYTES}")
        tid = new_transfer_id()
        tag = ownership_tag(self._secret, tenant, request_id, tid, prompt_digest)
        res = Reservation(tid, request_id, tenant, tag, prompt_len, bytes(prompt_digest), pages,
                          self.pool.kv.shape[0], self.pool.page_size, self._clock() + timeout_s, timeout_s,
                          cached_tokens=cached_tokens)
        with self._lock:
            self._live[tid] = res
        return res

    def release(self, transfer_id: bytes, reason: Refusal = Refusal.CANCELLED) -> Reservation | None:
        """End the transfer (failing it with `reason` unless it already ended), wait until no
        write into its pages is running, and forget it.  After this returns the owner may
        free the pages.  Returns the reservation, or None if it was unknown."""
        with self._lock:
            res = self._live.get(transfer_id)
            if res is None:
                return None
            if not res.terminal:
                self._fail(res, reason, "released by the pool owner")
            self._lock.wait_for(lambda: res.writers == 0)
            del self._live[transfer_id]
            self._gone[transfer_id] = res.request_id
            while len(self._gone) > TOMBSTONES:
                self._gone.popitem(last=False)
        return res

    def expire(self) -> list[Reservation]:
        """Fail every open transfer whose timeout passed; returns them (the owner releases them)."""
        now = self._clock()
        with self._lock:
            # a transfer with a write in progress is not idle, however slow this side is
            late = [r for r in self._live.values() if not r.terminal and r.deadline <= now
                    and r.writers == 0]
            for res in late:
                self._fail(res, Refusal.EXPIRED, f"no frame for {res.timeout_s}s")
        return late

    def get(self, transfer_id: bytes) -> Reservation | None:
        with self._lock:
            return self._live.get(transfer_id)

    @property
    def open_transfers(self) -> int:
        with self._lock:
            return sum(not r.terminal for r in self._live.values())

    # ---- the transports' side ----------------------------------------------------
    @staticmethod
    def hello(versions: list[int]) -> int:
        """The highest protocol version both sides speak; raises BAD_VERSION if none."""
        common = set(versions) & set(SUPPORTED_VERSIONS)
        if not common:
            raise TransferRefused(Refusal.BAD_VERSION, f"sender speaks {sorted(versions)}, "
                                  f"receiver speaks {list(SUPPORTED_VERSIONS)}")
        return max(common)

    def receive(self, h: pb.FrameHeader, payload: Buffer) -> None:
        """Verify one frame and write it into its reserved page.  Raises TransferRefused
        (having written nothing, and failing the transfer if it was open) on any refusal.

        One locked step admits the frame (tag, geometry, a new (page, layers), the page still
        the reservation's) and claims its (page, layers), so `release` waits for it; the
        checksum is then verified over the payload where the transport put it, and only a
        verified payload of a transfer still open is copied into the page (I2).  The frame's
        canonical header bytes are hashed once and kept with its record for the post-commit
        re-check."""
        self.hooks.before_receive(h)
        with self._lock:
            res = self._checked(h)

            def admissible() -> None:
                res.check_geometry(h, len(payload), self.pool)
                res.check_uncached(h)
                res.check_new(h)
                self._check_page(res, res.pages[h.page_index])
            self._guard(res, admissible)
            record = res.claim(h)
        t0 = perf_counter()
        record.head = header_bytes(h)
        ok = checksum_of(record.head, [payload]) == h.checksum
        self.checksum_s += perf_counter() - t0
        with self._lock:
            try:
                self._checked(h)              # no other frame failed the transfer meanwhile
                if not ok:
                    self._refuse(res, Refusal.BAD_CHECKSUM, f"frame seq {h.seq} page {h.page_index}: "
                                 f"header + payload do not match")
            except TransferRefused:
                self._unclaim(res)
                raise
        try:
            if not self.hooks.skip_write(h, lambda: holds_block(self.pool, record.page, h.layer_start, h.layer_end,
                                                               h.num_tokens, payload)):
                write_payload(self.pool, record.page, h.layer_start, h.layer_end, h.num_tokens, payload)
        except BaseException as e:
            with self._lock:
                self._unclaim(res)
                self._refuse(res, Refusal.TRANSPORT, f"writing frame seq {h.seq} failed: {e!r}")
        with self._lock:
            self._unclaim(res)
            if res.page_complete(h.page_index) and res.state == State.RECEIVING:
                self.pool.mark_written(res.request_id, [record.page])
            res.deadline = self._clock() + res.timeout_s
            self.accepted_frames += 1
            self.accepted_bytes += len(payload)

    def _unclaim(self, res: Reservation) -> None:
        """A claimed write is over (written or refused): `release` may go on.  Lock held."""
        res.writers -= 1
        self._lock.notify_all()

    def stream_closed(self, transfer_id: bytes) -> None:
        """A transport's stream ended without `transfer_id`'s commit: fail the transfer.
        Transports call this only for transfers the stream proved it owns (a frame that
        `receive` accepted), never for one it merely named in a Hello.  A transfer still
        RESERVED has accepted no frame from any stream, so this leaves it open (its own
        timeout ends it)."""
        with self._lock:
            res = self._live.get(transfer_id)
            if res is not None and res.state == State.RECEIVING:
                self._count(transfer_id, Refusal.STREAM_CLOSED)
                self._fail(res, Refusal.STREAM_CLOSED, "the stream ended before the commit")

    def commit(self, c: pb.Commit) -> Reservation:
        """Close the transfer: coverage, digest and a re-checksum of the destination pages.
        Returns the committed reservation; raises TransferRefused (failing it) otherwise."""
        with self._lock:
            res = self._checked(c)
            self._lock.wait_for(lambda: res.writers == 0)
            self._guard(res, lambda: res.check_coverage(c))
            records = list(res.frames.values())
        t0 = perf_counter()
        bad = [r.header.seq for r in records
               if checksum_of(r.head, list[Buffer](block_parts(self.pool, r.page, r.header.layer_start,
                                                               r.header.layer_end, r.header.num_tokens)))
               != r.header.checksum]
        self.checksum_s += perf_counter() - t0
        with self._lock:
            self._checked(c)
            if bad:
                self._guard(res, lambda: self._raise(Refusal.RECHECK_FAILED, f"destination pages of frames "
                                                     f"{bad[:8]} do not hash as sent"))

            def pages_unchanged() -> None:     # and the cached prefix is still the pages it was given
                for i, ref in enumerate(res.pages):
                    self._check_page(res, ref, cached=i < res.first_page)
            self._guard(res, pages_unchanged)
            res.state, res.first_token_id, res.first_logprob = State.COMMITTED, c.first_token_id, c.first_logprob
            res.first_top = dict(zip(c.first_top_ids, c.first_top_logprobs))
            self.committed += 1
        if self._on_committed is not None:
            self._on_committed(res)
        return res

    # ---- checks (called with the lock held) ----------------------------------------
    def _checked(self, msg: pb.FrameHeader | pb.Commit) -> Reservation:
        """The open reservation `msg` (a frame header or a commit) is for, if its version, tag,
        tenant and request match; refuses otherwise."""
        tid, version, tag = msg.transfer_id, msg.protocol_version, msg.ownership_tag
        tenant, request_id = msg.tenant, msg.request_id
        res = self._live.get(tid)
        if version != PROTOCOL_VERSION:
            self._refuse(res, Refusal.BAD_VERSION, f"protocol version {version}, receiver speaks "
                         f"{list(SUPPORTED_VERSIONS)}", tid)
        if res is None:
            code = Refusal.EXPIRED if tid in self._gone else Refusal.UNKNOWN_TRANSFER
            self._refuse(None, code, f"transfer {tid.hex()[:16]}", tid)
        if res.state == State.COMMITTED:
            self._refuse(None, Refusal.AFTER_COMMIT, f"transfer of {res.request_id} is committed", tid)
        if res.state == State.FAILED:
            self._refuse(None, Refusal.AFTER_FAILURE, f"transfer of {res.request_id} failed: {res.reason}", tid)
        if not (tags_equal(tag, res.tag) and tenant == res.tenant and request_id == res.request_id):
            if self._other_prompt(res, msg):
                self._refuse(res, Refusal.PROMPT_MISMATCH, f"{request_id!r}: KV computed for another prompt "
                             f"than the one reserved (digest "
                             f"{msg.prompt_digest.hex()[:16]}, reserved {res.prompt_digest.hex()[:16]})")
            self._refuse(res, Refusal.BAD_TAG, f"frame for ({tenant!r}, {request_id!r}) does not match "
                         f"the reservation of {res.request_id!r}")
        if msg.prompt_digest != res.prompt_digest:
            self._refuse(res, Refusal.PROMPT_MISMATCH, f"{request_id!r}: the frame states prompt digest "
                         f"{msg.prompt_digest.hex()[:16]}, reserved {res.prompt_digest.hex()[:16]}")
        return res

    def _other_prompt(self, res: Reservation, msg: pb.FrameHeader | pb.Commit) -> bool:
        """Whether `msg`'s tag is valid for this transfer, but over another prompt's digest (a
        sender that knows the secret computed another prompt; only run when the tag failed)."""
        if msg.prompt_digest == res.prompt_digest or msg.tenant != res.tenant or msg.request_id != res.request_id:
            return False
        return tags_equal(msg.ownership_tag, ownership_tag(self._secret, res.tenant, res.request_id,
                                                           res.transfer_id, msg.prompt_digest))

    def _check_page(self, res: Reservation, ref: PageRef, cached: bool = False) -> None:
        """Raises STALE_PAGE unless `ref` still has its generation and belongs to the request (a
        page frames write) or to the cache (a page of the cached prefix)."""
        owner, gen = self.pool.owner(ref.page), self.pool.generation(ref.page)
        want = CACHED if cached else res.request_id
        if owner != want or gen != ref.generation:
            self._raise(Refusal.STALE_PAGE, f"page {ref.page} is now ({owner}, generation {gen}), "
                        f"reserved as ({want}, generation {ref.generation})")

    def _guard(self, res: Reservation, check: Callable[[], object]) -> None:
        try:
            check()
        except TransferRefused as e:
            assert isinstance(e.reason, Refusal), e    # raised by this side's own checks
            self._refuse(res, e.reason, e.detail)

    @staticmethod
    def _raise(reason: Refusal, detail: str) -> NoReturn:
        raise TransferRefused(reason, detail)

    def _count(self, tid: bytes, reason: Refusal) -> None:
        self.refused[reason.value] += 1
        self.refusal_log.append((tid.hex(), reason.value))

    def _refuse(self, res: Reservation | None, reason: Refusal, detail: str, tid: bytes = b"") -> NoReturn:
        self._count(res.transfer_id if res is not None else tid, reason)
        if res is not None and not res.terminal:
            self._fail(res, reason, detail)
        raise TransferRefused(reason, detail)

    def _fail(self, res: Reservation, reason: Refusal, detail: str) -> None:
        res.fail(reason, detail)
        self.failure_log.append((res.transfer_id.hex(), reason.value))
        self._lock.notify_all()
        if self._on_failed is not None:
            self._on_failed(res)
