"""The invariants `chaos.protocol_model` checks after every action (see its docstring): each
returns the problems it found, as sentences naming pages, layers and whose bytes they hold."""

from __future__ import annotations

from chaos.protocol_actions import MIXED, Contents, World
from chaos.protocol_threads import PARKED, WAITING, Call
from engine.kv_pool import CACHED, PageRef
from kv_transfer.reservation import Reservation


def check_step(world: World, before: Contents, was_cached: list[bool], finished: list[Call]) -> list[str]:
    """Every problem after an action: `before` the contents and `was_cached` which pages were
    cached before it, `finished` the calls that ended during it."""
    after = world.contents()
    return (_writes(world, before, after, finished) + _commits(world, after, finished) +
            _cache_unchanged(world, before, after, was_cached) + _errors(finished) +
            _accounting(world) + _stuck(world))


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
    now = "free" if owner is None else "cached" if owner == CACHED else f"{owner}'s"
    return [f"the page is now {now} (generation {gen}); {q.rid} reserved pool page {ref.page} "
            f"generation {ref.generation} as its page {i}"]


def _commits(world: World, after: Contents, finished: list[Call]) -> list[str]:
    """Coverage: a successful commit finds every prompt page holding its own bytes, or (its
    cached prefix) a cached page under its own key holding the bytes of a request whose page
    had that key."""
    problems: list[str] = []
    for call in (c for c in finished if c.action.kind == "commit" and c.error is None):
        r = call.action.request
        assert isinstance(call.result, Reservation)   # what a commit returns
        for i, ref in enumerate(call.result.pages):
            where = f"committed r{r}'s page {i} (pool page {ref.page})"
            if i < call.result.first_page:
                wrong = _cached(world, after, r, i, ref)
            else:
                want = world.bounds.identity(r, i)
                wrong = [f"layer {k} holds {_name(world, g)}" for k, g in enumerate(after[ref.page])
                         if g != want] or _owned(world, ref.page, want)
            problems += [f"{where}: {', '.join(wrong)}"] if wrong else []
    return problems


def _cached(world: World, after: Contents, r: int, i: int, ref: PageRef) -> list[str]:
    """[] if r's page i, `ref`, is a cached page under r's key i whose every layer holds the
    bytes of some request's page i with that key."""
    key = world.requests[r].keys[i]
    if (world.pool.owner(ref.page), world.pool.generation(ref.page)) != (CACHED, ref.generation) or \
            world.pool.cache.key(ref.page) != key:
        return [f"it is no longer the cached page r{r} was given (owner {world.pool.owner(ref.page)}, "
                f"generation {world.pool.generation(ref.page)})"]
    ok = {world.bounds.identity(w.index, i) for w in world.requests if w.keys[i] == key}
    return [f"layer {k} holds {_name(world, g)}" for k, g in enumerate(after[ref.page]) if g not in ok]


def _cache_unchanged(world: World, before: Contents, after: Contents, was_cached: list[bool]) -> list[str]:
    """No cached page's bytes change while it stays cached."""
    return [f"cached pool page {p} changed from {_name(world, before[p][k])} to {_name(world, after[p][k])}"
            for p, cached in enumerate(was_cached) if cached and world.pool.owner(p) == CACHED
            for k in range(len(after[p])) if after[p][k] != before[p][k]]


def _errors(finished: list[Call]) -> list[str]:
    return [f"{c.label}: receiver {c.outcome}" for c in finished if c.error is not None and not c.refused]


def _accounting(world: World) -> list[str]:
    try:
        world.pool.check_integrity(contents=True)      # refcounts, and no cached page rewritten
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
