"""One choice of a request, the gateway's one home of its state: its prompt and sampling
parameters, what it has produced so far (text, token ids, logprobs, the reader that parses its
reasoning and tool calls), how it ended (its Finish: stop state and usage), and what its
attempts and migrations keep across worker pairs (the first stream's seed and cached prompt
tokens, the migration count, the workers that said they are leaving).

The planner (gateway/planner.py) makes the choices; the attempts (gateway/attempt.py) record
what the decode workers stream into them; the response (gateway/openai_format.py,
gateway/streaming.py) reads them.  Token ids are kept here only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.params import SamplingParams
from gateway.cache_view import PrefixKeys
from proto import worker_pb2 as wpb

if TYPE_CHECKING:
    from gateway.reader import ChoiceReader


@dataclass(frozen=True)
class Prompt:
    """What the workers get of a request's prompt besides its tokens: its cache salt (the
    request's `cache_salt`, "" for none) and its page keys for prefix routing (None: route by
    load alone).  The n choices of one prompt share it."""
    cache_salt: str = ""
    keys: PrefixKeys | None = None


@dataclass
class Choice:
    """One choice to generate, and everything generated for it so far."""
    index: int                          # in the response
    prompt_ids: list[int]               # the original prompt
    params: SamplingParams              # the client's
    prompt: Prompt = Prompt()
    prompt_group: int = 0               # which prompt of the request (its n choices share one)
    # a chat choice whose output is read for reasoning and tool calls (gateway/reader.py); None:
    # its text is the message's content
    reader: ChoiceReader | None = None
    # what the client has been sent (or will be): one list of token ids, whichever worker made them
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[wpb.TokenLogprobs] = field(default_factory=list)
    # /v1/completions' echo: the prompt's text, sent before the completion (None: no echo)
    echo: str | None = None
    # params.prompt_logprobs: the prompt tokens' entries, from the prefill worker's reply (or a
    # colocated worker's stream), kept across attempts: a migrated choice does not ask again
    prompt_logprobs: list[wpb.PromptLogprob] | None = None
    finish: wpb.Finish | None = None    # the stop state and usage, once it ended
    # across attempts and migrations
    seed: int | None = None             # the seed of the reservation whose stream gave the first token
    cached_tokens: int | None = None    # that reservation's cached prompt tokens (the choice's usage)
    attempts: int = 0                   # Generate calls made (each gets its own request id)
    migrations: int = 0                 # streams continued on another worker pair
    broken_on: str | None = None        # the decode worker its stream last broke on
    leaving: set[str] = field(default_factory=set)   # workers that said DRAINING (or UNAVAILABLE): not again

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def need_tokens(self) -> int:
        """KV tokens a decode worker reserves for it: prompt + max_tokens, migrated or not."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def awaits_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and has not got them yet."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    def attempt_params(self) -> SamplingParams:
        """Its params for its next attempt: without prompt logprobs once an earlier attempt
        brought them (a migration computes only what it must)."""
        p = self.params
        if p.prompt_logprobs is None or self.awaits_prompt_logprobs or p.prefill_only:
            return p
        return replace(p, prompt_logprobs=None)

    def keep_prompt_logprobs(self, entries: wpb.PromptLogprobs) -> None:
        """The prompt logprobs one attempt's prefill computed (the first that came are kept)."""
        if self.awaits_prompt_logprobs:
            self.prompt_logprobs = list(entries.logprobs)

    def keep_reservation(self, reservation: wpb.Reservation) -> None:
        """The reservation whose stream gives the first token: its seed (a migrated choice
        continues that sampler) and its cached prompt tokens (the choice's usage) are kept."""
        if self.seed is None:
            self.seed = reservation.seed
            self.cached_tokens = min(reservation.cached_tokens, len(self.prompt_ids))

    def add(self, tokens: wpb.Tokens) -> None:
        """A Tokens message of its stream: text, token ids and logprobs, read by its reader."""
        self.text += tokens.text
        self.token_ids += tokens.token_ids
        self.logprobs += tokens.logprobs
        if self.reader is not None:
            self.reader.feed(tokens.text, tokens.token_ids)

    def end(self, finish: wpb.Finish) -> None:
        """Its stream's Finish; a migrated choice's usage counts the first stream's cached
        prompt tokens (the later ones re-prefilled what that one had)."""
        if self.migrations and self.cached_tokens is not None:
            finish.cached_tokens = self.cached_tokens
        self.finish = finish

    @property
    def finish_reason(self) -> str | None:
        """The Finish's reason; "tool_calls" for a choice that stopped having made calls."""
        reason = self.finish.finish_reason if self.finish else None
        return self.reader.finish_reason(reason) if self.reader is not None else reason

    @property
    def matched_stop(self) -> str | int | None:
        """The stop string or regex that ended the choice, or the stop token's id (None: none)."""
        f = self.finish
        if f is None:
            return None
        matched: str | int | None = f.matched_token_id if f.matched_token else (f.matched_stop or None)
        return matched
