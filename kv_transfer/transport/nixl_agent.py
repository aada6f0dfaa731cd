"""The NIXL library (NVIDIA's transfer library, UCX backend) behind the few calls Tandem makes.

    agent = process_agent()                       # one agent per process, made on first use
    reg = agent.register([(addr, nbytes), ...], "DRAM", 0)
    meta = agent.partial_metadata(reg)            # what a peer needs to write into `reg` alone
    peer = agent.add_remote(meta)                 # on the writing side
    xfer = agent.write(local_regions, remote_regions, "DRAM", 0, peer)
    xfer.wait(deadline)                           # DONE only once the bytes are at the target
    agent.deregister(reg)

A write's DONE means the remote side has the bytes: NIXL's UCX backend flushes the endpoint
after posting a request's puts and reports it complete only when the flush completes.

The package is optional (`pip install tandem[nixl]`, the `nixl-cu13` wheel, which runs on a
CPU-only host as well); `unavailable()` says why it cannot be used here.  NIXL's agent is not
thread-safe in the mode it is made in, so every call goes through one lock.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from types import ModuleType
from typing import Any

from kv_transfer.errors import Refusal, TransferRefused

Region = tuple[int, int]     # (address, bytes)
_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


def _load() -> ModuleType:
    import importlib
    import logging
    errors = []
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as e:          # includes a wheel whose libraries fail to load
            errors.append(f"{name}: {e}")
            continue
        # NIXL logs INFO lines to stdout (a worker's or a benchmark peer's protocol channel)
        logging.getLogger(name.split(".")[0]).setLevel(logging.WARNING)
        logging.getLogger("nixl").setLevel(logging.WARNING)
        return module
    raise ImportError("the NIXL package is not usable here (pip install 'tandem[nixl]'): " + "; ".join(errors))


def unavailable() -> str | None:
    """None when NIXL can be used in this process, else why not."""
    try:
        _load()
    except ImportError as e:
        return str(e)
    return None


class Registration:
    """Memory registered with the agent; `descs` is NIXL's descriptor list for it."""

    def __init__(self, descs: Any, regions: list[Region]) -> None:
        self.descs, self.regions = descs, regions
        self.live = True


class Xfer:
    """One posted write."""

    def __init__(self, agent: Agent, handle: Any, state: str) -> None:
        self._agent, self._handle, self._state = agent, handle, state

    def done(self) -> bool:
        """Whether it completed; raises TransferRefused(TRANSPORT) if it failed."""
        if self._state == "PROC":
            self._state = self._agent._call(lambda a: a.check_xfer_state(self._handle))
        if self._state == "ERR":
            raise TransferRefused(Refusal.TRANSPORT, "a NIXL write failed")
        return self._state == "DONE"

    def wait(self, deadline: float) -> None:
        """Until DONE (raises TransferRefused on failure, or when `deadline`, a monotonic time,
        passes first).  Polls: a write of a layer group completes in milliseconds."""
        while not self.done():
            if time.monotonic() > deadline:
                raise TransferRefused(Refusal.TRANSPORT, "a NIXL write did not complete in time")
            time.sleep(0.0002)

    def release(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._agent._call(lambda a: a.release_xfer_handle(handle))


class Agent:
    def __init__(self, role: str) -> None:
        api = _load()
        self.name = f"tandem-{role}-{os.getpid()}-{secrets.token_hex(4)}"
        # no progress thread: NIXL's spins a core; the owner calls progress() (or polls a write)
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = api.nixl_agent(self.name, config)
        self._lock = threading.Lock()

    def _call(self, op: Any) -> Any:
        with self._lock:
            return op(self._agent)

    def progress(self) -> None:
        """Drive the agent's communication (an agent without NIXL's progress thread)."""
        self._call(lambda a: a.update_notifs())

    def register(self, regions: list[Region], mem_type: str, device_id: int) -> Registration:
        descs = self._call(lambda a: a.register_memory([(addr, n, device_id, "") for addr, n in regions], mem_type))
        return Registration(descs, regions)

    def deregister(self, reg: Registration) -> None:
        """Idempotent: a registration is dropped once."""
        if reg.live:
            reg.live = False
            self._call(lambda a: a.deregister_memory(reg.descs))

    def partial_metadata(self, reg: Registration) -> bytes:
        """This agent's connection details and `reg`'s registrations (no other memory of it)."""
        return bytes(self._call(lambda a: a.get_partial_agent_metadata(reg.descs, inc_conn_info=True)))

    def add_remote(self, metadata: bytes) -> str:
        name = self._call(lambda a: a.add_remote_agent(metadata))
        return name.decode() if isinstance(name, bytes) else str(name)

    def write(self, local: list[Region], remote: list[Region], mem_type: str, device_id: int,
              remote_mem_type: str, remote_device_id: int, peer: str) -> Xfer:
        """Post one write of local[i] into remote[i] (equal lengths) at agent `peer`."""
        def post(a: Any) -> tuple[Any, str]:
            src = a.get_xfer_descs([(addr, n, device_id) for addr, n in local], mem_type)
            dst = a.get_xfer_descs([(addr, n, remote_device_id) for addr, n in remote], remote_mem_type)
            handle = a.initialize_xfer("WRITE", src, dst, peer)
            return handle, a.transfer(handle)
        try:
            handle, state = self._call(post)
        except Exception as e:     # NIXL raises its own error types (e.g. nixlNotFoundError)
            raise TransferRefused(Refusal.TRANSPORT, f"NIXL refused the write: {e!r}") from e
        return Xfer(self, handle, state)


_PROCESS_AGENT: Agent | None = None
_PROCESS_LOCK = threading.Lock()


def process_agent() -> Agent:
    """This process's sending agent (made on first use; it lives as long as the process)."""
    global _PROCESS_AGENT
    with _PROCESS_LOCK:
        if _PROCESS_AGENT is None:
            _PROCESS_AGENT = Agent("kv")
        return _PROCESS_AGENT
