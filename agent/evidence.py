"""This node's evidence of a stall, gathered before anything is ended, into ``RUN/incidents/<id>/``.

- ``rank-<r>.fr.json``: each rank's Flight Recorder trace. The agent asks (runtime/flight_recorder.py:
  a request file the ranks' side threads answer) and waits up to the policy's ``evidence_seconds``.
- ``rank-<r>.stack.txt``: each local rank's Python stacks, taken from outside with py-spy, so a rank that
  cooperates with nothing still gives evidence. py-spy needs ptrace rights on the rank (root, or
  CAP_SYS_PTRACE, or the same user with ptrace_scope 0): when it cannot, the file says why.
- ``node-<host>.json``: the node's own signals at that moment, from the collectors the agent runs (GPUs
  lost and XIDs, IB error counters), NCCL WARN and watchdog lines of the ranks' logs with their rank, and
  each rank's last step and record time.

Every file is written on its own, atomically and size-bounded (trainguard/incidents/__init__.py). The node file is
written last and signed with this host's evidence key (derived from the run's checkpoint key, the one that
signs cordons): it names the digest of every rank file gathered, so the verdict uses only evidence this agent
vouches for (`load`: a node file that does not prove its host, or a rank file it did not vouch for, is
ignored, named and counted).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dataclasses import dataclass, field

from trainguard import incidents, rundir, safe_read, signed
from trainguard.agent.collectors.nccl import classify, output_directories
from trainguard.runtime import cordon_key, flight_recorder
from trainguard.runtime.checkpoint import keys

PY_SPY_TIMEOUT = 20.0
LOG_TAIL_BYTES = 256 * 1024
MAX_LOG_LINES = 50
RANK_IN_LINE = re.compile(rb"\[(?:Rank|rank)\s*(\d+)\]|\brank[ =:]+(\d+)")


def py_spy() -> str | None:
    """The py-spy executable: on PATH, beside this Python, or where its wheel put it."""
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found:
        return found
    try:
        for entry in importlib.metadata.distribution("py-spy").files or ():
            if entry.name == "py-spy":
                return str(entry.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    return None


def stacks(pid: int, timeout: float = PY_SPY_TIMEOUT) -> tuple[str | None, str | None]:
    """(py-spy dump of `pid`, None) or (None, why not)."""
    exe = py_spy()
    if exe is None:
        return None, "py-spy is not installed (pip install py-spy)"
    try:
        done = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, timeout=timeout, text=True)
    except subprocess.TimeoutExpired:
        return None, f"py-spy dump --pid {pid} did not finish within {timeout:.0f}s"
    except OSError as exc:
        return None, f"{exe}: {exc.strerror or exc}"
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        hint = " (py-spy needs ptrace: root or CAP_SYS_PTRACE)" if "ermission" in why[0] else ""
        return None, f"py-spy dump --pid {pid}: {why[0]}{hint}"
    return done.stdout, None


def gather(run_dir: Path, incident_id: str, host: str, live: list, agent=None, *,
           wait_seconds: float = 15.0, key_file: str | os.PathLike | None = None) -> dict:
    """Write this node's evidence for `incident_id`; `live` are this node's rank infos (restore.RankInfo).
    `key_file`: the run's checkpoint key (the agent's ``webhook.checkpoint_key_file``), which signs it.

    Returns a summary ({"fr": [ranks dumped], "stacks": [...], "missing": {...}, "signed": bool}) for the
    agent's log.
    """
    flight_recorder.request_dump(run_dir, incident_id)
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(live)))) as pool:
        taken = dict(zip([i.rank for i in live], pool.map(lambda info: stacks(info.pid), live)))
    missing: dict[str, str] = {}
    for rank, (text, why) in sorted(taken.items()):
        if text is None:
            missing[f"rank-{rank}.stack.txt"] = why
        incidents.write_file(run_dir, incident_id, f"rank-{rank}.stack.txt",
                             text if text is not None else f"# no stacks: {why}\n")
    dumped = wait_for_dumps(run_dir, incident_id, [i.rank for i in live], wait_seconds)
    for rank in sorted({i.rank for i in live} - set(dumped)):
        missing[f"rank-{rank}.fr.json"] = f"no answer to the Flight Recorder request within {wait_seconds:.0f}s"
    signals = node_signals(run_dir, host, live, agent)
    signals["missing"] = missing
    key, where = cordon_key.signing_key(key_file, create=True)
    if key is None:     # written for a human to read; the verdict will not use it (named there)
        signals["unsigned"] = f"no checkpoint key to sign it with: {where}"
        incidents.write_json(run_dir, incident_id, incidents.node_file(host), signals)
    else:
        files = vouched(run_dir, incident_id, [i.rank for i in live])
        incidents.write_json(run_dir, incident_id, incidents.node_file(host),
                             incidents.sign_node(key, incident_id, host, signals, files, keys.key_id(key)))
    return {"fr": sorted(dumped), "stacks": sorted(r for r, (t, _) in taken.items() if t), "missing": missing,
            "signed": key is not None}


def vouched(run_dir: Path, incident_id: str, ranks: list[int]) -> dict[str, str]:
    """name -> digest of each of these ranks' stack and Flight Recorder files as they are now."""
    directory = incidents.incidents_dir(run_dir) / incident_id
    out = {}
    for rank in sorted(set(ranks)):
        for name in (f"rank-{rank}.stack.txt", f"rank-{rank}.fr.json"):
            data = _bytes(directory / name)
            if data is not None:
                out[name] = incidents.digest(data)
    return out


