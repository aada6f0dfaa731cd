"""Migration through the gateway: a decode stream that breaks after k tokens continues on another
decode worker, and the client's response (streamed or not) equals the uninterrupted one:
tokens, text, logprobs (within 1e-5), finish reason and usage.  Real workers on loopback (three
decode, one prefill); each decode worker sits behind a `CuttingProxy` that breaks streams as a
test's `CutPlan` says (the stream is cut, ends without a final message, or ends with DRAINING or
INTERNAL), so nothing waits on time."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from engine.errors import ErrorCode
from gateway.routing import Worker, WorkerPool
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from tests.gateway_helpers import API_KEY, connection, get, post, start_gateway, wait_ready
from tests.workers import channel, config, start_decode, start_prefill, wait_idle
from worker.types import Role

MAX_MIGRATIONS = 2
PROXIES: dict[int, list[str]] = {}          # a CutPlan's id -> its proxies' addresses, as the workers'


class CutPlan:
    """What the proxies do to the next streams: refuse `refusals` of them with DRAINING, then
    cut `cuts` of them, each once `after` tokens went through, the way `how` says ("lost": abort
    UNAVAILABLE, "eof": end without a final message, "drain": Error DRAINING, "error": Error
    INTERNAL); `fails` resumed streams (with generated tokens) are cut right after their
    reservation, before a token (as when the new worker dies during the re-prefill).  Records
    every GenerateRequest and Reservation the proxies saw."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self, cuts: int = 0, after: int = 3, how: str = "lost", refusals: int = 0, fails: int = 0) -> None:
        with self.lock:
            self.cuts, self.after, self.how, self.refusals, self.fails = cuts, after, how, refusals, fails
            self.requests: list[tuple[str, wpb.GenerateRequest]] = []
            self.reservations: list[wpb.Reservation] = []

    def take(self, what: str) -> bool:
        with self.lock:
            if getattr(self, what) > 0:
                setattr(self, what, getattr(self, what) - 1)
                return True
            return False


class CuttingProxy(wpb_grpc.DecodeServiceServicer):
    """A decode worker's service, passed through to it (with the cluster's credentials), its
    Generate streams broken as `plan` says.  Cutting cancels the call to the worker, which frees
    the request's pages."""

    def __init__(self, address: str, plan: CutPlan) -> None:
        self.plan = plan
        self.channel = channel(address)
        self.stub = wpb_grpc.DecodeServiceStub(self.channel)
        self.server = grpc.server(ThreadPoolExecutor(8))
        wpb_grpc.add_DecodeServiceServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Health(self, request, context):
        return self.stub.Health(request, timeout=5)

    def Stats(self, request, context):
        return self.stub.Stats(request, timeout=5)

    def Generate(self, request, context):
        plan = self.plan
        with plan.lock:
            plan.requests.append((self.address, request))
        if plan.take("refusals"):
            yield wpb.GenerateResponse(error=wpb.Error(code="DRAINING", message="draining (test)"))
            return
        call = self.stub.Generate(request, timeout=120)
        cut, fail, seen = False, False, 0
        try:
            for msg in call:
                kind = msg.WhichOneof("kind")
                if kind == "reservation":
                    with plan.lock:
                        plan.reservations.append(msg.reservation)
                    fail = bool(request.generated_token_ids) and plan.take("fails")
                    cut = not fail and plan.take("cuts")
                yield msg
                seen += len(msg.tokens.token_ids) if kind == "tokens" else 0
                if fail or (cut and seen >= plan.after):
                    break
            else:
                return
        finally:
            call.cancel()
        if fail or plan.how == "lost":
            context.abort(grpc.StatusCode.UNAVAILABLE, "cut by the test")
        elif plan.how in ("drain", "error"):
            code = "DRAINING" if plan.how == "drain" else "INTERNAL"
            yield wpb.GenerateResponse(error=wpb.Error(code=code, message=f"{plan.how} (test)"))

    def stop(self) -> None:
        self.server.stop(grace=None)
        self.channel.close()


@pytest.fixture(scope="module")
def cluster():
    plan = CutPlan()
    decode = [start_decode(config()) for _ in range(3)]
    prefill = start_prefill(config())
    proxies = [CuttingProxy(d.address, plan) for d in decode]
    PROXIES[id(plan)] = [p.address for p in proxies]
    gw = start_gateway([p.address for p in proxies], [prefill.address], routing="load",
                       max_migrations=MAX_MIGRATIONS, request_timeout_s=120)
    try:
        wait_ready(gw.url)
        yield gw, plan, decode + [prefill]
    finally:
        gw.stop()
        try:
            wait_idle(*decode, prefill)
        finally:
            for h in proxies + decode + [prefill]:
                h.stop()


GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 1234}


def body(sampling: dict, stream: bool, max_tokens: int = 16, **kw) -> dict:
    return {"model": "tiny-moe", "prompt": "def fibonacci(n):\n", "max_tokens": max_tokens, "ignore_eos": True,
            "logprobs": 2, "return_token_ids": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {}), **sampling, **kw}


def complete(url: str, req: dict) -> dict:
    """The response's one choice as {text, token_ids, logprobs, finish_reason, usage, ids}, from
    a JSON body or the chunks of a stream (which must end with [DONE])."""
    status, got = post(url, "/v1/completions", req, timeout_s=120)
    assert status == 200, got
    if not req["stream"]:
        c = got["choices"][0]
        return {"text": c["text"], "token_ids": c["token_ids"], "logprobs": c["logprobs"],
                "finish_reason": c["finish_reason"], "usage": got["usage"], "ids": {got["id"]}}
    assert got[-1] == "[DONE]", got[-1]
    chunks = [json.loads(e) for e in got[:-1]]
    out: dict = {"text": "", "token_ids": [], "finish_reason": None, "ids": {c["id"] for c in chunks},
                 "logprobs": {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}}
    for chunk in chunks:
        if "usage" in chunk and not chunk["choices"]:
            out["usage"] = chunk["usage"]
        for c in chunk["choices"]:
            out["text"] += c["text"]
            out["token_ids"] += c.get("token_ids") or []
            out["finish_reason"] = c["finish_reason"] or out["finish_reason"]
            for key, values in (c["logprobs"] or {}).items():
                out["logprobs"][key] += values
    return out


def assert_same(got: dict, want: dict) -> None:
    assert got["token_ids"] == want["token_ids"]
    assert got["text"] == want["text"]
    assert got["finish_reason"] == want["finish_reason"]
    lp, ref = got["logprobs"], want["logprobs"]
    assert lp["tokens"] == ref["tokens"] and lp["text_offset"] == ref["text_offset"]
    assert lp["token_logprobs"] == pytest.approx(ref["token_logprobs"], abs=1e-5)
    for top, top_ref in zip(lp["top_logprobs"], ref["top_logprobs"], strict=True):
        assert top.keys() == top_ref.keys() and list(top.values()) == pytest.approx(list(top_ref.values()), abs=1e-5)
    usage = {k: v for k, v in got["usage"].items() if k != "prompt_tokens_details"}
    assert usage == {k: v for k, v in want["usage"].items() if k != "prompt_tokens_details"}
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] <= got["usage"]["prompt_tokens"]
    assert len(got["ids"]) == 1                          # one stream: the same id throughout


def metric(url: str, name: str, **labels: str) -> float:
    text = get(url, "/metrics")[1]
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}{{{want}}} (\S+)$" if want else rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("sampling,stream,how,after", [
    (GREEDY, True, "lost", 3), (GREEDY, False, "drain", 1), (SEEDED, True, "error", 5),
    (SEEDED, False, "eof", 15)])
def test_a_migrated_response_equals_the_uninterrupted_one(cluster, sampling, stream, how, after):
    gw, plan, workers = cluster
    cause = {"lost": "lost", "eof": "lost", "drain": "drain", "error": "error"}[how]
    plan.reset()
    want = complete(gw.url, body(sampling, stream))
    before = metric(gw.url, "tandem_migrations_total", cause=cause)
    plan.reset(cuts=1, after=after, how=how)
    got = complete(gw.url, body(sampling, stream))
    assert_same(got, want)
    assert len(plan.requests) == 2 and plan.cuts == 0
    (first_at, first), (second_at, second) = plan.requests
    assert second_at != first_at                          # not on the worker that broke
    assert list(second.generated_token_ids) == want["token_ids"][:after]
    assert second.prompt_token_ids == first.prompt_token_ids and second.tenant == first.tenant
    assert second.request_id != first.request_id
    assert metric(gw.url, "tandem_migrations_total", cause=cause) == before + 1
    wait_idle(*workers)


