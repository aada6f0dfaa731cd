"""Settings of a worker process (prefill, decode or colocated): one frozen config."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.compiled.buckets import decode_buckets, parse_buckets
from engine.config import SHIPPED_MODEL, EngineConfig, compile_default, parse_dtype
from engine.stop import STOP_BUDGET_S, STOP_WINDOW_CHARS, StopLimits
from kv_transfer.frame import check_secret
from kv_transfer.tls import TlsIdentity
from kv_transfer.transport.base import TransportConfig

MAX_REQUEST_TIMEOUT_S = 600.0   # the longest a Generate may ask its reservation to wait (the gateway's default)
STEP_DEADLINE_S = 30.0          # a loop iteration longer than this: Health says not ready
MAX_NUM_SEQS = 64               # requests one decode batch holds (the largest compile bucket)


@dataclass(frozen=True)
class WorkerConfig:
    model: str | None = None              # checkpoint directory; None: the shipped tiny-moe
    dtype: str = "float32"
    device: str = "cpu"
    kv_cache_tokens: int = 16384
    page_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = MAX_NUM_SEQS
    max_prefill_tokens: int = 2048
    paged_experts_num_resident: int | None = None
    # decode steps run as compiled graphs, one per batch bucket (engine/compiled); False: --no-compile
    compile: bool = field(default_factory=compile_default)
    compile_buckets: tuple[int, ...] | None = None   # --compile-buckets; None: 1, 2, 4, ... up to max_num_seqs
    # a constraint this worker has not seen is checked in a child process killed past this budget
    # (engine/grammar_check.py): twice the gateway's default, so what the gateway passed passes here
    grammar_check_timeout_s: float = 10.0
    seed: int = 0
    host: str = "127.0.0.1"               # where the services listen
    advertise_host: str | None = None     # the address others reach them at (default: host)
    port: int = 0                         # 0: a free port
    mem_fraction: float | None = None     # size the KV cache as this share of free memory instead
    transfer: str = "grpc"                # how prefill reaches this decode worker: grpc or shm
    transfer_port: int = 0
    transfer_timeout_s: float = 30.0      # a reservation that receives nothing for this long ends
    max_request_timeout_s: float = MAX_REQUEST_TIMEOUT_S   # a Generate's timeout_s is clamped to this
    step_deadline_s: float = STEP_DEADLINE_S    # Health is not ready while one loop iteration runs longer
    stop_window_chars: int = STOP_WINDOW_CHARS  # a stop_regex is searched in this many trailing characters
    stop_budget_s: float = STOP_BUDGET_S        # one token's stop checks; past it the request ends (error)
    layer_group: int = 2                  # prefill sends every `layer_group` layers as computed
    verify_experts: bool = False          # check resident expert slots before each use (guard mode)
    prefix_cache: bool = True             # reuse cached prompt prefixes (per tenant salt); False: --no-prefix-cache
    kv_audit: bool = False                # hash cached pages at publish (pool.check_integrity(contents=True))
    decode_peers: tuple[str, ...] = ()    # (prefill, as a plain process) the decode transfer endpoints it may push to
    secret: bytes = field(default=b"", repr=False)   # the cluster secret (never printed)
    # this worker's cluster certificate: its RPC and transfer servers, and the channels it opens,
    # run mutual TLS (kv_transfer/tls.py); None: plaintext (every worker on one node)
    tls: TlsIdentity | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.transfer not in ("grpc", "shm"):
            raise ValueError(f"transfer={self.transfer!r}: choose grpc or shm")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s={self.transfer_timeout_s} must be > 0")
        if not 0 < self.max_request_timeout_s < float("inf"):
            raise ValueError(f"max_request_timeout_s={self.max_request_timeout_s} must be > 0 and finite")
        if not 0 < self.step_deadline_s < float("inf"):
            raise ValueError(f"step_deadline_s={self.step_deadline_s} must be > 0 and finite")
        self.stop_limits                  # raises ValueError naming a bad stop window or budget
        if self.layer_group < 1:
            raise ValueError(f"layer_group={self.layer_group} must be >= 1")
        check_secret(self.secret)         # every worker of a cluster gets the same one at start-up
        if not 0 < self.grammar_check_timeout_s < float("inf"):
            raise ValueError(f"grammar_check_timeout_s={self.grammar_check_timeout_s} must be > 0 and finite")
        if self.compile_buckets is not None:   # before the model loads
            check_compile_buckets(self.compile_buckets, self.max_num_seqs)

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def stop_limits(self) -> StopLimits:
        """The regex window and per-token budget of every request's stop checks (`engine.stop`)."""
        return StopLimits(window_chars=self.stop_window_chars, budget_s=self.stop_budget_s)

    @property
    def transport(self) -> TransportConfig:
        """The transfer layer's settings for this worker (its TLS identity; defaults otherwise)."""
        return TransportConfig(tls=self.tls)

    def engine_config(self, kv_cache_tokens: int | None = None) -> EngineConfig:
        """The engine's config for this worker (`kv_cache_tokens` overrides the configured size)."""
        return EngineConfig(model=str(self.model or SHIPPED_MODEL), dtype=parse_dtype(self.dtype),
                            device=self.device, page_size=self.page_size,
                            kv_cache_tokens=self.kv_cache_tokens if kv_cache_tokens is None else kv_cache_tokens,
                            max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                            max_prefill_tokens=self.max_prefill_tokens, seed=self.seed,
                            paged_experts_num_resident=self.paged_experts_num_resident,
                            enable_prefix_cache=self.prefix_cache, kv_audit=self.kv_audit,
                            compile=self.compile, compile_buckets=self.compile_buckets,
                            grammar_check_timeout_s=self.grammar_check_timeout_s)


def check_compile_buckets(sizes: Sequence[int], max_num_seqs: int = MAX_NUM_SEQS) -> tuple[int, ...]:
    """The compile buckets `sizes` sorted and deduplicated.  Raises ValueError naming a size
    outside 1..max_num_seqs (a decode batch never holds more requests than that)."""
    if over := [b for b in sizes if b > max_num_seqs]:
        raise ValueError(f"compile bucket {over[0]} exceeds max_num_seqs={max_num_seqs}: a decode batch holds "
                         f"at most {max_num_seqs} requests (choose sizes from 1 to {max_num_seqs})")
    return decode_buckets(max_num_seqs, sizes)


def parse_compile_buckets(text: str, max_num_seqs: int = MAX_NUM_SEQS) -> tuple[int, ...]:
    """--compile-buckets "1,2,4,8" -> (1, 2, 4, 8).  Raises ValueError naming the bad entry:
    not a positive number, or above `max_num_seqs`."""
    return check_compile_buckets(parse_buckets(text), max_num_seqs)
