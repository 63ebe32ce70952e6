"""A policy key declared beside the component it configures: type, default, range and doc together.

Each component that takes settings from the policy file (a guard rule, the cost meter, the stall rule, the
webhook's ledger, a schedule ...) declares a frozen dataclass of its own keys, as torchtitan's components
declare their configs; trainguard/policy.py assembles the file's sections from these classes and checks a
file against them. A key is a field whose default comes from `key`:

    @dataclass(frozen=True)
    class LossSpikeConfig:
        spike_sigma: float = key(6.0, above(0), "a loss above mean + this many std of the window is a spike")

- the annotation is the type (int, float or str; an int key refuses 2.5, a float key takes 2);
- `check` is the range (`at_least`, `above`, `between`, or `FRACTION`, `SHARE`, `WINDOW`), a `Choice` of
  words, `DURATION` (a Prometheus duration such as 30s) or `ABSOLUTE_PATH`; NaN and infinities never pass a
  range;
- `doc` is one line: docs/policy.md is generated from these (`python -m trainguard.policy`), and
  tests/property/test_policy_doc.py fails when a key is missing there or its default or range differ;
- `alias` names an older dotted key ("alerts.loss_spike_sigma") that means the same number: it is
  accepted, documented, and an error when given beside this key with another value.

A section made of several components' keys (`guard`) is a class that inherits theirs; a nested section
(`cost.tiers`) is a field with ``field(default_factory=...)``. A rule that spans keys of one class is that
class's own ``cross_check(self, where)`` (where: the dotted section), returning the problem or None.
Importing this module costs nothing: no YAML, no numpy.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator

# The metadata key a declared field keeps its Key under.
DECLARED = "trainguard.key"


@dataclass(frozen=True)
class Range:
    """A closed or open interval a number must lie in (always finite: NaN and infinities never pass)."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def problem(self, value: float) -> str | None:
        if not math.isfinite(value):
            return "must be a finite number"
        below = value <= self.low if self.low_open else value < self.low
        above = value >= self.high if self.high_open else value > self.high
        if below or above:
            return f"must be {self.describe()}"
        return None

    def describe(self) -> str:
        low = "" if self.low == -math.inf else f"{'>' if self.low_open else '>='} {self.low:g}"
        high = "" if self.high == math.inf else f"{'<' if self.high_open else '<='} {self.high:g}"
        return " and ".join(part for part in (low, high) if part)


@dataclass(frozen=True)
class Choice:
    """A string key that takes one of a few words."""

    words: tuple[str, ...]

    def check(self, value: Any) -> str:
        if isinstance(value, bool) and {"off", "on"} & set(self.words):
            value = "on" if value else "off"      # YAML reads a bare on / off as true / false
        if not isinstance(value, str) or value not in self.words:
            raise ValueError(f"expected one of {', '.join(self.words)}, got {shown(value)}")
        return value

    def describe(self) -> str:
        return "one of " + ", ".join(self.words)


def at_least(low: float, high: float = math.inf) -> Range:
    return Range(low, high)


def above(low: float, high: float = math.inf) -> Range:
    return Range(low, high, low_open=True)


def between(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Range:
    return Range(low, high, low_open, high_open)


FRACTION = between(0, 1)
SHARE = between(0, 1, low_open=True)          # a ratio where 0 would switch the check off
WINDOW = at_least(1, 10**6)                   # steps held in memory: bounded
DURATION = "duration"                          # a Prometheus duration: 30s, 2m, 1h30m
ABSOLUTE_PATH = "absolute_path"                # a directory named from the root: /dev/shm
# re.match compiles it at the first duration checked (and caches it): the built-in policy checks none
_DURATION = r"^(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?$"
Check = Range | Choice | str


@dataclass(frozen=True)
class Key:
    """What `key` declared about one field: its range (or choice, or DURATION), its doc, its alias."""

    check: Check
    doc: str
    alias: str | None = None

    def describe(self) -> str:
        if self.check == ABSOLUTE_PATH:
            return "an absolute path"
        if isinstance(self.check, str):
            return "a duration (30s, 2m, 1h30m)"
        return self.check.describe() or "any finite number"


def key(default: Any, check: Check, doc: str, *, alias: str | None = None) -> Any:
    """A policy key's field: `default`, what values it takes (`check`), one line of `doc`; see the module."""
    return dataclasses.field(default=default, metadata={DECLARED: Key(check, doc, alias)})


def declared(field: dataclasses.Field[Any]) -> Key | None:
    """The declaration of a field made with `key` (None for a nested section)."""
    found = field.metadata.get(DECLARED)
    return found if isinstance(found, Key) else None


def leaves(section: Any, where: str = "") -> Iterator[tuple[str, Any, Key]]:
    """Every declared key under `section` (a config instance): (dotted name, value, declaration), in order."""
    for field in dataclasses.fields(section):
        name = f"{where}.{field.name}" if where else field.name
        value = getattr(section, field.name)
        declaration = declared(field)
        if declaration is not None:
            yield name, value, declaration
        elif dataclasses.is_dataclass(value):
            yield from leaves(value, name)


def cross_checks(section: Any, where: str = "") -> Iterator[str]:
    """The problems of every `cross_check` that `section`'s classes (each base's own) and its nested
    sections define: a rule spanning several keys (warn <= throttle <= stop)."""
    for kind in reversed(type(section).__mro__):
        check = vars(kind).get("cross_check")
        problem = check(section, where) if check is not None else None
        if problem:
            yield problem
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if declared(field) is None and dataclasses.is_dataclass(value):
            yield from cross_checks(value, f"{where}.{field.name}" if where else field.name)


def parse_duration(value: str) -> float:
    """Seconds of a Prometheus duration (``30s``, ``2m``, ``1h30m``); ValueError if it is not one."""
    match = re.match(_DURATION, value.strip()) if isinstance(value, str) else None
    if not match or not value.strip():
        raise ValueError(f"not a duration (like 30s, 2m, 1h30m): {shown(value)}")
    y, w, d, h, m, sec, ms = (int(g or 0) for g in match.groups())
    return (((y * 365 + w * 7 + d) * 24 + h) * 60 + m) * 60 + sec + ms / 1000


def shown(value: Any) -> str:
    """A value for an error message, bounded: a value from YAML may be huge (aliases repeat a node
    without copying it, and repr would write out every repetition)."""
    import reprlib

    shown = reprlib.Repr()
    shown.maxlevel, shown.maxstring, shown.maxother = 2, 60, 60
    shown.maxlist = shown.maxtuple = shown.maxdict = shown.maxset = 4
    text = shown.repr(value)
    return text if len(text) <= 200 else text[:200] + "…"
