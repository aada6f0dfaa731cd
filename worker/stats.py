"""The `Stats` and `Health` replies of a worker, read from its engine."""

from __future__ import annotations

from engine.core import EngineCore
from proto import worker_pb2 as wpb
from worker.types import Role


def health(core: EngineCore, role: Role) -> wpb.HealthReply:
    return wpb.HealthReply(ready=True, role=role.value, model=str(core.config.model),
                           max_model_len=core.max_model_len, kv_capacity_tokens=core.pool.capacity_tokens,
                           paged_experts_num_resident=core.config.paged_experts_num_resident or 0)


def stats(core: EngineCore, role: Role, running: int, waiting: int, waiting_tokens: int = 0,
          accepted: int = 0, refused: dict[str, int] | None = None, finished: int = 0,
          failed: int = 0, unauthenticated: int = 0) -> wpb.StatsReply:
    pool = core.pool
    size = pool.page_size
    reply = wpb.StatsReply(
        role=role.value, running=running, waiting=waiting, waiting_tokens=waiting_tokens,
        kv_pages_free=pool.num_free, kv_pages_used=pool.num_used, kv_pages_capacity=pool.num_pages,
        kv_tokens_free=pool.num_free * size, kv_tokens_used=pool.num_used * size,
        kv_tokens_capacity=pool.capacity_tokens, transfers_accepted=accepted,
        requests_finished=finished, requests_failed=failed, rpc_unauthenticated=unauthenticated)
    reply.transfers_refused.update(refused or {})
    for layer, c in core.expert_stats().items():
        reply.experts.append(wpb.ExpertLayerStats(layer=layer, hits=c["hits"], misses=c["misses"],
                                                  bytes_paged=c["bytes_paged"], waves=c["waves"]))
    return reply
