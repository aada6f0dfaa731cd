"""Fault injectors on the receiving side and in a worker's memory (the sending side's are in
`chaos/sender_faults.py`).  None of them exists in a worker unless a chaos run starts one
(`chaos.cluster`'s worker actors, or `python -m chaos.worker`): `ReceiverFaults` is then
installed as the worker's `kv_transfer.hooks.ReceiverHooks` through
`WorkerHandle.install_transfer_hooks`, and the run arms the points by name, one scenario at a
time.

    point           where                        what must catch it
    unwritten_page  decode: a verified frame is   the commit's re-checksum of the destination
                    marked written, bytes skipped pages (RECHECK_FAILED)
    stall           decode: the receiver reads    nothing: the transfer must still succeed
                    nothing for `seconds`          (or expire with an explicit error)
    corrupt_expert  any worker: one bit of a       verify mode (`verify_experts`): the slot is
                    resident expert slot flipped   compared before its next use or eviction
    pace            any worker: its engine loop    nothing: its streams are slower, their tokens
                    makes one step per `seconds`   the same (the moving scenarios use it to hold
                    or fewer                       streams mid-way while they kill or drain)
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from engine.experts import PagedExperts
from proto import kv_transfer_pb2 as pb

RECEIVER_POINTS = ("unwritten_page", "stall")
LOG_SIZE = 1 << 16
PACE_POLL_S = 0.0005    # pace: how often the pacer looks whether the loop made its step
PACE_IDLE_S = 0.02      # pace: the longest it leaves the lock free when nothing progresses


@dataclass
class Armed:
    times: int              # injections left
    probability: float
    seconds: float


class ReceiverFaults:
    """The receiving side's fault points, as `kv_transfer.hooks.ReceiverHooks` (installed with
    `TransferReceiver.install_hooks`, or on a worker with `WorkerHandle.install_transfer_hooks`).
    Unarmed, it changes nothing.  Each armed point fires on a frame with `probability`, at most
    `times` times, at most once per transfer; `log` records (point, transfer id hex) of every
    injection."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._armed: dict[str, Armed] = {}
        self._faulted: OrderedDict[bytes, None] = OrderedDict()
        self.fired: Counter[str] = Counter()
        self.log: deque[tuple[str, str]] = deque(maxlen=LOG_SIZE)

    def arm(self, point: str, times: int = 1, probability: float = 1.0, seconds: float = 0.0,
            after: int = 0) -> None:
        """Let `point` fire on up to `times` transfers, each frame with `probability` (`after`
        is the sender's option, ignored here).  Raises ValueError for an unknown point or value."""
        if point not in RECEIVER_POINTS:
            raise ValueError(f"unknown receiver fault {point!r}; known: {', '.join(RECEIVER_POINTS)}")
        if times < 1 or not 0.0 < probability <= 1.0 or seconds < 0:
            raise ValueError(f"fault {point}: times={times} (>= 1), probability={probability} "
                             f"(in (0, 1]), seconds={seconds} (>= 0)")
        with self._lock:
            self._armed[point] = Armed(times, probability, seconds)

    def disarm(self) -> None:
        with self._lock:
            self._armed.clear()

    def _fires(self, point: str, h: pb.FrameHeader, effective: Callable[[], bool] | None = None) -> float | None:
        """The point's seconds when it fires on this frame, else None.  `effective`: whether
        firing here changes anything; a fault that would change nothing is not injected."""
        with self._lock:
            rule = self._armed.get(point)
            if rule is None or rule.times <= 0 or h.transfer_id in self._faulted:
                return None
            if self._rng.random() >= rule.probability:
                return None
            if effective is not None and not effective():
                return None
            rule.times -= 1
            self._faulted[h.transfer_id] = None
            while len(self._faulted) > LOG_SIZE:
                self._faulted.popitem(last=False)
            self.fired[point] += 1
            self.log.append((point, h.transfer_id.hex()))
            return rule.seconds

    def before_receive(self, h: pb.FrameHeader) -> None:
        """Called before the receiver reads a frame: a stall sleeps here."""
        seconds = self._fires("stall", h)
        if seconds:
            time.sleep(seconds)

    def skip_write(self, h: pb.FrameHeader, holds_payload: Callable[[], bool]) -> bool:
        """Called in place of the page write: True means 'mark written, copy nothing'.  Never on
        a page that already holds the frame's bytes (a page reused from an earlier request with
        the same prompt, another tenant's with the prefix cache): skipping that copy leaves the
        page right, so there would be nothing for the re-checksum to find."""
        return self._fires("unwritten_page", h, lambda: not holds_payload()) is not None


