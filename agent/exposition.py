"""The /metrics body: client_python's text and OpenMetrics formats, byte for byte, at a fraction of the CPU.

client_python 0.26 escapes every sample name character by character when it writes OpenMetrics, which made
rendering the agent's ~1000 series cost more than all its collectors together. The families here are
simple (gauges, counters, infos; plain names and labels; no timestamps or exemplars), so this writes them
directly; any family it does not handle exactly (histograms, `:` in a name, exemplars, a non-default
escaping asked for in the Accept header) is handed to client_python's own encoder, one family at a time.
tests/agent/test_core_exposition.py holds the output equal to client_python's.
"""

from __future__ import annotations

import re
from functools import lru_cache, partial
from typing import Callable, Iterable

from prometheus_client import exposition as text_format
from prometheus_client.core import Metric
from prometheus_client.openmetrics import exposition as om_format
from prometheus_client.utils import floatToGoString

SIMPLE_TYPES = {"gauge": "gauge", "counter": "counter", "info": "gauge", "unknown": "untyped"}
_TEXT_NAME = {"counter": "{}_total", "info": "{}_info"}
_PLAIN_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


@lru_cache(maxsize=8192)
def _plain(name: str) -> bool:
    """A name both formats write unchanged (client_python rewrites ':' in OpenMetrics sample names)."""
    return _PLAIN_NAME.fullmatch(name) is not None


def _escape_value(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def _simple(family: Metric, openmetrics: bool) -> bool:
    if family.type not in SIMPLE_TYPES or not _plain(family.name) or (openmetrics and family.unit):
        return False
    for sample in family.samples:
        if sample.timestamp is not None or sample.exemplar or sample.native_histogram or not _plain(sample.name):
            return False
        if not openmetrics and sample.name in (family.name + "_created", family.name + "_gsum",
                                               family.name + "_gcount"):
            return False
        for label in sample.labels:
            if not _plain(label):
                return False
    return True


def _samples(family: Metric, out: list[str]) -> None:
    for sample in family.samples:
        if sample.labels:
            labels = ",".join(f'{k}="{_escape_value(v)}"' for k, v in sorted(sample.labels.items()))
            out.append(f"{sample.name}{{{labels}}} {floatToGoString(sample.value)}\n")
        else:
            out.append(f"{sample.name} {floatToGoString(sample.value)}\n")


def _text_block(family: Metric, out: list[str]) -> None:
    name = _TEXT_NAME.get(family.type, "{}").format(family.name)
    help_text = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
    out.append(f"# HELP {name} {help_text}\n# TYPE {name} {SIMPLE_TYPES[family.type]}\n")
    _samples(family, out)


def _openmetrics_block(family: Metric, out: list[str]) -> None:
    out.append(f"# HELP {family.name} {_escape_value(family.documentation)}\n# TYPE {family.name} {family.type}\n")
    _samples(family, out)


class _One:
    """A registry of one family, to hand a family the fast path does not cover to client_python."""

    def __init__(self, family: Metric):
        self.family = family

    def collect(self):
        return [self.family]


def render(families: Iterable[Metric], openmetrics: bool, library: Callable | None = None) -> bytes:
    """The exposition of `families`, as client_python's encoder (`library`) would write it."""
    if library is None:
        library = partial(om_format.generate_latest, escaping=om_format.UNDERSCORES) if openmetrics \
            else text_format.generate_latest
    out: list[str] = []
    block = _openmetrics_block if openmetrics else _text_block
    for family in families:
        if _simple(family, openmetrics):
            block(family, out)
        else:
            text = library(_One(family)).decode()
            out.append(text[: -len("# EOF\n")] if openmetrics else text)
    if openmetrics:
        out.append("# EOF\n")
    return "".join(out).encode()


def encode(registry, accept_header: str) -> tuple[bytes, str]:
    """(body, content type) for a scrape, negotiated from the Accept header as client_python does."""
    encoder, content_type = text_format.choose_encoder(accept_header)
    if encoder is text_format.generate_latest:
        return render(registry.collect(), False, encoder), content_type
    keywords = getattr(encoder, "keywords", {})
    if getattr(encoder, "func", None) is om_format.generate_latest and \
            keywords.get("escaping", om_format.UNDERSCORES) == om_format.UNDERSCORES:
        return render(registry.collect(), True, encoder), content_type
    return encoder(registry), content_type   # an escaping scheme asked for by name: the library's own path
