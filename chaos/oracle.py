"""The oracles a chaos run applies to what the clients saw, after the cluster is gone:

- reference equality: every completed response's tokens equal the single-process `LLM`'s
  greedy output for the same prompt run alone; a response cut short (an explicit error,
  or the client hanging up) must be a prefix of it;
- canaries: no response contains another request's canary (nor does anything a hostile
  scenario's attacker was sent).
"""

from __future__ import annotations

from chaos.prompts import CANARY
from chaos.report import ScenarioResult
from engine import LLM
from engine.params import SamplingParams


class Reference:
    """Greedy outputs of the single-process engine, one request at a time, with its prefix
    cache off (the cluster's cache must change no token)."""

    def __init__(self, model: str, max_model_len: int) -> None:
        self.llm = LLM(model, max_model_len=max_model_len, enable_prefix_cache=False)
        self._memo: dict[tuple[tuple[int, ...], int], list[int]] = {}   # a prompt sent again is run once

    def tokens(self, ids: list[int], max_tokens: int) -> list[int]:
        key = (tuple(ids), max_tokens)
        if key not in self._memo:
            out = self.llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0))[0]
            self.llm.pool.check_integrity()
            self._memo[key] = list(out.token_ids)
        return self._memo[key]


def judge(results: list[ScenarioResult], reference: Reference) -> None:
    """Count corrupted responses and canary leaks into each scenario's result."""
    owner = {o.job.canary: o.job.index for r in results for o in r.outcomes}
    for r in results:
        for text in r.other_texts:          # an attacker's responses: no request's canary may be there
            foreign = [c for c in CANARY.findall(text) if c in owner]
            if foreign:
                r.leaks += 1
                _say(r, f"the attacker was sent the canary of request {owner[foreign[0]]}")
        for o in r.outcomes:
            if o.job.expect_reject or not (o.token_ids or o.text):
                continue
            want = reference.tokens(o.job.ids, o.job.max_tokens)
            got = o.token_ids
            if (got != want) if o.outcome == "ok" else (got != want[:len(got)]):
                r.corrupted += 1
                _say(r, f"request {o.job.index} ({o.outcome}): tokens {got[:12]} differ from the "
                        f"reference {want[:12]}")
            foreign = [c for c in CANARY.findall(o.text) if c != o.job.canary and c in owner]
            if foreign:
                r.leaks += 1
                _say(r, f"request {o.job.index} (tenant {o.job.tenant}) carries the canary of request "
                        f"{owner[foreign[0]]}")


def _say(r: ScenarioResult, message: str) -> None:
    if len(r.violations) < 40:
        r.violations.append(message)
