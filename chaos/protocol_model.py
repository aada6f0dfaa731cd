"""An exhaustive model check of the KV transfer receiver and the pool's prefix cache, for
small bounds.

The model drives the real `TransferReceiver` in front of a real `PagePool` with its prefix
cache (see `chaos.protocol_actions` for the world and its actions, `chaos.protocol_senders`
for the prompts and frames, `chaos.protocol_checks` for the checks, `chaos.protocol_threads`
for how a call is stopped inside its page copy or while it waits for writers).  It searches
breadth first over every sequence of actions — admit (with the longest cached prefix,
evicting unreferenced cached pages when the free list is short), frame, a frame aimed at a
cached page, forged frame, end of a parked write, commit, stream close, publish, release,
free, and re-admission of freed or evicted pages to the next request — and checks after each
one:

    ownership (I3, I5)  every page whose bytes changed holds the bytes of a frame accepted in
                        that action, of the reservation that owns the page now (same request,
                        same generation, same logical page); no frame writes a free page, a
                        cached page or another reservation's page, and a refused frame writes
                        nothing
    coverage (I4)       a commit succeeds only when every prompt page past its cached prefix,
                        every layer, holds that reservation's own bytes, and every page of the
                        prefix is still the cached page it was given, under its own key,
                        holding the bytes of a request whose page had that key
    the cache           no cached page's bytes change while it is cached (compared before and
                        after every action, and `check_integrity(contents=True)`: each page
                        still hashes as at publish)
    accounting (I6)     `pool.check_integrity()` (refcounts == tables holding each cached
                        page, the evictable set, free + private + cached == capacity); once
                        every admitted request is freed, every page is free or evictable and
                        no transfer is open
    liveness            no call waits on the receiver while no write is in flight, no call
                        hangs, and the receiver raises nothing but TransferRefused

A state is expanded once, keyed by `World.fingerprint()` (phases, reservation states, layers
claimed, frames, writers, calls in flight, page owners, generations, cache keys, refcounts
and eviction order, contents): the model assumes it decides every later outcome.  The world
is real objects and threads, so a state with no call in flight is kept as a deep copy of its
world, and one with calls in flight as the nearest such copy plus the actions since, replayed
on a fresh copy (each replay must reach the recorded fingerprint: `divergent_replays`).
Breadth first, so a violation's trace is a shortest one.  Timeouts (`expire`), corrupt or
misshapen frames and protocol versions are left to tests/test_kv_transfer_machine.py; this
model is about who may write which page when.

At the default bounds (r0 and r1 of two pages each whose first pages share their tokens, a
pool of three pages: r1 reuses a page r0 freed, or shares r0's published first page while r0
still holds it) the search is complete: 412 states, 4812 transitions, 15 actions deep.  With
`--pool-pages 2` r1 evicts and reuses r0's unreferenced cached page: 367 states, 4231
transitions, 15 deep.

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

from chaos.protocol_actions import Action, MakeReceiver, World
from chaos.protocol_checks import check_step
from chaos.protocol_senders import Bounds
from chaos.protocol_threads import DONE, Call, Hang, gated_writes
from engine.kv_pool import CACHED
from kv_transfer.receiver import TransferReceiver

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
    was_cached = [world.pool.owner(p) == CACHED for p in range(world.bounds.pool_pages)]
    result.transitions += 1
    result.actions[action.kind] += 1
    try:
        finished = world.apply(action)
    except Hang as e:
        return f"{action} -> hang", [f"hang: {e}"]
    pending = [c for c in world.board.calls[first_new:] if c.status != DONE]
    line = f"{action} -> {_tally(world, action, finished + pending, result)}"
    return line, check_step(world, before, was_cached, finished)


def _tally(world: World, action: Action, calls: list[Call], result: Result) -> str:
    """Count the outcomes ("release ok on end": a waiting release returned when a write
    ended) and describe them for the trace."""
    if action.kind == "admit":
        q = world.requests[action.request]
        refs, hits = world.pool.refs(q.rid), q.reservation.first_page
        result.outcomes["admit reuses a page" if any(r.generation > 1 for r in refs[hits:]) else "admit"] += 1
        result.outcomes["admit hits the cache"] += hits > 0
        result.outcomes["admit evicts a cached page"] += q.evicted > 0
        result.outcomes["admit shares a cached page in use"] += any(
            world.pool.cache.refcount(r.page) > 1 for r in refs[:hits])
        return "pages " + ", ".join(f"{r.page} (generation {r.generation}{', cached' if i < hits else ''})"
                                    for i, r in enumerate(refs))
    for c in calls:
        on = "" if c.action == action else f" on {action.kind}"
        result.outcomes[f"{c.action.kind} {c.outcome}{on}{_reused(world, c)}"] += 1
    if action.kind == "publish":
        result.outcomes["publish"] += 1
    own = (str(action), action.label)
    return "; ".join(c.outcome if c.label in own else f"{c.label}: {c.outcome}" for c in calls) or "done"


def _reused(world: World, c: Call) -> str:
    """How a frame's reserved page changed since: given to another request after it was freed
    ("into a reused page"), or cached, evicted and given to another request."""
    if c.action.kind not in ("frame", "forge", "poison"):
        return ""
    r, i = world.bounds.writer(c.identity)
    ref = world.requests[r].reservation.pages[i]
    if (ref.page, ref.generation) in world.evicted:
        return " into an evicted and reused page"
    return " into a reused page" if world.pool.generation(ref.page) != ref.generation else ""


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
