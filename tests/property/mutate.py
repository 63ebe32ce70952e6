"""Strategies shared by the property tests: arbitrary JSON, and mutations of valid inputs.

A mutation takes something valid (bytes, or a decoded JSON document) and damages it the way the world
does: a flipped bit, a cut-off tail, bytes inserted or deleted, a field removed, a value replaced by
something of another type. What a reader must do with the result is the property under test.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

# Values JSON can hold (finite floats: Python's json writes NaN, but other writers do not).
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=12)

# Adversarial documents the random ones almost never reach: nesting deep enough to hit the recursion limit.
# (Under 64 KiB, so that a size limit does not refuse them first.)
DEEP_ARRAY = b"[" * 50_000
DEEP_OBJECT = b'{"a":' * 5_000 + b"1" + b"}" * 5_000


# --------------------------------------------------------------------------------------------- bytes

@st.composite
def mutated_bytes(draw, original: bytes) -> bytes:
    """`original` with one to three byte-level edits."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "set", "delete", "insert", "truncate", "duplicate"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind == "delete" and data:
            del data[at:at + draw(st.integers(1, 8))]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "truncate":
            del data[at:]
        elif kind == "duplicate" and data:
            data[at:at] = data[at:at + draw(st.integers(1, 16))]
    return bytes(data)


# ---------------------------------------------------------------------------------------------- JSON

def paths(document: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys and indexes) to a value inside `document`, the root excluded."""
    found = []
    items = document.items() if isinstance(document, dict) else enumerate(document) \
        if isinstance(document, list) else ()
    for key, value in items:
        found.append(prefix + (key,))
        found.extend(paths(value, prefix + (key,)))
    return found


@st.composite
def mutated_json(draw, original: Any) -> Any:
    """A deep copy of `original` with one to three structural edits: a value replaced (often by one of
    another type), a key or an item removed, a key added, a list emptied or grown."""
    document = copy.deepcopy(original)
    for _ in range(draw(st.integers(1, 3))):
        where = paths(document)
        if not where:
            return draw(json_values)
        path = draw(st.sampled_from(where))
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        kind = draw(st.sampled_from(["replace", "replace", "remove", "add", "retype"]))
        if kind == "replace":
            parent[key] = draw(json_values)
        elif kind == "retype":
            parent[key] = _retyped(parent[key], draw)
        elif kind == "remove":
            del parent[key]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=10))] = draw(json_values)
        else:
            parent.insert(key, draw(json_values))
    return document


def _retyped(value: Any, draw) -> Any:
    """The same value as another JSON type: "1" for 1, 1.0 for 1, [x] for x, true for 1 ..."""
    options: list[Any] = [[value], str(value), None]
    if isinstance(value, bool):
        options += [int(value), str(value).lower()]
    elif isinstance(value, int):
        options += [float(value), value != 0, -value, value + 1]
    elif isinstance(value, float):
        options += [int(value) if value == value and abs(value) < 1e18 else 0]
    elif isinstance(value, str):
        options += [value.upper(), value + " ", " " + value, value[:-1], value.encode("utf-8", "replace").hex()]
    return draw(st.sampled_from(options))
