"""The `Stats` and `Health` replies of a worker, read from its engine."""

from __future__ import annotations

from engine import LLM
from proto import worker_pb2 as wpb


def health(llm: LLM, role: str) -> wpb.HealthReply:
    return wpb.HealthReply(ready=True, role=role, model=str(llm.config.model),
                           max_model_len=llm.max_model_len, kv_capacity_tokens=llm.pool.capacity_tokens,
                           paged_experts_num_resident=llm.config.paged_experts_num_resident or 0)


def stats(llm: LLM, role: str, running: int, waiting: int, waiting_tokens: int = 0,
          accepted: int = 0, refused: dict | None = None, finished: int = 0, failed: int = 0) -> wpb.StatsReply:
    pool = llm.pool
    size = pool.page_size
    reply = wpb.StatsReply(
        role=role, running=running, waiting=waiting, waiting_tokens=waiting_tokens,
        kv_pages_free=pool.num_free, kv_pages_used=pool.num_used, kv_pages_capacity=pool.num_pages,
        kv_tokens_free=pool.num_free * size, kv_tokens_used=pool.num_used * size,
        kv_tokens_capacity=pool.capacity_tokens, transfers_accepted=accepted,
        requests_finished=finished, requests_failed=failed)
    reply.transfers_refused.update(refused or {})
    for layer, c in llm.expert_stats().items():
        reply.experts.append(wpb.ExpertLayerStats(layer=layer, hits=c["hits"], misses=c["misses"],
                                                  bytes_paged=c["bytes_paged"], waves=c["waves"]))
    return reply
