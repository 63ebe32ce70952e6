"""Checking a collector's own config section (`collectors.<name>.*` minus enabled/interval/timeout).

    opts = options(ctx.options, "io", device_exclude=DEFAULT_EXCLUDE, checkpoint_dir=None)

Every key a collector knows is declared with its default, whose type is the type the key must have (None:
any). An unknown key or a value of the wrong type is a ConfigError naming `collectors.<name>.<key>`.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from ..config import ConfigError

# Keys the runner passes to every collector besides its own section (agent/runner.py _shared_options).
SHARED = frozenset({"policy"})


def options(given: Mapping[str, Any], collector: str, **defaults: Any) -> dict[str, Any]:
    given = {key: value for key, value in given.items() if key not in SHARED or key in defaults}
    for key in given:
        if key not in defaults:
            raise ConfigError(f"collectors.{collector}.{key}: unknown option (known: {', '.join(sorted(defaults))})")
    values = dict(defaults)
    for key, value in given.items():
        default = defaults[key]
        if default is not None and value is not None and not _same_type(value, default):
            raise ConfigError(f"collectors.{collector}.{key}: expected {type(default).__name__}, got {value!r}")
        values[key] = value
    return values


def _same_type(value: Any, default: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float))
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    return isinstance(value, type(default))


def regex(value: str | None, collector: str, key: str) -> re.Pattern | None:
    if value is None or value == "":
        return None
    try:
        return re.compile(value)
    except re.error as exc:
        raise ConfigError(f"collectors.{collector}.{key}: not a regular expression: {exc}") from None


class DeviceFilter:
    """node_exporter's device filter: an exclude or an include pattern (not both); matches by re.search as Go does."""

    def __init__(self, collector: str, exclude: str | None, include: str | None, prefix: str = "device"):
        if exclude and include:
            raise ConfigError(f"collectors.{collector}: {prefix}_exclude and {prefix}_include are mutually exclusive")
        self.exclude = regex(exclude, collector, f"{prefix}_exclude")
        self.include = regex(include, collector, f"{prefix}_include")
        self._answers: dict[str, bool] = {}     # device name -> ignored (the same few devices every update)

    def ignored(self, name: str) -> bool:
        answer = self._answers.get(name)
        if answer is None:
            if len(self._answers) >= 4096:     # device names churn (containers' veths): forget, do not grow
                self._answers.clear()
            answer = self._answers[name] = self._matches(name)
        return answer

    def _matches(self, name: str) -> bool:
        if self.exclude is not None and self.exclude.search(name):
            return True
        return self.include is not None and not self.include.search(name)
