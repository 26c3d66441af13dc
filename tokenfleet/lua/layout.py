"""The notation of a Lua script's KEYS and ARGV: an ordered tuple of paths into a call's
fields. A call's values are flattened from it (`ScriptCall`, the base of each script's
call in tokenfleet/lua/calls.py), and the script's header states the same paths, slot by
slot, at the positions `slots` renders, which tests/test_lua_contracts.py checks.

Paths:
    name      a field: one slot
    a.b       field b of the record in field a
    xs[]      a list of scalars: one slot per item
    xs[].a    a list of records: per item, the fields listed (consecutive paths with
              the same `xs[]` are one run over the list; another run may follow later)
    x?.a      an optional record: its slots are absent when it is None

Header lines, one slot or run per line, at the top of the script:

    -- KEYS[1]      stream          the jobs stream
    -- KEYS[2..n+1] candidates[]    one run of the script's n items, i = 1..n:
    -- KEYS[i+1]    candidates[].hash
    -- ARGV[10..]   held[]          a run whose items vary in width: item i's slots
    -- ARGV[a+1]    held[].job_id   are counted from its first, a; a list inside
    -- ARGV[a+2e+3] held[].tokens[].index   such an item has k entries, e = 1..k

Every list at the top of a layout has the script's n items (a call checks it).
A bool is written '1' or '0' (the scripts test `== '1'`).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar, TypeAlias

Step = tuple[str, str]  # (field name, mark): mark '' one value, '[]' a list, '?' optional
Path = tuple[Step, ...]
Affine = dict[str, int]  # a position: variable -> coefficient; '' the constant

_VARIABLES = ("a", "n", "k", "i", "e")  # the order they are written in
_LOOPS = (("i", "n"), ("e", "k"))  # per nesting depth: (item index, item count)


ScriptArg: TypeAlias = str | bytes | int | float


class LayoutError(ValueError):
    """A layout the notation cannot state (a slot after a run of varying width)."""


@dataclass(frozen=True)
class Slot:
    """One header line: a position (`3`, `7i-6`, `5..n+4`, `10..`) and a path."""

    position: str
    path: str


def parse(path: str) -> Path:
    steps: list[Step] = []
    for part in path.split("."):
        mark = next((m for m in ("[]", "?") if part.endswith(m)), "")
        steps.append((part.removesuffix(mark), mark))
    return tuple(steps)


def _text(path: Path) -> str:
    return ".".join(name + mark for name, mark in path)


def _cut(path: Path) -> int | None:
    """Index of the first list or optional step, or None."""
    return next((i for i, (_, mark) in enumerate(path) if mark), None)


def _runs(paths: Sequence[Path]) -> Iterable[tuple[Path, list[Path]]]:
    """Each path on its own, or a run: consecutive paths through the same list or
    optional step, as (the steps up to it, the rest of each path)."""
    i = 0
    while i < len(paths):
        cut = _cut(paths[i])
        if cut is None:
            yield paths[i], []
            i += 1
            continue
        head = paths[i][: cut + 1]
        rest: list[Path] = []
        while i < len(paths) and paths[i][: cut + 1] == head:
            rest.append(paths[i][cut + 1 :])
            i += 1
        yield head, rest


def _get(value: Any, steps: Path) -> Any:
    for name, _mark in steps:
        value = getattr(value, name)
    return value


def flatten(value: Any, paths: Sequence[str]) -> list[Any]:
    """The values `paths` name in `value`, in order; bools as '1' / '0'."""
    out: list[Any] = []
    _flatten(value, _plan(tuple(paths)), out)
    return out


# A compiled walk: per run, its attribute names, its mark ('' a value, '?' optional,
# '[]' a list) and the walk below it. Compiled once per layout: a tick builds a call
# for every held job, every tick.
_Walk: TypeAlias = tuple[tuple[tuple[str, ...], str, "_Walk"], ...]


@cache
def _plan(paths: tuple[str, ...]) -> _Walk:
    return _compile([parse(p) for p in paths])


def _compile(paths: Sequence[Path]) -> _Walk:
    return tuple(
        (tuple(name for name, _ in head), head[-1][1] if rest else "", _compile(rest))
        for head, rest in _runs(paths)
    )


def _flatten(value: Any, walk: _Walk, out: list[Any]) -> None:
    for names, mark, below in walk:
        target = value
        for name in names:
            target = getattr(target, name)
        if not mark:
            out.append(("1" if target else "0") if isinstance(target, bool) else target)
        elif mark == "?":
            if target is not None:
                _flatten(target, below, out)
        else:
            for item in target:
                _flatten(item, below, out)


def top_lists(value: Any, paths: Sequence[str]) -> list[tuple[str, int]]:
    """(path, length) of every list at the top of `paths` (through plain fields only)."""
    return [(text, len(_get(value, head))) for text, head in _top_heads(tuple(paths))]


@cache
def _top_heads(paths: tuple[str, ...]) -> tuple[tuple[str, Path], ...]:
    return tuple(
        (_text(head), head)
        for head, rest in _runs([parse(p) for p in paths])
        if rest and head[-1][1] == "[]" and all(mark == "" for _, mark in head[:-1])
    )


class ScriptCall:
    """A script's KEYS and ARGV, as paths into the fields of the (frozen, keyword-only)
    dataclass that subclasses it; `keys()` and `args()` are the values, in order."""

    SCRIPT: ClassVar[str]  # its name in tokenfleet.lua.SCRIPTS
    KEYS: ClassVar[tuple[str, ...]]
    ARGV: ClassVar[tuple[str, ...]]

    def __post_init__(self) -> None:
        lengths = {n for _, n in top_lists(self, self.KEYS + self.ARGV)}
        if len(lengths) > 1:
            raise ValueError(f"{self.SCRIPT}.lua: its lists must have one length, not {lengths}")

    def keys(self) -> list[str]:
        out = flatten(self, self.KEYS)
        for key in out:
            if not isinstance(key, str):
                raise TypeError(f"{self.SCRIPT}.lua: a key must be a str, not {key!r}")
        return out

    def args(self) -> list[ScriptArg]:
        out = flatten(self, self.ARGV)
        for arg in out:
            if not isinstance(arg, str | bytes | int | float):
                raise TypeError(f"{self.SCRIPT}.lua: an argument may not be {arg!r}")
        return out


def slots(paths: Sequence[str]) -> list[Slot]:
    """The header lines that state `paths`, in order."""
    out: list[Slot] = []
    _render([parse(p) for p in paths], {"": 0}, 0, (), out)
    return out


def _render(
    paths: Sequence[Path], start: Affine | None, depth: int, prefix: Path, out: list[Slot]
) -> Affine | None:
    """Append the slots of `paths`, the first after `start` slots; the count after the
    last, or None when it varies (then nothing may follow)."""
    for head, rest in _runs(paths):
        if start is None:
            raise LayoutError(f"{_text(prefix + head)} follows a run of varying width")
        name = _text(prefix + head)
        first = _plus(start, {"": 1})
        if not rest:
            out.append(Slot(_show(first), name))
            start = first
        elif head[-1][1] == "?":
            members: list[Slot] = []
            end = _render(rest, start, depth, prefix + head, members)
            if end is None:
                raise LayoutError(f"{name} varies in width")
            out += [Slot(f"{_show(first)}..{_show(end)}", name), *members]
            start = None
        else:
            if depth >= len(_LOOPS):
                raise LayoutError(f"{name} nests lists too deep")
            var, count = _LOOPS[depth]
            if rest == [()]:  # scalars, one slot each
                end = _plus(start, {count: 1})
                out.append(Slot(f"{_show(first)}..{_show(end)}", name))
                start = end
                continue
            width = _render(rest, {"": 0}, depth + 1, prefix + head, [])
            if width is not None and set(width) == {""}:  # fixed: item i at w(i-1)
                w = width[""]
                end = _plus(start, {count: w})
                out.append(Slot(f"{_show(first)}..{_show(end)}", name))
                _render(rest, _plus(start, {var: w, "": -w}), depth + 1, prefix + head, out)
                start = end
            elif depth == 0:  # varying: counted from the item's first slot, a
                out.append(Slot(f"{_show(first)}..", name))
                _render(rest, {"a": 1, "": -1}, depth + 1, prefix + head, out)
                start = None
            else:
                raise LayoutError(f"{name} varies in width inside a run")
    return start


def _plus(x: Affine, y: Affine) -> Affine:
    out = dict(x)
    for var, coef in y.items():
        out[var] = out.get(var, 0) + coef
    return {var: coef for var, coef in out.items() if coef or var == ""}


def _show(x: Affine) -> str:
    terms = [
        (f"{'' if c == 1 else '-' if c == -1 else c}{v}", c)
        for v in _VARIABLES
        if (c := x.get(v, 0))
    ]
    if x.get("", 0) or not terms:
        terms.append((str(x.get("", 0)), x.get("", 0)))
    text = terms[0][0]
    for term, coef in terms[1:]:
        text += term if coef < 0 else f"+{term}"
    return text


_SLOT = re.compile(r"^(?:--)?\s*(KEYS|ARGV)\[([^\]\s]+)\]\s+(\S+)")


def header(script: str) -> str:
    """A script's header: its leading comment block."""
    return "\n".join(itertools.takewhile(lambda line: line.startswith("--"), script.splitlines()))


def header_slots(text: str) -> dict[str, list[Slot]]:
    """The KEYS and ARGV lines of a header, or of a block of plain lines (docs):
    {'KEYS': [...], 'ARGV': [...]}, each in order."""
    found: dict[str, list[Slot]] = {"KEYS": [], "ARGV": []}
    for line in text.splitlines():
        if match := _SLOT.match(line.strip()):
            found[match[1]].append(Slot(match[2], match[3]))
    return found
