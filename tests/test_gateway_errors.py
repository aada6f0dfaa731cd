"""Refusals say whether to retry (issue 41, item 5): a request that can never fit (the
tenant's whole KV budget, every decode worker's KV together, the context) is a 400 with the
numbers, which the official openai client does not send again; 429 (with Retry-After) only
for what waiting fixes.  Every error body's `code` comes from one table (gateway/errors.py),
one spelling per code, whoever raised it: the gateway, or a worker (ErrorCode)."""

from __future__ import annotations

import ast
import asyncio
import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest

from engine.errors import ErrorCode
from gateway.admission import AdmissionQueue, InvalidField, Rejected
from gateway.compile_queue import Busy
from gateway.errors import ERRORS, RETRY_AFTER_S, error_body, public
from proto import worker_pb2 as wpb
from tests.gateway_helpers import API_KEY, FakeWorker, fake_cluster, post, start_gateway, wait_ready
from tests.test_gateway_fairness import Fixed

CHAT = [{"role": "user", "content": "hi"}]
GATEWAY = Path(__file__).resolve().parent.parent / "gateway"


def rejected(gw, reason: str) -> float:
    """How many requests the gateway refused for `reason` (its own metrics)."""
    return gw.app.state.gateway.metrics.registry.get_sample_value("tandem_rejected_total", {"reason": reason}) or 0


# ---- the table ------------------------------------------------------------------------------------
def test_every_error_code_of_the_protocol_has_one_lowercase_spelling():
    for code in ErrorCode:
        entry = public(code)
        assert entry is ERRORS[code.value.lower()], code
        assert entry.code == code.value.lower() and entry.code.islower()
    assert error_body(ErrorCode.INVALID_REQUEST, "m")["error"]["code"] == error_body("invalid_request", "m")[
        "error"]["code"] == "invalid_request"


def test_retryable_codes_carry_retry_after_and_the_others_do_not():
    for entry in ERRORS.values():
        assert (entry.headers() == {"Retry-After": str(RETRY_AFTER_S)}) == entry.retryable, entry
        assert entry.retryable or entry.status < 500 or entry.code in ("internal", "unknown_peer", "aborted")
    assert {c for c, e in ERRORS.items() if e.status == 429} <= {c for c, e in ERRORS.items() if e.retryable}
    for never in ("kv_budget", "kv_capacity", "context_length", "invalid_request", "schema"):
        assert ERRORS[never].status == 400 and not ERRORS[never].retryable


# Each way the gateway's code refuses, and where its reason is: (the reason's argument index,
# the status the refusal's class promises, None: any).  The status itself is always the table's.
REFUSALS = {
    "Rejected": (0, None),                  # Rejected(reason, message)
    "_reject": (1, None),                   # the queue's _reject(tenant, reason, message)
    "InvalidField": (2, 400),               # InvalidField(param, message[, reason]): a 400 naming a field
    "Busy": (0, 429),                       # the compile queue's Busy(reason, message)
    "Refusal": (1, None),                   # the connection layer's Refusal(message, reason)
}


