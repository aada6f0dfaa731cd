"""How expert weights travel from the host store to a device slot.

A copy engine starts copies and hands back a `Copy` to wait on before the slot is read.
Demand page-ins (a step needs the expert now) are scheduled ahead of prefetches (a guess
about the next step), but on CUDA they still wait for prefetches already queued, which may
write the same slot (precise per-slot ordering is left until it can be measured on a GPU);
`idle()` tells the prefetcher whether the link has time to spare, so prefetches are only
queued while it is free.
  * `DirectCopy`     — a plain synchronous copy (CPU, or tests);
  * `CudaStreamCopy` — copies from pinned memory on two side CUDA streams (demand on a
                       high-priority one), ordered with events, so page-ins and prefetches
                       overlap compute;
  * `EmulatedLink`   — benchmarks on a CPU machine: each copy holds an emulated link for
                       bytes / bandwidth, so a page-in costs what it would over a real link,
                       and prefetches really overlap compute.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch


class Copy(Protocol):
    def wait(self) -> None: ...


class CopyEngine(Protocol):
    """Starts copies into device slots (see the module doc)."""

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: torch.cuda.Event | None = None,
             prefetch: bool = False) -> Copy:
        """Copy every (dst, src) pair, after the event `after` where the engine orders copies;
        one `Copy` covers them all."""
        ...

    def idle(self) -> bool:
        """Whether the link has time to spare (prefetches are queued only then)."""
        ...


class _Done:
    def wait(self) -> None:
        return None


class DirectCopy:
    name = "direct"

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: torch.cuda.Event | None = None,
             prefetch: bool = False) -> Copy:
        """Copy every (dst, src) pair; one `Copy` covers them all."""
        for dst, src in pairs:
            dst.copy_(src)
        return _Done()

    def idle(self) -> bool:
        return True


class _CudaEventCopy:
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class CudaStreamCopy:
    """Demand copies on a high-priority side stream, prefetches on a low-priority one;
    the compute stream waits on each copy's event before reading the slot."""

    name = "cuda-stream"

    def __init__(self, device: torch.device) -> None:
        # torch's stub declares the static priority_range() as an instance method
        low, high = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
        self.demand = torch.cuda.Stream(device=device, priority=high)
        self.background = torch.cuda.Stream(device=device, priority=low)
        self._last: list[torch.cuda.Event] = []

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: torch.cuda.Event | None = None,
             prefetch: bool = False) -> Copy:
        """`after`: an event recorded after the last compute that read the destinations; the
        copies wait for it so a slot is never overwritten while a queued kernel reads it."""
        stream, other = (self.background, self.demand) if prefetch else (self.demand, self.background)
        # Copies already queued on the other stream may target the same slot (a wrong
        # prefetch evicted again by a demand page-in): never let two writes race.
        stream.wait_stream(other)
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._last = [e for e in self._last if not e.query()] + [event]
        return _CudaEventCopy(event)

    def idle(self) -> bool:
        self._last = [e for e in self._last if not e.query()]
        return not self._last


class _TimedCopy:
    def __init__(self, finish: float) -> None:
        self.finish = finish

    def wait(self) -> None:
        # Sleep most of the way (a sleep can overshoot by a few hundred microseconds), then
        # yield until the end time.
        if (left := self.finish - time.perf_counter()) > 5e-4:
            time.sleep(left - 4e-4)
        while time.perf_counter() < self.finish:
            time.sleep(0)


class EmulatedLink:
    """A copy engine behind a link of `bytes_per_s`, for benchmarks on CPU machines.

    The link is a timeline: each batch of copies occupies it for bytes / bandwidth, starting
    when the link frees up; waiting on a copy blocks until its end time.  The bytes are
    moved at once (a memcpy, the same in every mode), so compute that runs while a copy is
    "on the link" really overlaps it, as with a DMA engine and a copy stream.  Prefetches
    are only issued on an idle link (see PagedExperts.prefetch), so a demand copy waits at
    most for the prefetch batch in flight.
    """

    name = "emulated-link"

    def __init__(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self._free_at = 0.0
        self.busy_s = 0.0

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: torch.cuda.Event | None = None,
             prefetch: bool = False) -> Copy:
        nbytes = 0
        for dst, src in pairs:
            dst.copy_(src)
            nbytes += src.numel() * src.element_size()
        duration = nbytes / self.bytes_per_s
        self._free_at = max(time.perf_counter(), self._free_at) + duration
        self.busy_s += duration
        return _TimedCopy(self._free_at)

    def idle(self) -> bool:
        return time.perf_counter() >= self._free_at
