"""Frames a one-sided transport (NIXL) writes straight into the reserved pages.

A one-sided sender writes page bytes without the receiver's code running, so I2 is kept in
its amended form for one-sided transports: no page such a transfer wrote is read, kept,
marked written or published before its frame checksums and the commit's coverage verify; a
failed verify releases the pages through the receiver's usual path.  The pieces:

    expose(tid, tag, make)   the sender proved the transfer's tag: `make` registers exactly the
                             reservation's sent pages for it (never the whole pool) -> an Exposure
    receive_in_place(h)      a frame's header after its bytes landed: admitted like any frame
                             (tag, geometry, new (page, layers), page still the reservation's),
                             nothing copied, nothing marked written
    commit                   coverage, then the exposure ends (revoked: no new write can aim at
                             the pages; quiet: no write already posted can still land), then each
                             in-place frame is verified over the page where it lies — for these
                             frames the verify and the post-commit re-check are the same pass
    release                  ends the exposure before the owner may free the pages (I5)

These are the receiver's own steps (TransferReceiver.expose, receive_in_place, commit and
release call them) and use its lock, table and refusal helpers.

An Exposure's `quiet` is the transport's promise that its peer has no write in flight: the NIXL
sender sends its commit only after every write it posted completed, and waits for its writes
before it closes the connection, so either event makes the exposure quiet.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Protocol

from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.frame import header_bytes, tags_equal
from kv_transfer.pages import block_nbytes
from kv_transfer.reservation import Reservation, State
from proto import kv_transfer_pb2 as pb

if TYPE_CHECKING:
    from kv_transfer.receiver import TransferReceiver

log = logging.getLogger(__name__)
QUIESCE_S = 10.0     # how long ending an exposure waits for its peer's writes to be over


class Exposure(Protocol):
    def revoke(self) -> None:
        """No new write can be aimed at the pages (the registration is dropped).  Idempotent."""

    def quiet(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until no write the peer already posted can still land."""


def expose(rx: TransferReceiver, transfer_id: bytes, tag: bytes,
           make: Callable[[Reservation], Exposure]) -> Exposure:
    """Open `transfer_id`'s reservation to one-sided writes once its sender proved the
    transfer's ownership tag.  Raises TransferRefused (failing the transfer for a wrong
    tag) when it is unknown, already exposed, past RESERVED, or the tag does not match."""
    with rx._lock:
        res = rx._live.get(transfer_id)
        if res is None:
            code = Refusal.EXPIRED if transfer_id in rx._gone else Refusal.UNKNOWN_TRANSFER
            rx._refuse(None, code, f"transfer {transfer_id.hex()[:16]}", transfer_id)
        if not tags_equal(tag, res.tag):
            rx._refuse(res, Refusal.BAD_TAG, f"a NIXL sender for {res.request_id!r} "
                       f"stated another transfer's ownership tag")
        if res.state != State.RESERVED or res.exposure is not None:
            rx._refuse(None, Refusal.DUPLICATE, f"transfer of {res.request_id} is already "
                       f"{'open to a sender' if res.exposure else res.state.value}", transfer_id)
        res.writers += 1            # release waits for the registration to be made
    try:
        exposure = make(res)
    except BaseException:
        with rx._lock:
            rx._unclaim(res)
        raise
    with rx._lock:
        res.exposure = exposure
        rx._unclaim(res)
        gone = res.terminal or rx._live.get(transfer_id) is not res
    if gone:                        # ended while its pages were being registered
        exposure.revoke()
        raise TransferRefused(Refusal.AFTER_FAILURE, f"transfer of {res.request_id} ended")
    return exposure


def receive_in_place(rx: TransferReceiver, h: pb.FrameHeader) -> None:
    """Admit a frame whose payload a one-sided write already put in its page.  Raises
    TransferRefused (failing the transfer) on any refusal; the payload is verified at the
    commit."""
    rx.hooks.before_receive(h)
    head = header_bytes(h)
    with rx._lock:
        res = rx._checked(h)
        if res.exposure is None:
            rx._refuse(res, Refusal.TRANSPORT, f"frame seq {h.seq}: transfer of {res.request_id} "
                       f"was not opened to one-sided writes")

        def admissible() -> None:
            nbytes = block_nbytes(rx.pool, h.layer_start, h.layer_end, h.num_tokens)
            res.check_geometry(h, nbytes, rx.pool)
            res.check_uncached(h)
            res.check_new(h)
            rx._check_page(res, res.pages[h.page_index])
            rx.accepted_bytes += nbytes
        rx._guard(res, admissible)
        res.claim(h, in_place=True).head = head
        res.deadline = rx._clock() + res.timeout_s
        rx.accepted_frames += 1


def end_exposure(rx: TransferReceiver, res: Reservation) -> bool:
    """Revoke `res`'s exposure and wait for its writes to be over; False if they were
    not over in QUIESCE_S (logged and counted).  Called without the lock."""
    exposure = res.exposure
    if exposure is None:
        return True
    exposure.revoke()
    if exposure.quiet(QUIESCE_S):
        return True
    with rx._lock:
        rx.unquiet_exposures += 1
    log.warning("transfer of %s: its one-sided sender still had writes in flight %.0f s after "
                "the transfer ended", res.request_id, QUIESCE_S)
    return False


def mark_in_place(rx: TransferReceiver, res: Reservation) -> None:
    """The pages in-place frames wrote are written, now that every frame verified.  Lock held."""
    pages = sorted({r.page for r in res.frames.values() if r.in_place})
    if pages:
        rx.pool.mark_written(res.request_id, pages)