def raised_reasons() -> list[tuple[str, int, str, int | None, list[object]]]:
    """(file, line, reason, the status its class promises, the call's literal arguments) of
    every refusal the gateway's code raises with a literal reason (REFUSALS)."""
    found = []
    for path in sorted(GATEWAY.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name not in REFUSALS:
                continue
            args = [a.value if isinstance(a, ast.Constant) else None for a in node.args]
            at, promised = REFUSALS[name]
            reason = args[at] if len(args) > at else "out_of_range" if name == "InvalidField" else None
            if isinstance(reason, str):
                found.append((path.name, node.lineno, reason, promised, args))
    return found


def test_every_refusal_the_gateway_raises_is_in_the_table_and_answered_with_its_status():
    """A refusal names its reason and nothing else decides its status: no call restates an
    HTTP status, every reason is in the table, and a Rejected answers the table's status (what
    each site restated before is what the table says: 400, 401, 404, 429, 503)."""
    found = raised_reasons()
    assert len(found) > 30 and {"kv_budget", "queue_full", "model_not_found", "out_of_range", "ambiguous_framing",
                                "too_many_connections", "draining", "grammar_queue_full"} <= {f[2] for f in found}
    for file, line, reason, promised, args in found:
        assert reason in ERRORS, f"{file}:{line}: {reason!r} is not in gateway/errors.py ERRORS"
        assert not any(isinstance(a, int) for a in args), f"{file}:{line}: a status restated: {args}"
        assert Rejected(reason, "m").status == ERRORS[reason].status
        if promised is not None:
            assert ERRORS[reason].status == promised, f"{file}:{line}: {reason} is {ERRORS[reason].status}, " \
                                                      f"not the {promised} its class promises"
    assert {ERRORS[f[2]].status for f in found} >= {400, 401, 404, 429, 503}


def test_a_refusal_takes_its_status_from_the_table():
    for reason, entry in ERRORS.items():
        refused = Rejected(reason, "m")
        assert (refused.reason, refused.status, refused.message) == (reason, entry.status, "m")
    assert InvalidField("n", "m").status == 400 and Busy("grammar_queue_full", "m").status == 429
    # a reason the table lacks (the test above keeps every raised one in it): public()'s fallback
    assert Rejected("not_in_the_table", "m").status == 500


# ---- the admission queue: never vs not now ---------------------------------------------------------
def refusal(queue: AdmissionQueue, tenant: str, kv_tokens: int) -> Rejected:
    async def main() -> Rejected:
        with pytest.raises(Rejected) as e:
            async with queue.admit(tenant, kv_tokens):
                pass
        return e.value
    return asyncio.run(main())


def test_a_request_over_every_decode_workers_kv_together_is_a_400_with_the_numbers():
    queue = AdmissionQueue(100, 10, 100, 600, Fixed(cluster=1000))
    e = refusal(queue, "A", 1001)
    assert (e.status, e.reason) == (400, "kv_capacity")
    assert "1001 KV tokens" in e.message and "(1000 tokens)" in e.message
    assert queue.tenants == {} and queue.total == 0


def test_a_request_over_the_whole_budget_is_400_before_a_full_queue_says_429():
    queue = AdmissionQueue(0, 10, 100, 600, Fixed(tenant=1000))       # a full queue: 429 for anything that fits
    e = refusal(queue, "A", 1001)
    assert (e.status, e.reason) == (400, "kv_budget") and "budget of 1000 tokens" in e.message
    assert refusal(queue, "A", 10).status == 429


def test_a_request_held_back_by_its_tenants_own_requests_is_a_429_naming_them():
    async def main() -> Rejected:
        queue = AdmissionQueue(100, 10, 100, 0.05, Fixed(cluster=10_000, tenant=1000))
        async with queue.admit("A", 700):
            with pytest.raises(Rejected) as e:
                async with queue.admit("A", 400):         # 1100 > 1000 while the first runs
                    pass
            assert queue.tenants["A"].kv_reserved == 700 and queue.total == 1
        assert queue.tenants == {} and queue.total == 0
        return e.value
    e = asyncio.run(main())
    assert (e.status, e.reason) == (429, "kv_budget_in_use") and ERRORS[e.reason].retryable
    assert "reserves 400 KV tokens" in e.message and "hold 700" in e.message and "budget of 1000" in e.message


# ---- over HTTP, with the official client --------------------------------------------------------
def test_a_request_that_can_never_fit_is_not_retried_by_the_openai_client():
    """n x max_tokens over the tenant's whole budget: BadRequestError at once, the gateway saw
    one request (before: a 429, which the client sent three times)."""
    with fake_cluster(tenant_max_kv_tokens=4096) as (gw, decode):
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=API_KEY, max_retries=2)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=2000, n=4)
        assert e.value.status_code == 400 and e.value.code == "kv_budget"
        assert "budget of 4096 tokens" in e.value.message and "KV tokens" in e.value.message
        assert "retry-after" not in e.value.response.headers
        assert rejected(gw, "kv_budget") == 1 and not decode.generated
        ok = client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=1000, n=4)
        assert len(ok.choices) == 4


