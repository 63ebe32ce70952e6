"""Helpers for tests of collectors: render families as /metrics would, and read an exposition back as values."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

Series = tuple[str, frozenset]          # (sample name, frozenset of (label, value))


def render(families) -> str:
    """The text exposition of these families, from a private registry (nothing else in it)."""
    class Fixed:
        def collect(self):
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed())
    return generate_latest(registry).decode()


def values(source) -> dict[Series, float]:
    """{(name, labels): value} of an exposition text, or of metric families."""
    families = text_string_to_metric_families(source) if isinstance(source, str) else source
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


def series(name: str, **labels: str) -> Series:
    return name, frozenset(labels.items())


def without(text: str, *prefixes: str) -> str:
    """The exposition minus the families whose names start with one of `prefixes` (volatile values)."""
    kept = []
    for line in text.splitlines():
        name = line.split(" ")[2] if line.startswith("# ") else line.split("{")[0].split(" ")[0]
        if not name.startswith(prefixes):
            kept.append(line)
    return "".join(line + "\n" for line in kept)
