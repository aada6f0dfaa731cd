"""A whole deployment with `--tls on` and an HTTPS gateway: a request completes through the
gateway, the prefill worker (which pushes only to the registry's decode endpoints) and the
decode worker, all over mutual TLS; a worker refuses the same authenticated call in plaintext;
the registry refuses registrations and unregistrations that do not prove the cluster secret."""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request

import grpc
import pytest
import ray

from deploy import registry as reg
from deploy.launcher import Deployment
from deploy.settings import ServeSettings
from deploy.status import read_stats
from engine.options import build
from kv_transfer.auth import channel
from kv_transfer.tls import ClusterCA
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc

KEY = "zt-key-1"


def completion(url: str, context: ssl.SSLContext, prompt: str) -> dict:
    body = json.dumps({"model": "tiny-moe", "prompt": prompt, "max_tokens": 6}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120, context=context) as r:
        assert r.status == 200
        return json.loads(r.read())


def test_a_deployment_over_mutual_tls_with_an_https_gateway(tmp_path):
    web = ClusterCA().issue("web", hosts=["127.0.0.1"]).write(tmp_path / "web")   # the front door's own CA
    settings = build(ServeSettings, tls="on", port=0, worker_host="127.0.0.1", kv_cache_tokens=4096,
                     max_model_len=512, log_level="error", api_keys={KEY: "acme"},
                     ssl_certfile=str(web / "cert.pem"), ssl_keyfile=str(web / "key.pem"))
    said: list[str] = []
    d = Deployment(settings, say=said.append).start(timeout_s=240)
    try:
        assert d.ca is not None and any("over mutual TLS" in line for line in said), said
        assert d.url.startswith("https://")
        out = completion(d.url, ssl.create_default_context(cafile=str(web / "ca.pem")), "def add(a, b):\n")
        assert out["usage"]["completion_tokens"] > 0 and out["choices"][0]["finish_reason"] in ("length", "stop")
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):   # one not trusting its CA
            completion(d.url, ssl.create_default_context(), "x")

        registry = reg.lookup()
        entries = ray.get(registry.workers.remote())
        assert {w["role"] for w in entries} == {"prefill", "decode"} and all(w["tls"] for w in entries)
        decode = next(w for w in entries if w["role"] == "decode")
        assert decode["transfer_endpoint"].startswith("grpc://")
        assert ray.get(registry.transfer_endpoints.remote()) == [decode["transfer_endpoint"]]

        for w in entries:
            assert read_stats(w)["health"] == "ok"             # the actor's channel holds a certificate
            with channel(w["address"], d._secret) as ch:        # the secret, but no certificate
                stub = wpb_grpc.PrefillServiceStub(ch) if w["role"] == "prefill" else wpb_grpc.DecodeServiceStub(ch)
                with pytest.raises(grpc.RpcError) as e:
                    stub.Stats(wpb.StatsRequest(), timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE

        forged = [
            registry.register.remote("evil-0", {"role": "decode", "address": "127.0.0.1:1"}, time.time(), "0" * 64),
            registry.register.remote("evil-1", {"role": "decode", "address": "127.0.0.1:1"},
                                     *reg.proof(b"another-cluster-secret-012345678", "register", "evil-1",
                                                {"role": "decode", "address": "127.0.0.1:1"})),
            registry.unregister.remote(decode["worker_id"], *reg.proof(b"another-cluster-secret-012345678",
                                                                       "unregister", decode["worker_id"])),
            registry.unregister.remote(decode["worker_id"], time.time() - 3600,
                                       reg.proof(d._secret, "unregister", decode["worker_id"])[1]),
        ]
        for ref in forged:
            with pytest.raises(Exception, match="no valid proof"):
                ray.get(ref)
        assert ray.get(registry.refused.remote()) == len(forged)
        assert sorted(w["worker_id"] for w in ray.get(registry.workers.remote())) == \
            sorted(w["worker_id"] for w in entries)
        assert completion(d.url, ssl.create_default_context(cafile=str(web / "ca.pem")), "x = ")["usage"]
    finally:
        d.stop()
