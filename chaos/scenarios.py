"""The chaos scenarios: each one name, one kind of fault, one way of checking it was caught.

`point` is armed on every worker of `role` for the scenario's requests; `expect` lists the
refusal codes that count as detecting one injection (matched by transfer id against the
decode workers' refusal logs).  Scenarios without `expect` hold faults that are not refused
frames: they are checked by their own rule (see `detects`) and by the oracles every
scenario shares (reference equality, canaries, pool accounting).  An `attack`
(chaos.attacks) runs around the scenario's requests and keeps its own account (the trust
group: a rogue client without the secret, stalled Push streams).  A hostile scenario's requests
are the other tenants' (`victim`): they run once without the attack (the TTFT baseline), then
again beside it, and both runs are judged.  A prefix scenario (chaos.prefix) runs its requests
in phases, one after another, with its own actions between them and its own judgement.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.types import Role

LATE = ("EXPIRED", "AFTER_FAILURE", "UNKNOWN_TRANSFER")


@dataclass(frozen=True)
class Scenario:
    name: str
    group: str                       # transfer | pool | process | admission | trust | hostile | prefix
    about: str
    point: str | None = None         # injector point armed for the scenario
    role: Role | None = None         # PREFILL (sender faults) or DECODE (receiver / pool faults)
    expect: tuple[str, ...] = ()     # refusal codes that detect one injection
    share: float = 0.4               # about this share of the scenario's requests is faulted
    per_frame: float = 0.5           # chance per frame while the armed count lasts
    seconds: float = 0.0
    after: int = 0                   # frames each injector lets pass before it may fire
    client: str = "normal"           # normal | victim | disconnect | storm | over_by_one | far_over | at_limit,
                                     # or a prefix-cache workload run in phases (chaos.prefix: cross_tenant,
                                     # poison, evict)
    driver: str | None = None        # kill_prefill | kill_decode | kill_decode_twice | drain_decode | corrupt_expert
    attack: str | None = None        # rogue_client | stalled_streams (chaos.attacks: around the requests),
                                     # or a hostile tenant (chaos.hostile, chaos.bombs: beside them)
    weight: float = 1.0              # share of --requests, relative to the other scenarios
    max_tokens: int | None = None    # every request asks this many (streams for a driver acting mid-way)
    lossless: bool = False           # every request must complete: none may fail (migration continues them)
    waves: int = 1                   # the requests go in this many waves, each sent when the driver says
                                     # (a moving driver: one per kill or drain, and one to spare)
    least: int = 2                   # requests it needs at the least

    @property
    def refused(self) -> bool:
        """Detection is a refusal on the injected transfer."""
        return bool(self.expect)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("flipped_bit", "transfer", "one payload bit flipped after the checksum",
             "corrupt_payload", Role.PREFILL, ("BAD_CHECKSUM",)),
    Scenario("altered_header", "transfer", "a header field changed after the checksum",
             "alter_header", Role.PREFILL, ("BAD_CHECKSUM",)),
    Scenario("swapped_pages", "transfer", "payloads exchanged between two concurrent transfers",
             "swap_pages", Role.PREFILL, ("BAD_CHECKSUM", "BAD_GEOMETRY"), share=0.5),
    Scenario("foreign_replay", "transfer", "a frame re-aimed at another request's reservation",
             "replay_foreign", Role.PREFILL, ("BAD_TAG",)),
    Scenario("stale_replay", "transfer", "a frame of a finished transfer replayed",
             "replay_stale", Role.PREFILL, ("EXPIRED", "AFTER_COMMIT", "UNKNOWN_TRANSFER", "AFTER_FAILURE")),
    Scenario("duplicate_frame", "transfer", "a frame sent twice", "duplicate", Role.PREFILL, ("DUPLICATE",)),
    Scenario("dropped_frame", "transfer", "a frame never sent, then the commit",
             "drop", Role.PREFILL, ("INCOMPLETE",)),
    Scenario("placeholder", "transfer", "only the first frames, then commit (the incident chain)",
             "commit_early", Role.PREFILL, ("INCOMPLETE",), per_frame=1.0),   # only first frames qualify
    Scenario("late_write", "transfer", "a frame written after the client left, the decode side "
             "aborted and its pages went to new requests", "late_write", Role.PREFILL, LATE,
             seconds=1.5, client="disconnect", share=0.5),
    Scenario("unwritten_page", "pool", "a verified frame marked written without its bytes",
             "unwritten_page", Role.DECODE, ("RECHECK_FAILED",)),
    Scenario("corrupt_expert", "pool", "a bit of a resident expert slot flipped after start-up",
             driver="corrupt_expert"),
    Scenario("kill_prefill", "process", "the prefill worker killed mid-push (SIGKILL, Ray restarts it)",
             "delay", Role.PREFILL, seconds=30.0, share=0.0, per_frame=1.0, after=2, driver="kill_prefill",
             weight=0.6),
    Scenario("kill_decode", "process", "a decode worker killed mid-stream (Ray restarts it; its streams "
             "migrate to the other)", driver="kill_decode", weight=0.6, max_tokens=48, lossless=True, waves=2,
             least=6),
    Scenario("kill_decode_twice", "process", "a decode worker killed mid-stream, then, while it restarts, the "
             "worker its streams migrated to once one of them streams there", driver="kill_decode_twice",
             weight=0.6, max_tokens=48, lossless=True, waves=2, least=8),
    Scenario("drain_decode", "process", "a rolling drain of every decode worker under load (grace 0.5 s, "
             "then a restart): what does not finish in the grace migrates", driver="drain_decode", weight=0.6,
             max_tokens=48, lossless=True, waves=3, least=8),
    Scenario("stalled_peer", "process", "a receiver that reads nothing for 2 s, then continues",
             "stall", Role.DECODE, seconds=2.0, share=0.15),
    Scenario("abort_storm", "process", "clients that disconnect at random points", client="storm"),
    Scenario("rogue_client", "trust", "a process without the cluster secret calls every worker RPC and the "
             "KV transfer service", attack="rogue_client", weight=0.4),
    Scenario("misbound_prefill", "trust", "a prefill worker holding the secret pushes KV bound to another "
             "prompt of the same length", "misbind", Role.PREFILL, ("PROMPT_MISMATCH",)),
    Scenario("stalled_streams", "trust", "a worker holding the secret stalls max_push_streams + 8 Push "
             "streams on a decode worker's receiver", attack="stalled_streams", weight=0.6),
    Scenario("redos", "hostile", "one tenant sends catastrophic stop_regex patterns, huge expansions and stop "
             "lists over and at the caps while the others run", client="victim", attack="redos", weight=0.5),
    Scenario("slow_reader", "hostile", "one tenant opens streams and never reads them (small receive window)",
             client="victim", attack="slow_reader", weight=0.5),
    Scenario("chunked_bomb", "hostile", "one client sends 64 MiB request bodies, chunked with and without an API "
             "key", client="victim", attack="chunked_bomb", weight=0.5),
    Scenario("kv_hog", "hostile", "one tenant floods long chat requests without max_tokens",
             client="victim", attack="kv_hog", weight=0.5),
    Scenario("control_tokens", "hostile", "one tenant's chat messages (every role) and prompt strings carry every "
             "special token of the shipped tokenizer and a forged system turn", client="victim",
             attack="control_tokens", weight=0.5),
    Scenario("slow_connections", "hostile", "one address keeps thousands of connections that never finish a "
             "request: silent, half-sent and trickled heads, stalled bodies", client="victim",
             attack="slow_connections", weight=0.5),
    Scenario("smuggling", "hostile", "ambiguous framings over raw sockets (Content-Length beside "
             "Transfer-Encoding, odd codings, two lengths, folded and bare-LF heads), each followed by a request",
             client="victim", attack="smuggling", weight=0.5),
    Scenario("cross_tenant_probe", "prefix", "a second tenant (and the first under two cache_salt values) sends "
             "the prompts whose long prefixes the first tenant cached", client="cross_tenant", weight=0.6),
    Scenario("cache_poison", "prefix", "a frame of other bytes aimed at a shared cached page of a delta transfer",
             "poison_cached", Role.PREFILL, ("CACHED_PAGE",), share=0.5, per_frame=1.0, client="poison", weight=0.6),
    Scenario("evict_under_load", "prefix", "decode pools squeezed to 32 pages while requests share 3 prefixes: "
             "cached pages evicted under load", client="evict", weight=0.6),
    Scenario("over_by_one", "admission", "prompt_tokens + max_tokens one over the limit",
             client="over_by_one", weight=0.4),
    Scenario("far_over", "admission", "a prompt far over the limit", client="far_over", weight=0.4),
    Scenario("at_limit", "admission", "prompt_tokens + max_tokens exactly at the limit",
             client="at_limit", weight=0.6),
)

BY_NAME = {s.name: s for s in SCENARIOS}


def select(names: str) -> list[Scenario]:
    """`all` or a comma-separated list of names; raises ValueError naming an unknown one."""
    if names.strip() == "all":
        return list(SCENARIOS)
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in BY_NAME]
    if unknown or not chosen:
        raise ValueError(f"unknown scenario(s) {', '.join(unknown) or '(none given)'}; "
                         f"known: {', '.join(BY_NAME)}")
    return [BY_NAME[n] for n in chosen]


def split(requests: int, scenarios: list[Scenario]) -> list[int]:
    """Requests per scenario in proportion to the weights (largest remainders), at least each
    scenario's `least`: the sum is `requests` unless that is below some scenario's least."""
    total = sum(s.weight for s in scenarios)
    exact = [requests * s.weight / total for s in scenarios]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[:requests - sum(counts)]:
        counts[i] += 1
    return [max(s.least, c) for s, c in zip(scenarios, counts)]