def wait_for_dumps(run_dir: Path, incident_id: str, ranks: list[int], seconds: float) -> list[int]:
    directory = incidents.incidents_dir(run_dir) / incident_id
    deadline = time.monotonic() + seconds
    while True:
        dumped = [r for r in ranks if (directory / f"rank-{r}.fr.json").exists()]
        if len(dumped) == len(ranks) or time.monotonic() >= deadline:
            return dumped
        time.sleep(0.2)


def node_signals(run_dir: Path, host: str, live: list, agent=None) -> dict:
    """The node's signals now: hardware from the agent's collectors, NCCL lines, each rank's progress."""
    from trainguard.agent.actions_embedded import last_step

    ranks = {}
    for info in live:
        step, at = last_step(rundir.rank_log(run_dir, info.rank))
        ranks[str(info.rank)] = {"pid": info.pid, "last_step": step, "last_step_at": at,
                                 "started_at": info.started_at, "last_record_at": _mtime(run_dir, info.rank)}
    return {"node": host, "taken_at": time.time(), "ranks": ranks, **hardware(agent),
            "nccl_lines": nccl_lines(run_dir, host, live)}


def hardware(agent) -> dict:
    """XIDs and lost GPUs (the gpu collector), IB counters (the ib collector), when the agent runs them."""
    out: dict = {"xids": [], "gpus_lost": [], "ib": {}}
    if agent is None:
        return out
    fragments = agent.tls_fragments()
    for gpu in (fragments.get("gpu", {}).get("hardware", {}).get("gpus") or ()):
        if gpu.get("lost"):
            out["gpus_lost"].append(gpu.get("gpu"))
        if gpu.get("xid_errors"):
            out["xids"].append({"gpu": gpu.get("gpu"), "xid": gpu.get("last_xid"), "count": gpu["xid_errors"]})
    runner = getattr(agent, "runners", {}).get("gpu")
    collector = getattr(runner, "collector", None)
    codes = getattr(getattr(collector, "xids", None), "last", {}) or {}
    by_pci = {g.pci: g.index for g in getattr(collector, "gpus", ())}
    for entry in out["xids"]:
        entry["xid"] = next((code for pci, code in codes.items() if by_pci.get(pci) == entry["gpu"]), entry["xid"])
    out["ib"] = fragments.get("ib", {}).get("system", {}) or fragments.get("ib", {})
    return out


def nccl_lines(run_dir: Path, host: str | None = None, live: list = ()) -> list[dict]:
    """NCCL WARN / watchdog / backend-error lines at the end of the ranks' logs (RUN/logs), with their rank.

    On a run directory other nodes share, only the logs this node's ranks (`live`) write into, as the nccl
    collector follows them (agent/collectors/nccl.py `RankOutputs`): every node's would be read by every
    agent at an incident, and land in this node's evidence."""
    found = []
    for path in _rank_logs(Path(run_dir), host, live):
        try:
            with safe_read.open_file(path, what="rank output") as handle:
                size = handle.seek(0, os.SEEK_END)
                handle.seek(max(0, size - LOG_TAIL_BYTES))
                lines = handle.read(LOG_TAIL_BYTES).splitlines()
        except OSError:
            continue
        for line in lines:
            kind = classify(line)
            if kind in (None, "init"):
                continue
            match = RANK_IN_LINE.search(line)
            rank = int(next(g for g in match.groups() if g)) if match else None
            found.append({"rank": rank, "kind": kind, "file": str(path.relative_to(run_dir)),
                          "line": line.decode(errors="replace")[:500]})
    return found[-MAX_LOG_LINES:]


def _rank_logs(run_dir: Path, host: str | None, live: list) -> list[Path]:
    logs = rundir.logs_dir(run_dir)
    if host is None or not _shared(run_dir, host):
        return sorted(logs.glob("**/*.log"))
    root = os.path.realpath(logs)
    found = []
    for directory in output_directories(Path("/proc"), [info.pid for info in live]):
        if not directory.startswith(root + os.sep):
            continue        # a rank writing elsewhere (a terminal, a scheduler's file): not RUN/logs
        inside = logs / os.path.relpath(directory, root)     # named under RUN as given (file names relative to it)
        try:
            found += [inside / name for name in os.listdir(directory) if name.endswith(".log")]
        except OSError:
            continue
    return sorted(found)


