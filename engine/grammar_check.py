"""Checking a constraint in a child process, under a time budget that a kill enforces.

Compiling some small grammars costs llguidance minutes of CPU that none of its parser limits
bound (the emptiness check of a string schema's `allOf` of ~30 regex patterns: under 1 KB of
schema, over 60 s here), and a thread cannot be stopped.  So the gateway and the workers check
a constraint they have not seen in a child process (`python -m engine.grammar_check`) that does
the same compile and first mask (`GrammarCompiler.check`); past the budget the child is killed
and the constraint refused.  Only a constraint that passed is then compiled in-process.

    CheckerPool.check(c, timeout_s)    a free child (waiting for one counts against the budget)
        ── frame: {"kind", "spec"} ──▶  child: GrammarCompiler.check (its own, uncached)
        ◀── frame: {"error": msg|null}   or nothing before the deadline: kill, refuse

Frames are a 4-byte big-endian length and UTF-8 JSON.  The first frame a child reads is its
setup (tokenizer JSON, vocabulary size, EOS ids, initial lexer fuel).  A child starts at the
first check that finds none free (about 0.2 s: Python, llguidance, the tokenizer) and lives
until it is killed or the pool closes.  Torch-free (the gateway uses it).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

from engine.constraint import INITIAL_LEXER_FUEL, CheckBusy, CheckTimeout, Constraint, GrammarCompiler

_LEN = struct.Struct(">I")


def _write(stream: IO[bytes], message: Any) -> None:
    data = json.dumps(message).encode()
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def _read(stream: IO[bytes]) -> Any:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError("the grammar checker closed its pipe")
    (size,) = _LEN.unpack(head)
    return json.loads(stream.read(size))


class _Child:
    def __init__(self, setup: dict[str, Any]):
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.grammar_check"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=_child_env())
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        _write(self.stdin, setup)
        self.answers: list[Any] = []
        self.ready = threading.Event()

    def ask(self, c: Constraint, deadline: float, budget: float) -> str | None:
        """The child's answer (None: it passed; else the refusal), or CheckTimeout at the deadline."""
        self.answers.clear()
        self.ready.clear()
        _write(self.stdin, {"kind": c.kind, "spec": c.spec})
        reader = threading.Thread(target=self._answer, daemon=True)
        reader.start()
        if not self.ready.wait(max(0.0, deadline - time.monotonic())):
            raise CheckTimeout(f"the {c.kind} constraint took longer than {budget:g} s to compile; simplify it")
        answer = self.answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer.get("error")

    def _answer(self) -> None:
        try:
            self.answers.append(_read(self.stdout))
        except BaseException as e:        # noqa: BLE001 - handed to the asking thread
            self.answers.append(e)
        self.ready.set()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.stdin, self.stdout):
            stream.close()


def _child_env() -> dict[str, str]:
    """The child imports this package from where the parent did."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class CheckerPool:
    """Up to `processes` children checking constraints for one tokenizer (thread-safe).  Called
    with a constraint, it checks it within `timeout_s` (a `GrammarCompiler`'s checker)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int], initial_lexer_fuel: int,
                 processes: int = 2, timeout_s: float = 10.0):
        self.timeout_s = timeout_s
        self.setup = {"tokenizer": tokenizer_json, "vocab_size": vocab_size, "eos_ids": list(eos_ids),
                      "fuel": initial_lexer_fuel}
        self._free: list[_Child] = []
        self._slots = threading.Semaphore(processes)
        self._lock = threading.Lock()
        self._closed = False
        self.killed = 0                      # children killed at a deadline (tests, logs)

    def __call__(self, c: Constraint) -> None:
        self.check(c, self.timeout_s)

    def check(self, c: Constraint, timeout_s: float) -> None:
        """Raise ValueError naming the problem (CheckTimeout past `timeout_s`, waiting for a free
        child included) unless `c` compiles and its first mask is computed."""
        deadline = time.monotonic() + timeout_s
        if not self._slots.acquire(timeout=timeout_s):
            raise CheckBusy(f"no grammar checker was free within {timeout_s:g} s (all busy compiling); "
                               "try again")
        try:
            child = self._take()
            try:
                error = child.ask(c, deadline, timeout_s)
            except BaseException:
                child.kill()                 # past its deadline, or its pipe broke: never reused
                with self._lock:
                    self.killed += 1
                raise
            self._give(child)
        finally:
            self._slots.release()
        if error is not None:
            raise ValueError(error)

    def _take(self) -> _Child:
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar checker pool is closed")
            if self._free:
                return self._free.pop()
        return _Child(self.setup)

    def _give(self, child: _Child) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(child)
                return
        child.kill()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for child in free:
            child.kill()


def checker_for(tokenizer_json: str, vocab_size: int, eos_ids: list[int],
                timeout_s: float | None) -> CheckerPool | None:
    """A `GrammarCompiler` checker: constraints checked by a pool of children within
    `timeout_s` (None: no checker, every constraint compiles in-process without a budget, as
    the single-process `engine.LLM` does)."""
    if timeout_s is None:
        return None
    return CheckerPool(tokenizer_json, vocab_size, eos_ids, INITIAL_LEXER_FUEL, timeout_s=timeout_s)


def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """The child: checks each constraint it reads, answers with the refusal or null."""
    import llguidance
    setup = _read(stdin)
    compiler = GrammarCompiler(setup["tokenizer"], setup["vocab_size"], setup["eos_ids"], cache_size=0,
                               limits=llguidance.LLParserLimits(initial_lexer_fuel=setup["fuel"]))
    while True:
        try:
            message = _read(stdin)
        except EOFError:
            return
        try:
            compiler.check(Constraint(message["kind"], message["spec"]))
            _write(stdout, {"error": None})
        except ValueError as e:
            _write(stdout, {"error": str(e)})


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
