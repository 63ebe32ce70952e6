"""Signed control records: a claim or a cordon in the run directory proves it was written by the job.

Anyone who can write the run directory can create a file there; only a holder of the job's secret can
sign one. A record is a JSON object; its signature is an HMAC-SHA256 over the record's other fields in one
canonical form (sorted keys, no blanks), under a *purpose* ("claim/1", "cordon/1") so that a signature
made for one kind of record never passes as another. `check` also binds a record to where it was found
(the request id of a claim, the host of a cordon): a valid record copied to another name is refused.

Pure: no files, no clock. The callers (agent/executor.py claims, agent/evict.py cordons) read and write.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Mapping

SIGNATURE = "signature"
KEY_ID = "key_id"

# Why a record is refused (the `reason` label of the counters that count refusals).
UNSIGNED = "unsigned"             # no signature at all (forged, or written before records were signed)
BAD_SIGNATURE = "bad_signature"   # signed, but not by this key, or changed since
NOT_BOUND = "not_bound"           # a valid record found under another name (copied)
UNREADABLE = "unreadable"         # not a JSON object
NO_KEY = "no_key"                 # the reader holds no key, so it cannot tell
REASONS = (UNSIGNED, BAD_SIGNATURE, NOT_BOUND, UNREADABLE, NO_KEY)


def canonical(purpose: str, record: Mapping[str, Any]) -> bytes:
    """The bytes signed: the purpose, then every field but the signature, in one canonical JSON form."""
    fields = {k: v for k, v in record.items() if k != SIGNATURE}
    return purpose.encode() + b"\0" + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def signature(key: bytes, purpose: str, record: Mapping[str, Any]) -> str:
    return hmac.new(key, canonical(purpose, record), hashlib.sha256).hexdigest()


def sign(key: bytes, purpose: str, record: Mapping[str, Any], key_id: str | None = None) -> dict[str, Any]:
    """`record` with its signature (and the public id of the key, to name it when another key reads it)."""
    out = {k: v for k, v in record.items() if k != SIGNATURE}
    if key_id is not None:
        out[KEY_ID] = key_id
    out[SIGNATURE] = signature(key, purpose, out)
    return out


def check(key: bytes | None, purpose: str, record: Any, bound: Mapping[str, Any]) -> str | None:
    """None when `record` is signed by `key` for `purpose` and carries the `bound` fields; else the reason."""
    if not isinstance(record, dict):
        return UNREADABLE
    if not isinstance(record.get(SIGNATURE), str):
        return UNSIGNED
    if key is None:
        return NO_KEY
    if not hmac.compare_digest(record[SIGNATURE], signature(key, purpose, record)):
        return BAD_SIGNATURE
    if any(record.get(field) != value for field, value in bound.items()):
        return NOT_BOUND
    return None


def tag(key: bytes, purpose: str, text: str, length: int = 16) -> str:
    """A name part only a key holder can compute (a file a stranger cannot create ahead of time)."""
    return hmac.new(key, purpose.encode() + b"\0name\0" + text.encode(), hashlib.sha256).hexdigest()[:length]


def refusal_message(reason: str, what: str) -> str:
    """Words for a refused record, for logs and for `trainguard status`."""
    return {UNSIGNED: f"{what} is not signed", BAD_SIGNATURE: f"{what} is signed with another key or was changed",
            NOT_BOUND: f"{what} was signed for another name (copied)", UNREADABLE: f"{what} is not readable JSON",
            NO_KEY: f"{what} cannot be checked: no key to check it with"}[reason]
