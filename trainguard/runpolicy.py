"""The run's own policy, ``RUN/policy.yaml``, used only when it proves who wrote it.

Anyone who can write the run directory can drop a ``policy.yaml`` there; a planted one with a tiny budget
made the agent issue every cost tier and stop the run. So the trainer's rank 0 writes the policy the run
trains with and signs it (``RUN/policy.sig.json``: the SHA-256 of the file's bytes, the run's name, the key's
public id; trainguard/signed.py, purpose ``run-policy/1``, the run's checkpoint key). A reader (the agent when
its own config names no policy, `trainguard replay RUN`) uses the file only when the signature checks with
the key it holds, and reads the policy from the very bytes it checked. Otherwise it uses the defaults, and
says why the file there was not used: nothing that acts takes a policy in silence.

Pure of torch; files and the key are the callers' (trainer/, agent/, the replay command).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard import rundir, safe_read, signed
from trainguard import policy as policy_mod

PURPOSE = "run-policy/1"
MAX_POLICY_BYTES = 1 << 20


@dataclass(frozen=True)
class Choice:
    """The policy a reader uses, where it came from, and why a policy in the run directory was not used."""
    policy: policy_mod.Policy
    path: Path | None          # the file it was read from; None: the defaults
    why: str                   # how it was chosen (and, for the defaults, why RUN/policy.yaml was not used)

    def describe(self) -> str:
        return f"{self.path if self.path is not None else 'defaults'} ({self.why})"


def write(run_dir: str | os.PathLike, policy: policy_mod.Policy, key: bytes, *, key_id: str | None, by: str) -> Path:
    """RUN/policy.yaml holding `policy` (its YAML, as `policy.dump` writes it) and RUN/policy.sig.json signing
    those bytes. Never the bytes found there signed as they are: anyone could have changed them since the
    trainer read its policy."""
    path = rundir.policy_path(run_dir)
    data = policy_mod.dump(policy).encode()
    try:
        same = _read(path) == data
    except (OSError, ValueError):
        same = False
    if not same:
        _replace(path, data)
    record = signed.sign(key, PURPOSE, {"sha256": _digest(data), "run": rundir.run_name(run_dir), "by": by},
                         key_id=key_id)
    _replace(rundir.policy_signature_path(run_dir), (json.dumps(record, indent=1) + "\n").encode())
    return path


def choose(run_dir: str | os.PathLike | None, given: str | os.PathLike | None, key: bytes | None,
           key_where: str = "") -> Choice:
    """`given` (the reader's own config or flag) when there is one; else the run's signed policy when it
    checks with `key`; else the defaults, saying why. PolicyError for a given policy that is not a valid
    policy (the run's, signed but invalid, is named in the why and not used: a run followed never stops
    the agent)."""
    if given is not None:
        return Choice(policy_mod.load(given), Path(given), "given")
    if run_dir is None:
        return Choice(policy_mod.Policy(), None, "no run directory")
    path = rundir.policy_path(run_dir)
    if not os.path.lexists(path):
        return Choice(policy_mod.Policy(), None, f"the run has no {path.name}")
    try:
        data = _read(path)
    except (OSError, ValueError) as exc:
        return Choice(policy_mod.Policy(), None, f"{path} not used: {exc}")
    reason, record = _check(run_dir, data, key)
    if reason is not None:
        why = signed.refusal_message(reason, path.name) if reason in signed.REASONS else reason
        if reason == signed.NO_KEY:
            why += f" ({key_where})"
        return Choice(policy_mod.Policy(), None, f"{path} not used: {why}")
    import yaml   # safe to parse now: these bytes are the ones a key holder signed

    try:
        policy = policy_mod.from_mapping(safe_read.load_yaml(data.decode("utf-8")), str(path))
    except (UnicodeDecodeError, yaml.YAMLError, policy_mod.PolicyError) as exc:
        return Choice(policy_mod.Policy(), None, f"{path} not used: signed, but not a valid policy: {exc}")
    return Choice(policy, path, f"the run's policy, signed by {record.get('by')} (key {record.get(signed.KEY_ID)})")


def _check(run_dir: str | os.PathLike, data: bytes, key: bytes | None) -> tuple[str | None, dict]:
    sig_path = rundir.policy_signature_path(run_dir)
    try:
        record: Any = json.loads(_read(sig_path))
    except FileNotFoundError:
        return f"{sig_path.name} is missing: nobody signed it", {}
    except (OSError, ValueError):
        return signed.UNREADABLE, {}
    reason = signed.check(key, PURPOSE, record, {"run": rundir.run_name(run_dir)})
    if reason is not None:
        return reason, {}
    if record.get("sha256") != _digest(data):
        return "it was changed since it was signed", {}
    return None, record


def _digest(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _read(path: Path) -> bytes:
    """The file's bytes: a regular file (a FIFO or device is named, never opened), at most MAX_POLICY_BYTES."""
    return safe_read.read_bytes(path, MAX_POLICY_BYTES, "policy file")


def _replace(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
