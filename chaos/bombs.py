"""Hostile clients at the socket level (issue 16), while the other tenants' requests run:

    slow_reader   streams whose client never reads (a small receive buffer and segment size,
                  so flow control stops the gateway's sends at once): the tenant's admission
                  slots must come back when generation ends, with the sockets still open and
                  unread; after `stream_idle_timeout_s` the gateway must cut each stream off
                  (counted in tandem_responses_stalled_total) and let go of its connection (no
                  longer ESTABLISHED on its side), the client then reading a stream cut short
                  (no [DONE]; a reset)
    chunked_bomb  64 MiB request bodies, chunked with and without an API key, and one announced
                  by Content-Length: each must be refused 413 body_too_large long before it is
                  all sent; the gateway's memory (its process's RSS, read from /proc) must not
                  grow by anything like the body
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any
from urllib.parse import urlparse

from chaos.attacker import HostileAttack
from chaos.cluster import ChaosCluster
from chaos.gauges import (
    Peaks,
    gateway_connections,
    gateway_pid,
    gateway_setting,
    memory_mib,
    metric,
    reset_peak,
    scrape,
    server_sockets,
)
from chaos.hostile import PROMPT
from chaos.report import ScenarioResult

MIB = 1 << 20
STALLED = "tandem_responses_stalled_total"


class SlowReader(HostileAttack):
    name = "slow_reader"
    SOCKETS = 4

    def __init__(self, cluster: ChaosCluster, key: str, model: str) -> None:
        super().__init__(cluster, key, model)
        self.idle_s = float(gateway_setting(cluster, "stream_idle_timeout_s") or 30.0)
        self.max_connections = gateway_setting(cluster, "max_connections")
        self.finish_wait_s = self.idle_s + 150
        u = urlparse(cluster.url)
        self.host, self.port = u.hostname or "127.0.0.1", int(u.port or 80)
        self.facts: dict[str, Any] = {}
        self.ends: list[dict[str, Any]] = []

    def _open(self) -> socket.socket:
        body = json.dumps({"model": self.model, "prompt": PROMPT, "max_tokens": 400, "n": 2, "logprobs": 5,
                           "stream": True, "temperature": 0, "ignore_eos": True}).encode()
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)           # before connect: a small window
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)          # and small segments (the server's
        s.connect((self.host, self.port))                                 # send buffer grows per segment)
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                   f"Authorization: Bearer {self.key}\r\n\r\n").encode() + body)
        return s

    async def _until(self, cond: Any, timeout_s: float) -> float | None:
        """Seconds until `cond()` held (polled every 0.1 s), None when it did not in time."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while not cond():
            if loop.time() - t0 > timeout_s:
                return None
            await asyncio.sleep(0.1)
        return loop.time() - t0

    async def attack(self) -> None:
        f = self.facts
        stalled0 = metric(scrape(self.url), STALLED)
        f["connections_before"] = gateway_connections(self.cluster)
        socks = [self._open() for _ in range(self.SOCKETS)]
        peers = f["peers"] = [s.getsockname()[1] for s in socks]
        self.launched.set()
        t0 = time.monotonic()
        try:
            f["running_seen"] = await self._until(lambda: self.sampler.tenant("running") >= 1, 30) is not None
            released = await self._until(lambda: self.sampler.tenant("running") == 0, self.idle_s + 60)
            f["released_s"] = None if released is None else time.monotonic() - t0
            f["at_release"] = server_sockets(self.port, peers)
            f["stalled_at_release"] = metric(scrape(self.url), STALLED) - stalled0
            closed = await self._until(lambda: metric(scrape(self.url), STALLED) - stalled0 >= self.SOCKETS,
                                       self.idle_s + 60)
            f["closed_s"] = None if closed is None else time.monotonic() - t0
            await asyncio.sleep(2.0)
            f["after_close"] = server_sockets(self.port, peers)
            f["connections_after_close"] = gateway_connections(self.cluster)
            f["stalled"] = metric(scrape(self.url), STALLED) - stalled0
            self.ends = [await self._drain(s) for s in socks]
        finally:
            for s in socks:
                s.close()

    async def _drain(self, s: socket.socket, timeout_s: float = 15.0) -> dict[str, Any]:
        """Read what the socket holds to its end: {"bytes", "done" ([DONE] seen), "end"}."""
        s.setblocking(False)
        loop, got, end = asyncio.get_running_loop(), bytearray(), "eof"
        try:
            async with asyncio.timeout(timeout_s):
                while piece := await loop.sock_recv(s, 65536):
                    got += piece
        except TimeoutError:
            end = "no end"
        except OSError as e:
            end = type(e).__name__
        return {"bytes": len(got), "done": b"data: [DONE]" in got, "end": end}

    def judge(self, res: ScenarioResult, peaks: Peaks) -> None:
        f, n = self.facts, self.SOCKETS
        res.faults_injected = n
        at_release = f.get("at_release", {})
        held = sum(state == "ESTABLISHED" and queued > 0 for state, queued in at_release.values())
        cut = sum(not e["done"] for e in self.ends)
        lingering = {p: v for p, v in f.get("after_close", {}).items() if v[0] == "ESTABLISHED"}
        res.notes.append(
            f"{n} unread streams (n=2, 400 tokens, logprobs 5); the tenant's running peak {peaks.running:.0f}; back to "
            f"0 after {_s(f.get('released_s'))} with {held} of the sockets open and unread (server send queues "
            f"{sorted(q for _, q in at_release.values())} bytes); the gateway cut {f.get('stalled', 0):.0f} off after "
            f"{_s(f.get('closed_s'))} (stream_idle_timeout_s {self.idle_s:g}); the client then read "
            + ", ".join(f"{e['bytes']} B {'with' if e['done'] else 'without'} [DONE] ({e['end']})" for e in self.ends)
            + f"; server side 2 s after the close: {sorted(v[0] for v in f.get('after_close', {}).values()) or 'gone'}"
            + f"; uvicorn's open connections {f.get('connections_before')} before, "
              f"{f.get('connections_after_close')} after the close")
        if not f.get("running_seen"):
            res.violations.append("slow_reader: the attacker's streams never showed as running in /metrics")
        if f.get("released_s") is None or f.get("stalled_at_release", 0) or held < n:
            res.violations.append(f"slow_reader: the tenant's slots did not come back while its {n} streams were "
                                  f"open and unread (released after {_s(f.get('released_s'))}, {held} held open, "
                                  f"{f.get('stalled_at_release', 0):.0f} already closed)")
        if f.get("stalled", 0) < n:
            res.violations.append(f"slow_reader: the gateway closed {f.get('stalled', 0):.0f} of {n} idle streams "
                                  f"within stream_idle_timeout_s + 60 s")
        if cut < n:
            res.violations.append(f"slow_reader: {n - cut} unread streams were not closed: the client read them "
                                  f"to [DONE] after {self.idle_s:g} s idle")
        if lingering:
            res.violations.append(f"slow_reader: {len(lingering)} connections closed for idleness are still "
                                  f"ESTABLISHED on the gateway's side with unsent bytes queued "
                                  f"{sorted(q for _, q in lingering.values())} (uvicorn counts "
                                  f"{f.get('connections_after_close')} open connections, "
                                  f"{f.get('connections_before')} before the attack, against max_connections "
                                  f"{self.max_connections}): the gateway holds them until the client reads")
        # a stream counts when it was open and unread with its slot back, then cut off and let go
        released = f.get("released_s") is not None and not f.get("stalled_at_release", 0)
        after = f.get("after_close", {})
        res.faults_detected = sum(
            released and at_release.get(p, ("", 0))[0] == "ESTABLISHED" and at_release[p][1] > 0
            and after.get(p, ("gone", 0))[0] != "ESTABLISHED" and not e["done"]
            for p, e in zip(f.get("peers", []), self.ends))


