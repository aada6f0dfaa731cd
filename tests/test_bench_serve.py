"""The serving benchmark's load generator and statistics, against a tiny fake SSE server with
known delays (bounds only: tests never assert timings beyond what the server guarantees)."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.http_stream import StreamResult
from bench.serve_load import Target, run_level
from bench.serve_metrics import MissingMetric, run_delta
from bench.serve_stats import percentile, summarize

TTFT_S, GAP_S, TOKENS = 0.05, 0.02, 5


async def fake_server(requests: list):
    """Streams TOKENS chunks: the first after TTFT_S, then one every GAP_S; a usage chunk; [DONE]."""
    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        body = json.loads(await reader.readexactly(length))
        requests.append(body)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")

        def chunk(data: str) -> bytes:
            raw = data.encode()
            return f"{len(raw):x}\r\n".encode() + raw + b"\r\n"
        await asyncio.sleep(TTFT_S)
        for i in range(TOKENS):
            if i:
                await asyncio.sleep(GAP_S)
            writer.write(chunk(f'data: {{"choices": [{{"index": 0, "text": "t{i}"}}]}}\n\n'))
            await writer.drain()
        writer.write(chunk(f'data: {{"choices": [], "usage": {{"completion_tokens": {TOKENS}}}}}\n\ndata: [DONE]\n\n'))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_stream_timing_and_statistics_against_known_delays():
    async def go():
        seen: list = []
        server, url = await fake_server(seen)
        async with server:
            target = Target(url, "m", None, chat=False, timeout_s=10)
            return await run_level(target, [f"p{i}" for i in range(6)], TOKENS, 3), seen
    (results, wall), seen = asyncio.run(go())
    assert len(seen) == 6 and all(b["stream"] and b["max_tokens"] == TOKENS and b["ignore_eos"] for b in seen)
    for r in results:
        assert r.error is None and r.text == "".join(f"t{i}" for i in range(TOKENS))
        assert r.output_tokens == TOKENS and len(r.chunk_times) == TOKENS
        assert r.ttft >= TTFT_S * 0.95                                    # the server waited this long
        # the last chunk cannot arrive before the server wrote it; gaps between arrivals are not
        # bounded below (a delayed chunk and the next one may arrive together on a busy machine)
        assert r.chunk_times[-1] - r.start >= (TTFT_S + (TOKENS - 1) * GAP_S) * 0.95
        assert len(r.itls) == TOKENS - 1 and all(g >= 0 for g in r.itls)
    s = summarize(results, wall, slo_ttft_ms=10_000, slo_itl_ms=10_000)
    assert s["requests"] == 6 and s["errors"] == 0
    assert s["ttft_p50_ms"] == pytest.approx(percentile([r.ttft for r in results], 50) * 1000)
    assert s["itl_p99_ms"] == pytest.approx(percentile([x for r in results for x in r.itls], 99) * 1000)
    assert s["output_tok_s"] == pytest.approx(6 * TOKENS / wall) and s["goodput_req_s"] == pytest.approx(6 / wall)
    assert wall >= 2 * (TTFT_S + (TOKENS - 1) * GAP_S) * 0.95             # 6 requests, 3 at a time


def synthetic(ttft: float, gaps: list[float], error: str | None = None) -> StreamResult:
    r = StreamResult(start=0.0, error=error)
    t = ttft
    r.chunk_times.append(t)
    for g in gaps:
        t += g
        r.chunk_times.append(t)
    r.end = t
    r.output_tokens = len(r.chunk_times)
    return r


def test_percentiles_tpot_and_goodput_are_exact():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and percentile([], 50) is None
    results = [synthetic(0.1, [0.01, 0.01]),            # meets both SLOs
               synthetic(0.5, [0.01, 0.01]),            # TTFT over 200 ms
               synthetic(0.1, [0.1, 0.1]),              # TPOT over 50 ms
               synthetic(0.1, [], error="HTTP 503")]    # an error: counted, never timed
    s = summarize(results, wall_s=2.0, slo_ttft_ms=200, slo_itl_ms=50)
    assert s["requests"] == 4 and s["errors"] == 1
    assert s["goodput_req_s"] == pytest.approx(0.5) and s["req_s"] == pytest.approx(1.5)
    assert s["tpot_p50_ms"] == pytest.approx(10.0) and s["ttft_p50_ms"] == pytest.approx(100.0)
    assert s["output_tok_s"] == pytest.approx(9 / 2.0)


def test_metrics_deltas_and_a_missing_metric_stops_the_report():
    before = {'tandem_worker_expert_hits{worker="a",role="decode"}': 10.0,
              'tandem_worker_expert_misses{worker="a",role="decode"}': 10.0,
              'tandem_worker_kv_used_tokens{worker="a",role="decode"}': 0.0}
    after = {**before, 'tandem_worker_expert_hits{worker="a",role="decode"}': 40.0,
             'tandem_worker_transfer_refusals{worker="a",role="decode",reason="BAD_CHECKSUM"}': 2.0}
    d = run_delta(before, after)
    assert d["expert_hit_rate"] == 1.0 and d["expert_lookups"] == 30 and d["transfer_refusals"] == {"BAD_CHECKSUM": 2}
    with pytest.raises(MissingMetric, match="tandem_worker_expert_misses"):
        run_delta(before, {k: v for k, v in after.items() if "misses" not in k})
