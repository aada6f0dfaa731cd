"""How expert weights travel from the host store to a device slot.

A copy engine starts copies and hands back a `Copy` to wait on before the slot is read.
Demand page-ins (a step needs the expert now) go ahead of prefetches (a guess about the
next step), and `idle()` tells the prefetcher whether the link has time to spare.
  * `DirectCopy`     — a plain synchronous copy (CPU, or tests);
  * `CudaStreamCopy` — copies from pinned memory on two side CUDA streams (demand on a
                       high-priority one), ordered with events, so page-ins and prefetches
                       overlap compute;
  * `EmulatedLink`   — benchmarks on a CPU machine: a copy thread moves the bytes and then
                       holds the link for bytes / bandwidth, so a page-in costs what it would
                       over a real link, and prefetches really overlap compute.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Protocol

import torch


class Copy(Protocol):
    def wait(self) -> None: ...


class _Done:
    def wait(self) -> None:
        return None


class DirectCopy:
    name = "direct"

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None, prefetch: bool = False) -> Copy:
        dst.copy_(src)
        return _Done()

    def idle(self) -> bool:
        return True


class _CudaEventCopy:
    def __init__(self, event):
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class CudaStreamCopy:
    """Demand copies on a high-priority side stream, prefetches on a low-priority one;
    the compute stream waits on each copy's event before reading the slot."""

    name = "cuda-stream"

    def __init__(self, device: torch.device):
        low, high = torch.cuda.Stream.priority_range()
        self.demand = torch.cuda.Stream(device=device, priority=high)
        self.background = torch.cuda.Stream(device=device, priority=low)
        self._last: list = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None, prefetch: bool = False) -> Copy:
        """`after`: an event recorded after the last compute that read `dst`; the copy waits
        for it so a slot is never overwritten while a queued kernel still reads it."""
        stream = self.background if prefetch else self.demand
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._last = [e for e in self._last if not e.query()] + [event]
        return _CudaEventCopy(event)

    def idle(self) -> bool:
        self._last = [e for e in self._last if not e.query()]
        return not self._last


class _ThreadCopy:
    def __init__(self, dst: torch.Tensor, src: torch.Tensor):
        self.dst, self.src = dst, src
        self.done = threading.Event()

    def wait(self) -> None:
        self.done.wait()


class EmulatedLink:
    """One copy thread standing in for a copy engine behind a link of `bytes_per_s`."""

    name = "emulated-link"

    def __init__(self, bytes_per_s: float):
        if bytes_per_s <= 0:
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self._demand: deque[_ThreadCopy] = deque()
        self._prefetch: deque[_ThreadCopy] = deque()
        self._cv = threading.Condition()
        self._busy = False
        threading.Thread(target=self._run, name="emulated-link", daemon=True).start()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None, prefetch: bool = False) -> Copy:
        job = _ThreadCopy(dst, src)
        with self._cv:
            (self._prefetch if prefetch else self._demand).append(job)
            self._cv.notify()
        return job

    def idle(self) -> bool:
        with self._cv:
            return not (self._busy or self._demand or self._prefetch)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._demand or self._prefetch):
                    self._busy = False
                    self._cv.wait()
                job = (self._demand or self._prefetch).popleft()
                self._busy = True
            start = time.perf_counter()
            job.dst.copy_(job.src)
            until = start + job.src.numel() * job.src.element_size() / self.bytes_per_s
            while (left := until - time.perf_counter()) > 0:
                time.sleep(min(left, 0.001))
            job.done.set()
