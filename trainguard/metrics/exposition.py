"""The /metrics body: client_python's text and OpenMetrics formats, byte for byte, at a fraction of the CPU.

client_python 0.26 escapes every sample name character by character when it writes OpenMetrics, which made
rendering the agent's ~1000 series cost more than all its collectors together. The families here are
simple (gauges, counters, infos; plain names and labels; no timestamps or exemplars), so this writes them
directly; any family it does not handle exactly (histograms, `:` in a name, exemplars, a non-default
escaping asked for in the Accept header) is handed to client_python's own encoder, one family at a time.
tests/agent/test_core_exposition.py holds the output equal to client_python's.

Two things keep a scrape cheaper still: a `Labels` set (made once per device by the collectors, see
trainguard/metrics/families.py) carries its own `{k="v"}` text, and the server's `Renderer` reuses the text of every
family whose samples have not changed since the previous scrape.
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


def label_text(labels: dict) -> str | None:
    """`{k="v",...}` sorted as client_python writes it ("" if empty); None for a name client_python must escape."""
    if not labels:
        return ""
    if not all(_plain(name) for name in labels):
        return None
    return "{" + ",".join(f'{k}="{_escape_value(v)}"' for k, v in sorted(labels.items())) + "}"


class Labels(dict):
    """A label set made once (per GPU, disk, rank ...) and shared by its samples, with its text rendered once.

    A plain dict to every reader of the samples; the renderer takes `text` instead of sorting and escaping
    the labels again on each scrape. Treat it as frozen: `text` is what it held when it was made.
    """

    __slots__ = ("text",)

    def __init__(self, names, values):
        super().__init__(zip(names, values))
        self.text = label_text(self)


_labels_cache: dict[tuple, str | None] = {}
LABELS_CACHE_MAX = 16384     # distinct label sets remembered (series are bounded: a few thousand at most)


def _labels(labels: dict) -> str | None:
    """The label text of any label dict: a Labels carries it, others are remembered per label set."""
    if labels.__class__ is Labels:
        return labels.text
    key = tuple(labels.items())
    text = _labels_cache.get(key)
    if text is None and key not in _labels_cache:
        text = label_text(labels)
        if len(_labels_cache) >= LABELS_CACHE_MAX:
            _labels_cache.clear()
        _labels_cache[key] = text
    return text


def _samples(family: Metric, openmetrics: bool) -> list[str] | None:
    """The family's sample lines, or None if one of them needs client_python's encoder."""
    lines = []
    reserved = () if openmetrics else (family.name + "_created", family.name + "_gsum", family.name + "_gcount")
    checked = None     # a family's samples mostly share one name: check it once
    for name, labels, value, timestamp, exemplar, native_histogram in family.samples:
        if timestamp is not None or exemplar or native_histogram:
            return None
        if name != checked:
            if not _plain(name) or name in reserved:
                return None
            checked = name
        text = labels.text if labels.__class__ is Labels else _labels(labels) if labels else ""
        if text is None:
            return None
        lines.append(f"{name}{text} {floatToGoString(value)}\n")
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


def _library(openmetrics: bool) -> Callable:
    return partial(om_format.generate_latest, escaping=om_format.UNDERSCORES) if openmetrics \
        else text_format.generate_latest


def _family_text(family: Metric, openmetrics: bool, library: Callable) -> str:
    lines = _block(family, openmetrics)
    if lines is not None:
        return "".join(lines)
    text = library(_One(family)).decode()
    return text[: -len("# EOF\n")] if openmetrics else text


def render(families: Iterable[Metric], openmetrics: bool, library: Callable | None = None) -> bytes:
    """The exposition of `families`, as client_python's encoder (`library`) would write it."""
    library = library or _library(openmetrics)
    out = [_family_text(family, openmetrics, library) for family in families]
    if openmetrics:
        out.append("# EOF\n")
    return "".join(out).encode()


class Renderer:
    """`render`, reusing the text of each family that is unchanged since the last render in the same format.

    The agent samples every few seconds and may be scraped more often (HA Prometheus pairs, probes), and
    many series hold still between updates (totals, limits, idle devices, error counters), so a family
    whose samples equal those of its namesake last time is not rendered again: its text is a function of
    its name, type, help and samples. (Samples compare as values: 0.0 and -0.0 are one, as for Prometheus.)
    Scrapes may run at once: each builds its own table and the last one to finish keeps it.
    """

    def __init__(self) -> None:
        # format -> {family name: (family, text)} of the last render
        self._last: dict[bool, dict[str, tuple[Metric, str]]] = {False: {}, True: {}}

    def render(self, families: Iterable[Metric], openmetrics: bool, library: Callable | None = None) -> bytes:
        library = library or _library(openmetrics)
        last, now = self._last[openmetrics], {}
        out = []
        for family in families:
            seen = last.get(family.name)
            if seen is not None and _same(seen[0], family):
                text = seen[1]
            else:
                text = _family_text(family, openmetrics, library)
            now[family.name] = (family, text)
            out.append(text)
        self._last[openmetrics] = now
        if openmetrics:
            out.append("# EOF\n")
        return "".join(out).encode()


def _same(before: Metric, family: Metric) -> bool:
    return before is family or (before.samples == family.samples and before.type == family.type and
                                before.documentation == family.documentation and before.unit == family.unit)


def encode(registry, accept_header: str, renderer: Renderer | None = None) -> tuple[bytes, str]:
    """(body, content type) for a scrape, negotiated from the Accept header as client_python does."""
    draw = renderer.render if renderer is not None else render
    encoder, content_type = text_format.choose_encoder(accept_header)
    if encoder is text_format.generate_latest:
        return draw(registry.collect(), False, encoder), content_type
    keywords = getattr(encoder, "keywords", {})
    if getattr(encoder, "func", None) is om_format.generate_latest and \
            keywords.get("escaping", om_format.UNDERSCORES) == om_format.UNDERSCORES:
        return draw(registry.collect(), True, encoder), content_type
    return encoder(registry), content_type   # an escaping scheme asked for by name: the library's own path
