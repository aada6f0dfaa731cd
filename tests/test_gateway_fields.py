""""No silent drops" (gateway/fields.py, gateway/protocol.py): the log of ignored fields stays
bounded whatever a request sends; neutral values of fields Tandem cannot honour are accepted;
extras nested in content parts and earlier tool calls are named in X-Tandem-Ignored-Fields;
reasoning_effort is checked, and named when the chat template does not read it.  The other
field-policy cases: tests/test_gateway_structured.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from gateway.fields import MAX_IGNORED_NAME_CHARS, MAX_IGNORED_NAMED, MAX_WARNED_FIELDS, IgnoredFields
from tests.gateway_helpers import FakeWorker, start_gateway, wait_ready
from tests.test_gateway_structured import MSG, call, chat


def warnings(caplog) -> int:
    return sum(r.levelno == logging.WARNING for r in caplog.records)


def test_one_request_cannot_fill_the_ignored_fields_log(caplog):
    caplog.set_level("DEBUG", "tandem.gateway")
    log = IgnoredFields()
    log.report([f"k{i:06d}" + "x" * 200 for i in range(20000)])
    assert len(log._warned) == MAX_IGNORED_NAMED
    assert all(len(n) <= MAX_IGNORED_NAME_CHARS for n in log._warned)
    log.report(["colour"])                  # a later request's own typo is still a warning
    assert warnings(caplog) == 2


def test_many_requests_keep_it_bounded_and_warning(caplog):
    caplog.set_level("DEBUG", "tandem.gateway")
    log = IgnoredFields()
    for i in range(200):
        log.report([f"r{i}-{j}" for j in range(MAX_IGNORED_NAMED)])
    assert len(log._warned) == MAX_WARNED_FIELDS
    caplog.clear()
    log.report(["r199-0"])                  # seen lately: debug
    assert warnings(caplog) == 0
    log.report(["colour"])                  # new: a warning, though the log was full
    assert warnings(caplog) == 1


@pytest.fixture(scope="module")
def gw() -> Iterator[object]:
    prefill, decode = FakeWorker("prefill"), FakeWorker()
    decode.peer = prefill
    gateway = start_gateway([decode.address], [prefill.address])
    try:
        wait_ready(gateway.url)
        yield gateway
    finally:
        gateway.stop()
        decode.stop()
        prefill.stop()


def test_neutral_values_are_accepted_others_refused(gw):
    status, got, header = call(gw, chat(verbosity="medium", function_call="none"))
    assert status == 200 and header is None, got
    for extra, words in (({"verbosity": "low"}, "verbosity"), ({"function_call": "auto"}, "tool_choice")):
        status, got, _ = call(gw, chat(**extra))
        assert status == 400 and got["error"]["code"] == "unsupported" and words in got["error"]["message"], got


def test_extras_in_content_parts_and_earlier_tool_calls_are_named(gw):
    call_item = {"id": "c1", "type": "function", "weird": 1, "function": {"name": "f", "arguments": "{}", "x": 2}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": None, "tool_calls": [call_item]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    status, got, header = call(gw, chat(messages=messages))
    assert status == 200, got
    assert header.split(", ") == ["messages[].content[].cache_control", "messages[].tool_calls[].weird",
                                  "messages[].tool_calls[].function.x"]


def test_reasoning_effort_is_checked_and_named_when_the_template_ignores_it(gw):
    status, got, _ = call(gw, chat(reasoning_effort="ultra"))
    assert status == 400 and got["error"]["param"] == "reasoning_effort", got
    assert "'ultra' is not one of minimal, low, medium, high" in got["error"]["message"]
    status, got, header = call(gw, chat(reasoning_effort="low", messages=MSG))
    assert status == 200 and header == "reasoning_effort", got      # the shipped model's template has no use for it
