"""A Ray instance of `tandem serve`'s own on this machine, in a session of its own.

`ray.init()` without an address starts GCS, the raylet and Ray's helper processes as children
of the driver, in the driver's process group (ray/_private/services.py `start_ray_process`:
only SIGINT is blocked in them, and with kernel fate-sharing they die with the driver).  A
SIGTERM to that group — systemd's default stop, `kill -TERM -PGID`, a container runtime —
reaches GCS and the raylet as well as the driver: Ray is gone before the driver has drained
anything, and the driver's next Ray call waits for GCS to come back (60 s) and fails.

So the driver starts Ray from a small holder process in a new session (`python -m
deploy.local_ray`): it calls `ray.init()` there, exactly as the driver would have, prints the
cluster's address and holds the cluster until SIGTERM.  Signals to the driver's process group
do not reach it; it dies with the driver all the same (PR_SET_PDEATHSIG: SIGTERM when the
driver exits, however it exits), and `stop()` ends it once the deployment is down.  (`ray start
--head` would do as well but always adds a Ray client server on a fixed port.)

Every socket of that Ray listens on loopback only.  Ray binds its core gRPC servers (GCS,
raylet, object manager, each worker's) to every interface unless the node's IP is a loopback
address, and the Python agents (runtime env agent, autoscaler monitor's metrics) to the node's
IP; but `ray.init(_node_ip_address="127.0.0.1")` swaps a loopback address for the machine's
outward IP (ray/_private/services.py `resolve_ip_for_localhost`), unless Ray is told the node
is not part of a cluster: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (ray_constants.ENABLE_RAY_CLUSTER,
read by `get_node_ip_address`).  The holder runs with it set, in its own environment only (every
Ray process it starts inherits it), and checks the node's IP before it reports ready: it
refuses to hold a Ray reachable from outside.  A process joining that Ray (the driver, `tandem
status`, `tandem drain`) would swap the loopback address it is given the same way and miss the
cluster: `keep_loopback(address)` makes Ray take a loopback address as given, in that process,
for as long as it is joined.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

READY = "tandem-local-ray"
LOOPBACK = "127.0.0.1"
# ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR: "0" makes Ray use the loopback address as the node's
# IP (not the outward one), so that every Ray server binds loopback only
LOCAL_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class LocalRay:
    """Ray on this machine, held by a process in a session of its own; `address` for ray.init."""

    def __init__(self, num_cpus: int, object_store_memory: int) -> None:
        self.address = ""
        self._log = tempfile.NamedTemporaryFile(prefix="tandem-ray-", suffix=".log", delete=False)
        self._cmd = [sys.executable, "-m", "deploy.local_ray", str(num_cpus), str(object_store_memory)]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 120.0) -> "LocalRay":
        """Start Ray and return once it serves.  Raises RuntimeError with the end of the
        holder's log when it exits or Ray does not come up within `timeout_s`."""
        _token_auth_as_ray_init_does()
        self.proc = subprocess.Popen(self._cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **LOCAL_ONLY_ENV}, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        end = time.monotonic() + timeout_s
        while not (found := re.search(rf"^{READY} (\S+)$", self.log(), re.M)):
            if self.proc.poll() is not None or time.monotonic() > end:
                tail = self.log()[-3000:]
                self.stop()
                raise RuntimeError(f"the local Ray ({' '.join(self._cmd[1:3])}) did not start: {tail}")
            time.sleep(0.1)
        self.address = found.group(1)
        return self

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM the holder (it shuts Ray down) and wait; SIGKILL its session's process group
        (only processes it started) if it does not end in time."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        Path(self._log.name).unlink(missing_ok=True)


def keep_loopback(address: str) -> Callable[[], None]:
    """Before `ray.init(address=address)` in this process: when `address` ("auto" read as Ray
    reads it: RAY_ADDRESS, then the Ray running on this machine) is a loopback address,
    have Ray connect to it as given instead of swapping it for this machine's outward IP (what
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 does at Ray's import).  Returns the undo, to call after
    `ray.shutdown()`; it does nothing when nothing was changed."""
    from ray._common.network_utils import is_localhost, parse_address
    from ray._private import ray_constants, services
    try:
        found = services.get_ray_address_from_environment(address, None) if address == "auto" else address
    except Exception:        # no Ray to find: ray.init says so itself
        return lambda: None
    host_port = parse_address(found) if found not in (None, "auto", "local") else None
    if host_port is None or not is_localhost(host_port[0]) or not ray_constants.ENABLE_RAY_CLUSTER:
        return lambda: None
    ray_constants.ENABLE_RAY_CLUSTER = False

    def undo() -> None:
        ray_constants.ENABLE_RAY_CLUSTER = True
    return undo


def hold(num_cpus: int, object_store_memory: int) -> int:
    """(The holder process) start Ray on loopback, print its address, hold it until SIGTERM, shut
    it down.  Raises RuntimeError (and shuts Ray down) when Ray took a node IP that is not loopback."""
    import threading

    import ray
    ray.init(address="local", num_cpus=num_cpus, object_store_memory=object_store_memory,
             _node_ip_address=LOOPBACK, include_dashboard=False, log_to_driver=False)
    if not ipaddress.ip_address(node_ip := ray.util.get_node_ip_address()).is_loopback:
        ray.shutdown()
        setting = " ".join(f"{k}={v}" for k, v in LOCAL_ONLY_ENV.items())
        raise RuntimeError(f"the local Ray took the node IP {node_ip}, not {LOOPBACK}: its ports would listen "
                           f"beyond this machine (this Ray does not honour {setting})")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"{READY} {ray.get_runtime_context().gcs_address}", flush=True)
    while not stop.wait(0.5):   # a signal may land on one of Ray's threads: the handler runs when this one wakes
        pass
    ray.shutdown()
    return 0


def _token_auth_as_ray_init_does() -> None:
    """What `ray.init()` does before it starts a new local cluster (ray/_private/worker.py
    `init`): token authentication unless RAY_AUTH_MODE says otherwise (it sets RAY_AUTH_MODE
    in this process's environment, which `ray start` inherits), and a token in
    ~/.ray/auth_token if there is none.  The driver then joins with the same mode and token."""
    from ray._private.authentication.authentication_token_setup import (
        enable_token_auth_by_default,
        ensure_token_if_auth_enabled,
    )
    enable_token_auth_by_default()
    ensure_token_if_auth_enabled(None, create_token_if_missing=True)


def _die_with_parent() -> None:
    """(In the child, before exec) SIGTERM this process when its parent exits (Linux)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


if __name__ == "__main__":
    sys.exit(hold(int(sys.argv[1]), int(sys.argv[2])))
