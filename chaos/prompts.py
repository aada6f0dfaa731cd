"""The requests of a chaos run: token-id prompts of held-out text, each opened by a unique
canary string, spread over several tenants, with what the client will do with each.

Prompts go to /v1/completions as token ids, so the reference run sees exactly the ids the
cluster saw.  The canary is text the shipped model can repeat: a response that contains
another request's canary is a leak.
"""

from __future__ import annotations

import random
import re
import secrets
from dataclasses import dataclass, replace
from typing import Any

from engine import corpus
from engine.tokenizer import Tokenizer

TENANTS = ("acme", "globex", "initech", "umbrella")
ATTACKER = "umbrella"           # the hostile scenarios' attacker; the other tenants are its victims
VICTIMS = tuple(t for t in TENANTS if t != ATTACKER)
CANARY = re.compile(r"canary [0-9a-f]{10}")
# the APIs a request may come through (chaos/client.py speaks each): token-id completions, the same
# with the prompt echoed and its logprobs computed on the prefill side (issue 37), and three
# chat-shaped ones whose one user message is the prompt's text
APIS = ("completions", "echo", "chat", "responses", "messages")
TEXT_ONLY = ("responses", "messages")   # their answers carry no token ids: judged by text


@dataclass
class Job:
    index: int
    scenario: str
    tenant: str
    canary: str
    ids: list[int]
    max_tokens: int
    stream: bool = True
    disconnect_after: int | None = None     # stream chunks to read before hanging up
    disconnect_s: float | None = None       # or seconds after sending
    expect_reject: bool = False             # an oversized prompt: must get HTTP 400
    cache_salt: str | None = None           # the request's cache_salt (vLLM's field)
    usage: bool = False                     # ask for usage on a stream too (its cached_tokens)
    wave: int = 0                           # sent once the scenario's driver opens this wave (0: at once)
    api: str = "completions"                # one of APIS
    text: str | None = None                 # a chat-shaped API's user message (`ids` its templated ids)


class PromptMaker:
    def __init__(self, tokenizer: Tokenizer, seed: int):
        _, held = corpus.read_split()
        self.tok = tokenizer
        self.text_ids = tokenizer.encode("\n".join(held))
        self.rng = random.Random(seed)
        self.n = 0

    def keys(self) -> dict[str, str]:
        """API key -> tenant, fresh for this run."""
        return {f"chaos-{t}-{secrets.token_hex(8)}": t for t in TENANTS}

    def job(self, scenario: str, length: int, max_tokens: int, **kw: Any) -> Job:
        """A request whose prompt is exactly `length` token ids, canary first."""
        self.n += 1
        canary = f"canary {self.rng.getrandbits(40):010x}"
        head = self.tok.encode(f"# {canary}\n")[:length]
        body = max(0, length - len(head))
        ids = head
        while len(ids) < length:
            start = self.rng.randrange(0, len(self.text_ids) - body - 1)
            ids = ids + self.text_ids[start:start + length - len(ids)]
        return Job(self.n, scenario, TENANTS[self.n % len(TENANTS)], canary, ids, max_tokens, **kw)

    def text(self, length: int) -> list[int]:
        """`length` token ids of held-out text from a random place (no canary)."""
        start = self.rng.randrange(0, len(self.text_ids) - length - 1)
        return self.text_ids[start:start + length]

    def for_api(self, job: Job, api: str) -> Job:
        """`job` sent through `api`: a chat-shaped one sends its prompt's text (canary first) as the
        one user message, and `ids` become that conversation's ids as the gateway renders them."""
        if api not in APIS:
            raise ValueError(f"unknown api {api!r}: one of {APIS}")
        if api in ("completions", "echo"):
            return replace(job, api=api)
        text = self.tok.decode(job.ids)
        return replace(job, api=api, text=text, ids=self.tok.encode_chat([{"role": "user", "content": text}]))

    def again(self, job: Job) -> Job:
        """The same request (prompt, canary, tenant, behaviour) under a new index."""
        self.n += 1
        return replace(job, index=self.n)
