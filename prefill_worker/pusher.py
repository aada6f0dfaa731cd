"""Pushes one request's pages to its decode worker on a thread of its own, layer group by
layer group as prefill computes them, then the commit; frees the prefill pages at the end,
whatever happened."""

from __future__ import annotations

import queue
import threading
from typing import Callable

import torch

from kv_transfer.errors import TransferRefused
from kv_transfer.sender import TransferSender, TransferTicket
from kv_transfer.transport import TransportConfig, connect


class Pusher:
    def __init__(self, ticket: TransferTicket, endpoint: str, secret: bytes, pool, page_table: list[int],
                 prompt_len: int, config: TransportConfig, on_done: Callable[[str | None, int], None],
                 faults=None):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._args = (ticket, endpoint, secret, pool, page_table, prompt_len, config, faults)
        self._on_done = on_done           # (error or None, frames sent)
        self._thread = threading.Thread(target=self._run, name=f"push-{ticket.request_id}", daemon=True)
        self._thread.start()

    def layers(self, l0: int, l1: int, ready: torch.cuda.Event | None = None) -> None:
        """Layers [l0, l1) of every prompt page are computed (once `ready` has fired, on CUDA)."""
        self._q.put(("layers", l0, l1, ready))

    def commit(self, token: int, logprob: float, top: dict[int, float] | None) -> None:
        self._q.put(("commit", token, logprob, top))

    def cancel(self, why: str) -> None:
        self._q.put(("cancel", why))

    def _run(self) -> None:
        ticket, endpoint, secret, pool, table, prompt_len, config, faults = self._args
        sender, error = None, None
        try:
            stream = connect(endpoint, ticket.transfer_id, config, sender="prefill")
            sender = TransferSender(stream, ticket, secret, pool, table, prompt_len, faults=faults)
            while True:
                item = self._q.get()
                if item[0] == "layers":
                    if item[3] is not None:
                        item[3].synchronize()
                    sender.send_layers(item[1], item[2])
                elif item[0] == "commit":
                    sender.commit(item[1], item[2], item[3])
                    break
                else:
                    stream.close()
                    error = f"CANCELLED: {item[1]}"
                    break
        except TransferRefused as e:
            error = str(e)
        except Exception as e:  # a bug or a dead peer: the request fails with a coded error
            error = f"TRANSPORT: {e!r}"
        self._on_done(error, len(sender.checksums) if sender else 0)
