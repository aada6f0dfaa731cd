"""Reasoning in a chat's output: the `<think>…</think>` section of Qwen3, GLM-4.5 and
DeepSeek-R1 style models, and gpt-oss's Harmony channels, split from the answer into
`reasoning_content`, streaming too.

Both are stages like gateway/tools.py's: fed the output text piece by piece, they write the
reasoning into `Output.reasoning` and pass the rest on to the next stage (tool calls or plain
content), holding back text that may still become a marker.

- think: a section opened by `<think>` at the start of the output (after whitespace), or by
  the prompt itself when the chat template ends the generation prompt with `<think>`
  (`inside=True`), closed by `</think>`.  An output that does not open one is all content; one
  that never closes it (cut by max_tokens) is all reasoning.
- harmony (gpt-oss; facts from the Harmony format's description): messages
  `<|channel|>C [to=R] [<|constrain|>json]<|message|>BODY` ended by `<|end|>`, `<|call|>` or
  `<|return|>` (the next one after `<|start|>assistant`).  Channel "analysis" is reasoning,
  "final" the answer, "commentary" addressed `to=functions.N` a call of N with BODY as its
  arguments when BODY is a JSON object (other commentary is content).
"""

from __future__ import annotations

import re
from typing import Protocol

from gateway.tool_parsers import call_arguments
from gateway.tools import ContentSink, Output, Text, ToolCall, call_id, held_suffix

REASONING_PARSERS = ("think", "harmony")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HARMONY_MESSAGE = "<|message|>"
HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
HARMONY_FINAL = "<|channel|>final<|message|>"     # what ends reasoning (a constraint's `after`)
MAX_HEADER_CHARS = 1024      # a longer "header" is not Harmony: the model wrote text, read as content
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>",
                   "<|return|>")
CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class Stage(Protocol):
    def feed(self, text: str) -> None: ...

    def finish(self) -> None: ...


class ThinkSplitter:
    """`<think>…</think>` at the start of the output into `out.reasoning`; the rest to `then`."""

    def __init__(self, out: Output, then: Stage, inside: bool = False) -> None:
        self.out, self.then = out, then
        self.state = "reasoning" if inside else "start"
        self.buf = ""
        self.blank = True                 # buf holds only whitespace so far (state "start")

    def feed(self, text: str) -> None:
        if self.state == "start" and self.blank and (not text or text.isspace()):
            self.buf += text              # a run of whitespace before anything: no rescan of it
            return
        self.blank = False
        self.buf += text
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(THINK_OPEN):
                self.buf, self.state = head[len(THINK_OPEN):], "reasoning"
            elif not head or THINK_OPEN.startswith(head):
                return                                    # may still open a section
            else:
                self.state = "content"
        if self.state == "reasoning":
            i = self.buf.find(THINK_CLOSE)
            if i < 0:
                keep = held_suffix(self.buf, [THINK_CLOSE])
                self.out.reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return
            self.out.reasoning += self.buf[:i]
            self.buf, self.state = self.buf[i + len(THINK_CLOSE):], "content"
        self.then.feed(self.buf)
        self.buf = ""

    def finish(self) -> None:
        if self.state == "reasoning":
            self.out.reasoning += self.buf
        else:
            self.then.feed(self.buf)
        self.buf = ""
        self.then.finish()


class ReasoningSink:
    """A stage whose text is reasoning (Harmony's asides beside a constrained answer)."""

    def __init__(self, out: Output) -> None:
        self.out = out

    def feed(self, text: str) -> None:
        self.out.reasoning += text

    def finish(self) -> None:
        pass


class HarmonySplitter:
    """Harmony messages by channel: analysis into `out.reasoning`, calls to functions into
    `out.calls` (when `calls`; else their text is content), the rest to `then`.  A call is
    added when its message ends, if its body is a strict JSON object (else the body is content).

    With `aside` (the grammar constrains the final channel alone: a named or required
    tool_choice, or a response_format) only the final channel's text goes to `then`; what the
    model writes before it outside the analysis channel (gpt-oss's commentary preambles) goes to
    the "content" (beside a call) or to the "reasoning" (beside a constrained answer), never
    into the call or the constrained answer."""

    def __init__(self, out: Output, then: Stage, calls: bool, aside: str | None = None) -> None:
        self.out, self.then, self.calls = out, then, calls
        sinks: dict[str | None, Stage] = {"content": ContentSink(out), "reasoning": ReasoningSink(out), None: then}
        self.aside = sinks[aside]
        self.final_only = aside is not None
        self.buf, self.kind = "", "header"                # header | reasoning | answer | aside | call
        self.seen_message = False
        self.call: tuple[str, list[str]] | None = None    # the open call message: name, body pieces

    def feed(self, text: str) -> None:
        self.buf += text
        while self.buf:
            if self.kind == "header":
                i = self.buf.find(HARMONY_MESSAGE)
                if i < 0 and len(self.buf) > MAX_HEADER_CHARS:
                    self.kind = "aside"
                    continue
                if i < 0:
                    return
                self._open(self.buf[:i])
                self.buf = self.buf[i + len(HARMONY_MESSAGE):]
                continue
            hits = [(j, m) for m in HARMONY_ENDS if (j := self.buf.find(m)) >= 0]
            if hits:
                j, m = min(hits)
                self._body(self.buf[:j])
                self._end()
                self.buf = self.buf[j + len(m):] if m != "<|start|>" else self.buf[j:]
                self.kind = "header"
                continue
            keep = held_suffix(self.buf, HARMONY_ENDS)
            self._body(self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return

    def _open(self, header: str) -> None:
        self.seen_message = True
        channel = m.group(1) if (m := CHANNEL.search(header)) else ""
        to = r.group(1) if (r := RECIPIENT.search(header)) else ""
        if channel == "analysis":
            self.kind = "reasoning"
        elif to.startswith("functions.") and self.calls:
            self.kind = "call"
            self.call = (to[len("functions."):], [])
        elif self.final_only and channel != "final":
            self.kind = "aside"
        else:
            self.kind = "answer"

    def _body(self, text: str) -> None:
        if not text:
            return
        if self.kind == "reasoning":
            self.out.reasoning += text
        elif self.call is not None:
            self.call[1].append(text)
        elif self.kind == "aside":
            self.aside.feed(text)
        else:
            self.then.feed(text)

    def _end(self) -> None:
        """The message ends: a call message becomes a call, or content when it is not one."""
        if self.call is None:
            return
        (name, pieces), self.call = self.call, None
        body = "".join(pieces)
        if name and (args := call_arguments(body)) is not None:
            self.out.calls.append(ToolCall(call_id(), name, Text(args)))
        else:
            self.then.feed(body)

    def finish(self) -> None:
        if self.kind == "header":
            # an output without Harmony messages is content; a header cut short is dropped
            if not self.seen_message:
                self.aside.feed(self.buf)
        else:
            self._body(self.buf)
            self._end()
        self.buf = ""
        if self.aside is not self.then:
            self.aside.finish()
        self.then.finish()
