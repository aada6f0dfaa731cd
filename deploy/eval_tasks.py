"""`tandem eval`'s task files: one JSON object a line, each a multiple-choice or a generation item.

    {"id": "mc-1", "prompt": "def f(x):", "choices": ["\\n    return x", "\\n    pass"], "answer": 0}
    {"id": "gen-1", "prompt": "def f(x):\\n    return", "expected": " x", "max_tokens": 8, "stop": ["\\n"]}

A multiple-choice item is scored by the log-probability of each choice given the prompt (the
choice's text follows the prompt directly, so a choice usually starts with its separator); a
generation item by exact match of the greedy completion, stripped, against `expected`,
stripped.  `max_tokens` and `stop` are a generation item's own (optional), `source` says where
an item came from (optional, not read).  A file is read whole before anything is sent, and a
bad line stops the run naming its line number and what is wrong with it.

Shipped tasks are found by a short name (`tandem eval stdlib`): see TASKS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

MAX_ITEMS = 10_000            # items one run reads, whatever --max-items says
MAX_CHOICES = 32              # choices of one multiple-choice item
MAX_GEN_TOKENS = 4096         # a generation item's max_tokens
TASKS = {"stdlib": "stdlib-heldout.jsonl"}    # short name -> file under deploy/tasks/
CHOICE_KEYS = frozenset({"id", "prompt", "choices", "answer", "source"})
GENERATION_KEYS = frozenset({"id", "prompt", "expected", "max_tokens", "stop", "source"})


class TaskError(ValueError):
    """A task file that cannot be read: says which file, which line and what is wrong."""


@dataclass(frozen=True)
class ChoiceItem:
    """A multiple-choice item: `choices[answer]` is the right continuation of `prompt`."""
    id: str
    prompt: str
    choices: tuple[str, ...]
    answer: int


@dataclass(frozen=True)
class GenerationItem:
    """A generation item: the greedy completion of `prompt` should be `expected` (stripped);
    `max_tokens` None: the run's default; `stop`: strings that end the completion."""
    id: str
    prompt: str
    expected: str
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()


Item = ChoiceItem | GenerationItem


def task_path(name: str) -> Path:
    """The task file `name` names: a path, or a shipped task's short name (TASKS).  Raises
    FileNotFoundError naming both kinds."""
    path = Path(name)
    if path.is_file():
        return path
    if name in TASKS:
        return Path(str(files("deploy") / "tasks" / TASKS[name]))
    raise FileNotFoundError(f"no task file {name!r} (give a .jsonl path, or a shipped task: {', '.join(TASKS)})")


def load_tasks(path: Path, max_items: int = MAX_ITEMS) -> tuple[list[Item], bool]:
    """The first `max_items` items of the file (at most MAX_ITEMS), and whether it holds more.
    Blank lines are skipped.  Raises TaskError for a bad line or a file with no item."""
    if not 1 <= max_items <= MAX_ITEMS:
        raise TaskError(f"--max-items {max_items}: it must be in 1..{MAX_ITEMS}")
    items: list[Item] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if len(items) == max_items:
                return items, True
            item = parse_item(line, f"{path} line {number}")
            if item.id in seen:
                raise TaskError(f"{path} line {number}: the id {item.id!r} is also on line {seen[item.id]}")
            seen[item.id] = number
            items.append(item)
    if not items:
        raise TaskError(f"{path}: no items (one JSON object a line)")
    return items, False


def parse_item(line: str, where: str) -> Item:
    """One line as an item; raises TaskError naming `where` and what is wrong."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(raw, dict):
        raise TaskError(f"{where}: an item is a JSON object, not {type(raw).__name__}")
    if "choices" in raw and "expected" in raw:
        raise TaskError(f"{where}: an item has either 'choices' (multiple choice) or 'expected' (generation), "
                        f"not both")
    if "choices" in raw:
        _known(raw, CHOICE_KEYS, where)
        return ChoiceItem(_text(raw, "id", where), _text(raw, "prompt", where), *_choices(raw, where))
    if "expected" in raw:
        _known(raw, GENERATION_KEYS, where)
        return GenerationItem(_text(raw, "id", where), _text(raw, "prompt", where),
                              _text(raw, "expected", where, empty=True), _max_tokens(raw, where), _stop(raw, where))
    raise TaskError(f"{where}: an item needs 'choices' and 'answer' (multiple choice) or 'expected' (generation)")


def _known(raw: dict[str, Any], keys: frozenset[str], where: str) -> None:
    if unknown := sorted(set(raw) - keys):
        raise TaskError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))} (this kind of item takes "
                        f"{', '.join(sorted(keys))})")


def _text(raw: dict[str, Any], key: str, where: str, empty: bool = False) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or (not value and not empty):
        got = "missing" if key not in raw else f"{json.dumps(value)[:40]}"
        raise TaskError(f"{where}: {key!r} must be a{'' if empty else ' non-empty'} string (got {got})")
    return value


def _choices(raw: dict[str, Any], where: str) -> tuple[tuple[str, ...], int]:
    choices, answer = raw["choices"], raw.get("answer")
    if not isinstance(choices, list) or not 2 <= len(choices) <= MAX_CHOICES \
            or not all(isinstance(c, str) and c for c in choices):
        raise TaskError(f"{where}: 'choices' must be a list of 2..{MAX_CHOICES} non-empty strings")
    if len(set(choices)) != len(choices):
        raise TaskError(f"{where}: two choices are the same text")
    if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
        raise TaskError(f"{where}: 'answer' must be the index of the right choice, 0..{len(choices) - 1} "
                        f"(got {json.dumps(answer) if 'answer' in raw else 'none'})")
    return tuple(choices), answer


def _max_tokens(raw: dict[str, Any], where: str) -> int | None:
    value = raw.get("max_tokens")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_GEN_TOKENS:
        raise TaskError(f"{where}: 'max_tokens' must be an integer in 1..{MAX_GEN_TOKENS} (got {json.dumps(value)})")
    return value


def _stop(raw: dict[str, Any], where: str) -> tuple[str, ...]:
    value = raw.get("stop", [])
    if not isinstance(value, list) or len(value) > 4 or not all(isinstance(s, str) and s for s in value):
        raise TaskError(f"{where}: 'stop' must be a list of at most 4 non-empty strings (OpenAI's limit)")
    return tuple(value)