def _s(x: float | None) -> str:
    return "never" if x is None else f"{x:.1f}s"


class ChunkedBomb(HostileAttack):
    name = "chunked_bomb"
    SIZE = 64 * MIB
    PIECE = 256 * 1024

    def __init__(self, cluster: ChaosCluster, key: str, model: str) -> None:
        super().__init__(cluster, key, model)
        self.limit = int(gateway_setting(cluster, "max_body_bytes") or 4 * MIB)
        self.pid = gateway_pid(cluster)
        self.bombs: list[dict[str, Any]] = []
        self.memory: dict[str, float] = {}

    async def attack(self) -> None:
        if self.pid is not None:
            self.memory = {"before": memory_mib(self.pid).get("rss", 0.0)}
            self.memory["peak_reset"] = float(reset_peak(self.pid))
        kinds = (("chunked, API key", self.key, True), ("chunked, no key", None, True),
                 ("Content-Length 64 MiB, no key", None, False))
        self.launched.set()
        while not self.bombs or not self.halt.is_set():
            for what, key, chunked in kinds:
                self.bombs.append({"what": what, **await self._bomb(key, chunked)})
            await asyncio.sleep(0.2)
        if self.pid is not None:
            now = memory_mib(self.pid)
            self.memory.update(after=now.get("rss", 0.0), peak=now.get("peak", 0.0))

    async def _bomb(self, key: str | None, chunked: bool) -> dict[str, Any]:
        """Send a SIZE body until the gateway answers or hangs up: {"sent" (bytes the kernel
        took), "status", "code", "message"}."""
        u = urlparse(self.url)
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        head = ["POST /v1/completions HTTP/1.1", f"Host: {u.hostname}:{u.port}", "Content-Type: application/json",
                "Transfer-Encoding: chunked" if chunked else f"Content-Length: {self.SIZE}"]
        if key:
            head.append(f"Authorization: Bearer {key}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
        piece = b'{"prompt": "' + b"a" * (self.PIECE - 12)
        written, out = 0, {"status": 0, "code": "", "message": ""}
        try:
            while written < self.SIZE and not answer.done():
                data = piece if written + len(piece) <= self.SIZE else piece[:self.SIZE - written]
                writer.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
                written += len(data)
                drain = asyncio.ensure_future(writer.drain())
                await asyncio.wait([drain, answer], return_when=asyncio.FIRST_COMPLETED, timeout=30)
                if not drain.done():
                    drain.cancel()
                elif drain.exception() is not None:
                    break                          # the gateway hung up: its answer may be read still
            if chunked and written >= self.SIZE:
                writer.write(b"0\r\n\r\n")
            out["sent"] = written - writer.transport.get_write_buffer_size()
            head_bytes = await asyncio.wait_for(answer, 30)
            out["status"] = int(head_bytes.split(b" ", 2)[1])
            length = next((int(line.split(b":", 1)[1]) for line in head_bytes.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            body = json.loads(await asyncio.wait_for(reader.readexactly(length), 10) or b"{}")
            error = body.get("error") or {}
            out["code"], out["message"] = error.get("code", ""), error.get("message", "")
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError, IndexError) as e:
            out.setdefault("sent", written - writer.transport.get_write_buffer_size())
            out["message"] = out["message"] or f"{type(e).__name__}: {e}"
        finally:
            answer.cancel()
            writer.close()
        return out

    def judge(self, res: ScenarioResult, peaks: Peaks) -> None:
        res.faults_injected = len(self.bombs)
        most = max((b["sent"] for b in self.bombs), default=0)
        for b in self.bombs:
            # the 413's body may be lost to a reset: the gateway closes while the client still sends
            ok = b["status"] == 413 and b["code"] in ("body_too_large", "") and b["sent"] < self.SIZE
            res.faults_detected += ok
            if not ok:
                res.violations.append(f"chunked_bomb ({b['what']}): HTTP {b['status']} {b['code']} after "
                                      f"{b['sent'] / MIB:.1f} MiB sent: {b['message'][:120]}")
        firsts = {b["what"]: b for b in reversed(self.bombs)}
        res.notes.append(f"{len(self.bombs)} bombs of {self.SIZE // MIB} MiB (limit {self.limit / MIB:g} MiB): "
                         + "; ".join(f"{w}: HTTP {b['status']} {b['code'] or '(body lost: ' + b['message'][:40] + ')'}"
                                     f" after {b['sent'] / MIB:.1f} MiB sent" for w, b in firsts.items())
                         + f"; at most {most / MIB:.1f} MiB sent before an answer")
        m = self.memory
        if "peak" in m:
            grew = m["peak"] - m["before"]
            res.figures.update(gateway_rss_before_mib=round(m["before"], 1), gateway_rss_peak_mib=round(m["peak"], 1),
                               gateway_rss_after_mib=round(m["after"], 1))
            res.notes.append(f"gateway RSS {m['before']:.0f} MiB before, peak {m['peak']:.0f} MiB during "
                             f"(VmHWM{'' if m['peak_reset'] else ', not reset: since start'}), {m['after']:.0f} "
                             f"MiB after")
            if m["peak_reset"] and grew >= self.SIZE / MIB / 2:
                res.violations.append(f"chunked_bomb: the gateway's RSS grew by {grew:.0f} MiB under {self.SIZE // MIB}"
                                      f" MiB bodies: it holds what it should refuse")
        else:
            res.notes.append("gateway RSS not read (its pid could not be found through Ray)")
