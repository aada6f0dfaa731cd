"""A deployment across three Ray nodes on one machine (custom resources force placement):
prefill and decode land on different nodes and requests complete; killing the decode
worker's node mid-stream gives the in-flight request an explicit error, and once a node
with room joins, Ray restarts the worker there and the cluster serves again."""

from __future__ import annotations

import json
import time

import openai
import pytest
import ray
from ray.cluster_utils import Cluster

from deploy import registry as reg
from deploy.launcher import Deployment
from deploy.settings import ServeSettings
from gateway.server import _free_port
from tests.gateway_helpers import connection

CHAT = [{"role": "user", "content": "Repeat after me: blue kettle"}]


@pytest.fixture
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 1}})
    nodes = {"prefill": c.add_node(num_cpus=1, resources={"prefill_node": 1}),
             "decode": c.add_node(num_cpus=1, resources={"decode_node": 1})}
    c.wait_for_nodes()
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def workers() -> list[dict]:
    return ray.get(reg.lookup().workers.remote())


def test_prefill_and_decode_on_different_nodes_and_recovery(cluster):
    c, nodes = cluster
    settings = ServeSettings(address=c.address, port=_free_port("127.0.0.1"), worker_host="127.0.0.1",
                             placement_strategy="SPREAD", kv_cache_tokens=4096, max_restarts=3, gateway_replicas=2,
                             worker_resources={"prefill": {"prefill_node": 1}, "decode": {"decode_node": 1}})
    d = Deployment(settings, say=lambda _: None).start(timeout_s=180)
    try:
        placed = {w["role"]: w["node_id"] for w in workers()}
        assert placed["prefill"] != placed["decode"]
        assert placed["decode"] == nodes["decode"].node_id and placed["prefill"] == nodes["prefill"].node_id
        assert all(w["tls"] for w in workers())          # --tls auto: more than one node, so mutual TLS
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="none", max_retries=0)
        assert client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=8).usage.completion_tokens
        replica = openai.OpenAI(base_url=d.urls[1] + "/v1", api_key="none", max_retries=0)   # a second gateway
        assert replica.completions.create(model="tiny-moe", prompt="x", max_tokens=4).usage.completion_tokens

        conn = connection(d.url)
        body = {"model": "tiny-moe", "prompt": "while True:\n", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        old = {w["role"]: w["address"] for w in workers()}["decode"]
        c.remove_node(nodes["decode"])                                   # the decode node dies mid-stream
        events = [e.strip() for e in resp.read().decode().split("\n\n") if e.strip().startswith("data: ")]
        last = events[-1][len("data: "):]
        assert last != "[DONE]" and "error" in json.loads(last), last    # an explicit error, not a cut 200

        c.add_node(num_cpus=1, resources={"decode_node": 1})             # room for the restart
        end = time.monotonic() + 120
        while True:
            now = {w["role"]: w["address"] for w in workers()}
            if now.get("decode") not in (None, old):
                try:
                    r = client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=8)
                    break
                except openai.APIError:
                    pass
            assert time.monotonic() < end, f"the cluster did not serve again: {workers()}"
            time.sleep(1)
        assert r.usage.completion_tokens >= 1
    finally:
        d.stop()
