"""What a hostile client's half-open connections cost the other clients: the latency of a cheap
authenticated request (GET /v1/models, on a new connection each and on one kept alive) with
the gateway idle (before and after the attack), then while one attacker address tries to hold
`--connections` connections that never finish a request (half-sent heads, reopened as the
gateway closes them), and the ratios.

    python -m bench.front_door [--connections 5000] [--requests 2000]

The gateway (`python -m gateway.server`, no worker behind it: /v1/models needs none) and the
attacker (its own process, from 127.0.0.2) run apart from the victims (this process, from
127.0.0.1).  Prints one JSON object."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from gateway.server import _free_port

KEY = "sk-bench-front-door"
ATTACKER, VICTIM = "127.0.0.2", "127.0.0.1"
HALF_HEAD = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: "


def start_gateway(port: int, flags: list[str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "gateway.server", "--port", str(port), "--colocated",
                             "127.0.0.1:1", "--api-key", KEY, *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "TANDEM_CLUSTER_SECRET": os.urandom(32).hex()})
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            if victim_request(port) is not None:
                return proc
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the gateway did not start")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def victim_request(port: int, conn: http.client.HTTPConnection | None = None) -> float | None:
    """Seconds for one GET /v1/models from VICTIM, on `conn` (kept alive) or a new connection;
    None unless 200."""
    t0 = time.perf_counter()
    own = conn is None
    if conn is None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=(VICTIM, 0))
    try:
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        resp.read()
        return time.perf_counter() - t0 if resp.status == 200 else None
    finally:
        if own:
            conn.close()


def measure(port: int, requests: int) -> dict[str, Any]:
    """Victims' latency: `requests` on a new connection each, then as many on one kept alive."""
    out: dict[str, Any] = {}
    for mode in ("new_connection", "keep_alive"):
        conn = None if mode == "new_connection" else http.client.HTTPConnection(
            "127.0.0.1", port, timeout=30, source_address=(VICTIM, 0))
        times, failed = [], 0
        for _ in range(requests):
            try:
                took = victim_request(port, conn)
            except (OSError, http.client.HTTPException):
                took, conn = None, conn and http.client.HTTPConnection("127.0.0.1", port, timeout=30,
                                                                       source_address=(VICTIM, 0))
            if took is None:
                failed += 1
            else:
                times.append(took)
        if conn is not None:
            conn.close()
        qs = statistics.quantiles(times, n=100) if len(times) > 1 else [float("nan")] * 99
        out[mode] = {"requests": requests, "failed": failed, "p50_ms": round(qs[49] * 1e3, 3),
                     "p99_ms": round(qs[98] * 1e3, 3)}
    return out


def _add(counter: Any, n: int) -> None:
    with counter.get_lock():
        counter.value += n


def attack(port: int, connections: int, reopen_s: float, held: Any, refused: Any, stop: Any) -> None:
    """Keep up to `connections` half-open connections from ATTACKER, reopening each one the
    gateway closes `reopen_s` later: `held` counts those open as the attacker sees them (a
    refused one too, until the gateway closes it), `refused` the 429s it was answered."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    async def one(budget: asyncio.Semaphore) -> None:
        while not stop.is_set():
            async with budget:
                try:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(ATTACKER, 0))
                except OSError:
                    await asyncio.sleep(0.5)
                    continue
            try:
                writer.write(HALF_HEAD)
                _add(held, 1)
                answer = await reader.read(65536)
                _add(refused, answer.startswith(b"HTTP/1.1 429"))
                while not stop.is_set() and answer:                         # until the gateway closes it
                    answer = await reader.read(65536)
            except OSError:
                pass
            finally:
                _add(held, -1)
                writer.close()
            await asyncio.sleep(reopen_s)

    async def main() -> None:
        budget = asyncio.Semaphore(64)                 # openings in progress at once
        tasks = [asyncio.create_task(one(budget)) for _ in range(connections)]
        while not stop.is_set():
            await asyncio.sleep(0.1)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.front_door")
    ap.add_argument("--connections", type=int, default=5000, help="half-open connections the attacker tries to hold")
    ap.add_argument("--requests", type=int, default=2000, help="victim requests per phase and way (a new "
                    "connection each, then one connection kept alive)")
    ap.add_argument("--header-timeout", type=float, default=5.0, help="the gateway's --header-timeout")
    ap.add_argument("--reopen-after", type=float, default=0.5, help="seconds before the attacker reopens a "
                    "connection the gateway closed")
    ap.add_argument("--settle", type=float, default=12.0, help="seconds the attack runs before measuring (past "
                    "the first 429s, held 1-2 x the header timeout)")
    ap.add_argument("--gateway-flag", action="append", default=[], help="passed to gateway.server (repeatable)")
    args = ap.parse_args(argv)
    port = _free_port("127.0.0.1")
    gateway = start_gateway(port, ["--header-timeout", str(args.header_timeout), *args.gateway_flag])
    try:
        before = measure(port, args.requests)
        held, refused, stop = mp.Value("i", 0), mp.Value("i", 0), mp.Event()
        attacker = mp.Process(target=attack, args=(port, args.connections, args.reopen_after, held, refused, stop),
                              daemon=True)
        attacker.start()
        time.sleep(args.settle)
        held_at_start, cpu0, t0 = held.value, cpu_seconds(gateway.pid), time.monotonic()
        attacked = measure(port, args.requests)
        cpu = (cpu_seconds(gateway.pid) - cpu0) / (time.monotonic() - t0)
        held_at_end = held.value
        stop.set()
        attacker.join(30)
        if attacker.is_alive():
            attacker.kill()
        time.sleep(args.header_timeout * 2 + 1)     # what the attacker left has timed out
        after = measure(port, args.requests)
    finally:
        gateway.terminate()
        gateway.wait(30)
    out = {"connections_tried": args.connections, "attacker_open": [held_at_start, held_at_end],
           "attacker_refused_429": refused.value,
           "gateway_cpu_share_attacked": round(cpu, 3), "cpus": os.cpu_count(),
           "idle_before": before, "attacked": attacked, "idle_after": after,
           **{f"{q}_ratio_{mode}": round(attacked[mode][f"{q}_ms"] / statistics.mean(
               [before[mode][f"{q}_ms"], after[mode][f"{q}_ms"]]), 3) for mode in attacked for q in ("p50", "p99")},
           "gateway_flags": args.gateway_flag}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
