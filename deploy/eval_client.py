"""`tandem eval`'s side of an OpenAI-compatible server: /v1/completions over plain HTTP (the
standard library's, no serving code, no torch), each item's requests, and what they answered.

A multiple-choice item is scored as lm-evaluation-harness's `local-completions` does: for each
choice one request with prompt = item prompt + choice, `echo: true`, `logprobs: 1`,
`max_tokens: 0`, temperature 0; the choice's score is the sum of the echoed
`token_logprobs` of the tokens whose `text_offset` is at or past the item prompt's length.  A
generation item is one greedy request (`logprobs: 1`, for its tokens).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from deploy.eval_tasks import ChoiceItem, GenerationItem, Item

MAX_ERROR_CHARS = 300         # of a server's error message, as a report quotes it


class EvalError(RuntimeError):
    """A request that failed: which endpoint, which item, what it answered."""


@dataclass(frozen=True)
class Scored:
    """One choice scored: every echoed token (text and offset, to compare two tokenizations)
    and the logprobs of the scored ones (those of the choice)."""
    tokens: tuple[str, ...]
    offsets: tuple[int, ...]
    logprobs: tuple[float, ...]

    @property
    def score(self) -> float:
        return sum(self.logprobs)


@dataclass(frozen=True)
class Generated:
    """A greedy completion: its text and its tokens."""
    text: str
    tokens: tuple[str, ...]


Answer = tuple[Scored, ...] | Generated       # a multiple-choice item's choices, or a generation


class Endpoint:
    """An OpenAI-compatible server at `url` (with or without the /v1), serving `model` (None:
    the first model its /v1/models lists); `timeout_s` bounds each request."""

    def __init__(self, url: str, model: str | None, api_key: str | None, timeout_s: float):
        self.url = url.rstrip("/")
        self.base = self.url if self.url.endswith("/v1") else self.url + "/v1"
        self.api_key, self.timeout_s = api_key, timeout_s
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        data = self._call("GET", "/models", None).get("data")
        if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
            raise EvalError(f"{self.url}: /v1/models lists no model; pass --model")
        return str(data[0]["id"])

    def _call(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """The JSON answer of one request; raises EvalError saying what went wrong."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise EvalError(f"{self.url} answered {e.code} to {path}: {_message(e.read())}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise EvalError(f"{self.url}: {path} failed: {reason} (timeout {self.timeout_s:g} s)") from None
        except json.JSONDecodeError:
            raise EvalError(f"{self.url}: {path} answered something that is not JSON") from None
        if not isinstance(answer, dict):
            raise EvalError(f"{self.url}: {path} answered JSON that is not an object")
        return answer

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """choices[0] of a /v1/completions request for this endpoint's model."""
        answer = self._call("POST", "/completions", {"model": self.model, **body})
        choices = answer.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise EvalError(f"{self.url}: /completions answered no choices")
        first: dict[str, Any] = choices[0]
        return first

    def score(self, prompt: str, choice: str) -> Scored:
        """`choice`'s tokens after `prompt`, with their logprobs (echo)."""
        try:
            out = self.complete({"prompt": prompt + choice, "echo": True, "logprobs": 1, "max_tokens": 0,
                                 "temperature": 0})
        except EvalError as e:
            if " answered 400 " in str(e):
                what = "does not support echo" if "echo" in str(e).lower() else "refused a scoring request"
                raise EvalError(f"{e}: this endpoint {what}, and multiple-choice items need /v1/completions with "
                                f"echo=true, logprobs=1 and max_tokens=0") from None
            raise
        tokens, offsets, logprobs = _logprobs(out, self.url, ("tokens", "text_offset", "token_logprobs"))
        scored = [i for i, o in enumerate(offsets) if o >= len(prompt)]
        if not scored:
            raise EvalError(f"{self.url}: no echoed token lies past the prompt (was the prompt echoed?)")
        if any(not isinstance(logprobs[i], (int, float)) for i in scored):
            raise EvalError(f"{self.url}: a token of the choice has no logprob")
        return Scored(tuple(tokens), tuple(offsets), tuple(float(logprobs[i]) for i in scored))

    def generate(self, item: GenerationItem, max_tokens: int) -> Generated:
        body: dict[str, Any] = {"prompt": item.prompt, "max_tokens": item.max_tokens or max_tokens,
                                "temperature": 0, "logprobs": 1}
        if item.stop:
            body["stop"] = list(item.stop)
        out = self.complete(body)
        (tokens,) = _logprobs(out, self.url, ("tokens",))
        if not isinstance(out.get("text"), str):
            raise EvalError(f"{self.url}: a completion has no text")
        return Generated(out["text"], tuple(tokens))

    def answer(self, item: Item, max_tokens: int) -> Answer:
        """What this endpoint answers for `item`; raises EvalError naming the item."""
        try:
            if isinstance(item, ChoiceItem):
                return tuple(self.score(item.prompt, c) for c in item.choices)
            return self.generate(item, max_tokens)
        except EvalError as e:
            raise EvalError(f"item {item.id!r}: {e}") from None


def run(endpoint: Endpoint, items: list[Item], concurrency: int, max_tokens: int) -> list[Answer]:
    """Every item's answer, at most `concurrency` items in flight; the first failure stops the
    run (the items not started are cancelled) and is raised."""
    with ThreadPoolExecutor(concurrency, thread_name_prefix="tandem-eval") as pool:
        futures: list[Future[Answer]] = [pool.submit(endpoint.answer, item, max_tokens) for item in items]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        error = next((e for f in done if (e := f.exception()) is not None), None)
        if error is not None:
            raise error
        return [f.result() for f in futures]


def _logprobs(out: dict[str, Any], url: str, keys: tuple[str, ...]) -> list[list[Any]]:
    """The lists `keys` of a choice's `logprobs`, all of one length; raises EvalError."""
    lp = out.get("logprobs")
    if not isinstance(lp, dict):
        raise EvalError(f"{url}: a completion has no logprobs (it was asked for logprobs=1)")
    lists = [lp.get(k) for k in keys]
    if not all(isinstance(x, list) for x in lists) or len({len(x) for x in lists if isinstance(x, list)}) != 1:
        raise EvalError(f"{url}: the logprobs lack {' or '.join(keys)}, or their lengths differ")
    return [x for x in lists if isinstance(x, list)]


def _message(raw: bytes) -> str:
    """An error body's message (OpenAI's {"error": {"message"}}), else its text, cut short."""
    try:
        body = json.loads(raw)
        text = body["error"]["message"] if isinstance(body.get("error"), dict) else json.dumps(body)
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError):
        text = raw.decode("utf-8", "replace")
    return str(text)[:MAX_ERROR_CHARS]
