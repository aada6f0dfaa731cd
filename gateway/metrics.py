"""The gateway's Prometheus metrics (one registry per app), including per-worker figures
copied from the workers' `Stats` at every refresh and per-tenant figures read from the admission
queue at every scrape (tenant labels bounded: gateway/fairness.py `tenant_label`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from gateway.admission import AdmissionQueue
from gateway.errors import Cause, MigrationFailure
from gateway.fairness import tenant_label
from gateway.routing import WorkerPool

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# the time a migration adds to a stream: fine buckets, so that p50/p99 interpolate well
GAP_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5,
               10, 15, 20, 30)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tandem_requests", "Requests by final status", ["status"], registry=r)
        self.rejected = Counter("tandem_rejected", "Requests rejected by the gateway, by reason",
                                ["reason"], registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tandem_e2e_latency_seconds", "Request latency, end to end",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Gauge("tandem_queue_length", "Requests waiting for a running slot", registry=r)
        self.running = Gauge("tandem_running_requests", "Requests forwarded to workers", registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of completed requests", registry=r)
        self.generated = Counter("tandem_generation_tokens", "Generated tokens", registry=r)
        self.prompt_logprobs = Counter("tandem_prompt_logprob_entries", "Prompt logprob entries returned (each "
                                       "prompt token's, and each alternative of it)", registry=r)
        labels = ["worker", "role"]
        self.kv_used = Gauge("tandem_worker_kv_used_tokens", "KV tokens in use", labels, registry=r)
        self.kv_capacity = Gauge("tandem_worker_kv_capacity_tokens", "KV capacity in tokens", labels, registry=r)
        self.worker_up = Gauge("tandem_worker_up", "1 when the worker answered the last health check",
                               labels, registry=r)
        self.refusals = Gauge("tandem_worker_transfer_refusals", "KV transfer refusals on the worker, by reason",
                              labels + ["reason"], registry=r)
        self.expert_hit_rate = Gauge("tandem_worker_expert_hit_rate", "Paged experts: hits / (hits + misses)",
                                     labels, registry=r)
        self.expert_misses = Gauge("tandem_worker_expert_misses", "Paged experts: misses", labels, registry=r)
        self.expert_hits = Gauge("tandem_worker_expert_hits", "Paged experts: hits", labels, registry=r)
        self.expert_bytes_paged = Gauge("tandem_worker_expert_bytes_paged", "Paged experts: bytes copied into "
                                        "device slots (page-ins and prefetches)", labels, registry=r)
        self.expert_format = Gauge("tandem_worker_expert_format_info", "1 per MoE layer: how its routed experts "
                                   "are held (a dtype or a quantized format) and whether they are paged",
                                   labels + ["layer", "format", "paged"], registry=r)
        self.unauthenticated = Gauge("tandem_worker_rpc_unauthenticated",
                                     "Calls the worker refused for missing, bad, stale or replayed credentials",
                                     labels, registry=r)
        # the prefix cache (worker counters, copied from its Stats) and the router's view of it
        self.cache_query_tokens = Gauge("tandem_worker_cache_query_tokens",
                                        "Prompt tokens looked up in the worker's prefix cache", labels, registry=r)
        self.cache_hit_tokens = Gauge("tandem_worker_cache_hit_tokens", "Prompt tokens found in the worker's "
                                      "prefix cache (not computed, not transferred)", labels, registry=r)
        self.kv_pages_cached = Gauge("tandem_worker_kv_pages_cached", "KV pages in the worker's prefix cache",
                                     labels, registry=r)
        self.cache_evictions = Gauge("tandem_worker_cache_evictions", "Cached KV pages the worker evicted "
                                     "to make room", labels, registry=r)
        self.transfer_bytes = Gauge("tandem_worker_transfer_bytes_accepted", "KV payload bytes the decode "
                                    "worker accepted from prefill", labels, registry=r)
        self.view_pages = Gauge("tandem_worker_routing_view_pages", "Pages this gateway's router believes "
                                "the worker caches (from its cache events)", labels, registry=r)
        self.migration = MigrationMetrics(r)
        self.grammar_compile = Histogram("tandem_grammar_compile_seconds", "Structured outputs: building and "
                                         "compiling a request's constraint (cached per constraint)",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.ignored_fields = Counter("tandem_requests_with_ignored_fields", "Requests that sent fields the "
                                      "gateway ignored (named in X-Tandem-Ignored-Fields)", registry=r)
        self.tenant_rejections = Counter("tandem_tenant_rejected", "Requests the admission queue refused, "
                                         "by tenant and reason", ["tenant", "reason"], registry=r)

    def tenant_rejected(self, tenant: str, reason: str) -> None:
        """Count a refusal of the admission queue (its `on_reject`)."""
        self.tenant_rejections.labels(tenant_label(tenant), reason).inc()

    def watch(self, queue: AdmissionQueue) -> None:
        """Export the queue's per-tenant figures at every scrape."""
        self.registry.register(TenantCollector(queue))

    def observe_workers(self, pool: WorkerPool) -> None:
        for w in pool.workers:
            lab = (w.address, w.role)
            self.worker_up.labels(*lab).set(1 if w.healthy else 0)
            self.view_pages.labels(*lab).set(len(w.cache) if w.cache is not None else 0)
            if w.stats is None:
                continue
            s = w.stats
            self.kv_used.labels(*lab).set(s.kv_tokens_used)
            self.kv_capacity.labels(*lab).set(s.kv_tokens_capacity)
            self.unauthenticated.labels(*lab).set(s.rpc_unauthenticated)
            for reason, n in s.transfers_refused.items():
                self.refusals.labels(*lab, reason).set(n)
            hits = sum(e.hits for e in s.experts)
            misses = sum(e.misses for e in s.experts)
            self.expert_hits.labels(*lab).set(hits)
            self.expert_bytes_paged.labels(*lab).set(sum(e.bytes_paged for e in s.experts))
            for e in s.experts:
                self.expert_format.labels(*lab, str(e.layer), e.format, "true" if e.paged else "false").set(1)
            self.cache_query_tokens.labels(*lab).set(s.cache_query_tokens)
            self.cache_hit_tokens.labels(*lab).set(s.cache_hit_tokens)
            self.kv_pages_cached.labels(*lab).set(s.kv_pages_cached)
            self.cache_evictions.labels(*lab).set(s.cache_evictions)
            self.transfer_bytes.labels(*lab).set(s.transfer_bytes_accepted)
            self.expert_misses.labels(*lab).set(misses)
            if hits + misses:
                self.expert_hit_rate.labels(*lab).set(hits / (hits + misses))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MigrationMetrics:
    """What the choices' migrations report (gateway/migration.py; a gateway/route.py
    MigrationObserver)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.total = Counter("tandem_migrations", "Streams continued on another worker after their decode "
                             f"worker failed after a token, by cause ({', '.join(Cause)})", ["cause"], registry=r)
        self.failed_total = Counter("tandem_migrations_failed", "Broken streams that could not be continued, by "
                                    f"reason ({', '.join(MigrationFailure)})", ["reason"], registry=r)
        self.prefill_tokens = Counter("tandem_migration_prefill_tokens", "Prompt and generated tokens the "
                                      "migrations' re-prefills computed (not found in a prefix cache)", registry=r)
        self.gaps = Histogram("tandem_migration_gap_seconds", "From the last token before a stream broke to "
                              "the first message after it, as the gateway saw them", buckets=GAP_BUCKETS,
                              registry=r)
        for cause in Cause:
            self.total.labels(cause)
        for reason in MigrationFailure:
            self.failed_total.labels(reason)

    def migrated(self, cause: Cause) -> None:
        self.total.labels(cause).inc()

    def failed(self, reason: MigrationFailure) -> None:
        self.failed_total.labels(reason).inc()

    def recomputed(self, tokens: int) -> None:
        self.prefill_tokens.inc(tokens)

    def gap(self, seconds: float) -> None:
        self.gaps.observe(seconds)


class TenantCollector:
    """Per tenant label: requests queued and running, KV tokens reserved; and the KV budget."""

    def __init__(self, queue: AdmissionQueue) -> None:
        self.queue = queue

    def collect(self) -> Iterator[GaugeMetricFamily]:
        queued, running, kv = (GaugeMetricFamily(name, doc, labels=["tenant"]) for name, doc in (
            ("tandem_tenant_queued", "Requests of the tenant waiting in the admission queue"),
            ("tandem_tenant_running", "Requests of the tenant forwarded to workers"),
            ("tandem_tenant_kv_reserved_tokens", "KV tokens (prompt + max_tokens) the tenant's running requests hold")))
        sums: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for key, load in list(self.queue.tenants.items()):
            s = sums[tenant_label(key)]
            s[0] += len(load.queued)
            s[1] += load.running
            s[2] += load.kv_reserved
        for label, (q, r, k) in sorted(sums.items()):
            queued.add_metric([label], q)
            running.add_metric([label], r)
            kv.add_metric([label], k)
        yield from (queued, running, kv)
        yield GaugeMetricFamily("tandem_tenant_kv_budget_tokens", "KV tokens one tenant may hold reserved "
                                "(0: no limit)", value=self.queue.limits.tenant_tokens())
