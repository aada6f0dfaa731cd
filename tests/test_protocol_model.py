"""The protocol model (`chaos.protocol_model`) over the real receiver and pool: at the default
bounds no interleaving of reserve, frames (genuine, duplicate, stale, forged), commit, close,
release, free and page reuse breaks ownership, coverage or accounting; the search is
exhaustive, deterministic and reaches the corners that matter; and receivers with a known
hole are caught, each with a shortest trace."""

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
]


@pytest.fixture(scope="module")
def default_run() -> Result:
    return explore(Bounds())


def test_no_interleaving_breaks_ownership_coverage_or_accounting(default_run):
    assert default_run.violations == []


def test_the_search_is_exhaustive_and_deterministic(default_run):
    r = default_run
    assert r.complete and r.divergent_replays == 0
    assert r.states >= 350 and r.transitions >= 4000     # 403 and 4732 when written
    assert 12 <= r.max_depth_reached < Bounds().max_depth


def test_the_search_reaches_every_corner(default_run):
    assert set(default_run.actions) == {"admit", "frame", "forge", "end", "commit", "close",
                                        "release", "free"}
    missing = [c for c in CORNERS if not default_run.outcomes[c]]
    assert not missing, (missing, default_run.outcomes)


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


def test_the_command_prints_one_json_line(capsys):
    assert main(["--max-depth", "3"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["violations"] == 0 and summary["max_depth_reached"] == 3
    assert summary["bounds"]["pool_pages"] == 3 and not summary["complete"]
    assert receiver_module.write_payload is pages_module.write_payload   # the gate is gone
