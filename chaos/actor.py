"""A chaos run's worker actor: deploy's `WorkerActor` plus a `ChaosControl` that installs the
injectors as the worker's transfer hooks before the worker registers, and answers the run's
calls.  `chaos.cluster` launches it with `Deployment(worker_class=ChaosWorkerActor,
worker_args=(seed,))`; a `tandem serve` deployment never contains one."""

from __future__ import annotations

from typing import Any

from chaos.control import ChaosControl
from deploy.actors import WorkerActor
from worker.types import Role

OPS = ("arm", "disarm", "injected", "ledger", "idle_check", "push_streams",       # what chaos_call may ask
       "stall_open", "stall_status", "stall_handshake", "stall_close", "cache_pages", "squeeze", "unsqueeze",
       "pool_state", "live_requests")


class ChaosWorkerActor(WorkerActor):
    def __init__(self, worker_id: str, role: Role, index: int, config: dict[str, Any], secret: bytes,
                 registry: str, host: str | None, cores: list[int] | None, seed: int) -> None:
        """`seed`: the run's; this worker's injectors are seeded with `seed + index` (the same
        again when Ray restarts it)."""
        self.control = ChaosControl(role, seed + index, secret)
        super().__init__(worker_id, role, index, config, secret, registry, host, cores)

    def started(self) -> None:
        self.control.attach(self.handle)

    def chaos_call(self, op: str, **kw: Any) -> Any:
        """A chaos run's request to this worker: one of ChaosControl's `OPS` with its keywords.
        Raises ValueError for another name."""
        if op not in OPS:
            raise ValueError(f"chaos_call: unknown op {op!r}; known: {', '.join(OPS)}")
        return getattr(self.control, op)(**kw)
