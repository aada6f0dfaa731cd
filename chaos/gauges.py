"""What a hostile scenario reads of the gateway while it is attacked, from outside, as an
operator would: its Prometheus `/metrics` (per-tenant queued, running and KV reserved, the KV
budget, refusals, idle closes), the workers' readiness as the gateway's `/v1/server_info`
reports it (their Health, read over the authenticated worker channel), the gateway process's
memory, the server side of its TCP connections, and TTFT percentiles."""

from __future__ import annotations

import math
import os
import re
import threading
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import ray

from chaos.cluster import ChaosCluster

SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})? (\S+)')
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
              "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN",
              "0B": "CLOSING"}
Metrics = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Metrics:
    """Prometheus text -> {(name, labels): value} (comments skipped)."""
    out: Metrics = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m is not None:
            out[(m[1], frozenset(LABEL.findall(m[2] or "")))] = float(m[3])
    return out


def metric(samples: Metrics, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when there is none)."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def scrape(url: str, timeout_s: float = 10.0) -> Metrics:
    """The gateway's /metrics now (empty when it does not answer)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as r:
            return parse_metrics(r.read().decode())
    except OSError:
        return {}


@dataclass
class Peaks:
    """What `Sampler` saw: the attacker's largest figures and the fewest ready workers."""
    samples: int = 0
    running: float = 0.0            # the attacker tenant's requests forwarded to workers
    queued: float = 0.0             # ... waiting in the admission queue
    kv_reserved: float = 0.0        # ... KV tokens its running requests hold
    kv_budget: float = 0.0
    fewest_ready: int | None = None
    unready: list[str] = field(default_factory=list)     # when and how many workers were not ready


class Sampler:
    """Reads /metrics and /v1/server_info every `every_s` in a thread of its own, from `start` to
    `stop`, keeping the attacker tenant's peaks and the fewest workers ready at once."""

    def __init__(self, cluster: ChaosCluster, tenant: str, every_s: float = 0.2) -> None:
        self.cluster, self.who, self.every_s = cluster, tenant, every_s
        self.want = cluster.shape.prefill_workers + cluster.shape.decode_workers
        self.peaks = Peaks()
        self.last: Metrics = {}
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-sampler", daemon=True)
        self._t0 = time.monotonic()

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> Peaks:
        self._halt.set()
        self._thread.join(timeout=30)
        return self.peaks

    def tenant(self, name: str) -> float:
        """The attacker tenant's `tandem_tenant_<name>` in the last sample."""
        with self._lock:
            return metric(self.last, f"tandem_tenant_{name}", tenant=self.who)

    def _run(self) -> None:
        while not self._halt.is_set():
            self._sample()
            self._halt.wait(self.every_s)

    def _sample(self) -> None:
        now = scrape(self.cluster.url)
        info = self.cluster.server_info()
        ready = sum(bool(w.get("healthy")) for w in info.get("workers", []))
        with self._lock:
            self.last = now
            p = self.peaks
            p.samples += 1
            for name in ("running", "queued", "kv_reserved"):
                value = metric(now, f"tandem_tenant_{name}" + ("_tokens" if name == "kv_reserved" else ""),
                               tenant=self.who)
                setattr(p, name, max(getattr(p, name), value))
            p.kv_budget = max(p.kv_budget, metric(now, "tandem_tenant_kv_budget_tokens"))
            if info:
                p.fewest_ready = ready if p.fewest_ready is None else min(p.fewest_ready, ready)
                if ready < self.want and len(p.unready) < 5:
                    p.unready.append(f"{ready}/{self.want} ready at {time.monotonic() - self._t0:.1f}s")


def check_ready(violations: list[str], peaks: Peaks, want: int) -> str:
    """Workers stay healthy: every sample saw all `want` workers ready (else a violation).
    Returns a note saying what was seen."""
    if peaks.fewest_ready is None:
        violations.append("the gateway's /v1/server_info never answered during the attack")
        return "workers' readiness not read"
    if peaks.fewest_ready < want:
        violations.append(f"workers not ready during the attack (Health via the gateway): {'; '.join(peaks.unready)}")
    return f"workers ready (Health, via the gateway): at least {peaks.fewest_ready} of {want} in {peaks.samples} " \
           f"samples"


# ---- the gateway process --------------------------------------------------------------------
def gateway_pid(cluster: ChaosCluster) -> int | None:
    """The pid of the (first) gateway actor's process, None when it cannot be asked."""
    if not cluster.deployment.gateways:
        return None
    try:
        pid: int = ray.get(cluster.deployment.gateways[0].__ray_call__.remote(lambda self: os.getpid()),
                           timeout=30)
        return pid
    except Exception:   # noqa: BLE001  (an old Ray without __ray_call__: no reading, not a failure)
        return None


def gateway_setting(cluster: ChaosCluster, name: str) -> Any:
    """One field of the running gateway's GatewayConfig (None when it cannot be read)."""
    try:
        return ray.get(cluster.deployment.gateways[0].__ray_call__.remote(
            lambda self: getattr(self.server.app.state.gateway.config, name, None)), timeout=30)
    except Exception:   # noqa: BLE001
        return None


def gateway_connections(cluster: ChaosCluster) -> int | None:
    """The connections the (first) gateway's uvicorn server counts now (what the front door's
    connection table holds to the gateway's max_connections); None when unreadable."""
    def count(actor: Any) -> int:
        return len(actor.server._server.server_state.connections)
    try:
        n: int = ray.get(cluster.deployment.gateways[0].__ray_call__.remote(count), timeout=30)
        return n
    except Exception:   # noqa: BLE001  (another server inside: no reading, not a failure)
        return None


def memory_mib(pid: int) -> dict[str, float]:
    """{"rss", "peak"} of a local process in MiB (VmRSS, VmHWM); empty when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {}
    return {"rss": int(fields["VmRSS"].split()[0]) / 1024, "peak": int(fields["VmHWM"].split()[0]) / 1024}


def reset_peak(pid: int) -> bool:
    """Reset the process's peak RSS (VmHWM) to its RSS now (Linux clear_refs 5)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def server_sockets(port: int, peers: Iterable[int]) -> dict[int, tuple[str, int]]:
    """The server side of loopback connections to `port`: peer port -> (TCP state, bytes queued
    to send).  A peer with no entry is closed on the server's side."""
    want, out = set(peers), {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            local, remote, state, queues = cols[1], cols[2], cols[3], cols[4]
            if int(local.rsplit(":", 1)[1], 16) == port and (peer := int(remote.rsplit(":", 1)[1], 16)) in want:
                out[peer] = (TCP_STATES.get(state, state), int(queues.split(":")[0], 16))
    return out


# ---- latency --------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank `q` percentile (0 < q <= 100), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
