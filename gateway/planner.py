"""A completion request turned into choices, before any worker is contacted: the cheap checks
on the event loop (404/400 naming the field), the fields it ignored (named back), its prompts
tokenized and checked against the context and the decode workers' KV capacity, and one
`Choice` (gateway/choice.py) per choice with its sampling parameters, reader and prefix-routing
keys.  `CompletionHandler` (gateway/completions.py) serves the choices."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jinja2

from engine.constraint import Constraint
from engine.errors import RequestError
from engine.validate import check_prompt_logprobs
from gateway.admission import InvalidField, Rejected
from gateway.cache_view import PrefixKeys
from gateway.chat import chat_prompt
from gateway.choice import Choice, Prompt
from gateway.errors import shown
from gateway.fields import IgnoredFields
from gateway.prompts import PromptTooLong
from gateway.protocol import REASONING_EFFORTS, ChatCompletionRequest, CompletionRequest, sampling_params
from gateway.reader import choice_reader
from gateway.structured import ignored_fields as structured_ignored
from gateway.tool_choice import check_tools

if TYPE_CHECKING:
    from gateway.app import Gateway

DEFAULT_COMPLETION_TOKENS = 16      # OpenAI's default for /v1/completions
MAX_TEMPLATE_MESSAGE = 400          # of a chat template's refusal, as the client sees it
Body = ChatCompletionRequest | CompletionRequest


class RequestPlanner:
    """A request's checks, ignored fields, prompts and choices: everything done before
    admission, with no worker contacted (`CompletionHandler` serves them)."""

    def __init__(self, gw: Gateway):
        self.gw = gw                  # the Gateway: config, tokenizer, pool, queue, metrics
        self.ignored_log = IgnoredFields()

    def check(self, body: Body) -> None:
        """The cheap checks, on the event loop: model, options, integer ranges.  Raises
        Rejected (404, 400 naming the field)."""
        gw = self.gw
        if body.model != gw.config.served_model_name:
            raise Rejected("model_not_found", f"the model {shown(body.model)} does not exist; this server "
                           f"serves {gw.config.served_model_name!r}")
        if (bad := body.out_of_range(gw.vocab_size)) is not None:
            raise InvalidField(bad[0], bad[1])
        self._check_counts(body)
        if (why := body.unsupported()) is not None:
            raise Rejected("unsupported", why)
        if isinstance(body, ChatCompletionRequest):
            check_tools(body, gw.output_settings)

    def ignored(self, body: Body) -> str:
        """The request's ignored fields (gateway/fields.py), logged and counted, as the header's
        value ("" : none)."""
        names = list(dict.fromkeys(body.ignored_fields() + structured_ignored(body) + self._unread(body)))
        if names:
            self.gw.metrics.ignored_fields.inc()
        return self.ignored_log.report(names)

    def _unread(self, body: Body) -> list[str]:
        """Fields that only the chat template acts on, sent to a model whose template does not
        read them (gpt-oss's reads reasoning_effort; the shipped model's does not)."""
        if isinstance(body, ChatCompletionRequest) and body.reasoning_effort in REASONING_EFFORTS \
                and "reasoning_effort" not in (self.gw.tokenizer.chat_template or ""):
            return ["reasoning_effort"]
        return []

    def _check_counts(self, body: Body) -> None:
        """How many messages or prompts the request carries, before any is templated or
        tokenized (a 4 MiB body holds some 100,000 short ones)."""
        cfg = self.gw.config
        if isinstance(body, ChatCompletionRequest):
            if len(body.messages) > cfg.max_messages:
                raise InvalidField("messages", f"the request has {len(body.messages)} messages; at most "
                                   f"{cfg.max_messages} are allowed")
            return
        p = body.prompt
        count = 1 if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)) else len(p)
        if count * body.n > cfg.max_n:
            raise Rejected("too_many_choices", f"{count} prompt(s) x n={body.n} choices exceeds "
                           f"the limit of {cfg.max_n} per request")

    def prompts(self, body: Body, context: int) -> list[list[int]]:
        """Token ids of each prompt; raises Rejected 400 for a prompt that cannot be tokenized,
        a conversation the chat template refuses (its message), or a prompt that is, from its
        length in bytes or tokens, longer than `context`."""
        try:
            return self._prompts(body, context)
        except PromptTooLong as e:
            raise Rejected("context_length", str(e)) from None
        except (TypeError, ValueError, UnicodeError) as e:
            raise Rejected("invalid_request", f"the prompt cannot be tokenized: {e}") from None
        except jinja2.TemplateSyntaxError:
            raise                   # the template itself is broken: the server's fault (500, logged)
        except jinja2.TemplateError as e:   # its raise_exception (roles must alternate, ...) or a missing key
            raise Rejected("invalid_request", f"the chat template refused the conversation: "
                           f"{str(e)[:MAX_TEMPLATE_MESSAGE]}") from None

    def _prompts(self, body: Body, context: int) -> list[list[int]]:
        tok, enc = self.gw.tokenizer, self.gw.encoder
        if isinstance(body, ChatCompletionRequest):
            rendered = chat_prompt(tok, body)
            enc.check(rendered.text, context, "conversation")
            return [enc.encode_chat(rendered)]
        p = body.prompt
        items: list[str | list[int]]
        if isinstance(p, str):
            items = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [[x for x in p if isinstance(x, int)]]
        else:
            items = [x for x in p if not isinstance(x, int)]
        out = []
        text = enc.encode if self.gw.config.prompt_special_tokens else enc.encode_plain
        for x in items:
            if isinstance(x, str):
                enc.check(x, context)
                out.append(text(x))
            else:
                out.append(list(x))         # its length is checked with max_tokens (_max_tokens)
        return out

    def choices(self, body: Body, context: int, capacity: int, tenant: str = "default",
                page_sizes: frozenset[int] = frozenset(), constraint: Constraint | None = None) -> list[Choice]:
        """Tokenizes the prompts, builds each choice's sampling parameters (compiling its stop
        patterns; `constraint`: the request's structured output, already compiled) and, for
        prefix routing, each prompt's page keys for `page_sizes`: the expensive part, run on a
        preparation thread.  Raises Rejected (400) naming what is wrong; contacts no worker."""
        gw = self.gw
        prompts = self.prompts(body, context)
        if not prompts or len(prompts) * body.n > gw.config.max_n:
            raise Rejected("too_many_choices", f"{len(prompts)} prompt(s) x n={body.n} choices exceeds "
                           f"the limit of {gw.config.max_n} per request")
        choices: list[Choice] = []
        echoes = self._echoes(body, prompts)
        for group, ids in enumerate(prompts):
            self._check_ids(ids)
            try:
                check_prompt_logprobs(len(ids), body.prompt_logprobs_n)
            except RequestError as e:
                raise InvalidField("prompt_logprobs" if isinstance(body, CompletionRequest) and body.prompt_logprobs
                                   is not None else "logprobs", str(e)) from None
            max_tokens = self._max_tokens(body, len(ids), context, capacity)
            prompt = self._prompt(body, tenant, ids, page_sizes)
            for j in range(body.n):
                seed = body.seed + j if body.seed is not None else None
                try:
                    params = sampling_params(body, max_tokens, seed, constraint)
                except ValueError as e:
                    raise Rejected("invalid_request", str(e)) from None
                # one fresh reader per choice: its reasoning, content and tool calls (gateway/reader.py)
                reader = choice_reader(gw.output_settings, body) if isinstance(body, ChatCompletionRequest) \
                    else None
                choices.append(Choice(len(choices), ids, params, prompt, prompt_group=group, reader=reader,
                                      echo=echoes[group]))
        return choices

    def _echoes(self, body: Body, prompts: list[list[int]]) -> list[str | None]:
        """Each prompt's text as /v1/completions' echo returns it (a text prompt as sent, token
        ids decoded); None for each without echo."""
        if not isinstance(body, CompletionRequest) or not body.echo:
            return [None] * len(prompts)
        p = body.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, str) for x in p):
            return [x for x in p if isinstance(x, str)]
        return [self.gw.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]

    def _prompt(self, body: Body, tenant: str, ids: list[int], page_sizes: frozenset[int]) -> Prompt:
        """The prompt's cache salt, and its page keys when routing follows the workers' caches."""
        cfg = self.gw.config
        salt = body.cache_salt or ""
        if cfg.routing != "prefix":
            return Prompt(salt)
        keys = PrefixKeys(cfg.cluster_secret, tenant, salt, ids)
        for size in page_sizes:
            keys.get(size)            # computed here, off the event loop
        return Prompt(salt, keys)

    def _check_ids(self, ids: list[int]) -> None:
        vocab = self.gw.vocab_size
        if not ids:
            raise Rejected("invalid_request", "the prompt is empty")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise Rejected("invalid_request", f"prompt token {bad} is not in the vocabulary (0..{vocab - 1})")

    def _max_tokens(self, body: Body, prompt: int, context: int, capacity: int) -> int:
        limit = min(context, capacity)
        wanted = body.wanted_max_tokens
        if wanted is None:
            wanted = self.gw.config.default_max_tokens if isinstance(body, ChatCompletionRequest) \
                else DEFAULT_COMPLETION_TOKENS
            wanted = max(1, min(wanted, limit - prompt))
        total = prompt + wanted
        if total > context:
            raise Rejected("context_length", f"prompt_tokens ({prompt}) + max_tokens ({wanted}) = {total} "
                           f"exceeds this model's context length of {context} tokens")
        if total > capacity:
            raise Rejected("kv_capacity", f"prompt_tokens ({prompt}) + max_tokens ({wanted}) = {total} "
                           f"exceeds the KV capacity of every decode worker (largest: {capacity} tokens)")
        return wanted
