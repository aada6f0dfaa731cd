"""The shipped `tandem eval` task (deploy/tasks/stdlib-heldout.jsonl), made from the standard
library files the shipped model never saw in training (engine/corpus.py `is_held_out`):

    python -m deploy.eval_stdlib --out deploy/tasks/stdlib-heldout.jsonl

- multiple choice: CONTEXT_LINES lines of code, and four candidate next lines: the real one and
  three real lines from elsewhere in the held-out files, indented like the real one;
- generation: the same kind of context and the next line but for its last TAIL_TOKENS tokens,
  which are expected (greedy, stopped at the newline).

The output is committed, not made at test time: the standard library differs between Python
versions, and the file must be the same on every machine.  Each prompt ends in a character
that is not white space and each choice starts with a newline, so the byte-level tokenizer
never joins the two across the boundary; the shipped tokenizer checks that for every item.
The shipped model in fp32 picks 10 of the 24 multiple-choice answers (chance: 6; scored with
transformers' forward, the suite's parity reference) and completes 4 of the 24 lines exactly
(the engine, greedy): the accuracy is low because the model is small, the task is there to
compare two servers.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import corpus
from engine.config import SHIPPED_MODEL
from engine.tokenizer import Tokenizer

CONTEXT_LINES = 8
LINE_CHARS = (12, 80)             # a candidate line's length, stripped (exclusive bounds)
SEED = 37
TAIL_TOKENS = 2                   # a generation item expects the last tokens of its line
MAX_TRIES = 100_000


@dataclass(frozen=True)
class Spot:
    """A line of a held-out file with the CONTEXT_LINES lines before it (right-stripped)."""
    source: str
    context: tuple[str, ...]
    line: str


def held_out_lines() -> list[tuple[str, list[str]]]:
    """(path under the standard library, right-stripped lines) of each held-out file, the
    codec tables of encodings/ left out (rows of numbers, not code)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in corpus.stdlib_files():
        rel = path.relative_to(root).as_posix()
        if not corpus.is_held_out(path) or rel.startswith("encodings/"):
            continue
        try:
            out.append((rel, [ln.rstrip() for ln in path.read_text(encoding="utf-8").splitlines()]))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def spot(rel: str, lines: list[str], i: int) -> Spot | None:
    """Line `i` with its context, or None where it makes a poor item: a short, long or comment
    line, a context that ends in a blank line, or any special token's text."""
    line = lines[i]
    if i < CONTEXT_LINES or not LINE_CHARS[0] < len(line.strip()) < LINE_CHARS[1] or line.strip().startswith("#"):
        return None
    context = tuple(lines[i - CONTEXT_LINES:i])
    if not context[-1].strip() or any(t in "\n".join(context) + line for t in corpus.SPECIAL_TOKENS):
        return None
    return Spot(f"{rel}:{i + 1}", context, line)


def spots(files: list[tuple[str, list[str]]], count: int, rng: random.Random) -> list[Spot]:
    """`count` distinct spots: a file at random, then a line of it at random."""
    chosen: dict[str, Spot] = {}
    for _ in range(MAX_TRIES):
        if len(chosen) == count:
            return list(chosen.values())
        rel, lines = rng.choice(files)
        s = spot(rel, lines, rng.randrange(len(lines))) if lines else None
        if s is not None:
            chosen.setdefault(s.source, s)
    raise RuntimeError(f"found only {len(chosen)} of {count} usable lines in the held-out files")


def clean_boundary(tok: Tokenizer, prompt: str, continuation: str) -> bool:
    """Whether the prompt's tokens are the first tokens of prompt + continuation (no token
    spans the boundary, so every token of the continuation is scored)."""
    head = tok.encode_plain(prompt)
    return tok.encode_plain(prompt + continuation)[:len(head)] == head


def choice_item(s: Spot, pool: list[str], rng: random.Random, n: int) -> dict[str, Any]:
    indent = s.line[:len(s.line) - len(s.line.lstrip())]
    others: list[str] = []
    while len(others) < 3:
        other = indent + rng.choice(pool)
        if other.strip() != s.line.strip() and other not in others:
            others.append(other)
    choices = ["\n" + c for c in [s.line, *others]]
    rng.shuffle(choices)
    return {"id": f"mc-{n:02d}", "prompt": "\n".join(s.context), "choices": choices,
            "answer": choices.index("\n" + s.line), "source": s.source}


def generation_item(s: Spot, tok: Tokenizer, n: int) -> dict[str, Any] | None:
    """The line cut before its last TAIL_TOKENS tokens: the cut must follow a character that
    is not white space, and the tail must hold at least two that are not."""
    offsets = tok.backend.encode(s.line, add_special_tokens=False).offsets
    if len(offsets) <= TAIL_TOKENS:
        return None
    head, tail = s.line[:offsets[-TAIL_TOKENS][0]], s.line[offsets[-TAIL_TOKENS][0]:]
    if not head.strip() or head[-1].isspace() or len(tail.strip()) < 2:
        return None
    return {"id": f"gen-{n:02d}", "prompt": "\n".join(s.context) + "\n" + head, "expected": tail,
            "max_tokens": TAIL_TOKENS + 8, "stop": ["\n"], "source": s.source}


def make_task(count: int, seed: int = SEED) -> list[dict[str, Any]]:
    """`count` multiple-choice items, then `count` generation items, each from its own spot."""
    rng = random.Random(seed)
    tok = Tokenizer(SHIPPED_MODEL)
    files = held_out_lines()
    pool = sorted({ln.strip() for _, lines in files for ln in lines
                   if LINE_CHARS[0] < len(ln.strip()) < LINE_CHARS[1] and not ln.strip().startswith("#")})
    mc: list[dict[str, Any]] = []
    gen: list[dict[str, Any]] = []
    for s in spots(files, 4 * count, rng):
        if len(mc) < count:
            item = choice_item(s, pool, rng, len(mc))
            if all(clean_boundary(tok, item["prompt"], c) for c in item["choices"]):
                mc.append(item)
        elif len(gen) < count and (g := generation_item(s, tok, len(gen))) is not None \
                and clean_boundary(tok, g["prompt"], g["expected"]):
            gen.append(g)
    if len(mc) < count or len(gen) < count:
        raise RuntimeError(f"made {len(mc)} multiple-choice and {len(gen)} generation items of {count} each")
    return mc + gen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.eval_stdlib", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the .jsonl file to write")
    ap.add_argument("--count", type=int, default=24, help="items of each kind (default: 24)")
    ap.add_argument("--seed", type=int, default=SEED, help=f"draws the spots (default: {SEED})")
    args = ap.parse_args(argv)
    items = make_task(args.count, args.seed)
    Path(args.out).write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
    print(f"wrote {len(items)} items to {args.out} from the held-out standard library of Python "
          f"{sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
