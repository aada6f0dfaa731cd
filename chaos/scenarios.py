"""The chaos scenarios, one row each: name, group, what it does, then its parts
(chaos.scenario.Scenario): the requests it sends (chaos.workloads, chaos.prefix), the fault
point it arms (`Armed`: on the workers of a role, for about `share` of its requests), its
driver (chaos.drivers, chaos.moving), its attack (chaos.attacks; a hostile tenant: chaos.hostile,
chaos.bombs, chaos.tokens, chaos.front_door), and the rules that judge it (chaos.judges).  An
attack judges itself, a prefix workload adds its own judgement; every scenario is also judged by
the oracles they all share."""

from __future__ import annotations

from chaos.attacks import RogueClient, StalledStreams
from chaos.bombs import ChunkedBomb, SlowReader
from chaos.drivers import CorruptExpert, KillPrefill
from chaos.front_door import SlowConnections, Smuggling
from chaos.hostile import KvHog, Redos
from chaos.judges import (
    LATE,
    AtLimitCompletes,
    KilledTransfers,
    Lossless,
    Moves,
    Refusals,
    RefusedAtDoor,
    SlotsRepaired,
    ToleratedHangUps,
    ToleratedInjections,
)
from chaos.moving import DrainDecode, KillDecode, KillDecodeTwice
from chaos.prefix import CachePoison, CrossTenant, EvictUnderLoad, Phased
from chaos.scenario import Armed, Group, Scenario
from chaos.tokens import ControlTokenInjection
from chaos.workloads import AtLimit, Disconnects, FarOver, Mixed, OverByOne, Storm, Streams, Victims
from worker.types import Role

SENDER, RECEIVER = Role.PREFILL, Role.DECODE
# kill_prefill's fault: one push (share 0: armed once) waits 30 s after its first two frames, so its
# driver finds it mid-push and kills the worker holding it
HELD_PUSH = Armed("delay", SENDER, share=0.0, per_frame=1.0, seconds=30.0, after=2)