def test_a_stop_string_across_the_break_is_found(cluster):
    """The stop string is the text of tokens k-1 and k: the first worker holds token k-1's text
    back (it may start the stop), the stream breaks after it, and the resumed worker finds the
    stop: text and finish equal the uninterrupted run's."""
    gw, plan, workers = cluster
    plan.reset()
    ref = complete(gw.url, body(GREEDY, False, max_tokens=16))
    pieces, text = ref["logprobs"]["tokens"], ref["text"]
    spans = {k: pieces[k - 1] + pieces[k] for k in range(3, 15)}
    k, stop = next((k, s) for k, s in spans.items() if len(s) >= 2 and text.find(s) == len("".join(pieces[:k - 1])))
    want = complete(gw.url, body(GREEDY, True, max_tokens=16, stop=[stop]))
    assert want["finish_reason"] == "stop" and stop not in want["text"]
    plan.reset(cuts=1, after=k)
    got = complete(gw.url, body(GREEDY, True, max_tokens=16, stop=[stop]))
    assert_same(got, want)
    assert list(plan.requests[1][1].generated_token_ids) == ref["token_ids"][:k]
    wait_idle(*workers)


def test_a_resumed_stream_that_breaks_before_its_first_token_goes_to_a_third_worker(cluster):
    gw, plan, workers = cluster
    plan.reset()
    want = complete(gw.url, body(SEEDED, True))
    before = metric(gw.url, "tandem_migrations_total", cause="lost")
    plan.reset(cuts=1, after=4, fails=1)
    got = complete(gw.url, body(SEEDED, True))
    assert_same(got, want)
    assert len({at for at, _ in plan.requests}) == 3 and plan.fails == 0
    assert [len(r.generated_token_ids) for _, r in plan.requests] == [0, 4, 4]
    assert metric(gw.url, "tandem_migrations_total", cause="lost") == before + 1     # one break, one retry
    wait_idle(*workers)


def test_a_migrating_stream_with_no_worker_left_waits_for_one_that_answers_again(cluster):
    """The stream breaks on one worker, its resumed stream breaks before a token on both others:
    no worker is left to try, so it waits until a worker's Health answers again, and goes on."""
    gw, plan, workers = cluster
    plan.reset()
    want = complete(gw.url, body(GREEDY, False))
    plan.reset(cuts=1, after=2, fails=2)
    got = complete(gw.url, body(GREEDY, False))
    assert_same(got, want)
    assert [len(r.generated_token_ids) for _, r in plan.requests] == [0, 2, 2, 2]
    assert len({at for at, _ in plan.requests[:3]}) == 3
    wait_idle(*workers)


def test_an_unseeded_sampled_stream_resumes_with_its_first_reservations_seed(cluster):
    gw, plan, workers = cluster
    plan.reset(cuts=1, after=4)
    got = complete(gw.url, body({"temperature": 1.0}, True, max_tokens=12))
    assert len(got["token_ids"]) == 12 and got["usage"]["completion_tokens"] == 12
    (_, first), (_, second) = plan.requests
    assert not first.params.has_seed
    assert second.params.has_seed and second.params.seed == plan.reservations[0].seed
    assert plan.reservations[1].seed == plan.reservations[0].seed
    assert list(second.generated_token_ids) == got["token_ids"][:4]
    wait_idle(*workers)


def test_a_break_after_the_last_token_ends_with_the_resumed_workers_finish(cluster):
    """Every token was streamed, the Finish was not: the resumed Generate answers with a Finish
    alone, and the response is the uninterrupted one."""
    gw, plan, workers = cluster
    plan.reset()
    want = complete(gw.url, body(GREEDY, True, max_tokens=6))
    plan.reset(cuts=1, after=6)
    got = complete(gw.url, body(GREEDY, True, max_tokens=6))
    assert_same(got, want)
    assert len(plan.reservations) == 1                    # the resumed one reserved nothing
    wait_idle(*workers)


def test_the_migration_bound_ends_the_stream_with_migration_failed(cluster):
    gw, plan, workers = cluster
    before = metric(gw.url, "tandem_migrations_failed_total", reason="bound")
    plan.reset(cuts=MAX_MIGRATIONS + 1, after=2)
    status, events = post(gw.url, "/v1/completions", body(GREEDY, True, max_tokens=24), timeout_s=120)
    assert status == 200 and events[-1] != "[DONE]"
    error = json.loads(events[-1])["error"]
    assert error["code"] == "migration_failed" and "127.0.0.1" not in error["message"], error
    streamed = [t for e in events[:-1] for c in json.loads(e)["choices"] for t in c.get("token_ids") or []]
    assert len(streamed) == 2 * (MAX_MIGRATIONS + 1)      # every token before the last break, once
    assert len(plan.requests) == MAX_MIGRATIONS + 1
    assert metric(gw.url, "tandem_migrations_failed_total", reason="bound") == before + 1
    plan.reset(cuts=MAX_MIGRATIONS + 1, after=2)
    status, got = post(gw.url, "/v1/completions", body(GREEDY, False, max_tokens=24))
    assert status == 502 and got["error"]["code"] == "migration_failed"    # the bound, as JSON
    plan.reset()
    wait_idle(*workers)


