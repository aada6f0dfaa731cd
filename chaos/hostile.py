"""Hostile tenants (issue 16) that attack with what they ask for, while the other tenants'
requests run:

    redos    catastrophic stop_regex patterns, patterns whose expansion is huge, stop lists
             over the caps and at them: each must end in a 400 naming the field and its limit,
             or an explicit error naming the stop-check budget, or (at the caps) a completion;
             never a hang; and the other costs a body can ask for (logit_bias entries, prompt
             logprobs) over their caps and at them
    kv_hog   a flood of long chat requests without max_tokens (the default applies), more at
             once than the tenant may have in flight: the tenant's KV reserved must stay within
             its budget, the rest wait in its queue or are refused 429
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from chaos.attacker import HostileAttack, Reply, request
from chaos.cluster import ChaosCluster
from chaos.gauges import Peaks, gateway_setting
from chaos.report import ScenarioResult
from engine.params import (
    MAX_LOGIT_BIAS_TOKENS,
    MAX_PROMPT_LOGPROB_ENTRIES,
    MAX_STOP_REGEX_CHARS,
    MAX_STOP_REGEX_EXPANSION,
    MAX_STOP_REGEXES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

REQUEST_TIMEOUT_S = 90.0        # an attacker request without an answer by then hung: a violation
CATASTROPHIC = "(?:.|.)+(?!)"   # never matches; backtracks 2^n over n characters
PROMPT = "Once upon a time, in a small town by the sea, there lived an old sailor who"


def _padded(pattern: str) -> str:
    """`pattern` as one alternative of a pattern exactly MAX_STOP_REGEX_CHARS long."""
    return pattern + "|" + "z" * (MAX_STOP_REGEX_CHARS - len(pattern) - 1)


# (what, extra body fields, expected end, words the refusal must name)
#   refused: HTTP 400 whose message names the field and its limit
#   budget:  an explicit error naming the stop-check budget, per token or on average (a completion
#            is noted, not detected)
#   bounded: a completion or the budget's error (at the caps: work bounded either way)
REDOS: tuple[tuple[str, dict[str, Any], str, tuple[str, ...]], ...] = (
    (f"catastrophic {CATASTROPHIC}", {"stop_regex": [CATASTROPHIC]}, "budget", ()),
    ("catastrophic, n=8", {"stop_regex": [CATASTROPHIC], "n": 8}, "budget", ()),
    ("nested quantifiers (?:(?:\\w+)+\\s?)+#", {"stop_regex": [r"(?:(?:\w+)+\s?)+#"]}, "bounded", ()),
    (f"{MAX_STOP_REGEXES} catastrophic patterns of {MAX_STOP_REGEX_CHARS} chars (at the caps)",
     {"stop_regex": [_padded(CATASTROPHIC)] * MAX_STOP_REGEXES}, "budget", ()),
    ("expansion (?:a{1000}){1000}", {"stop_regex": ["(?:a{1000}){1000}"]}, "refused",
     ("stop_regex", str(MAX_STOP_REGEX_EXPANSION))),
    (f"pattern of {MAX_STOP_REGEX_CHARS + 1} chars", {"stop_regex": ["a" * (MAX_STOP_REGEX_CHARS + 1)]}, "refused",
     ("stop_regex", str(MAX_STOP_REGEX_CHARS))),
    (f"{MAX_STOP_REGEXES + 1} patterns", {"stop_regex": [f"q{i}x" for i in range(MAX_STOP_REGEXES + 1)]},
     "refused", ("stop_regex", str(MAX_STOP_REGEXES))),
    (f"{MAX_STOP_STRINGS + 1} stop strings", {"stop": [f"zq{i}" for i in range(MAX_STOP_STRINGS + 1)]},
     "refused", ("stop", str(MAX_STOP_STRINGS))),
    (f"stop string of {MAX_STOP_STRING_CHARS + 1} chars", {"stop": ["q" * (MAX_STOP_STRING_CHARS + 1)]},
     "refused", ("stop", str(MAX_STOP_STRING_CHARS))),
    ("1000 stop strings of 3900 chars (3.9 MB)", {"stop": [f"{i:04d}" + "q" * 3896 for i in range(1000)]},
     "refused", ("stop", str(MAX_STOP_STRINGS))),
    (f"{MAX_STOP_TOKEN_IDS + 1} stop_token_ids", {"stop_token_ids": list(range(3000, 3001 + MAX_STOP_TOKEN_IDS))},
     "refused", ("stop_token_ids", str(MAX_STOP_TOKEN_IDS))),
    (f"{MAX_STOP_STRINGS} stop strings of {MAX_STOP_STRING_CHARS} chars, {MAX_STOP_TOKEN_IDS} stop ids (the caps)",
     {"stop": [f"{i:02d}" + "q" * (MAX_STOP_STRING_CHARS - 2) for i in range(MAX_STOP_STRINGS)],
      "stop_token_ids": list(range(4096 - MAX_STOP_TOKEN_IDS, 4096))}, "bounded", ()),
    # the other per-request costs a body can ask for: logit_bias entries, prompt logprobs (issue 37)
    (f"{MAX_LOGIT_BIAS_TOKENS + 1} logit_bias entries", {"logit_bias": {str(i): 1 for i in
                                                                        range(MAX_LOGIT_BIAS_TOKENS + 1)}},
     "refused", ("logit_bias", str(MAX_LOGIT_BIAS_TOKENS))),
    (f"{MAX_LOGIT_BIAS_TOKENS} logit_bias entries (the cap)", {"logit_bias": {str(i): -1 for i in
                                                                              range(MAX_LOGIT_BIAS_TOKENS)}},
     "bounded", ()),
    (f"prompt logprobs past {MAX_PROMPT_LOGPROB_ENTRIES} entries",
     {"prompt": [5] * (MAX_PROMPT_LOGPROB_ENTRIES // 6 + 1), "echo": True, "logprobs": 5, "max_tokens": 0},
     "refused", ("prompt logprobs", str(MAX_PROMPT_LOGPROB_ENTRIES))),
    ("echo with 20 prompt logprobs a token, nothing generated",
     {"echo": True, "logprobs": 5, "prompt_logprobs": 20, "max_tokens": 0}, "bounded", ()),
)


def judge_redos(reply: Reply, expect: str, names: tuple[str, ...]) -> tuple[bool, str | None]:
    """(detected, violation or None) for one attacker request."""
    # the per-token budget ("exceeded the stop-check budget of 50 ms per token") or the mean one
    # ("the stop checks ... cost 6.8 ms per token ..., over the limit of 5 ms per token on average")
    budget = reply.code == "invalid_request" and ("stop-check budget" in reply.message or (
        "stop checks" in reply.message and "per token on average" in reply.message))
    if reply.ended != "answered":
        return False, f"{reply.show()}: no answer (a hang is what redos must never cause)"
    if reply.status >= 500:
        return False, f"{reply.show()}: a server error, not a refusal"
    if expect == "refused":
        if reply.status == 400 and all(n in reply.message for n in names):
            return True, None
        return False, f"{reply.show()}: expected HTTP 400 naming {' and '.join(names)}"
    if budget or reply.completed:
        return (budget if expect == "budget" else True), None
    return False, f"{reply.show()}: expected the stop-check budget's error or a completion"


class Redos(HostileAttack):
    """Sends every REDOS request in turn (two at a time), pass after pass, until halted."""

    name = "redos"

    def __init__(self, cluster: ChaosCluster, key: str, model: str) -> None:
        super().__init__(cluster, key, model)
        self.replies: list[tuple[Reply, str, tuple[str, ...]]] = []

    async def attack(self) -> None:
        sem = asyncio.Semaphore(2)

        async def one(what: str, extra: dict[str, Any], expect: str, names: tuple[str, ...]) -> None:
            body = {"model": self.model, "prompt": PROMPT, "max_tokens": 96, "temperature": 0, "ignore_eos": True,
                    **extra}
            async with sem:
                out = await request(self.url, self.key, "/v1/completions", body, Reply(what), REQUEST_TIMEOUT_S)
            self.replies.append((out, expect, names))
        passes = 0
        while passes == 0 or not self.halt.is_set():
            batch = asyncio.gather(*(one(*a) for a in REDOS))
            self.launched.set()
            await batch
            passes += 1

    def judge(self, res: ScenarioResult, peaks: Peaks) -> None:
        res.faults_injected = len(self.replies)
        seen: Counter[str] = Counter()
        examples: dict[str, str] = {}
        for reply, expect, names in self.replies:
            detected, violation = judge_redos(reply, expect, names)
            res.faults_detected += detected
            res.faults_tolerated += not detected and violation is None    # a catastrophic one that completed
            if violation is not None:
                res.violations.append(violation)
            seen[f"{reply.what}: {_redos_end(reply)}"] += 1
            examples.setdefault(f"{reply.what}: {_redos_end(reply)}", reply.message[:130])
            res.other_texts.append(reply.text)
        res.notes.append(f"attacker ({len(self.replies)} requests, {len(REDOS)} kinds): "
                         + "; ".join(f"{s} x{n}" for s, n in sorted(seen.items())))
        res.notes.append("the attacker was told: " + "; ".join(f"{kind}: {msg!r}" for kind, msg in
                                                               sorted(examples.items()) if msg))


def _redos_end(r: Reply) -> str:
    """How a redos request ended, in a word or three."""
    if r.completed:
        return "completed"
    if r.code == "invalid_request" and "stop-check budget" in r.message:
        return "budget (per token)"
    if r.code == "invalid_request" and "per token on average" in r.message:
        return "budget (mean)"
    if r.ended == "answered" and r.status == 400:
        return "400"
    return r.show()


class KvHog(HostileAttack):
    """`tenant_max_concurrency` + EXTRA streamed chat requests at once, with a long prompt and
    no max_tokens (ignore_eos: each would run to the context's end).  The flood is hung up when
    the other tenants' requests are done."""

    name = "kv_hog"
    EXTRA = 16

    def __init__(self, cluster: ChaosCluster, key: str, model: str) -> None:
        super().__init__(cluster, key, model)
        self.replies: list[Reply] = []
        self.flood = int(gateway_setting(cluster, "tenant_max_concurrency") or 64) + self.EXTRA

    async def attack(self) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": " ".join([PROMPT] * 3)}],
                "stream": True, "temperature": 0, "ignore_eos": True}
        self.replies = [Reply("hog") for _ in range(self.flood)]
        tasks = [asyncio.create_task(request(self.url, self.key, "/v1/chat/completions", body, r, 600.0))
                 for r in self.replies]
        loop = asyncio.get_running_loop()
        until = loop.time() + 30
        while self.sampler.tenant("running") < 1 and loop.time() < until:
            await asyncio.sleep(0.1)
        self.launched.set()
        await self.halt.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def judge(self, res: ScenarioResult, peaks: Peaks) -> None:
        res.faults_injected = len(self.replies)
        ends = Counter(_end(r) for r in self.replies)
        refused = sum(n for end, n in ends.items() if end.startswith("429"))
        res.faults_detected = min(res.faults_injected, refused + int(peaks.queued))
        # the rest ran within the tenant's limits (at most its running peak): tolerated
        res.faults_tolerated = min(res.faults_injected - res.faults_detected, int(peaks.running))
        res.other_texts += [r.text for r in self.replies]
        res.notes.append(f"hog: {self.flood} chat requests without max_tokens; at most {peaks.running:.0f} running, "
                         f"{peaks.queued:.0f} queued, {peaks.kv_reserved:.0f} KV tokens reserved of its budget "
                         f"{peaks.kv_budget:.0f} ({peaks.samples} samples of /metrics); ends: "
                         + ", ".join(f"{n} {e}" for e, n in ends.most_common()))
        if peaks.samples == 0:
            res.violations.append("kv_hog: /metrics was never read: nothing to judge the hog by")
        elif peaks.kv_budget and peaks.kv_reserved > peaks.kv_budget:
            res.violations.append(f"kv_hog: the hog held {peaks.kv_reserved:.0f} KV tokens, over its budget of "
                                  f"{peaks.kv_budget:.0f}")
        elif not refused and not peaks.queued:
            res.violations.append("kv_hog: the flood was neither queued nor refused: no limit held it")
        bad = [r for r in self.replies if _end(r) not in ("completed", "hung up", "429 tenant_limit",
                                                          "429 kv_budget_in_use", "429 queue_full",
                                                          "503 queue_timeout")]
        for r in bad[:5]:
            res.violations.append(f"kv_hog: a hog request ended otherwise than completed, limited or hung up by "
                                  f"us: {r.show()}")


def _end(r: Reply) -> str:
    if r.ended != "answered":
        return r.ended if r.ended in ("hung up", "timeout") else "broken"
    if r.completed:
        return "completed"
    return f"{r.status} {r.code}" if r.status != 200 else f"error event {r.code}"
