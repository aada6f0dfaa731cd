"""`tandem eval`'s numbers: each endpoint's accuracy, and with a second endpoint how far the two
are apart (logprobs of the same tokens, picks, greedy outputs), judged against the thresholds;
as a short table or as JSON."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from deploy.eval_client import Answer, Generated, Scored
from deploy.eval_tasks import ChoiceItem, GenerationItem, Item


@dataclass(frozen=True)
class Accuracy:
    """Right answers per kind of item: (right, out of)."""
    choice: tuple[int, int]
    generation: tuple[int, int]


def pick(scored: tuple[Scored, ...]) -> int:
    """The choice with the highest summed logprob (the first of a tie)."""
    return max(range(len(scored)), key=lambda j: scored[j].score)


def accuracy(items: list[Item], answers: list[Answer]) -> Accuracy:
    choice = [pick(a) == i.answer for i, a in zip(items, answers) if isinstance(i, ChoiceItem)
              and isinstance(a, tuple)]
    gen = [a.text.strip() == i.expected.strip() for i, a in zip(items, answers)
           if isinstance(i, GenerationItem) and isinstance(a, Generated)]
    return Accuracy((sum(choice), len(choice)), (sum(gen), len(gen)))


@dataclass
class Comparison:
    """Two endpoints' answers side by side.  `diffs`: |a - b| of every scored token whose
    tokenization both share; `mismatches`: where they tokenized the same text differently."""
    diffs: list[float] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    picks: list[bool] = field(default_factory=list)           # per multiple-choice item: same pick
    identical: list[bool] = field(default_factory=list)       # per generation item: same output
    leading: list[float] = field(default_factory=list)        # per generation item: shared leading tokens

    def stats(self) -> dict[str, float | None]:
        """median, p99 (nearest rank) and max of `diffs` (None when no token was compared)."""
        if not self.diffs:
            return {"median": None, "p99": None, "max": None}
        ranked = sorted(self.diffs)
        return {"median": statistics.median(ranked), "p99": ranked[math.ceil(0.99 * len(ranked)) - 1],
                "max": ranked[-1]}


def compare(items: list[Item], a: list[Answer], b: list[Answer]) -> Comparison:
    out = Comparison()
    for item, x, y in zip(items, a, b):
        if isinstance(x, tuple) and isinstance(y, tuple):
            for j, (sx, sy) in enumerate(zip(x, y)):
                if (sx.tokens, sx.offsets) != (sy.tokens, sy.offsets):
                    out.mismatches.append(f"item {item.id!r} choice {j}: {_first_difference(sx, sy)}")
                else:
                    out.diffs += [abs(p - q) for p, q in zip(sx.logprobs, sy.logprobs)]
            out.picks.append(pick(x) == pick(y))
        elif isinstance(x, Generated) and isinstance(y, Generated):
            out.identical.append(x.text == y.text)
            longest = max(len(x.tokens), len(y.tokens))
            same = next((k for k, (p, q) in enumerate(zip(x.tokens, y.tokens)) if p != q),
                        min(len(x.tokens), len(y.tokens)))
            out.leading.append(same / longest if longest else 1.0)
    return out


def _first_difference(x: Scored, y: Scored) -> str:
    for k, (p, q) in enumerate(zip(zip(x.tokens, x.offsets), zip(y.tokens, y.offsets))):
        if p != q:
            return (f"the endpoints tokenized the text differently at token {k}: {p[0]!r} at {p[1]} vs "
                    f"{q[0]!r} at {q[1]}")
    return f"the endpoints tokenized the text into {len(x.tokens)} and {len(y.tokens)} tokens"


def share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def violations(cmp: Comparison, max_diff: float, min_agreement: float) -> list[str]:
    """What makes the comparison fail, in words (empty: it passes)."""
    out: list[str] = []
    if cmp.mismatches:
        out.append(f"{len(cmp.mismatches)} choice(s) tokenized differently by the two endpoints, first: "
                   f"{cmp.mismatches[0]}")
    worst = cmp.stats()["max"]
    if worst is not None and worst > max_diff:
        out.append(f"the largest logprob difference {worst:.3g} exceeds --max-logprob-diff {max_diff:g}")
    for name, value in (("the choice agreement", share(cmp.picks)), ("the greedy agreement", share(cmp.identical))):
        if value is not None and value < min_agreement:
            out.append(f"{name} {value:.1%} is below --min-agreement {min_agreement:.1%}")
    return out


def report(task: str, items: list[Item], endpoints: list[tuple[str, str, Accuracy]], cmp: Comparison | None,
           thresholds: dict[str, float], failures: list[str]) -> dict[str, Any]:
    """The run as JSON-ready data; `ok` is false on any failure."""
    counts = {"multiple_choice": sum(isinstance(i, ChoiceItem) for i in items),
              "generation": sum(isinstance(i, GenerationItem) for i in items)}
    rows = [{"url": url, "model": model, "multiple_choice_accuracy": _ratio(acc.choice),
             "multiple_choice_right": acc.choice[0], "generation_accuracy": _ratio(acc.generation),
             "generation_right": acc.generation[0]} for url, model, acc in endpoints]
    comparison = None if cmp is None else {
        "scored_tokens": len(cmp.diffs), "logprob_diff": cmp.stats(), "tokenization_mismatches": cmp.mismatches[:20],
        "choice_agreement": share(cmp.picks), "greedy_agreement": share(cmp.identical),
        "greedy_leading_token_share": statistics.mean(cmp.leading) if cmp.leading else None}
    return {"task": task, "items": counts, "endpoints": rows, "comparison": comparison, "thresholds": thresholds,
            "failures": failures, "ok": not failures}


def _ratio(right_of: tuple[int, int]) -> float | None:
    return right_of[0] / right_of[1] if right_of[1] else None


def table(rep: dict[str, Any]) -> str:
    """The report as a few lines of text."""
    n = rep["items"]
    lines = [f"task {rep['task']}: {n['multiple_choice']} multiple choice, {n['generation']} generation items",
             f"{'endpoint':<40} {'model':<16} {'multiple choice':>16} {'generation':>16}"]
    for r in rep["endpoints"]:
        lines.append(f"{r['url'][:40]:<40} {r['model'][:16]:<16} "
                     f"{_cell(r['multiple_choice_right'], n['multiple_choice']):>16} "
                     f"{_cell(r['generation_right'], n['generation']):>16}")
    if (c := rep["comparison"]) is not None:
        d, t = c["logprob_diff"], rep["thresholds"]
        diff = "no token compared" if d["max"] is None else \
            f"median {d['median']:.3g}, p99 {d['p99']:.3g}, max {d['max']:.3g}"
        lines.append(f"|logprob a - b| over {c['scored_tokens']} scored tokens: {diff} "
                     f"(limit {t['max_logprob_diff']:g})")
        lines.append(f"agreement: picks {_pct(c['choice_agreement'])}, greedy outputs identical "
                     f"{_pct(c['greedy_agreement'])}, leading tokens shared {_pct(c['greedy_leading_token_share'])} "
                     f"(limit {t['min_agreement']:.1%})")
    lines += [f"FAIL: {f}" for f in rep["failures"]] or ["PASS"]
    return "\n".join(lines)


def _cell(right: int, total: int) -> str:
    return f"{right}/{total} ({right / total:.1%})" if total else "-"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"
