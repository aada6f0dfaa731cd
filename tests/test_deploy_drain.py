"""Drain and restart where workers run as deployed.

A worker process (`python -m deploy.worker`) that gets SIGTERM drains: Health says draining,
new requests are refused with DRAINING, its live requests end with DRAINING after the grace
period (a second signal ends them at once), and it exits 0.

On Ray: a worker actor's constructor arguments are plain values (no error-level warning about
arguments in the object store), so a worker actor killed after the driver dropped its handles
restarts and serves; `WorkerActor.drain` (and undo, and restart), SIGTERM to a worker actor's
process and `Deployment.remove_worker` drain one worker while the deployment keeps serving on
the others."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import openai
import pytest
import ray

from deploy import registry as reg
from deploy.launcher import Deployment
from deploy.settings import ServeSettings
from deploy.status import read_stats
from engine.errors import ErrorCode
from engine.options import build
from engine.params import SamplingParams
from gateway.server import _free_port
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from tests.gateway_helpers import connection
from tests.workers import SECRET, channel
from worker.client import generate

CHAT = [{"role": "user", "content": "Repeat after me: blue kettle"}]


@pytest.fixture
def decode_process(request) -> Iterator[tuple[subprocess.Popen, str]]:
    """A decode worker process with --drain-grace-s `request.param`; (process, address)."""
    env = dict(os.environ, TANDEM_CLUSTER_SECRET=SECRET.hex())
    proc = subprocess.Popen([sys.executable, "-m", "deploy.worker", "--role", "decode", "--kv-cache-tokens", "4096",
                             "--drain-grace-s", str(request.param)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, _, address, _ = proc.stdout.readline().split()     # READY decode ADDRESS ENDPOINT
        yield proc, address
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def reserve(address: str, rid: str) -> Iterator[wpb.GenerateResponse]:
    """A Generate whose reservation is taken and whose prefill never comes: a live request."""
    stream = generate(channel(address), None, rid, "t", [1, 2, 3, 4], SamplingParams(max_tokens=8), timeout_s=60)
    assert next(stream).WhichOneof("kind") == "reservation"
    return stream


def health(address: str) -> wpb.HealthReply:
    return wpb_grpc.DecodeServiceStub(channel(address)).Health(wpb.HealthRequest(), timeout=5)


@pytest.mark.parametrize("decode_process", [1.0], indirect=True)
def test_sigterm_drains_a_worker_process_then_it_exits_0(decode_process):
    proc, address = decode_process
    live = reserve(address, "live")
    proc.send_signal(signal.SIGTERM)
    ended = next(live)                                 # after the grace period
    assert ended.WhichOneof("kind") == "error" and ended.error.code == ErrorCode.DRAINING.value, ended
    assert proc.wait(timeout=60) == 0
    assert "drained: 0 finished, 1 drained; stopped" in proc.stderr.read()


@pytest.mark.parametrize("decode_process", [600.0], indirect=True)
def test_a_draining_worker_refuses_new_requests_and_a_second_signal_ends_the_rest(decode_process):
    proc, address = decode_process
    assert not health(address).draining
    live = reserve(address, "live")
    proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + 30
    while not health(address).draining:
        assert time.monotonic() < end, "the worker did not start draining"
        time.sleep(0.05)
    refused = next(generate(channel(address), None, "new", "t", [1, 2, 3], SamplingParams(max_tokens=4)))
    assert refused.WhichOneof("kind") == "error" and refused.error.code == ErrorCode.DRAINING.value, refused
    proc.send_signal(signal.SIGTERM)                   # the grace period (600 s) is cut short
    assert next(live).WhichOneof("kind") == "error"
    assert proc.wait(timeout=60) == 0
    assert "a second signal cut the grace period short" in proc.stderr.read()


def _address(wid: str) -> str | None:
    workers = ray.get(reg.lookup().workers.remote(), timeout=30)
    return next((w["address"] for w in workers if w["worker_id"] == wid), None)


def _wait_new_address(wid: str, old: str | None, timeout_s: float = 120) -> str:
    end = time.monotonic() + timeout_s
    while (now := _address(wid)) in (None, old):
        assert time.monotonic() < end, f"{wid} did not register again"
        time.sleep(0.25)
    assert now is not None
    return now


def _serves(url: str, timeout_s: float = 60) -> None:
    """A chat completion succeeds (retried while the gateway catches up with a restart)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    end = time.monotonic() + timeout_s
    while True:
        try:
            assert client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=4).usage.completion_tokens
            return
        except openai.APIError:
            assert time.monotonic() < end, "the deployment did not serve"
            time.sleep(0.5)


