"""The senders' side of `chaos.protocol_model`: how big the world is, what each request's
prompt is, and the frames and commit a real `TransferSender` builds for it.

Every request's prompt starts with the same `Bounds.shared_pages` pages of tokens (so their
page keys agree there, and a later request can find an earlier one's pages in the cache), then
tokens of its own.  The sender reads from a prefill pool whose page i of request r holds the
byte `Bounds.identity(r, i)` everywhere, so every frame's payload names its request and page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.kv_pool import PagePool
from engine.prefix_cache import cache_salt
from kv_transfer.pages import Payload, pool_bytes
from kv_transfer.sender import TransferSender, TransferTicket
from proto import kv_transfer_pb2 as pb

SECRET = b"protocol-model-cluster-secret-32"
TENANT = "acme"
SALT = cache_salt(SECRET, TENANT)      # the tenant's prefix-cache salt


@dataclass(frozen=True)
class Bounds:
    """How big a world the model explores (every field a bound of the search)."""
    requests: int = 2            # request ids r0, r1, ... admitted in this order
    pages_per_request: int = 2   # prompt pages of every request (all full)
    pool_pages: int = 3          # fewer than requests * pages_per_request: pages are reused
    layers: int = 1              # one frame per (page, layer)
    page_size: int = 2
    shared_pages: int = 1        # leading prompt pages every request's prompt shares (cacheable)
    max_depth: int = 40          # actions on one path; deeper states are not expanded

    def __post_init__(self) -> None:
        if not 1 <= self.pages_per_request <= self.pool_pages:
            raise ValueError(f"pages_per_request={self.pages_per_request} must be in "
                             f"[1, pool_pages={self.pool_pages}]")
        if not 0 <= self.shared_pages < self.pages_per_request:
            raise ValueError(f"shared_pages={self.shared_pages} must be in [0, pages_per_request="
                             f"{self.pages_per_request}): prompts must differ")
        if self.requests * self.pages_per_request >= 255:
            raise ValueError("identity bytes run out: requests * pages_per_request must be < 255")

    @property
    def prompt_len(self) -> int:
        return self.pages_per_request * self.page_size

    def prompt(self, request: int) -> list[int]:
        """Request `request`'s token ids: the shared pages' tokens (0), then its own (request + 1)."""
        shared = self.shared_pages * self.page_size
        return [0] * shared + [request + 1] * (self.prompt_len - shared)

    def identity(self, request: int, page_index: int) -> int:
        """The byte of every payload byte of request `request`'s page `page_index` (0: none)."""
        return 1 + request * self.pages_per_request + page_index

    def writer(self, identity: int) -> tuple[int, int]:
        """(request, page index) of an identity byte."""
        return divmod(identity - 1, self.pages_per_request)


def model_pool(bounds: Bounds, pages: int, cache: bool = True) -> PagePool:
    """A float32 pool of one head of width one (a page's layer is 2 * page_size * 4 bytes); with
    `cache`, its prefix cache on and every published page hashed (`audit`)."""
    return PagePool(pages, bounds.page_size, bounds.layers, 1, 1, torch.float32, enable_prefix_cache=cache,
                    audit=cache)


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


def build_frames(bounds: Bounds, request: int, ticket: TransferTicket, first_page: int
                 ) -> tuple[list[Frame], pb.Commit]:
    """The frames (one per page from `first_page` on and layer) and the commit a sender builds
    for `ticket` from a prefill pool holding request `request`'s identity bytes."""
    src = model_pool(bounds, bounds.pages_per_request, cache=False)
    pages = src.allocate(ticket.request_id, bounds.pages_per_request)
    for i, page in enumerate(pages):
        pool_bytes(src)[:, :, page] = bounds.identity(request, i)
    stream = _Capture()
    sender = TransferSender(stream, ticket, SECRET, src, pages, bounds.prompt_len,
                            cached_tokens=first_page * bounds.page_size)
    for layer in range(bounds.layers):
        sender.send_layers(layer, layer + 1)
    sender.commit(first_token_id=1, first_logprob=0.0)
    frames = [Frame(h, p, bounds.identity(request, h.page_index)) for h, p in stream.frames]
    return frames, stream.commits[0]