def _shared(run_dir: Path, host: str) -> bool:
    """Another host registered ranks in this run directory."""
    registrations = rundir.RankFiles(run_dir, {host, socket.gethostname()})
    registrations.read()
    return registrations.others_registered()


def _mtime(run_dir: Path, rank: int) -> float | None:
    try:
        return rundir.rank_log(run_dir, rank).stat().st_mtime
    except OSError:
        return None


# ------------------------------------------------------------------------------ reading it back

@dataclass
class Loaded:
    """An incident's evidence as the verdict's inputs, and what was not used because it proves nothing."""
    ranks: list = field(default_factory=list)       # decide/culprit.RankEvidence
    nodes: list = field(default_factory=list)       # decide/culprit.NodeSignals
    refused: list[dict] = field(default_factory=list)   # {"file", "reason", "why"}: ignored, named, counted

    def __iter__(self):       # `decide(*load(...))`
        return iter((self.ranks, self.nodes))


def load(run_dir: Path, incident_id: str, key: bytes | None) -> Loaded:
    """Every node's evidence of an incident that proves who gathered it: a ``node-<host>.json`` signed with
    `host`'s evidence key (the host is the file's name, checked by the signature, never the file's own
    word), and the rank files it vouches for by digest. `key`: the run's checkpoint key (None: nothing can
    be checked, so nothing is used)."""
    from trainguard.decide.culprit import NodeSignals, RankEvidence

    directory = incidents.incidents_dir(run_dir) / incidents.check_id(incident_id)
    out = Loaded()
    for path in sorted(directory.glob("node-*.json")):
        host = path.name[len("node-"):-len(".json")]
        data = _json(path)
        reason = incidents.check_node(key, incident_id, host, data)
        if reason is not None:
            out.refused.append({"file": path.name, "reason": reason,
                                "why": signed.refusal_message(reason, f"evidence {path.name}")})
            continue
        out.nodes.append(NodeSignals(host, *node_signal_fields(data)))
        files = data.get(incidents.FILES) if isinstance(data.get(incidents.FILES), dict) else {}
        for rank in node_ranks(data):
            fr = _vouched(directory / f"rank-{rank}.fr.json", files, out.refused)
            stack = _vouched(directory / f"rank-{rank}.stack.txt", files, out.refused)
            fr = _parse(fr)
            text = None if stack is None else stack.decode(errors="replace")
            ranks_stack = None if text is None or text.startswith("# no stacks:") else text
            out.ranks.append(RankEvidence(rank, host, fr if isinstance(fr, dict) else None, ranks_stack))
    return out


def _vouched(path: Path, files: dict, refused: list[dict]) -> bytes | None:
    """The file's bytes when the signed node file vouches for exactly them; else None (a changed one named)."""
    data = _bytes(path)
    if data is None:
        return None
    if files.get(path.name) != incidents.digest(data):
        refused.append({"file": path.name, "reason": signed.BAD_SIGNATURE if path.name in files else signed.UNSIGNED,
                        "why": f"evidence {path.name} is not the file its node's signed evidence vouches for"})
        return None
    return data


def _bytes(path: Path) -> bytes | None:
    try:
        return safe_read.read_bytes(path, incidents.MAX_FILE_BYTES, "evidence file")
    except OSError:
        return None


def _parse(data: bytes | None):
    try:
        return None if data is None else json.loads(data)
    except (ValueError, RecursionError):
        return None


MAX_RANK = 2**31 - 1     # torch's ranks are int32


def node_ranks(data: dict) -> list[int]:
    """The ranks a node file lists (``"ranks": {"0": {...}}``, or a list), each an integer 0..MAX_RANK;
    anything else there is left out: a node file is written by whoever can write the run directory, and a
    bad entry must cost the verdict that rank's evidence, never the verdict (a `ranks` of 5, ["x"] or
    {"1e400": ...} was a traceback in the agent's live verdict and in `trainguard incidents replay`)."""
    listed = data.get("ranks")
    found = set()
    for item in listed if isinstance(listed, (dict, list)) else ():
        text = str(item).strip()
        if text.isascii() and text.isdigit() and len(text) <= 10 and int(text) <= MAX_RANK:
            found.add(int(text))
    return sorted(found)


def node_signal_fields(data: dict) -> tuple[tuple, tuple, tuple]:
    """(xids, gpus_lost, nccl_lines) of a node file, each a tuple of entries of the right shape only:
    XIDs and NCCL lines objects, lost GPUs numbers or strings (others are left out, as in `node_ranks`)."""
    def entries(key: str, kinds: tuple[type, ...]) -> tuple:
        value = data.get(key)
        if not isinstance(value, list):
            return ()
        return tuple(v for v in value if isinstance(v, kinds) and not isinstance(v, bool))
    return entries("xids", (dict,)), entries("gpus_lost", (int, str)), entries("nccl_lines", (dict,))


def _json(path: Path):
    return _parse(_bytes(path))
