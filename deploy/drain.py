"""`tandem drain WORKER`: drain one worker of a running deployment, from any machine that
reaches its Ray cluster (as `tandem status`).

The worker admits nothing new (Health says draining, so the gateways route around it; a request
sent to it anyway is refused with DRAINING and goes elsewhere), its live requests may finish for
`--grace-s`, and the rest end with DRAINING: the gateway continues a decode worker's streams on
another decode worker with the tokens already sent.  Then, with `--restart`, the worker stops
and Ray restarts its actor (a fresh worker registers); without it, the worker stays up and
drained until `--undo` (or a scale-down removes it).

The call goes through the worker's own actor (`tandem-WORKER`), which holds the cluster secret
every worker RPC needs; this process never sees it.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from deploy import registry as reg
from deploy.local_ray import keep_loopback

RESTART_WAIT_S = 120.0      # how long `--restart` waits for the fresh worker to register


def drain(address: str, worker_id: str, grace_s: float, restart: bool = False, undo: bool = False) -> int:
    """Drain `worker_id` (see the module's docstring); prints what happened.  Returns the exit
    status: 0 done, 1 no such worker or deployment, or the restarted worker did not come back."""
    if grace_s < 0:
        raise ValueError(f"--grace-s must be >= 0, got {grace_s}")
    if restart and undo:
        raise ValueError("--restart and --undo contradict each other: give one")
    undo_loopback = keep_loopback(address)     # a local `tandem serve`'s Ray listens on loopback only
    ray.init(address=address, namespace=reg.NAMESPACE, log_to_driver=False,
             logging_level="ERROR")  # type: ignore[arg-type]  # ray takes a level name too
    try:
        try:
            actor: reg.ActorHandle = ray.get_actor(f"tandem-{worker_id}", namespace=reg.NAMESPACE)
            before = _address_of(worker_id)
        except ValueError:
            print(f"tandem: no worker {worker_id!r} in a deployment on this Ray cluster (see `tandem status`)")
            return 1
        if not undo:
            print(f"tandem: draining {worker_id} (grace {grace_s:g} s)", flush=True)
        counts: dict[str, Any] = ray.get(actor.drain.remote(grace_s, restart=restart, undo=undo),
                                         timeout=grace_s + 60)
        if undo:
            print(f"tandem: {worker_id} admits requests again")
            return 0
        print(f"tandem: {worker_id} drained: {counts['finished']} request(s) finished, "
              f"{counts['drained']} ended with DRAINING (continued on other workers)")
        if not restart:
            print(f"tandem: {worker_id} stays drained: `tandem drain {worker_id} --undo` admits again")
            return 0
        return _wait_restarted(worker_id, before)
    finally:
        ray.shutdown()
        undo_loopback()


def _address_of(worker_id: str) -> str | None:
    workers: list[dict] = ray.get(reg.lookup().workers.remote(), timeout=30)
    return next((w["address"] for w in workers if w["worker_id"] == worker_id), None)


def _wait_restarted(worker_id: str, before: str | None) -> int:
    """Wait until the restarted worker registers (an address other than `before`)."""
    end = time.monotonic() + RESTART_WAIT_S
    while time.monotonic() < end:
        now = _address_of(worker_id)
        if now is not None and now != before:
            print(f"tandem: {worker_id} restarted at {now}")
            return 0
        time.sleep(0.5)
    print(f"tandem: {worker_id} did not register again within {RESTART_WAIT_S:.0f} s (see `tandem status`)")
    return 1
