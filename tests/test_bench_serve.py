"""The serving benchmark's load generator and statistics, against a tiny fake SSE server with
known delays (bounds only: tests never assert timings beyond what the server guarantees)."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading

import pytest

from bench import serve_prefix
from bench.http_stream import StreamResult
from bench.serve import main as serve_main
from bench.serve_load import Target, run_level
from bench.serve_metrics import MissingMetric, cache_delta, run_delta
from bench.serve_prompts import PromptMaker
from bench.serve_stats import cache_share, percentile, summarize
from bench.serve_turns import run_conversations
from bench.serve_workloads import DEFAULTS, MultiTurn, SharedPrefix, pages, resolve
from engine.config import SHIPPED_MODEL
from engine.tokenizer import Tokenizer

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


# ---- the prefix workloads and --prefix-compare (issue 18) ----

PAGE = 16


class FakeTandem:
    """A gateway stand-in on 127.0.0.1, in a thread of its own.  POST: `max_tokens` chunks (with
    token ids 100, 101, ... when asked and `token_ids`), then usage whose cached_tokens follow a
    page cache of the prompts seen (full pages, never the last token; none with --no-prefix-cache
    or --routing load); the decode worker "accepts" 10 bytes per uncached prompt token.  GET
    /metrics: the workers' gauges, a prefill worker's bytes that must not count among them."""

    def __init__(self, flags: list[str], token_ids: bool = True):
        self.cache = "--no-prefix-cache" not in flags and "load" not in flags
        self.decode = int(flags[flags.index("--decode-workers") + 1]) if "--decode-workers" in flags else 1
        self.token_ids, self.keys, self.bodies = token_ids, set(), []
        self.kv_bytes = self.hit = self.query = 0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self.handle, "127.0.0.1", 0),
                                                       self.loop).result(10)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def metrics(self) -> str:
        lines = ["tandem_queue_length 0", 'tandem_worker_up{worker="p0",role="prefill"} 1',
                 f'tandem_worker_transfer_bytes_accepted{{worker="p0",role="prefill"}} {7 * self.query}']
        for w in range(self.decode):
            lab = f'{{worker="d{w}",role="decode"}}'
            lines += [f"tandem_worker_up{lab} 1",
                      f"tandem_worker_transfer_bytes_accepted{lab} {self.kv_bytes * (w == 0)}",
                      f"tandem_worker_cache_hit_tokens{lab} {self.hit * (w == 0)}",
                      f"tandem_worker_cache_query_tokens{lab} {self.query * (w == 0)}"]
        return "\n".join(lines) + "\n"

    def cached(self, ids: list[int]) -> int:
        keys = [tuple(ids[:PAGE * (k + 1)]) for k in range((len(ids) - 1) // PAGE)]
        n = next((k for k, key in enumerate(keys) if key not in self.keys), len(keys)) if self.cache else 0
        self.keys.update(keys if self.cache else [])
        return n * PAGE

    async def handle(self, reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /metrics"):
            text = self.metrics().encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n"
                         b"connection: close\r\n\r\n" % len(text) + text)
        else:
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            body = json.loads(await reader.readexactly(length))
            self.bodies.append(body)
            ids, n = body["prompt"], body["max_tokens"]
            cached = self.cached(ids)
            self.kv_bytes, self.hit, self.query = self.kv_bytes + 10 * (len(ids) - cached), self.hit + cached, \
                self.query + len(ids)
            events = []
            for i in range(n):
                choice = {"index": 0, "text": f"t{i}"}
                if body.get("return_token_ids") and self.token_ids:
                    choice["token_ids"] = [100 + i]
                events.append({"choices": [choice]})
            events.append({"choices": [], "usage": {"prompt_tokens": len(ids), "completion_tokens": n,
                                                    "prompt_tokens_details": {"cached_tokens": cached}}})
            raw = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                         + f"{len(raw):x}\r\n".encode() + raw + b"\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def maker():
    return PromptMaker(Tokenizer(str(SHIPPED_MODEL)), seed=7)


def test_prompt_pieces_are_token_exact_and_the_shared_prefix_workload_draws_prefixes_round_robin(maker):
    assert [len(maker.make_ids(n, "a very long label " * 9)) for n in (1, 3, 16, 1000)] == [1, 3, 16, 1000]
    w = SharedPrefix(num_prefixes=3, prefix_len=40, question_len=20, output_len=4, requests=8, concurrency=2)
    prompts = w.prompts(maker)
    assert len(prompts) == 8 and all(len(p) == w.prompt_len == 60 for p in prompts)
    heads = [p[:40] for p in prompts]
    assert all(heads[i] == heads[i % 3] for i in range(8)) and len({tuple(h[:PAGE]) for h in heads}) == 3
    assert len({tuple(p[40:40 + PAGE]) for p in prompts}) == 8          # each question's first page its own
    with pytest.raises(ValueError, match="num_prefixes=0"):
        SharedPrefix(num_prefixes=0)


def test_a_run_mark_keeps_one_invocations_prompts_out_of_anothers_prefix_cache():
    """Two invocations with one seed send the same text, but their prompts' first pages differ
    (bench.serve gives each its own `run`), so a server's prefix cache from the first serves
    nothing of the second; without a mark the prompts are the same, page for page."""
    tok = Tokenizer(str(SHIPPED_MODEL))

    def first_pages(run: str) -> tuple[list[tuple[int, ...]], list[str]]:
        m = PromptMaker(tok, seed=3, run=run)
        pieces = [m.make_ids(64, "system prompt") for _ in range(4)]
        texts = [m.make(200) for _ in range(4)]
        return [tuple(p[:PAGE]) for p in pieces] + [tuple(tok.encode(t)[:PAGE]) for t in texts], texts

    plain, plain_texts = first_pages("")
    assert first_pages("")[0] == plain
    one, one_texts = first_pages("a1b2c3d4")
    two, _ = first_pages("e5f6a7b8")
    assert not set(one) & set(two) and not set(one) & set(plain)
    assert all(len(tok.encode(t)) <= 200 for t in one_texts + plain_texts)
    # the text after the header is the seed's either way
    assert [t.split("\n", 1)[1][:40] for t in one_texts] == [t.split("\n", 1)[1][:40] for t in plain_texts]


def test_kv_pools_hold_the_stated_prefixes_besides_the_running_requests():
    w = SharedPrefix()       # the workload: 1024 + 64 prompt, 64 out = 72 pages, 8 past the prefix
    assert w.request_tokens == 1152 and pages(w.request_tokens) == 72
    assert w.compare_pools() == {"one_decode_worker": (16 * 72 + 8 * 8) * PAGE,
                                 "per_decode_worker": (8 * 72 + 8 * 8) * PAGE}
    # 36 tokens: 3 pages, of which the prefix fills 2 (its 33rd token shares a page with the question)
    odd = SharedPrefix(num_prefixes=5, prefix_len=33, question_len=2, output_len=1, concurrency=3)
    assert odd.compare_pools() == {"one_decode_worker": (5 * 3 + 3 * 1) * PAGE, "per_decode_worker": (3 * 3 + 3) * PAGE}
    assert odd.compare_pools(held=4)["per_decode_worker"] == (4 * 3 + 3) * PAGE
    m = MultiTurn(conversations=2, turns=3, prefix_len=20, question_len=5, output_len=4)
    assert [m.prompt_len(t) for t in range(3)] == [20, 29, 38] and m.request_tokens == 42 and m.requests == 6


def test_multi_turn_resends_the_history_with_each_answer(maker):
    for token_ids in (True, False):           # the server's ids, else the answer text encoded
        fake = FakeTandem(["--decode-workers", "1"], token_ids=token_ids)
        try:
            m = MultiTurn(conversations=2, turns=3, prefix_len=20, question_len=5, output_len=4, concurrency=2)
            convs = m.messages(maker)
            target = Target(fake.url, "m", None, chat=False, timeout_s=10)
            results, _ = asyncio.run(run_conversations(target, convs, m.output_len, m.concurrency, maker.tok))
        finally:
            fake.close()
        answer = [100, 101, 102, 103] if token_ids else maker.tok.encode("t0t1t2t3")
        assert len(results) == 6 and all(r.error is None for r in results)
        for conv in convs:
            sent = [b["prompt"] for b in fake.bodies if b["prompt"][:20] == conv[0]]
            assert sent == [conv[0], conv[0] + answer + conv[1], conv[0] + answer + conv[1] + answer + conv[2]]
        if token_ids:
            assert [len(b["prompt"]) for b in fake.bodies if b["prompt"][:20] == convs[0][0]] == [20, 29, 38]


def test_prefix_compare_report(maker, monkeypatch):
    started: list[list[str]] = []

    class Proc:
        def __init__(self, fake):
            self.fake = fake

        def send_signal(self, sig):
            self.fake.close()

        def wait(self, timeout):
            return 0

    def start(flags):
        started.append(flags)
        fake = FakeTandem(flags)
        return Proc(fake), fake.url
    monkeypatch.setattr(serve_prefix, "start_tandem", start)
    monkeypatch.setattr(serve_prefix, "STATS_WAIT_S", 0.0)
    w = SharedPrefix(num_prefixes=4, prefix_len=64, question_len=16, output_len=3, requests=16, concurrency=1)
    args = argparse.Namespace(model="m", timeout=10.0, held_prefixes=None)
    report = json.loads(json.dumps(serve_prefix.prefix_compare(args, maker, w, (1e9, 1e9))))
    one, per = (4 * 6 + 2) * PAGE, (2 * 6 + 2) * PAGE     # 83 tokens: 6 pages, 2 past the prefix
    assert report["workload"]["kv_cache_tokens"] == {"one_decode_worker": one, "per_decode_worker": per}
    common = ["--prefill-workers", "1", "--decode-workers"]
    pre = ["--prefill-kv-cache-tokens", str(one), "--max-model-len", "83"]   # prefill holds every prefix
    assert started == [common + ["1", "--kv-cache-tokens", str(one), *pre, "--no-prefix-cache"],
                       common + ["1", "--kv-cache-tokens", str(one), *pre],
                       common + ["2", "--kv-cache-tokens", str(per), *pre, "--routing", "prefix"],
                       common + ["2", "--kv-cache-tokens", str(per), *pre, "--routing", "load"]]
    runs = {r["mode"]: r for r in report["runs"]}
    assert list(runs) == ["cache_off", "cache_on", "prefix_routing", "load_routing"]
    off, on = runs["cache_off"], runs["cache_on"]
    assert off["cached_share"] == 0 and off["kv_bytes_per_request"] == 800 and off["errors"] == 0
    # the first request of each of the 4 prefixes misses; the other 12 find its 64 tokens
    assert on["cached_tokens"] == 12 * 64 and on["prompt_tokens"] == 16 * 80 and on["cached_share"] == 0.6
    assert on["kv_bytes_per_request"] == (4 * 80 + 12 * 16) * 10 / 16 and on["decode_cache_hit_share"] == 0.6
    assert runs["prefix_routing"]["kv_cache_tokens"] == per and runs["load_routing"]["routing"] == "load"
    s = report["summary"]
    assert s["prefix_kv_bytes_ratio"] == 2.5 and s["prefix_routing_hit_rate"] == 0.6
    assert s["least_load_hit_rate"] == 0 and s["prefix_routing_over_least_load"] is None
    assert s["prefix_ttft_p50_ratio"] == pytest.approx(off["ttft_p50_ms"] / on["ttft_p50_ms"])
    assert s["targets"] == {"prefix_ttft_p50_ratio": 3, "prefix_kv_bytes_ratio": 5, "prefix_routing_hit_rate": 0.8,
                            "prefix_routing_over_least_load": 1.5}
    assert s["met"]["prefix_kv_bytes_ratio"] is False and s["met"]["prefix_routing_hit_rate"] is False
    assert s["met"]["prefix_routing_over_least_load"] is True and s["all_met"] is False and s["errors"] == 0


def test_summary_targets_and_a_figure_not_reported():
    def run(ttft, kv, share, errors=0):
        return {"ttft_p50_ms": ttft, "kv_bytes_per_request": kv, "cached_share": share, "errors": errors}
    runs = {"cache_off": run(300.0, 1000.0, 0.0), "cache_on": run(100.0, 200.0, 0.9),
            "prefix_routing": run(90.0, 150.0, 0.85), "load_routing": run(200.0, 600.0, 0.5)}
    s = serve_prefix.summary(runs)
    assert (s["prefix_ttft_p50_ratio"], s["prefix_kv_bytes_ratio"], s["prefix_routing_over_least_load"]) == (3, 5, 1.7)
    assert all(s["met"].values()) and s["all_met"]
    s = serve_prefix.summary({**runs, "load_routing": run(200.0, 600.0, 0.6, errors=1)})
    assert s["met"]["prefix_routing_over_least_load"] is False and s["errors"] == 1 and not s["all_met"]
    s = serve_prefix.summary({**runs, "prefix_routing": run(90.0, 150.0, None)})    # no cached_tokens seen
    assert s["prefix_routing_hit_rate"] is None and s["met"]["prefix_routing_hit_rate"] is None and not s["all_met"]


def test_cache_share_counts_only_reporting_responses_and_missing_metrics_stop_the_run():
    a, b, c = StreamResult(start=0, prompt_tokens=100, cached_tokens=50), StreamResult(start=0, prompt_tokens=100), \
        StreamResult(start=0, prompt_tokens=100, cached_tokens=30, error="HTTP 500")
    assert cache_share([a, b, c]) == {"prompt_tokens": 100, "cached_tokens": 50, "cached_share": 0.5}
    assert cache_share([b]) == {"prompt_tokens": None, "cached_tokens": None, "cached_share": None}
    with pytest.raises(MissingMetric, match="tandem_worker_transfer_bytes_accepted of a decode worker"):
        cache_delta({}, {'tandem_worker_transfer_bytes_accepted{worker="p",role="prefill"}': 5.0}, 1)


@pytest.mark.parametrize("argv", [["--prefix-compare", "--chat"], ["--compare", "--prefix-compare"],
                                  ["--workload", "multi-turn", "--chat"], ["--prefix-compare", "--concurrency", "4,8"],
                                  ["--prefix-compare", "--held-prefixes", "17"]])
def test_flag_combinations_that_cannot_run_are_refused(argv):
    with pytest.raises(SystemExit) as e:
        serve_main(argv)
    assert e.value.code == 2


def test_quick_fills_only_the_flags_left_unset():
    args = argparse.Namespace(quick=True, prefix_len=32, **{k: None for k in DEFAULTS if k != "prefix_len"})
    resolve(args)
    assert (args.prefix_len, args.num_prefixes, args.requests, args.concurrency) == (32, 4, 16, "4")
