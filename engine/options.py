"""A config field written once: its default, its help and how a command line reads it.

Every config dataclass (EngineConfig, WorkerConfig, GatewayConfig, ServeSettings) declares its
fields with `option`, and a field that holds another config with `branch`, so the configs form
one tree (ServeSettings holds WorkerSettings, which holds EngineConfig; and GatewaySettings):

    retries: int = option(3, help="tries before giving up")        # a field: its default, once
    engine: EngineConfig = branch(EngineConfig, help="the engine this worker runs")

`build(cls, **values)` makes a config from flat field names, wherever in its tree each one
lives (nano-vllm builds its `Config` from kwargs filtered by `fields(Config)`).
`add_flags(parser, cls, names)` makes fields argparse options: the help is the field's, with
its default; the option parses to nothing when not given, so argparse holds no copy of any
default and `build(cls, **given(args, names))` leaves every field not given at its own.
A new flag is a field name added to a command's list of names.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import MISSING, Field, field
from typing import Any, TypeVar

__all__ = ["add_flag", "add_flags", "branch", "build", "default_of", "field_of", "fields_of", "flag_of", "given",
           "help_of", "option", "paths"]

HELP, CLI, BRANCH, INSTEAD_OF, SAYS_DEFAULT = "help", "cli", "branch", "instead_of", "says_default"
SWITCHES = ("store_true", "store_false")
STATED_DEFAULT = re.compile(r"\bdefault:", re.IGNORECASE)    # how a help states its default in words
T = TypeVar("T")


def option(default: Any = MISSING, *, help: str, factory: Callable[[], Any] | None = None, repr: bool = True,
           says_default: bool = False, instead_of: str | None = None, **cli: Any) -> Any:
    """A dataclass field: its default (or `factory`, called for each instance), its help, and in
    `cli` how a command line reads it, as argparse takes it (`type`, `choices`, `action`,
    `metavar`) plus `flag`, the option's name when it is not `--` and the field's name with
    dashes.  A switch (`action="store_false"`: `--no-compile`) turns the field's default off.
    `says_default`: the help states the default in words ("default: the model's"), so a command
    line shows it as it is, with no "(default: X)" added.  `instead_of`: the field of the same
    tree this one replaces when set (`build` refuses the two given together)."""
    metadata: dict[str, Any] = {HELP: help, CLI: cli, SAYS_DEFAULT: says_default}
    if instead_of is not None:
        metadata[INSTEAD_OF] = instead_of
    if factory is not None:
        return field(default_factory=factory, repr=repr, metadata=metadata)
    return field(default=default, repr=repr, metadata=metadata)


def branch(cls: type, *, help: str) -> Any:
    """A field holding a config of its own (default `cls()`): a branch of the tree."""
    return field(default_factory=cls, metadata={HELP: help, BRANCH: cls})


def _walk(cls: type, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Field[Any]]]:
    for f in dataclasses.fields(cls):
        yield (*prefix, f.name), f
        if BRANCH in f.metadata:
            yield from _walk(f.metadata[BRANCH], (*prefix, f.name))


def paths(cls: type) -> dict[str, tuple[str, ...]]:
    """Every field name of `cls`'s tree, branches included, with its path:
    ServeSettings' "kv_cache_tokens" is ("worker", "engine", "kv_cache_tokens").  Raises
    TypeError naming a name two fields of the tree share (a value restated, or ambiguous)."""
    out: dict[str, tuple[str, ...]] = {}
    for path, f in _walk(cls):
        if f.name in out:
            raise TypeError(f"{cls.__name__}: {'.'.join(out[f.name])} and {'.'.join(path)} share the name {f.name!r}")
        out[f.name] = path
    return out


def field_of(cls: type, name: str) -> Field[Any]:
    """The field named `name` anywhere in `cls`'s tree.  Raises KeyError when none is."""
    found = next((f for _, f in _walk(cls) if f.name == name), None)
    if found is None:
        raise KeyError(f"{cls.__name__} has no field {name!r} in its tree")
    return found


def default_of(cls: type, name: str) -> Any:
    """The default of the field `name` of `cls`'s tree (its factory called)."""
    f = field_of(cls, name)
    if f.default_factory is not MISSING:
        return f.default_factory()
    if f.default is MISSING:
        raise ValueError(f"{cls.__name__}.{name} has no default")
    return f.default


def help_of(cls: type, name: str) -> str:
    """The help of the field `name` of `cls`'s tree."""
    return str(field_of(cls, name).metadata[HELP])


