"""The chaos suite's connection-layer hostile rows (chaos/front_door.py) on their own: their
probes against a real gateway on loopback (no cluster: every request here is one the gateway
answers itself), and their judges against servers that fail them (the gateway before issue
41 served a smuggled request and kept half-open connections for ever)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

import chaos.front_door as fd
from chaos.front_door import KINDS, SlowConnections, Smuggling, answers, probes
from chaos.gauges import Peaks
from chaos.report import ScenarioResult
from tests.gateway_helpers import API_KEY, start_gateway


def _bare(cls, **attrs):
    """An attack without a cluster: only what its methods read."""
    attack = cls.__new__(cls)
    attack.__dict__.update(attrs)
    return attack


@contextlib.contextmanager
def gateway(**kw):
    gw = start_gateway(colocated=("127.0.0.1:1",), **kw)
    try:
        host, port = gw.url.split("//")[1].split(":")
        yield host, int(port)
    finally:
        gw.stop()


def test_answers_are_read_one_by_one():
    one = b'HTTP/1.1 400 Bad Request\r\ncontent-length: 40\r\n\r\n{"error": {"code": "ambiguous_framing"}}'
    assert answers(one + one) == [(400, "ambiguous_framing")] * 2
    assert answers(b"HTTP/1.1 503 Service Unavailable\r\n\r\nService Unavailable")[0][0] == 0     # no length
    assert answers(b"") == []


def test_every_smuggling_probe_is_refused_once_and_its_row_is_clean():
    with gateway() as (host, port):
        attack = _bare(Smuggling, key=API_KEY, results=[])

        async def run():
            for what, data in probes(API_KEY):
                attack.results.append({"what": what, **await attack._probe(host, port, data)})
        asyncio.run(run())
    res = ScenarioResult("smuggling", "hostile", "")
    attack.judge(res, Peaks())
    assert not res.violations and res.faults_detected == res.faults_injected == len(probes(API_KEY)), res.violations


def test_a_server_that_serves_the_smuggled_request_is_flagged():
    async def run():
        async def lenient(reader, writer):      # answers every request it can find, as h11 did
            data = await reader.read(65536)
            for _ in range(data.count(b" HTTP/1.")):
                writer.write(b'HTTP/1.1 422 X\r\ncontent-length: 2\r\n\r\n{}')
            await writer.drain()
            writer.close()
        server = await asyncio.start_server(lenient, "127.0.0.1", 0)
        attack = _bare(Smuggling, key=API_KEY, results=[])
        try:
            what, data = probes(API_KEY)[0]
            attack.results.append({"what": what, **await attack._probe("127.0.0.1", server.sockets[0].getsockname()[1],
                                                                       data)})
        finally:
            server.close()
        return attack
    attack = asyncio.run(run())
    res = ScenarioResult("smuggling", "hostile", "")
    attack.judge(res, Peaks())
    assert res.faults_detected == 0 and "422" in res.violations[0], res.violations


def slow(**attrs):
    return _bare(SlowConnections, key=API_KEY, ends=Counter(), held=[], longest_s=0.0, open=0, peak_open=0,
                 cap=256, **attrs)


def test_each_kind_of_slow_connection_is_ended_by_the_gateway():
    with gateway(header_timeout_s=0.5, body_timeout_s=0.5) as (host, port):
        attack = slow(header_s=0.5, body_s=0.5)

        async def run():
            async def one(kind):
                reader, writer = await asyncio.open_connection(host, port, local_addr=("127.0.0.2", 0))
                try:
                    await attack._one(kind, reader, writer)
                finally:
                    writer.close()
            await asyncio.gather(*(one(kind) for kind in KINDS))
        asyncio.run(run())
    assert not attack.held and sum(attack.ends.values()) == len(KINDS), (attack.held, attack.ends)
    assert attack.ends["stalled body: 408 request_timeout"] == attack.ends["trickled head: 408 request_timeout"] == 1
    res = ScenarioResult("slow_connections", "hostile", "")
    attack.CONNECTIONS = len(KINDS)
    attack.judge(res, Peaks())
    assert not res.violations and res.faults_detected == len(KINDS), res.violations


def test_a_connection_held_past_its_deadline_or_a_plain_text_503_is_flagged():
    async def run():
        async def never(reader, writer):         # reads what comes, answers nothing, closes nothing
            with contextlib.suppress(OSError):
                while await reader.read(65536):
                    pass
        server = await asyncio.start_server(never, "127.0.0.1", 0)
        attack = slow(header_s=0.1, body_s=0.1)
        try:
            grace, fd.GRACE_S = fd.GRACE_S, 0.3
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
                await attack._one("half head", reader, writer)
                writer.close()
                await asyncio.sleep(0.1)                 # the server's side sees the close
            finally:
                fd.GRACE_S = grace
        finally:
            server.close()
        return attack
    attack = asyncio.run(run())
    assert attack.held and "without an answer" in attack.held[0]
    res = ScenarioResult("slow_connections", "hostile", "")
    attack.ends["half head: 0 HTTP/1.1 503 Service Unavailable"] += 1
    attack.judge(res, Peaks())
    assert any("without an answer" in v for v in res.violations) and any("503" in v for v in res.violations)
