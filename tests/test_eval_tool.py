"""`tandem eval` (deploy/eval_cli.py) against fake OpenAI-compatible servers on loopback: one
token per character, each with a fixed logprob (plus a shift, to make a second server differ),
greedy completions from a table.  Accuracy, the thresholds' exit codes, a tokenization that
differs, a server that refuses echo, bad task files, and the shipped task."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from deploy.eval_cli import main
from deploy.eval_tasks import TASKS, ChoiceItem, GenerationItem, load_tasks, task_path

ROOT = Path(__file__).resolve().parent.parent
ITEMS = [
    {"id": "short-wins", "prompt": "def f():", "choices": ["\n    ab", "\n    abcd"], "answer": 0},
    {"id": "long-loses", "prompt": "def g():", "choices": ["\n    abcdef", "\n    ab"], "answer": 0},
    {"id": "three", "prompt": "x = 1", "choices": ["\ny", "\nyzz", "\nyz"], "answer": 0},
    {"id": "gen-right", "prompt": "p1", "expected": "yes", "stop": ["\n"]},
    {"id": "gen-wrong", "prompt": "p2", "expected": "maybe", "max_tokens": 4},
]
COMPLETIONS = {"p1": " yes\nand more", "p2": " no"}


def logprob(char: str) -> float:
    return -0.5 - 0.01 * (ord(char) % 3)


class Fake(ThreadingHTTPServer):
    """/v1/models and /v1/completions: tokens of `width` characters, logprob + `shift` each."""

    def __init__(self, shift: float = 0.0, width: int = 1, echo: bool = True,
                 completions: dict[str, str] = COMPLETIONS) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.shift, self.width, self.echo, self.completions = shift, width, echo, completions
        self.bodies: list[dict[str, Any]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.bodies.append(body)
        if body.get("echo") and not self.echo:
            return 400, {"error": {"message": "echo is not supported", "type": "invalid_request_error"}}
        if body.get("echo"):
            text = body["prompt"]
        else:
            text = self.completions[body["prompt"]]
            for stop in body.get("stop") or ():
                text = text.split(stop)[0]
        tokens = [text[i:i + self.width] for i in range(0, len(text), self.width)]
        lps: list[float | None] = [logprob(t[0]) + self.shift for t in tokens]
        if body.get("echo"):
            lps[0] = None
        offsets = [i * self.width for i in range(len(tokens))]
        return 200, {"choices": [{"index": 0, "text": text, "finish_reason": "length", "logprobs": {
            "tokens": tokens, "token_logprobs": lps, "text_offset": offsets, "top_logprobs": None}}]}


class Handler(BaseHTTPRequestHandler):
    server: Fake

    def do_GET(self) -> None:
        self._send(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._send(*self.server.complete(body))

    def _send(self, status: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def fake(**kw: Any) -> Iterator[Fake]:
    server = Fake(**kw)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def task(tmp_path: Path) -> Path:
    path = tmp_path / "task.jsonl"
    path.write_text("".join(json.dumps(i) + "\n" for i in ITEMS))
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    status = main([*argv, "--json"])
    return status, json.loads(capsys.readouterr().out)


def test_accuracy_is_scored_as_local_completions_does(capsys, task):
    with fake() as a:
        status, rep = run(capsys, str(task), "--url", a.url)
    assert status == 0 and rep["ok"] and rep["comparison"] is None
    (row,) = rep["endpoints"]
    # shorter choices win (every character costs about 0.5): right, wrong, right; yes right, no wrong
    assert (row["multiple_choice_right"], row["generation_right"]) == (2, 1)
    assert row["multiple_choice_accuracy"] == pytest.approx(2 / 3) and row["model"] == "fake-model"
    echo = [b for b in a.bodies if b.get("echo")]
    assert len(echo) == 7 and all(b["max_tokens"] == 0 and b["logprobs"] == 1 and b["temperature"] == 0
                                  and b["model"] == "fake-model" for b in echo)
    assert {b["prompt"] for b in echo} >= {"def f():\n    ab", "x = 1\nyzz"}
    gen = {b["prompt"]: b for b in a.bodies if not b.get("echo")}
    assert gen["p1"]["stop"] == ["\n"] and gen["p1"]["max_tokens"] == 64 and gen["p2"]["max_tokens"] == 4


def test_the_same_server_twice_agrees_exactly(capsys, task):
    with fake() as a, fake() as b:
        status, rep = run(capsys, str(task), "--url", a.url, "--against", b.url)
    c = rep["comparison"]
    assert status == 0 and rep["failures"] == []
    assert c["scored_tokens"] == sum(len(ch) - len(i["prompt"]) for i in ITEMS[:3] for ch in
                                     [i["prompt"] + x for x in i["choices"]])
    assert c["logprob_diff"] == {"median": 0.0, "p99": 0.0, "max": 0.0}
    assert (c["choice_agreement"], c["greedy_agreement"], c["greedy_leading_token_share"]) == (1.0, 1.0, 1.0)


def test_a_difference_below_the_threshold_passes_and_one_above_fails(capsys, task):
    with fake() as a, fake(shift=1e-6) as near, fake(shift=0.01) as far:
        ok, rep = run(capsys, str(task), "--url", a.url, "--against", near.url)
        bad, worse = run(capsys, str(task), "--url", a.url, "--against", far.url)
        loose, _ = run(capsys, str(task), "--url", a.url, "--against", far.url, "--max-logprob-diff", "0.02")
    assert ok == 0 and rep["comparison"]["logprob_diff"]["max"] == pytest.approx(1e-6, rel=1e-3)
    assert bad == 1 and not worse["ok"] and "exceeds --max-logprob-diff 0.001" in worse["failures"][0]
    assert worse["comparison"]["logprob_diff"]["p99"] == pytest.approx(0.01)
    assert loose == 0


def test_different_greedy_outputs_miss_the_agreement(capsys, task):
    with fake() as a, fake(completions={"p1": " yes", "p2": " nope"}) as b:
        status, rep = run(capsys, str(task), "--url", a.url, "--against", b.url)
        lenient, _ = run(capsys, str(task), "--url", a.url, "--against", b.url, "--min-agreement", "0.5")
    c = rep["comparison"]
    assert status == 1 and c["greedy_agreement"] == 0.5 and c["choice_agreement"] == 1.0
    assert c["greedy_leading_token_share"] == pytest.approx((1 + 3 / 5) / 2)     # " no" vs " nope": 3 of 5
    assert rep["failures"] == ["the greedy agreement 50.0% is below --min-agreement 100.0%"]
    assert lenient == 0


def test_a_different_tokenization_is_named_and_fails(capsys, task):
    with fake() as a, fake(width=2) as b:
        status, rep = run(capsys, str(task), "--url", a.url, "--against", b.url, "--max-logprob-diff", "100")
    assert status == 1
    assert "tokenized differently" in rep["failures"][0] and "item 'short-wins' choice 0" in rep["failures"][0]
    assert "token 0: 'd' at 0 vs 'de' at 0" in rep["failures"][0]


def test_a_server_without_echo_is_reported_clearly(capsys, task):
    with fake(echo=False) as a:
        status = main([str(task), "--url", a.url, "--concurrency", "1"])
    out = capsys.readouterr().out
    assert status == 1
    assert "answered 400 to /completions: echo is not supported: this endpoint does not support echo, and " \
        "multiple-choice items need /v1/completions with echo=true, logprobs=1 and max_tokens=0" in out
    assert "FAIL: a request failed: item 'short-wins'" in out and len(a.bodies) <= 2    # it stopped at once


def test_an_unreachable_server_fails_with_exit_1(capsys, task):
    with fake() as a:
        url = a.url
    status = main([str(task), "--url", url, "--timeout-s", "2"])
    assert status == 1 and "FAIL: a request failed" in capsys.readouterr().out


@pytest.mark.parametrize("line, message", [
    ('{"id": "a", "prompt": "p", "choices": ["x", "y"], "answer": 2}', "line 2: 'answer' must be the index"),
    ('{"id": "a", "prompt": "p", "choices": ["x"', "line 2: not JSON ("),
    ('{"id": "a", "prompt": "p", "expected": "x", "choises": 1}', "line 2: unknown field(s) 'choises'"),
    ('{"id": "first", "prompt": "p", "expected": "x"}', "line 2: the id 'first' is also on line 1"),
    ('{"id": "a", "prompt": "", "expected": "x"}', "line 2: 'prompt' must be a non-empty string"),
    ('{"id": "a", "prompt": "p"}', "line 2: an item needs 'choices' and 'answer'"),
    ('[1, 2]', "line 2: an item is a JSON object, not list"),
    ('{"id": "a", "prompt": "p", "expected": "x", "max_tokens": true}', "line 2: 'max_tokens' must be an integer"),
])
def test_a_bad_task_file_names_the_line_and_the_problem(capsys, tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "first", "prompt": "p", "expected": "x"}\n' + line + "\n")
    assert main([str(path), "--url", "http://127.0.0.1:9/v1"]) == 2
    assert message in capsys.readouterr().err


def test_max_items_takes_the_first_items(capsys, task):
    with fake() as a:
        status, rep = run(capsys, str(task), "--url", a.url, "--max-items", "2")
    assert status == 0 and rep["items"] == {"multiple_choice": 2, "generation": 0}
    assert main([str(task), "--url", a.url, "--max-items", "10001"]) == 2


def test_the_shipped_task_is_found_by_its_short_name():
    path = task_path("stdlib")
    assert path.name == TASKS["stdlib"] and path.parent == ROOT / "deploy" / "tasks"
    items, more = load_tasks(path)
    assert not more and len(items) == 48
    assert sum(isinstance(i, ChoiceItem) for i in items) == sum(isinstance(i, GenerationItem) for i in items) == 24
    for i in items:                 # the boundary the generator keeps clean: no white space before it
        assert not i.prompt[-1].isspace()
        if isinstance(i, ChoiceItem):
            assert all(c.startswith("\n") for c in i.choices) and len(i.choices) == 4


def test_tandem_eval_is_a_command_and_loads_no_torch():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["tandem.commands"]["eval"] == "deploy.eval_cli:main"
    assert "tasks/*.jsonl" in meta["tool"]["setuptools"]["package-data"]["deploy"]
    probe = "import sys, deploy.eval_cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
