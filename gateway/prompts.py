"""Turning prompts into token ids without stalling the gateway: a cheap bound that refuses a
prompt obviously longer than the context from its byte length alone, and an encoder that
releases the GIL (so the event loop keeps serving while a long prompt is tokenised in one of
the gateway's preparation threads).

The byte bound.  Let L be the most UTF-8 bytes any one token's text can stand for (the
longest token of the vocabulary, special tokens included; a byte-level token that is part
of a character decodes to U+FFFD, 3 bytes, which only overstates L).  A byte-level BPE
tokenizer keeps every input byte and each token covers a contiguous run of them, so a text
of B bytes gives at least B / L tokens.  A Unicode normalizer runs first and may shrink the
text, at most 4x (NFKC maps a 4-byte mathematical letter to 1 ASCII byte; NFC composes 3
Hangul jamo, 9 bytes, into a 3-byte syllable), so with one the bound is B / 4L.  So a prompt
of more than `context x L` (x4 with a normalizer) bytes cannot fit, and is refused before it
is tokenised.  Any other tokenizer (a pre-tokenizer that drops whitespace, an unknown token
that fuses a run of characters, a normalizer that replaces text) has no such bound: for it
the check is off and the body limit alone caps the prompt.  The bound holds for the text
encodings too (`encode_plain`, `encode_chat`: the same model over pieces of the text, each
token still covering at most L of its bytes).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from engine.chat_tokens import ControlTokens, RenderedChat, Span, encode_rendered
from engine.tokenizer import Tokenizer

log = logging.getLogger("tandem.gateway")
UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
NORMALIZER_SHRINK = 4          # the most a Unicode normalization form shrinks a text (see above)
KEEPS_BYTES = {"ByteLevel", "Digits"}
KEEPING_SPLITS = {"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"}


class PromptTooLong(ValueError):
    """A prompt refused from its byte length: more bytes than the context can hold."""


class PromptEncoder:
    """Encodes text as `Tokenizer.encode`, `encode_plain` and `encode_rendered` do (no special
    tokens added), releasing the GIL while it works (`encode_batch` runs outside it);
    `check(text, context)` raises PromptTooLong for a text that cannot fit in `context` tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        # an independent copy of the engine tokenizer's backend (tokenizer.json, or the one built
        # from a TikToken checkpoint's tiktoken.model), so the gateway reads any checkpoint it does
        spec_text = tokenizer.backend.to_str()
        self._tok = HFTokenizer.from_str(spec_text)
        self.control = ControlTokens(self._tok)
        spec = json.loads(spec_text)
        self.max_token_bytes = max(len(tokenizer.decode([i], skip_special_tokens=False).encode())
                                   for i in range(self._tok.get_vocab_size(with_added_tokens=True)))
        self.bytes_per_token = byte_bound(spec, self.max_token_bytes)
        if self.bytes_per_token is None:
            log.info("this tokenizer has no byte-length bound: prompts are capped by the body limit only")

    def encode(self, text: str) -> list[int]:
        """`text` as the tokenizer reads it: an added token's text is its control id."""
        ids: list[int] = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """`text` read as text: no control id from it (`Tokenizer.encode_plain`; ValueError)."""
        return self.control.encode_plain([text])[0]

    def encode_chat(self, rendered: RenderedChat) -> list[int]:
        """A rendered conversation's ids, client text as text (`Tokenizer.encode_rendered`)."""
        return encode_rendered(rendered, self._with_offsets, self.control)

    def _with_offsets(self, text: str) -> tuple[list[int], list[Span]]:
        enc = self._tok.encode_batch([text], add_special_tokens=False)[0]
        return enc.ids, enc.offsets

    def check(self, text: str, context: int, what: str = "prompt") -> None:
        """Raises PromptTooLong naming the limit when `text` has more bytes than `context`
        tokens can stand for; a cheap test (no tokenising), never wrong the other way."""
        if self.bytes_per_token is None:
            return
        limit = context * self.bytes_per_token
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise PromptTooLong(f"the {what} is {size} bytes: more than this model's context length of {context} "
                                f"tokens can hold (at most {self.bytes_per_token} bytes per token, so "
                                f"{limit} bytes)")


def byte_bound(spec: dict[str, Any], max_token_bytes: int) -> int | None:
    """The most bytes of input one token can account for, after normalization, given the
    tokenizer's JSON spec; None when the tokenizer may drop or fuse input (no bound)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") and not model.get("byte_fallback")):
        return None
    if not all(_keeps_bytes(p) for p in _parts(spec.get("pre_tokenizer"))):
        return None
    normalizers = _parts(spec.get("normalizer"))
    if not all(n.get("type") in UNICODE_FORMS for n in normalizers):
        return None
    return max_token_bytes * (NORMALIZER_SHRINK if normalizers else 1)


def _parts(step: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A tokenizer step as a flat list (a Sequence is unrolled; none is an empty list)."""
    if step is None:
        return []
    if step.get("type") == "Sequence":
        inner = step.get("pretokenizers", step.get("normalizers", []))
        return [p for s in inner for p in _parts(s)]
    return [step]


def _keeps_bytes(step: dict[str, Any]) -> bool:
    if step.get("type") == "Split":
        return step.get("behavior") in KEEPING_SPLITS
    return step.get("type") in KEEPS_BYTES
