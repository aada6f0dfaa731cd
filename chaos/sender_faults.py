"""Named fault injection points on the sending side of KV transfers: `FaultInjector`, an
implementation of `kv_transfer.hooks.SenderHooks`.

A worker's senders use the plain hooks (every frame sent as it is) unless a chaos run
installs a `FaultInjector` through `WorkerHandle.install_transfer_hooks`; then every frame
passes through `on_frame`, which may alter, hold, repeat or drop it.  Each armed point fires
a bounded number of times, optionally with a seeded probability, and `fired` counts what was
actually injected (the chaos report compares it with the receivers' refusal counters).

    point            what the receiver should see
    corrupt_payload  one payload bit flipped after the checksum      BAD_CHECKSUM
    alter_header     the header's seq changed after the checksum     BAD_CHECKSUM
    swap_pages       payloads exchanged between two transfers         BAD_CHECKSUM (both; counts 2)
    drop             a frame never sent (then commit)                 INCOMPLETE
    duplicate        a frame sent twice                               DUPLICATE
    reorder          a frame sent after the next one                  (legal: must succeed)
    replay_stale     a frame of a finished transfer sent again        EXPIRED / AFTER_COMMIT / UNKNOWN
    replay_foreign   a finished transfer's frame re-aimed at this one BAD_TAG
    commit_early     commit right after the first frame (placeholder) INCOMPLETE
    delay            sleep `seconds` before sending this frame        (must not break a healthy stream)
    cut              the stream is closed here, without a commit      STREAM_CLOSED
    late_write       this frame sent `seconds` late, after the decode  EXPIRED / AFTER_FAILURE / UNKNOWN
                     side ended the request (a chaos client disconnects meanwhile)
    misbind          from this frame on, the transfer is bound to      PROMPT_MISMATCH
                     another prompt of the same length: each frame
                     states that prompt's digest, tagged with the
                     secret and checksummed (needs `bind_prompts`)
    poison_cached    a delta transfer (the receiver caches the first   CACHED_PAGE
                     pages of the prompt: its first frame is for a
                     later page) also gets a frame of other bytes for
                     the last cached page, tag and checksum valid

A transfer is faulted at most once, so each injection has one refusal to answer for it;
`log` records (point, victim transfer id) for every injection, to be matched with the
receivers' refusal logs.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.frame import frame_checksum, ownership_tag, prompt_digest
from kv_transfer.pages import Payload, payload_view
from kv_transfer.sender import SenderStream, TransferTicket
from proto import kv_transfer_pb2 as pb

Frame = tuple[pb.FrameHeader, Payload]
PromptOf = Callable[[str], Sequence[int] | None]     # request id -> the prompt ids being pushed

POINTS = ("corrupt_payload", "alter_header", "swap_pages", "drop", "duplicate", "reorder",
          "replay_stale", "replay_foreign", "commit_early", "delay", "cut", "late_write", "misbind",
          "poison_cached")
OWN_RULE = ("misbind", "poison_cached")      # points with a rule of their own (not `_actions`)
REPLAYS = ("replay_stale", "replay_foreign")
LOG_SIZE = 1 << 16


@dataclass
class Rule:
    times: int
    after: int              # frames to let pass before the point may fire
    probability: float
    seconds: float
    seen: int = 0


class FaultInjector:
    """The sending side's fault points (`SenderHooks`): unarmed, every frame goes out as it is.
    `arm` and `disarm` may be called from any thread while transfers run."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._rules: dict[str, Rule] = {}
        self._lock = threading.Lock()
        self._held: dict[bytes, list[Frame]] = {}     # transfer id -> frames held back
        self._swap: tuple[TransferTicket, pb.FrameHeader, Payload] | None = None   # waiting for a partner
        self._first: OrderedDict[bytes, Frame] = OrderedDict()   # live transfer -> its first frame
        self._earlier: deque[tuple[bytes, pb.FrameHeader, Payload]] = deque(maxlen=8)   # of ended transfers
        self._faulted: OrderedDict[bytes, None] = OrderedDict()  # transfers already faulted once
        self._misbound: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()   # tid -> (digest, tag)
        self._secret = b""
        self._prompt_of: PromptOf = lambda request_id: None
        self.fired: Counter[str] = Counter()
        self.log: deque[tuple[str, str]] = deque(maxlen=LOG_SIZE)  # (point, victim transfer id hex)

    def bind_prompts(self, secret: bytes, prompt_of: PromptOf) -> None:
        """What `misbind` needs: the cluster secret (to tag frames as this worker may) and a
        lookup of the prompt ids a request's push carries.  Without it `misbind` never fires."""
        self._secret, self._prompt_of = secret, prompt_of

    def arm(self, point: str, times: int = 1, after: int = 0, probability: float = 1.0,
            seconds: float = 0.0) -> None:
        """Let `point` fire on up to `times` transfers, each time with `probability`, once
        `after` frames have passed it.  Raises ValueError for an unknown point or a bad value."""
        if point not in POINTS:
            raise ValueError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}")
        if times < 1 or after < 0 or not 0.0 < probability <= 1.0 or seconds < 0:
            raise ValueError(f"fault {point}: times={times} (>= 1), after={after} (>= 0), "
                             f"probability={probability} (in (0, 1]), seconds={seconds} (>= 0)")
        with self._lock:
            self._rules[point] = Rule(times, after, probability, seconds)

    def disarm(self) -> None:
        """Fire nothing more (frames already held are still sent at their transfer's commit)."""
        with self._lock:
            self._rules.clear()

    def _fires(self, point: str) -> Rule | None:
        rule = self._rules.get(point)
        if rule is None or rule.times <= 0:
            return None
        rule.seen += 1
        if rule.seen <= rule.after or self._rng.random() >= rule.probability:
            return None
        rule.times -= 1
        self.fired[point] += 1
        return rule

    def on_frame(self, ticket: TransferTicket, h: pb.FrameHeader, payload: Payload, stream: SenderStream) -> bool:
        """Send the frame through `stream` as the armed faults say.  Returns True when the
        sender must commit now (commit_early).  Raises TransferRefused(TRANSPORT) for `cut`."""
        tid = ticket.transfer_id
        h = self._rebound(ticket, h, payload)
        poison = self._poison(ticket, h, payload)
        with self._lock:
            held = self._held.pop(tid, [])
            earlier = self._earlier[-1] if self._earlier else None    # never this transfer: it is live
            actions = self._actions(tid, earlier is not None, h.page_index == 0 and h.layer_start == 0)
            if tid not in self._first:
                self._first[tid] = (_copy(h), _keep(payload))
                while len(self._first) > 1024:
                    self._first.popitem(last=False)
            for point in actions:
                if point != "swap_pages":              # logged once the swap really happens
                    victim = earlier[0] if point == "replay_stale" and earlier is not None else tid
                    self.log.append((point, victim.hex()))
        for point in ("delay", "late_write"):
            if actions.get(point):
                time.sleep(actions[point].seconds)
        if actions.get("cut"):
            stream.close()
            raise TransferRefused(Refusal.TRANSPORT, "stream cut by fault injection")
        if actions.get("corrupt_payload"):
            payload = _flipped(payload)
        if actions.get("alter_header"):
            h = _copy(h)
            h.seq += 1000
        out: list[Frame] = [(h, payload)]
        if actions.get("swap_pages") and not self._swap_with(ticket, h, payload, out):
            out = []
        if actions.get("reorder"):
            with self._lock:
                self._held.setdefault(ticket.transfer_id, []).extend(
                    (fh, _keep(fp)) for fh, fp in out)          # the staging buffer is reused
            out = []
        if actions.get("duplicate"):
            out = out + out
        if actions.get("drop"):
            out = []
        if earlier is not None and actions.get("replay_stale"):
            out.append((earlier[1], earlier[2]))
        if earlier is not None and actions.get("replay_foreign"):
            foreign = _copy(earlier[1])
            foreign.transfer_id = ticket.transfer_id
            out.append((foreign, earlier[2]))
        for fh, fp in out + held + poison:       # the poison last: the staged payload went out first
            stream.send(fh, fp)
        if actions.get("late_write"):
            _deliver(stream)
        return bool(actions.get("commit_early"))

    def _rebound(self, ticket: TransferTicket, h: pb.FrameHeader, payload: Payload) -> pb.FrameHeader:
        """The frame as `misbind` sends it: once the point fired on the transfer, every frame
        states the digest of another prompt of the same length (the pushed ids with the last
        one changed), with the tag and checksum a worker holding the secret makes for it."""
        tid = ticket.transfer_id
        with self._lock:
            bound = self._misbound.get(tid)
            if bound is None and tid not in self._faulted and self._secret and self._fires("misbind"):
                ids = self._prompt_of(ticket.request_id)
                if not ids:                            # not this worker's push: fire on another
                    self.fired["misbind"] -= 1
                    self._rules["misbind"].times += 1
                    return h
                other = prompt_digest([*ids[:-1], ids[-1] ^ 1])
                bound = self._misbound[tid] = (other, ownership_tag(
                    self._secret, ticket.tenant, ticket.request_id, tid, other))
                self._faulted[tid] = None
                self.log.append(("misbind", tid.hex()))
                while len(self._misbound) > 1024:
                    self._misbound.popitem(last=False)
        if bound is None:
            return h
        h = _copy(h)
        h.prompt_digest, h.ownership_tag = bound
        h.checksum = frame_checksum(h, [payload_view(payload)])
        return h

    def _poison(self, ticket: TransferTicket, h: pb.FrameHeader, payload: Payload) -> list[Frame]:
        """`poison_cached`: at the first frame (seq 0) of a delta transfer, whose page index is the
        receiver's first uncached page, a frame for the page before it (the last cached one: shared,
        read-only) carrying other bytes, with this transfer's tag and a valid checksum.  Returns
        the frame to send as well (none when the point does not fire)."""
        if h.seq != 0 or h.page_index == 0 or h.num_tokens == 0:
            return []
        tid = ticket.transfer_id
        with self._lock:
            if tid in self._faulted or not self._fires("poison_cached"):
                return []
            self._faulted[tid] = None
            self.log.append(("poison_cached", tid.hex()))
        page_size = h.first_token // h.page_index
        forged = _copy(h)
        forged.page_index, forged.first_token = h.page_index - 1, h.first_token - page_size
        forged.num_tokens = page_size
        forged.seq = h.seq + (1 << 20)                   # a seq no genuine frame of the transfer uses
        forged.shape[2] = page_size                      # [layers, 2, tokens, heads, dim]
        nbytes = len(payload_view(payload)) // h.num_tokens * page_size
        bad: Payload = torch.full((nbytes,), 0x5A, dtype=torch.uint8) if isinstance(payload, torch.Tensor) \
            else b"\x5a" * nbytes
        forged.checksum = frame_checksum(forged, [payload_view(bad)])
        return [(forged, bad)]

    def _actions(self, tid: bytes, can_replay: bool, first: bool) -> dict[str, Rule]:
        """The points that fire on this frame (none once the transfer was faulted).  A placeholder
        (commit_early) commits after the transfer's first frame, never after its last."""
        if tid in self._faulted:
            return {}
        candidates = [p for p in POINTS if p in self._rules and p not in OWN_RULE
                      and (can_replay or p not in REPLAYS) and (first or p != "commit_early")]
        fired = {p: r for p in candidates if (r := self._fires(p)) is not None}
        if fired:
            self._faulted[tid] = None
            while len(self._faulted) > LOG_SIZE:
                self._faulted.popitem(last=False)
        return fired

    def _swap_with(self, ticket: TransferTicket, h: pb.FrameHeader, payload: Payload, out: list[Frame]) -> bool:
        """Pair this frame with one held from another transfer and exchange their payloads.
        Returns False when the frame was held instead (waiting for a partner)."""
        with self._lock:
            partner = self._swap
            if partner is None or partner[0].transfer_id == ticket.transfer_id:
                self.fired["swap_pages"] -= 1            # counted once the swap really happens
                self._rules["swap_pages"].times += 1
                if partner is not None:
                    return True                          # same transfer: send unchanged
                self._swap = (ticket, h, _keep(payload))
                return False
            self._swap = None
            self.fired["swap_pages"] += 1                # two frames corrupted, one per transfer
            ptid, ph, pp = partner[0].transfer_id, partner[1], partner[2]
            self.log.extend([("swap_pages", ptid.hex()), ("swap_pages", ticket.transfer_id.hex())])
            self._faulted[ptid] = None
            # the partner's header with our bytes, sent by the partner's own sender (a stream
            # is used by one thread) with its next frame or before its commit
            self._held.setdefault(ptid, []).append((ph, _keep(payload)))
        out[0] = (h, pp)
        return True

    def after_commit(self, ticket: TransferTicket) -> None:
        """The transfer's commit was answered: its first frame becomes replayable (stale)."""
        with self._lock:
            first = self._first.pop(ticket.transfer_id, None)
            if first is not None:
                self._earlier.append((ticket.transfer_id, *first))

    def before_commit(self, ticket: TransferTicket, stream: SenderStream) -> None:
        """Before commit: send frames still held for this transfer, unchanged."""
        with self._lock:
            held = self._held.pop(ticket.transfer_id, [])
            if self._swap is not None and self._swap[0].transfer_id == ticket.transfer_id:
                _, h, p = self._swap
                held.append((h, p))
                self._swap = None
        for h, p in held:
            stream.send(h, p)


def _deliver(stream: SenderStream, timeout_s: float = 5.0) -> None:
    """Make sure a late frame reaches the receiver before the sender may close the stream
    (a transport that batches frames in the background says when they landed: `settle`)."""
    settle: Callable[[float], object] | None = getattr(stream, "settle", None)
    if settle is not None:
        settle(timeout_s)
    else:
        stream.flush()


def _keep(p: Payload) -> Payload:
    """A payload that outlives the stream's staging buffer."""
    return p.clone() if isinstance(p, torch.Tensor) else p


def _flipped(p: Payload) -> Payload:
    """The payload with its first bit flipped (a copy)."""
    if isinstance(p, torch.Tensor):
        p = p.clone()
        p.view(torch.uint8).view(-1)[0] ^= 1
        return p
    b = bytearray(p)
    b[0] ^= 1
    return bytes(b)


def _copy(h: pb.FrameHeader) -> pb.FrameHeader:
    c = pb.FrameHeader()
    c.CopyFrom(h)
    return c
