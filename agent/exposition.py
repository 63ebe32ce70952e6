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


_labels_cache: dict[tuple, str | None] = {}
LABELS_CACHE_MAX = 16384     # distinct label sets remembered (series are bounded: a few thousand at most)


def _labels(labels: dict) -> str | None:
    """`{k="v",...}` sorted as client_python writes it, remembered per label set; None for a non-plain name."""
    key = tuple(labels.items())
    text = _labels_cache.get(key)
    if text is None and key not in _labels_cache:
        if all(_plain(name) for name in labels):
            text = "{" + ",".join(f'{k}="{_escape_value(v)}"' for k, v in sorted(labels.items())) + "}"
        if len(_labels_cache) >= LABELS_CACHE_MAX:
            _labels_cache.clear()
        _labels_cache[key] = text
    return text


def _samples(family: Metric, openmetrics: bool) -> list[str] | None:
    """The family's sample lines, or None if one of them needs client_python's encoder."""
    lines = []
    reserved = () if openmetrics else (family.name + "_created", family.name + "_gsum", family.name + "_gcount")
    for sample in family.samples:
        if sample.timestamp is not None or sample.exemplar or sample.native_histogram or not _plain(sample.name) \
                or sample.name in reserved:
            return None
        labels = _labels(sample.labels) if sample.labels else ""
        if labels is None:
            return None
        lines.append(f"{sample.name}{labels} {floatToGoString(sample.value)}\n")
    return lines


def _block(family: Metric, openmetrics: bool) -> list[str] | None:
    """The family as client_python would write it, or None when only client_python can."""
    if family.type not in SIMPLE_TYPES or not _plain(family.name) or (openmetrics and family.unit):
        return None
    lines = _samples(family, openmetrics)
    if lines is None:
        return None
    if openmetrics:
        header = f"# HELP {family.name} {_escape_value(family.documentation)}\n# TYPE {family.name} {family.type}\n"
    else:
        name = _TEXT_NAME.get(family.type, "{}").format(family.name)
        help_text = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        header = f"# HELP {name} {help_text}\n# TYPE {name} {SIMPLE_TYPES[family.type]}\n"
    lines.insert(0, header)
    return lines


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
    for family in families:
        lines = _block(family, openmetrics)
        if lines is not None:
            out.extend(lines)
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
