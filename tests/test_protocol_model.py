"""The protocol model (`chaos.protocol_model`) over the real receiver and pool with its prefix
cache: at the default bounds (two requests overlapping, the second sharing the first's cached
page while both hold it) and at the eviction bounds (a pool of two pages: the second request
evicts and reuses a page the first published) no interleaving of admission with a cached
prefix, frames (genuine, duplicate, stale, forged, aimed at a cached page), commit, close,
publish, release, free, eviction and page reuse breaks ownership, coverage, the cache's
read-only pages or accounting; the search is exhaustive, deterministic and reaches the corners
that matter; and receivers with a known hole are caught, each with a shortest trace."""

from __future__ import annotations

import json

import pytest

import kv_transfer.pages as pages_module
import kv_transfer.receiver as receiver_module
from chaos.protocol_model import Bounds, Result, explore, main
from kv_transfer.errors import Refusal
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import Reservation

ADMIT_R0 = "admit r0 -> pages 0 (generation 1), 1 (generation 1)"
CORNERS = [
    "admit reuses a page",        # r1 gets a page r0 freed, with a new generation
    "frame parked",               # a write in flight ...
    "release waiting",            # ... holds the owner's release back
    "release ok on end",          # ... which returns when that write ends
    "commit waiting",
    "commit ok on end",           # a commit that waited for the last write, then passed
    "commit ok",
    "commit INCOMPLETE",
    "frame DUPLICATE",
    "frame EXPIRED",              # a stale frame replayed after release (and reuse)
    "forge BAD_TAG",              # r0's frame aimed at r1's transfer
    "forge EXPIRED",
    "frame AFTER_FAILURE",
    "publish",                    # r0's committed pages enter the cache ...
    "admit hits the cache",       # ... r1 is admitted with r0's first page as its cached prefix
    "admit shares a cached page in use",   # ... while r0 still holds it (refcount 2)
    "poison CACHED_PAGE",         # r1's own sender aims a genuine frame at that page
]
EVICTION_CORNERS = [
    "admit evicts a cached page",            # r1 takes r0's unreferenced cached page 1 ...
    "admit hits the cache",                  # ... and keeps r0's page 0 as its prefix
    "frame EXPIRED into an evicted and reused page",   # r0's stale frame for the evicted page
    "forge BAD_TAG into an evicted and reused page",   # ... aimed at r1's transfer
    "poison CACHED_PAGE",
]
EVICTION = Bounds(pool_pages=2)


@pytest.fixture(scope="module")
def default_run() -> Result:
    return explore(Bounds())


@pytest.fixture(scope="module")
def eviction_run() -> Result:
    return explore(EVICTION)


def test_no_interleaving_breaks_ownership_coverage_the_cache_or_accounting(default_run, eviction_run):
    assert default_run.violations == [] and eviction_run.violations == []


def test_the_search_is_exhaustive_and_deterministic(default_run, eviction_run):
    for r in (default_run, eviction_run):
        assert r.complete and r.divergent_replays == 0
        assert 12 <= r.max_depth_reached < Bounds().max_depth
    assert default_run.states >= 380 and default_run.transitions >= 4500    # 412 and 4812 when written
    assert eviction_run.states >= 330 and eviction_run.transitions >= 4000  # 367 and 4231 when written


def test_the_search_reaches_every_corner(default_run, eviction_run):
    kinds = {"admit", "frame", "poison", "forge", "end", "commit", "close", "publish", "release", "free"}
    assert set(default_run.actions) == set(eviction_run.actions) == kinds
    missing = [c for c in CORNERS if not default_run.outcomes[c]]
    missing += [c for c in EVICTION_CORNERS if not eviction_run.outcomes[c]]
    assert not missing, (missing, default_run.outcomes, eviction_run.outcomes)


class EagerRelease(TransferReceiver):
    """Forgets a transfer at once, without waiting for writes still in flight (breaks I5)."""

    def release(self, transfer_id: bytes, reason: Refusal = Refusal.CANCELLED) -> Reservation | None:
        with self._lock:
            res = self._live.pop(transfer_id, None)
            if res is not None:
                if not res.terminal:
                    self._fail(res, reason, "released without waiting")
                self._gone[transfer_id] = res.request_id
        return res


