"""The worker registry: a named Ray actor that knows every worker's role, service address,
transfer endpoint, node and last report.  Workers register when they start (and again after
Ray restarts them); the gateway, the prefill workers (where they may push) and `tandem status`
read it.

A registration or unregistration carries a proof that its sender holds the cluster secret
(`proof`: an HMAC over the worker id, its entry and a timestamp, within `SKEW_S`); the registry
refuses any other, counting it, so a process that reaches Ray but not the secret cannot add a
fake worker (which would receive tenants' prompts) or remove a real one."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import Any

import ray

from kv_transfer.frame import check_secret
from worker.types import Role

# A Ray actor handle.  Ray types attribute access on `ActorHandle` as Never, so mypy would take
# every line after `handle.method.remote()` as unreachable and check none of it: handles are Any.
ActorHandle = Any

NAME = "tandem_registry"
NAMESPACE = "tandem"
SKEW_S = 30.0            # the most a proof's timestamp may differ from the registry's clock


def _key(secret: bytes) -> bytes:
    return hmac.new(check_secret(secret), b"tandem-registry", hashlib.sha256).digest()


def _mac(key: bytes, action: str, worker_id: str, info: dict | None, ts: float) -> str:
    body = json.dumps([action, worker_id, info, ts], sort_keys=True, separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def proof(secret: bytes, action: str, worker_id: str, info: dict | None = None) -> tuple[float, str]:
    """(timestamp, MAC) proving that the caller of `action` ("register" with `info`, or
    "unregister") for `worker_id` holds the cluster secret."""
    ts = time.time()
    return ts, _mac(_key(secret), action, worker_id, info, ts)


class RegistrationRefused(PermissionError):
    """A registration without a valid proof."""


@ray.remote(num_cpus=0, max_restarts=-1)
class Registry:
    def __init__(self, secret: bytes) -> None:
        self._key = _key(secret)
        self._workers: dict[str, dict] = {}
        self._refused = 0

    def _check(self, action: str, worker_id: str, info: dict | None, ts: float, mac: str) -> None:
        ok = isinstance(ts, (int, float)) and isinstance(mac, str) and abs(time.time() - ts) <= SKEW_S \
            and hmac.compare_digest(mac, _mac(self._key, action, worker_id, info, ts))
        if not ok:
            self._refused += 1
            raise RegistrationRefused(f"{action} of {str(worker_id)[:64]!r} refused: no valid proof of the "
                                      f"cluster secret (or a clock more than {SKEW_S:.0f} s off)")

    def register(self, worker_id: str, info: dict, ts: float, mac: str) -> None:
        self._check("register", worker_id, info, ts, mac)
        self._workers[worker_id] = {**info, "worker_id": worker_id}

    def unregister(self, worker_id: str, ts: float, mac: str) -> None:
        self._check("unregister", worker_id, None, ts, mac)
        self._workers.pop(worker_id, None)

    def refused(self) -> int:
        """Registrations and unregistrations refused for their proof so far."""
        return self._refused

    def workers(self) -> list[dict]:
        return sorted(self._workers.values(), key=lambda w: w["worker_id"])

    def addresses(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {role.value: [] for role in Role}
        for w in self._workers.values():
            out[w["role"]].append(w["address"])
        return out

    def transfer_endpoints(self) -> list[str]:
        """The decode workers' transfer endpoints: where a prefill worker may push KV."""
        return sorted(w["transfer_endpoint"] for w in self._workers.values()
                      if w["role"] == Role.DECODE.value and w.get("transfer_endpoint"))


def get_or_create(secret: bytes) -> ActorHandle:
    """The registry, on this (the driver's, normally the head) node: it must not share the fate
    of a worker node.  Workers re-register every few seconds, so a restarted registry refills."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    # ray.remote(...) turns the class into an ActorClass; ray's stubs keep the plain class
    return Registry.options(name=NAME, namespace=NAMESPACE, get_if_exists=True,  # type: ignore[attr-defined]
                            scheduling_strategy=here).remote(secret)


def lookup() -> ActorHandle:
    return ray.get_actor(NAME, namespace=NAMESPACE)
