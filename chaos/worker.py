"""Run one worker as a process with armed fault points (tests and hand-run chaos).

    TANDEM_CLUSTER_SECRET=<hex> python -m chaos.worker --role prefill \
        --fault delay:after=3:seconds=60 [--seed S] [python -m deploy.worker's flags]

The same process as `python -m deploy.worker` (same flags, `READY <role> <host:port>`, same
shutdown), plus a `ChaosControl` whose injectors are installed as the worker's transfer hooks
before READY is printed.  Each `--fault POINT[:after=N][:seconds=S][:times=K]` arms one point:
a sender point (chaos.sender_faults.POINTS) on a prefill or colocated worker, a receiver point
(chaos.injectors.RECEIVER_POINTS) on a decode or colocated worker.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace

from chaos.control import ChaosControl
from chaos.injectors import RECEIVER_POINTS
from chaos.sender_faults import POINTS as SENDER_POINTS
from deploy.worker import config_from, parser, serve_until_signalled, start_worker
from worker.types import Role


@dataclass(frozen=True)
class FaultSpec:
    point: str
    after: int = 0          # frames to let pass first (sender points)
    seconds: float = 0.0    # delay, late_write, stall
    times: int = 1          # transfers to fault


def parse_fault(spec: str) -> FaultSpec:
    """POINT[:after=N][:seconds=S][:times=K].  Raises argparse.ArgumentTypeError (a usage error)."""
    point, *opts = spec.split(":")
    if point not in SENDER_POINTS + RECEIVER_POINTS:
        raise argparse.ArgumentTypeError(f"{spec!r}: unknown transfer fault point {point!r} "
                                         f"(known: {', '.join(SENDER_POINTS + RECEIVER_POINTS)})")
    out = FaultSpec(point)
    for opt in opts:
        key, _, value = opt.partition("=")
        try:
            if key == "seconds":
                out = replace(out, seconds=float(value))
            elif key == "after":
                out = replace(out, after=int(value))
            elif key == "times":
                out = replace(out, times=int(value))
            else:
                raise argparse.ArgumentTypeError(f"{spec!r}: unknown option {key!r} (after, seconds, times)")
        except ValueError:
            raise argparse.ArgumentTypeError(f"{spec!r}: {key}={value!r} is not a number") from None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = parser("python -m chaos.worker")
    ap.add_argument("--fault", action="append", default=[], type=parse_fault,
                    metavar="POINT[:after=N][:seconds=S][:times=K]", help="arm a fault point (repeatable)")
    ap.add_argument("--seed", type=int, default=0, help="the injectors' random seed")
    args = ap.parse_args(argv)
    role = Role(args.role)
    config = config_from(args)
    control = ChaosControl(role, args.seed, config.secret)
    for spec in args.fault:             # a point this role lacks fails before the model loads
        try:
            control.arm(spec.point, times=spec.times, after=spec.after, seconds=spec.seconds)
        except ValueError as e:
            ap.error(f"--fault {spec.point}: {e}")
    handle = start_worker(role, config)
    control.attach(handle)
    return serve_until_signalled(handle)


if __name__ == "__main__":
    sys.exit(main())