class HeldDecode(FakeWorker):
    """A fake decode worker whose streams wait for `go` before their tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def Generate(self, request, context):
        for i, msg in enumerate(super().Generate(request, context)):
            if i == 1:
                self.go.wait(30)
            yield msg


@pytest.fixture
def held() -> Iterator[tuple[object, HeldDecode]]:
    prefill, decode = FakeWorker("prefill"), HeldDecode()
    decode.peer = prefill
    gw = start_gateway([decode.address], [prefill.address], tenant_max_concurrency=1)
    try:
        wait_ready(gw.url)
        yield gw, decode
    finally:
        decode.go.set()
        gw.stop()
        decode.stop()
        prefill.stop()


def test_what_waiting_fixes_is_a_429_with_retry_after(held):
    gw, decode = held
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=API_KEY, max_retries=0)
    first = threading.Thread(target=post, args=(gw.url, "/v1/chat/completions",
                                                {"model": "tiny-moe", "messages": CHAT, "max_tokens": 2}))
    first.start()
    end = time.monotonic() + 30
    while not decode.generated:
        assert time.monotonic() < end, "the first request never reached the worker"
        time.sleep(0.01)
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=2)
    decode.go.set()
    first.join(30)
    assert e.value.code == "tenant_limit" and e.value.response.headers["retry-after"] == str(RETRY_AFTER_S)
    assert "tenant_max_concurrency" in e.value.message


class FailingDecode(FakeWorker):
    """A fake decode worker that ends every stream with Error `code`: before its reservation,
    or after one token."""

    def __init__(self, code: ErrorCode, after_token: bool) -> None:
        super().__init__()
        self.code, self.after_token = code, after_token

    def Generate(self, request, context):
        self.generated.append(request)
        error = wpb.GenerateResponse(error=wpb.Error(code=self.code.value, message="scripted refusal"))
        if self.after_token:
            for msg in super().Generate(request, context):
                yield msg
                if msg.WhichOneof("kind") == "tokens":
                    break
        yield error


@pytest.mark.parametrize("after_token", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_a_workers_code_is_answered_in_the_tables_spelling(stream, after_token):
    """A worker's INVALID_REQUEST reaches the client as `invalid_request`, as a JSON body or a
    stream's last event (before: INVALID_REQUEST here, invalid_request from the gateway)."""
    prefill, decode = FakeWorker("prefill"), FailingDecode(ErrorCode.INVALID_REQUEST, after_token)
    decode.peer = prefill
    gw = start_gateway([decode.address], [prefill.address])
    try:
        wait_ready(gw.url)
        status, got = post(gw.url, "/v1/completions", {"model": "tiny-moe", "prompt": "x", "max_tokens": 4,
                                                       "stream": stream})
    finally:
        gw.stop()
        decode.stop()
        prefill.stop()
    if stream and after_token:
        assert status == 200 and isinstance(got, list) and "[DONE]" not in got
        error = json.loads(got[-1])["error"]
    else:
        assert status == 400, got
        error = got["error"]
    assert error["code"] == "invalid_request" and error["type"] == "invalid_request_error", error
    assert error["message"] == "scripted refusal"


def test_the_frameworks_own_refusals_use_the_table_too():
    """No such route, a method the route does not take (before: `http_404`, `http_405`)."""
    with fake_cluster() as (gw, decode):
        u = urlparse(gw.url)
        for method, path, status, code in (("GET", "/v1/nothing", 404, "not_found"),
                                           ("GET", "/v1/chat/completions", 405, "method_not_allowed")):
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
            conn.request(method, path, headers={"Authorization": f"Bearer {API_KEY}"})
            resp = conn.getresponse()
            got = json.loads(resp.read())
            conn.close()
            assert resp.status == status and got["error"]["code"] == code == ERRORS[code].code, got
            assert ERRORS[code].status == status


@pytest.mark.parametrize("code, retry", [(ErrorCode.DECODE_FAILED, True), (ErrorCode.UNKNOWN_PEER, False)])
def test_a_failure_past_the_gateway_says_whether_to_retry(code, retry):
    prefill, decode = FakeWorker("prefill"), FailingDecode(code, after_token=False)
    decode.peer = prefill
    gw = start_gateway([decode.address], [prefill.address], max_attempts=1)
    try:
        wait_ready(gw.url)
        u = urlparse(gw.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"model": "tiny-moe", "prompt": "x", "max_tokens": 2}),
                     headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        got = json.loads(resp.read())
        conn.close()
    finally:
        gw.stop()
        decode.stop()
        prefill.stop()
    assert resp.status == ERRORS[code.value.lower()].status == 502, got
    assert got["error"]["code"] == code.value.lower() and got["error"]["type"] == "server_error"
    assert resp.getheader("Retry-After") == (str(RETRY_AFTER_S) if retry else None)
