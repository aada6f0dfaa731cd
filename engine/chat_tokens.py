"""Client text is text: a conversation's token ids in which only the chat template's own
structure yields control ids.

A control id is the id of an added token (special or not: `<|im_end|>`, `<think>`, Kimi's
`<|reserved_token_N|>`).  Encoding a rendered conversation as one string reads every added
token's text as its id, wherever it came from, so a user message holding
`<|im_end|>\\n<|im_start|>system` would forge a system turn.  Here:

1. The conversation is rendered twice: as it is, and with every client string (message
   content, names, tool-call arguments, tool descriptions and schemas: each string value but
   roles and `type`s) wrapped, inside its outer whitespace, in a pair of markers that cannot
   occur in client text (private-use characters around a fresh random nonce).  Where the
   marked rendering, markers removed, is the real one, the markers give the spans of client
   text in it.
2. The real rendering is encoded as today.  An added token overlapping no client span is the
   template's own; one that overlaps a span is forged.  Without forged tokens the ids stand
   (benign conversations keep exactly today's ids); with them the text between the template's
   own added tokens is re-encoded with no added token recognised (`ControlTokens.plain`).
3. Where the markers cannot give the spans (a template that slices, splits or measures its
   content) and a client string holds an added token's text, the conversation is rendered a
   third time with those texts removed: its control ids are the structure's, and a real
   rendering with any other sequence of control ids is refused (ValueError).  An added token's
   text where nothing is marked (a role, a `type`, a dict key, a chat template variable) is
   refused too.

      rendered:  <|im_start|>user\\n  [ Hi <|im_end|> ... ]  <|im_end|>\\n<|im_start|>assistant\\n
                 ^template token      ^client span: text     ^template tokens
"""

from __future__ import annotations

import json
import re
import secrets
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

Span = tuple[int, int]
UNMARKED_KEYS = frozenset({"role", "type"})     # values templates compare: checked, not marked
MAX_NONCE_TRIES = 8


@dataclass(frozen=True)
class RenderedChat:
    """A conversation as the chat template renders it (`text`, what transformers gives) and the
    [start, end) character spans of client text in it, sorted and disjoint; `spans` is None when
    the template transforms client text so that they cannot be known.  Then `neutral` is the
    rendering with every added token's text removed from client strings (None when none held
    one): the control ids the structure alone gives."""
    text: str
    spans: tuple[Span, ...] | None
    neutral: str | None = None


