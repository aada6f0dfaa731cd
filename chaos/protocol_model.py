"""An exhaustive model check of the KV transfer receiver, for small bounds.

The model drives the real `TransferReceiver` in front of a real `PagePool` (see
`chaos.protocol_actions` for the world and its actions, `chaos.protocol_threads` for how a
call is stopped inside its page copy or while it waits for writers).  It searches breadth
first over every sequence of actions — admit, frame, forged frame, end of a parked write,
commit, stream close, release, free, and re-admission of freed pages to the next request —
and checks after each one:

    ownership (I3, I5)  every page whose bytes changed holds the bytes of a frame accepted in
                        that action, of the reservation that owns the page now (same request,
                        same generation, same logical page); no frame writes a free page or
                        another reservation's page, and a refused frame writes nothing
    coverage (I4)       a commit succeeds only when every prompt page, every layer, holds that
                        reservation's own bytes
    accounting (I6)     `pool.check_integrity()`; once every admitted request is freed, all
                        pages are free and no transfer is open
    liveness            no call waits on the receiver while no write is in flight, no call
                        hangs, and the receiver raises nothing but TransferRefused

A state is expanded once, keyed by `World.fingerprint()` (phases, reservation states, layers
claimed, frames, writers, calls in flight, page owners, generations, contents): the model
assumes it decides every later outcome.  The world is real objects and threads, so a state
with no call in flight is kept as a deep copy of its world, and one with calls in flight as
the nearest such copy plus the actions since, replayed on a fresh copy (each replay must
reach the recorded fingerprint: `divergent_replays`).  Breadth first, so a violation's trace
is a shortest one.  Timeouts (`expire`), corrupt or misshapen frames and protocol versions are
left to tests/test_kv_transfer_machine.py; this model is about who may write which page when.

At the default bounds (r0 and r1 of two pages each, a pool of three pages, so r1 reuses a
page r0 freed) the search is complete: 403 states, 4732 transitions, 16 actions deep.

    python -m chaos.protocol_model [--requests 2 --pages-per-request 2 --pool-pages 3 ...]

prints a one-line JSON summary and exits 1 when it found a violation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from chaos.protocol_actions import MIXED, Action, Bounds, Contents, MakeReceiver, World
from chaos.protocol_threads import DONE, PARKED, WAITING, Call, Hang, gated_writes
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import Reservation

__all__ = ["Bounds", "Result", "explore"]

Trace = list[str]
# a state: a settled world before it, the actions since, the trace to it, its fingerprint
Node = tuple[World, tuple[Action, ...], Trace, tuple]


@dataclass
class Result:
    states: int = 0                  # distinct abstract states reached
    transitions: int = 0             # (state, action) pairs executed and checked
    violations: list[tuple[Trace, str]] = field(default_factory=list)
    max_depth_reached: int = 0
    complete: bool = True            # every reachable state expanded (max_depth, stop_after)
    actions: Counter[str] = field(default_factory=Counter)    # action kind -> times taken
    outcomes: Counter[str] = field(default_factory=Counter)   # "frame parked", "forge BAD_TAG", ...
    divergent_replays: int = 0       # replays that did not reach their recorded state
    seconds: float = 0.0

    def summary(self) -> dict:
        return dict(states=self.states, transitions=self.transitions,
                    violations=len(self.violations), max_depth_reached=self.max_depth_reached,
                    complete=self.complete, divergent_replays=self.divergent_replays,
                    seconds=round(self.seconds, 2), first_violation=self.violations[:1])


def explore(bounds: Bounds = Bounds(), make_receiver: MakeReceiver = TransferReceiver,
            stop_after: int | None = None) -> Result:
    """Check every interleaving of the model's actions up to `bounds`, on receivers built by
    `make_receiver(pool, secret)`.  Returns what was explored and every violation found, each
    with the actions that led to it (a shortest such path); with `stop_after`, stops once it
    found that many."""
    result, t0 = Result(), time.perf_counter()
    with gated_writes():
        root = World(bounds, make_receiver)
        seen = {root.fingerprint()}
        queue: deque[Node] = deque([(root, (), [], next(iter(seen)))])
        while queue:
            node = queue.popleft()
            if len(node[2]) >= bounds.max_depth:
                result.complete = False
                continue
            _expand(node, seen, queue, result)
            if stop_after is not None and len(result.violations) >= stop_after:
                result.complete = False
                break
    result.states, result.seconds = len(seen), time.perf_counter() - t0
    return result


def _expand(node: Node, seen: set[tuple], queue: deque[Node], result: Result) -> None:
    base, suffix, trace, key = node
    world: World | None
    world = _resume(node, result)
    for action in world.enabled():
        world = world or _resume(node, result)
        line, problems = _step(world, action, result)
        reached = world.fingerprint()
        if problems:
            result.violations += [(trace + [line], p) for p in problems]
        elif reached not in seen:
            seen.add(reached)
            child = (world.clone(), ()) if not world.board.live() else (base, suffix + (action,))
            queue.append((*child, trace + [line], reached))
            result.max_depth_reached = max(result.max_depth_reached, len(trace) + 1)
        if problems or reached != key:   # else the world is still in node's state: reuse it
            _close(world)
            world = None
    if world is not None:
        _close(world)


def _resume(node: Node, result: Result) -> World:
    """A world in `node`'s state: a copy of its settled base taken through the actions since
    (every one of them was checked already)."""
    base, suffix, _, key = node
    world = base.clone()
    for action in suffix:
        world.apply(action)
    result.divergent_replays += bool(suffix) and world.fingerprint() != key
    return world


def _close(world: World) -> None:
    try:
        world.close()
    except Hang:
        pass


def _step(world: World, action: Action, result: Result) -> tuple[str, list[str]]:
    """Take one action and check every invariant.  Returns the trace line and the problems."""
    before, first_new = world.contents(), len(world.board.calls)
    result.transitions += 1
    result.actions[action.kind] += 1
    try:
        finished = world.apply(action)
    except Hang as e:
        return f"{action} -> hang", [f"hang: {e}"]
    pending = [c for c in world.board.calls[first_new:] if c.status != DONE]
    line = f"{action} -> {_tally(world, action, finished + pending, result)}"
    after = world.contents()
    problems = (_writes(world, before, after, finished) + _commits(world, after, finished) +
                _errors(finished) + _accounting(world) + _stuck(world))
    return line, problems


def _tally(world: World, action: Action, calls: list[Call], result: Result) -> str:
    """Count the outcomes ("release ok on end": a waiting release returned when a write
    ended) and describe them for the trace."""
    if action.kind == "admit":
        refs = world.pool.refs(world.requests[action.request].rid)
        result.outcomes["admit reuses a page" if any(r.generation > 1 for r in refs) else "admit"] += 1
        return "pages " + ", ".join(f"{r.page} (generation {r.generation})" for r in refs)
    for c in calls:
        on = "" if c.action == action else f" on {action.kind}"
        result.outcomes[f"{c.action.kind} {c.outcome}{on}"] += 1
    own = (str(action), action.label)
    return "; ".join(c.outcome if c.label in own else f"{c.label}: {c.outcome}" for c in calls) or "done"


def _writes(world: World, before: Contents, after: Contents, finished: list[Call]) -> list[str]:
    """Ownership: every page copy was an accepted frame's, into a page its reservation owns
    now (same request, generation and logical page); no page changed any other way."""
    problems: list[str] = []
    copied: set[tuple[int, int]] = set()
    for c in finished:
        for page, l0, l1 in c.writes:
            copied.update((page, layer) for layer in range(l0, l1))
            layers = f"layer {l0}" if l1 == l0 + 1 else f"layers {l0}..{l1 - 1}"
            where = f"{c.label} copied {_name(world, c.identity)} into pool page {page} {layers}"
            problems += [f"{where}, and was refused ({c.outcome})"] if c.error is not None else []
            problems += [f"{where}, but {wrong}" for wrong in _owned(world, page, c.identity)]
    return problems + [f"pool page {p} layer {k} changed to {_name(world, now[k])}, no frame copying"
                       for p, (was, now) in enumerate(zip(before, after))
                       for k in range(len(now)) if now[k] != was[k] and (p, k) not in copied]


def _owned(world: World, page: int, ident: int) -> list[str]:
    """[] if `page` is, now, the page the reservation of `ident`'s request holds as its page."""
    r, i = world.bounds.writer(ident)
    q = world.requests[r]
    owner, gen = world.pool.owner(page), world.pool.generation(page)
    ref = q.reservation.pages[i]
    if (owner, gen, page) == (q.rid, ref.generation, ref.page):
        return []
    now = "free" if owner is None else f"{owner}'s"
    return [f"the page is now {now} (generation {gen}); {q.rid} reserved pool page {ref.page} "
            f"generation {ref.generation} as its page {i}"]


