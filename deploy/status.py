"""`tandem status`: every worker of a running deployment, its node, health, KV usage and
expert hit rate (read from the registry, then from each worker's own `Stats`)."""

from __future__ import annotations

import grpc
import ray

from deploy import registry as reg
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from worker.types import Role


def status(address: str) -> int:
    ray.init(address=address, namespace=reg.NAMESPACE, log_to_driver=False,
             logging_level="ERROR")  # type: ignore[arg-type]  # ray takes a level name too (its default is "info")
    try:
        try:
            workers: list[dict] = ray.get(reg.lookup().workers.remote())
        except ValueError:
            print("tandem: no deployment is running on this Ray cluster")
            return 1
        print(f"{'worker':14s} {'role':10s} {'node':15s} {'address':22s} {'health':8s} {'KV used/capacity':>22s} "
              f"{'expert hit rate':>15s}")
        for w in workers:
            print(_row(w))
        return 0
    finally:
        ray.shutdown()


def _row(w: dict) -> str:
    channel = grpc.insecure_channel(w["address"])
    prefill = w["role"] == Role.PREFILL.value
    stub = wpb_grpc.PrefillServiceStub(channel) if prefill else wpb_grpc.DecodeServiceStub(channel)
    try:
        s = stub.Stats(wpb.StatsRequest(), timeout=5)
        health = "ok"
        kv = f"{s.kv_tokens_used}/{s.kv_tokens_capacity}"
        hits, misses = sum(e.hits for e in s.experts), sum(e.misses for e in s.experts)
        rate = f"{hits / (hits + misses):.3f}" if hits + misses else "-"
    except grpc.RpcError as e:
        health, kv, rate = e.code().name.lower()[:8], "-", "-"
    finally:
        channel.close()
    return (f"{w['worker_id']:14s} {w['role']:10s} {w['node_ip']:15s} {w['address']:22s} {health:8s} "
            f"{kv:>22s} {rate:>15s}")
