"""No silent drops: what the gateway does with each field of a request body it was sent.

- a field of OpenAI's API, or one of `VENDOR_EXTENSIONS`, is honoured (gateway/protocol.py
  declares them);
- a field OpenAI, vLLM or SGLang define that Tandem cannot honour (`UNHONOURED`) is refused
  with 400 naming it, unless its value is a neutral one (what leaving it out means);
- a field OpenAI defines that changes nothing in a completion (`NO_EFFECT`) is accepted;
- any other field is ignored: logged (`IgnoredFields`, a warning the first time a name is
  seen) and named in the response's `X-Tandem-Ignored-Fields` header (`header_value`)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

log = logging.getLogger("tandem.gateway")
IGNORED_HEADER = "X-Tandem-Ignored-Fields"
MAX_WARNED_FIELDS = 1024             # ignored names remembered as warned about (the latest seen)

# The extensions to OpenAI's request bodies that Tandem honours: field -> whose and what it does.
VENDOR_EXTENSIONS: dict[str, str] = {
    "top_k": "vLLM/SGLang: sample among the k most likely tokens (-1: off)",
    "min_tokens": "vLLM/SGLang: no stop before this many tokens",
    "stop_token_ids": "vLLM/SGLang: token ids that end the output",
    "stop_regex": "SGLang: regular expressions that end the output",
    "no_stop_trim": "SGLang: keep the matched stop text in the output",
    "ignore_eos": "vLLM/SGLang: generate past the end-of-sequence token",
    "return_token_ids": "vLLM: each choice and chunk also carries its token ids",
    "cache_salt": "vLLM: salts the prefix cache, so only requests with the same salt share pages",
    "chat_template_kwargs": "vLLM/SGLang: extra variables for the chat template (e.g. enable_thinking)",
    "stream_options.continuous_usage_stats": "vLLM: usage in every stream chunk",
    "response_format (on /v1/completions)": "vLLM/SGLang: json_object and json_schema for text completions",
    "structured_outputs": "vLLM: {json | regex | choice | grammar | json_object: true}, one of them",
    "guided_json": "vLLM (older spelling of structured_outputs.json): a JSON schema",
    "guided_regex": "vLLM (older): a regular expression the whole output matches",
    "guided_choice": "vLLM (older): the output is exactly one of these strings",
    "guided_grammar": "vLLM (older): a Lark (llguidance) or GBNF grammar",
    "json_schema": "SGLang: a JSON schema (as text or an object)",
    "regex": "SGLang: a regular expression the whole output matches",
    "ebnf": "SGLang: a GBNF grammar",
    "prompt_logprobs (on /v1/completions)": "vLLM: each prompt token's logprob and its top N alternatives",
}
# Fields defined by OpenAI, vLLM or SGLang that Tandem cannot honour: sent with any value but
# the neutral ones listed (what leaving them out means), they are refused with 400 naming them.
UNHONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((None, []), "functions (deprecated by OpenAI) is not supported: send tools"),
    "function_call": ((None, "none"), "function_call (deprecated by OpenAI) is not supported: send tool_choice"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), 'modalities other than ["text"] are not supported'),
    "prediction": ((None,), "prediction (predicted outputs) is not supported"),
    "web_search_options": ((None,), "web_search_options is not supported: this server does not search the web"),
    "store": ((None, False), "store=true is not supported: this server keeps no completions"),
    "service_tier": ((None, "auto", "default"), "service_tier other than auto or default is not supported"),
    "verbosity": ((None, "medium"), "verbosity other than medium is not supported"),
    "min_p": ((None, 0), "min_p is not supported (send 0 or leave it out)"),
    "repetition_penalty": ((None, 1), "repetition_penalty is not supported (send 1 or leave it out)"),
    "length_penalty": ((None, 1), "length_penalty is not supported"),
    "use_beam_search": ((None, False), "use_beam_search is not supported"),
    "include_stop_str_in_output": ((None, False), "include_stop_str_in_output is not supported: send "
                                   "no_stop_trim=true"),
    "skip_special_tokens": ((None, True), "skip_special_tokens=false is not supported"),
    "spaces_between_special_tokens": ((None, True), "spaces_between_special_tokens=false is not supported"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported: send a choice, regex or grammar"),
    "bad_words": ((None, []), "bad_words is not supported"),
    "truncate_prompt_tokens": ((None,), "truncate_prompt_tokens is not supported"),
    "logits_processors": ((None, []), "logits_processors is not supported"),
    "custom_logit_processor": ((None,), "custom_logit_processor is not supported"),
    "echo": ((None, False), "echo is supported on /v1/completions only"),
    "add_generation_prompt": ((None, True), "add_generation_prompt=false is not supported"),
    "continue_final_message": ((None, False), "continue_final_message is not supported"),
    "chat_template": ((None,), "chat_template is not supported: the checkpoint's template is used"),
    "documents": ((None,), "documents is not supported"),
    "guided_whitespace_pattern": ((None,), "guided_whitespace_pattern is not supported"),
    "structural_tag": ((None,), "structural_tag is not supported"),
    "return_tokens_as_token_ids": ((None, False), "return_tokens_as_token_ids is not supported: send "
                                   "return_token_ids=true"),
    "lora_path": ((None,), "LoRA adapters are not supported"),
}
# Fields OpenAI defines that change nothing in a completion (identifiers, cache routing hints,
# stored-completion metadata): accepted without a word.
NO_EFFECT = frozenset({"metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"})
# Fields of an OpenAI chat message that the template does not render and that carry nothing
# when empty (an assistant message echoed back as the client received it).
MESSAGE_NO_EFFECT = {"refusal": (None, ""), "annotations": (None, []), "audio": (None,),
                     "function_call": (None,)}
MAX_IGNORED_NAMED = 16               # fields listed in the header; the rest are counted
MAX_IGNORED_NAME_CHARS = 64


def neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """`value` is one of `neutral` (a bool equals only a bool: true is not the number 1)."""
    for n in neutral:
        if value is None or n is None:
            if value is n:
                return True
        elif isinstance(value, bool) or isinstance(n, bool):
            if type(value) is type(n) and value == n:
                return True
        elif value == n:
            return True
    return False


def header_value(names: list[str]) -> str:
    """The X-Tandem-Ignored-Fields header: distinct names in order, printable ASCII, at most
    MAX_IGNORED_NAMED of them (then how many more)."""
    distinct = list(dict.fromkeys(names))
    shown = ["".join(c if " " < c < "\x7f" and c != "," else "?" for c in n[:MAX_IGNORED_NAME_CHARS])
             for n in distinct[:MAX_IGNORED_NAMED]]
    more = len(distinct) - len(shown)
    return ", ".join(shown) + (f", (+{more} more)" if more else "")


class IgnoredFields:
    """Logs the fields requests sent that were ignored: a warning when a request names one not
    seen lately, debug otherwise.  It remembers the MAX_WARNED_FIELDS names seen last (an LRU),
    each cut to MAX_IGNORED_NAME_CHARS, and of one request only the MAX_IGNORED_NAMED its header
    shows: no request can hold memory here, nor turn the warnings off for later ones."""

    def __init__(self) -> None:
        self._warned: OrderedDict[str, None] = OrderedDict()

    def report(self, names: list[str]) -> str:
        """Log `names`; returns the header value ("" : none)."""
        if not names:
            return ""
        value = header_value(names)
        shown = [n[:MAX_IGNORED_NAME_CHARS] for n in list(dict.fromkeys(names))[:MAX_IGNORED_NAMED]]
        new = [n for n in shown if n not in self._warned]
        for n in shown:
            self._warned[n] = None
            self._warned.move_to_end(n)
        while len(self._warned) > MAX_WARNED_FIELDS:
            self._warned.popitem(last=False)
        if new:
            log.warning("request fields ignored (defined neither by OpenAI nor by the extensions Tandem "
                        "accepts): %s", value)
        else:
            log.debug("request fields ignored: %s", value)
        return value
