"""The chaos suite's trust scenarios (issue 15): their parts against a real gRPC transfer
server, then the three scenarios in a small real run, as `python -m chaos run` runs them."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from chaos.rogue import CREDENTIALS, code_of, open_channel, transfer_calls
from chaos.siege import StalledStreams
from kv_transfer.frame import PROTOCOL_VERSION
from kv_transfer.receiver import TransferReceiver
from kv_transfer.transport import TransportConfig
from kv_transfer.transport.grpc_server import GrpcTransferServer
from tests.kv_helpers import SECRET, make_pool

TRUST = ("rogue_client", "misbound_prefill", "stalled_streams")


def wait_for(cond, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.02)


@pytest.fixture
def server():
    recv = TransferReceiver(make_pool(8, seed=2), SECRET, timeout_s=30)
    srv = GrpcTransferServer(recv, config=TransportConfig(max_push_streams=3), secret=SECRET, max_workers=5)
    yield srv, recv
    srv.stop()


def test_stalled_streams_fill_the_cap_and_all_close(server):
    srv, recv = server
    stalled = StalledStreams(SECRET)
    try:
        assert stalled.open(srv.endpoint, 5) == 5
        wait_for(lambda: srv.watch.live == 3 and stalled.status()["ended"] == {"RESOURCE_EXHAUSTED": 2})
        assert stalled.status()["open"] == 3
        assert stalled.handshake(srv.endpoint)["version"] == PROTOCOL_VERSION    # a spare thread answers it
    finally:
        closed = stalled.close()
    assert closed == {"closed": 3, "ended": {"RESOURCE_EXHAUSTED": 2, "reply STREAM_CLOSED": 3}}
    wait_for(lambda: srv.watch.live == 0)
    assert srv.watch.refused == 2 and not list(recv.refusal_log)     # a Hello alone fails nothing


def test_the_rogues_transfer_calls_are_refused_and_counted(server):
    srv, recv = server
    calls = transfer_calls({"tenant": "acme"})
    for credentials in CREDENTIALS:
        with open_channel(srv.endpoint.removeprefix("grpc://"), credentials) as ch:
            assert [code_of(call, ch) for _, call in calls] == ["UNAUTHENTICATED"] * len(calls)
    assert srv.auth.refused == len(CREDENTIALS) * len(calls) and srv.watch.live == 0
    assert recv.accepted_frames == 0 and not list(recv.refusal_log)


def test_the_trust_scenarios_in_a_small_run():
    proc = subprocess.run([sys.executable, "-m", "chaos", "run", "--scenarios", ",".join(TRUST), "--requests", "12",
                           "--concurrency", "4", "--seed", "7", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    rows = {s["name"]: s for s in report["scenarios"]}
    assert list(rows) == list(TRUST) and report["ok"] and report["violations"] == 0
    assert report["leaks"] == report["corrupted_completions"] == report["pages_leaked"] == report["silent"] == 0
    for row in rows.values():
        assert row["ok"] and row["faults_injected"] >= 1 and row["faults_detected"] == row["faults_injected"], row
    rogue = rows["rogue_client"]
    # 2 decode workers x (Generate, Abort, Stats, Handshake, Push) + 1 prefill x (Prefill, Stats), twice
    assert rogue["faults_injected"] == 24 and rogue["notes"][0].endswith(
        "24 UNAUTHENTICATED; rpc_unauthenticated grew by decode-0 +10 (calls 10), decode-1 +10 (calls 10), "
        "prefill-0 +4 (calls 4)")
    assert rows["misbound_prefill"]["completed"] + rows["misbound_prefill"]["failed_explicitly"] == \
        rows["misbound_prefill"]["requests"]
    stalled = rows["stalled_streams"]
    assert stalled["faults_injected"] == 8                    # max_push_streams + 8 opened at idle
    assert any(f"a Handshake meanwhile answered version {PROTOCOL_VERSION}" in n for n in stalled["notes"])
    assert any("live Push streams afterwards: 0" in n for n in stalled["notes"])
