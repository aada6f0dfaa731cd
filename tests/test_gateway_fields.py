""""No silent drops" (gateway/fields.py, gateway/protocol.py): the log of ignored fields stays
bounded whatever a request sends; neutral values of fields Tandem cannot honour are accepted;
extras nested in content parts and earlier tool calls are named in X-Tandem-Ignored-Fields;
reasoning_effort is checked, and named when the chat template does not read it.  The other
field-policy cases: tests/test_gateway_structured.py."""

from __future__ import annotations

import logging

from gateway.fields import MAX_IGNORED_NAME_CHARS, MAX_IGNORED_NAMED, MAX_WARNED_FIELDS, IgnoredFields


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