def test_worker_actors_restart_from_plain_arguments_drain_and_scale_down(capfd):
    settings = build(ServeSettings, port=_free_port("127.0.0.1"), decode_workers=2, kv_cache_tokens=4096,
                     max_restarts=3, drain_grace_s=5.0, log_level="warning")
    d = Deployment(settings, say=lambda _: None)
    try:
        d.start(timeout_s=180)
        assert "constructor arguments in the object store" not in capfd.readouterr().err
        # the driver lets go of every handle it made for the workers' sake
        d.registry = None
        gc.collect()
        old = _address("decode-0")
        ray.kill(d.workers["decode-0"], no_restart=False)      # as a crash: Ray restarts it
        _wait_new_address("decode-0", old)
        _serves(d.url)

        drained = ray.get(d.workers["decode-1"].drain.remote(0.5), timeout=60)
        assert drained == {"finished": 0, "drained": 0, "draining": True}
        assert read_stats({"worker_id": "decode-1"})["draining"] is True
        _serves(d.url)                                         # on decode-0
        assert ray.get(d.workers["decode-1"].drain.remote(0, undo=True), timeout=60)["draining"] is False
        assert read_stats({"worker_id": "decode-1"})["draining"] is False

        old = _address("decode-1")
        assert ray.get(d.workers["decode-1"].drain.remote(0.5, restart=True), timeout=60)["drained"] == 0
        old = _wait_new_address("decode-1", old)
        pid = ray.get(d.workers["decode-1"].__ray_call__.remote(lambda _: os.getpid()), timeout=60)
        os.kill(pid, signal.SIGTERM)                           # drains, unregisters, exits; Ray restarts it
        _wait_new_address("decode-1", old)

        assert d.remove_worker("decode-0", grace_s=1.0) == {"finished": 0, "drained": 0, "draining": True}
        assert _address("decode-0") is None and "decode-0" not in d.workers
        _serves(d.url)                                         # on the restarted decode-1
    finally:
        d.stop()


def test_the_shutdown_log_counts_a_stream_that_finished_during_the_drain():
    """Deployment.stop drains the gateways first: a stream in flight finishes there, before any
    worker drains, and the log counts it (it said "workers finished 0 request(s)")."""
    said: list[str] = []
    settings = build(ServeSettings, port=_free_port("127.0.0.1"), colocated=True, kv_cache_tokens=4096,
                     compile=False, drain_grace_s=60.0, log_level="warning")
    d = Deployment(settings, say=said.append)
    try:
        d.start(timeout_s=180)
        conn = connection(d.url)
        conn.request("POST", "/v1/completions", body='{"model": "tiny-moe", "prompt": "x", "max_tokens": 48, '
                     '"ignore_eos": true, "stream": true}', headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        body: list[str] = []
        reader = threading.Thread(target=lambda: body.append(resp.read().decode()), daemon=True)
        reader.start()
    finally:
        d.stop()
    reader.join(30)
    assert body and body[0].rstrip().endswith("data: [DONE]"), body      # it finished in the grace period
    assert "tandem: drained: 1 request(s) finished in the grace period, 0 ended by the drain" in said, said