def fields_of(config: Any) -> dict[str, Any]:
    """A config's own fields by name, a branch kept whole: `type(config)(**fields_of(config))`
    is `config` again, and a subclass's constructor takes it with its own fields added."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def build(cls: type[T], /, **values: Any) -> T:
    """`cls` with each of `values` set on the field of that name in its tree, every other
    field at its default: build(WorkerConfig, kv_cache_tokens=4096, secret=s) sets
    engine.kv_cache_tokens.  A branch given whole (engine=EngineConfig(...)) is taken, then
    fields below it given by name replace its values.  Raises TypeError for a name that no
    field of the tree has, ValueError for a field given with the one it replaces
    (`option(instead_of=...)`: mem_fraction and kv_cache_tokens); the configs' own checks
    raise ValueError."""
    where = paths(cls)
    if unknown := sorted(set(values) - set(where)):
        raise TypeError(f"{cls.__name__} has no field {unknown[0]!r} (nor has any config it holds)")
    for name in values:
        replaced = field_of(cls, name).metadata.get(INSTEAD_OF)
        if replaced in values:
            raise ValueError(f"{flag_of(cls, replaced)} and {flag_of(cls, name)} are both given, and {name} is used "
                             f"instead of {replaced}: give one")
    return _build(cls, (), values, where, None)


def _build(cls: type[T], prefix: tuple[str, ...], values: dict[str, Any], where: dict[str, tuple[str, ...]],
           base: T | None) -> T:
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        path = (*prefix, f.name)
        if f.name in values:
            kw[f.name] = values[f.name]
        if BRANCH in f.metadata:
            below = {n: v for n, v in values.items() if len(where[n]) > len(path) and where[n][:len(path)] == path}
            if below:
                inner = kw.get(f.name, None if base is None else getattr(base, f.name))
                kw[f.name] = _build(f.metadata[BRANCH], path, below, where, inner)
    return dataclasses.replace(base, **kw) if base is not None else cls(**kw)  # type: ignore[type-var]


# ---- command lines ------------------------------------------------------------------------

def flag_of(cls: type, name: str) -> str:
    """The option that sets the field `name` of `cls`'s tree: `--kv-cache-tokens`."""
    return str(field_of(cls, name).metadata.get(CLI, {}).get("flag") or "--" + name.replace("_", "-"))


def add_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, name: str,
             **overrides: Any) -> argparse.Action:
    """The field `name` of `cls`'s tree as an option of `parser` (dest: the field's name).
    Its help is the field's, followed by "(default: X)" unless the field `says_default` in
    words (a switch: the field's own state, "(default: off)", or "(default: on)" for a
    `--no-...` one);
    its type, choices and action are the field's (`overrides` win).  Not given, it parses to
    nothing (argparse.SUPPRESS): the field keeps its default.
    Raises TypeError when the field's help cannot state its default truly."""
    f = field_of(cls, name)
    opts = {**f.metadata.get(CLI, {}), **overrides}
    flag = opts.pop("flag", None) or "--" + name.replace("_", "-")
    action = opts.get("action")
    if action is None and "type" not in opts:
        default = default_of(cls, name)
        if isinstance(default, bool):
            raise TypeError(f"{cls.__name__}.{name}: a bool field needs action store_true or store_false")
        if isinstance(default, (int, float)):
            opts["type"] = type(default)
    elif callable(opts.get("type")) and opts["type"] not in (int, float, str):
        opts["type"] = _argument_type(opts["type"])
    text = _with_default(cls, name, str(f.metadata[HELP]), action, bool(f.metadata.get(SAYS_DEFAULT)))
    return parser.add_argument(flag, dest=name, default=argparse.SUPPRESS, help=text.replace("%", "%%"), **opts)


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, names: Iterable[str]) -> None:
    """`add_flag` for each of `names`, in order."""
    for name in names:
        add_flag(parser, cls, name)


def given(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The fields among `names` whose options were given, by name (an appended list as a
    tuple, as the configs hold sequences): what `build` takes."""
    out = {}
    for name in names:
        if hasattr(args, name):
            value = getattr(args, name)
            out[name] = tuple(value) if isinstance(value, list) else value
    return out


def _with_default(cls: type, name: str, text: str, action: str | None, says_default: bool) -> str:
    stated = STATED_DEFAULT.search(text) is not None
    if says_default != stated:
        raise TypeError(f"{cls.__name__}.{name}: its help " + ("says no 'default: ...'" if says_default else
                        "says 'default: ...' in words: mark it says_default=True") + f" ({text!r})")
    if says_default:
        return text
    default = default_of(cls, name)
    if action in SWITCHES:
        if default != (action == "store_false"):
            raise TypeError(f"{cls.__name__}.{name}: a {action} switch on a field whose default is {default!r}")
        return f"{text} (default: {'on' if default else 'off'})"    # the field's state, not the switch's
    if action == "append" and not default:
        return f"{text} (default: none)"
    if default is None:
        raise TypeError(f"{cls.__name__}.{name}: say in its help what None means (e.g. 'default: all')")
    return f"{text} (default: {default})"


def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, its ValueError turned into argparse's error carrying the message."""
    def parse_argument(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse_argument.__name__ = getattr(parse, "__name__", "value")
    return parse_argument
