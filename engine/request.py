"""One request's state inside the engine, and what `generate` returns for it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine.guide import Guide
from engine.params import SamplingParams
from engine.prompt_entry import PromptLogprob
from engine.stop import StopChecker


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    prompt: str | None = None
    handoff: bool = False                      # prefilled for another worker: ends after its first
                                               # token, pages kept for the push (EngineCore)
    status: Status = Status.WAITING
    num_computed: int = 0                      # tokens whose K/V are in the cache
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # params.prompt_logprobs: the entries of prompt tokens 1.. (engine/prompt_logprobs.py), as computed
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stopper: StopChecker | None = None         # stop conditions and the output text (not on hand-off)
    guide: Guide | None = None                 # its grammar (params.constraint): masks its tokens;
                                               # advanced by `stopper.append` (its stopper holds it)
    cache_salt: bytes = b""                    # the salt of its prefix-cache keys (engine/prefix_cache.py)
    num_cached_tokens: int = 0                 # prompt tokens found in the prefix cache at admission
    resumed: int = 0                           # a migrated request: the last `resumed` of
                                               # prompt_token_ids were generated before, elsewhere
                                               # (`EngineCore.make_request`)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """The client's prompt (a migrated request's KV also covers its `resumed` tokens)."""
        return len(self.prompt_token_ids) - self.resumed

    @property
    def num_completion_tokens(self) -> int:
        """Every token generated for the client: before a migration and here."""
        return self.resumed + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus every token it may generate: the KV it can ever need."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def reserved_tokens(self) -> int:
        """The KV this pool reserves for it: the prompt alone for a hand-off, else all of it."""
        return len(self.prompt_token_ids) if self.handoff else self.max_total_tokens

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_token_ids)

    @property
    def under_min_tokens(self) -> bool:
        return len(self.output_token_ids) < self.params.min_tokens

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str
    prompt_logprobs: list[PromptLogprob] | None = None   # asked for: the entries of prompt tokens 1..
    matched_stop: str | int | None = None      # the stop string, regex pattern or token id
    num_cached_tokens: int = 0                 # prompt tokens served from the prefix cache
