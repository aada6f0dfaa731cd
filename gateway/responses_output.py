"""The output items of one Responses answer, built from what the choice's reader made final
(gateway/reader.py `take`: reasoning, content, tool-call deltas), in the order the model wrote
them: a reasoning item, a message, function calls.  Each change is also the stream events
OpenAI documents for it (without their sequence_number, which the stream adds):

    response.output_item.added  {item}                  an item opens (empty)
    response.content_part.added {part}                  reasoning and message items: their one part
    response.reasoning_text.delta | response.output_text.delta | response.function_call_arguments.delta
    response.reasoning_text.done  | response.output_text.done  | response.function_call_arguments.done
    response.content_part.done  {part}
    response.output_item.done   {item}                  the item, whole, when the next one opens or at the end

The same builder makes the non-streamed answer, fed the whole output at once."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.tools import Text

Event = dict[str, Any]          # one stream event, before its sequence_number
REASONING, MESSAGE, CALL = "reasoning", "message", "function_call"
ID_PREFIX = {REASONING: "rs", MESSAGE: "msg", CALL: "fc"}
DELTA = {REASONING: "response.reasoning_text.delta", MESSAGE: "response.output_text.delta",
         CALL: "response.function_call_arguments.delta"}


@dataclass
class Item:
    """One output item: its kind, id, place in `output`, text (reasoning, message text or call
    arguments) and, for a function call, its call id and name."""
    kind: str
    index: int
    call_id: str = ""
    name: str = ""
    text: Text = field(default_factory=Text)
    status: str = "in_progress"
    id: str = ""

    def __post_init__(self) -> None:
        self.id = f"{ID_PREFIX[self.kind]}_{uuid.uuid4().hex}"

    def part(self, text: str) -> dict[str, Any]:
        if self.kind == REASONING:
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def body(self) -> dict[str, Any]:
        """The item as `output` holds it (while it is open: empty)."""
        done = self.status != "in_progress"
        text = str(self.text) if done else ""
        if self.kind == CALL:
            return {"type": CALL, "id": self.id, "call_id": self.call_id, "name": self.name, "arguments": text,
                    "status": self.status}
        content = [self.part(text)] if done else []
        if self.kind == REASONING:
            return {"type": REASONING, "id": self.id, "summary": [], "content": content, "status": self.status}
        return {"type": MESSAGE, "id": self.id, "role": "assistant", "status": self.status, "content": content}

    def where(self) -> dict[str, Any]:
        """The fields an event about this item names it by."""
        out: dict[str, Any] = {"item_id": self.id, "output_index": self.index}
        if self.kind != CALL:
            out["content_index"] = 0
        return out


class OutputItems:
    """The items of one answer: `feed` each reader delta (or {"content": text} for a choice
    read as plain text), `close` once at the end; each returns the stream events it made."""

    def __init__(self) -> None:
        self.items: list[Item] = []
        self._calls: dict[int, Item] = {}       # the reader's call index -> its item

    @property
    def open(self) -> Item | None:
        last = self.items[-1] if self.items else None
        return last if last is not None and last.status == "in_progress" else None

    def feed(self, delta: dict[str, Any]) -> list[Event]:
        """The events of one delta.  Within a delta the growing call's arguments come first
        (they were written before anything new), then reasoning, content and new calls."""
        events: list[Event] = []
        calls = delta.get("tool_calls", ())
        for entry in calls:
            if "id" not in entry:
                events += self._grow(self._calls[entry["index"]], entry["function"]["arguments"])
        if delta.get("reasoning_content"):
            events += self._text(REASONING, delta["reasoning_content"])
        if delta.get("content"):
            events += self._text(MESSAGE, delta["content"])
        for entry in calls:
            if "id" in entry:
                fn = entry["function"]
                events += self._done("completed")
                item = self._calls[entry["index"]] = self._open(CALL, call_id=entry["id"], name=fn["name"])
                events += [{"type": "response.output_item.added", "output_index": item.index, "item": item.body()}]
                events += self._grow(item, fn["arguments"])
        return events

    def close(self, status: str = "completed") -> list[Event]:
        """The last item's done events, with `status` (an answer cut by max_output_tokens:
        "incomplete"); an answer that wrote nothing gets an empty message."""
        events = self._text(MESSAGE, "") if not self.items else []
        return events + self._done(status)

    def cut(self) -> None:
        """The open item ends "incomplete", without events (the stream ends with a failure)."""
        if (item := self.open) is not None:
            item.status = "incomplete"

    def output(self) -> list[dict[str, Any]]:
        return [i.body() for i in self.items]

    def text_of(self, kind: str) -> str:
        return "".join(str(i.text) for i in self.items if i.kind == kind)

    def _text(self, kind: str, piece: str) -> list[Event]:
        events: list[Event] = []
        item = self.open
        if item is None or item.kind != kind:
            events += self._done("completed")
            item = self._open(kind)
            events += [{"type": "response.output_item.added", "output_index": item.index, "item": item.body()},
                       {"type": "response.content_part.added", **item.where(), "part": item.part("")}]
        return events + self._grow(item, piece)

    def _open(self, kind: str, call_id: str = "", name: str = "") -> Item:
        item = Item(kind, len(self.items), call_id, name)
        self.items.append(item)
        return item

    def _grow(self, item: Item, piece: str) -> list[Event]:
        if not piece:
            return []
        item.text += piece
        event: Event = {"type": DELTA[item.kind], **item.where(), "delta": piece}
        if item.kind == MESSAGE:
            event["logprobs"] = []
        return [event]

    def _done(self, status: str) -> list[Event]:
        item = self.open
        if item is None:
            return []
        item.status = status
        text, where = str(item.text), item.where()
        if item.kind == CALL:
            events: list[Event] = [{"type": "response.function_call_arguments.done", **where, "arguments": text}]
        else:
            kind = "response.reasoning_text.done" if item.kind == REASONING else "response.output_text.done"
            events = [{"type": kind, **where, "text": text}]
            if item.kind == MESSAGE:
                events[0]["logprobs"] = []
            events.append({"type": "response.content_part.done", **where, "part": item.part(text)})
        return events + [{"type": "response.output_item.done", "output_index": item.index, "item": item.body()}]
