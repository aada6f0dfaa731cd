"""Settings of a worker process (prefill, decode or colocated): one frozen config that holds
the engine's.

    WorkerSettings   what an operator chooses for every worker: the engine (EngineConfig),
                     the KV transfer, timeouts, stop-check limits, the drain grace
    WorkerConfig     one worker process: its settings, and what its launcher wires in (where
                     it listens, the decode peers it pushes to, the cluster secret, its TLS
                     identity)

`tandem serve` holds one WorkerSettings for all its workers; `python -m deploy.worker` and
the Ray actors build a WorkerConfig (`options.build(WorkerConfig, kv_cache_tokens=..., ...)`
takes the engine's fields by name too).  Each field's help is what the command lines show.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.config import EngineConfig
from engine.constraint import GRAMMAR_COMPILE_TIMEOUT_S
from engine.options import branch, option
from engine.params import REQUEST_TIMEOUT_S
from engine.stop import STOP_BUDGET_S, STOP_WINDOW_CHARS, StopLimits
from kv_transfer.frame import check_secret
from kv_transfer.reservation import TRANSFER_TIMEOUT_S
from kv_transfer.tls import TlsIdentity
from kv_transfer.transport.base import TransportConfig

# the longest a Generate may ask its reservation to wait: the gateway's default request timeout
MAX_REQUEST_TIMEOUT_S = REQUEST_TIMEOUT_S
STEP_DEADLINE_S = 30.0          # a loop iteration longer than this: Health says not ready
# a worker's engine checks a constraint it has not seen in a child process killed past this
# budget (engine/grammar_check.py) when its EngineConfig sets none: twice the gateway's default
# compile timeout, so what the gateway passed passes here
GRAMMAR_CHECK_TIMEOUT_S = 2 * GRAMMAR_COMPILE_TIMEOUT_S
TRANSFERS = ("grpc", "shm", "nixl")


@dataclass(frozen=True)
class WorkerSettings:
    """What every worker of a deployment runs with.  Its engine's grammar-check budget is
    GRAMMAR_CHECK_TIMEOUT_S when the EngineConfig leaves it unset: a worker never compiles a
    client's constraint without one."""
    engine: EngineConfig = branch(EngineConfig, help="the engine the worker runs")
    # set, it replaces engine.kv_cache_tokens (the worker sizes its pool at start-up): options.build
    # refuses the two given together, as `tandem serve` does; a WorkerSettings made whole with an
    # engine that sets kv_cache_tokens takes mem_fraction
    mem_fraction: float | None = option(None, type=float, instead_of="kv_cache_tokens", says_default=True,
                                        help="size the KV pool as this share of free memory, instead of "
                                        "--kv-cache-tokens (default: not used)")
    transfer: str = option("grpc", choices=TRANSFERS, help="how prefill reaches decode (shm, nixl: "
                           "same node only)")
    transfer_timeout_s: float = option(TRANSFER_TIMEOUT_S, help="a reservation that receives nothing for this long "
                                       "ends, seconds")
    max_request_timeout_s: float = option(MAX_REQUEST_TIMEOUT_S, help="a Generate's timeout_s is clamped to this")
    step_deadline_s: float = option(STEP_DEADLINE_S, help="Health is not ready while one loop iteration runs "
                                    "longer, seconds")
    stop_window_chars: int = option(STOP_WINDOW_CHARS, help="a stop_regex is searched in this many trailing "
                                    "characters")
    stop_budget_s: float = option(STOP_BUDGET_S, help="one token's stop checks; past it the request ends (error)")
    layer_group: int = option(2, help="prefill sends every `layer_group` layers as they are computed")
    verify_experts: bool = option(False, action="store_true", help="check each resident expert slot against the "
                                  "host copy before use (guard mode; costs a read)")
    drain_grace_s: float = option(30.0, help="on shutdown (SIGTERM/SIGINT), scale-down or `tandem drain`: seconds "
                                  "in-flight requests may finish before they are ended with DRAINING (a decode "
                                  "worker's streams then continue on another)")

    def __post_init__(self) -> None:
        if self.engine.grammar_check_timeout_s is None:
            object.__setattr__(self, "engine", replace(self.engine, grammar_check_timeout_s=GRAMMAR_CHECK_TIMEOUT_S))
        if self.mem_fraction is not None and not 0 < self.mem_fraction < 1:
            raise ValueError(f"mem_fraction={self.mem_fraction} must be in (0, 1)")
        if self.transfer not in TRANSFERS:
            raise ValueError(f"transfer={self.transfer!r}: choose one of {', '.join(TRANSFERS)}")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s={self.transfer_timeout_s} must be > 0")
        for name in ("max_request_timeout_s", "step_deadline_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 and finite")
        self.stop_limits                  # raises ValueError naming a bad stop window or budget
        if self.layer_group < 1:
            raise ValueError(f"layer_group={self.layer_group} must be >= 1")
        if not 0 <= self.drain_grace_s < float("inf"):
            raise ValueError(f"drain_grace_s={self.drain_grace_s} must be >= 0 and finite")

    @property
    def stop_limits(self) -> StopLimits:
        """The regex window and per-token budget of every request's stop checks (`engine.stop`)."""
        return StopLimits(window_chars=self.stop_window_chars, budget_s=self.stop_budget_s)


@dataclass(frozen=True)
class WorkerConfig(WorkerSettings):
    """One worker process: its settings and its wiring."""
    host: str = option("127.0.0.1", help="the address its RPC and transfer servers listen on")
    advertise_host: str | None = option(None, says_default=True,
                                        help="the address others reach this worker at (default: --host)")
    port: int = option(0, help="its RPC port (0: a free one)")
    transfer_port: int = option(0, help="the decode worker's KV transfer port (0: a free one)")
    decode_peers: tuple[str, ...] = option(
        (), flag="--decode-peer", action="append",
        help="(prefill) a decode worker's transfer endpoint it may push to (repeatable; a prefill worker run as a "
        "plain process needs one)")
    secret: bytes = option(b"", repr=False, help="the cluster secret (never printed; every worker of a cluster gets "
                           "the same one at start-up)")
    # its cluster certificate: its RPC and transfer servers, and the channels it opens, run
    # mutual TLS (kv_transfer/tls.py); None: plaintext (every worker on one node)
    tls: TlsIdentity | None = option(None, repr=False, says_default=True,
                                     help="its cluster certificate (default: none, plaintext)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_secret(self.secret)

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def transport(self) -> TransportConfig:
        """The transfer layer's settings for this worker (its TLS identity; defaults otherwise)."""
        return TransportConfig(tls=self.tls)

    def engine_config(self, kv_cache_tokens: int | None = None) -> EngineConfig:
        """The engine's config for this worker: `engine`, with `kv_cache_tokens` (a pool sized
        from mem_fraction at start-up) replacing the configured pool when given."""
        return self.engine if kv_cache_tokens is None else replace(self.engine, kv_cache_tokens=kv_cache_tokens)
