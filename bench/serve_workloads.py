"""The prefix workloads of bench.serve, as token ids (sent on /v1/completions, so every prompt
has exactly the stated length):

- shared-prefix: `num_prefixes` system prompts of `prefix_len` tokens; request i is system prompt
  i mod num_prefixes (round robin) plus a unique question of `question_len` tokens.
- multi-turn: conversations whose first turn is an opening message of `prefix_len` tokens; each
  later turn resends the whole history (every earlier prompt and answer) plus a new question of
  `question_len` tokens.

Every answer is forced to `output_len` tokens.  Also here: how large a worker's KV pool must be to
keep a given number of prefixes cached besides its running requests (bench.serve --prefix-compare)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from bench.serve_prompts import PromptMaker
from engine.config import EngineConfig
from engine.options import default_of

PAGE_SIZE: int = default_of(EngineConfig, "page_size")   # tandem serve's KV page: the unit the prefix cache keeps

# (flag default, --quick default) of each workload flag
DEFAULTS = {"num_prefixes": (16, 4), "prefix_len": (1024, 64), "question_len": (64, 16), "output_len": (64, 8),
            "requests": (256, 16), "conversations": (64, 4), "turns": (4, 3), "concurrency": ("8", "4")}


def pages(tokens: int, page_size: int = PAGE_SIZE) -> int:
    return -(-tokens // page_size)


def _positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"{name}={v} must be >= 1")


@dataclass(frozen=True)
class SharedPrefix:
    num_prefixes: int = 16
    prefix_len: int = 1024
    question_len: int = 64
    output_len: int = 64
    requests: int = 256
    concurrency: int = 8

    def __post_init__(self) -> None:
        _positive(num_prefixes=self.num_prefixes, prefix_len=self.prefix_len, question_len=self.question_len,
                  output_len=self.output_len, requests=self.requests, concurrency=self.concurrency)

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + self.question_len

    @property
    def request_tokens(self) -> int:
        return self.prompt_len + self.output_len

    def prompts(self, maker: PromptMaker) -> list[list[int]]:
        """`requests` prompts of exactly `prompt_len` ids; prefixes drawn round robin."""
        prefixes = [maker.make_ids(self.prefix_len, "system prompt") for _ in range(self.num_prefixes)]
        return [prefixes[i % self.num_prefixes] + maker.make_ids(self.question_len, "question")
                for i in range(self.requests)]

    def kv_cache_tokens(self, held_prefixes: int, running: int, page_size: int = PAGE_SIZE) -> int:
        """The KV pool (tokens) of a worker that keeps `held_prefixes` prefixes cached besides
        `running` requests of its own.  A held prefix counts one whole request's pages: a finished
        request's pages enter the cache, so a cached prefix keeps the question and answer of the
        last request that used it beside it.  A running request whose prefix is cached holds only
        its own pages past the prefix's full pages (a miss publishes its prompt pages at the
        transfer's commit: it becomes one of the held prefixes)."""
        request = pages(self.request_tokens, page_size)
        own = request - self.prefix_len // page_size
        return (held_prefixes * request + running * own) * page_size

    def compare_pools(self, decode_workers: int = 2, held: int | None = None,
                      page_size: int = PAGE_SIZE) -> dict[str, int]:
        """KV pools of --prefix-compare: with one decode worker, every prefix; with `decode_workers`,
        `held` of them (default: their share, about half with two, so placement matters) — each
        besides all `concurrency` running requests
        (prefix routing may load one worker past its share).  Checked by simulating the pool's LRU
        under both routings: more room lets load routing keep most prefixes too, less lets an
        uneven moment evict prefixes the prefix-routed worker needs next."""
        return {"one_decode_worker": self.kv_cache_tokens(self.num_prefixes, self.concurrency, page_size),
                "per_decode_worker": self.kv_cache_tokens(held or math.ceil(self.num_prefixes / decode_workers),
                                                          self.concurrency, page_size)}


@dataclass(frozen=True)
class MultiTurn:
    conversations: int = 64
    turns: int = 4
    prefix_len: int = 1024       # the opening message
    question_len: int = 64       # each later user message
    output_len: int = 64
    concurrency: int = 8

    def __post_init__(self) -> None:
        _positive(conversations=self.conversations, turns=self.turns, prefix_len=self.prefix_len,
                  question_len=self.question_len, output_len=self.output_len, concurrency=self.concurrency)

    @property
    def requests(self) -> int:
        return self.conversations * self.turns

    def prompt_len(self, turn: int) -> int:
        """Tokens of turn `turn`'s prompt (0-based): the history and the new message."""
        return self.prefix_len + turn * (self.output_len + self.question_len)

    @property
    def request_tokens(self) -> int:
        """The longest request: the last turn's prompt and its answer."""
        return self.prompt_len(self.turns - 1) + self.output_len

    def messages(self, maker: PromptMaker) -> list[list[list[int]]]:
        """Per conversation, the new user tokens of each turn (the opening message first)."""
        return [[maker.make_ids(self.prefix_len, "conversation")] +
                [maker.make_ids(self.question_len, "question") for _ in range(self.turns - 1)]
                for _ in range(self.conversations)]


def add_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("prefix workloads (--workload shared-prefix|multi-turn, --prefix-compare)")
    for name, help_ in (("num_prefixes", "distinct system prompts (shared-prefix)"),
                        ("prefix_len", "tokens of each system prompt / opening message"),
                        ("question_len", "tokens of each request's own question / later user message"),
                        ("output_len", "tokens of every answer"),
                        ("requests", "requests per concurrency level (shared-prefix)"),
                        ("conversations", "conversations per concurrency level (multi-turn)"),
                        ("turns", "turns of each conversation (multi-turn)")):
        full, quick = DEFAULTS[name]
        g.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"{help_} (default {full}; "
                       f"--quick: {quick})")
    g.add_argument("--held-prefixes", type=int, default=None, help="--prefix-compare: how many prefixes each of "
                   "the two decode workers' KV pools holds besides the running requests (default: half of "
                   "--num-prefixes)")
    g.add_argument("--quick", action="store_true", help="a tiny version of the workload (every default above "
                   "and --concurrency take their --quick value): to see it work, not to measure")


def resolve(args: argparse.Namespace) -> None:
    """Fills the workload flags left unset with their defaults (--quick: the tiny ones)."""
    for name, (full, quick) in DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, quick if args.quick else full)


def shared_prefix(args: argparse.Namespace, concurrency: int) -> SharedPrefix:
    return SharedPrefix(args.num_prefixes, args.prefix_len, args.question_len, args.output_len, args.requests,
                        concurrency)


def multi_turn(args: argparse.Namespace, concurrency: int) -> MultiTurn:
    return MultiTurn(args.conversations, args.turns, args.prefix_len, args.question_len, args.output_len,
                     concurrency)
