"""The offline training corpus of the shipped checkpoint (models/tiny-moe).

It lives in the engine, beside SHIPPED_MODEL, because it is part of what the shipped model
is: its special tokens and chat layout match the checkpoint's template, and the chaos and
benchmark prompts draw from its held-out files (text the model has not seen, in the domain
it knows).  Torch-free; models/train_tiny_moe.py trains from it.

Two sources, both present on every machine with Python 3.11:
  * the standard library's own source (code and docstrings), split into
    training and held-out files by a hash of the file name;
  * chat-formatted examples built from it: "repeat after me" copies of words,
    code lines and random canary strings, and docstring look-ups.
"""

from __future__ import annotations

import ast
import hashlib
import random
import string
import sysconfig
from pathlib import Path

BOS_DOC = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [BOS_DOC, IM_START, IM_END]


def stdlib_files() -> list[Path]:
    """Every stdlib source file outside tests, sorted for reproducibility."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("site-packages", "test", "idlelib", "lib2to3", "tkinter", "turtledemo")):
            continue
        if "/test" in rel or "tests/" in rel:
            continue
        files.append(path)
    return files


def is_held_out(path: Path) -> bool:
    """One file in twenty (by a hash of its name) is held out of training."""
    return hashlib.sha256(path.name.encode()).digest()[0] % 20 == 0


def read_split() -> tuple[list[str], list[str]]:
    train: list[str] = []
    held: list[str] = []
    for path in stdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (held if is_held_out(path) else train).append(text)
    return train, held


def chat(user: str, assistant: str) -> str:
    """The same layout the shipped chat template renders."""
    return (f"{IM_START}user\n{user}{IM_END}\n"
            f"{IM_START}assistant\n{assistant}{IM_END}\n")


def _docstrings(texts: list[str]) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                if doc and 20 < len(doc) < 400:
                    pairs.append((node.name, doc.split("\n\n")[0]))
    return pairs


def _canary(rng: random.Random) -> str:
    alphabet = string.ascii_letters + string.digits
    parts = [''.join(rng.choice(alphabet) for _ in range(rng.randint(3, 8)))
             for _ in range(rng.randint(1, 3))]
    return rng.choice(["-", "_", " "]).join(parts)


def chat_examples(texts: list[str], count: int, seed: int) -> list[str]:
    """Chat-formatted examples: copies (words, code lines, canaries) and docstrings."""
    rng = random.Random(seed)
    words = sorted({w for t in texts[:200] for w in t.split() if w.isidentifier()})
    lines = [ln.strip() for t in texts[:400] for ln in t.splitlines() if 10 < len(ln.strip()) < 80]
    docs = _docstrings(texts)
    prompts = ["Repeat after me: {}", "Please repeat: {}", "Say exactly this: {}",
               "Echo back the following text.\n{}", "Copy this: {}"]
    out: list[str] = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.5:
            target = _canary(rng)
            if rng.random() < 0.5:
                target = f"{rng.choice(words)} {target} {rng.choice(words)}"
        elif kind < 0.7:
            target = " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))
        elif kind < 0.85:
            target = rng.choice(lines)
        else:
            name, doc = rng.choice(docs)
            out.append(chat(f"What does {name} do?", doc))
            continue
        out.append(chat(rng.choice(prompts).format(target), target))
    return out