def _commits(world: World, after: Contents, finished: list[Call]) -> list[str]:
    """Coverage: a successful commit finds every prompt page holding its own bytes."""
    problems: list[str] = []
    for call in (c for c in finished if c.action.kind == "commit" and c.error is None):
        r = call.action.request
        assert isinstance(call.result, Reservation)   # what a commit returns
        for i, ref in enumerate(call.result.pages):
            want, where = world.bounds.identity(r, i), f"committed r{r}'s page {i} (pool page {ref.page})"
            wrong = [f"layer {k} holds {_name(world, g)}" for k, g in enumerate(after[ref.page])
                     if g != want] or _owned(world, ref.page, want)
            problems += [f"{where}: {', '.join(wrong)}"] if wrong else []
    return problems


def _errors(finished: list[Call]) -> list[str]:
    return [f"{c.label}: receiver {c.outcome}" for c in finished if c.error is not None and not c.refused]


def _accounting(world: World) -> list[str]:
    try:
        world.pool.check_integrity()
    except AssertionError as e:
        return [f"pool integrity: {e}"]
    admitted = [q for q in world.requests if q.phase != "new"]
    if admitted and all(q.phase == "freed" for q in admitted):
        if world.pool.num_free != world.pool.num_pages or world.recv.open_transfers:
            return [f"all requests freed, but {world.pool.num_free} of {world.pool.num_pages} "
                    f"pages are free and {world.recv.open_transfers} transfers open"]
    return []


def _stuck(world: World) -> list[str]:
    live = world.board.live()
    if any(c.status == PARKED for c in live):
        return []
    return [f"{c.label} waits on the receiver, but no write is in flight"
            for c in live if c.status == WAITING]


def _name(world: World, ident: int) -> str:
    if ident == MIXED:
        return "mixed bytes"
    if ident == 0:
        return "never-written bytes"
    r, i = world.bounds.writer(ident)
    return f"r{r} page {i}'s bytes"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(Bounds):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default)
    bounds = Bounds(**vars(parser.parse_args(argv)))
    result = explore(bounds)
    print(json.dumps(dict(bounds=dataclasses.asdict(bounds), **result.summary())))
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main())