def test_a_release_that_does_not_wait_lets_a_late_write_land_in_a_reused_page():
    r = explore(Bounds(), EagerRelease, stop_after=10)
    trace, message = r.violations[0]
    assert trace == [ADMIT_R0, "frame r0.f0 -> parked", "release r0 -> ok", "free r0 -> done",
                     "end frame r0.f0 -> ok"]
    assert message == ("frame r0.f0 copied r0 page 0's bytes into pool page 0 layer 0, but the page "
                       "is now free (generation 1); r0 reserved pool page 0 generation 1 as its page 0")
    trace, message = next(v for v in r.violations if "now r1's" in v[1])
    assert "admit r1 -> pages 2 (generation 1), 0 (generation 2)" in trace
    assert trace[-1] == "end frame r0.f0 -> ok"
    assert message.startswith("frame r0.f0 copied r0 page 0's bytes into pool page 0 layer 0, but "
                              "the page is now r1's (generation 2)")


def test_a_receiver_without_the_tag_check_takes_a_forged_frame(monkeypatch):
    monkeypatch.setattr(receiver_module, "tags_equal", lambda a, b: True)
    r = explore(Bounds(), stop_after=1)
    (trace, message), = r.violations
    assert trace == [ADMIT_R0, "release r0 -> ok", "free r0 -> done",
                     "admit r1 -> pages 2 (generation 1), 0 (generation 2)",
                     "forge r0.f0->r1 -> parked", "end forge r0.f0->r1 -> ok"]
    assert message == ("forge r0.f0->r1 copied r0 page 0's bytes into pool page 2 layer 0, but the "
                       "page is now r1's (generation 1); r0 reserved pool page 0 generation 1 as its page 0")


def test_a_commit_without_the_coverage_check_is_caught(monkeypatch):
    monkeypatch.setattr(Reservation, "check_coverage", lambda self, c: None)    # breaks I4
    r = explore(Bounds(), stop_after=1)
    assert [v[1] for v in r.violations] == [
        "committed r0's page 0 (pool page 0): layer 0 holds never-written bytes",
        "committed r0's page 1 (pool page 1): layer 0 holds never-written bytes"]
    assert r.violations[0][0] == [ADMIT_R0, "commit r0 -> ok"]


WARM_R1 = ["frame r0.f0 -> parked", "frame r0.f1 -> parked", "commit r0 -> waiting", "end frame r0.f0 -> ok",
           "end frame r0.f1 -> ok; commit r0: ok"]


def test_a_receiver_that_lets_a_frame_into_the_cached_prefix_is_caught(monkeypatch):
    """Without the CACHED_PAGE check and the page owner check (STALE_PAGE: a cached page is not
    the request's), r1's genuine frame for the page it shares with r0 lands in the cache."""
    monkeypatch.setattr(Reservation, "check_uncached", lambda self, h: None)
    monkeypatch.setattr(TransferReceiver, "_check_page", lambda self, res, ref, cached=False: None)
    r = explore(Bounds(), stop_after=1)
    trace = [ADMIT_R0, *WARM_R1, "publish r0 -> done",
             "admit r1 -> pages 0 (generation 1, cached), 2 (generation 1)", "poison r1.p0 -> parked",
             "end poison r1.p0 -> raised AssertionError('page 0 is cached (read-only): r1 cannot write it')"]
    assert all(t == trace for t, _ in r.violations)
    assert [m for _, m in r.violations][1:3] == [
        "poison r1.p0 copied r1 page 0's bytes into pool page 0 layer 0, but the page is now cached "
        "(generation 1); r1 reserved pool page 0 generation 1 as its page 0",
        "cached pool page 0 changed from r0 page 0's bytes to r1 page 0's bytes"]
    assert r.violations[-1][1] == "pool integrity: cached page 0 was written after it was published"


def test_the_command_prints_one_json_line(capsys):
    assert main(["--max-depth", "3"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["violations"] == 0 and summary["max_depth_reached"] == 3
    assert summary["bounds"]["pool_pages"] == 3 and not summary["complete"]
    assert receiver_module.write_payload is pages_module.write_payload   # the gate is gone
