"""How expert weights travel from the host store to a device slot.

A copy engine starts copies and hands back a `Copy` to wait on before the slot is read:
  * `DirectCopy`     — a plain synchronous copy (CPU, or tests);
  * `CudaStreamCopy` — copies on a side CUDA stream from pinned memory, ordered with events,
                       so page-ins and prefetches overlap compute;
  * `EmulatedLink`   — benchmarks on a CPU machine: a copy thread moves the bytes and then
                       holds the link for bytes / bandwidth, so a page-in costs what it would
                       over a real link, and prefetches really overlap compute.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Protocol

import torch


class Copy(Protocol):
    def wait(self) -> None: ...


class _Done:
    def wait(self) -> None:
        return None


class DirectCopy:
    name = "direct"

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> Copy:
        dst.copy_(src)
        return _Done()


class _CudaEventCopy:
    def __init__(self, event):
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class CudaStreamCopy:
    """Copies on one side stream; the compute stream waits on each copy's event."""

    name = "cuda-stream"

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device=device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> Copy:
        """`after`: an event recorded after the last compute that read `dst`; the copy waits
        for it so a slot is never overwritten while a queued kernel still reads it."""
        if after is not None:
            self.stream.wait_event(after)
        else:
            self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _CudaEventCopy(event)


class _ThreadCopy:
    def __init__(self):
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
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="emulated-link", daemon=True)
        self._thread.start()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None) -> Copy:
        job = _ThreadCopy()
        self._jobs.put((dst, src, job))
        return job

    def _run(self) -> None:
        busy_until = time.perf_counter()
        while True:
            dst, src, job = self._jobs.get()
            start = max(time.perf_counter(), busy_until)
            dst.copy_(src)
            busy_until = start + src.numel() * src.element_size() / self.bytes_per_s
            while (left := busy_until - time.perf_counter()) > 0:
                time.sleep(min(left, 0.002))
            job.done.set()
