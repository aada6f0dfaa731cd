"""Small pools, captured frames and a ready transfer for the KV transfer tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_pool import PagePool
from kv_transfer.frame import prompt_digest
from kv_transfer.hooks import PLAIN_SENDER, SenderHooks
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import Reservation
from kv_transfer.sender import TransferSender, TransferTicket
from proto import kv_transfer_pb2 as pb

SECRET = bytes(range(32))
LAYERS, PAGE, HEADS, DIM = 3, 4, 2, 8


def prompt_ids(rid: str, prompt_len: int) -> list[int]:
    """The token ids of `rid`'s prompt in these tests (distinct per request id)."""
    base = sum(rid.encode()) * 131
    return [(base + i) % 50_000 for i in range(prompt_len)]


def digest_of(rid: str, prompt_len: int) -> bytes:
    """prompt_digest of `rid`'s test prompt: what a reservation and a ticket for it carry."""
    return prompt_digest(prompt_ids(rid, prompt_len))


def make_pool(num_pages: int = 16, seed: int = 0) -> PagePool:
    """A bf16 pool full of random bytes (stale data from 'earlier requests')."""
    pool = PagePool(num_pages, PAGE, LAYERS, HEADS, DIM, torch.bfloat16)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


class CaptureStream:
    """A SenderStream that keeps every frame instead of sending it."""

    def __init__(self):
        self.frames: list[tuple[pb.FrameHeader, bytes]] = []
        self.commits: list[pb.Commit] = []
        self.closed = False

    def stage(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def send(self, header: pb.FrameHeader, payload: torch.Tensor) -> None:
        h = pb.FrameHeader()
        h.CopyFrom(header)
        self.frames.append((h, payload.reshape(-1).view(torch.uint8).numpy().tobytes()))

    def flush(self) -> None:
        pass

    def commit(self, commit: pb.Commit) -> pb.PushReply:
        self.commits.append(commit)
        return pb.PushReply(ok=True)

    def close(self) -> None:
        self.closed = True


@dataclass
class Transfer:
    """A reservation on `dst` and the frames + commit a sender built for it from `src`."""
    res: Reservation
    frames: list[tuple[pb.FrameHeader, bytes]]
    commit: pb.Commit
    rid: str
    prompt_len: int


def prepare(src: PagePool, dst: PagePool, receiver: TransferReceiver, rid: str, prompt_len: int,
            tenant: str = "acme", extra_pages: int = 1, groups=((0, 2), (2, LAYERS)),
            secret: bytes = SECRET, hooks: SenderHooks = PLAIN_SENDER,
            sent_digest: bytes | None = None) -> Transfer:
    """`sent_digest`: the prompt digest the sender states (default: that of rid's prompt, the
    one reserved)."""
    src.allocate(rid, src.pages_for(prompt_len))
    dst.allocate(rid, dst.pages_for(prompt_len) + extra_pages)
    res = receiver.reserve(rid, tenant, prompt_len, digest_of(rid, prompt_len))
    sent = digest_of(rid, prompt_len) if sent_digest is None else sent_digest
    cap = CaptureStream()
    sender = TransferSender(cap, TransferTicket(res.transfer_id, rid, tenant, sent), secret, src,
                            src.page_table(rid), prompt_len, hooks=hooks)
    for l0, l1 in groups:
        sender.send_layers(l0, l1)
    sender.commit(first_token_id=7, first_logprob=-0.25)
    return Transfer(res, cap.frames, cap.commits[0], rid, prompt_len)


def copy_header(h: pb.FrameHeader, **changes) -> pb.FrameHeader:
    c = pb.FrameHeader()
    c.CopyFrom(h)
    for k, v in changes.items():
        if k == "shape":
            del c.shape[:]
            c.shape.extend(v)
        else:
            setattr(c, k, v)
    return c


def copy_commit(c: pb.Commit, **changes) -> pb.Commit:
    out = pb.Commit()
    out.CopyFrom(c)
    for k, v in changes.items():
        setattr(out, k, v)
    return out


def pages_equal(src: PagePool, dst: PagePool, rid: str, prompt_len: int) -> bool:
    for i, (a, b) in enumerate(zip(src.page_table(rid), dst.page_table(rid))):
        n = min(src.page_size, prompt_len - i * src.page_size)
        if n <= 0:
            break
        if not torch.equal(src.kv[:, :, a, :n], dst.kv[:, :, b, :n]):
            return False
    return True


def open_transfer(src: PagePool, dst: PagePool, recv: TransferReceiver, server, rid: str,
                  faults: SenderHooks, prompt_len: int) -> tuple[Reservation, TransferSender]:
    """Pages for `rid` on both sides, a reservation on `recv`, and a sender (through `server`'s
    endpoint, with the fault hooks `faults`) that has sent nothing yet."""
    from kv_transfer.transport import connect
    src.allocate(rid, src.pages_for(prompt_len))
    dst.allocate(rid, dst.pages_for(prompt_len) + 1)
    res = recv.reserve(rid, "acme", prompt_len, digest_of(rid, prompt_len))
    sender = TransferSender(connect(server.endpoint, res.transfer_id, secret=SECRET),
                            TransferTicket(res.transfer_id, rid, "acme", res.prompt_digest), SECRET, src,
                            src.page_table(rid), prompt_len, hooks=faults)
    return res, sender


def end_transfer(src: PagePool, dst: PagePool, recv: TransferReceiver, res: Reservation, rid: str) -> None:
    """Release the reservation and free the request's pages on both pools."""
    recv.release(res.transfer_id)
    dst.free(rid)
    src.free(rid)


def assert_engines_idle(engines: list) -> None:
    """I6 for `engines` (`engine.LLM`s): every pool intact and fully free, no work left."""
    for llm in engines:
        llm.pool.check_integrity()
        assert llm.pool.num_free == llm.pool.num_pages, \
            f"{llm.pool.num_pages - llm.pool.num_free} KV pages still in use after the test"
        assert not llm.scheduler.has_work()
