"""Checking a constraint in a child process, under a time budget that a kill enforces.

Compiling some small grammars costs llguidance minutes of CPU that none of its parser limits
bound (the emptiness check of a string schema's `allOf` of ~30 regex patterns: under 1 KB of
schema, over 60 s here), and a thread cannot be stopped.  So the gateway and the workers check
a constraint they have not seen in a child process (`python -m engine.grammar_check`) that does
the same compile, first mask and first steps (`GrammarCompiler.check`); past the budget the child is killed
and the constraint refused.  Only a constraint that passed is then compiled in-process.

    CheckerPool.check(c, timeout_s)    a free child (none free within the budget: CheckBusy)
        ── frame: {"kind", "spec"} ──▶  child: grammar text, compile, first mask, the worker's first
                                         steps (GrammarCompiler.prepare)
        ◀── frame: {"text"} | {"error"}  or nothing before the deadline: kill, CheckTimeout
                                         or the child died checking it: a refusal ("crashed")

The child answers with the grammar text it checked (for a GBNF grammar, the Lark that
llguidance's Python converter made: the parent never converts it again).  Frames are a 4-byte
big-endian length and UTF-8 JSON, on a copy of the child's stdout: its fd 1 goes to stderr, so
nothing a library prints can break a frame.  The first frame a child reads is its setup
(tokenizer JSON, vocabulary size, EOS ids, every field of the parser limits).  A child starts at the first
check that finds none free (about 0.1 s: Python, llguidance, the tokenizer; not counted in the
budget), dies with its parent (Linux: PR_SET_PDEATHSIG) and may use at most
CHILD_MEMORY_BYTES.  Torch-free (the gateway uses it).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

import llguidance

from engine.constraint import CheckBusy, CheckTimeout, Constraint, GrammarCompiler, default_limits
from engine.grammar_steps import limits_from, limits_setup

_LEN = struct.Struct(">I")
MAX_FRAME = 16 << 20                 # a frame's length past this is not a frame: the protocol broke
CHILD_MEMORY_BYTES = 2 << 30         # a child's address space (RLIMIT_AS): a check's memory is bounded too


class CheckerBroken(CheckBusy):
    """The pool could not run a check (a child would not start, or its pipe broke before the
    constraint was sent): the server's trouble, never the constraint's (never remembered)."""


def _write(stream: IO[bytes], message: Any) -> None:
    data = json.dumps(message).encode()
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def _read(stream: IO[bytes]) -> Any:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError("the grammar checker closed its pipe")
    (size,) = _LEN.unpack(head)
    if size > MAX_FRAME:
        raise EOFError(f"the grammar checker sent a frame of {size} bytes (the protocol broke)")
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the grammar checker closed its pipe")
    return json.loads(data)


class _Child:
    def __init__(self, setup: dict[str, Any]):
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.grammar_check", str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_child_env())
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        _write(self.stdin, setup)
        self.answers: list[Any] = []
        self.ready = threading.Event()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, c: Constraint) -> None:
        """Send `c` (raises OSError when the child is gone)."""
        self.answers.clear()
        self.ready.clear()
        _write(self.stdin, {"kind": c.kind, "spec": c.spec})
        threading.Thread(target=self._answer, daemon=True).start()

    def answer(self, c: Constraint, deadline: float, budget: float) -> dict[str, Any]:
        """The child's answer ({"text"} or {"error"}).  Raises CheckTimeout at the deadline and
        ValueError when the child died checking `c` (both leave the child unusable)."""
        if not self.ready.wait(max(0.0, deadline - time.monotonic())):
            raise CheckTimeout(f"the {c.kind} constraint took longer than {budget:g} s to compile; simplify it")
        answer = self.answers[0]
        if isinstance(answer, BaseException):
            try:
                code = self.proc.wait(timeout=5)
                how = f"signal {-code}" if code < 0 else f"exit status {code}"
            except subprocess.TimeoutExpired:
                how = str(answer)
            raise ValueError(f"the {c.kind} constraint crashed the grammar engine ({how}); simplify it")
        return dict(answer)

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
            try:
                stream.close()
            except OSError:
                pass


def _child_env() -> dict[str, str]:
    """The child imports this package from where the parent did."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class CheckerPool:
    """Up to `processes` children checking constraints for one tokenizer (thread-safe).  Called
    with a constraint, it checks it within `timeout_s` and returns its grammar text (a
    `GrammarCompiler`'s checker)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int],
                 limits: llguidance.LLParserLimits | None = None, *, timeout_s: float, processes: int = 2):
        self.timeout_s = timeout_s
        # the children check under every one of the limits the workers' matchers run under
        self.setup = {"tokenizer": tokenizer_json, "vocab_size": vocab_size, "eos_ids": list(eos_ids),
                      "limits": limits_setup(limits if limits is not None else default_limits())}
        self._free: list[_Child] = []
        self._busy: set[_Child] = set()
        self._slots = threading.Semaphore(processes)
        self._lock = threading.Lock()
        self._closed = False
        self.killed = 0                      # children killed at a deadline or dead (tests, logs)

    def __call__(self, c: Constraint) -> str:
        return self.check(c, self.timeout_s)

    def check(self, c: Constraint, timeout_s: float) -> str:
        """`c`'s grammar text once a child compiled it and computed its first mask within
        `timeout_s` (counted from when a child has it).  Raises ValueError naming the problem
        (CheckTimeout past the budget; a crash of the child is a refusal too), CheckBusy when
        no child was free within `timeout_s`, CheckerBroken when none could run it."""
        if not self._slots.acquire(timeout=timeout_s):
            raise CheckBusy(f"no grammar checker was free within {timeout_s:g} s (all busy compiling); "
                            "try again")
        try:
            child = self._send(c)
            try:
                answer = child.answer(c, time.monotonic() + timeout_s, timeout_s)
            except BaseException:
                self._drop(child)            # past its deadline, or dead: never reused
                raise
            self._give(child)
        finally:
            self._slots.release()
        if answer.get("error") is not None:
            raise ValueError(answer["error"])
        return str(answer["text"])

    def _send(self, c: Constraint) -> _Child:
        """A live child that has `c`: a free one, or a new one when none is (or the free one
        turns out dead: once)."""
        for _ in range(2):
            child = self._take()
            try:
                child.send(c)
                return child
            except OSError:
                self._drop(child)
        raise CheckerBroken("the grammar checker could not be started")

    def _take(self) -> _Child:
        with self._lock:
            if self._closed:
                raise CheckerBroken("the grammar checker pool is closed")
            while self._free:
                child = self._free.pop()
                if child.alive:
                    self._busy.add(child)
                    return child
                child.kill()
        try:
            child = _Child(self.setup)
        except OSError as e:
            raise CheckerBroken(f"the grammar checker could not be started: {e}") from None
        with self._lock:
            self._busy.add(child)
        return child

    def _give(self, child: _Child) -> None:
        with self._lock:
            self._busy.discard(child)
            if not self._closed:
                self._free.append(child)
                return
        child.kill()

    def _drop(self, child: _Child) -> None:
        child.kill()
        with self._lock:
            self._busy.discard(child)
            self.killed += 1

    def close(self) -> None:
        """Kill every child, busy ones too (their checks end as crashed)."""
        with self._lock:
            self._closed = True
            children, self._free = [*self._free, *self._busy], []
        for child in children:
            child.kill()


def checker_for(tokenizer_json: str, vocab_size: int, eos_ids: list[int],
                timeout_s: float | None, processes: int = 2) -> CheckerPool | None:
    """A `GrammarCompiler` checker: constraints checked by up to `processes` children within
    `timeout_s` (None: no checker, every constraint compiles in-process without a budget, as
    the single-process `engine.LLM` does)."""
    if timeout_s is None:
        return None
    return CheckerPool(tokenizer_json, vocab_size, eos_ids, default_limits(), processes=processes,
                       timeout_s=timeout_s)


def _guard(parent: int) -> None:
    """The child's own bounds: killed when its parent dies (Linux), its memory capped."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)    # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass                                   # not Linux: an idle child still ends at its stdin's EOF
    if os.getppid() != parent:                 # the parent died before the prctl
        os._exit(0)
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))
    except (ImportError, ValueError, OSError):
        pass


def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """The child: checks each constraint it reads, answers with its grammar text or the refusal."""
    setup = _read(stdin)
    compiler = GrammarCompiler(setup["tokenizer"], setup["vocab_size"], setup["eos_ids"], cache_size=0,
                               limits=limits_from(setup["limits"]))
    while True:
        try:
            message = _read(stdin)
        except EOFError:
            return
        try:
            _write(stdout, {"text": compiler.prepare(Constraint(message["kind"], message["spec"]))})
        except ValueError as e:
            _write(stdout, {"error": str(e)})


if __name__ == "__main__":
    _guard(int(sys.argv[1]))
    protocol = os.fdopen(os.dup(1), "wb")       # frames only: fd 1 (what libraries print) goes to stderr
    os.dup2(2, 1)
    _serve(sys.stdin.buffer, protocol)