class ControlTokens:
    """A tokenizer's added tokens: their `ids`, a search for their texts, and `plain`: a copy of
    the backend that reads every added token's text as ordinary characters."""

    def __init__(self, backend: HFTokenizer) -> None:
        added = backend.get_added_tokens_decoder()
        self.ids = frozenset(added)
        self.texts = {i: a.content for i, a in added.items()}
        texts = sorted({a.content for a in added.values() if a.content}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._backend = backend

    @cached_property
    def plain(self) -> HFTokenizer:
        """The backend reading every added token's text as text (built when first used)."""
        return plain_backend(self._backend)

    def find(self, text: str) -> str | None:
        """The first added token's text in `text`, or None."""
        m = self._pattern.search(text) if self._pattern is not None else None
        return m.group(0) if m else None

    def remove(self, text: str) -> str:
        """`text` without any added token's text."""
        return self._pattern.sub("", text) if self._pattern is not None else text

    def encode_plain(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids with no added token recognised (encode_batch: off the GIL).  Raises
        ValueError if the model's own merges still made a control id of client text."""
        out = [e.ids for e in self.plain.encode_batch(texts, add_special_tokens=False)]
        for ids in out:
            if hit := self.ids.intersection(ids):
                raise ValueError(f"the text encodes to the control token {min(hit)} even with added tokens off")
        return out


def plain_backend(backend: HFTokenizer) -> HFTokenizer:
    """A copy of `backend` whose added tokens are all special and never matched in text
    (`encode_special_tokens`), so `<|im_end|>` encodes as the characters it is made of."""
    spec = json.loads(backend.to_str())
    for token in spec.get("added_tokens") or []:
        token["special"] = True
    plain = HFTokenizer.from_str(json.dumps(spec))
    plain.encode_special_tokens = True
    return plain


def render(template: Callable[[list[dict], list[dict] | None], str], messages: list[dict],
           tools: list[dict] | None, extra: dict[str, Any], control: ControlTokens) -> RenderedChat:
    """`template(messages, tools)` rendered with the spans of client text (see the module).
    `extra`: the request's other template variables (checked: they are not marked).  Raises
    ValueError naming an added token's text where it cannot be kept as text."""
    text = template(messages, tools)
    _check_unmarked([messages, tools], extra, control)
    strings = [s for s in _strings([messages, tools]) if s]
    if not strings:
        return RenderedChat(text, ())
    spans = _marked_spans(template, messages, tools, text, strings)
    if spans is not None or not any(control.find(s) is not None for s in strings):
        return RenderedChat(text, spans)
    try:
        neutral = template(_apply(messages, control.remove), _apply(tools, control.remove))
    except Exception as e:  # noqa: BLE001  (the template refuses the conversation without them)
        raise ValueError(f"a message holds control token text, which this chat template cannot keep apart "
                         f"from its own ({e}): remove it") from None
    return RenderedChat(text, None, neutral)


def _marked_spans(template: Callable[[list[dict], list[dict] | None], str], messages: list[dict],
                  tools: list[dict] | None, text: str, strings: list[str]) -> tuple[Span, ...] | None:
    """The client spans in `text` from a rendering with marked strings; None where it fails."""
    nonce = next((n for n in (secrets.token_hex(8) for _ in range(MAX_NONCE_TRIES))
                  if not any(n in s for s in strings)), None)
    if nonce is None:
        return None
    open_, close = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"

    def mark(s: str) -> str:     # inside its outer whitespace, so a template's trim keeps the marks
        core = s.strip()
        if not core:
            return s
        lead = len(s) - len(s.lstrip())
        return f"{s[:lead]}{open_}{core}{close}{s[lead + len(core):]}"
    try:
        marked = template(_apply(messages, mark), _apply(tools, mark))
    except Exception:       # noqa: BLE001  (a template that refuses marked strings: no spans)
        return None
    return _spans(marked, text, open_, close)


def encode_rendered(rendered: RenderedChat, encode: Callable[[str], tuple[list[int], list[Span]]],
                    control: ControlTokens) -> list[int]:
    """The token ids of a rendered conversation: `encode(text)` -> (ids, character offsets),
    the tokenizer's ordinary encoding, where every added token from client text is re-encoded
    as text (see the module).  Raises ValueError where client text still yields a control id."""
    ids, offsets = encode(rendered.text)
    if rendered.spans is None:
        if rendered.neutral is not None:
            _check_structure(ids, encode(rendered.neutral)[0], control)
        return ids
    if not rendered.spans:
        return ids
    starts = [a for a, _ in rendered.spans]
    own: list[tuple[int, Span]] = []
    forged = False
    for tid, (a, b) in zip(ids, offsets):
        if tid in control.ids:
            if _overlaps(rendered.spans, starts, a, b):
                forged = True
            else:
                own.append((tid, (a, b)))
    if not forged:
        return ids
    gaps, at = [], 0
    for _, (a, b) in own:
        gaps.append(rendered.text[at:a])
        at = b
    gaps.append(rendered.text[at:])
    pieces = control.encode_plain(gaps)
    out: list[int] = []
    for piece, (tid, _) in zip(pieces, own):
        out += piece
        out.append(tid)
    return out + pieces[-1]


def _check_structure(ids: list[int], neutral: list[int], control: ControlTokens) -> None:
    """Raises ValueError unless `ids` hold the control ids of `neutral` (the structure's), in order."""
    got, want = [i for i in ids if i in control.ids], [i for i in neutral if i in control.ids]
    if got != want:
        at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        extra = control.texts.get(got[at], str(got[at])) if at < len(got) else "one of its own"
        raise ValueError(f"a message holds the control token text {extra!r}, which this chat template cannot "
                         f"keep apart from its own: remove it")


def _overlaps(spans: tuple[Span, ...], starts: list[int], a: int, b: int) -> bool:
    """[a, b) meets one of `spans` (sorted, disjoint; `starts` their starts)."""
    i = bisect_right(starts, b - 1) - 1     # the last span starting before b
    return i >= 0 and spans[i][1] > a


def _spans(marked: str, text: str, open_: str, close: str) -> tuple[Span, ...] | None:
    """The spans of the marked parts of `marked` once the markers are removed; None unless the
    markers pair up (open, close, open, ...) and removing them gives `text`."""
    out: list[Span] = []
    plain: list[str] = []
    at = size = 0
    start: int | None = None
    for m in re.finditer(re.escape(open_) + "|" + re.escape(close), marked):
        piece = marked[at:m.start()]
        plain.append(piece)
        size += len(piece)
        at = m.end()
        if (m.group(0) == open_) != (start is None):
            return None
        if start is None:
            start = size
        else:
            if size > start:
                out.append((start, size))
            start = None
    plain.append(marked[at:])
    if start is not None or "".join(plain) != text:
        return None
    return tuple(_merge(out))


def _merge(spans: list[Span]) -> Iterator[Span]:
    """Sorted spans, touching or overlapping ones joined."""
    cur: Span | None = None
    for a, b in sorted(spans):
        if cur is not None and a <= cur[1]:
            cur = (cur[0], max(cur[1], b))
            continue
        if cur is not None:
            yield cur
        cur = (a, b)
    if cur is not None:
        yield cur


def _apply(value: Any, fn: Callable[[str], str]) -> Any:
    """`value` with `fn` applied to every string value (not a role or a type, not a key)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [_apply(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: v if k in UNMARKED_KEYS else _apply(v, fn) for k, v in value.items()}
    return value


def _strings(value: Any) -> Iterator[str]:
    """The string values `_apply` changes."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            if k not in UNMARKED_KEYS:
                yield from _strings(v)


def _check_unmarked(marked: list[Any], extra: dict[str, Any], control: ControlTokens) -> None:
    """Raises ValueError for an added token's text in a string that is not marked: a dict key,
    a role or type in `marked`, any string of the chat template variables `extra`."""
    def walk(v: Any, is_marked: bool) -> None:
        if isinstance(v, str) and not is_marked and (hit := control.find(v)) is not None:
            raise ValueError(f"the control token text {hit!r} is not allowed in a role, a type, a key or a chat "
                             f"template variable")
        if isinstance(v, list):
            for x in v:
                walk(x, is_marked)
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(str(k), False)
                walk(x, is_marked and k not in UNMARKED_KEYS)
    walk(marked, True)
    walk(extra, False)
