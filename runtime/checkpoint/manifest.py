"""The checkpoint manifest: what a checkpoint holds, signed. Pure: dicts and bytes in, verdicts out.

``manifest.json`` names every file of the checkpoint with its SHA-256 and size, the step, the world size,
the versions that wrote it and whether it is *stable*. Its body is serialised canonically (sorted keys,
no whitespace) and signed with HMAC-SHA256; the signature covers everything but itself, so the stable
flag, the step and every hash are as trustworthy as the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard import rundir

# /1: whole files written by rank 0 (model.pt, optim.pt, extra.pt); still verified and restored.
# /2: the tensors through torch.distributed.checkpoint (DCP shards of every rank and its `.metadata`),
#     the rest in extra.pt; `layout` says how to read them.
FORMAT_V1 = "trainguard-checkpoint/1"
FORMAT = "trainguard-checkpoint/2"
FORMATS = (FORMAT_V1, FORMAT)
MANIFEST_NAME = rundir.CHECKPOINT_MANIFEST
ALGORITHM = "HMAC-SHA256"
_SAFE_NAME = re.compile(r"\A(?:[A-Za-z0-9_][A-Za-z0-9_.-]*|\.metadata)\Z")   # DCP names its index .metadata
_HEX64 = re.compile(r"\A[0-9a-f]{64}\Z")

# Why a checkpoint is refused; stable names for scripts (`--json`) and events.
OK = "ok"
MISSING_MANIFEST = "missing_manifest"
UNREADABLE_MANIFEST = "unreadable_manifest"
BAD_SIGNATURE = "bad_signature"
WRONG_KEY = "wrong_key"
STEP_MISMATCH = "step_mismatch"
MISSING_FILE = "missing_file"
SIZE_MISMATCH = "size_mismatch"
HASH_MISMATCH = "hash_mismatch"
UNSAFE_CONTENT = "unsafe_content"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, verified or loaded; `code` is one of the reason codes above
    (or ``"write_failed"``, ``"bad_state"``)."""

    def __init__(self, message: str, *, code: str = "error", path: Path | str | None = None):
        super().__init__(message)
        self.code, self.path = code, path


@dataclass(frozen=True)
class VerifyResult:
    path: Path
    ok: bool
    code: str
    reason: str
    step: int | None = None
    manifest: dict | None = None

    @classmethod
    def refused(cls, path: Path, code: str, reason: str, step: int | None = None) -> "VerifyResult":
        return cls(path, False, code, f"{code.replace('_', ' ')}: {reason}", step)


@dataclass(frozen=True)
class FileEntry:
    name: str
    sha256: str
    bytes: int


def build(*, step: int, files: list[FileEntry], stable: bool, world_size: int, created_at: str,
          versions: dict[str, str], meta: dict | None = None, layout: dict | None = None) -> dict:
    """The unsigned manifest body (format /2 with a `layout`, else /1)."""
    body = {
        "format": FORMAT if layout is not None else FORMAT_V1,
        "step": step,
        "stable": stable,
        "world_size": world_size,
        "created_at": created_at,
        "versions": dict(versions),
        "files": {f.name: {"sha256": f.sha256, "bytes": f.bytes} for f in files},
        "meta": dict(meta or {}),
    }
    if layout is not None:
        body["layout"] = dict(layout)
    return body


def canonical(body: dict) -> bytes:
    """The exact bytes that are signed: re-derived from the parsed JSON on verify, so layout on disk is free."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _mac(body: dict, key: bytes) -> str:
    return hmac.new(key, canonical(body), hashlib.sha256).hexdigest()


def sign(body: dict, key: bytes, key_id: str) -> dict:
    body = {**body, "key_id": key_id}
    return {**body, "signature": {"algorithm": ALGORITHM, "value": _mac(body, key)}}


def encode(manifest: dict) -> bytes:
    return json.dumps(manifest, sort_keys=True, indent=2).encode() + b"\n"


def parse(data: bytes) -> dict:
    """A manifest from its bytes; ValueError says what is wrong with it (and where)."""
    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    except RecursionError:
        raise ValueError("nested too deeply to be a manifest") from None
    if not isinstance(manifest, dict):
        raise ValueError("not a JSON object")
    if manifest.get("format") not in FORMATS:
        raise ValueError(f"format: expected one of {list(FORMATS)}, got {manifest.get('format')!r}")
    if manifest["format"] == FORMAT:
        _expect(manifest, "layout", dict)
    _expect(manifest, "step", int)
    _expect(manifest, "stable", bool)
    _expect(manifest, "world_size", int)
    _expect(manifest, "created_at", str)
    _expect(manifest, "key_id", str)   # the signing key's fingerprint (keys.key_id): names a key mismatch
    signature = _expect(manifest, "signature", dict)
    if signature.get("algorithm") != ALGORITHM or not _HEX64.match(str(signature.get("value"))):
        raise ValueError(f"signature: expected {{'algorithm': {ALGORITHM!r}, 'value': 64 lowercase hex digits}}")
    for name, entry in _expect(manifest, "files", dict).items():
        _check_entry(name, entry)
    try:
        canonical(manifest)  # what check_signature will hash must be serialisable (no absurd nesting)
    except (RecursionError, ValueError) as exc:
        raise ValueError(f"cannot be serialised canonically ({type(exc).__name__})") from None
    return manifest


def _expect(manifest: dict, field: str, kind: type) -> Any:
    value = manifest.get(field)
    # bool is an int in Python; a step of `true` is still wrong.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{field}: expected {kind.__name__}, got {value!r}")
    return value


def _check_entry(name: str, entry: Any) -> None:
    # The signature already vouches for names, but a manifest must never point outside its directory.
    if not _SAFE_NAME.match(name) or name == MANIFEST_NAME:
        raise ValueError(f"files: {name!r} is not a plain file name")
    if not isinstance(entry, dict) or not _HEX64.match(str(entry.get("sha256", ""))):
        raise ValueError(f"files.{name}.sha256: expected 64 lowercase hex digits")
    size = entry.get("bytes")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"files.{name}.bytes: expected a non-negative integer, got {size!r}")


def check_signature(manifest: dict, key: bytes, key_id: str) -> tuple[str, str] | None:
    """None when the signature holds; else (code, reason)."""
    body = {k: v for k, v in manifest.items() if k != "signature"}
    if hmac.compare_digest(_mac(body, key), manifest["signature"]["value"]):
        return None
    if manifest["key_id"] != key_id:
        return WRONG_KEY, (f"signed with key {manifest['key_id']}, the key in use is {key_id} "
                           "(another key file, or a modified manifest)")
    return BAD_SIGNATURE, "manifest.json does not match its signature (modified after it was signed)"


def check_step(manifest: dict, dir_name: str) -> tuple[str, str] | None:
    """A signed checkpoint copied under another step's name is still refused."""
    if dir_name != rundir.step_dir_name(manifest['step']):
        return STEP_MISMATCH, f"directory {dir_name} holds a manifest for step {manifest['step']}"
    return None


def entries(manifest: dict) -> list[FileEntry]:
    return [FileEntry(name, e["sha256"], e["bytes"]) for name, e in sorted(manifest["files"].items())]


def layout(manifest: dict) -> dict:
    """How the files of a checkpoint are read: {} for format /1."""
    return manifest.get("layout", {}) if manifest["format"] == FORMAT else {}
