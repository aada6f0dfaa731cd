"""A local `tandem serve` listens on loopback only: every socket that any process it started
listens on (the driver, the local Ray's holder, GCS, raylet, object manager, runtime env agent,
autoscaler monitor, every Ray worker, the Tandem workers and the gateway) is bound to a loopback
address, so nothing of it is reachable from another machine.  The command runs as a user runs it
(`python -m deploy.cli serve`, a new session), its process tree is read with psutil once it says
it serves; `tandem status` from another process still reaches that Ray; the command is stopped
the way systemd stops it (SIGTERM to its group)."""

from __future__ import annotations

import ipaddress
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from gateway.server import _free_port

START_S = 300.0            # a cold start on a busy 2-core machine: Ray, one worker, the gateway
ROOT = Path(__file__).resolve().parent.parent


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1 and ::ffff:127.x.y.z (an IPv6 socket bound to a v4 loopback address)."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def listening(proc: psutil.Process) -> list[tuple[str, int]]:
    """The TCP sockets `proc` listens on and its UDP sockets bound without a peer."""
    return [(c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr)]


def tree(root: psutil.Process) -> list[psutil.Process]:
    return [root, *root.children(recursive=True)]


def _read_lines(proc: subprocess.Popen[str], into: queue.Queue[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        into.put(line)


def test_is_loopback_reads_every_form_of_a_loopback_address():
    assert all(map(is_loopback, ("127.0.0.1", "127.8.0.1", "::1", "::ffff:127.0.0.1")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "192.0.2.2", "::ffff:192.0.2.2", "10.0.0.1")))


def test_keep_loopback_holds_for_a_loopback_address_only_and_is_undone():
    from ray._private import ray_constants, services

    from deploy.local_ray import keep_loopback
    assert ray_constants.ENABLE_RAY_CLUSTER
    assert keep_loopback("192.0.2.7:6379")() is None and ray_constants.ENABLE_RAY_CLUSTER   # another node: as Ray does
    undo = keep_loopback("127.0.0.1:6379")
    try:
        assert services.canonicalize_bootstrap_address("127.0.0.1:6379") == "127.0.0.1:6379"
    finally:
        undo()
    assert ray_constants.ENABLE_RAY_CLUSTER


def test_a_local_tandem_serve_listens_on_loopback_only():
    port = _free_port("127.0.0.1")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--port", str(port), "--colocated",
                             "--no-compile", "--kv-cache-tokens", "4096", "--drain-grace-s", "1",
                             "--log-level", "warning"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc, lines), daemon=True).start()
    started: list[psutil.Process] = []
    try:
        seen: list[str] = []
        while not any(line.startswith("Tandem is serving") for line in seen):
            try:
                seen.append(lines.get(timeout=START_S))
            except queue.Empty:
                raise AssertionError(f"tandem serve did not start in {START_S:.0f} s: {''.join(seen)}") from None
            assert proc.poll() is None or not lines.empty(), f"tandem serve exited: {''.join(seen)}"
        started = tree(psutil.Process(proc.pid))
        sockets: dict[str, list[tuple[str, int]]] = {}
        for p in started:
            try:
                sockets[f"{p.pid} {' '.join(p.cmdline())[:100]}"] = listening(p)
            except psutil.NoSuchProcess:     # a Ray worker that ended meanwhile listens on nothing
                continue
        names = " ".join(sockets)
        assert "gcs_server" in names and "raylet" in names, names        # the tree holds Ray's own processes
        assert ("127.0.0.1", port) in [s for ss in sockets.values() for s in ss], sockets   # the gateway
        assert sum(map(len, sockets.values())) >= 8, sockets
        exposed = {who: [s for s in ss if not is_loopback(s[0])] for who, ss in sockets.items()}
        assert not any(exposed.values()), {who: ss for who, ss in exposed.items() if ss}
        # another process on this machine still finds that Ray (by its loopback address) and the worker
        status = subprocess.run([sys.executable, "-m", "deploy.cli", "status", "--json"], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stderr[-3000:]
        [worker] = json.loads(status.stdout)["workers"]
        assert (worker["worker_id"], worker["node_ip"], worker["health"]) == ("colocated-0", "127.0.0.1", "ok")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        _, alive = psutil.wait_procs([p for p in started if p.pid != proc.pid], timeout=30)
        for p in alive:                       # only processes this test's command started
            p.kill()
