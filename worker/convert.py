"""Protobuf <-> engine conversions shared by the workers and their callers (the gateway
included: this module imports no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Callable

from engine.constraint import Constraint
from engine.errors import ErrorCode
from engine.params import SamplingParams
from engine.prompt_entry import PromptLogprob
from proto import worker_pb2 as wpb
from worker.types import WorkerError

_PROTO = wpb.SamplingParams.DESCRIPTOR


@dataclass(frozen=True)
class WireField:
    """A SamplingParams field whose wire encoding is not "the proto field of the same name"."""
    proto_fields: tuple[str, ...]                        # the proto fields it is spelled with
    to_proto: Callable[[Any], dict[str, Any]]            # value -> {proto field: wire value}
    from_proto: Callable[[Any], Any]                     # message -> value


# The only hand-written part of the conversion; every other field is copied by name (a tuple
# as a repeated field).  The field list itself is `dataclasses.fields(SamplingParams)`.
SPECIAL_FIELDS: dict[str, WireField] = {
    "seed": WireField(("has_seed", "seed"), lambda v: {"has_seed": v is not None, "seed": v or 0},
                      lambda m: m.seed if m.has_seed else None),
    "logprobs": WireField(("logprobs",), lambda v: {"logprobs": -1 if v is None else v},
                          lambda m: None if m.logprobs < 0 else m.logprobs),
    "prompt_logprobs": WireField(("prompt_logprobs",), lambda v: {"prompt_logprobs": -1 if v is None else v},
                                 lambda m: None if m.prompt_logprobs < 0 else m.prompt_logprobs),
    "logit_bias": WireField(("logit_bias",), lambda v: {"logit_bias": [wpb.LogitBias(token_id=t, bias=b)
                                                                       for t, b in v]},
                            lambda m: tuple((b.token_id, b.bias) for b in m.logit_bias)),
    "constraint": WireField(("constraint",), lambda v: {} if v is None else {"constraint": wpb.Constraint(
                                kind=v.kind, spec=v.spec, after=v.after)},
                            lambda m: _constraint(m.constraint) if m.HasField("constraint") else None),
}
_PLAIN = tuple(f.name for f in fields(SamplingParams) if f.name not in SPECIAL_FIELDS)
_REPEATED = frozenset(f.name for f in _PROTO.fields if f.is_repeated)


def _constraint(m: wpb.Constraint) -> Constraint:
    """Raises WorkerError(INVALID_REQUEST) naming what is wrong with it."""
    try:
        return Constraint(m.kind, m.spec, m.after)
    except ValueError as e:
        raise WorkerError(ErrorCode.INVALID_REQUEST, str(e)) from None


def params_from_proto(p: wpb.SamplingParams) -> SamplingParams:
    """Raises WorkerError(INVALID_REQUEST) naming the bad parameter."""
    values: dict[str, Any] = {name: tuple(getattr(p, name)) if name in _REPEATED else getattr(p, name)
                              for name in _PLAIN}
    values.update({name: wire.from_proto(p) for name, wire in SPECIAL_FIELDS.items()})
    try:
        return SamplingParams(**values)
    except ValueError as e:
        raise WorkerError(ErrorCode.INVALID_REQUEST, str(e)) from None


def params_to_proto(p: SamplingParams) -> wpb.SamplingParams:
    values: dict[str, Any] = {name: list(getattr(p, name)) if name in _REPEATED else getattr(p, name)
                              for name in _PLAIN}
    for name, wire in SPECIAL_FIELDS.items():
        values.update(wire.to_proto(getattr(p, name)))
    return wpb.SamplingParams(**values)


def logprobs_to_proto(token: int, entry: dict[int, float] | None) -> wpb.TokenLogprobs | None:
    if entry is None:
        return None
    return wpb.TokenLogprobs(token_id=token, logprob=entry[token],
                             top=[wpb.TopLogprob(token_id=t, logprob=v) for t, v in entry.items()])


def prompt_logprobs_to_proto(entries: Sequence[PromptLogprob]) -> wpb.PromptLogprobs:
    return wpb.PromptLogprobs(logprobs=[
        wpb.PromptLogprob(token_id=e.token, logprob=e.logprob, rank=e.rank,
                          top=[wpb.TopLogprob(token_id=t, logprob=v) for t, v in e.top]) for e in entries])


def finish_to_proto(reason: str, matched: str | int | None, prompt_tokens: int,
                    completion_tokens: int, cached_tokens: int = 0) -> wpb.Finish:
    f = wpb.Finish(finish_reason=reason, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   cached_tokens=cached_tokens)
    if isinstance(matched, int):
        f.matched_token, f.matched_token_id = True, matched
    elif matched is not None:
        f.matched_stop = matched
    return f