def test_a_draining_refusal_before_the_first_token_goes_to_the_other_worker(cluster):
    gw, plan, workers = cluster
    plan.reset()
    want = complete(gw.url, body(GREEDY, False))
    before = sum(metric(gw.url, "tandem_migrations_total", cause=c) for c in ("lost", "drain", "error"))
    plan.reset(refusals=1)
    got = complete(gw.url, body(GREEDY, False))
    assert_same(got, want)
    (first_at, _), (second_at, second) = plan.requests
    assert first_at != second_at and not second.generated_token_ids
    assert sum(metric(gw.url, "tandem_migrations_total", cause=c) for c in ("lost", "drain", "error")) == before
    wait_idle(*workers)


def test_a_drained_worker_s_stream_continues_on_the_other(cluster):
    """A real drain (grace 0) of the worker a long stream runs on: the worker ends it with
    DRAINING, the gateway migrates it, and it keeps streaming from the other worker."""
    gw, plan, workers = cluster
    plan.reset()
    before = metric(gw.url, "tandem_migrations_total", cause="drain")
    conn = connection(gw.url)
    conn.request("POST", "/v1/completions", body=json.dumps(body(GREEDY, True, max_tokens=1500)),
                 headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    (address, _), = plan.requests
    busy = next(h for h, p in zip(workers, cluster_proxies(plan)) if p == address)
    stub = wpb_grpc.DecodeServiceStub(channel(busy.address))
    try:
        reply = stub.Drain(wpb.DrainRequest(grace_s=0), timeout=30)
        assert reply.drained == 1 and reply.draining
        tokens = 0
        while tokens < 20:                                 # it goes on, from the other worker
            line = resp.readline()
            assert line, "the stream ended"
            if line.startswith(b"data: "):
                event = json.loads(line[len(b"data: "):])
                assert "error" not in event, event
                tokens += sum(len(c.get("token_ids") or []) for c in event["choices"])
        (_, first), (second_at, second) = plan.requests
        assert second_at != address and len(second.generated_token_ids) >= 1
        assert metric(gw.url, "tandem_migrations_total", cause="drain") == before + 1
    finally:
        conn.close()                                       # the client leaves: its pages are freed
        stub.Drain(wpb.DrainRequest(undo=True), timeout=30)
    wait_idle(*workers)


def cluster_proxies(plan: CutPlan) -> list[str]:
    return PROXIES[id(plan)]


def test_a_draining_worker_gets_no_new_request():
    w = Worker("127.0.0.1:1", Role.DECODE, health=wpb.HealthReply(ready=True, kv_capacity_tokens=100))
    assert w.available()
    w.health = wpb.HealthReply(ready=True, kv_capacity_tokens=100, draining=True)
    assert w.healthy and w.draining and not w.available()


def test_a_stream_that_fits_no_other_worker_fails_at_once_naming_the_capacity():
    from dataclasses import replace

    from engine.params import SamplingParams
    from gateway.choice import Choice
    from gateway.errors import Cause, ForwardError
    from gateway.migration import migrate
    from gateway.outcome import Broken
    from gateway.route import Route
    pool = WorkerPool(("127.0.0.1:1", "127.0.0.1:2"), ("127.0.0.1:3",), (), b"")
    big, small = pool.of(Role.DECODE)
    big.health = wpb.HealthReply(ready=True, kv_capacity_tokens=1000)
    small.health = wpb.HealthReply(ready=True, kv_capacity_tokens=100)
    route = Route(pool, "r", "acme", 0.0, 3, 1.0, max_migrations=3)

    def choice() -> Choice:
        return Choice(0, [1] * 50, SamplingParams(max_tokens=400))
    broken = Broken(Cause.LOST, ForwardError(ErrorCode.DECODE_FAILED, "cut"), big.address)
    with pytest.raises(ForwardError) as e:
        migrate(choice(), route, broken)
    assert e.value.code == ErrorCode.MIGRATION_FAILED and e.value.status == 503
    assert "450" in e.value.message and "largest: 100 tokens" in e.value.message
    small.health = wpb.HealthReply(ready=True, kv_capacity_tokens=100, draining=True)
    migrate(choice(), route, broken)           # none known that fits or not: it waits for one
    with pytest.raises(ForwardError) as e:
        migrate(choice(), replace(route, max_migrations=0), broken)
    assert e.value.code == ErrorCode.MIGRATION_FAILED and "--max-migrations 0" in e.value.message
