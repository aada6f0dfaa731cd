"""A worker never waits on one request (issue 16, part 2): a stop regex past its budget ends
only its own request, with an explicit error and its pages freed, while the request beside it
on the same worker completes token-exact; a worker whose loop has not finished a step within
its deadline answers Health not ready (the gateway routes only to ready workers) and ready
again once the step ends."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from decode_worker.engine import DecodeEngine
from decode_worker.service import DecodeServicer
from engine.core import LayerHook, TokenEvent
from engine.errors import ErrorCode
from engine.params import SamplingParams
from engine.scheduler import ScheduledBatch
from kv_transfer.hooks import TransferHooks
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from tests.workers import SECRET, channel, config, run, start_decode, start_prefill, wait_idle
from worker.loop import WorkerLoop
from worker.server import build_core
from worker.stats import LoopWatch

CATASTROPHIC = r"(?:.|.)+(?!)"


def test_the_watch_is_stalled_past_its_deadline_only():
    now = [100.0]
    watch = LoopWatch(deadline_s=30.0, clock=lambda: now[0])
    now[0] += 30.0
    assert watch.stalled_s() is None
    now[0] += 0.5
    assert watch.stalled_s() == 30.5
    watch.beat()
    assert watch.stalled_s() is None


class SlowStep:
    """A role that holds the loop inside the next step's `before_run` until released."""

    def __init__(self) -> None:
        self.closing, self.counts = False, Counter[str]()
        self.armed, self.entered, self.release = threading.Event(), threading.Event(), threading.Event()

    def handle_inbox(self) -> bool:
        return False

    def before_run(self, batch: ScheduledBatch) -> LayerHook | None:
        if self.armed.is_set():
            self.entered.set()
            self.release.wait(30)
        return None

    def after_run(self, events: list[TokenEvent]) -> None:
        pass

    def fail(self, batch: ScheduledBatch, error: BaseException) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def install_hooks(self, hooks: TransferHooks) -> None:
        pass


def wait_for(ready: bool, servicer: DecodeServicer, limit_s: float = 20.0) -> bool:
    """Poll Health until its `ready` is `ready` (False if it never is within `limit_s`)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if servicer.Health(wpb.HealthRequest(), None).ready == ready:
            return True
        time.sleep(0.02)
    return False


def test_health_is_not_ready_while_a_step_runs_past_the_deadline():
    core = build_core(config(kv_cache_tokens=1024, max_model_len=1024))
    lock, wake = threading.RLock(), threading.Event()
    engine = DecodeEngine(core, SECRET, 30.0, lock, wake)
    watch = LoopWatch(deadline_s=0.3)
    servicer = DecodeServicer(engine, "local://watchdog", watch=watch)
    slow = SlowStep()
    loop = WorkerLoop(core, [engine, slow], lock, wake, idle_wait_s=0.01, watch=watch).start()
    try:
        assert wait_for(True, servicer)
        slow.armed.set()
        req = core.make_request([1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        with lock:
            core.add(req)
        wake.set()
        assert slow.entered.wait(20)
        assert wait_for(False, servicer)          # the step is held: not ready
        slow.armed.clear()
        slow.release.set()
        assert wait_for(True, servicer)           # it ended: ready again
        end = time.monotonic() + 20
        while req.finish_reason is None and time.monotonic() < end:
            time.sleep(0.02)
        assert req.finish_reason == "length"
    finally:
        slow.release.set()
        assert loop.stop()
    core.pool.check_integrity()
    assert core.pool.num_free == core.pool.num_pages


@pytest.fixture(scope="module")
def workers():
    cfg = config()
    decode, prefill = start_decode(cfg), start_prefill(cfg)
    yield decode, prefill
    decode.stop()
    prefill.stop()


def test_a_catastrophic_regex_ends_only_its_own_request(workers, shipped_llm):
    decode, prefill = workers
    dch, pch = channel(decode.address), channel(prefill.address)
    tok = shipped_llm.tokenizer
    good_ids, bad_ids = tok.encode("def add(a, b):"), tok.encode("The quick brown fox")   # a long line
    good = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    bad = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, stop_regex=[CATASTROPHIC])
    want = shipped_llm.generate([good_ids], good)[0]
    with ThreadPoolExecutor(2) as pool:
        bad_run = pool.submit(run, dch, pch, "redos", bad_ids, bad)
        good_run = pool.submit(run, dch, pch, "bystander", good_ids, good)
        hurt, fine = bad_run.result(), good_run.result()
    assert hurt.finish is None and hurt.error.code == ErrorCode.INVALID_REQUEST.value
    # the per-token budget ends it, or the mean budget first (its cost doubles per character)
    assert "stop_regex '(?:.|.)+(?!)' exceeded the stop-check budget of 50 ms per token" in hurt.error.message \
        or "over the limit of 5 ms per token on average" in hurt.error.message
    assert len(hurt.token_ids) < 200
    assert fine.error is None and fine.token_ids == want.token_ids and fine.text == want.text
    wait_idle(decode, prefill)
    assert decode.roles[0].counts["failed"] >= 1
    assert wpb_grpc.DecodeServiceStub(dch).Health(wpb.HealthRequest(), timeout=10).ready


def test_a_workers_stop_limits_and_step_deadline_come_from_its_config():
    decode = start_decode(config(kv_cache_tokens=1024, max_model_len=1024, stop_window_chars=64, stop_budget_s=0.2,
                                 step_deadline_s=7.0))
    prefill = start_prefill(config(kv_cache_tokens=1024, max_model_len=1024, step_deadline_s=9.0))
    try:
        assert (decode.core.stop_limits.window_chars, decode.core.stop_limits.budget_s) == (64, 0.2)
        assert decode.loop.watch.deadline_s == 7.0 and prefill.loop.watch.deadline_s == 9.0
    finally:
        decode.stop()
        prefill.stop()


def test_health_names_the_model_without_its_path():
    handle = start_decode(config(kv_cache_tokens=1024, max_model_len=1024))
    try:
        reply = wpb_grpc.DecodeServiceStub(channel(handle.address)).Health(wpb.HealthRequest(), timeout=30)
        assert reply.model == "tiny-moe" and "/" not in reply.model
    finally:
        handle.stop()
