"""Hostile clients at the HTTP connection layer (issue 41), while the other tenants' requests
run:

    slow_connections  one address (127.0.0.2, not the victims') keeps thousands of connections
                      that never finish a request: silent ones, half-sent heads, heads trickled
                      a byte a second, bodies that stall after a trickle.  Each must end within
                      its deadline (the header or body timeout, or the per-address cap's 429
                      held 1-2 x the header timeout) with a 408 or 429 OpenAI error or a close;
                      one held open past it is a violation, and so is any other answer.
    smuggling         ambiguous framings over raw sockets (Content-Length beside
                      Transfer-Encoding, a coding other than `chunked`, two lengths, a folded
                      or bare-LF head, chunked HTTP/1.0), each followed by a request of its
                      own: exactly one answer, a 400 naming the framing, then the connection
                      closed; a second answer (the smuggled request served) is a violation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from typing import Any
from urllib.parse import urlparse

from chaos.attacker import HostileAttack
from chaos.cluster import ChaosCluster
from chaos.gauges import Peaks, gateway_setting
from chaos.report import ScenarioResult

ATTACKER_ADDRESS = "127.0.0.2"        # loopback, but an address of its own: the per-address cap is its
GRACE_S = 10.0                        # past its deadline, a connection still open unanswered is held
HEAD = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: "
POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
KINDS = ("silent", "half head", "trickled head", "stalled body")
OK_ENDS = ("408 request_timeout", "429 too_many_connections", "closed", "reset")


def answers(raw: bytes) -> list[tuple[int, str]]:
    """(status, error code) of each Content-Length-framed response in `raw`; a piece that does
    not parse is (0, its first bytes)."""
    out: list[tuple[int, str]] = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        try:
            status = int(lines[0].split()[1])
            length = next(int(v) for k, _, v in (line.partition(b":") for line in lines[1:])
                          if k.strip().lower() == b"content-length")
            code = str((json.loads(rest[:length]).get("error") or {}).get("code") or "")
        except (IndexError, ValueError, StopIteration, AttributeError):
            return out + [(0, raw[:60].decode("latin-1"))]
        out.append((status, code))
        raw = rest[length:]
    return out


async def read_to_end(reader: asyncio.StreamReader, timeout_s: float) -> tuple[bytes, str]:
    """What the server sends until it closes: (bytes, "closed" | "reset" | "timeout")."""
    got = b""
    try:
        async with asyncio.timeout(timeout_s):
            while data := await reader.read(65536):
                got += data
        return got, "closed"
    except TimeoutError:
        return got, "timeout"
    except OSError:
        return got, "reset"


class SlowConnections(HostileAttack):
    name = "slow_connections"
    finish_wait_s = 120.0              # > the longest deadline (a stalled body's) + GRACE_S
    CONNECTIONS = 2000
    OPENING = 64                       # connections being opened at once

    def __init__(self, cluster: ChaosCluster, key: str, model: str) -> None:
        super().__init__(cluster, key, model)
        self.header_s = float(gateway_setting(cluster, "header_timeout_s") or 5.0)
        self.body_s = float(gateway_setting(cluster, "body_timeout_s") or 10.0)
        self.cap = int(gateway_setting(cluster, "max_connections_per_client") or 256)
        self.ends: Counter[str] = Counter()
        self.held: list[str] = []      # connections held open past their deadline
        self.longest_s = 0.0
        self.open = self.peak_open = 0

    def deadline(self, kind: str) -> float:
        """The longest the gateway may keep a connection of `kind` without answering it."""
        return 2 * self.header_s + (3 + self.body_s if kind == "stalled body" else 0)

    async def attack(self) -> None:
        u = urlparse(self.url)
        opening = asyncio.Semaphore(self.OPENING)
        tasks = [asyncio.create_task(self._keep(u.hostname or "127.0.0.1", u.port or 80, KINDS[i % len(KINDS)],
                                                opening)) for i in range(self.CONNECTIONS)]
        loop = asyncio.get_running_loop()
        until = loop.time() + 30
        while self.peak_open < self.CONNECTIONS // 2 and loop.time() < until:
            await asyncio.sleep(0.1)
        self.launched.set()
        await self.halt.wait()
        # no connection is reopened now; each one open waits for the gateway to end it (or for
        # its deadline and the grace to pass: then it was held), so every one is judged
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _keep(self, host: str, port: int, kind: str, opening: asyncio.Semaphore) -> None:
        """One connection of `kind`, reopened as the gateway ends it, until the attack halts."""
        while not self.halt.is_set():
            async with opening:
                try:
                    reader, writer = await asyncio.open_connection(host, port, local_addr=(ATTACKER_ADDRESS, 0))
                except OSError:
                    await asyncio.sleep(1.0)
                    continue
            self.open += 1
            self.peak_open = max(self.peak_open, self.open)
            try:
                await self._one(kind, reader, writer)
            finally:
                self.open -= 1
                writer.close()
            await asyncio.sleep(0.5)

    async def _one(self, kind: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        t0 = time.monotonic()
        trickle = asyncio.create_task(self._send(kind, writer))
        try:
            raw, how = await read_to_end(reader, self.deadline(kind) + GRACE_S)
        finally:
            trickle.cancel()
        took = time.monotonic() - t0
        if how == "timeout":
            self.held.append(f"{kind}: open {took:.0f}s without an answer (deadline {self.deadline(kind):.0f}s)")
            return
        self.longest_s = max(self.longest_s, took)
        got = answers(raw)
        end = how if not got else " ".join(f"{s} {c}" for s, c in got)
        self.ends[f"{kind}: {end}"] += 1

    async def _send(self, kind: str, writer: asyncio.StreamWriter) -> None:
        """What a connection of `kind` sends: nothing, half a head, a head a byte a second (never
        ending), or a whole head and a body that trickles for 3 s and then stops."""
        if kind == "silent":
            return
        post = POST.replace(b"\r\n\r\n", f"\r\nAuthorization: Bearer {self.key}\r\n\r\n".encode(), 1)
        pieces = {"half head": 0, "stalled body": 3}.get(kind, 10 ** 6)
        with contextlib.suppress(OSError):
            writer.write(post + b"{" if kind == "stalled body" else HEAD)
            for _ in range(pieces):
                await asyncio.sleep(1.0)
                writer.write(b"a")

    def judge(self, res: ScenarioResult, peaks: Peaks) -> None:
        total = sum(self.ends.values()) + len([h for h in self.held if "without an answer" in h])
        res.faults_injected = total
        res.faults_detected = sum(n for end, n in self.ends.items() if end.split(": ", 1)[1] in OK_ENDS)
        refused = sum(n for end, n in self.ends.items() if "429" in end)
        res.notes.append(f"slow_connections: {self.CONNECTIONS} connections kept from {ATTACKER_ADDRESS} (at most "
                         f"{self.peak_open} open at once; header timeout {self.header_s:g}s, body {self.body_s:g}s, "
                         f"{self.cap} per address), {total} ended, the longest after {self.longest_s:.1f}s: "
                         + ", ".join(f"{n} {e}" for e, n in self.ends.most_common()))
        for h in self.held[:5]:
            res.violations.append(f"slow_connections: {h}")
        for end, n in self.ends.items():
            if end.split(": ", 1)[1] not in OK_ENDS:
                res.violations.append(f"slow_connections: {n} x {end} (expected 408, 429 or a close)")
        if self.peak_open > self.cap and not refused:
            res.violations.append(f"slow_connections: {self.peak_open} connections from one address and no 429: "
                                  f"the per-address cap of {self.cap} did not hold")
        if total == 0:
            res.violations.append("slow_connections: no connection ended while the others ran: nothing to judge")


FRAMINGS: tuple[tuple[str, bytes], ...] = (
    ("Content-Length beside Transfer-Encoding", b"Content-Length: 30\r\nTransfer-Encoding: chunked\r\n"),
    ("Transfer-Encoding beside Content-Length", b"Transfer-Encoding: chunked\r\nContent-Length: 30\r\n"),
    ("Transfer-Encoding: Chunked", b"Transfer-Encoding: Chunked\r\n"),
    ("Transfer-Encoding: gzip, chunked", b"Transfer-Encoding: gzip, chunked\r\n"),
    ("two Transfer-Encoding headers", b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n"),
    ("two equal Content-Length headers", b"Content-Length: 5\r\nContent-Length: 5\r\n"),
    ("two different Content-Length headers", b"Content-Length: 5\r\nContent-Length: 30\r\n"),
    ("Content-Length: 5, 5", b"Content-Length: 5, 5\r\n"),
    ("Transfer-Encoding folded onto the line before", b"X-A: 1\r\nTransfer-Encoding:\r\n chunked\r\n"),
)
BODY = b"0\r\n\r\n"


def probes(key: str) -> list[tuple[str, bytes]]:
    """(what, the bytes sent in one write): each framing with a request of its own after it."""
    tail = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    out = [(what, post + headers + b"\r\n" + BODY + tail) for what, headers in FRAMINGS]
    out.append(("a head with bare LF line ends", (post + b"Transfer-Encoding: chunked\r\n\r\n").replace(b"\r\n", b"\n")
                + BODY + tail))
    out.append(("chunked HTTP/1.0", post.replace(b"HTTP/1.1", b"HTTP/1.0") + b"Transfer-Encoding: chunked\r\n\r\n"
                + BODY + tail))
    return out


class Smuggling(HostileAttack):
    name = "smuggling"

    def __init__(self, cluster: ChaosCluster, key: str, model: str) -> None:
        super().__init__(cluster, key, model)
        self.results: list[dict[str, Any]] = []

    async def attack(self) -> None:
        u = urlparse(self.url)
        self.launched.set()
        while not self.results or not self.halt.is_set():
            for what, data in probes(self.key):
                self.results.append({"what": what, **await self._probe(u.hostname or "127.0.0.1", u.port or 80,
                                                                       data)})
            await asyncio.sleep(0.2)

    async def _probe(self, host: str, port: int, data: bytes) -> dict[str, Any]:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as e:
            return {"answers": [], "end": f"not connected: {e}"}
        try:
            writer.write(data)
            raw, end = await read_to_end(reader, 15.0)
        finally:
            writer.close()
        return {"answers": answers(raw), "end": end}

    def judge(self, res: ScenarioResult, peaks: Peaks) -> None:
        res.faults_injected = len(self.results)
        for r in self.results:
            ok = (r["end"] in ("closed", "reset") and len(r["answers"]) == 1 and r["answers"][0][0] == 400
                  and r["answers"][0][1] in ("ambiguous_framing", "invalid_request"))
            res.faults_detected += ok
            if not ok and len(res.violations) < 8:
                res.violations.append(f"smuggling ({r['what']}): answers {r['answers']}, then {r['end']} (expected "
                                      f"one 400 naming the framing, then the connection closed)")
        seen = Counter(f"{r['what']}: {' '.join(f'{s} {c}' for s, c in r['answers'])} then {r['end']}"
                       for r in self.results)
        res.notes.append(f"smuggling: {len(self.results)} probes of {len(probes(self.key))} framings, each followed "
                         f"by a request of its own: " + "; ".join(seen))
