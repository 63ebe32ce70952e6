"""Grafana's variable substitution, as the dashboards' queries need it, for running them without Grafana."""

from __future__ import annotations

import re

# Grafana's built-in interval variables, at the values Grafana gives them for a short time range.
BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}
VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)(?::\w+)?\}|\$([A-Za-z_]\w*)")


def used_variables(text: str) -> set[str]:
    return {a or b for a, b in VARIABLE.findall(text)} - set(BUILTINS)


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace $var / ${var} with a regex value (as Grafana does for a multi-value variable in =~)."""
    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name in BUILTINS:
            return BUILTINS[name]
        return values[name]
    return VARIABLE.sub(replace, expr)