SCENARIOS: tuple[Scenario, ...] = (
    Scenario("flipped_bit", Group.TRANSFER, "one payload bit flipped after the checksum",
             Mixed(), Armed("corrupt_payload", SENDER), judged=(Refusals("BAD_CHECKSUM"),)),
    Scenario("altered_header", Group.TRANSFER, "a header field changed after the checksum",
             Mixed(), Armed("alter_header", SENDER), judged=(Refusals("BAD_CHECKSUM"),)),
    Scenario("swapped_pages", Group.TRANSFER, "payloads exchanged between two concurrent transfers",
             Mixed(), Armed("swap_pages", SENDER, share=0.5), judged=(Refusals("BAD_CHECKSUM", "BAD_GEOMETRY"),)),
    Scenario("foreign_replay", Group.TRANSFER, "a frame re-aimed at another request's reservation",
             Mixed(), Armed("replay_foreign", SENDER), judged=(Refusals("BAD_TAG"),)),
    Scenario("stale_replay", Group.TRANSFER, "a frame of a finished transfer replayed",
             Mixed(), Armed("replay_stale", SENDER),
             judged=(Refusals("EXPIRED", "AFTER_COMMIT", "UNKNOWN_TRANSFER", "AFTER_FAILURE"),)),
    Scenario("duplicate_frame", Group.TRANSFER, "a frame sent twice",
             Mixed(), Armed("duplicate", SENDER), judged=(Refusals("DUPLICATE"),)),
    Scenario("dropped_frame", Group.TRANSFER, "a frame never sent, then the commit",
             Mixed(), Armed("drop", SENDER), judged=(Refusals("INCOMPLETE"),)),
    Scenario("placeholder", Group.TRANSFER, "only the first frames, then commit (the incident chain)",
             Mixed(), Armed("commit_early", SENDER, per_frame=1.0),    # only first frames qualify
             judged=(Refusals("INCOMPLETE"),)),
    Scenario("late_write", Group.TRANSFER, "a frame written after the client left, the decode side aborted and its "
             "pages went to new requests",
             Disconnects(), Armed("late_write", SENDER, share=0.5, seconds=1.5), judged=(Refusals(*LATE),)),
    Scenario("unwritten_page", Group.POOL, "a verified frame marked written without its bytes",
             Mixed(), Armed("unwritten_page", RECEIVER), judged=(Refusals("RECHECK_FAILED"),)),
    Scenario("corrupt_expert", Group.POOL, "a bit of a resident expert slot flipped after start-up",
             Mixed(), driver=CorruptExpert(), judged=(SlotsRepaired(),)),
    Scenario("kill_prefill", Group.PROCESS, "the prefill worker killed mid-push (SIGKILL, Ray restarts it)",
             Mixed(), HELD_PUSH, KillPrefill(HELD_PUSH.point),
             judged=(KilledTransfers(),), weight=0.6),
    Scenario("kill_decode", Group.PROCESS, "a decode worker killed mid-stream (Ray restarts it; its streams migrate "
             "to the other)",
             Streams(max_tokens=48, waves=2), driver=KillDecode(), judged=(Moves(1), Lossless()),
             weight=0.6, least=6),
    Scenario("kill_decode_twice", Group.PROCESS, "a decode worker killed mid-stream, then, while it restarts, the "
             "worker its streams migrated to once one of them streams there",
             Streams(max_tokens=48, waves=2), driver=KillDecodeTwice(), judged=(Moves(2), Lossless()),
             weight=0.6, least=8),
    Scenario("drain_decode", Group.PROCESS, "a rolling drain of every decode worker under load (grace 0.5 s, then a "
             "restart): what does not finish in the grace migrates",
             Streams(max_tokens=48, waves=3), driver=DrainDecode(), judged=(Moves(None), Lossless()),
             weight=0.6, least=8),
    Scenario("stalled_peer", Group.PROCESS, "a receiver that reads nothing for 2 s, then continues",
             Mixed(), Armed("stall", RECEIVER, share=0.15, seconds=2.0), judged=(ToleratedInjections(),)),
    Scenario("abort_storm", Group.PROCESS, "clients that disconnect at random points",
             Storm(), judged=(ToleratedHangUps(),)),
    Scenario("rogue_client", Group.TRUST, "a process without the cluster secret calls every worker RPC and the KV "
             "transfer service",
             Mixed(), attack=RogueClient, weight=0.4),
    Scenario("misbound_prefill", Group.TRUST, "a prefill worker holding the secret pushes KV bound to another prompt "
             "of the same length",
             Mixed(), Armed("misbind", SENDER), judged=(Refusals("PROMPT_MISMATCH"),)),
    Scenario("stalled_streams", Group.TRUST, "a worker holding the secret stalls max_push_streams + 8 Push streams on "
             "a decode worker's receiver",
             Mixed(), attack=StalledStreams, weight=0.6),
    Scenario("redos", Group.HOSTILE, "one tenant sends catastrophic stop_regex patterns, huge expansions and stop "
             "lists over and at the caps while the others run",
             Victims(), attack=Redos, weight=0.5),
    Scenario("slow_reader", Group.HOSTILE, "one tenant opens streams and never reads them (small receive window)",
             Victims(), attack=SlowReader, weight=0.5),
    Scenario("chunked_bomb", Group.HOSTILE, "one client sends 64 MiB request bodies, chunked with and without an API "
             "key",
             Victims(), attack=ChunkedBomb, weight=0.5),
    Scenario("kv_hog", Group.HOSTILE, "one tenant floods long chat requests without max_tokens",
             Victims(), attack=KvHog, weight=0.5),
    Scenario("control_tokens", Group.HOSTILE, "one tenant's chat messages (every role) and prompt strings carry every "
             "special token of the shipped tokenizer and a forged system turn",
             Victims(), attack=ControlTokenInjection, weight=0.5),
    Scenario("slow_connections", Group.HOSTILE, "one address keeps thousands of connections that never finish a "
             "request: silent, half-sent and trickled heads, stalled bodies",
             Victims(), attack=SlowConnections, weight=0.5),
    Scenario("smuggling", Group.HOSTILE, "ambiguous framings over raw sockets (Content-Length beside "
             "Transfer-Encoding, odd codings, two lengths, folded and bare-LF heads), each followed by a request",
             Victims(), attack=Smuggling, weight=0.5),
    Scenario("cross_tenant_probe", Group.PREFIX, "a second tenant (and the first under two cache_salt values) sends "
             "the prompts whose long prefixes the first tenant cached",
             Phased(CrossTenant), weight=0.6),
    Scenario("cache_poison", Group.PREFIX, "a frame of other bytes aimed at a shared cached page of a delta transfer",
             Phased(CachePoison), Armed("poison_cached", SENDER, share=0.5, per_frame=1.0, phase=1),
             judged=(Refusals("CACHED_PAGE"),), weight=0.6),
    Scenario("evict_under_load", Group.PREFIX, "decode pools squeezed to 32 pages while requests share 3 prefixes: "
             "cached pages evicted under load",
             Phased(EvictUnderLoad), weight=0.6),
    Scenario("over_by_one", Group.ADMISSION, "prompt_tokens + max_tokens one over the limit",
             OverByOne(), judged=(RefusedAtDoor(),), weight=0.4),
    Scenario("far_over", Group.ADMISSION, "a prompt far over the limit",
             FarOver(), judged=(RefusedAtDoor(),), weight=0.4),
    Scenario("at_limit", Group.ADMISSION, "prompt_tokens + max_tokens exactly at the limit",
             AtLimit(), judged=(AtLimitCompletes(),), weight=0.6),
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
