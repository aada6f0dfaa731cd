"""The chaos client through every API (chaos/prompts.py APIS) against a gateway with real
prefill and decode workers, judged by the run's oracles: token-id completions, echo (the
prompt's logprobs from the prefill side), chat, the Responses and the Messages APIs, streamed
and not, each equal to the single-process engine's greedy output for the ids it renders."""

from __future__ import annotations

import asyncio

import pytest

from chaos.client import Outcome, send
from chaos.oracle import Reference, judge
from chaos.prompts import APIS, PromptMaker
from chaos.report import ScenarioResult
from engine.config import SHIPPED_MODEL
from engine.tokenizer import Tokenizer
from tests.gateway_helpers import API_KEY, gateway_cluster
from tests.workers import config


@pytest.fixture(scope="module")
def cluster():
    with gateway_cluster(config(), config()) as c:
        yield c


def test_every_api_gives_the_reference_output(cluster):
    maker = PromptMaker(Tokenizer(SHIPPED_MODEL), seed=5)
    jobs = [maker.for_api(maker.job("apis", 24 + 7 * i, 6, stream=i % 2 == 0), api)
            for i, api in enumerate(APIS * 2)]

    async def all_of() -> list[Outcome]:
        return list(await asyncio.gather(*(send(cluster[0].url, API_KEY, "tiny-moe", Outcome(j), 60) for j in jobs)))
    outs = asyncio.run(all_of())
    assert [o.outcome for o in outs] == ["ok"] * len(jobs), [(o.job.api, o.outcome, o.error) for o in outs]
    for o in outs:
        assert o.text and (o.token_ids or o.job.api in ("responses", "messages"))
        if o.job.api == "echo":        # the prompt came back first (its canary opens it)
            assert o.text.startswith(maker.tok.decode(o.job.ids)) and o.job.canary in o.text
    r = ScenarioResult("apis", "hostile", "", outcomes=outs)
    judge([r], Reference(str(SHIPPED_MODEL), 2048))
    assert (r.corrupted, r.leaks, r.violations) == (0, 0, [])
