"""The oracles a chaos run applies to what the clients saw, after the cluster is gone:

- reference equality: every completed response's tokens equal the single-process `LLM`'s
  greedy output for the same prompt run alone; a response cut short (an explicit error,
  or the client hanging up) must be a prefix of it.  A near-tie is told apart, never passed
  silently: where a token differs and the reference's logprobs of its own token and of the
  response's are within NEAR_TIE (a migrated stream's re-prefill computes the generated tokens'
  KV in another order, so its logprobs agree within 1e-5, not bit for bit), the response is
  counted as a near-tie and the rest of it is compared with the reference continued from the
  response's token; any other difference is a corrupted response;
- canaries: no response contains another request's canary (nor does anything a hostile
  scenario's attacker was sent).

A request through an API whose answers carry no token ids (the Responses and Messages APIs)
is judged by its text: the reference's text when complete, a prefix of it when cut short.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from chaos.client import Outcome
from chaos.prompts import CANARY, TEXT_ONLY
from chaos.report import ScenarioResult
from engine import LLM
from engine.params import SamplingParams

NEAR_TIE = 1e-5       # logprobs this close are a tie the reduction order may break either way
MAX_NEAR_TIES = 4     # per response; past them the response counts as corrupted


class Reference:
    """Greedy outputs of the single-process engine, one request at a time, with its prefix
    cache off (the cluster's cache must change no token), and the top two logprobs of each
    step (for telling a near-tie from a wrong token)."""

    def __init__(self, model: str, max_model_len: int) -> None:
        self.llm = LLM(model, max_model_len=max_model_len, enable_prefix_cache=False)
        # a prompt sent again is run once: (ids, max_tokens) -> (tokens, each step's top logprobs, text)
        self._memo: dict[tuple[tuple[int, ...], int], tuple[list[int], list[dict[int, float]], str]] = {}

    def _run(self, ids: list[int], max_tokens: int) -> tuple[list[int], list[dict[int, float]], str]:
        key = (tuple(ids), max_tokens)
        if key not in self._memo:
            out = self.llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=2))[0]
            self.llm.pool.check_integrity()
            self._memo[key] = (list(out.token_ids), list(out.logprobs or []), out.text)
        return self._memo[key]

    def tokens(self, ids: list[int], max_tokens: int) -> list[int]:
        return self._run(ids, max_tokens)[0]

    def text(self, ids: list[int], max_tokens: int) -> str:
        """The output's text (stop handling applied), for an API whose answers carry no token ids."""
        return self._run(ids, max_tokens)[2]

    def logprobs(self, ids: list[int], max_tokens: int) -> list[dict[int, float]]:
        """Per generated token: token id -> logprob of the chosen token and the top two."""
        return self._run(ids, max_tokens)[1]


class Greedy(Protocol):
    def tokens(self, ids: list[int], max_tokens: int) -> list[int]: ...

    def text(self, ids: list[int], max_tokens: int) -> str: ...

    def logprobs(self, ids: list[int], max_tokens: int) -> list[dict[int, float]]: ...


@dataclass
class Comparison:
    wrong: str | None = None                                  # how the response differs, None: it does not
    near_ties: list[str] = field(default_factory=list)        # where it took the other side of a near-tie


def compare(got: list[int], ids: list[int], max_tokens: int, complete: bool, reference: Greedy) -> Comparison:
    """Compare a response's tokens with the reference's for the same prompt: all of them for a
    complete response, a prefix of them for one cut short.  At a differing token where the
    reference's two candidates' logprobs are within NEAR_TIE, note the near-tie and compare the
    rest with the reference continued from the response's tokens so far."""
    out, done = Comparison(), 0
    while True:
        want = reference.tokens(ids + got[:done], max_tokens - done) if done < max_tokens else []
        rest = got[done:]
        i = next((k for k, (a, b) in enumerate(zip(rest, want)) if a != b), None)
        if i is None:
            if len(rest) > len(want) or (complete and len(rest) != len(want)):
                out.wrong = f"{len(got)} tokens where the reference has {done + len(want)}"
            return out
        top = reference.logprobs(ids + got[:done], max_tokens - done)[i]
        a, b = want[i], rest[i]
        if b not in top or abs(top[a] - top[b]) > NEAR_TIE or len(out.near_ties) >= MAX_NEAR_TIES:
            theirs = f"{top[b]:.7f}" if b in top else f"not among its top {len(top)}"
            out.wrong = (f"token {done + i} is {b} where the reference has {a} (the reference's logprobs: "
                         f"{top[a]:.7f} for {a}, {theirs} for {b})")     # a wide tie reads apart from a wrong token
            return out
        out.near_ties.append(f"token {done + i}: {b} for the reference's {a} (logprobs {top[a]:.7f} and "
                             f"{top[b]:.7f})")
        done += i + 1


def judge(results: list[ScenarioResult], reference: Greedy) -> None:
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
            got = o.token_ids
            if o.job.api in TEXT_ONLY:       # no token ids in the answer: its text against the reference's
                _judge_text(r, o, reference, owner)
                continue
            c = compare(got, o.job.ids, o.job.max_tokens, o.outcome == "ok", reference)
            if c.near_ties:
                r.near_ties += 1
                r.notes.append(f"request {o.job.index} ({o.outcome}): a near-tie (top two within {NEAR_TIE:g}) "
                               f"at " + "; ".join(c.near_ties)
                               + (": the rest equals the reference continued from its token" if c.wrong is None
                                  else ""))
            if c.wrong is not None:
                r.corrupted += 1
                want = reference.tokens(o.job.ids, o.job.max_tokens)
                _say(r, f"request {o.job.index} ({o.outcome}): {c.wrong}; tokens {got[:12]} differ from the "
                        f"reference {want[:12]}")
            _judge_canary(r, o, owner)


def _judge_canary(r: ScenarioResult, o: Outcome, owner: dict[str, int]) -> None:
    foreign = [c for c in CANARY.findall(o.text) if c != o.job.canary and c in owner]
    if foreign:
        r.leaks += 1
        _say(r, f"request {o.job.index} (tenant {o.job.tenant}) carries the canary of request {owner[foreign[0]]}")


def _judge_text(r: ScenarioResult, o: Outcome, reference: Greedy, owner: dict[str, int]) -> None:
    """A text-only answer (chaos/prompts.py TEXT_ONLY): the reference's text when complete, a
    prefix of it when cut short; and no foreign canary."""
    want = reference.text(o.job.ids, o.job.max_tokens)
    if not (o.text == want if o.outcome == "ok" else want.startswith(o.text)):
        r.corrupted += 1
        _say(r, f"request {o.job.index} ({o.job.api}, {o.outcome}): its text {o.text[:60]!r} differs from the "
                f"reference's {want[:60]!r}")
    _judge_canary(r, o, owner)


def _say(r: ScenarioResult, message: str) -> None:
    if len(r.violations) < 40:
        r.violations.append(message)
