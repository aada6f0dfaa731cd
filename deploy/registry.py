"""The worker registry: a named Ray actor that knows every worker's role, service address,
node and last report.  Workers register when they start (and again after Ray restarts them);
the gateway and `tandem status` read it."""

from __future__ import annotations

from typing import Any

import ray

from worker.types import Role

# A Ray actor handle.  Ray types attribute access on `ActorHandle` as Never, so mypy would take
# every line after `handle.method.remote()` as unreachable and check none of it: handles are Any.
ActorHandle = Any

NAME = "tandem_registry"
NAMESPACE = "tandem"


@ray.remote(num_cpus=0, max_restarts=-1)
class Registry:
    def __init__(self) -> None:
        self._workers: dict[str, dict] = {}

    def register(self, worker_id: str, info: dict) -> None:
        self._workers[worker_id] = {**info, "worker_id": worker_id}

    def unregister(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def workers(self) -> list[dict]:
        return sorted(self._workers.values(), key=lambda w: w["worker_id"])

    def addresses(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {role.value: [] for role in Role}
        for w in self._workers.values():
            out[w["role"]].append(w["address"])
        return out


def get_or_create() -> ActorHandle:
    """The registry, on this (the driver's, normally the head) node: it must not share the fate
    of a worker node.  Workers re-register every few seconds, so a restarted registry refills."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    # ray.remote(...) turns the class into an ActorClass; ray's stubs keep the plain class
    return Registry.options(name=NAME, namespace=NAMESPACE, get_if_exists=True,  # type: ignore[attr-defined]
                            scheduling_strategy=here).remote()


def lookup() -> ActorHandle:
    return ray.get_actor(NAME, namespace=NAMESPACE)