class Pacer:
    """Slows a worker's engine loop to one step per `seconds` or slower while it runs.  A thread
    holds the worker's lock (the one the loop takes to schedule a batch and to apply its
    output) for `seconds`, then leaves it free until the loop has applied one step's output
    (`progress`, a count the token path changes, moved) and takes it again: the next step's
    output waits for the next hold.  A floor on the time per token that no machine's speed
    lowers (a loaded one only adds to it); nothing else changes: the same tokens, later.
    Threads that need the lock for other work (admission, a commit, the chaos run's own calls)
    wait up to one hold too.  While nothing progresses (idle, or waiting for KV) the lock is
    left free for PACE_IDLE_S between holds.  Unused it costs nothing: no thread exists until
    `start`."""

    def __init__(self, lock: threading.RLock, progress: Callable[[], int]) -> None:
        """`progress`: a count that changes whenever the loop applies a step's output (read
        without the lock, so it must be safe to read while the loop runs)."""
        self._lock, self._progress = lock, progress
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, seconds: float) -> None:
        """Pace at one step per `seconds` or slower from now on (replaces an earlier pace).
        Raises ValueError unless 0 < seconds <= 1."""
        if not 0.0 < seconds <= 1.0:
            raise ValueError(f"pace: seconds={seconds} must be in (0, 1] (one engine step)")
        self.stop()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._stop, seconds), name="chaos-pace",
                                        daemon=True)
        self._thread.start()

    def _run(self, stop: threading.Event, hold_s: float) -> None:
        while not stop.is_set():
            with self._lock:
                seen = self._progress()
                stop.wait(hold_s)
            end = time.monotonic() + PACE_IDLE_S        # the loop's turn: one step's output
            while not stop.wait(PACE_POLL_S) and self._progress() == seen and time.monotonic() < end:
                pass

    def stop(self) -> None:
        """Stop pacing (the lock is free when this returns)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None


class HasPagedExperts(Protocol):
    def paged_experts(self) -> dict[int, PagedExperts]:
        """MoE layer index -> its paged experts (an `EngineCore`, an `LLM`)."""
        ...


def corrupt_expert(llm: HasPagedExperts, rng: random.Random) -> tuple[int, int, int] | None:
    """Flip one exponent bit of a random resident expert slot of a random paged MoE layer.
    Returns (layer, slot, expert), or None when the model pages no experts (or the chosen
    layer has no intact slot left)."""
    layers = llm.paged_experts()
    if not layers:
        return None
    layer = rng.choice(sorted(layers))
    slots = layers[layer].slots
    first, held = slots.tensors()[0], slots.store.tensors()[0]  # w13 (or its first quantized part)
    intact = [s for s, e in enumerate(slots.expert_in)        # one flip per slot until repaired:
              if e >= 0 and torch.equal(first[s], held[e].to(first.device))]
    if not intact:                                              # each injection is one finding
        return None
    slot = rng.choice(intact)
    size = first.element_size()
    raw = first[slot].view(-1).view(torch.uint8)
    raw[rng.randrange(raw.numel() // size) * size + size - 1] ^= 0x40   # an exponent bit (little-endian)
    return layer, slot, slots.expert_in[slot]
