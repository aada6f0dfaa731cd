"""A deployment across three Ray nodes on one machine (custom resources force placement): the
prefill worker on the head node, one decode worker on each of two other nodes, mutual TLS
between them.  A decode worker SIGKILLed mid-stream: the gateway continues the stream on the
other node's decode worker, and the client gets every token exactly once, equal to the
single-process engine's greedy output; Ray restarts the killed worker and it serves again."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import openai
import pytest
import ray
from ray.cluster_utils import Cluster

from deploy import registry as reg
from deploy.launcher import Deployment
from deploy.settings import ServeSettings
from deploy.status import read_stats
from engine.options import build
from engine.params import SamplingParams
from gateway.server import _free_port
from tests.gateway_helpers import connection

CHAT = [{"role": "user", "content": "Repeat after me: blue kettle"}]
MAX_TOKENS = 400


@pytest.fixture
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 1, "prefill_node": 1}})
    nodes = [c.add_node(num_cpus=1, resources={"decode_node": 1}) for _ in range(2)]
    c.wait_for_nodes()
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def workers() -> dict[str, dict]:
    return {w["worker_id"]: w for w in ray.get(reg.lookup().workers.remote(), timeout=30)}


def test_a_stream_survives_its_decode_worker_killed_on_another_node(cluster, shipped_llm):
    c, nodes = cluster
    settings = build(ServeSettings, address=c.address, port=_free_port("127.0.0.1"), worker_host="127.0.0.1",
                     decode_workers=2, placement_strategy="SPREAD", kv_cache_tokens=4096, max_restarts=3,
                     gateway_replicas=2,
                     worker_resources={"prefill": {"prefill_node": 1}, "decode": {"decode_node": 1}})
    d = Deployment(settings, say=lambda _: None).start(timeout_s=180)
    try:
        placed = {wid: w["node_id"] for wid, w in workers().items()}
        assert placed["prefill-0"] == c.head_node.node_id
        assert {placed["decode-0"], placed["decode-1"]} == {n.node_id for n in nodes}
        assert all(w["tls"] for w in workers().values())    # --tls auto: more than one node, so mutual TLS
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="none", max_retries=0)
        assert client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=8).usage.completion_tokens
        replica = openai.OpenAI(base_url=d.urls[1] + "/v1", api_key="none", max_retries=0)   # a second gateway
        assert replica.completions.create(model="tiny-moe", prompt="x", max_tokens=4).usage.completion_tokens

        ids = shipped_llm.tokenizer.encode("while True:\n")
        want = shipped_llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0]
        conn = connection(d.url)
        body = {"model": "tiny-moe", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        got: list[int] = []
        for _ in range(4):                                   # a few tokens in, the stream is mid-way
            line = resp.readline()
            while not line.startswith(b"data: "):
                line = resp.readline()
            got += json.loads(line[len(b"data: "):])["choices"][0]["token_ids"]
        busy = [wid for wid in ("decode-0", "decode-1") if read_stats({"worker_id": wid})["running"]]
        assert len(busy) == 1, busy
        old = workers()[busy[0]]["address"]
        pid = ray.get(d.workers[busy[0]].__ray_call__.remote(lambda _: os.getpid()), timeout=30)
        os.kill(pid, signal.SIGKILL)                          # the decode worker dies mid-stream

        events = [e.strip()[len("data: "):] for e in resp.read().decode().split("\n\n")
                  if e.strip().startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        for e in events[:-1]:
            chunk = json.loads(e)
            assert "error" not in chunk, chunk
            got += chunk["choices"][0]["token_ids"]
        assert got == list(want.token_ids)                    # every token once, as if nothing happened
        assert len(got) == MAX_TOKENS
        with urllib.request.urlopen(d.url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert 'tandem_migrations_total{cause="lost"} 1.0' in metrics, \
            [m for m in metrics.splitlines() if "migration" in m]

        end = time.monotonic() + 120                          # Ray restarts the killed worker on its node
        while workers().get(busy[0], {}).get("address") in (None, old):
            assert time.monotonic() < end, f"{busy[0]} did not come back: {workers()}"
            time.sleep(0.5)
        assert workers()[busy[0]]["node_id"] == placed[busy[0]]
        assert client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=8).usage.completion_tokens
    finally:
        d.stop()
