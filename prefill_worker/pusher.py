"""Pushes one request's pages to its decode worker on a thread of its own, layer group by
layer group as prefill computes them, then the commit.  It never frees a page: when the push
ends, acknowledged or failed, it reports to its owner (`on_done`), and the prefill role frees
the pages on the worker loop's thread."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from engine.kv_pool import PagePool
from kv_transfer.errors import TransferRefused
from kv_transfer.hooks import PLAIN_SENDER, SenderHooks
from kv_transfer.sender import TransferSender, TransferTicket
from kv_transfer.transport import TransportConfig, connect


@dataclass(frozen=True)
class Layers:
    """Layers [start, end) of every prompt page are computed (once `ready` fired, on CUDA)."""
    start: int
    end: int
    ready: torch.cuda.Event | None


@dataclass(frozen=True)
class Commit:
    """The prompt is complete: commit with prefill's first token."""
    token: int
    logprob: float
    top: dict[int, float] | None


@dataclass(frozen=True)
class Cancel:
    why: str


PushStep = Layers | Commit | Cancel


@dataclass(frozen=True)
class PushPlan:
    """What one push sends, and to whom."""
    ticket: TransferTicket
    endpoint: str
    secret: bytes
    pool: PagePool
    page_table: list[int]
    prompt_len: int
    transport: TransportConfig
    hooks: SenderHooks = PLAIN_SENDER
    cached_tokens: int = 0    # the decode side's cached prefix: its pages are not sent


class Pusher:
    def __init__(self, plan: PushPlan, on_done: Callable[[str | None, int], None]):
        self._q: queue.SimpleQueue[PushStep] = queue.SimpleQueue()
        self._plan = plan
        self._on_done = on_done           # (error or None, frames sent)
        self._thread = threading.Thread(target=self._run, name=f"push-{plan.ticket.request_id}", daemon=True)
        self._thread.start()

    def layers(self, l0: int, l1: int, ready: torch.cuda.Event | None = None) -> None:
        """Layers [l0, l1) of every prompt page are computed (once `ready` has fired, on CUDA)."""
        self._q.put(Layers(l0, l1, ready))

    def commit(self, token: int, logprob: float, top: dict[int, float] | None) -> None:
        self._q.put(Commit(token, logprob, top))

    def cancel(self, why: str) -> None:
        self._q.put(Cancel(why))

    def _run(self) -> None:
        p = self._plan
        sender, error = None, None
        try:
            stream = connect(p.endpoint, p.ticket.transfer_id, p.transport, sender="prefill", secret=p.secret)
            sender = TransferSender(stream, p.ticket, p.secret, p.pool, p.page_table, p.prompt_len, p.hooks,
                                    cached_tokens=p.cached_tokens)
            while True:
                item = self._q.get()
                if isinstance(item, Layers):
                    if item.ready is not None:
                        item.ready.synchronize()
                    sender.send_layers(item.start, item.end)
                elif isinstance(item, Commit):
                    sender.commit(item.token, item.logprob, item.top)
                    break
                else:
                    stream.close()
                    error = f"CANCELLED: {item.why}"
                    break
        except TransferRefused as e:
            error = str(e)
        except Exception as e:  # a bug or a dead peer: the request fails with a coded error
            error = f"TRANSPORT: {e!r}"
        self._on_done(error, len(sender.checksums) if sender else 0)
